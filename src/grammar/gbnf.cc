#include "simpler/grammar/gbnf.h"

#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "grammar/expr.h"

namespace simpler::grammar {
namespace {

using internal::CodepointSet;
using internal::ExprPtr;

bool name_char(char c) {
  return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_';
}

// A recursive-descent parser after llama.cpp's grammar-parser (the same newline rules), building
// expression trees that the Lowerer adds to the builder rule by rule.
class GbnfParser {
 public:
  GbnfParser(std::string_view t, GrammarBuilder& b) : t_(t), lines_(t), b_(b), lower_(b) {}
  const internal::LineIndex& lines() const { return lines_; }

  absl::StatusOr<uint32_t> parse() {
    space(true);
    while (!at_end()) {
      if (absl::Status s = rule(); !s.ok()) return s;
      space(true);
    }
    for (const auto& [name, r] : rules_) {
      if (r.defined_at == kNever) {
        return absl::InvalidArgumentError(
            absl::StrCat("rule '", name, "' is used at ", where(r.used_at), " but never defined"));
      }
    }
    const auto root = rules_.find("root");
    if (root == rules_.end()) return absl::InvalidArgumentError("the grammar has no 'root' rule");
    return root->second.id;
  }

 private:
  static constexpr size_t kNever = SIZE_MAX;
  // Parentheses and stacked quantifiers, below the trees' own bound (non_empty adds levels).
  static constexpr uint32_t kMaxNesting = internal::kMaxExprDepth / 4;
  struct Rule {
    uint32_t id = 0;
    size_t defined_at = kNever, used_at = kNever;
  };

  std::string where(size_t at) const { return lines_.where(at); }
  absl::Status too_deep(size_t at) const {
    return error(absl::StrCat("groups and repetitions nested deeper than ", kMaxNesting), at);
  }
  absl::Status error(std::string_view what, size_t at) const {
    return absl::InvalidArgumentError(absl::StrCat(std::string(what), " at ", where(at)));
  }
  bool at_end() const { return i_ >= t_.size(); }
  char cur() const { return at_end() ? '\0' : t_[i_]; }

  // Spaces, tabs and comments; newlines too when `newline_ok`.
  void space(bool newline_ok) {
    while (!at_end()) {
      const char c = t_[i_];
      if (c == ' ' || c == '\t' || (newline_ok && (c == '\r' || c == '\n'))) {
        ++i_;
      } else if (c == '#') {
        while (!at_end() && t_[i_] != '\r' && t_[i_] != '\n') ++i_;
      } else {
        return;
      }
    }
  }

  std::string name() {
    const size_t from = i_;
    while (!at_end() && name_char(t_[i_])) ++i_;
    return std::string(t_.substr(from, i_ - from));
  }

  Rule& rule_named(const std::string& n) {
    auto [it, inserted] = rules_.try_emplace(n);
    if (inserted) it->second.id = b_.add_rule(n);
    return it->second;
  }

  absl::Status rule() {
    const size_t at = i_;
    const std::string n = name();
    if (n.empty()) return error("expected a rule name", at);
    space(false);
    if (t_.substr(i_, 3) != "::=") return error("expected ::= after the rule name", i_);
    i_ += 3;
    space(true);
    Rule& r = rule_named(n);
    if (r.defined_at != kNever) {
      return absl::InvalidArgumentError(absl::StrCat("rule '", n, "' is defined twice (at ",
                                                     where(r.defined_at), " and ", where(at), ")"));
    }
    r.defined_at = at;
    const uint32_t id = r.id;
    std::vector<ExprPtr> alts;
    // Generated rules are named after the rule (shortened) and their place.
    if (absl::Status s = alternates(internal::short_rule_name(n), false, alts); !s.ok()) return s;
    for (const ExprPtr& a : alts) {
      if (absl::Status s = lower_.add_alternative(id, a); !s.ok()) return s;
    }
    if (cur() == '\r') ++i_;
    if (cur() == '\n') {
      ++i_;
    } else if (!at_end()) {
      return error("expected a newline or the end after the rule", i_);
    }
    return absl::OkStatus();
  }

  absl::Status alternates(const std::string& rule, bool nested, std::vector<ExprPtr>& out) {
    while (true) {
      absl::StatusOr<ExprPtr> s = sequence(rule, nested);
      if (!s.ok()) return s.status();
      out.push_back(*std::move(s));
      if (cur() != '|') return absl::OkStatus();
      ++i_;
      space(true);
    }
  }

  absl::StatusOr<ExprPtr> sequence(const std::string& rule, bool nested) {
    std::vector<ExprPtr> items;
    while (!at_end()) {
      const size_t at = i_;
      const char c = t_[i_];
      absl::StatusOr<ExprPtr> e = nullptr;
      if (c == '"') {
        e = literal();
      } else if (c == '[') {
        e = char_class();
      } else if (c == '.') {
        ++i_;
        e = internal::set(CodepointSet::range(0, internal::kMaxCodepoint));
      } else if (name_char(c)) {
        Rule& r = rule_named(name());
        if (r.used_at == kNever) r.used_at = at;
        e = internal::rule_ref(r.id);
      } else if (c == '(') {
        if (++open_groups_ > kMaxNesting) return too_deep(at);
        ++i_;
        space(true);
        std::vector<ExprPtr> alts;
        if (absl::Status s = alternates(rule, true, alts); !s.ok()) return s;
        if (cur() != ')') return error("expected )", i_);
        ++i_;
        --open_groups_;
        e = alts.size() == 1
                ? alts[0]
                : internal::alt(std::move(alts), absl::StrCat(rule, " (group at ", where(at), ")"));
      } else if (c == '*' || c == '+' || c == '?' || c == '{') {
        if (items.empty()) return error("repetition without a preceding item", at);
        absl::Status s = quantifier(rule, items.back());
        if (!s.ok()) return s;
        if (items.back()->depth > kMaxNesting) return too_deep(at);
        space(nested);
        continue;
      } else if (c == '<' || c == '!') {
        return error("token references (<...>, !<...>) are not supported", at);
      } else {
        break;
      }
      if (!e.ok()) return e;
      items.push_back(*std::move(e));
      if (items.back()->depth > kMaxNesting) return too_deep(at);
      space(nested);
    }
    return items.size() == 1 ? items[0] : internal::seq(std::move(items));
  }

  absl::StatusOr<uint32_t> count() {
    const size_t at = i_;
    uint64_t v = 0;
    while (!at_end() && absl::ascii_isdigit(static_cast<unsigned char>(t_[i_]))) {
      v = std::min<uint64_t>(v * 10 + static_cast<uint64_t>(t_[i_++] - '0'), uint64_t{1} << 40);
    }
    if (i_ == at) return error("expected a number", at);
    if (v > kMaxGbnfRepeat) {
      return absl::InvalidArgumentError(
          absl::StrCat("repetition count ", v, " at ", where(at), " is above ", kMaxGbnfRepeat));
    }
    space(true);
    return static_cast<uint32_t>(v);
  }

  absl::Status quantifier(const std::string& rule, ExprPtr& item) {
    const size_t at = i_;
    const char c = t_[i_++];
    uint32_t min = c == '+' ? 1 : 0, max = c == '?' ? 1 : internal::kUnbounded;
    if (c == '{') {
      space(true);
      absl::StatusOr<uint32_t> m = count();
      if (!m.ok()) return m.status();
      min = max = *m;
      if (cur() == ',') {
        ++i_;
        space(true);
        max = internal::kUnbounded;
        if (cur() != '}') {
          absl::StatusOr<uint32_t> n = count();
          if (!n.ok()) return n.status();
          max = *n;
        }
      }
      if (cur() != '}') return error("expected }", i_);
      ++i_;
      if (max < min) return error("a repetition's maximum is below its minimum", at);
    }
    item = internal::repeat(std::move(item), min, max,
                            absl::StrCat(rule, " (repetition at ", where(at), ")"));
    return absl::OkStatus();
  }

  // One character of a literal or class at i_ (an escape or a UTF-8 code point).
  absl::StatusOr<uint32_t> character() {
    const size_t at = i_;
    uint32_t cp = 0;
    if (t_[i_] != '\\') {
      if (!internal::decode_utf8(t_, i_, cp)) return error("ill-formed UTF-8", at);
      return cp;
    }
    ++i_;
    if (at_end()) return error("unterminated escape", at);
    const char c = t_[i_++];
    switch (c) {
      case 'n':
        return uint32_t{'\n'};
      case 'r':
        return uint32_t{'\r'};
      case 't':
        return uint32_t{'\t'};
      case '\\':
      case '"':
      case '[':
      case ']':
      case '-':
        return static_cast<uint32_t>(c);
      case 'x':
      case 'u':
      case 'U': {
        const int n = c == 'x' ? 2 : c == 'u' ? 4 : 8;
        for (int k = 0; k < n; ++k, ++i_) {
          if (at_end() || !absl::ascii_isxdigit(static_cast<unsigned char>(t_[i_]))) {
            return error(absl::StrCat("expected ", n, " hex digits after \\", std::string(1, c)),
                         at);
          }
          const char h = absl::ascii_tolower(t_[i_]);
          cp = cp * 16 + static_cast<uint32_t>(h <= '9' ? h - '0' : h - 'a' + 10);
        }
        if (cp > internal::kMaxCodepoint || (cp >= 0xD800 && cp <= 0xDFFF)) {
          return error("the escape is not a Unicode character", at);
        }
        return cp;
      }
      default:
        return error(absl::StrCat("unknown escape \\", std::string(1, c)), at);
    }
  }

  absl::StatusOr<ExprPtr> literal() {
    const size_t at = i_++;
    std::vector<ExprPtr> chars;
    while (true) {
      if (at_end() || cur() == '\n') return error("unterminated string literal", at);
      if (cur() == '"') break;
      absl::StatusOr<uint32_t> cp = character();
      if (!cp.ok()) return cp.status();
      chars.push_back(internal::set(CodepointSet::of(*cp)));
    }
    ++i_;
    return chars.size() == 1 ? chars[0] : internal::seq(std::move(chars));
  }

  absl::StatusOr<ExprPtr> char_class() {
    const size_t at = i_++;
    const bool negate = cur() == '^';
    if (negate) ++i_;
    CodepointSet s;
    while (cur() != ']') {
      if (at_end()) return error("unterminated character class", at);
      const size_t from = i_;
      absl::StatusOr<uint32_t> lo = character();
      if (!lo.ok()) return lo.status();
      uint32_t hi = *lo;
      if (cur() == '-' && i_ + 1 < t_.size() && t_[i_ + 1] != ']') {
        ++i_;
        absl::StatusOr<uint32_t> h = character();
        if (!h.ok()) return h.status();
        hi = *h;
        if (hi < *lo) return error("a range in a character class ends below its start", from);
      }
      s.add(*lo, hi);
    }
    ++i_;
    return internal::set(negate ? s.negated() : std::move(s));
  }

  std::string_view t_;
  internal::LineIndex lines_;
  size_t i_ = 0;
  GrammarBuilder& b_;
  internal::Lowerer lower_;
  absl::flat_hash_map<std::string, Rule> rules_;
  uint32_t open_groups_ = 0;
};

}  // namespace

namespace internal {

absl::StatusOr<std::shared_ptr<const Grammar>> compile_gbnf_counting(std::string_view text,
                                                                     int64_t& place_steps) {
  GrammarBuilder b;
  GbnfParser parser(text, b);
  absl::StatusOr<uint32_t> root = parser.parse();
  place_steps = parser.lines().steps();
  if (!root.ok()) return root.status();
  return std::move(b).build(*root);
}

}  // namespace internal

absl::StatusOr<std::shared_ptr<const Grammar>> compile_gbnf(std::string_view text) {
  int64_t place_steps = 0;
  return internal::compile_gbnf_counting(text, place_steps);
}

}  // namespace simpler::grammar
