#include "serve/tool_calls.h"

#include <algorithm>
#include <utility>

#include "absl/strings/ascii.h"
#include "simpler/base/json.h"
#include "simpler/tokenizer/chat_template.h"

namespace simpler::serve {

namespace {

using json = nlohmann::json;
using ojson = nlohmann::ordered_json;

// The nesting a call's JSON may have (its arguments' JSON Schema allows no more in practice).
constexpr int kMaxCallDepth = 32;

bool is_space(char c) { return absl::ascii_isspace(static_cast<unsigned char>(c)); }

std::string_view trim_space(std::string_view s) {
  while (!s.empty() && is_space(s.front())) s.remove_prefix(1);
  while (!s.empty() && is_space(s.back())) s.remove_suffix(1);
  return s;
}

// The length of the longest suffix of `s` that is a proper prefix of `tag`, with the
// whitespace before it when `with_space`: what must wait for more text.
size_t undecided_suffix(std::string_view s, std::string_view tag, bool with_space) {
  size_t hold = 0;
  for (size_t k = std::min(s.size(), tag.size() - 1); k > 0; --k) {
    if (s.substr(s.size() - k) == tag.substr(0, k)) {
      hold = k;
      break;
    }
  }
  while (with_space && hold < s.size() && is_space(s[s.size() - hold - 1])) ++hold;
  return hold;
}

}  // namespace

// Where text read now goes: after the piece's calls when it has some.
std::string& text_of(ToolCallPiece& out) { return out.calls.empty() ? out.content : out.after; }

void ToolCallPiece::append(ToolCallPiece more) {
  std::string& text = calls.empty() && after.empty() ? content : after;
  text += more.content;
  for (ParsedToolCall& c : more.calls) calls.push_back(std::move(c));
  after += more.after;
}

std::optional<ParsedToolCall> parse_one_call(std::string_view text, const ToolCallPolicy& policy) {
  absl::StatusOr<ojson> call =
      base::parse_ordered_json_bounded(trim_space(text), "tool call", kMaxCallDepth);
  if (!call.ok() || !call->is_object()) return std::nullopt;
  const auto name = call->find("name");
  const auto arguments = call->find("arguments");
  if (name == call->end() || !name->is_string() || arguments == call->end() ||
      !arguments->is_object() || !policy.allows(name->get_ref<const std::string&>())) {
    return std::nullopt;
  }
  return ParsedToolCall{name->get<std::string>(), llm::python_json_dumps(*arguments)};
}

void ToolCallParser::end_call(std::string_view body, bool closed, ToolCallPiece& out) {
  std::optional<ParsedToolCall> call = parse_one_call(body, *policy_);
  if (call) {
    space_before_call_.clear();
    out.calls.push_back(*std::move(call));
    ++calls_;
    state_ = policy_->parallel ? State::kBetweenCalls : State::kDone;
    return;
  }
  std::string& text = text_of(out);
  text += space_before_call_;
  text += kToolCallOpen;
  text += body;
  if (closed) text += kToolCallClose;
  state_ = State::kPlain;
}

bool ToolCallParser::step(ToolCallPiece& out) {
  switch (state_) {
    case State::kContent:
    case State::kBetweenCalls: {
      const bool content = state_ == State::kContent;
      const size_t open = buffer_.find(kToolCallOpen);
      if (open == std::string::npos) {
        const size_t hold = undecided_suffix(buffer_, kToolCallOpen, content);
        if (content) out.content.append(buffer_, 0, buffer_.size() - hold);
        buffer_.erase(0, buffer_.size() - hold);
        return false;
      }
      space_before_call_.clear();
      if (content) {
        std::string_view before(buffer_.data(), open);
        size_t text = before.size();
        while (text > 0 && is_space(before[text - 1])) --text;
        out.content += before.substr(0, text);
        space_before_call_ = before.substr(text);
      }
      buffer_.erase(0, open + kToolCallOpen.size());
      state_ = State::kInCall;
      return true;
    }
    case State::kInCall: {
      const size_t close = buffer_.find(kToolCallClose);
      if (close == std::string::npos) return false;
      const std::string rest = buffer_.substr(close + kToolCallClose.size());
      end_call(std::string_view(buffer_.data(), close), /*closed=*/true, out);
      buffer_ = rest;
      return true;
    }
    case State::kPlain:
      text_of(out) += buffer_;
      buffer_.clear();
      return false;
    case State::kDone:
      buffer_.clear();
      return false;
  }
  return false;
}

ToolCallPiece ToolCallParser::feed(std::string_view text) {
  buffer_ += text;
  ToolCallPiece out;
  while (step(out)) {
  }
  return out;
}

ToolCallPiece ToolCallParser::finish() {
  ToolCallPiece out;
  if (state_ == State::kContent || state_ == State::kPlain) {
    out.content = std::move(buffer_);  // a new piece: no calls
  } else if (state_ == State::kInCall) {
    end_call(buffer_, /*closed=*/false, out);
  }
  buffer_.clear();
  state_ = State::kDone;
  return out;
}

ToolCallPiece parse_tool_calls(std::string_view text, const ToolCallPolicy& policy) {
  ToolCallParser parser(&policy);
  ToolCallPiece whole = parser.feed(text);
  whole.append(parser.finish());
  return whole;
}

json chat_message_json(const ToolCallPiece& whole, const ToolCallIds& ids) {
  const std::string content = whole.text();
  json message = {{"role", "assistant"},
                  {"content", content.empty() ? json(nullptr) : json(content)}};
  if (whole.calls.empty()) return message;
  json calls = json::array();
  for (const ParsedToolCall& c : whole.calls) {
    calls.push_back({{"id", ids()},
                     {"type", "function"},
                     {"function", {{"name", c.name}, {"arguments", c.arguments}}}});
  }
  message["tool_calls"] = std::move(calls);
  return message;
}

std::vector<json> tool_call_deltas(const std::vector<ParsedToolCall>& calls, int64_t first_index,
                                   const ToolCallIds& ids) {
  std::vector<json> deltas;
  for (size_t k = 0; k < calls.size(); ++k) {
    const int64_t index = first_index + static_cast<int64_t>(k);
    json open = {{"index", index},
                 {"id", ids()},
                 {"type", "function"},
                 {"function", {{"name", calls[k].name}, {"arguments", ""}}}};
    deltas.push_back({{"tool_calls", json::array({std::move(open)})}});
    json arguments = {{"index", index}, {"function", {{"arguments", calls[k].arguments}}}};
    deltas.push_back({{"tool_calls", json::array({std::move(arguments)})}});
  }
  return deltas;
}

std::vector<json> tool_stream_deltas(ToolCallParser& parser, std::string_view text, bool finished,
                                     bool content_delta, const ToolCallIds& ids) {
  const int64_t first_index = parser.calls();
  ToolCallPiece piece = parser.feed(text);
  if (finished) piece.append(parser.finish());
  std::vector<json> deltas;
  if (!piece.content.empty() || content_delta) deltas.push_back({{"content", piece.content}});
  for (json& d : tool_call_deltas(piece.calls, first_index, ids)) deltas.push_back(std::move(d));
  if (!piece.after.empty()) deltas.push_back({{"content", piece.after}});
  return deltas;
}

std::string tool_finish_reason(bool called, const std::string& engine_reason) {
  return called && (engine_reason == "stop" || engine_reason == "length") ? "tool_calls"
                                                                          : engine_reason;
}

}  // namespace simpler::serve
