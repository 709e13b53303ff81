// The OpenAI-compatible HTTP API's request and response shapes (OpenAI's API reference for
// /v1/completions and /v1/chat/completions, tools and tool calls included, with vLLM's
// extensions top_k, min_p, repetition_penalty, stop_token_ids, ignore_eos, min_tokens and
// chat_template_kwargs), as
// pure functions: a request body becomes a ParsedRequest or an ApiError, never an exception;
// responses, stream chunks, errors and Prometheus metrics are rendered to text. No I/O and no
// engine: the server (openai_server.h) and the libFuzzer target
// (openai_protocol_fuzz.cc) call these. Thread-safe (pure).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "nlohmann/json.hpp"
#include "simpler/engine/llm_engine.h"
#include "simpler/engine/metrics.h"
#include "simpler/tokenizer/chat_template.h"

namespace simpler::serve {

// OpenAI's error object: {"error": {"message", "type", "param", "code"}} with an HTTP status.
struct ApiError {
  int http_status = 400;
  std::string message;
  std::string type = "invalid_request_error";
  std::string param;  // empty: null
  std::string code;   // empty: null
  std::string to_json() const;
};

ApiError bad_request(std::string message, std::string param = {});

// Bounds on what a body may hold (each refused with 400 past it, naming the field).
struct RequestLimits {
  int64_t max_n = 256;            // choices per request
  int64_t max_stop_strings = 16;  // `stop` entries
  int64_t max_stop_string_bytes = 256;
  int64_t max_prompt_ids = 1 << 20;  // token ids in an array prompt
  int64_t max_messages = 1024;
  int64_t max_tools = 128;  // `tools` entries
  int32_t max_json_depth = 16;
};

// A chat request's `tool_choice`: which tool calls its output may hold. kNone: the tools are
// still rendered into the prompt (vLLM's default) and the output is plain content. kAuto (the
// default when there are tools): calls of any of the tools. kRequired: the same, meant to hold
// at least one; kFunction: calls of that one function only. Decoding is not constrained yet:
// under kRequired or kFunction an output without a valid call is returned as plain content.
enum class ToolChoice : uint8_t { kNone, kAuto, kRequired, kFunction };

// What a chat request's output may call. Plain value; thread-compatible.
struct ToolCallPolicy {
  ToolChoice choice = ToolChoice::kNone;
  std::string function;            // kFunction: its name (one of `names`)
  std::vector<std::string> names;  // the tools' function names, in request order
  bool parallel = true;            // parallel_tool_calls: false keeps the first call only
  // Whether the output is parsed for tool calls at all.
  bool parses() const { return choice != ToolChoice::kNone && !names.empty(); }
  // Whether a call of `name` is a valid call under this policy.
  bool allows(std::string_view name) const;
};

// The max_tokens of a /v1/completions body that gives none: OpenAI's default.
inline constexpr int64_t kDefaultCompletionMaxTokens = 16;

// A validated /v1/completions or /v1/chat/completions body. Values are type-checked and
// structurally checked here; ranges the engine knows (temperature, top_p, penalties, the
// prompt against the context and the KV pool) are checked by LlmEngine::add_request, whose
// INVALID_ARGUMENT the server returns as 400.
struct ParsedRequest {
  bool chat = false;
  std::string model;
  // Completions: the prompt as text or as token ids.
  std::variant<std::string, std::vector<int64_t>> prompt;
  // Chat: the conversation and the template options (chat_template_kwargs, and `tools`: each
  // tool as the client sent it, keys in its order, rendered with the template's tojson).
  std::vector<llm::ChatMessage> messages;
  llm::ChatRenderOptions chat_options;
  ToolCallPolicy tool_calls;  // chat: tool_choice, the tools' names and parallel_tool_calls
  // max_tokens, or chat's max_completion_tokens. Completions without it get
  // kDefaultCompletionMaxTokens (OpenAI's default); chat without it has none here, and the
  // server runs it to the room left in the context (LlmEngine::max_tokens_for), as vLLM does.
  std::optional<int64_t> max_tokens;
  int32_t n = 1;
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage
  bool echo = false;           // completions only
  // Completions: `logprobs` N (top alternatives). Chat: `logprobs` true with `top_logprobs` N.
  // A completion with `echo` and `logprobs` also asks the engine for the prompt's logprobs
  // (RequestSampling::prompt_logprobs = N), listed before the output's as vLLM lists them.
  std::optional<int32_t> logprobs;
  llm::RequestSampling sampling;
};

// Parses and validates a body. `chat` selects the endpoint's shape. Errors: 400 with the field
// in `param` (invalid JSON or UTF-8, too deep, wrong types, unknown fields — OpenAI refuses
// "unrecognized request arguments" —, response_format other than text, n < 1, negative or
// non-integer counts, max_tokens < 1).
//
// Chat with tools: `tools` is an array of {"type": "function", "function": {"name",
// "description"?, "parameters"? (an object: a JSON Schema), "strict"?}}, names OpenAI's
// (1 to 64 of a-z A-Z 0-9 _ -) and distinct; `tool_choice` is "none", "auto", "required" or
// {"type": "function", "function": {"name": N}} with N one of the tools (400 naming it
// otherwise; anything but "none" needs tools); `parallel_tool_calls` a boolean. Messages may
// have the role "tool" (content and a string tool_call_id) and assistant messages
// `tool_calls` ([{"id", "type": "function", "function": {"name", "arguments"}}], arguments a
// string) with a null or absent content (rendered as ""). Arguments that parse as JSON are
// rendered with tojson (vLLM parses them too); others, and "" as {}, as they are. Errors in
// messages name "messages", in tools "tools", in tool_choice "tool_choice".
std::variant<ParsedRequest, ApiError> parse_request(std::string_view body, bool chat,
                                                    const RequestLimits& limits = {});

// /tokenize and /detokenize bodies (vLLM's shapes).
struct TokenizeRequest {
  std::string model;  // empty when the body names none (the server answers 404 for another)
  std::optional<std::string> prompt;
  std::vector<llm::ChatMessage> messages;  // when `messages` is given
  llm::ChatRenderOptions chat_options;     // with `tools`, checked as parse_request does
  bool add_special_tokens = true;          // accepted; Qwen3 adds none
};
std::variant<TokenizeRequest, ApiError> parse_tokenize(std::string_view body,
                                                       const RequestLimits& limits = {});
struct DetokenizeRequest {
  std::string model;            // as TokenizeRequest's
  std::vector<int64_t> tokens;  // each in [0, 2^31); the server checks them against the vocabulary
};
std::variant<DetokenizeRequest, ApiError> parse_detokenize(std::string_view body,
                                                           const RequestLimits& limits = {});

// Prometheus text exposition format (version 0.0.4) of the engine's metrics, names prefixed
// "simpler:" as vLLM prefixes "vllm:"; histograms with cumulative _bucket{le=...}, _sum and
// _count; `model_name` labels every series.
std::string prometheus_text(const llm::EngineMetrics& m, const std::string& model_name);

}  // namespace simpler::serve
