#include "simpler/grammar/grammar.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace simpler::grammar {

ByteClass ByteClass::range(uint8_t lo, uint8_t hi) {
  ByteClass c;
  c.add(lo, hi);
  return c;
}

ByteClass& ByteClass::add(uint8_t lo, uint8_t hi) {
  for (int b = lo; b <= hi; ++b) bits[b >> 6] |= uint64_t{1} << (b & 63);
  return *this;
}

// ---- builder ---------------------------------------------------------------------------------

uint32_t GrammarBuilder::add_rule(std::string name) {
  rules_.emplace_back();
  names_.push_back(std::move(name));
  return static_cast<uint32_t>(rules_.size() - 1);
}

void GrammarBuilder::add_alternative(uint32_t rule, const Sequence& sequence) {
  rules_.at(rule).push_back(sequence);
}

Symbol GrammarBuilder::bytes(const ByteClass& c) {
  const auto [it, inserted] = class_index_.try_emplace(c, static_cast<uint32_t>(classes_.size()));
  if (inserted) classes_.push_back(c);
  return Symbol{Symbol::Kind::kBytes, it->second};
}

void GrammarBuilder::append_literal(std::string_view text, Sequence& out) {
  for (char ch : text) out.push_back(bytes(ByteClass::of(static_cast<uint8_t>(ch))));
}

GrammarBuilder::Sequence GrammarBuilder::literal(std::string_view text) {
  Sequence s;
  append_literal(text, s);
  return s;
}

uint32_t GrammarBuilder::star(const Sequence& item, std::string name) {
  const uint32_t r = add_rule(std::move(name));
  Sequence again = item;
  again.push_back(ref(r));
  add_alternative(r, again);
  add_alternative(r, {});
  return r;
}

uint32_t GrammarBuilder::optional(const Sequence& s, std::string name) {
  const uint32_t r = add_rule(std::move(name));
  add_alternative(r, s);
  add_alternative(r, {});
  return r;
}

namespace {

// Fixed point of "rule r has an alternative whose every symbol satisfies `sym_ok`".
template <typename F>
std::vector<bool> fixed_point(const std::vector<std::vector<GrammarBuilder::Sequence>>& rules,
                              F sym_ok) {
  std::vector<bool> ok(rules.size(), false);
  for (bool changed = true; changed;) {
    changed = false;
    for (size_t r = 0; r < rules.size(); ++r) {
      if (ok[r]) continue;
      for (const auto& alt : rules[r]) {
        if (std::all_of(alt.begin(), alt.end(), [&](const Symbol& s) { return sym_ok(s, ok); })) {
          ok[r] = changed = true;
          break;
        }
      }
    }
  }
  return ok;
}

// INVALID_ARGUMENT naming a rule on a cycle of "r can start with rule s" (s after only nullable
// symbols): left recursion, which the stack parser cannot expand.
absl::Status check_left_recursion(const std::vector<std::vector<GrammarBuilder::Sequence>>& rules,
                                  const std::vector<std::string>& names,
                                  const std::vector<bool>& nullable) {
  const size_t n = rules.size();
  std::vector<std::vector<uint32_t>> first(n);
  for (size_t r = 0; r < n; ++r) {
    for (const GrammarBuilder::Sequence& alt : rules[r]) {
      for (const Symbol& s : alt) {
        if (s.kind != Symbol::Kind::kRule) break;
        first[r].push_back(s.arg);
        if (!nullable[s.arg]) break;
      }
    }
  }
  std::vector<uint8_t> color(n, 0);  // 0 new, 1 on the path, 2 done
  for (uint32_t start = 0; start < n; ++start) {
    if (color[start] != 0) continue;
    std::vector<std::pair<uint32_t, size_t>> path{{start, 0}};
    color[start] = 1;
    while (!path.empty()) {
      auto& [r, next] = path.back();
      if (next == first[r].size()) {
        color[r] = 2;
        path.pop_back();
        continue;
      }
      const uint32_t s = first[r][next++];
      if (color[s] == 1) {
        return absl::InvalidArgumentError(absl::StrCat("rule '", names[s], "' is left-recursive"));
      }
      if (color[s] == 0) {
        color[s] = 1;
        path.emplace_back(s, 0);
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::shared_ptr<const Grammar>> GrammarBuilder::build(uint32_t root) && {
  const size_t n = rules_.size();
  if (root >= n) {
    return absl::InvalidArgumentError(
        absl::StrCat("root rule ", root, " is outside the ", n, " rules"));
  }
  for (size_t r = 0; r < n; ++r) {
    for (const Sequence& alt : rules_[r]) {
      for (const Symbol& s : alt) {
        if (s.kind == Symbol::Kind::kRule && s.arg >= n) {
          return absl::InvalidArgumentError(absl::StrCat("rule '", names_[r], "' refers to rule ",
                                                         s.arg, ", which is undefined"));
        }
        if (s.kind == Symbol::Kind::kBytes && classes_.at(s.arg).empty()) {
          return absl::InvalidArgumentError(
              absl::StrCat("rule '", names_[r], "' has an empty byte class"));
        }
      }
    }
  }
  // Productive rules derive a finite byte string; alternatives using an unproductive rule can
  // never complete, so they are dropped (every prefix the parser accepts then extends to a
  // sentence, which makes the mask exact).
  const std::vector<bool> productive = fixed_point(rules_, [](const Symbol& s, const auto& ok) {
    return s.kind != Symbol::Kind::kRule || ok[s.arg];
  });
  if (!productive[root]) {
    return absl::InvalidArgumentError(absl::StrCat("the grammar's language is empty: rule '",
                                                   names_[root], "' derives no finite string"));
  }
  for (size_t r = 0; r < n; ++r) {
    std::erase_if(rules_[r], [&](const Sequence& alt) {
      return std::any_of(alt.begin(), alt.end(), [&](const Symbol& s) {
        return s.kind == Symbol::Kind::kRule && !productive[s.arg];
      });
    });
  }
  const std::vector<bool> nullable = fixed_point(rules_, [](const Symbol& s, const auto& ok) {
    return s.kind == Symbol::Kind::kRule && ok[s.arg];
  });
  if (absl::Status s = check_left_recursion(rules_, names_, nullable); !s.ok()) return s;
  auto g = std::make_shared<Grammar>();
  g->classes_ = std::move(classes_);
  g->names_ = std::move(names_);
  g->root_ = root;
  g->rules_.resize(n);
  for (size_t r = 0; r < n; ++r) {
    for (const Sequence& alt : rules_[r]) {
      g->rules_[r].push_back(static_cast<uint32_t>(g->symbols_.size()));
      g->symbols_.insert(g->symbols_.end(), alt.begin(), alt.end());
      g->symbols_.push_back(Symbol{});
    }
  }
  GrammarMatcher::Stacks first;
  if (!GrammarMatcher::start(*g, first)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the grammar is too ambiguous: the places its first byte can come from take more than ",
        GrammarMatcher::kExpansionBudget, " steps to list (rule '", g->names_[root], "')"));
  }
  return std::shared_ptr<const Grammar>(std::move(g));
}

// ---- matcher ---------------------------------------------------------------------------------

namespace {

// Expands `s` until each top is a byte class (or the stack is empty) and adds the results to
// `out`. Terminates: the grammar has no left recursion. Iterative, with a work list, and bounded:
// each symbol it visits costs one unit of `budget` (the expansion of a state is
// GrammarMatcher::kExpansionBudget in all); false when the budget ran out. A grammar can make
// the stacks of one position exponential in its size (`r1 ::= r2 r2`, ..., `r30 ::= "a" | ""`
// has 2^30 places the first byte can come from): the budget keeps that from stalling the thread
// that steps it.
bool expand(const Grammar& g, GrammarMatcher::Stack s, GrammarMatcher::Stacks& out,
            int64_t& budget) {
  const std::vector<Symbol>& sym = g.symbols();
  std::vector<GrammarMatcher::Stack> work;
  work.push_back(std::move(s));
  while (!work.empty()) {
    GrammarMatcher::Stack cur = std::move(work.back());
    work.pop_back();
    bool expanding = true;
    while (expanding) {
      if (--budget < 0) return false;
      if (cur.empty()) {
        out.push_back(std::move(cur));
        break;
      }
      const uint32_t pos = cur.back();
      switch (sym[pos].kind) {
        case Symbol::Kind::kEnd:
          cur.pop_back();
          break;
        case Symbol::Kind::kBytes:
          out.push_back(std::move(cur));
          expanding = false;
          break;
        case Symbol::Kind::kRule: {
          cur.pop_back();
          // Tail position: the caller's continuation is not kept (right recursion stays flat).
          if (sym[pos + 1].kind != Symbol::Kind::kEnd) cur.push_back(pos + 1);
          const std::vector<uint32_t>& alts = g.alternatives(sym[pos].arg);
          for (size_t i = 0; i + 1 < alts.size(); ++i) {
            GrammarMatcher::Stack c = cur;
            c.push_back(alts[i]);
            work.push_back(std::move(c));
          }
          cur.push_back(alts.back());
          break;
        }
      }
    }
  }
  return true;
}

void normalize(GrammarMatcher::Stacks& stacks) {
  std::sort(stacks.begin(), stacks.end());
  stacks.erase(std::unique(stacks.begin(), stacks.end()), stacks.end());
}

}  // namespace

bool GrammarMatcher::start(const Grammar& g, Stacks& out) {
  out.clear();
  int64_t budget = kExpansionBudget;
  for (uint32_t alt : g.alternatives(g.root())) {
    if (!expand(g, {alt}, out, budget)) {
      out.clear();
      return false;
    }
  }
  normalize(out);
  return true;
}

GrammarMatcher::GrammarMatcher(std::shared_ptr<const Grammar> grammar)
    : grammar_(std::move(grammar)) {
  // Grammars past the budget at their start are refused when built (GrammarBuilder::build).
  (void)start(*grammar_, stacks_);
}

void GrammarMatcher::step(const Grammar& g, const Stacks& in, uint8_t byte, Stacks& out) {
  out.clear();
  int64_t budget = kExpansionBudget;
  for (const Stack& s : in) {
    if (s.empty()) continue;
    const Symbol& top = g.symbols()[s.back()];
    if (!g.classes()[top.arg].has(byte)) continue;
    Stack c = s;
    c.back() += 1;
    if (!expand(g, std::move(c), out, budget)) {
      out.clear();  // past the budget: a dead end, as if no stack took the byte
      return;
    }
  }
  if (out.size() > 1) normalize(out);
}

bool GrammarMatcher::advance(std::string_view bytes) {
  Stacks cur = stacks_, next;
  for (char ch : bytes) {
    step(*grammar_, cur, static_cast<uint8_t>(ch), next);
    if (next.empty()) return false;
    cur.swap(next);
  }
  stacks_ = std::move(cur);
  return true;
}

bool GrammarMatcher::complete() const {
  return std::any_of(stacks_.begin(), stacks_.end(), [](const Stack& s) { return s.empty(); });
}

bool GrammarMatcher::can_continue() const {
  return std::any_of(stacks_.begin(), stacks_.end(), [](const Stack& s) { return !s.empty(); });
}

// ---- token index -----------------------------------------------------------------------------

TokenIndex::TokenIndex(const std::vector<std::string>& token_bytes)
    : vocab_(static_cast<int64_t>(token_bytes.size())) {
  std::vector<int32_t> order;
  for (size_t id = 0; id < token_bytes.size(); ++id) {
    if (!token_bytes[id].empty()) order.push_back(static_cast<int32_t>(id));
  }
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    return token_bytes[a] != token_bytes[b] ? token_bytes[a] < token_bytes[b] : a < b;
  });
  byte_.push_back(0);
  depth_.push_back(0);
  std::vector<uint32_t> path{0};  // the node at each depth of the previous token
  std::vector<uint32_t> token_node;
  const std::string* prev = nullptr;
  for (int32_t id : order) {
    const std::string& s = token_bytes[id];
    size_t l = 0;
    if (prev != nullptr) {
      while (l < prev->size() && l < s.size() && (*prev)[l] == s[l]) ++l;
    }
    path.resize(l + 1);
    for (size_t d = l; d < s.size(); ++d) {
      path.push_back(static_cast<uint32_t>(byte_.size()));
      byte_.push_back(static_cast<uint8_t>(s[d]));
      depth_.push_back(static_cast<uint32_t>(d + 1));
    }
    token_node.push_back(path.back());
    token_ids_.push_back(id);
    prev = &s;
  }
  const size_t n = byte_.size();
  // token_node is non-decreasing (sorted order is preorder): CSR offsets per node.
  token_begin_.assign(n + 1, 0);
  for (uint32_t node : token_node) ++token_begin_[node + 1];
  for (size_t i = 0; i < n; ++i) token_begin_[i + 1] += token_begin_[i];
  skip_.assign(n, static_cast<uint32_t>(n));
  std::vector<uint32_t> open;
  for (uint32_t i = 0; i < n; ++i) {
    while (!open.empty() && depth_[open.back()] >= depth_[i]) {
      skip_[open.back()] = i;
      open.pop_back();
    }
    open.push_back(i);
  }
}

namespace {

// The parser states one mask walk meets, interned, with the transitions between them memoized:
// most trie nodes repeat a (state, byte) pair already seen (inside a JSON string every plain
// character leads back to the same state), so a node usually costs one hash lookup.
class StateCache {
 public:
  static constexpr uint32_t kDead = UINT32_MAX;
  StateCache(const Grammar& g, const GrammarMatcher::Stacks& start) : g_(g) { intern(start); }
  uint32_t next(uint32_t state, uint8_t byte) {
    const uint64_t key = (uint64_t{state} << 8) | byte;
    if (auto it = trans_.find(key); it != trans_.end()) return it->second;
    GrammarMatcher::step(g_, states_[state], byte, scratch_);
    const uint32_t to = scratch_.empty() ? kDead : intern(scratch_);
    trans_.emplace(key, to);
    return to;
  }

 private:
  uint32_t intern(const GrammarMatcher::Stacks& s) {
    auto [it, fresh] = ids_.try_emplace(s, static_cast<uint32_t>(states_.size()));
    if (fresh) states_.push_back(s);
    return it->second;
  }
  const Grammar& g_;
  std::vector<GrammarMatcher::Stacks> states_;
  absl::flat_hash_map<GrammarMatcher::Stacks, uint32_t> ids_;
  absl::flat_hash_map<uint64_t, uint32_t> trans_;
  GrammarMatcher::Stacks scratch_;
};

}  // namespace

void TokenIndex::fill_mask(const GrammarMatcher& m, uint32_t* mask) const {
  std::memset(mask, 0, static_cast<size_t>(mask_words()) * sizeof(uint32_t));
  StateCache cache(m.grammar(), m.stacks());
  std::vector<uint32_t> state(1, 0);  // the state at each depth of the walk
  const uint32_t n = static_cast<uint32_t>(byte_.size());
  uint32_t i = 1;
  while (i < n) {
    const uint32_t d = depth_[i];
    if (state.size() <= d) state.resize(d + 1);
    state[d] = cache.next(state[d - 1], byte_[i]);
    if (state[d] == StateCache::kDead) {
      i = skip_[i];
      continue;
    }
    for (uint32_t k = token_begin_[i]; k < token_begin_[i + 1]; ++k) {
      const int32_t id = token_ids_[k];
      mask[id >> 5] |= uint32_t{1} << (id & 31);
    }
    ++i;
  }
}

}  // namespace simpler::grammar
