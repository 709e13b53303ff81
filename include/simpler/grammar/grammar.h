// Grammars over bytes, their incremental parser and the per-step token mask
// (docs/design/structured_outputs.md).
//
// A Grammar is a set of rules; a rule is a list of alternatives, an alternative a sequence of
// symbols, a symbol either a byte class (a set of bytes) or a reference to a rule. It is a
// context-free grammar over bytes, without left recursion (the builder refuses it) and with a
// non-empty language (the builder refuses a root that derives no finite string). The parser is
// llama.cpp's (llama-grammar.cpp): its state is a set of stacks of positions, each stack's top a
// byte class; a byte keeps the stacks whose top holds it.
//
// Thread safety: Grammar and TokenIndex are immutable after construction (thread-safe to share);
// GrammarMatcher is thread-compatible (one owner at a time; copies are independent).
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"

namespace simpler::grammar {

// A set of bytes (bit b of word b / 64).
struct ByteClass {
  std::array<uint64_t, 4> bits{};
  static ByteClass of(uint8_t b) { return range(b, b); }
  static ByteClass range(uint8_t lo, uint8_t hi);  // [lo, hi]; empty when lo > hi
  ByteClass& add(uint8_t lo, uint8_t hi);
  bool has(uint8_t b) const { return (bits[b >> 6] >> (b & 63)) & 1; }
  bool empty() const { return (bits[0] | bits[1] | bits[2] | bits[3]) == 0; }
  bool operator==(const ByteClass&) const = default;
  template <typename H>
  friend H AbslHashValue(H h, const ByteClass& c) {
    return H::combine(std::move(h), c.bits);
  }
};

// One symbol of an alternative.
struct Symbol {
  enum class Kind : uint8_t { kEnd, kBytes, kRule };
  Kind kind = Kind::kEnd;
  uint32_t arg = 0;  // kBytes: index into Grammar::classes(); kRule: rule id
};

class Grammar {
 public:
  // The flat symbol array: every alternative's symbols followed by a kEnd.
  const std::vector<Symbol>& symbols() const { return symbols_; }
  const std::vector<ByteClass>& classes() const { return classes_; }
  // Start positions (indices into symbols()) of rule r's alternatives.
  const std::vector<uint32_t>& alternatives(uint32_t r) const { return rules_[r]; }
  const std::string& rule_name(uint32_t r) const { return names_[r]; }
  uint32_t num_rules() const { return static_cast<uint32_t>(rules_.size()); }
  uint32_t root() const { return root_; }

 private:
  friend class GrammarBuilder;
  std::vector<Symbol> symbols_;
  std::vector<ByteClass> classes_;
  std::vector<std::vector<uint32_t>> rules_;
  std::vector<std::string> names_;
  uint32_t root_ = 0;
};

// Builds a Grammar. Thread-compatible.
class GrammarBuilder {
 public:
  using Sequence = std::vector<Symbol>;
  // A new rule without alternatives yet; `name` is used in error messages.
  uint32_t add_rule(std::string name);
  void add_alternative(uint32_t rule, const Sequence& sequence);
  Symbol bytes(const ByteClass& c);
  static Symbol ref(uint32_t rule) { return Symbol{Symbol::Kind::kRule, rule}; }
  // The bytes of `text`, one single-byte class each, appended to `out`.
  void append_literal(std::string_view text, Sequence& out);
  Sequence literal(std::string_view text);
  // A rule matching `item` zero or more times (right recursion: R ::= item R | ε).
  uint32_t star(const Sequence& item, std::string name);
  // A rule matching `s` or nothing.
  uint32_t optional(const Sequence& s, std::string name);
  uint32_t num_rules() const { return static_cast<uint32_t>(rules_.size()); }

  // The grammar with `root` as its start rule. A rule without alternatives matches nothing;
  // alternatives that use a rule deriving no finite byte string are dropped, so every prefix
  // the parser accepts extends to a sentence. INVALID_ARGUMENT naming the rule for: a root
  // outside the rules, a reference to an undefined rule, an empty byte class, left recursion
  // ("rule 'R' is left-recursive"), a root that derives no finite byte string ("the
  // grammar's language is empty: rule 'R' derives no finite string"), and a start whose
  // expansion passes GrammarMatcher::kExpansionBudget ("the grammar is too ambiguous: ...").
  absl::StatusOr<std::shared_ptr<const Grammar>> build(uint32_t root) &&;

 private:
  std::vector<std::vector<Sequence>> rules_;
  std::vector<std::string> names_;
  std::vector<ByteClass> classes_;
  absl::flat_hash_map<ByteClass, uint32_t> class_index_;  // classes_[i] -> i
};

// The incremental parser: which byte strings keep the input a prefix of a sentence.
class GrammarMatcher {
 public:
  using Stack = std::vector<uint32_t>;  // positions into Grammar::symbols(), top last
  using Stacks = std::vector<Stack>;    // sorted, unique; each top is a kBytes symbol (or empty)

  explicit GrammarMatcher(std::shared_ptr<const Grammar> grammar);
  // Advances by `bytes` if the input stays a valid prefix; returns false and leaves the state
  // unchanged otherwise.
  bool advance(std::string_view bytes);
  // True when the input so far is a complete sentence (end of input is allowed here).
  bool complete() const;
  // True when some byte may follow (false: only the end of input is allowed).
  bool can_continue() const;
  const Stacks& stacks() const { return stacks_; }
  const Grammar& grammar() const { return *grammar_; }

  // The symbols one state's expansion may visit (the stacks it lists, and the rules it passes
  // through to reach them). A grammar can make the stacks of one position exponential in its
  // size; a step past this is a dead end (as a refused byte), and a grammar past it at its start
  // is refused by GrammarBuilder::build.
  static constexpr int64_t kExpansionBudget = int64_t{1} << 18;

  // `in` advanced by one byte into `out` (empty: refused, or past kExpansionBudget). Pure;
  // thread-safe for a shared grammar.
  static void step(const Grammar& g, const Stacks& in, uint8_t byte, Stacks& out);
  // The stacks before any input into `out`; false (and `out` empty) past kExpansionBudget.
  static bool start(const Grammar& g, Stacks& out);

 private:
  std::shared_ptr<const Grammar> grammar_;
  Stacks stacks_;
};

// The vocabulary's decoded bytes as a trie, for the per-step mask. Tokens whose bytes are empty
// (special tokens) are never allowed by a grammar.
class TokenIndex {
 public:
  // token_bytes[id]: the bytes token `id` decodes to (empty for special tokens).
  explicit TokenIndex(const std::vector<std::string>& token_bytes);
  int64_t vocab_size() const { return vocab_; }
  int64_t num_nodes() const { return static_cast<int64_t>(byte_.size()); }
  // Words of a mask: (vocab_size + 31) / 32.
  int64_t mask_words() const { return (vocab_ + 31) / 32; }
  // Sets bit t of mask[t / 32] for each token whose bytes keep `m`'s input a valid prefix and
  // clears every other bit. `mask` holds mask_words() words. Cost: one hash lookup per trie
  // node whose prefix is a valid continuation, and one GrammarMatcher::step per distinct
  // (parser state, byte) pair the walk meets (states are interned per call).
  void fill_mask(const GrammarMatcher& m, uint32_t* mask) const;

 private:
  int64_t vocab_ = 0;
  // Nodes in preorder (node 0 is the root): the edge byte into it, its depth, the first node
  // after its subtree, and its tokens (token_ids_[token_begin_[i] .. token_begin_[i + 1])).
  std::vector<uint8_t> byte_;
  std::vector<uint32_t> depth_, skip_, token_begin_;
  std::vector<int32_t> token_ids_;
};

}  // namespace simpler::grammar
