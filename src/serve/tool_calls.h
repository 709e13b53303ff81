// Qwen3's tool calls in a chat choice's generated text, and the response shapes they take.
//
// Qwen3 writes each call as <tool_call>\n{"name": NAME, "arguments": {...}}\n</tool_call> (the
// format its chat template asks for, which vLLM's hermes parser reads). A call is valid when
// the text between its tags, whitespace around it trimmed, is one JSON object whose "name" is a
// function the request's ToolCallPolicy allows and whose "arguments" is an object; its
// arguments are returned as a JSON string written as Python's json.dumps writes it (key order
// kept: what vLLM returns, and what the chat template renders back). A choice's text splits so:
//   * text before the first valid call is content, without the whitespace just before it;
//   * each valid call is a tool call; text between and after valid calls is dropped (vLLM);
//     with parallel_tool_calls false, everything after the first valid call is dropped;
//   * the first call that is not valid (malformed JSON, no name or one not allowed, arguments
//     not an object) and everything after it are content, as generated: no tool call is ever
//     made up, and no output is refused;
//   * a call still open when the generation ends counts when its text is a valid call, and is
//     content otherwise.
// Streamed and whole, the readings agree: the pieces ToolCallParser returns for any split of a
// text add up to what parse_tool_calls returns for the whole.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "nlohmann/json.hpp"
#include "simpler/serve/openai_protocol.h"

namespace simpler::serve {

inline constexpr std::string_view kToolCallOpen = "<tool_call>";
inline constexpr std::string_view kToolCallClose = "</tool_call>";

struct ParsedToolCall {
  std::string name;
  std::string arguments;  // JSON text of an object
};

// What may be sent for the text read so far, in the order generated: content, the calls
// completed, then content after them (only after a call that was not valid).
struct ToolCallPiece {
  std::string content;
  std::vector<ParsedToolCall> calls;
  std::string after;
  // `more` read after this piece, added in order.
  void append(ToolCallPiece more);
  // All of the content, as one message holds it.
  std::string text() const { return content + after; }
};

// Reads one choice's generated text as it arrives. Text that may still turn out to open a call
// (a prefix of "<tool_call>", with the whitespace before it) is held back until it is decided,
// and a call's text until its closing tag. Borrows `policy`, which must outlive it.
// Thread-compatible.
class ToolCallParser {
 public:
  explicit ToolCallParser(const ToolCallPolicy* policy) : policy_(policy) {}

  // The next generated text; returns what is decided by it.
  ToolCallPiece feed(std::string_view text);
  // The end of the generation: the rest (held-back text, a call left open). Call once, last.
  ToolCallPiece finish();
  // Valid calls returned so far.
  int64_t calls() const { return calls_; }

 private:
  enum class State : uint8_t { kContent, kInCall, kBetweenCalls, kPlain, kDone };
  // One step over buffer_; false when it needs more text.
  bool step(ToolCallPiece& out);
  // Ends the call whose text is `body`: a call, or (not valid) content from here on.
  void end_call(std::string_view body, bool closed, ToolCallPiece& out);

  const ToolCallPolicy* policy_;
  State state_ = State::kContent;
  std::string buffer_;             // read, not yet decided
  std::string space_before_call_;  // the whitespace before the open call (content if it fails)
  int64_t calls_ = 0;
};

// The whole text at once: feed(text) and finish() of a new parser, added up.
ToolCallPiece parse_tool_calls(std::string_view text, const ToolCallPolicy& policy);

// The call `text` holds (between its tags) when it is a valid call under `policy`.
std::optional<ParsedToolCall> parse_one_call(std::string_view text, const ToolCallPolicy& policy);

// Makes a tool call id ("call_..."), unique in the process.
using ToolCallIds = std::function<std::string()>;

// A non-streamed chat choice's "message": {"role": "assistant", "content": the piece's text
// or null (when empty), "tool_calls": [{"id", "type": "function", "function": {"name",
// "arguments"}}] (only when there are calls)}.
nlohmann::json chat_message_json(const ToolCallPiece& whole, const ToolCallIds& ids);

// The stream deltas of `calls`, the first numbered `first_index` in the choice: per call one
// opening it ({"tool_calls": [{"index", "id", "type": "function", "function": {"name",
// "arguments": ""}}]}), then one with its arguments ({"tool_calls": [{"index", "function":
// {"arguments"}}]}), as OpenAI streams them.
std::vector<nlohmann::json> tool_call_deltas(const std::vector<ParsedToolCall>& calls,
                                             int64_t first_index, const ToolCallIds& ids);

// The deltas of one streamed event of a chat choice read for tool calls, in order: a content
// delta ({"content": ...}) when the event decided some content or `content_delta` asks for one
// (to carry the event's logprobs), the deltas of the calls it completed (tool_call_deltas,
// numbered on from the parser's earlier calls), then a content delta of the text after them.
// `finished`: the generation's last event (the parser is finished with it).
std::vector<nlohmann::json> tool_stream_deltas(ToolCallParser& parser, std::string_view text,
                                               bool finished, bool content_delta,
                                               const ToolCallIds& ids);

// A chat choice's finish_reason: "tool_calls" when it made a call and ended by a stop or its
// length, else the engine's reason.
std::string tool_finish_reason(bool called, const std::string& engine_reason);

}  // namespace simpler::serve
