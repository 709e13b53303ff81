// Reading untrusted JSON without crashing, and quoting JSON in messages without unbounded output.
//
// nlohmann::json parses iteratively, but several of its operations recurse once per nesting level
// (dump(), copying, comparison), so a value nested 100,000 deep overflows the stack. Text read
// from a file or a socket goes through parse_json_bounded, which bounds the depth it accepts;
// messages quote values through quote_json_prefix, which never recurses and never exceeds its
// length bound; output that may hold bytes that are not UTF-8 is serialized with dump_replacing.
// All functions are thread-safe (no shared state).
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace simpler::base {

// The nesting depth parse_json_bounded accepts by default: containers inside containers, the
// top-level object or array counting as 1. Model files (config.json, tokenizer.json, safetensors
// headers) nest fewer than 10 levels.
inline constexpr int kJsonDefaultMaxDepth = 64;

// The longest message excerpt parse_json_bounded quotes from the parser's error.
inline constexpr size_t kJsonMaxErrorChars = 200;

// Parses `text` as one JSON value. `what` names the source (a file path, "file:line") and starts
// every error message. Refused, with INVALID_ARGUMENT:
//   * malformed JSON, including invalid UTF-8 in a string, a lone UTF-16 surrogate escape and a
//     number outside the double range (1e400): "<what>: malformed JSON: <parser's reason>"
//     (the reason quoted to at most kJsonMaxErrorChars characters);
//   * anything but whitespace after the value, including a NUL byte anywhere (nlohmann's lexer
//     would stop at it): "<what>: malformed JSON: NUL byte at offset N";
//   * containers nested deeper than `max_depth`: "<what>: JSON nested deeper than 64 levels at
//     /a/b" (the path of object keys to the too-deep value, array indices left out); parsing
//     stops at the first too-deep container, so the cost is bounded by the text's length;
//   * an object holding the same key twice (nlohmann would keep the last), found when the
//     object closes: "<what>: duplicate key 'k' in the object at /weight_map".
// Keys and paths in messages are cut to a few hundred characters.
// Every exception of nlohmann's family is caught; none leaves this function.
absl::StatusOr<nlohmann::json> parse_json_bounded(std::string_view text, std::string_view what,
                                                  int max_depth = kJsonDefaultMaxDepth);
// The same, objects keeping their keys in the text's order (nlohmann::ordered_json), for values
// rendered back as they were written (a chat request's tools, a tool call's arguments).
absl::StatusOr<nlohmann::ordered_json> parse_ordered_json_bounded(
    std::string_view text, std::string_view what, int max_depth = kJsonDefaultMaxDepth);

// parse_json_bounded's errors, for readers that parse untrusted JSON with nlohmann's SAX interface
// (nlohmann::json::sax_parse) under the same bounds and must report them in the same words (all
// INVALID_ARGUMENT, starting with `what`):
//   json_malformed_error: "<what>: malformed JSON: <e's reason>" (nlohmann's exception, as
//     passed to a SAX handler's parse_error, its "[json.exception...] " prefix dropped, cut to
//     kJsonMaxErrorChars characters);
//   json_nul_byte_error: "<what>: malformed JSON: NUL byte at offset N";
//   json_too_deep_error: "<what>: JSON nested deeper than N levels at <path>";
//   json_duplicate_key_error: "<what>: duplicate key '<key>' in the object at <path>".
// `path` is the object keys from the top to the place ("/a/b"; "/" at the top), array indices left
// out. Keys and paths are cut to a few hundred characters.
absl::Status json_malformed_error(std::string_view what, const nlohmann::json::exception& e);
absl::Status json_nul_byte_error(std::string_view what, size_t offset);
absl::Status json_too_deep_error(std::string_view what, int max_depth, std::string_view path);
absl::Status json_duplicate_key_error(std::string_view what, std::string_view key,
                                      std::string_view path);

// A compact JSON rendering of `value` cut to at most `max_chars` characters plus "..." when cut
// (never inside a UTF-8 sequence). Iterative: safe on a value of any depth, and it stops walking
// once the bound is reached, so the cost is O(max_chars) whatever the value's size. Bytes that
// are not UTF-8 are replaced with U+FFFD.
std::string quote_json_prefix(const nlohmann::json& value, size_t max_chars = 80);

// value.dump(indent) with nlohmann's replacing error handler: bytes that are not UTF-8 (a path, a
// library's callable names) become U+FFFD instead of throwing type_error 316. Recurses once per
// nesting level, so use it on values this program built or parsed with parse_json_bounded.
std::string dump_replacing(const nlohmann::json& value, int indent = -1);

}  // namespace simpler::base
