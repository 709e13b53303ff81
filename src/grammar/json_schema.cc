#include "simpler/grammar/json_schema.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <set>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace simpler::grammar {
namespace {

using json = nlohmann::ordered_json;  // properties in the schema's order
using Sequence = GrammarBuilder::Sequence;

absl::Status bad_keyword(const std::string& keyword, const std::string& at,
                         const std::string& want) {
  return absl::InvalidArgumentError(
      absl::StrCat("JSON Schema keyword '", keyword, "' at #", at, " must be ", want));
}

// The JSON building blocks, made once per grammar on first use.
class JsonRules {
 public:
  explicit JsonRules(GrammarBuilder& b) : b_(b) {}

  uint32_t string() {
    if (string_ != kNone) return string_;
    const uint32_t ch = b_.add_rule("json-char");
    ByteClass plain = ByteClass::range(0x20, 0x7F);
    plain.bits[0x22 >> 6] &= ~(uint64_t{1} << (0x22 & 63));  // '"'
    plain.bits[0x5C >> 6] &= ~(uint64_t{1} << (0x5C & 63));  // '\'
    b_.add_alternative(ch, {b_.bytes(plain)});
    ByteClass esc;
    for (char c : std::string_view("\"\\/bfnrt")) esc.add(c, c);
    b_.add_alternative(ch, {b_.bytes(ByteClass::of('\\')), b_.bytes(esc)});
    const Symbol hex = b_.bytes(ByteClass::range('0', '9').add('a', 'f').add('A', 'F'));
    Sequence u = b_.literal("\\u");
    u.insert(u.end(), {hex, hex, hex, hex});
    b_.add_alternative(ch, u);
    add_utf8(ch);
    const uint32_t chars = b_.star({GrammarBuilder::ref(ch)}, "json-chars");
    string_ = b_.add_rule("json-string");
    b_.add_alternative(string_, {b_.bytes(ByteClass::of('"')), GrammarBuilder::ref(chars),
                                 b_.bytes(ByteClass::of('"'))});
    return string_;
  }

  uint32_t integer() {
    if (integer_ != kNone) return integer_;
    const uint32_t digits = b_.star({b_.bytes(ByteClass::range('0', '9'))}, "json-digits");
    const uint32_t magnitude = b_.add_rule("json-magnitude");
    b_.add_alternative(magnitude, b_.literal("0"));
    b_.add_alternative(magnitude,
                       {b_.bytes(ByteClass::range('1', '9')), GrammarBuilder::ref(digits)});
    const uint32_t sign = b_.optional(b_.literal("-"), "json-minus");
    integer_ = b_.add_rule("json-integer");
    b_.add_alternative(integer_, {GrammarBuilder::ref(sign), GrammarBuilder::ref(magnitude)});
    return integer_;
  }

  uint32_t number() {
    if (number_ != kNone) return number_;
    const Symbol digit = b_.bytes(ByteClass::range('0', '9'));
    const uint32_t more = b_.star({digit}, "json-more-digits");
    const uint32_t frac = b_.optional(
        {b_.bytes(ByteClass::of('.')), digit, GrammarBuilder::ref(more)}, "json-fraction");
    const uint32_t esign = b_.optional({b_.bytes(ByteClass::of('+').add('-', '-'))}, "json-esign");
    const uint32_t exp = b_.optional({b_.bytes(ByteClass::of('e').add('E', 'E')),
                                      GrammarBuilder::ref(esign), digit, GrammarBuilder::ref(more)},
                                     "json-exponent");
    number_ = b_.add_rule("json-number");
    b_.add_alternative(number_, {GrammarBuilder::ref(integer()), GrammarBuilder::ref(frac),
                                 GrammarBuilder::ref(exp)});
    return number_;
  }

  // Any JSON value, and any JSON object.
  uint32_t value() {
    if (value_ != kNone) return value_;
    value_ = b_.add_rule("json-value");
    object_ = map_of(value_, "json-object");
    const uint32_t items =
        b_.star({b_.bytes(ByteClass::of(',')), GrammarBuilder::ref(value_)}, "json-array-more");
    const uint32_t array = b_.add_rule("json-array");
    b_.add_alternative(array, b_.literal("[]"));
    Sequence a = b_.literal("[");
    a.insert(a.end(), {GrammarBuilder::ref(value_), GrammarBuilder::ref(items)});
    b_.append_literal("]", a);
    b_.add_alternative(array, a);
    for (uint32_t r : {object_, array, string(), number()}) {
      b_.add_alternative(value_, {GrammarBuilder::ref(r)});
    }
    for (const char* lit : {"true", "false", "null"}) b_.add_alternative(value_, b_.literal(lit));
    return value_;
  }
  uint32_t object() {
    value();
    return object_;
  }

  // "{" (string ":" V ("," string ":" V)*)? "}" with V = rule `v`.
  uint32_t map_of(uint32_t v, std::string name) {
    Sequence member = {GrammarBuilder::ref(string())};
    b_.append_literal(":", member);
    member.push_back(GrammarBuilder::ref(v));
    Sequence again = b_.literal(",");
    again.insert(again.end(), member.begin(), member.end());
    const uint32_t more = b_.star(again, name + "-more");
    const uint32_t r = b_.add_rule(std::move(name));
    b_.add_alternative(r, b_.literal("{}"));
    Sequence full = b_.literal("{");
    full.insert(full.end(), member.begin(), member.end());
    full.push_back(GrammarBuilder::ref(more));
    b_.append_literal("}", full);
    b_.add_alternative(r, full);
    return r;
  }

 private:
  static constexpr uint32_t kNone = UINT32_MAX;

  // Well-formed UTF-8 of two to four bytes (RFC 3629: no overlongs, no surrogates).
  void add_utf8(uint32_t ch) {
    const Symbol tail = b_.bytes(ByteClass::range(0x80, 0xBF));
    auto lead = [&](uint8_t lo, uint8_t hi) { return b_.bytes(ByteClass::range(lo, hi)); };
    b_.add_alternative(ch, {lead(0xC2, 0xDF), tail});
    b_.add_alternative(ch, {lead(0xE0, 0xE0), lead(0xA0, 0xBF), tail});
    b_.add_alternative(ch, {lead(0xE1, 0xEC), tail, tail});
    b_.add_alternative(ch, {lead(0xED, 0xED), lead(0x80, 0x9F), tail});
    b_.add_alternative(ch, {lead(0xEE, 0xEF), tail, tail});
    b_.add_alternative(ch, {lead(0xF0, 0xF0), lead(0x90, 0xBF), tail, tail});
    b_.add_alternative(ch, {lead(0xF1, 0xF3), tail, tail, tail});
    b_.add_alternative(ch, {lead(0xF4, 0xF4), lead(0x80, 0x8F), tail, tail});
  }

  GrammarBuilder& b_;
  uint32_t string_ = kNone, integer_ = kNone, number_ = kNone, value_ = kNone, object_ = kNone;
};

const std::set<std::string, std::less<>>& supported_keywords() {
  static const std::set<std::string, std::less<>> k = {
      "type",        "properties", "required",    "additionalProperties",
      "items",       "minItems",   "maxItems",    "enum",
      "const",       "anyOf",      "$ref",        "$defs",
      "definitions", "title",      "description", "$schema",
      "$id",         "$comment",   "default",     "examples"};
  return k;
}

bool has_type(const json& v, std::string_view type) {
  if (type == "object") return v.is_object();
  if (type == "array") return v.is_array();
  if (type == "string") return v.is_string();
  if (type == "integer") {
    return v.is_number_integer() || (v.is_number_float() && std::isfinite(v.get<double>()) &&
                                     std::floor(v.get<double>()) == v.get<double>());
  }
  if (type == "number") return v.is_number();
  if (type == "boolean") return v.is_boolean();
  return v.is_null();
}

class SchemaCompiler {
 public:
  // Compiles `doc` into rules of `b` (sharing the JSON building blocks `j`).
  SchemaCompiler(const json& doc, GrammarBuilder& b, JsonRules& j) : doc_(doc), b_(b), j_(j) {}

  // The rule of the whole document.
  absl::StatusOr<uint32_t> root() { return ref_rule("#", ""); }

 private:
  // The rule of the schema a $ref (or the root, "#") names, made once per target.
  absl::StatusOr<uint32_t> ref_rule(const std::string& ref, const std::string& at) {
    if (auto it = refs_.find(ref); it != refs_.end()) return it->second;
    if (ref.empty() || ref[0] != '#') {
      return absl::InvalidArgumentError(
          absl::StrCat("$ref '", ref, "' at #", at, " does not point into this document"));
    }
    const std::string pointer = ref.substr(1);
    json::json_pointer ptr;
    try {
      ptr = json::json_pointer(pointer);
    } catch (const json::exception&) {
      return absl::InvalidArgumentError(
          absl::StrCat("$ref '", ref, "' at #", at, " does not point into this document"));
    }
    if (!doc_.contains(ptr)) {
      return absl::InvalidArgumentError(
          absl::StrCat("$ref '", ref, "' at #", at, " does not point into this document"));
    }
    const uint32_t r = b_.add_rule(ref);
    refs_[ref] = r;
    absl::StatusOr<uint32_t> target = schema(doc_.at(ptr), pointer);
    if (!target.ok()) return target.status();
    b_.add_alternative(r, {GrammarBuilder::ref(*target)});
    return r;
  }

  absl::StatusOr<uint32_t> schema(const json& s, const std::string& at) {
    if (s.is_boolean()) {
      if (s.get<bool>()) return j_.value();
      return b_.add_rule("#" + at);  // false: no alternatives, no value
    }
    if (!s.is_object()) return bad_keyword("schema", at, "an object or a boolean");
    for (const auto& [k, v] : s.items()) {
      if (supported_keywords().count(k) == 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("unsupported JSON Schema keyword '", k, "' at #", at));
      }
    }
    if (s.contains("$ref")) {
      if (!s["$ref"].is_string()) return bad_keyword("$ref", at, "a string");
      return ref_rule(s["$ref"].get<std::string>(), at);
    }
    if (s.contains("enum") || s.contains("const")) return enum_rule(s, at);
    if (s.contains("anyOf")) return any_of(s, at);
    std::vector<std::string> types;
    if (absl::Status st = type_list(s, at, types); !st.ok()) return st;
    const uint32_t r = b_.add_rule("#" + at);
    for (const std::string& t : types) {
      absl::StatusOr<uint32_t> tr = typed(s, t, at);
      if (!tr.ok()) return tr.status();
      b_.add_alternative(r, {GrammarBuilder::ref(*tr)});
    }
    return r;
  }

  absl::Status type_list(const json& s, const std::string& at, std::vector<std::string>& out) {
    static const std::set<std::string, std::less<>> kTypes = {
        "object", "array", "string", "integer", "number", "boolean", "null"};
    if (!s.contains("type")) {
      if (s.contains("properties") || s.contains("required") ||
          s.contains("additionalProperties")) {
        out = {"object"};
      } else if (s.contains("items") || s.contains("minItems") || s.contains("maxItems")) {
        out = {"array"};
      } else {
        out = {"any"};
      }
      return absl::OkStatus();
    }
    const json& t = s["type"];
    const json list = t.is_array() ? t : json::array({t});
    for (const json& e : list) {
      if (!e.is_string() || kTypes.count(e.get<std::string>()) == 0) {
        return bad_keyword("type", at, "one of the seven JSON types or a list of them");
      }
      out.push_back(e.get<std::string>());
    }
    return absl::OkStatus();
  }

  absl::StatusOr<uint32_t> typed(const json& s, const std::string& type, const std::string& at) {
    if (type == "any") return j_.value();
    if (type == "object") return object(s, at);
    if (type == "array") return array(s, at);
    if (type == "string") return j_.string();
    if (type == "integer") return j_.integer();
    if (type == "number") return j_.number();
    const uint32_t r = b_.add_rule("#" + at + "/" + type);
    if (type == "boolean") {
      b_.add_alternative(r, b_.literal("true"));
      b_.add_alternative(r, b_.literal("false"));
    } else {
      b_.add_alternative(r, b_.literal("null"));
    }
    return r;
  }

  absl::StatusOr<uint32_t> enum_rule(const json& s, const std::string& at) {
    json values = json::array();
    if (s.contains("const")) values.push_back(s["const"]);
    if (s.contains("enum")) {
      if (!s["enum"].is_array()) return bad_keyword("enum", at, "an array");
      for (const json& v : s["enum"]) {
        if (!s.contains("const") || v == s["const"]) values.push_back(v);
      }
      if (s.contains("const")) values.erase(values.begin());  // kept only if also in enum
    }
    std::vector<std::string> types;
    if (s.contains("type")) {
      if (absl::Status st = type_list(s, at, types); !st.ok()) return st;
    }
    const uint32_t r = b_.add_rule("#" + at);
    std::set<std::string> seen;
    for (const json& v : values) {
      const bool typed_ok =
          types.empty() || std::any_of(types.begin(), types.end(),
                                       [&](const std::string& t) { return has_type(v, t); });
      const std::string text = v.dump(-1, ' ', false, json::error_handler_t::replace);
      if (typed_ok && seen.insert(text).second) b_.add_alternative(r, b_.literal(text));
    }
    return r;
  }

  absl::StatusOr<uint32_t> any_of(const json& s, const std::string& at) {
    if (!s["anyOf"].is_array() || s["anyOf"].empty()) {
      return bad_keyword("anyOf", at, "a non-empty array");
    }
    for (const char* k : {"type", "properties", "items", "required", "additionalProperties"}) {
      if (s.contains(k)) {
        return absl::InvalidArgumentError(
            absl::StrCat("unsupported JSON Schema keyword '", k, "' beside anyOf at #", at));
      }
    }
    const uint32_t r = b_.add_rule("#" + at);
    for (size_t i = 0; i < s["anyOf"].size(); ++i) {
      absl::StatusOr<uint32_t> sub = schema(s["anyOf"][i], absl::StrCat(at, "/anyOf/", i));
      if (!sub.ok()) return sub.status();
      b_.add_alternative(r, {GrammarBuilder::ref(*sub)});
    }
    return r;
  }

  absl::StatusOr<uint32_t> object(const json& s, const std::string& at);
  absl::StatusOr<uint32_t> object_properties(const json& props, const std::set<std::string>& req,
                                             const std::string& at);
  absl::StatusOr<uint32_t> array(const json& s, const std::string& at);
  absl::StatusOr<int64_t> bound(const json& s, const char* key, const std::string& at);

  const json& doc_;
  GrammarBuilder& b_;
  JsonRules& j_;
  std::map<std::string, uint32_t> refs_;
};

absl::StatusOr<uint32_t> SchemaCompiler::object(const json& s, const std::string& at) {
  const json props = s.value("properties", json::object());
  if (!props.is_object()) return bad_keyword("properties", at, "an object");
  std::set<std::string> req;
  if (s.contains("required")) {
    if (!s["required"].is_array()) return bad_keyword("required", at, "an array of strings");
    for (const json& name : s["required"]) {
      if (!name.is_string()) return bad_keyword("required", at, "an array of strings");
      req.insert(name.get<std::string>());
    }
  }
  const json extra = s.value("additionalProperties", json());
  if (props.empty() && req.empty()) {
    if (extra.is_null() || extra == true) return j_.object();
    if (extra == false) {
      const uint32_t r = b_.add_rule("#" + at);
      b_.add_alternative(r, b_.literal("{}"));
      return r;
    }
    absl::StatusOr<uint32_t> v = schema(extra, at + "/additionalProperties");
    if (!v.ok()) return v.status();
    return j_.map_of(*v, "#" + at);
  }
  if (!extra.is_null() && extra != false) {
    return absl::InvalidArgumentError(
        absl::StrCat("additionalProperties at #", at, " must be false when properties are given"));
  }
  return object_properties(props, req, at);
}

// "{" then the properties in order, required ones always, optional ones present or not, "," between
// present ones, "}". Rules after[i][e]: properties i.. when e says one was already emitted.
absl::StatusOr<uint32_t> SchemaCompiler::object_properties(const json& props,
                                                           const std::set<std::string>& req,
                                                           const std::string& at) {
  struct Property {
    std::string key;  // the name as a JSON string
    uint32_t value;   // its schema's rule
    bool required;
  };
  std::vector<Property> kv;
  for (const auto& [name, sub] : props.items()) {
    absl::StatusOr<uint32_t> v = schema(sub, absl::StrCat(at, "/properties/", name));
    if (!v.ok()) return v.status();
    kv.push_back(
        {json(name).dump(-1, ' ', false, json::error_handler_t::replace), *v, req.count(name) > 0});
  }
  for (const std::string& name : req) {
    if (!props.contains(name)) return b_.add_rule("#" + at);  // required, never allowed: empty
  }
  const size_t n = kv.size();
  uint32_t after[2] = {b_.add_rule("#" + at + "/end"), 0};
  b_.add_alternative(after[0], {});
  after[1] = after[0];
  for (size_t i = n; i-- > 0;) {
    uint32_t now[2];
    for (int e = 0; e < 2; ++e) {
      now[e] = b_.add_rule(absl::StrCat("#", at, "/properties@", i, e ? "," : ""));
      Sequence present = e ? b_.literal(",") : Sequence{};
      b_.append_literal(kv[i].key + ":", present);
      present.insert(present.end(),
                     {GrammarBuilder::ref(kv[i].value), GrammarBuilder::ref(after[1])});
      b_.add_alternative(now[e], present);
      if (!kv[i].required) b_.add_alternative(now[e], {GrammarBuilder::ref(after[e])});
    }
    after[0] = now[0];
    after[1] = now[1];
  }
  const uint32_t r = b_.add_rule("#" + at);
  Sequence full = b_.literal("{");
  full.push_back(GrammarBuilder::ref(after[0]));
  b_.append_literal("}", full);
  b_.add_alternative(r, full);
  return r;
}

absl::StatusOr<int64_t> SchemaCompiler::bound(const json& s, const char* key,
                                              const std::string& at) {
  const json& v = s[key];
  if (!v.is_number_integer() || v.get<int64_t>() < 0) {
    return bad_keyword(key, at, "a non-negative integer");
  }
  return v.get<int64_t>();
}

absl::StatusOr<uint32_t> SchemaCompiler::array(const json& s, const std::string& at) {
  absl::StatusOr<uint32_t> item =
      s.contains("items") ? schema(s["items"], at + "/items") : j_.value();
  if (!item.ok()) return item.status();
  int64_t lo = 0, hi = -1;
  if (s.contains("minItems")) {
    absl::StatusOr<int64_t> v = bound(s, "minItems", at);
    if (!v.ok()) return v.status();
    lo = *v;
  }
  if (s.contains("maxItems")) {
    absl::StatusOr<int64_t> v = bound(s, "maxItems", at);
    if (!v.ok()) return v.status();
    hi = *v;
  }
  if (lo > kMaxArrayBound) return bad_keyword("minItems", at, "at most 1024");
  if (hi >= 0 && hi - lo > kMaxArrayBound)
    return bad_keyword("maxItems", at, "minItems + 1024 or less");
  const uint32_t r = b_.add_rule("#" + at);
  if (hi >= 0 && hi < lo) return r;  // no array fits: no alternatives
  const Sequence one = {GrammarBuilder::ref(*item)};
  Sequence more = b_.literal(",");
  more.push_back(GrammarBuilder::ref(*item));
  // The optional tail after the first max(lo, 1) items.
  const int64_t first = std::max<int64_t>(lo, 1);
  uint32_t tail;
  if (hi < 0) {
    tail = b_.star(more, "#" + at + "/more");
  } else {
    tail = b_.add_rule("#" + at + "/end");
    b_.add_alternative(tail, {});
    for (int64_t k = first; k < hi; ++k) {
      Sequence again = more;
      again.push_back(GrammarBuilder::ref(tail));
      tail = b_.optional(again, absl::StrCat("#", at, "/upto", hi - k));
    }
  }
  if (lo == 0) b_.add_alternative(r, b_.literal("[]"));
  if (hi != 0) {
    Sequence full = b_.literal("[");
    full.insert(full.end(), one.begin(), one.end());
    for (int64_t k = 1; k < first; ++k) full.insert(full.end(), more.begin(), more.end());
    full.push_back(GrammarBuilder::ref(tail));
    b_.append_literal("]", full);
    b_.add_alternative(r, full);
  }
  return r;
}

}  // namespace

absl::StatusOr<std::shared_ptr<const Grammar>> compile_json_schema(std::string_view schema_json) {
  json doc;
  try {
    doc = json::parse(schema_json);
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("the schema is not valid JSON: ", e.what()));
  }
  GrammarBuilder b;
  JsonRules j(b);
  absl::StatusOr<uint32_t> root = SchemaCompiler(doc, b, j).root();
  if (!root.ok()) return root.status();
  return std::move(b).build(*root);
}

namespace {

// tool_call_grammar's rules; `any_arguments`: every tool's arguments any JSON object.
absl::StatusOr<std::shared_ptr<const Grammar>> tool_calls(const std::vector<ToolSchema>& tools,
                                                          const ToolCallFormat& f,
                                                          bool any_arguments) {
  GrammarBuilder b;
  JsonRules j(b);
  const uint32_t call = b.add_rule("tool-call");
  for (const ToolSchema& t : tools) {
    uint32_t args = j.object();
    json doc = json::parse(t.parameters_json, nullptr, false);
    if (!any_arguments && !t.parameters_json.empty() && !doc.is_discarded()) {
      absl::StatusOr<uint32_t> r = SchemaCompiler(doc, b, j).root();
      if (r.ok()) args = *r;
    }
    GrammarBuilder::Sequence seq = b.literal(f.open);
    b.append_literal("{\"name\":" + json(t.name).dump() + ",\"arguments\":", seq);
    seq.push_back(GrammarBuilder::ref(args));
    b.append_literal("}" + f.close, seq);
    b.add_alternative(call, seq);
  }
  uint32_t root = call;
  if (f.parallel) {
    GrammarBuilder::Sequence more = b.literal(f.separator);
    more.push_back(GrammarBuilder::ref(call));
    const uint32_t rest = b.star(more, "more-tool-calls");
    root = b.add_rule("tool-calls");
    b.add_alternative(root, {GrammarBuilder::ref(call), GrammarBuilder::ref(rest)});
  }
  return std::move(b).build(root);
}

}  // namespace

absl::StatusOr<std::shared_ptr<const Grammar>> tool_call_grammar(
    const std::vector<ToolSchema>& tools, const ToolCallFormat& format) {
  if (tools.empty()) return absl::InvalidArgumentError("a tool-call grammar needs a tool");
  absl::StatusOr<std::shared_ptr<const Grammar>> g = tool_calls(tools, format, false);
  if (g.ok()) return g;
  return tool_calls(tools, format, true);  // a parameters schema the builder refused
}

std::shared_ptr<const Grammar> json_object_grammar() {
  static const std::shared_ptr<const Grammar> g = [] {
    GrammarBuilder b;
    JsonRules j(b);
    const uint32_t root = j.object();
    return *std::move(b).build(root);
  }();
  return g;
}

absl::StatusOr<std::shared_ptr<const Grammar>> choice_grammar(
    const std::vector<std::string>& choices) {
  if (choices.empty()) {
    return absl::InvalidArgumentError("guided_choice must hold at least one choice");
  }
  GrammarBuilder b;
  const uint32_t root = b.add_rule("choice");
  for (size_t i = 0; i < choices.size(); ++i) {
    if (choices[i].empty()) {
      return absl::InvalidArgumentError(absl::StrCat("guided_choice[", i, "] is empty"));
    }
    b.add_alternative(root, b.literal(choices[i]));
  }
  return std::move(b).build(root);
}

}  // namespace simpler::grammar
