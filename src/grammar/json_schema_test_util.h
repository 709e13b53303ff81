// Test helpers for structured outputs: a validator for the JSON Schema subset of json_schema.h,
// written from the spec (JSON Schema 2020-12 validation: type, properties, required,
// additionalProperties, items, minItems, maxItems, enum, const, anyOf, $ref), independent of the
// grammar compiler; and a generator of random schemas in that subset.
#pragma once

#include <cmath>
#include <random>
#include <regex>
#include <string>
#include <vector>

#include "nlohmann/json.hpp"

namespace simpler::grammar::testing {

using ojson = nlohmann::ordered_json;

inline bool json_equal(const ojson& a, const ojson& b) {
  if (a.is_number() && b.is_number()) return a.get<double>() == b.get<double>();
  return nlohmann::json::parse(a.dump()) == nlohmann::json::parse(b.dump());
}

inline bool has_json_type(const ojson& v, const std::string& t) {
  if (t == "object") return v.is_object();
  if (t == "array") return v.is_array();
  if (t == "string") return v.is_string();
  if (t == "integer") {
    return v.is_number_integer() ||
           (v.is_number_float() && std::floor(v.get<double>()) == v.get<double>());
  }
  if (t == "number") return v.is_number();
  if (t == "boolean") return v.is_boolean();
  if (t == "null") return v.is_null();
  return false;
}

// True when `v` satisfies `s` (a schema of `root`). Unknown keywords make it false, so a test
// never passes on a keyword the validator does not check.
inline bool validate(const ojson& v, const ojson& s, const ojson& root) {
  if (s.is_boolean()) return s.get<bool>();
  for (const auto& [k, kv] : s.items()) {
    if (k == "$ref") {
      const std::string ref = kv.get<std::string>();
      if (!validate(v, root.at(ojson::json_pointer(ref.substr(1))), root)) return false;
    } else if (k == "type") {
      const ojson list = kv.is_array() ? kv : ojson::array({kv});
      bool any = false;
      for (const ojson& t : list) any = any || has_json_type(v, t.get<std::string>());
      if (!any) return false;
    } else if (k == "enum") {
      bool any = false;
      for (const ojson& e : kv) any = any || json_equal(v, e);
      if (!any) return false;
    } else if (k == "const") {
      if (!json_equal(v, kv)) return false;
    } else if (k == "anyOf") {
      bool any = false;
      for (const ojson& sub : kv) any = any || validate(v, sub, root);
      if (!any) return false;
    } else if (k == "properties" && v.is_object()) {
      for (const auto& [name, sub] : kv.items()) {
        if (v.contains(name) && !validate(v[name], sub, root)) return false;
      }
    } else if (k == "required" && v.is_object()) {
      for (const ojson& name : kv) {
        if (!v.contains(name.get<std::string>())) return false;
      }
    } else if (k == "additionalProperties" && v.is_object()) {
      const ojson props = s.value("properties", ojson::object());
      for (const auto& [name, val] : v.items()) {
        if (!props.contains(name) && !validate(val, kv, root)) return false;
      }
    } else if (k == "items" && v.is_array()) {
      for (const ojson& e : v) {
        if (!validate(e, kv, root)) return false;
      }
    } else if (k == "minItems" && v.is_array()) {
      if (static_cast<int64_t>(v.size()) < kv.get<int64_t>()) return false;
    } else if (k == "maxItems" && v.is_array()) {
      if (static_cast<int64_t>(v.size()) > kv.get<int64_t>()) return false;
    } else if (k != "$defs" && k != "title" && k != "description" && k != "properties" &&
               k != "required" && k != "additionalProperties" && k != "items" && k != "minItems" &&
               k != "maxItems") {
      return false;
    }
  }
  return true;
}

// Parses an output. A valid JSON number beyond double's range (e.g. 5e1210127552), which
// nlohmann-json refuses, is validated with its exponent made 0 (the grammar allows any exponent,
// as RFC 8259 does). Throws what the parser throws for anything else.
inline ojson parse_output(const std::string& out) {
  try {
    return ojson::parse(out);
  } catch (const nlohmann::json::out_of_range&) {
    return ojson::parse(std::regex_replace(out, std::regex("[eE][-+]?[0-9]+"), "e0"));
  }
}

// A random schema of the subset, at most `depth` levels deep. `defs` collects $defs the schema
// may refer to (a random subschema is sometimes moved there and referenced).
inline ojson random_schema(std::mt19937_64& rng, int depth, ojson& defs) {
  auto pick = [&](int n) { return static_cast<int>(rng() % static_cast<uint64_t>(n)); };
  const int kind = depth <= 0 ? 2 + pick(6) : pick(9);
  ojson s;
  switch (kind) {
    case 0: {
      s["type"] = "object";
      ojson props = ojson::object();
      ojson req = ojson::array();
      const int n = 1 + pick(4);
      for (int i = 0; i < n; ++i) {
        const std::string name = std::string(1, static_cast<char>('a' + i)) + "\u00e9";
        props[name] = random_schema(rng, depth - 1, defs);
        if (pick(2) == 0) req.push_back(name);
      }
      s["properties"] = props;
      s["required"] = req;
      s["additionalProperties"] = false;
      break;
    }
    case 1: {
      s["type"] = "array";
      s["items"] = random_schema(rng, depth - 1, defs);
      const int lo = pick(3);
      if (pick(2) == 0) s["minItems"] = lo;
      if (pick(2) == 0) s["maxItems"] = lo + pick(3);
      break;
    }
    case 2:
      s["type"] = "string";
      if (pick(2) == 0) s["enum"] = ojson::array({"red", "gr\"een", "\u00fc\u00df", 7});
      break;
    case 3:
      s["type"] = pick(2) == 0 ? "integer" : "number";
      break;
    case 4:
      s["type"] = pick(2) == 0 ? "boolean" : "null";
      break;
    case 5:
      s["const"] = pick(2) == 0 ? ojson("fixed") : ojson::parse(R"({"k":[1,2.5,null]})");
      break;
    case 6:
      s["type"] = ojson::array({"integer", "null"});
      break;
    case 7:
      s["anyOf"] =
          ojson::array({random_schema(rng, depth - 1, defs), random_schema(rng, depth - 1, defs)});
      break;
    default: {
      const std::string name = "d" + std::to_string(defs.size());
      defs[name] = true;  // reserved before the recursion picks names
      defs[name] = random_schema(rng, depth - 1, defs);
      s["$ref"] = "#/$defs/" + name;
      break;
    }
  }
  return s;
}

}  // namespace simpler::grammar::testing
