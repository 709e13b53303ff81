// libFuzzer target: an HTTP request body through parse_request (completions or chat, chosen by
// the first byte), parse_tokenize and parse_detokenize; the same bytes as a chat choice's
// generated text through the tool-call reader, whole and fed in two pieces (cut where the
// second byte says).
// Checks: no crash/UB/exception; an accepted body is a JSON object; an accepted request keeps
// every bound (n in [1, 256], max_tokens >= 1 and set on every completion, logprobs in
// [0, kMaxLogprobs], 1-256-byte stop strings, at most 8 stop ids, chat: a non-empty
// conversation of system / user / assistant / tool turns, tool calls on assistant turns only,
// at most 128 tools with distinct names, a named tool_choice one of them); a refusal is a 400
// whose error object is valid JSON naming a message; the tool-call reader's calls name an
// allowed function with arguments that are a JSON object, and the two-piece reading equals the
// whole one.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string_view>
#include <variant>

#include "base/fuzz_check.h"
#include "nlohmann/json.hpp"
#include "serve/tool_calls.h"
#include "simpler/kernels/sampling.h"
#include "simpler/serve/openai_protocol.h"

namespace {

using simpler::fuzz::check;
using simpler::serve::ApiError;

void check_tools(const simpler::serve::ParsedRequest& p) {
  const simpler::serve::ToolCallPolicy& t = p.tool_calls;
  check(t.names.size() == p.chat_options.tools.size() && t.names.size() <= 128,
        "tools and their names disagree, or more than 128 tools");
  for (size_t i = 0; i < t.names.size(); ++i) {
    for (size_t k = 0; k < i; ++k) check(t.names[k] != t.names[i], "a tool name given twice");
  }
  check(t.choice == simpler::serve::ToolChoice::kNone || !t.names.empty(),
        "a tool_choice other than none without tools");
  check(t.choice != simpler::serve::ToolChoice::kFunction || t.allows(t.function),
        "a named tool_choice that is not one of the tools");
  for (const auto& m : p.messages) {
    check(m.role == "system" || m.role == "user" || m.role == "assistant" || m.role == "tool",
          "an unsupported role accepted");
    check(m.tool_calls.empty() || m.role == "assistant", "tool calls on a non-assistant turn");
  }
}

// The bytes as generated text: calls name allowed functions with object arguments, and a
// reading in two pieces (cut at `cut`) is the whole one.
void check_tool_call_reading(std::string_view text, size_t cut) {
  simpler::serve::ToolCallPolicy policy;
  policy.choice = simpler::serve::ToolChoice::kAuto;
  policy.names = {"f", "get_weather"};
  const simpler::serve::ToolCallPiece whole = simpler::serve::parse_tool_calls(text, policy);
  for (const auto& c : whole.calls) {
    check(policy.allows(c.name), "a call of a function that is not allowed");
    const auto args = nlohmann::json::parse(c.arguments, nullptr, false);
    check(!args.is_discarded() && args.is_object(), "call arguments that are not an object");
  }
  simpler::serve::ToolCallParser parser(&policy);
  cut = std::min(cut, text.size());
  simpler::serve::ToolCallPiece pieces = parser.feed(text.substr(0, cut));
  pieces.append(parser.feed(text.substr(cut)));
  pieces.append(parser.finish());
  check(pieces.content == whole.content && pieces.after == whole.after &&
            pieces.calls.size() == whole.calls.size(),
        "the tool-call reading in two pieces differs from the whole one");
}

void check_error(const ApiError& e) {
  check(e.http_status == 400, "a body was refused with a status other than 400");
  const auto j = nlohmann::json::parse(e.to_json(), nullptr, false);
  check(!j.is_discarded() && j.contains("error") && j["error"]["message"].is_string() &&
            !j["error"]["message"].get<std::string>().empty(),
        "an error object that is not JSON or has no message");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const bool chat = (data[0] & 1) != 0;
  const std::string_view body(reinterpret_cast<const char*>(data) + 1, size - 1);
  auto r = simpler::serve::parse_request(body, chat);
  if (const auto* e = std::get_if<ApiError>(&r)) {
    check_error(*e);
  } else {
    const auto& p = std::get<simpler::serve::ParsedRequest>(r);
    const auto j = nlohmann::json::parse(body, nullptr, false);
    check(!j.is_discarded() && j.is_object(), "accepted a body that is not a JSON object");
    check(p.n >= 1 && p.n <= 256, "n outside [1, 256] accepted");
    check(!p.max_tokens.has_value() || *p.max_tokens >= 1, "max_tokens < 1 accepted");
    check(p.chat || p.max_tokens.has_value(), "a completion without max_tokens (16 by default)");
    check(
        !p.logprobs.has_value() || (*p.logprobs >= 0 && *p.logprobs <= simpler::llm::kMaxLogprobs),
        "logprobs outside [0, kMaxLogprobs] accepted");
    for (const auto& s : p.sampling.stop) {
      check(!s.empty() && s.size() <= 256, "a stop string outside 1-256 bytes accepted");
    }
    check(p.sampling.stop_token_ids.size() <= 8, "more than 8 stop ids accepted");
    if (chat) {
      check(!p.messages.empty(), "an empty conversation accepted");
      check_tools(p);
    }
  }
  check_tool_call_reading(body, size > 1 ? data[1] : 0);
  auto t = simpler::serve::parse_tokenize(body);
  if (const auto* e = std::get_if<ApiError>(&t)) check_error(*e);
  auto d = simpler::serve::parse_detokenize(body);
  if (const auto* e = std::get_if<ApiError>(&d)) {
    check_error(*e);
  } else {
    for (int64_t id : std::get<simpler::serve::DetokenizeRequest>(d).tokens) {
      check(id >= 0 && id <= INT32_MAX, "a token id outside [0, 2^31) accepted");
    }
  }
  return 0;
}
