#include "grammar/expr.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace simpler::grammar::internal {

CodepointSet CodepointSet::range(uint32_t lo, uint32_t hi) {
  CodepointSet s;
  s.add(lo, hi);
  return s;
}

CodepointSet& CodepointSet::add(uint32_t lo, uint32_t hi) {
  if (lo <= hi) ranges.emplace_back(lo, std::min(hi, kMaxCodepoint));
  return *this;
}

CodepointSet& CodepointSet::add(const CodepointSet& other) {
  ranges.insert(ranges.end(), other.ranges.begin(), other.ranges.end());
  return *this;
}

void CodepointSet::normalize() {
  std::sort(ranges.begin(), ranges.end());
  std::vector<std::pair<uint32_t, uint32_t>> merged;
  for (const auto& r : ranges) {
    if (!merged.empty() && r.first <= merged.back().second + 1) {
      merged.back().second = std::max(merged.back().second, r.second);
    } else {
      merged.push_back(r);
    }
  }
  ranges = std::move(merged);
}

CodepointSet CodepointSet::negated() const {
  CodepointSet s = *this;
  s.normalize();
  CodepointSet out;
  uint32_t next = 0;
  for (const auto& [lo, hi] : s.ranges) {
    if (lo > next) out.add(next, lo - 1);
    next = hi + 1;
  }
  if (next <= kMaxCodepoint) out.add(next, kMaxCodepoint);
  return out;
}

namespace {

int encode(uint32_t cp, uint8_t* b) {
  if (cp < 0x80) {
    b[0] = static_cast<uint8_t>(cp);
    return 1;
  }
  if (cp < 0x800) {
    b[0] = static_cast<uint8_t>(0xC0 | (cp >> 6));
    b[1] = static_cast<uint8_t>(0x80 | (cp & 0x3F));
    return 2;
  }
  if (cp < 0x10000) {
    b[0] = static_cast<uint8_t>(0xE0 | (cp >> 12));
    b[1] = static_cast<uint8_t>(0x80 | ((cp >> 6) & 0x3F));
    b[2] = static_cast<uint8_t>(0x80 | (cp & 0x3F));
    return 3;
  }
  b[0] = static_cast<uint8_t>(0xF0 | (cp >> 18));
  b[1] = static_cast<uint8_t>(0x80 | ((cp >> 12) & 0x3F));
  b[2] = static_cast<uint8_t>(0x80 | ((cp >> 6) & 0x3F));
  b[3] = static_cast<uint8_t>(0x80 | (cp & 0x3F));
  return 4;
}

}  // namespace

void utf8_ranges(uint32_t lo, uint32_t hi, std::vector<Utf8Range>& out) {
  if (lo > hi) return;
  if (lo <= 0xDFFF && hi >= 0xD800) {  // surrogates have no UTF-8 encoding
    if (lo < 0xD800) utf8_ranges(lo, 0xD7FF, out);
    if (hi > 0xDFFF) utf8_ranges(0xE000, hi, out);
    return;
  }
  for (uint32_t max : {0x7Fu, 0x7FFu, 0xFFFFu}) {  // one encoded length per piece
    if (lo <= max && hi > max) {
      utf8_ranges(lo, max, out);
      utf8_ranges(max + 1, hi, out);
      return;
    }
  }
  for (int i = 1; i < 4; ++i) {  // continuation bytes cover their whole range, or split
    const uint32_t m = (1u << (6 * i)) - 1;
    if ((lo & ~m) != (hi & ~m)) {
      if ((lo & m) != 0) {
        utf8_ranges(lo, lo | m, out);
        utf8_ranges((lo | m) + 1, hi, out);
        return;
      }
      if ((hi & m) != m) {
        utf8_ranges(lo, (hi & ~m) - 1, out);
        utf8_ranges(hi & ~m, hi, out);
        return;
      }
    }
  }
  Utf8Range r;
  r.length = encode(lo, r.lo);
  encode(hi, r.hi);
  out.push_back(r);
}

void append_utf8(uint32_t cp, std::string& out) {
  uint8_t b[4];
  const int n = encode(cp, b);
  out.append(reinterpret_cast<const char*>(b), static_cast<size_t>(n));
}

bool decode_utf8(std::string_view text, size_t& i, uint32_t& cp) {
  const auto at = [&](size_t k) { return static_cast<uint8_t>(text[k]); };
  if (i >= text.size()) return false;
  const uint8_t b0 = at(i);
  int n = 0;
  uint32_t min = 0;
  if (b0 < 0x80) {
    cp = b0;
    ++i;
    return true;
  } else if ((b0 & 0xE0) == 0xC0) {
    n = 2, min = 0x80, cp = b0 & 0x1F;
  } else if ((b0 & 0xF0) == 0xE0) {
    n = 3, min = 0x800, cp = b0 & 0x0F;
  } else if ((b0 & 0xF8) == 0xF0) {
    n = 4, min = 0x10000, cp = b0 & 0x07;
  } else {
    return false;
  }
  if (i + n > text.size()) return false;
  for (int k = 1; k < n; ++k) {
    if ((at(i + k) & 0xC0) != 0x80) return false;
    cp = (cp << 6) | (at(i + k) & 0x3F);
  }
  if (cp < min || cp > kMaxCodepoint || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
  i += static_cast<size_t>(n);
  return true;
}

namespace {

uint32_t depth_of(const std::vector<ExprPtr>& items) {
  uint32_t d = 0;
  for (const ExprPtr& x : items) d = std::max(d, x->depth);
  return d + 1;
}

}  // namespace

ExprPtr seq(std::vector<ExprPtr> items) {
  auto e = std::make_shared<Expr>();
  e->depth = depth_of(items);
  e->kind = Expr::Kind::kSeq;
  e->items = std::move(items);
  return e;
}

ExprPtr alt(std::vector<ExprPtr> items, std::string name) {
  auto e = std::make_shared<Expr>();
  e->kind = Expr::Kind::kAlt;
  e->depth = depth_of(items);
  e->items = std::move(items);
  e->name = std::move(name);
  return e;
}

ExprPtr set(CodepointSet s) {
  auto e = std::make_shared<Expr>();
  e->kind = Expr::Kind::kSet;
  s.normalize();
  e->set = std::move(s);
  return e;
}

ExprPtr repeat(ExprPtr item, uint32_t min, uint32_t max, std::string name) {
  if (nullable(item)) {  // x{m,n} with ε in x is (x without ε){0,n}
    item = non_empty(item);
    min = 0;
    if (item == nullptr) return seq({});
  }
  if (max == 0) return seq({});
  auto e = std::make_shared<Expr>();
  e->kind = Expr::Kind::kRepeat;
  e->depth = item->depth + 1;
  e->items = {std::move(item)};
  e->min = min;
  e->max = max;
  e->name = std::move(name);
  return e;
}

ExprPtr rule_ref(uint32_t rule) {
  auto e = std::make_shared<Expr>();
  e->kind = Expr::Kind::kRule;
  e->rule = rule;
  return e;
}

bool nullable(const ExprPtr& e) {
  switch (e->kind) {
    case Expr::Kind::kSeq:
      return std::all_of(e->items.begin(), e->items.end(),
                         [](const ExprPtr& x) { return nullable(x); });
    case Expr::Kind::kAlt:
      return std::any_of(e->items.begin(), e->items.end(),
                         [](const ExprPtr& x) { return nullable(x); });
    case Expr::Kind::kRepeat:
      return e->min == 0 || nullable(e->items[0]);
    case Expr::Kind::kSet:
    case Expr::Kind::kRule:
      return false;
  }
  return false;
}

ExprPtr non_empty(const ExprPtr& e) {
  if (!nullable(e)) {
    return e->kind == Expr::Kind::kSet && e->set.ranges.empty() ? nullptr : e;
  }
  std::vector<ExprPtr> alts;
  switch (e->kind) {
    case Expr::Kind::kSeq: {  // every part nullable: the first non-empty part is part i
      // Alternative i copies the n - i parts after it: n²/2 in all, refused before it is built
      // when that is more than a grammar may hold (a 200 KB regex of nullable parts would
      // otherwise take gigabytes here).
      const auto n = static_cast<int64_t>(e->items.size());
      if (n * (n + 1) / 2 > Lowerer::kMaxSymbols) {
        auto big = std::make_shared<Expr>(*e);
        big->too_large = true;
        return big;
      }
      for (size_t i = 0; i < e->items.size(); ++i) {
        ExprPtr first = non_empty(e->items[i]);
        if (first == nullptr) continue;
        std::vector<ExprPtr> rest{first};
        rest.insert(rest.end(), e->items.begin() + static_cast<std::ptrdiff_t>(i) + 1,
                    e->items.end());
        alts.push_back(seq(std::move(rest)));
      }
      break;
    }
    case Expr::Kind::kAlt:
      for (const ExprPtr& x : e->items) {
        if (ExprPtr n = non_empty(x)) alts.push_back(std::move(n));
      }
      break;
    case Expr::Kind::kRepeat: {  // x{0,n}, x non-nullable: x x{0,n-1}
      const ExprPtr& x = e->items[0];
      const uint32_t rest = e->max == kUnbounded ? kUnbounded : e->max - 1;
      return seq({x, repeat(x, 0, rest, e->name + "-more")});
    }
    case Expr::Kind::kSet:
    case Expr::Kind::kRule:
      break;
  }
  if (alts.empty()) return nullptr;
  return alts.size() == 1 ? alts[0] : alt(std::move(alts), e->name + "-nonempty");
}

LineIndex::LineIndex(std::string_view text) : size_(text.size()) {
  starts_.push_back(0);
  for (size_t k = 0; k < text.size(); ++k) {
    if (text[k] == '\n') starts_.push_back(k + 1);
  }
}

std::string LineIndex::where(size_t at) const {
  at = std::min(at, size_);
  // The last line start <= at (binary search, counting its steps).
  size_t lo = 0, hi = starts_.size();  // starts_[lo] <= at < starts_[hi] (hi may be the end)
  while (hi - lo > 1) {
    ++steps_;
    const size_t mid = lo + (hi - lo) / 2;
    (starts_[mid] <= at ? lo : hi) = mid;
  }
  return absl::StrCat(lo + 1, ":", at - starts_[lo] + 1);
}

std::string short_rule_name(std::string_view name) {
  if (name.size() <= kMaxNameInPlace) return std::string(name);
  return std::string(name.substr(0, kMaxNameInPlace)) + "...";
}

absl::Status Lowerer::too_large() {
  return absl::InvalidArgumentError(
      absl::StrCat("the grammar is too large: more than ", kMaxSymbols, " symbols"));
}

absl::Status Lowerer::add(uint32_t rule, const GrammarBuilder::Sequence& s) {
  symbols_ += static_cast<int64_t>(s.size()) + 1;
  if (symbols_ > kMaxSymbols) return too_large();
  b_.add_alternative(rule, s);
  return absl::OkStatus();
}

absl::Status Lowerer::add_alternative(uint32_t rule, const ExprPtr& e) {
  GrammarBuilder::Sequence s;
  if (absl::Status st = lower(e, s); !st.ok()) return st;
  return add(rule, s);
}

absl::Status Lowerer::lower(const ExprPtr& e, GrammarBuilder::Sequence& out) {
  if (e->too_large) return too_large();
  if (const auto it = memo_.find(e.get()); it != memo_.end()) {
    out.push_back(it->second);
    return absl::OkStatus();
  }
  // Memoized expressions stay alive with the Lowerer, so that no new one reuses their address.
  if (e->kind == Expr::Kind::kSet || e->kind == Expr::Kind::kAlt) keep_.push_back(e);
  switch (e->kind) {
    case Expr::Kind::kSeq:
      for (const ExprPtr& x : e->items) {
        if (absl::Status s = lower(x, out); !s.ok()) return s;
        if (symbols_ + static_cast<int64_t>(out.size()) > kMaxSymbols) return too_large();
      }
      return absl::OkStatus();
    case Expr::Kind::kSet:
      return lower_set(*e, out);
    case Expr::Kind::kAlt:
      return lower_alt(*e, out);
    case Expr::Kind::kRepeat:
      return lower_repeat(*e, out);
    case Expr::Kind::kRule:
      out.push_back(GrammarBuilder::ref(e->rule));
      return absl::OkStatus();
  }
  return absl::OkStatus();
}

absl::Status Lowerer::lower_set(const Expr& e, GrammarBuilder::Sequence& out) {
  std::vector<Utf8Range> seqs;
  for (const auto& [lo, hi] : e.set.ranges) utf8_ranges(lo, hi, seqs);
  ByteClass single;
  std::vector<const Utf8Range*> multi;
  for (const Utf8Range& r : seqs) {
    if (r.length == 1) {
      single.add(r.lo[0], r.hi[0]);
    } else {
      multi.push_back(&r);
    }
  }
  const auto bytes_of = [&](const Utf8Range& r) {
    GrammarBuilder::Sequence s;
    for (int i = 0; i < r.length; ++i) s.push_back(b_.bytes(ByteClass::range(r.lo[i], r.hi[i])));
    return s;
  };
  if (multi.empty() && !single.empty()) {
    out.push_back(b_.bytes(single));
    memo_[&e] = out.back();
    return absl::OkStatus();
  }
  if (multi.size() == 1 && single.empty()) {  // e.g. one non-ASCII character: inline
    const GrammarBuilder::Sequence s = bytes_of(*multi[0]);
    out.insert(out.end(), s.begin(), s.end());
    return absl::OkStatus();
  }
  const uint32_t r = b_.add_rule(e.name.empty() ? "character class" : e.name);
  if (!single.empty()) {
    if (absl::Status s = add(r, {b_.bytes(single)}); !s.ok()) return s;
  }
  for (const Utf8Range* m : multi) {
    if (absl::Status s = add(r, bytes_of(*m)); !s.ok()) return s;
  }
  out.push_back(GrammarBuilder::ref(r));  // no alternatives (an empty set): matches nothing
  memo_[&e] = out.back();
  return absl::OkStatus();
}

absl::Status Lowerer::lower_alt(const Expr& e, GrammarBuilder::Sequence& out) {
  const uint32_t r = b_.add_rule(e.name.empty() ? "alternation" : e.name);
  for (const ExprPtr& x : e.items) {
    GrammarBuilder::Sequence s;
    if (absl::Status st = lower(x, s); !st.ok()) return st;
    if (absl::Status st = add(r, s); !st.ok()) return st;
  }
  out.push_back(GrammarBuilder::ref(r));
  memo_[&e] = out.back();
  return absl::OkStatus();
}

// x{m,n}: m copies of x, then n − m nested optional copies (O_i ::= x O_i+1 | ε), or a
// right-recursive tail (S ::= x S | ε) when unbounded. x is one symbol (a rule if needed).
absl::Status Lowerer::lower_repeat(const Expr& e, GrammarBuilder::Sequence& out) {
  const std::string name = e.name.empty() ? "repetition" : e.name;
  GrammarBuilder::Sequence item;
  if (absl::Status s = lower(e.items[0], item); !s.ok()) return s;
  Symbol x = item.size() == 1 ? item[0] : Symbol{};
  if (item.size() != 1) {
    const uint32_t r = b_.add_rule(name + "-item");
    if (absl::Status s = add(r, item); !s.ok()) return s;
    x = GrammarBuilder::ref(r);
  }
  symbols_ += e.min;
  if (symbols_ > kMaxSymbols) return too_large();
  out.insert(out.end(), e.min, x);
  if (e.max == kUnbounded) {
    const uint32_t r = b_.add_rule(name);
    if (absl::Status s = add(r, {x, GrammarBuilder::ref(r)}); !s.ok()) return s;
    if (absl::Status s = add(r, {}); !s.ok()) return s;
    out.push_back(GrammarBuilder::ref(r));
    return absl::OkStatus();
  }
  const uint32_t optional = e.max - e.min;
  if (optional == 0) return absl::OkStatus();
  const uint32_t first = b_.num_rules();
  for (uint32_t i = 0; i < optional; ++i) b_.add_rule(name);
  for (uint32_t i = 0; i < optional; ++i) {
    GrammarBuilder::Sequence s{x};
    if (i + 1 < optional) s.push_back(GrammarBuilder::ref(first + i + 1));
    if (absl::Status st = add(first + i, s); !st.ok()) return st;
    if (absl::Status st = add(first + i, {}); !st.ok()) return st;
  }
  out.push_back(GrammarBuilder::ref(first));
  return absl::OkStatus();
}

}  // namespace simpler::grammar::internal
