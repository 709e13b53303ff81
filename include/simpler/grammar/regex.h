// Regular expressions (vLLM's guided_regex) compiled to grammars (grammar.h;
// docs/design/structured_outputs.md, "Regex and GBNF").
//
// The whole output must match the pattern (as vLLM / outlines use it: a leading ^ and a trailing
// $ are accepted and change nothing). The syntax is the common subset of Python's `re` and PCRE2:
//   * literals (UTF-8), `.` (any character but \n), character classes `[...]` / `[^...]` with
//     ranges, and the escapes \d [0-9], \w [A-Za-z0-9_], \s [ \t\n\r\f\v] (ASCII, as PCRE2
//     without UCP, xgrammar and outlines-core take them) and \D \W \S, \n \t \r \f \v \a \e \0,
//     \xHH, \x{H...}, \uHHHH, \UHHHHHHHH and any escaped punctuation;
//   * groups `(...)`, `(?:...)`, `(?P<name>...)`, `(?<name>...)`, comments `(?#...)`,
//     alternation `|`;
//   * quantifiers ?, *, +, {m}, {m,}, {m,n} and Python's {,n}, each optionally lazy (`*?`: the
//     same language); counts at most kMaxRegexRepeat.
// A character is a Unicode code point; the grammar accepts its UTF-8 bytes.
//
// Thread safety: a pure function (thread-safe).
#pragma once

#include <cstdint>
#include <memory>
#include <string_view>

#include "absl/status/statusor.h"
#include "simpler/grammar/grammar.h"

namespace simpler::grammar {

inline constexpr uint32_t kMaxRegexRepeat = 10000;

// The grammar of the strings matching `pattern` in full. INVALID_ARGUMENT:
//   * "invalid regular expression: M at byte offset N" for a pattern PCRE2 refuses (M is
//     PCRE2's message, N its byte offset), ill-formed UTF-8 included;
//   * "unsupported regular expression construct: W at byte offset N" for what a grammar cannot
//     express or this subset leaves out, W naming it: "backreference \1", "named backreference
//     (?P=", "lookahead (?=", "negative lookahead (?!", "lookbehind (?<=", "negative lookbehind
//     (?<!", "atomic group (?>", "possessive quantifier", "inline flags (?i", "conditional (?(",
//     "recursion (?R", "branch reset (?|", "anchor ^ inside the pattern", "anchor $ inside the
//     pattern", "word boundary \b", "Unicode property \p", "POSIX class [:", "escape \K",
//     "groups and repetitions nested deeper than 250" (stacked quantifiers such as `a{1}{1}...`
//     or `((a*)*)*` count one level each; N is the offset of the group or quantifier past it),
//     ...;
//   * "repetition count C at byte offset N is above kMaxRegexRepeat";
//   * "the grammar is too large: more than N symbols" (e.g. nested large counts);
//   * the builder's "the grammar's language is empty: rule 'pattern' derives no finite string"
//     (e.g. `[^\x00-\x{10FFFF}]`).
absl::StatusOr<std::shared_ptr<const Grammar>> compile_regex(std::string_view pattern);

}  // namespace simpler::grammar
