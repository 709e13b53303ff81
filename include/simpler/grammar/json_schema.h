// JSON Schema and other structured-output requests compiled to grammars (grammar.h;
// docs/design/structured_outputs.md).
//
// The JSON Schema subset (draft 2020-12 keywords) every structured-output engine supports:
//   * type: "object", "array", "string", "integer", "number", "boolean", "null", or a list;
//   * object: properties (emitted in the schema's order), required, additionalProperties
//     (false, or absent: only the listed properties, as OpenAI's strict mode and xgrammar's
//     strict mode; with no properties, absent / true means any object and a schema means an
//     object whose values match it);
//   * array: items, minItems, maxItems (at most kMaxArrayBound each);
//   * enum and const (any JSON values; compared in their compact serialization), anyOf,
//     $ref to a JSON pointer inside the document ("#", "#/$defs/X", "#/definitions/X"), recursive
//     references included;
//   * annotations are ignored: title, description, $schema, $id, $comment, default, examples,
//     and $defs / definitions as containers.
// A schema without type, enum, const, anyOf or $ref is inferred as an object when it has object
// keywords, an array when it has array keywords, and any JSON value otherwise.
// Output is compact JSON (RFC 8259, no whitespace outside strings; strings are well-formed
// UTF-8 with JSON's escapes).
//
// Thread safety: pure functions (thread-safe).
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "simpler/grammar/grammar.h"

namespace simpler::grammar {

inline constexpr int64_t kMaxArrayBound = 1024;  // minItems, and maxItems − minItems

// The grammar of the JSON text `schema_json`. INVALID_ARGUMENT:
//   * "the schema is not valid JSON: ..." (the parser's message);
//   * "unsupported JSON Schema keyword 'K' at #/P" for any keyword outside the subset (P the JSON
//     pointer of the schema holding it, e.g. "#/properties/name");
//   * "JSON Schema keyword 'K' at #/P must be ..." for a keyword of the wrong shape (e.g. required
//     not a list of strings, minItems negative or above kMaxArrayBound, an unknown type name);
//   * "$ref 'R' at #/P does not point into this document" for a remote or dangling reference;
//   * "additionalProperties at #/P must be false when properties are given";
//   * the builder's errors (grammar.h), e.g. a schema no JSON value satisfies: "the grammar's
//     language is empty: rule '#' derives no finite string", and a $ref cycle that consumes no
//     input (X = {"anyOf": [..., {"$ref": X}]}): "rule '#/$defs/X' is left-recursive".
absl::StatusOr<std::shared_ptr<const Grammar>> compile_json_schema(std::string_view schema_json);

// Any JSON object (OpenAI's response_format {"type": "json_object"}).
std::shared_ptr<const Grammar> json_object_grammar();

// Tool calls as text blocks: `open` {"name":N,"arguments":A} `close`, N one of the tools' names
// (as a JSON string) and A a JSON object matching that tool's parameters schema (compiled as
// above; any JSON object when it has none or it falls outside the subset, so a client's
// richer schema never makes the request fail). With `parallel`, one or more blocks separated
// by `separator`; otherwise exactly one.
struct ToolSchema {
  std::string name;
  std::string parameters_json;  // a JSON Schema's text; empty: any object
};
struct ToolCallFormat {
  std::string open, close, separator;
  bool parallel = false;
};
// INVALID_ARGUMENT "a tool-call grammar needs a tool" for an empty list.
absl::StatusOr<std::shared_ptr<const Grammar>> tool_call_grammar(
    const std::vector<ToolSchema>& tools, const ToolCallFormat& format);

// Exactly one of `choices` (vLLM's guided_choice), as raw text. INVALID_ARGUMENT for an empty
// list ("guided_choice must hold at least one choice") or an empty string.
absl::StatusOr<std::shared_ptr<const Grammar>> choice_grammar(
    const std::vector<std::string>& choices);

}  // namespace simpler::grammar
