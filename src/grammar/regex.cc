#include "simpler/grammar/regex.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "grammar/expr.h"

namespace simpler::grammar {
namespace {

using internal::CodepointSet;
using internal::ExprPtr;

// PCRE2's verdict on the pattern: its syntax errors (with their offsets) become ours. The
// matching itself is the grammar's (docs/design/structured_outputs.md says why).
absl::Status pcre2_check(std::string_view pattern) {
  pcre2_compile_context* ctx = pcre2_compile_context_create(nullptr);
  // \uHHHH as Python writes it (and \U as a literal, which our parser reads as Python does).
  pcre2_set_compile_extra_options(ctx, PCRE2_EXTRA_ALT_BSUX);
  int code = 0;
  PCRE2_SIZE offset = 0;
  pcre2_code* re = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                                 PCRE2_UTF | PCRE2_ALT_BSUX, &code, &offset, ctx);
  pcre2_compile_context_free(ctx);
  if (re != nullptr) {
    pcre2_code_free(re);
    return absl::OkStatus();
  }
  // PCRE2 compiles a counted group into that many copies, within 64 KiB; the grammar has one
  // rule per group instead (and bounds its own size), so that limit is not the pattern's.
  if (code == PCRE2_ERROR_PATTERN_TOO_LARGE) return absl::OkStatus();
  PCRE2_UCHAR message[256];
  pcre2_get_error_message(code, message, sizeof(message));
  return absl::InvalidArgumentError(
      absl::StrCat("invalid regular expression: ", reinterpret_cast<const char*>(message),
                   " at byte offset ", offset));
}

CodepointSet digits() { return CodepointSet::range('0', '9'); }
CodepointSet word() {
  return CodepointSet::range('0', '9').add('A', 'Z').add('a', 'z').add('_', '_');
}
CodepointSet space() { return CodepointSet::range('\t', '\r').add(' ', ' '); }

// The set a one-letter escape stands for (\d, \n, ...), if it is one of those.
std::optional<CodepointSet> escape_set(char c) {
  switch (c) {
    case 'd':
      return digits();
    case 'D':
      return digits().negated();
    case 'w':
      return word();
    case 'W':
      return word().negated();
    case 's':
      return space();
    case 'S':
      return space().negated();
    case 'n':
      return CodepointSet::of('\n');
    case 't':
      return CodepointSet::of('\t');
    case 'r':
      return CodepointSet::of('\r');
    case 'f':
      return CodepointSet::of('\f');
    case 'v':
      return CodepointSet::of('\v');
    case 'a':
      return CodepointSet::of(0x07);
    case 'e':
      return CodepointSet::of(0x1B);
    case '0':
      return CodepointSet::of(0);
    default:
      return std::nullopt;
  }
}

// A recursive-descent parser of the subset in regex.h into an expression tree.
class RegexParser {
 public:
  explicit RegexParser(std::string_view p) : p_(p) {}

  absl::StatusOr<ExprPtr> parse() {
    if (!p_.empty() && p_[0] == '^') i_ = 1;
    absl::StatusOr<ExprPtr> e = alternation();
    if (!e.ok()) return e;
    if (i_ < p_.size()) return error("unbalanced )");  // PCRE2 refuses it first
    return e;
  }

 private:
  // Groups and stacked quantifiers, below the trees' own bound (non_empty adds levels), as GBNF.
  static constexpr uint32_t kMaxNesting = internal::kMaxExprDepth / 4;
  absl::Status too_deep(size_t at) const {
    return unsupported(absl::StrCat("groups and repetitions nested deeper than ", kMaxNesting), at);
  }
  absl::Status unsupported(std::string_view what, size_t at) const {
    return absl::InvalidArgumentError(absl::StrCat(
        "unsupported regular expression construct: ", std::string(what), " at byte offset ", at));
  }
  absl::Status error(std::string_view what) const {
    return absl::InvalidArgumentError(
        absl::StrCat("invalid regular expression: ", std::string(what), " at byte offset ", i_));
  }
  bool at_end() const { return i_ >= p_.size(); }
  bool peek(std::string_view s) const { return p_.substr(i_, s.size()) == s; }

  absl::StatusOr<ExprPtr> alternation() {
    const size_t start = i_;
    std::vector<ExprPtr> alts;
    while (true) {
      absl::StatusOr<ExprPtr> s = sequence();
      if (!s.ok()) return s;
      alts.push_back(*std::move(s));
      if (at_end() || p_[i_] != '|') break;
      ++i_;
    }
    if (alts.size() == 1) return alts[0];
    return internal::alt(std::move(alts), absl::StrCat("alternation at ", start));
  }

  absl::StatusOr<ExprPtr> sequence() {
    std::vector<ExprPtr> items;
    while (!at_end() && p_[i_] != '|' && p_[i_] != ')') {
      if (p_[i_] == '$') {
        if (i_ + 1 != p_.size()) return unsupported("anchor $ inside the pattern", i_);
        ++i_;
        continue;
      }
      if (p_[i_] == '^') return unsupported("anchor ^ inside the pattern", i_);
      const size_t start = i_;
      absl::StatusOr<ExprPtr> a = atom();
      if (!a.ok()) return a;
      if (*a == nullptr) continue;  // a comment
      absl::StatusOr<ExprPtr> q = quantified(*std::move(a), start);
      if (!q.ok()) return q;
      items.push_back(*std::move(q));
    }
    return items.size() == 1 ? items[0] : internal::seq(std::move(items));
  }

  // {m}, {m,}, {m,n}, {,n} at i_ (on '{'); false when the braces are not a quantifier (then
  // they are literal text, as in Python and PCRE2).
  bool counted(uint32_t& min, uint32_t& max, uint64_t& big) {
    size_t j = i_ + 1;
    auto number = [&](uint64_t& v) {
      const size_t from = j;
      v = 0;
      while (j < p_.size() && absl::ascii_isdigit(static_cast<unsigned char>(p_[j]))) {
        v = std::min<uint64_t>(v * 10 + static_cast<uint64_t>(p_[j] - '0'), uint64_t{1} << 40);
        ++j;
      }
      return j > from;
    };
    uint64_t lo = 0, hi = 0;
    const bool has_lo = number(lo);
    bool has_hi = false, comma = false;
    if (j < p_.size() && p_[j] == ',') {
      comma = true;
      ++j;
      has_hi = number(hi);
    }
    if (j >= p_.size() || p_[j] != '}' || (!has_lo && !has_hi)) return false;
    if (!comma) hi = lo, has_hi = true;
    big = std::max(lo, has_hi ? hi : 0);
    min = static_cast<uint32_t>(std::min<uint64_t>(lo, UINT32_MAX - 1));
    max = has_hi ? static_cast<uint32_t>(std::min<uint64_t>(hi, UINT32_MAX - 1))
                 : internal::kUnbounded;
    i_ = j + 1;
    return true;
  }

  absl::StatusOr<ExprPtr> quantified(ExprPtr e, size_t start) {
    while (!at_end()) {
      const size_t q = i_;
      uint32_t min = 0, max = 0;
      uint64_t big = 0;
      const char c = p_[i_];
      if (c == '?' || c == '*' || c == '+') {
        min = c == '+' ? 1 : 0;
        max = c == '?' ? 1 : internal::kUnbounded;
        ++i_;
      } else if (c != '{' || !counted(min, max, big)) {
        return e;
      }
      if (big > kMaxRegexRepeat) {
        return absl::InvalidArgumentError(absl::StrCat("repetition count ", big, " at byte offset ",
                                                       q, " is above ", kMaxRegexRepeat));
      }
      if (max != internal::kUnbounded && min > max) return error("numbers out of order");
      if (!at_end() && p_[i_] == '+') return unsupported("possessive quantifier", i_);
      if (!at_end() && p_[i_] == '?') ++i_;  // lazy: the same language
      e = internal::repeat(std::move(e), min, max, absl::StrCat("repetition at ", start));
      if (e->depth > kMaxNesting) return too_deep(q);
    }
    return e;
  }

  absl::StatusOr<ExprPtr> atom() {
    const char c = p_[i_];
    if (c == '(') return group();
    if (c == '[') return char_class();
    if (c == '.') {
      ++i_;
      return internal::set(CodepointSet::of('\n').negated());
    }
    if (c == '\\') {
      CodepointSet s;
      if (absl::Status st = escape(s, /*in_class=*/false); !st.ok()) return st;
      return internal::set(std::move(s));
    }
    if (c == '*' || c == '+' || c == '?')
      return error("quantifier does not follow a repeatable item");
    uint32_t cp = 0;
    if (!internal::decode_utf8(p_, i_, cp)) return error("ill-formed UTF-8");
    return internal::set(CodepointSet::of(cp));
  }

  absl::StatusOr<ExprPtr> group() {
    const size_t start = i_;
    ++i_;  // '('
    if (peek("?")) {
      if (peek("?#")) {  // a comment
        while (!at_end() && p_[i_] != ')') ++i_;
        if (at_end()) return error("missing )");
        ++i_;
        return nullptr;
      }
      static constexpr std::pair<std::string_view, std::string_view> kRefused[] = {
          {"?P=", "named backreference (?P="},
          {"?=", "lookahead (?="},
          {"?!", "negative lookahead (?!"},
          {"?<=", "lookbehind (?<="},
          {"?<!", "negative lookbehind (?<!"},
          {"?>", "atomic group (?>"},
          {"?(", "conditional (?("},
          {"?|", "branch reset (?|"},
          {"?R", "recursion (?R"},
          {"?&", "recursion (?&"},
          {"?P>", "recursion (?P>"},
          {"?C", "callout (?C"}};
      for (const auto& [prefix, name] : kRefused) {
        if (peek(prefix)) return unsupported(name, start);
      }
      if (peek("?:")) {
        i_ += 2;
      } else if (peek("?P<") || peek("?<") || peek("?'")) {
        const char close = peek("?'") ? '\'' : '>';
        while (!at_end() && p_[i_] != close) ++i_;
        if (at_end()) return error("unterminated group name");
        ++i_;
      } else if (i_ + 1 < p_.size() &&
                 absl::ascii_isdigit(static_cast<unsigned char>(p_[i_ + 1]))) {
        return unsupported("recursion (?N", start);
      } else {
        return unsupported(absl::StrCat("inline flags (?", std::string(p_.substr(i_ + 1, 1))),
                           start);
      }
    }
    absl::StatusOr<ExprPtr> e = alternation();
    if (!e.ok()) return e;
    if (at_end() || p_[i_] != ')') return error("missing )");
    ++i_;
    if ((*e)->depth > kMaxNesting) return too_deep(start);
    return e;
  }

  // A hex number of `n` digits (n = 0: inside braces) at i_.
  absl::StatusOr<uint32_t> hex(int n) {
    const bool braces = n == 0;
    if (braces) {
      if (!peek("{")) return error("\\x{ expected");
      ++i_;
    }
    uint32_t v = 0;
    int count = 0;
    while (!at_end() && (braces || count < n) &&
           absl::ascii_isxdigit(static_cast<unsigned char>(p_[i_]))) {
      const char h = absl::ascii_tolower(p_[i_++]);
      v = v * 16 + static_cast<uint32_t>(h <= '9' ? h - '0' : h - 'a' + 10);
      if (v > internal::kMaxCodepoint) return error("character code point value is too large");
      ++count;
    }
    if (braces) {
      if (!peek("}") || count == 0) return error("malformed \\x{...}");
      ++i_;
    } else if (count != n) {
      return error("malformed hexadecimal escape");
    }
    if (v >= 0xD800 && v <= 0xDFFF) return error("a surrogate is not a character");
    return v;
  }

  // The escape at i_ (on '\') as a set of characters.
  absl::Status escape(CodepointSet& s, bool in_class) {
    const size_t start = i_;
    ++i_;
    if (at_end()) return error("\\ at end of pattern");
    const char c = p_[i_++];
    if (std::optional<CodepointSet> set = escape_set(c)) {
      s.add(*set);
      return absl::OkStatus();
    }
    switch (c) {
      case 'x':
      case 'u':
      case 'U': {
        absl::StatusOr<uint32_t> v = hex(c == 'u' ? 4 : c == 'U' ? 8 : peek("{") ? 0 : 2);
        if (!v.ok()) return v.status();
        s.add(*v, *v);
        return absl::OkStatus();
      }
      case 'b':
        if (in_class) {  // a backspace inside a class
          s.add(0x08, 0x08);
          return absl::OkStatus();
        }
        return unsupported("word boundary \\b", start);
      case 'B':
        return unsupported("word boundary \\B", start);
      case 'p':
      case 'P':
        return unsupported(absl::StrCat("Unicode property \\", std::string(1, c)), start);
      case 'k':
      case 'g':
        return unsupported(absl::StrCat("backreference \\", std::string(1, c)), start);
      default:
        break;
    }
    if (c >= '1' && c <= '9') {
      return unsupported(absl::StrCat("backreference \\", std::string(1, c)), start);
    }
    if (absl::ascii_isalnum(static_cast<unsigned char>(c))) {
      return unsupported(absl::StrCat("escape \\", std::string(1, c)), start);
    }
    --i_;  // an escaped punctuation or non-ASCII character stands for itself
    uint32_t cp = 0;
    if (!internal::decode_utf8(p_, i_, cp)) return error("ill-formed UTF-8");
    s.add(cp, cp);
    return absl::OkStatus();
  }

  // One item of a class at i_: a character (`single`, in `cp`: it may start or end a range) or a
  // set escape such as \d (added to `s`).
  absl::Status class_char(CodepointSet& s, bool& single, uint32_t& cp) {
    single = true;
    if (p_[i_] == '\\') {
      CodepointSet e;
      if (absl::Status st = escape(e, /*in_class=*/true); !st.ok()) return st;
      e.normalize();
      single = e.ranges.size() == 1 && e.ranges[0].first == e.ranges[0].second;
      if (single) {
        cp = e.ranges[0].first;
      } else {
        s.add(e);
      }
      return absl::OkStatus();
    }
    if (!internal::decode_utf8(p_, i_, cp)) return error("ill-formed UTF-8");
    return absl::OkStatus();
  }

  absl::StatusOr<ExprPtr> char_class() {
    ++i_;  // '['
    const bool negate = peek("^");
    if (negate) ++i_;
    CodepointSet s;
    bool first = true;
    while (true) {
      if (at_end()) return error("missing terminating ] for character class");
      if (p_[i_] == ']' && !first) break;
      if (peek("[:") || peek("[=") || peek("[.")) return unsupported("POSIX class [:", i_);
      first = false;
      bool single = false;
      uint32_t lo = 0;
      if (absl::Status st = class_char(s, single, lo); !st.ok()) return st;
      if (!single) continue;
      if (peek("-") && i_ + 1 < p_.size() && p_[i_ + 1] != ']') {
        ++i_;
        uint32_t hi = 0;
        bool hi_single = false;
        if (absl::Status st = class_char(s, hi_single, hi); !st.ok()) return st;
        if (!hi_single) return error("invalid range in character class");
        if (hi < lo) return error("range out of order in character class");
        s.add(lo, hi);
      } else {
        s.add(lo, lo);
      }
    }
    ++i_;  // ']'
    return internal::set(negate ? s.negated() : std::move(s));
  }

  std::string_view p_;
  size_t i_ = 0;
};

}  // namespace

absl::StatusOr<std::shared_ptr<const Grammar>> compile_regex(std::string_view pattern) {
  if (absl::Status s = pcre2_check(pattern); !s.ok()) return s;
  absl::StatusOr<ExprPtr> e = RegexParser(pattern).parse();
  if (!e.ok()) return e.status();
  GrammarBuilder b;
  const uint32_t root = b.add_rule("pattern");
  internal::Lowerer lower(b);
  if (absl::Status s = lower.add_alternative(root, *e); !s.ok()) return s;
  return std::move(b).build(root);
}

}  // namespace simpler::grammar
