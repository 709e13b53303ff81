// GBNF, llama.cpp's grammar notation (llama-server's `grammar`, vLLM's `guided_grammar`),
// compiled to grammars (grammar.h; docs/design/structured_outputs.md, "Regex and GBNF").
//
// The notation as llama.cpp's grammars/README.md describes it:
//   * rules `name ::= alternatives`, names of letters, digits, '-' and '_'; the start rule is
//     `root`; a rule may be used before it is defined; a rule ends at the end of its line, except
//     inside parentheses and after `|`;
//   * alternation `|`, groups `(...)`, repetition ?, *, +, {m}, {m,}, {m,n} (counts at most
//     kMaxGbnfRepeat);
//   * string literals "..." and character classes [...] / [^...] with ranges, with the escapes
//     \n \r \t \\ \" \[ \] \- \xHH \uHHHH \UHHHHHHHH (code points, not bytes), and `.` (any
//     character);
//   * comments from # to the end of the line.
// Terminals are Unicode code points; the grammar accepts their UTF-8 bytes.
//
// Cost: linear in the text, plus O(log lines) per group and repetition (their places come from
// an index of the line starts).
//
// Thread safety: a pure function (thread-safe).
#pragma once

#include <cstdint>
#include <memory>
#include <string_view>

#include "absl/status/statusor.h"
#include "simpler/grammar/grammar.h"

namespace simpler::grammar {

inline constexpr uint32_t kMaxGbnfRepeat = 10000;

// The grammar of the GBNF text `text`. INVALID_ARGUMENT, every parse error naming its place as
// "at L:C" (line and column from 1; the column counts bytes):
//   * "expected ::= after the rule name at L:C", "expected a rule name at L:C", "unterminated
//     string literal at L:C", "unterminated character class at L:C", "expected ) at L:C",
//     "unknown escape \q at L:C", "expected a newline or the end after the rule at L:C",
//     "repetition without a preceding item at L:C", "ill-formed UTF-8 at L:C", "a range in a
//     character class ends below its start at L:C", ...;
//   * "token references (<...>, !<...>) are not supported at L:C";
//   * "repetition count C at L:C is above kMaxGbnfRepeat";
//   * "rule 'x' is defined twice (at L:C and L:C)", "rule 'x' is used at L:C but never defined",
//     "the grammar has no 'root' rule";
//   * the builder's errors (grammar.h): "rule 'x' is left-recursive" (llama.cpp refuses left
//     recursion too; a generated rule is named after its rule and place, e.g. "root (repetition
//     at L:C)", a rule name past 48 bytes shortened to its first 48 and "..."), and "the grammar's
//     language is empty: rule 'root' derives no finite string";
//   * "the grammar is too large: more than N symbols".
absl::StatusOr<std::shared_ptr<const Grammar>> compile_gbnf(std::string_view text);

}  // namespace simpler::grammar
