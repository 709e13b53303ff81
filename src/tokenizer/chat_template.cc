#include "simpler/tokenizer/chat_template.h"

#include <openssl/evp.h>

#include <filesystem>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "simpler/base/file.h"
#include "simpler/base/json.h"
#include "simpler/base/status.h"

namespace simpler::llm {

namespace {

// Python's str.lstrip / rstrip / strip with a set of characters.
std::string_view lstrip(std::string_view s, char c) {
  while (!s.empty() && s.front() == c) s.remove_prefix(1);
  return s;
}
std::string_view rstrip(std::string_view s, char c) {
  while (!s.empty() && s.back() == c) s.remove_suffix(1);
  return s;
}
std::string_view strip(std::string_view s, char c) { return rstrip(lstrip(s, c), c); }

// Python's s.split(sep)[0] and s.split(sep)[-1].
std::string_view before_first(std::string_view s, std::string_view sep) {
  const size_t at = s.find(sep);
  return at == std::string_view::npos ? s : s.substr(0, at);
}
std::string_view after_last(std::string_view s, std::string_view sep) {
  const size_t at = s.rfind(sep);
  return at == std::string_view::npos ? s : s.substr(at + sep.size());
}

// Qwen3's template (tokenizer_config.json of Qwen/Qwen3-*), the branch without tools, step for
// step: the Jinja source is in the comments.
std::string render_qwen3(const std::vector<ChatMessage>& messages,
                         const ChatRenderOptions& options) {
  std::string out;
  const int64_t n = static_cast<int64_t>(messages.size());
  // {%- if messages[0].role == 'system' %} '<|im_start|>system\n' + content + '<|im_end|>\n'
  if (messages[0].role == "system") {
    absl::StrAppend(&out, "<|im_start|>system\n", messages[0].content, "<|im_end|>\n");
  }
  // ns.last_query_index: the last user message that is not a tool response wrapper.
  bool multi_step_tool = true;
  int64_t last_query_index = n - 1;
  for (int64_t index = n - 1; index >= 0; --index) {
    const ChatMessage& m = messages[index];
    if (multi_step_tool && m.role == "user" &&
        !(absl::StartsWith(m.content, "<tool_response>") &&
          absl::EndsWith(m.content, "</tool_response>"))) {
      multi_step_tool = false;
      last_query_index = index;
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    const ChatMessage& m = messages[i];
    if (m.role == "user" || (m.role == "system" && i != 0)) {
      absl::StrAppend(&out, "<|im_start|>", m.role, "\n", m.content, "<|im_end|>\n");
    } else if (m.role == "assistant") {
      std::string_view content = m.content;
      std::string_view reasoning;
      if (m.reasoning_content.has_value()) {
        reasoning = *m.reasoning_content;
      } else if (absl::StrContains(m.content, "</think>")) {
        content = lstrip(after_last(m.content, "</think>"), '\n');
        reasoning =
            lstrip(after_last(rstrip(before_first(m.content, "</think>"), '\n'), "<think>"), '\n');
      }
      if (i > last_query_index && (i == n - 1 || !reasoning.empty())) {
        out += "<|im_start|>" + m.role + "\n<think>\n";
        out += strip(reasoning, '\n');
        out += "\n</think>\n\n";
        out += lstrip(content, '\n');
      } else {
        out += "<|im_start|>" + m.role + "\n";
        out += content;
      }
      out += "<|im_end|>\n";
    }
  }
  if (options.add_generation_prompt) {
    out += "<|im_start|>assistant\n";
    if (options.enable_thinking.has_value() && !*options.enable_thinking) {
      out += "<think>\n\n</think>\n\n";
    }
  }
  return out;
}

}  // namespace

std::string sha256_hex(std::string_view bytes) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  EVP_Digest(bytes.data(), bytes.size(), digest, &len, EVP_sha256(), nullptr);
  static constexpr char kHex[] = "0123456789abcdef";
  std::string hex;
  hex.reserve(2 * len);
  for (unsigned int i = 0; i < len; ++i) {
    hex.push_back(kHex[digest[i] >> 4]);
    hex.push_back(kHex[digest[i] & 15]);
  }
  return hex;
}

absl::StatusOr<ChatTemplate> ChatTemplate::from_text(const std::string& template_text) {
  std::string digest = sha256_hex(template_text);
  if (digest == kQwen3ChatTemplateSha256) return ChatTemplate("qwen3", std::move(digest));
  return absl::UnimplementedError(absl::StrCat(
      "the model's chat template (SHA-256 ", digest,
      ") is not one simpler renders; known: Qwen3's (SHA-256 ", kQwen3ChatTemplateSha256,
      "). Chat is unavailable for this model; completions still work"));
}

absl::StatusOr<ChatTemplate> ChatTemplate::load(const std::string& model_dir) {
  const std::string path = (std::filesystem::path(model_dir) / "tokenizer_config.json").string();
  SIMPLER_ASSIGN_OR_RETURN(std::string text, base::read_regular_file(path));
  SIMPLER_ASSIGN_OR_RETURN(nlohmann::json config, base::parse_json_bounded(text, path));
  if (!config.is_object() || !config.contains("chat_template")) {
    return absl::NotFoundError(absl::StrCat(path, " has no \"chat_template\""));
  }
  const nlohmann::json& t = config["chat_template"];
  if (!t.is_string()) {
    return absl::UnimplementedError(absl::StrCat(
        path, ": \"chat_template\" is not a string (named templates are not supported)"));
  }
  absl::StatusOr<ChatTemplate> known = from_text(t.get<std::string>());
  if (!known.ok()) return base::annotate(known.status(), path + ": ");
  return known;
}

absl::StatusOr<std::string> ChatTemplate::render(const std::vector<ChatMessage>& messages,
                                                 const ChatRenderOptions& options) const {
  if (messages.empty()) return absl::InvalidArgumentError("messages is empty");
  for (size_t i = 0; i < messages.size(); ++i) {
    const ChatMessage& m = messages[i];
    if (m.role != "system" && m.role != "user" && m.role != "assistant") {
      return absl::InvalidArgumentError(
          absl::StrCat("messages[", i, "].role '", m.role.substr(0, 40),
                       "' is not supported (system, user or assistant)"));
    }
    if (m.reasoning_content.has_value() && m.role != "assistant") {
      return absl::InvalidArgumentError(absl::StrCat(
          "messages[", i, "].reasoning_content is only allowed on assistant messages"));
    }
  }
  return render_qwen3(messages, options);
}

}  // namespace simpler::llm
