// Internal to src/grammar: the expression trees the regex and GBNF front ends parse into, and
// their lowering to GrammarBuilder rules (docs/design/structured_outputs.md, "Regex and GBNF").
//
// Terminals are sets of Unicode code points (U+0000..U+10FFFF); a set is lowered to the
// well-formed UTF-8 byte sequences of its code points (surrogates have none), so the grammar
// stays a grammar over bytes.
//
// Thread safety: Expr trees are immutable once built (thread-safe to share); Lowerer is
// thread-compatible.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "simpler/grammar/grammar.h"

namespace simpler::grammar::internal {

inline constexpr uint32_t kMaxCodepoint = 0x10FFFF;

// Closed code point ranges, sorted, disjoint and not adjacent after normalize().
struct CodepointSet {
  std::vector<std::pair<uint32_t, uint32_t>> ranges;
  static CodepointSet of(uint32_t cp) { return range(cp, cp); }
  static CodepointSet range(uint32_t lo, uint32_t hi);
  CodepointSet& add(uint32_t lo, uint32_t hi);
  CodepointSet& add(const CodepointSet& other);
  void normalize();
  // Every code point of U+0000..U+10FFFF outside this set (normalized first).
  CodepointSet negated() const;
};

// One sequence of byte ranges: byte i of a sequence lies in [lo[i], hi[i]].
struct Utf8Range {
  int length = 0;
  uint8_t lo[4] = {}, hi[4] = {};
};
// The UTF-8 encodings of the code points in [lo, hi] as byte-range sequences (the algorithm of
// Rust's regex-syntax utf8 module: split at encoded-length boundaries, then at continuation-byte
// boundaries until each piece is a product of byte ranges). Surrogates are skipped.
void utf8_ranges(uint32_t lo, uint32_t hi, std::vector<Utf8Range>& out);
// The UTF-8 encoding of `cp` appended to `out`.
void append_utf8(uint32_t cp, std::string& out);
// Decodes the code point at `text[i]`, advancing `i`; false for ill-formed UTF-8 (then `i` is
// unchanged).
bool decode_utf8(std::string_view text, size_t& i, uint32_t& cp);

struct Expr;
using ExprPtr = std::shared_ptr<const Expr>;
inline constexpr uint32_t kUnbounded = UINT32_MAX;

struct Expr {
  enum class Kind : uint8_t { kSeq, kAlt, kSet, kRepeat, kRule };
  Kind kind = Kind::kSeq;
  std::vector<ExprPtr> items;  // kSeq / kAlt: the parts; kRepeat: the repeated item
  CodepointSet set;            // kSet
  uint32_t min = 0, max = 0;   // kRepeat: max may be kUnbounded
  uint32_t rule = 0;           // kRule: a rule id of the builder
  std::string name;            // the name of the rule it lowers to (for error messages)
  uint32_t depth = 1;          // 1 + the deepest part's depth
  // Set by non_empty() in place of a rewrite that would copy more parts than a grammar may
  // hold (kMaxSymbols): the Lowerer refuses it as too large without building it.
  bool too_large = false;
};

// The deepest expression tree the front ends build: the tree functions below recurse on it.
inline constexpr uint32_t kMaxExprDepth = 1000;

ExprPtr seq(std::vector<ExprPtr> items);
ExprPtr alt(std::vector<ExprPtr> items, std::string name);
ExprPtr set(CodepointSet s);
ExprPtr repeat(ExprPtr item, uint32_t min, uint32_t max, std::string name);
ExprPtr rule_ref(uint32_t rule);

// True when the expression matches the empty string (rule references count as non-empty: the
// builder finds left recursion through them).
bool nullable(const ExprPtr& e);
// An expression for the non-empty strings of `e`, or nullptr when it has none. Used under
// repetition: x* is lowered as (x without ε)*, so a repeated nullable group does not become a
// left-recursive rule.
ExprPtr non_empty(const ExprPtr& e);

// "L:C" places (line and column from 1, the column in bytes) of offsets into one text: the
// line starts are indexed once, so a place costs O(log lines) however far into the text it is.
// `steps()` counts the binary-search steps taken so far (the work, for tests).
class LineIndex {
 public:
  explicit LineIndex(std::string_view text);
  std::string where(size_t at) const;
  int64_t steps() const { return steps_; }

 private:
  std::vector<size_t> starts_;  // offset of each line's first byte; starts_[0] = 0
  size_t size_ = 0;
  mutable int64_t steps_ = 0;
};

// The name a generated rule gives for the rule it belongs to: `name` itself up to
// kMaxNameInPlace bytes, else its first kMaxNameInPlace bytes and "...", so that generated
// names stay short however long the rule's name is.
inline constexpr size_t kMaxNameInPlace = 48;
std::string short_rule_name(std::string_view name);

// compile_gbnf (gbnf.h), also giving the LineIndex steps its places took (the work, for tests).
absl::StatusOr<std::shared_ptr<const Grammar>> compile_gbnf_counting(std::string_view text,
                                                                     int64_t& place_steps);

// Lowers expressions into `b`. A lowered expression is a sequence of symbols; alternation,
// repetition and multi-byte sets become rules. The total number of symbols is bounded:
// INVALID_ARGUMENT "the grammar is too large: more than N symbols" past kMaxSymbols.
class Lowerer {
 public:
  static constexpr int64_t kMaxSymbols = int64_t{1} << 21;
  explicit Lowerer(GrammarBuilder& b) : b_(b) {}
  absl::Status lower(const ExprPtr& e, GrammarBuilder::Sequence& out);
  // Adds `e` as one alternative of `rule`.
  absl::Status add_alternative(uint32_t rule, const ExprPtr& e);

 private:
  absl::Status lower_set(const Expr& e, GrammarBuilder::Sequence& out);
  absl::Status lower_alt(const Expr& e, GrammarBuilder::Sequence& out);
  absl::Status lower_repeat(const Expr& e, GrammarBuilder::Sequence& out);
  absl::Status add(uint32_t rule, const GrammarBuilder::Sequence& s);
  static absl::Status too_large();
  GrammarBuilder& b_;
  int64_t symbols_ = 0;
  // Expressions lowered to one symbol (a rule or a byte class), shared subtrees lowered once.
  absl::flat_hash_map<const Expr*, Symbol> memo_;
  std::vector<ExprPtr> keep_;
};

}  // namespace simpler::grammar::internal
