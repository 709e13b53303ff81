#include "simpler/serve/openai_protocol.h"

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <limits>
#include <set>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "simpler/base/enum_names.h"
#include "simpler/base/json.h"
#include "simpler/grammar/gbnf.h"
#include "simpler/grammar/json_schema.h"
#include "simpler/grammar/regex.h"
#include "simpler/kernels/sampling.h"

namespace simpler::serve {

using json = nlohmann::json;
using ojson = nlohmann::ordered_json;

bool ToolCallPolicy::allows(std::string_view name) const {
  if (choice == ToolChoice::kNone) return false;
  if (choice == ToolChoice::kFunction) return name == function;
  return std::find(names.begin(), names.end(), name) != names.end();
}

std::string ApiError::to_json() const {
  json e = {{"message", message},
            {"type", type},
            {"param", param.empty() ? json(nullptr) : json(param)},
            {"code", code.empty() ? json(nullptr) : json(code)}};
  return base::dump_replacing(json{{"error", e}});
}

ApiError bad_request(std::string message, std::string param) {
  ApiError e;
  e.http_status = 400;
  e.message = std::move(message);
  e.param = std::move(param);
  return e;
}

namespace {

// The other types (the three number types, binary, discarded) are named "a number".
constexpr base::EnumNames<json::value_t> kTypeNames = {{json::value_t::null, "null"},
                                                       {json::value_t::boolean, "a boolean"},
                                                       {json::value_t::string, "a string"},
                                                       {json::value_t::array, "an array"},
                                                       {json::value_t::object, "an object"}};

const char* type_name(const json& v) { return kTypeNames.c_name(v.type(), "a number"); }

// Typed field readers: each returns an ApiError naming the field on a wrong type.
struct Reader {
  const json& body;
  std::optional<ApiError> error;

  bool has(const char* key) const { return body.contains(key) && !body[key].is_null(); }
  void fail(std::string msg, std::string param) {
    if (!error) error = bad_request(std::move(msg), std::move(param));
  }
  // The field as a T when `is` holds for it (`want` names the type in the error).
  template <typename T>
  std::optional<T> typed(const char* key, bool (json::*is)() const noexcept, const char* want) {
    if (!has(key)) return std::nullopt;
    if (!(body[key].*is)()) {
      fail(absl::StrCat("'", key, "' must be ", want, ", got ", type_name(body[key])), key);
      return std::nullopt;
    }
    return body[key].get<T>();
  }
  std::optional<bool> boolean(const char* key) {
    return typed<bool>(key, &json::is_boolean, "a boolean");
  }
  std::optional<double> number(const char* key) {
    return typed<double>(key, &json::is_number, "a number");
  }
  // A float parameter: finite and within f32 range (the engine checks the range it allows).
  std::optional<float> real(const char* key) {
    std::optional<double> v = number(key);
    if (!v) return std::nullopt;
    if (!std::isfinite(*v) || std::fabs(*v) > 3.4e38) {
      fail(absl::StrCat("'", key, "' must be a finite number, got ", body[key].dump()), key);
      return std::nullopt;
    }
    return static_cast<float>(*v);
  }
  std::optional<int64_t> integer(const char* key, int64_t lo, int64_t hi) {
    if (!has(key)) return std::nullopt;
    const json& v = body[key];
    int64_t out = 0;
    if (v.is_number_integer()) {
      if (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)) {
        fail(absl::StrCat("'", key, "' is ", v.dump(), ", outside [", lo, ", ", hi, "]"), key);
        return std::nullopt;
      }
      out = v.get<int64_t>();
    } else if (v.is_number_float() && std::isfinite(v.get<double>()) &&
               v.get<double>() == std::floor(v.get<double>()) &&
               std::fabs(v.get<double>()) < 9.0e15) {
      out = static_cast<int64_t>(v.get<double>());
    } else {
      fail(absl::StrCat("'", key, "' must be an integer, got ", base::quote_json_prefix(v)), key);
      return std::nullopt;
    }
    if (out < lo || out > hi) {
      fail(absl::StrCat("'", key, "' is ", out, ", outside [", lo, ", ", hi, "]"), key);
      return std::nullopt;
    }
    return out;
  }
  std::optional<std::string> string(const char* key) {
    return typed<std::string>(key, &json::is_string, "a string");
  }
};

// The body as a JSON object whose every key is in `known` (OpenAI refuses "unrecognized
// request arguments").
std::variant<json, ApiError> parse_object(std::string_view body, const RequestLimits& limits,
                                          const std::set<std::string>& known) {
  absl::StatusOr<json> parsed =
      base::parse_json_bounded(body, "request body", limits.max_json_depth);
  if (!parsed.ok()) return bad_request(std::string(parsed.status().message()));
  if (!parsed->is_object()) {
    return bad_request(
        absl::StrCat("the request body must be a JSON object, got ", type_name(*parsed)));
  }
  for (const auto& [k, v] : parsed->items()) {
    if (known.count(k) == 0) {
      return bad_request(absl::StrCat("unrecognized request argument supplied: ", k.substr(0, 64)),
                         k.substr(0, 64));
    }
  }
  return *std::move(parsed);
}

// Token ids of an array prompt: integers in [0, 2^31).
std::optional<std::vector<int64_t>> token_ids(Reader& r, const json& v, const char* key,
                                              const RequestLimits& limits) {
  if (static_cast<int64_t>(v.size()) > limits.max_prompt_ids) {
    r.fail(absl::StrCat("'", key, "' holds ", v.size(), " token ids, more than ",
                        limits.max_prompt_ids),
           key);
    return std::nullopt;
  }
  std::vector<int64_t> ids;
  ids.reserve(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    const bool is_id = v[i].is_number_unsigned()
                           ? v[i].get<uint64_t>() <= INT32_MAX
                           : v[i].is_number_integer() && v[i].get<int64_t>() >= 0 &&
                                 v[i].get<int64_t>() <= INT32_MAX;
    if (!is_id) {
      r.fail(absl::StrCat("'", key, "'[", i, "] must be a token id (an integer in [0, 2^31)), got ",
                          base::quote_json_prefix(v[i])),
             key);
      return std::nullopt;
    }
    ids.push_back(v[i].get<int64_t>());
  }
  return ids;
}

// A message's content: a string, or text parts joined with newlines (vLLM does the same).
bool message_content(Reader& r, const json& m, const std::string& where, llm::ChatMessage& cm) {
  const json content = m.contains("content") ? m["content"] : json(nullptr);
  if (content.is_string()) {
    cm.content = content.get<std::string>();
    return true;
  }
  if (!content.is_array()) {
    r.fail(absl::StrCat(where, ".content must be a string or an array of text parts, got ",
                        type_name(content)),
           "messages");
    return false;
  }
  for (size_t p = 0; p < content.size(); ++p) {
    const json& part = content[p];
    if (!part.is_object() || !part.contains("type") || part["type"] != "text" ||
        !part.contains("text") || !part["text"].is_string()) {
      r.fail(absl::StrCat(where, ".content[", p,
                          "] must be a text part {\"type\": \"text\", \"text\": ...} (other "
                          "content types are not supported)"),
             "messages");
      return false;
    }
    if (p > 0) cm.content += "\n";
    cm.content += part["text"].get<std::string>();
  }
  return true;
}

// Each key of `o` is one of `known`; otherwise fails naming `where` and the first other key.
template <typename Json>
bool only_keys(Reader& r, const Json& o, std::initializer_list<std::string_view> known,
               const std::string& where, const char* param) {
  for (auto it = o.begin(); it != o.end(); ++it) {
    if (std::find(known.begin(), known.end(), it.key()) == known.end()) {
      r.fail(absl::StrCat(where, ": unrecognized field '", it.key().substr(0, 64), "'"), param);
      return false;
    }
  }
  return true;
}

// A tool call's arguments as the template gets them: "" as {}, JSON text as its value (keys in
// the text's order), anything else as the string itself.
ojson call_arguments(const std::string& text, const RequestLimits& limits) {
  if (text.empty()) return ojson::object();
  absl::StatusOr<ojson> parsed =
      base::parse_ordered_json_bounded(text, "arguments", limits.max_json_depth);
  return parsed.ok() ? *std::move(parsed) : ojson(text);
}

// An assistant message's `tool_calls`: [{"id", "type": "function", "function": {"name",
// "arguments"}}].
bool assistant_tool_calls(Reader& r, const json& m, const std::string& where,
                          const RequestLimits& limits, llm::ChatMessage& cm) {
  if (!m.contains("tool_calls") || m["tool_calls"].is_null()) return true;
  const json& calls = m["tool_calls"];
  if (!calls.is_array()) {
    r.fail(absl::StrCat(where, ".tool_calls must be an array"), "messages");
    return false;
  }
  for (size_t k = 0; k < calls.size(); ++k) {
    const std::string w = absl::StrCat(where, ".tool_calls[", k, "]");
    const json& c = calls[k];
    if (!c.is_object() || !only_keys(r, c, {"id", "type", "function"}, w, "messages")) {
      r.fail(absl::StrCat(w, " must be an object"), "messages");
      return false;
    }
    const bool shape = c.contains("id") && c["id"].is_string() &&
                       (!c.contains("type") || c["type"] == "function") && c.contains("function") &&
                       c["function"].is_object();
    const json& f = shape ? c["function"] : c;
    if (!shape || !only_keys(r, f, {"name", "arguments"}, w + ".function", "messages") ||
        !f.contains("name") || !f["name"].is_string() || !f.contains("arguments") ||
        !f["arguments"].is_string()) {
      r.fail(absl::StrCat(w,
                          " must be {\"id\": string, \"type\": \"function\", \"function\": "
                          "{\"name\": string, \"arguments\": string}}"),
             "messages");
      return false;
    }
    cm.tool_calls.push_back(llm::ChatToolCall{
        f["name"].get<std::string>(), call_arguments(f["arguments"].get<std::string>(), limits)});
  }
  return true;
}

// The fields only one role has: an assistant's reasoning_content and tool_calls, a tool
// message's tool_call_id.
bool role_fields(Reader& r, const json& m, const std::string& where, const RequestLimits& limits,
                 llm::ChatMessage& cm) {
  const auto given = [&](const char* key) { return m.contains(key) && !m[key].is_null(); };
  if (given("reasoning_content")) {
    if (!m["reasoning_content"].is_string() || cm.role != "assistant") {
      r.fail(absl::StrCat(where, ".reasoning_content must be a string on an assistant message"),
             "messages");
      return false;
    }
    cm.reasoning_content = m["reasoning_content"].get<std::string>();
  }
  if (given("tool_calls") && cm.role != "assistant") {
    r.fail(absl::StrCat(where, ".tool_calls is only allowed on assistant messages"), "messages");
    return false;
  }
  if (cm.role == "tool" && !(m.contains("tool_call_id") && m["tool_call_id"].is_string())) {
    r.fail(absl::StrCat(where, ".tool_call_id must be a string on a tool message"), "messages");
    return false;
  }
  if (given("tool_call_id") && cm.role != "tool") {
    r.fail(absl::StrCat(where, ".tool_call_id is only allowed on tool messages"), "messages");
    return false;
  }
  return assistant_tool_calls(r, m, where, limits, cm);
}

// One message of `messages` (`where` names it): role, content, name and the role's own fields.
std::optional<llm::ChatMessage> chat_message(Reader& r, const json& m, const std::string& where,
                                             const RequestLimits& limits) {
  if (!m.is_object()) {
    r.fail(absl::StrCat(where, " must be an object"), "messages");
    return std::nullopt;
  }
  if (!only_keys(r, m,
                 {"role", "content", "name", "reasoning_content", "tool_calls", "tool_call_id"},
                 where, "messages")) {
    return std::nullopt;
  }
  llm::ChatMessage cm;
  if (!m.contains("role") || !m["role"].is_string()) {
    r.fail(absl::StrCat(where, ".role must be a string"), "messages");
    return std::nullopt;
  }
  cm.role = m["role"].get<std::string>();
  if (cm.role != "system" && cm.role != "user" && cm.role != "assistant" && cm.role != "tool") {
    r.fail(absl::StrCat(where, ".role '", cm.role.substr(0, 40),
                        "' is not supported (system, user, assistant or tool)"),
           "messages");
    return std::nullopt;
  }
  // An assistant's content may be null (a turn of tool calls only): the template gets "".
  const bool no_content = !m.contains("content") || m["content"].is_null();
  if (!(cm.role == "assistant" && no_content) && !message_content(r, m, where, cm)) {
    return std::nullopt;
  }
  if (!role_fields(r, m, where, limits, cm)) return std::nullopt;
  if (m.contains("name") && !m["name"].is_null() && !m["name"].is_string()) {
    r.fail(absl::StrCat(where, ".name must be a string"), "messages");
    return std::nullopt;
  }
  return cm;
}

std::optional<std::vector<llm::ChatMessage>> chat_messages(Reader& r, const RequestLimits& limits) {
  if (!r.body.contains("messages")) {
    r.fail("'messages' is required", "messages");
    return std::nullopt;
  }
  const json& ms = r.body["messages"];
  if (!ms.is_array() || ms.empty()) {
    r.fail("'messages' must be a non-empty array", "messages");
    return std::nullopt;
  }
  if (static_cast<int64_t>(ms.size()) > limits.max_messages) {
    r.fail(
        absl::StrCat("'messages' holds ", ms.size(), " messages, more than ", limits.max_messages),
        "messages");
    return std::nullopt;
  }
  std::vector<llm::ChatMessage> out;
  for (size_t i = 0; i < ms.size(); ++i) {
    std::optional<llm::ChatMessage> cm =
        chat_message(r, ms[i], absl::StrCat("messages[", i, "]"), limits);
    if (!cm) return std::nullopt;
    out.push_back(*std::move(cm));
  }
  return out;
}

std::optional<bool> enable_thinking(Reader& r) {
  if (!r.has("chat_template_kwargs")) return std::nullopt;
  const json& kw = r.body["chat_template_kwargs"];
  if (!kw.is_object()) {
    r.fail("'chat_template_kwargs' must be an object", "chat_template_kwargs");
    return std::nullopt;
  }
  for (const auto& [k, v] : kw.items()) {
    if (k != "enable_thinking") {
      r.fail(absl::StrCat("chat_template_kwargs: '", k.substr(0, 64),
                          "' is not supported (enable_thinking is)"),
             "chat_template_kwargs");
      return std::nullopt;
    }
    if (!v.is_boolean()) {
      r.fail("chat_template_kwargs.enable_thinking must be a boolean", "chat_template_kwargs");
      return std::nullopt;
    }
    return v.get<bool>();
  }
  return std::nullopt;
}

// A function name as OpenAI allows it: 1 to 64 of a-z, A-Z, 0-9, '_' and '-'.
bool function_name_ok(const ojson& name) {
  if (!name.is_string()) return false;
  const std::string& s = name.get_ref<const std::string&>();
  return !s.empty() && s.size() <= 64 && std::all_of(s.begin(), s.end(), [](char c) {
    return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-';
  });
}

// tools[i] (`where`): {"type": "function", "function": {"name", "description"?, "parameters"?,
// "strict"?}}. Returns the function's name.
std::optional<std::string> tool_function_name(Reader& r, const ojson& t, const std::string& where) {
  if (!t.is_object()) {
    r.fail(absl::StrCat(where, " must be an object"), "tools");
    return std::nullopt;
  }
  if (!only_keys(r, t, {"type", "function"}, where, "tools")) return std::nullopt;
  const auto type = t.find("type");
  const auto f = t.find("function");
  if (type == t.end() || *type != "function" || f == t.end() || !f->is_object()) {
    r.fail(absl::StrCat(where, " must be {\"type\": \"function\", \"function\": {...}}"), "tools");
    return std::nullopt;
  }
  const std::string fw = where + ".function";
  if (!only_keys(r, *f, {"name", "description", "parameters", "strict"}, fw, "tools")) {
    return std::nullopt;
  }
  const auto name = f->find("name");
  if (name == f->end() || !function_name_ok(*name)) {
    r.fail(absl::StrCat(fw, ".name must be 1 to 64 letters, digits, '_' or '-'"), "tools");
    return std::nullopt;
  }
  const auto wrong = [&](const char* key, bool (ojson::*is)() const noexcept) {
    const auto v = f->find(key);
    return v != f->end() && !v->is_null() && !((*v).*is)();
  };
  if (wrong("description", &ojson::is_string) || wrong("parameters", &ojson::is_object) ||
      wrong("strict", &ojson::is_boolean)) {
    r.fail(absl::StrCat(fw,
                        ": description must be a string, parameters an object (a JSON Schema), "
                        "strict a boolean"),
           "tools");
    return std::nullopt;
  }
  return name->get<std::string>();
}

// `tools`, from the body parsed again keeping its keys in order (the template renders each
// tool as sent): into the render options, their names into `names`.
void read_tools(Reader& r, std::string_view body, const RequestLimits& limits,
                llm::ChatRenderOptions& options, std::vector<std::string>& names) {
  if (!r.has("tools")) return;
  const json& tools = r.body["tools"];
  if (!tools.is_array() || static_cast<int64_t>(tools.size()) > limits.max_tools) {
    r.fail(absl::StrCat("'tools' must be an array of at most ", limits.max_tools, " tools"),
           "tools");
    return;
  }
  // The same text parse_object accepted: within the same bounds.
  absl::StatusOr<ojson> ordered =
      base::parse_ordered_json_bounded(body, "request body", limits.max_json_depth);
  if (!ordered.ok()) return r.fail(std::string(ordered.status().message()), "tools");
  const ojson& list = (*ordered)["tools"];
  for (size_t i = 0; i < list.size(); ++i) {
    std::optional<std::string> name =
        tool_function_name(r, list[i], absl::StrCat("tools[", i, "]"));
    if (!name) return;
    if (std::find(names.begin(), names.end(), *name) != names.end()) {
      return r.fail(absl::StrCat("tools[", i, "].function.name '", *name, "' is given twice"),
                    "tools");
    }
    names.push_back(*std::move(name));
    options.tools.push_back(list[i]);
  }
}

// `tool_choice` ("auto" by default with tools, "none" without) and `parallel_tool_calls`.
void read_tool_choice(Reader& r, ToolCallPolicy& t) {
  t.choice = t.names.empty() ? ToolChoice::kNone : ToolChoice::kAuto;
  if (auto v = r.boolean("parallel_tool_calls")) t.parallel = *v;
  if (!r.has("tool_choice")) return;
  const json& c = r.body["tool_choice"];
  const bool named = c.is_object() && c.size() == 2 && c.contains("type") &&
                     c["type"] == "function" && c.contains("function") &&
                     c["function"].is_object() && c["function"].size() == 1 &&
                     c["function"].contains("name") && c["function"]["name"].is_string();
  if (named) {
    t.choice = ToolChoice::kFunction;
    t.function = c["function"]["name"].get<std::string>();
  } else if (c == "none" || c == "auto" || c == "required") {
    t.choice =
        c == "none" ? ToolChoice::kNone : (c == "auto" ? ToolChoice::kAuto : ToolChoice::kRequired);
  } else {
    return r.fail(
        "'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
        "\"function\": {\"name\": ...}}",
        "tool_choice");
  }
  if (t.choice != ToolChoice::kNone && t.names.empty()) {
    return r.fail("'tool_choice' other than \"none\" needs 'tools'", "tool_choice");
  }
  if (named && std::find(t.names.begin(), t.names.end(), t.function) == t.names.end()) {
    r.fail(absl::StrCat("'tool_choice' names the function '", t.function.substr(0, 64),
                        "', which is not in 'tools'"),
           "tool_choice");
  }
}

// The fields both endpoints accept, with the endpoint's own.
std::set<std::string> fields_with(std::initializer_list<const char*> own) {
  std::set<std::string> k = {"model",
                             "max_tokens",
                             "temperature",
                             "top_p",
                             "n",
                             "seed",
                             "stop",
                             "presence_penalty",
                             "frequency_penalty",
                             "logprobs",
                             "stream",
                             "stream_options",
                             "user",
                             "top_k",
                             "min_p",
                             "repetition_penalty",
                             "stop_token_ids",
                             "ignore_eos",
                             "min_tokens",
                             "logit_bias",
                             "response_format",
                             "guided_json",
                             "guided_choice",
                             "guided_regex",
                             "guided_grammar",
                             "grammar"};
  k.insert(own.begin(), own.end());
  return k;
}
const std::set<std::string>& completion_fields() {
  static const std::set<std::string> k = fields_with({"prompt", "echo", "best_of", "suffix"});
  return k;
}
const std::set<std::string>& chat_fields() {
  static const std::set<std::string> k =
      fields_with({"messages", "max_completion_tokens", "top_logprobs", "chat_template_kwargs",
                   "tools", "tool_choice", "parallel_tool_calls"});
  return k;
}

// Chat's own fields. Returns the error of a refused feature at once; others go to `r`.
std::optional<ApiError> read_chat(Reader& r, std::string_view body, const RequestLimits& limits,
                                  ParsedRequest& p) {
  if (auto m = chat_messages(r, limits)) p.messages = std::move(*m);
  read_tools(r, body, limits, p.chat_options, p.tool_calls.names);
  read_tool_choice(r, p.tool_calls);
  p.chat_options.add_generation_prompt = true;
  p.chat_options.enable_thinking = enable_thinking(r);
  p.max_tokens = r.integer("max_completion_tokens", 1, INT32_MAX);
  if (!p.max_tokens) p.max_tokens = r.integer("max_tokens", 1, INT32_MAX);
  const std::optional<bool> lp = r.boolean("logprobs");
  const std::optional<int64_t> top = r.integer("top_logprobs", 0, llm::kMaxLogprobs);
  if (top && !(lp && *lp)) {
    r.fail("'top_logprobs' needs 'logprobs': true", "top_logprobs");
  }
  if (lp && *lp) p.logprobs = static_cast<int32_t>(top.value_or(0));
  return std::nullopt;
}

// The completion endpoint's own fields, as read_chat.
std::optional<ApiError> read_completion(Reader& r, const RequestLimits& limits, ParsedRequest& p) {
  const json& j = r.body;
  if (!j.contains("prompt")) return bad_request("'prompt' is required", "prompt");
  const json& pr = j["prompt"];
  if (pr.is_string()) {
    p.prompt = pr.get<std::string>();
  } else if (pr.is_array() && !pr.empty() && pr[0].is_number()) {
    if (auto ids = token_ids(r, pr, "prompt", limits)) p.prompt = std::move(*ids);
  } else if (pr.is_array() && pr.size() == 1 && pr[0].is_string()) {
    p.prompt = pr[0].get<std::string>();
  } else {
    return bad_request(
        "'prompt' must be a string or an array of token ids (a batch of prompts is not "
        "supported: send one request per prompt)",
        "prompt");
  }
  p.max_tokens = r.integer("max_tokens", 1, INT32_MAX);
  if (!p.max_tokens) p.max_tokens = kDefaultCompletionMaxTokens;
  if (auto lp = r.integer("logprobs", 0, llm::kMaxLogprobs)) p.logprobs = static_cast<int32_t>(*lp);
  if (auto e = r.boolean("echo")) p.echo = *e;
  (void)r.integer("best_of", 1, 1);  // only the default: no server-side best-of
  if (r.has("suffix")) return bad_request("'suffix' is not supported", "suffix");
  return std::nullopt;
}

void read_stream_options(Reader& r, ParsedRequest& p) {
  if (!r.has("stream_options")) return;
  const json& so = r.body["stream_options"];
  if (!so.is_object()) {
    r.fail("'stream_options' must be an object", "stream_options");
    return;
  }
  for (const auto& [k, v] : so.items()) {
    if (k != "include_usage" || !v.is_boolean()) {
      r.fail("'stream_options' holds only include_usage (a boolean)", "stream_options");
      break;
    }
    p.include_usage = v.get<bool>();
  }
}

// `stop`: a string or an array of at most max_stop_strings, each 1 to max_stop_string_bytes.
void read_stop(Reader& r, const RequestLimits& limits, llm::RequestSampling& s) {
  if (!r.has("stop")) return;
  const json& st = r.body["stop"];
  if (st.is_string()) {
    s.stop.push_back(st.get<std::string>());
  } else if (st.is_array()) {
    if (static_cast<int64_t>(st.size()) > limits.max_stop_strings) {
      r.fail(
          absl::StrCat("'stop' holds ", st.size(), " strings, at most ", limits.max_stop_strings),
          "stop");
    }
    for (size_t i = 0; i < st.size() && !r.error; ++i) {
      if (!st[i].is_string()) {
        r.fail(absl::StrCat("'stop'[", i, "] must be a string"), "stop");
      } else {
        s.stop.push_back(st[i].get<std::string>());
      }
    }
  } else {
    r.fail("'stop' must be a string or an array of strings", "stop");
  }
  for (size_t i = 0; i < s.stop.size() && !r.error; ++i) {
    if (s.stop[i].empty() ||
        static_cast<int64_t>(s.stop[i].size()) > limits.max_stop_string_bytes) {
      r.fail(absl::StrCat("'stop'[", i, "] must be 1 to ", limits.max_stop_string_bytes,
                          " bytes, got ", s.stop[i].size()),
             "stop");
    }
  }
}

// A JSON Schema compiled to the request's grammar; a refusal names `param`.
void compile_schema(Reader& r, const ojson& schema, const char* param, llm::RequestSampling& s) {
  if (!schema.is_object() && !schema.is_boolean()) {
    r.fail(absl::StrCat("'", param, "' must hold a JSON Schema (an object)"), param);
    return;
  }
  absl::StatusOr<std::shared_ptr<const grammar::Grammar>> g =
      grammar::compile_json_schema(schema.dump());
  if (!g.ok()) {
    r.fail(absl::StrCat("'", param, "': ", g.status().message()), param);
    return;
  }
  s.grammar = *std::move(g);
}

// response_format {"type": "json_schema", "json_schema": {"name", "schema", "strict"?,
// "description"?}}; `ordered` is the body with its keys in order (properties keep theirs).
void read_json_schema_format(Reader& r, const ojson& ordered, llm::RequestSampling& s) {
  const json& f = r.body["response_format"];
  const json& js = f.contains("json_schema") ? f["json_schema"] : json();
  if (!js.is_object() || !js.contains("name") || !js["name"].is_string()) {
    r.fail(
        "'response_format' of type json_schema needs 'json_schema': {\"name\": ..., "
        "\"schema\": {...}}",
        "response_format");
    return;
  }
  for (const auto& [k, v] : js.items()) {
    if (k != "name" && k != "schema" && k != "strict" && k != "description") {
      r.fail(absl::StrCat("'response_format.json_schema' has an unknown field '", k, "'"),
             "response_format");
      return;
    }
  }
  if (js.contains("strict") && !js["strict"].is_boolean() && !js["strict"].is_null()) {
    r.fail("'response_format.json_schema.strict' must be a boolean", "response_format");
    return;
  }
  const auto& schema = ordered["response_format"]["json_schema"];
  compile_schema(r, schema.contains("schema") ? schema["schema"] : ojson::object(),
                 "response_format", s);
}

// The structured-output fields; a request gives at most one of them.
constexpr const char* kStructuredFields[] = {"response_format", "guided_json",    "guided_choice",
                                             "guided_regex",    "guided_grammar", "grammar"};

// A grammar from the text field `param` (a regex or GBNF); a refusal names `param`.
void compile_text(
    Reader& r, const char* param, llm::RequestSampling& s,
    absl::StatusOr<std::shared_ptr<const grammar::Grammar>> (*compile)(std::string_view)) {
  const json& v = r.body[param];
  if (!v.is_string()) return r.fail(absl::StrCat("'", param, "' must be a string"), param);
  absl::StatusOr<std::shared_ptr<const grammar::Grammar>> g = compile(v.get<std::string>());
  if (!g.ok()) return r.fail(absl::StrCat("'", param, "': ", g.status().message()), param);
  s.grammar = *std::move(g);
}

void read_choice(Reader& r, llm::RequestSampling& s) {
  const json& c = r.body["guided_choice"];
  std::vector<std::string> choices;
  for (const json& e : c.is_array() ? c : json::array({json()})) {
    if (!e.is_string())
      return r.fail("'guided_choice' must be an array of strings", "guided_choice");
    choices.push_back(e.get<std::string>());
  }
  absl::StatusOr<std::shared_ptr<const grammar::Grammar>> g = grammar::choice_grammar(choices);
  if (!g.ok()) return r.fail(std::string(g.status().message()), "guided_choice");
  s.grammar = *std::move(g);
}

// Structured outputs: `response_format` (OpenAI: text, json_object, json_schema), vLLM's
// `guided_json` (a schema), `guided_choice` (strings), `guided_regex` (a regular expression) and
// `guided_grammar`, and llama-server's `grammar` (both GBNF); at most one of them.
void read_structured(Reader& r, std::string_view body, const RequestLimits& limits,
                     ParsedRequest& p) {
  std::vector<const char*> given;
  for (const char* f : kStructuredFields) {
    if (r.has(f)) given.push_back(f);
  }
  if (given.empty() || r.error) return;
  if (given.size() > 1) {
    return r.fail(
        "give at most one of 'response_format', 'guided_json', 'guided_choice', "
        "'guided_regex', 'guided_grammar' and 'grammar'",
        std::string_view(given[0]) == "response_format" ? given[1] : given[0]);
  }
  const std::string_view field = given[0];
  if (field == "guided_choice") return read_choice(r, p.sampling);
  if (field == "guided_regex") return compile_text(r, given[0], p.sampling, grammar::compile_regex);
  if (field != "response_format" && field != "guided_json") {
    return compile_text(r, given[0], p.sampling, grammar::compile_gbnf);
  }
  // The same text parse_object accepted: within the same bounds.
  absl::StatusOr<ojson> parsed =
      base::parse_ordered_json_bounded(body, "request body", limits.max_json_depth);
  if (!parsed.ok()) return r.fail(std::string(parsed.status().message()), given[0]);
  const ojson& ordered = *parsed;
  if (field == "guided_json") {
    const auto& g = ordered["guided_json"];
    compile_schema(r, g.is_string() ? ojson::parse(g.get<std::string>(), nullptr, false) : g,
                   "guided_json", p.sampling);
    return;
  }
  const json& f = r.body["response_format"];
  const std::string type = f.is_object() && f.contains("type") && f["type"].is_string()
                               ? f["type"].get<std::string>()
                               : std::string();
  if (type == "text") return;
  if (type == "json_object") {
    p.sampling.grammar = grammar::json_object_grammar();
  } else if (type == "json_schema") {
    read_json_schema_format(r, ordered, p.sampling);
  } else {
    r.fail(
        "'response_format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
        "{\"type\": \"json_schema\", \"json_schema\": {...}}",
        "response_format");
  }
}

// tool_choice "required" or a named function: the output is constrained to Qwen3's tool-call
// blocks (chat_template.cc) of the allowed functions, arguments matching their parameters.
void constrain_tool_calls(Reader& r, ParsedRequest& p) {
  const ToolCallPolicy& t = p.tool_calls;
  if (r.error || (t.choice != ToolChoice::kRequired && t.choice != ToolChoice::kFunction)) return;
  if (p.sampling.grammar != nullptr) {
    return r.fail(
        "'tool_choice' \"required\" or a named function constrains the output; it cannot be "
        "combined with 'response_format', 'guided_json', 'guided_choice', 'guided_regex', "
        "'guided_grammar' or 'grammar'",
        "tool_choice");
  }
  std::vector<grammar::ToolSchema> tools;
  for (const ojson& tool : p.chat_options.tools) {
    const ojson& fn = tool["function"];
    const std::string name = fn["name"].get<std::string>();
    if (t.choice == ToolChoice::kFunction && name != t.function) continue;
    const auto params = fn.find("parameters");
    tools.push_back({name, params != fn.end() && !params->is_null() ? params->dump() : ""});
  }
  grammar::ToolCallFormat f{"<tool_call>\n", "\n</tool_call>", "\n",
                            t.choice == ToolChoice::kRequired && t.parallel};
  absl::StatusOr<std::shared_ptr<const grammar::Grammar>> g = grammar::tool_call_grammar(tools, f);
  if (!g.ok()) return r.fail(std::string(g.status().message()), "tool_choice");
  p.sampling.grammar = *std::move(g);
}

// The sampling parameters, `stop` and `stop_token_ids` (the engine checks their ranges).
void read_sampling(Reader& r, const RequestLimits& limits, ParsedRequest& p) {
  llm::RequestSampling& s = p.sampling;
  if (auto v = r.real("temperature")) s.temperature = *v;
  if (auto v = r.real("top_p")) s.top_p = *v;
  if (auto v = r.integer("top_k", -1, INT32_MAX)) s.top_k = static_cast<int32_t>(*v);
  if (auto v = r.real("min_p")) s.min_p = *v;
  if (auto v = r.real("presence_penalty")) s.presence_penalty = *v;
  if (auto v = r.real("frequency_penalty")) s.frequency_penalty = *v;
  if (auto v = r.real("repetition_penalty")) s.repetition_penalty = *v;
  if (auto v = r.integer("seed", INT64_MIN, INT64_MAX)) s.seed = static_cast<uint64_t>(*v);
  if (auto v = r.integer("min_tokens", 0, INT32_MAX)) s.min_tokens = static_cast<int32_t>(*v);
  if (auto v = r.boolean("ignore_eos")) s.ignore_eos = *v;
  s.logprobs = p.logprobs;
  read_stop(r, limits, s);
  if (r.has("stop_token_ids")) {
    const json& ids = r.body["stop_token_ids"];
    if (!ids.is_array() || ids.size() > 8) {
      r.fail("'stop_token_ids' must be an array of at most 8 token ids", "stop_token_ids");
    } else if (auto v = token_ids(r, ids, "stop_token_ids", limits)) {
      for (int64_t id : *v) s.stop_token_ids.push_back(static_cast<int32_t>(id));
    }
  }
}

}  // namespace

std::variant<ParsedRequest, ApiError> parse_request(std::string_view body, bool chat,
                                                    const RequestLimits& limits) {
  auto obj = parse_object(body, limits, chat ? chat_fields() : completion_fields());
  if (auto* e = std::get_if<ApiError>(&obj)) return *e;
  const json& j = std::get<json>(obj);
  Reader r{j, std::nullopt};
  ParsedRequest p;
  p.chat = chat;
  if (auto m = r.string("model")) p.model = *m;
  if (auto e = chat ? read_chat(r, body, limits, p) : read_completion(r, limits, p)) return *e;
  if (r.has("logit_bias") && !(j["logit_bias"].is_object() && j["logit_bias"].empty())) {
    return bad_request("'logit_bias' is not supported", "logit_bias");
  }
  if (auto n = r.integer("n", 1, limits.max_n)) p.n = static_cast<int32_t>(*n);
  if (auto s = r.boolean("stream")) p.stream = *s;
  read_stream_options(r, p);
  (void)r.string("user");
  read_sampling(r, limits, p);
  read_structured(r, body, limits, p);
  constrain_tool_calls(r, p);
  if (r.error) return *r.error;
  return p;
}

std::variant<TokenizeRequest, ApiError> parse_tokenize(std::string_view body,
                                                       const RequestLimits& limits) {
  static const std::set<std::string> kFields = {"model",
                                                "prompt",
                                                "messages",
                                                "add_special_tokens",
                                                "add_generation_prompt",
                                                "chat_template_kwargs",
                                                "tools"};
  auto obj = parse_object(body, limits, kFields);
  if (auto* e = std::get_if<ApiError>(&obj)) return *e;
  const json& j = std::get<json>(obj);
  Reader r{j, std::nullopt};
  TokenizeRequest t;
  if (auto m = r.string("model")) t.model = *m;
  if (j.contains("prompt") == j.contains("messages")) {
    return bad_request("give exactly one of 'prompt' and 'messages'");
  }
  if (j.contains("prompt")) {
    t.prompt = r.string("prompt");
    if (!t.prompt && !r.error) r.fail("'prompt' must be a string", "prompt");
    if (r.has("tools")) r.fail("'tools' needs 'messages'", "tools");
  } else if (auto m = chat_messages(r, limits)) {
    t.messages = std::move(*m);
    std::vector<std::string> names;
    read_tools(r, body, limits, t.chat_options, names);
  }
  if (auto v = r.boolean("add_special_tokens")) t.add_special_tokens = *v;
  if (auto v = r.boolean("add_generation_prompt")) t.chat_options.add_generation_prompt = *v;
  t.chat_options.enable_thinking = enable_thinking(r);
  if (r.error) return *r.error;
  return t;
}

std::variant<DetokenizeRequest, ApiError> parse_detokenize(std::string_view body,
                                                           const RequestLimits& limits) {
  static const std::set<std::string> kFields = {"model", "tokens"};
  auto obj = parse_object(body, limits, kFields);
  if (auto* e = std::get_if<ApiError>(&obj)) return *e;
  const json& j = std::get<json>(obj);
  Reader r{j, std::nullopt};
  DetokenizeRequest d;
  if (auto m = r.string("model")) d.model = *m;
  if (!j.contains("tokens") || !j["tokens"].is_array()) {
    return bad_request("'tokens' must be an array of token ids", "tokens");
  }
  auto ids = token_ids(r, j["tokens"], "tokens", limits);
  if (r.error) return *r.error;
  d.tokens = *std::move(ids);
  return d;
}

namespace {

void histogram(std::string& out, const std::string& name, const std::string& help,
               const llm::Histogram& h, const std::string& label) {
  absl::StrAppend(&out, "# HELP ", name, " ", help, "\n# TYPE ", name, " histogram\n");
  int64_t cum = 0;
  for (size_t i = 0; i < h.bounds.size(); ++i) {
    cum += i < h.counts.size() ? h.counts[i] : 0;
    absl::StrAppend(&out, name, "_bucket{", label, ",le=\"", h.bounds[i], "\"} ", cum, "\n");
  }
  absl::StrAppend(&out, name, "_bucket{", label, ",le=\"+Inf\"} ", h.count, "\n", name, "_sum{",
                  label, "} ", h.sum, "\n", name, "_count{", label, "} ", h.count, "\n");
}

void metric(std::string& out, const std::string& name, const char* type, const std::string& help,
            const std::vector<std::pair<std::string, double>>& series) {
  absl::StrAppend(&out, "# HELP ", name, " ", help, "\n# TYPE ", name, " ", type, "\n");
  for (const auto& [labels, v] : series) absl::StrAppend(&out, name, "{", labels, "} ", v, "\n");
}

}  // namespace

std::string prometheus_text(const llm::EngineMetrics& m, const std::string& model_name) {
  std::string escaped;
  for (char c : model_name) {
    if (c == '\\' || c == '"') escaped += '\\';
    if (c == '\n') {
      escaped += "\\n";
      continue;
    }
    escaped += c;
  }
  const std::string l = absl::StrCat("model_name=\"", escaped, "\"");
  std::string out;
  // A series of its own, labelled with the model only.
  const auto single = [&](const char* name, const char* type, const char* help, double v) {
    metric(out, name, type, help, {{l, v}});
  };
  single("simpler:healthy", "gauge", "1 while the engine is healthy", m.healthy ? 1 : 0);
  single("simpler:num_requests_running", "gauge", "Requests running (admitted)",
         m.requests_running);
  single("simpler:num_requests_waiting", "gauge", "Requests waiting to be admitted",
         m.requests_waiting);
  single("simpler:num_preemptions_total", "counter", "Preemptions by recompute",
         m.preemptions_total);
  metric(out, "simpler:request_success_total", "counter", "Finished requests by finish reason",
         {{l + ",finished_reason=\"stop\"", static_cast<double>(m.requests_finished_stop)},
          {l + ",finished_reason=\"length\"", static_cast<double>(m.requests_finished_length)},
          {l + ",finished_reason=\"abort\"", static_cast<double>(m.requests_finished_abort)},
          {l + ",finished_reason=\"error\"", static_cast<double>(m.requests_finished_error)}});
  single("simpler:request_refused_total", "counter", "Requests refused at admission",
         m.requests_refused);
  metric(out, "simpler:kv_cache_pages", "gauge", "KV cache pages by state (they sum to the pool)",
         {{l + ",state=\"free\"", static_cast<double>(m.kv_pages.free)},
          {l + ",state=\"used\"", static_cast<double>(m.kv_pages.used)},
          {l + ",state=\"fenced\"", static_cast<double>(m.kv_pages.fenced)},
          {l + ",state=\"quarantined\"", static_cast<double>(m.kv_pages.quarantined)}});
  single(
      "simpler:kv_cache_usage_perc", "gauge", "Fraction of KV pages not free",
      m.kv_pages_total > 0 ? 1.0 - static_cast<double>(m.kv_pages.free) / m.kv_pages_total : 0.0);
  single("simpler:prompt_tokens_total", "counter", "Prompt positions computed",
         m.prompt_tokens_total);
  single("simpler:prefix_cache_queries_total", "counter",
         "Prompt tokens looked up in the prefix cache at admission", m.prefix_cache_queries_total);
  single("simpler:prefix_cache_hits_total", "counter",
         "Prompt tokens found in the prefix cache at admission", m.prefix_cache_hits_total);
  single("simpler:kv_cache_pages_cached", "gauge", "KV pages in the prefix cache",
         m.kv_pages_cached);
  single("simpler:generation_tokens_total", "counter", "Output tokens", m.generation_tokens_total);
  single("simpler:steps_total", "counter", "Engine steps submitted", m.steps_total);
  histogram(out, "simpler:time_to_first_token_seconds", "Time to first token",
            m.time_to_first_token_s, l);
  histogram(out, "simpler:inter_token_latency_seconds", "Inter-token latency",
            m.inter_token_latency_s, l);
  histogram(out, "simpler:e2e_request_latency_seconds", "End-to-end request latency",
            m.e2e_request_latency_s, l);
  histogram(out, "simpler:request_queue_time_seconds", "Time waiting before admission",
            m.request_queue_time_s, l);
  histogram(out, "simpler:step_time_seconds", "Engine step time, submit to retire", m.step_time_s,
            l);
  histogram(out, "simpler:rows_per_step", "Requests per engine step", m.rows_per_step, l);
  histogram(out, "simpler:tokens_per_step", "Positions per engine step", m.tokens_per_step, l);
  histogram(out, "simpler:grammar_mask_seconds",
            "Host time of one structured-output row's token mask", m.grammar_mask_time_s, l);
  return out;
}

}  // namespace simpler::serve
