#include "simpler/tokenizer/chat_template.h"

#include <openssl/evp.h>

#include <charconv>
#include <cmath>
#include <cstdlib>
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

// Python's repr of a finite double: the shortest digits that round-trip, in exponent form
// (at least two exponent digits, as 1e-05 and 1.5e+16) when the decimal exponent is below -4
// or at least 16, otherwise positional with at least one fraction digit (1.0, 0.0001).
std::string python_float_repr(double d) {
  if (std::isnan(d)) return "NaN";
  if (std::isinf(d)) return d > 0 ? "Infinity" : "-Infinity";
  char buf[64];
  const std::to_chars_result r =
      std::to_chars(buf, buf + sizeof(buf), d, std::chars_format::scientific);
  std::string_view sci(buf, static_cast<size_t>(r.ptr - buf));  // "-1.25e+17", "1e-05"
  std::string out;
  if (sci.front() == '-') {
    out += '-';
    sci.remove_prefix(1);
  }
  const size_t e = sci.find('e');
  std::string digits(1, sci[0]);
  if (e > 1) digits.append(sci.substr(2, e - 2));
  int exponent = 0;
  std::from_chars(sci.data() + e + 1 + (sci[e + 1] == '+'), sci.data() + sci.size(), exponent);
  const int n = static_cast<int>(digits.size());
  if (exponent < -4 || exponent >= 16) {
    absl::StrAppend(&out, digits.substr(0, 1), n > 1 ? "." : "", digits.substr(1), "e",
                    exponent < 0 ? "-" : "+", absl::Dec(std::abs(exponent), absl::kZeroPad2));
  } else if (exponent < 0) {
    absl::StrAppend(&out, "0.", std::string(-exponent - 1, '0'), digits);
  } else if (n <= exponent + 1) {
    absl::StrAppend(&out, digits, std::string(exponent + 1 - n, '0'), ".0");
  } else {
    absl::StrAppend(&out, digits.substr(0, exponent + 1), ".", digits.substr(exponent + 1));
  }
  return out;
}

void append_python_json(const nlohmann::ordered_json& v, std::string& out) {
  using value_t = nlohmann::ordered_json::value_t;
  switch (v.type()) {
    case value_t::object: {
      out += '{';
      bool first = true;
      for (auto it = v.begin(); it != v.end(); ++it) {
        if (!first) out += ", ";
        first = false;
        append_python_json(nlohmann::ordered_json(it.key()), out);
        out += ": ";
        append_python_json(it.value(), out);
      }
      out += '}';
      return;
    }
    case value_t::array: {
      out += '[';
      for (size_t i = 0; i < v.size(); ++i) {
        if (i > 0) out += ", ";
        append_python_json(v[i], out);
      }
      out += ']';
      return;
    }
    case value_t::number_float:
      out += python_float_repr(v.get<double>());
      return;
    default:  // null, booleans, integers and strings print as Python prints them
      out +=
          v.dump(-1, ' ', /*ensure_ascii=*/false, nlohmann::ordered_json::error_handler_t::replace);
      return;
  }
}

// Qwen3's template (tokenizer_config.json of Qwen/Qwen3-*), step for step: the Jinja source is
// in the comments.

// The leading system turn: with tools, '<|im_start|>system\n' + (messages[0].content + '\n\n'
// when it is a system message) + the tools header, each tool's tojson on its own line, the
// footer; without, the leading system message alone.
void render_system(const std::vector<ChatMessage>& messages, const ChatRenderOptions& options,
                   std::string& out) {
  if (options.tools.empty()) {
    if (messages[0].role == "system") {
      absl::StrAppend(&out, "<|im_start|>system\n", messages[0].content, "<|im_end|>\n");
    }
    return;
  }
  out += "<|im_start|>system\n";
  if (messages[0].role == "system") absl::StrAppend(&out, messages[0].content, "\n\n");
  out +=
      "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are "
      "provided with function signatures within <tools></tools> XML tags:\n<tools>";
  for (const nlohmann::ordered_json& tool : options.tools) {
    out += "\n";
    append_python_json(tool, out);
  }
  out +=
      "\n</tools>\n\nFor each function call, return a json object with function name and "
      "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": "
      "<function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n";
}

// ns.last_query_index: the last user message that is not a tool response wrapper.
int64_t last_query_index(const std::vector<ChatMessage>& messages) {
  const int64_t n = static_cast<int64_t>(messages.size());
  for (int64_t index = n - 1; index >= 0; --index) {
    const ChatMessage& m = messages[index];
    if (m.role == "user" && !(absl::StartsWith(m.content, "<tool_response>") &&
                              absl::EndsWith(m.content, "</tool_response>"))) {
      return index;
    }
  }
  return n - 1;
}

// {%- for tool_call in message.tool_calls %}: a newline before each but a first one that
// follows empty content, then <tool_call>\n{"name": "NAME", "arguments": ARGS}\n</tool_call>.
void render_tool_calls(const std::vector<ChatToolCall>& calls, std::string_view content,
                       std::string& out) {
  for (size_t k = 0; k < calls.size(); ++k) {
    if (k > 0 || !content.empty()) out += "\n";
    absl::StrAppend(&out, "<tool_call>\n{\"name\": \"", calls[k].name, "\", \"arguments\": ");
    if (calls[k].arguments.is_string()) {
      out += calls[k].arguments.get_ref<const std::string&>();
    } else {
      append_python_json(calls[k].arguments, out);
    }
    out += "}\n</tool_call>";
  }
}

// An assistant turn: its think block kept only after the last query (and then only for the
// last message or a non-empty reasoning), its content, its tool calls.
void render_assistant(const ChatMessage& m, bool after_last_query, bool last, std::string& out) {
  std::string_view content = m.content;
  std::string_view reasoning;
  if (m.reasoning_content.has_value()) {
    reasoning = *m.reasoning_content;
  } else if (absl::StrContains(m.content, "</think>")) {
    content = lstrip(after_last(m.content, "</think>"), '\n');
    reasoning =
        lstrip(after_last(rstrip(before_first(m.content, "</think>"), '\n'), "<think>"), '\n');
  }
  if (after_last_query && (last || !reasoning.empty())) {
    out += "<|im_start|>" + m.role + "\n<think>\n";
    out += strip(reasoning, '\n');
    out += "\n</think>\n\n";
    out += lstrip(content, '\n');
  } else {
    out += "<|im_start|>" + m.role + "\n";
    out += content;
  }
  render_tool_calls(m.tool_calls, content, out);
  out += "<|im_end|>\n";
}

// A tool message: a <tool_response> block, the first of a run of tool messages opening a user
// turn and the last closing it.
void render_tool(const std::vector<ChatMessage>& messages, size_t i, std::string& out) {
  if (i == 0 || messages[i - 1].role != "tool") out += "<|im_start|>user";
  absl::StrAppend(&out, "\n<tool_response>\n", messages[i].content, "\n</tool_response>");
  if (i + 1 == messages.size() || messages[i + 1].role != "tool") out += "<|im_end|>\n";
}

std::string render_qwen3(const std::vector<ChatMessage>& messages,
                         const ChatRenderOptions& options) {
  std::string out;
  render_system(messages, options, out);
  const int64_t n = static_cast<int64_t>(messages.size());
  const int64_t last_query = last_query_index(messages);
  for (int64_t i = 0; i < n; ++i) {
    const ChatMessage& m = messages[i];
    if (m.role == "user" || (m.role == "system" && i != 0)) {
      absl::StrAppend(&out, "<|im_start|>", m.role, "\n", m.content, "<|im_end|>\n");
    } else if (m.role == "assistant") {
      render_assistant(m, i > last_query, i == n - 1, out);
    } else if (m.role == "tool") {
      render_tool(messages, static_cast<size_t>(i), out);
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

std::string python_json_dumps(const nlohmann::ordered_json& value) {
  std::string out;
  append_python_json(value, out);
  return out;
}

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
      ") is not one simpler renders; known: Qwen3's (SHA-256 ", kQwen3ChatTemplateSha256, ")"));
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
    if (m.role != "system" && m.role != "user" && m.role != "assistant" && m.role != "tool") {
      return absl::InvalidArgumentError(
          absl::StrCat("messages[", i, "].role '", m.role.substr(0, 40),
                       "' is not supported (system, user, assistant or tool)"));
    }
    if (m.reasoning_content.has_value() && m.role != "assistant") {
      return absl::InvalidArgumentError(absl::StrCat(
          "messages[", i, "].reasoning_content is only allowed on assistant messages"));
    }
    if (!m.tool_calls.empty() && m.role != "assistant") {
      return absl::InvalidArgumentError(
          absl::StrCat("messages[", i, "].tool_calls is only allowed on assistant messages"));
    }
  }
  return render_qwen3(messages, options);
}

}  // namespace simpler::llm
