#include "simpler/grammar/regex.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "grammar/grammar_test_util.h"
#include "gtest/gtest.h"

namespace simpler::grammar::regex_test {
namespace {

using testing::accepts;

std::shared_ptr<const Grammar> compile(std::string_view pattern) {
  return testing::compiled_or_fail(compile_regex(pattern), pattern);
}

std::string error_of(std::string_view pattern) {
  return testing::refusal_of(compile_regex(pattern), pattern);
}

TEST(RegexTest, TheWholeOutputMatchesThePattern) {
  const auto email = compile(R"(\w+@\w+\.com\n)");
  EXPECT_TRUE(accepts(email, "alan_turing@enigma.com\n"));
  EXPECT_FALSE(accepts(email, "alan turing@enigma.com\n"));
  EXPECT_FALSE(accepts(email, "alan@enigma.com"));  // a prefix, not a match
  const auto phone = compile(R"(^\(\d{3}\) \d{3}-\d{4}$)");
  EXPECT_TRUE(accepts(phone, "(555) 123-4567"));
  EXPECT_FALSE(accepts(phone, "(555) 123-456"));
  const auto pets = compile("(?:cat|dog)s?|(?P<other>fish)");
  for (const char* ok : {"cat", "dogs", "fish"}) EXPECT_TRUE(accepts(pets, ok)) << ok;
  for (const char* bad : {"", "cats!", "fishs", "ca"}) EXPECT_FALSE(accepts(pets, bad)) << bad;
}

TEST(RegexTest, CharactersAreCodePointsAcceptedAsTheirUtf8Bytes) {
  const auto g = compile(R"(.[^a-z]\u00e9\x{1F600})");
  GrammarMatcher m(g);
  const std::string text = "\xE4\xB8\xADZ\xC3\xA9\xF0\x9F\x98\x80";  // 中 Z é 😀
  for (size_t i = 0; i < text.size(); ++i) ASSERT_TRUE(m.advance(text.substr(i, 1))) << i;
  EXPECT_TRUE(m.complete());
  EXPECT_FALSE(accepts(g, "\nZ\xC3\xA9\xF0\x9F\x98\x80"));  // . is not \n
  EXPECT_FALSE(accepts(g, "aa\xC3\xA9\xF0\x9F\x98\x80"));
  GrammarMatcher surrogate(compile("."));
  EXPECT_FALSE(surrogate.advance("\xED\xA0\x80"));  // U+D800 has no UTF-8 encoding
}

// Every string over a small alphabet up to kDepth characters: the grammar accepts it as a
// prefix exactly when PCRE2's hard partial match says it is one, and as a sentence exactly when
// PCRE2 matches it in full.
class Pcre2Oracle {
 public:
  explicit Pcre2Oracle(const std::string& pattern) {
    int code = 0;
    PCRE2_SIZE offset = 0;
    // \z rather than PCRE2_ENDANCHORED, which hard partial matching refuses.
    const std::string whole = "(?:" + pattern + ")\\z";
    re_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(whole.data()), whole.size(),
                        PCRE2_UTF | PCRE2_ANCHORED | PCRE2_DOLLAR_ENDONLY, &code, &offset, nullptr);
    data_ = pcre2_match_data_create(4, nullptr);
  }
  ~Pcre2Oracle() {
    pcre2_match_data_free(data_);
    pcre2_code_free(re_);
  }
  bool ok() const { return re_ != nullptr; }
  int match(const std::string& s, uint32_t options) const {
    return pcre2_match(re_, reinterpret_cast<PCRE2_SPTR>(s.data()), s.size(), 0, options, data_,
                       nullptr);
  }

 private:
  pcre2_code* re_ = nullptr;
  pcre2_match_data* data_ = nullptr;
};

void agree(const Pcre2Oracle& pcre, const GrammarMatcher& m, const std::string& text, int depth,
           const std::string& pattern, int& checked) {
  static const char* const kAlphabet[] = {"a", "b", "c", "1", "-", ".", "\n", " ", "\xC3\xA9"};
  const int full = pcre.match(text, 0);
  ++checked;
  ASSERT_EQ(m.complete(), full >= 0) << "/" << pattern << "/ on '" << text << "'";
  if (depth == 0) return;
  for (const char* ch : kAlphabet) {
    GrammarMatcher next = m;
    const bool ours = next.advance(ch);
    const std::string longer = text + ch;
    const int p = pcre.match(longer, PCRE2_PARTIAL_HARD);
    ASSERT_EQ(ours, p >= 0 || p == PCRE2_ERROR_PARTIAL)
        << "/" << pattern << "/ on prefix '" << longer << "'";
    if (ours) agree(pcre, next, longer, depth - 1, pattern, checked);
  }
}

TEST(RegexTest, PrefixesAndMatchesAgreeWithPcre2OnEveryShortString) {
  const std::vector<std::string> patterns = {"",
                                             "a",
                                             "a*",
                                             "(a|b)+c",
                                             "a{2,3}",
                                             "(ab|a)*b?",
                                             "[^a]*",
                                             "[a-c]{1,2}\\.",
                                             "\\d+(-\\d+)*",
                                             "\\w+ \\w",
                                             "(a?)*b",
                                             "(a*|b)*",
                                             "(|a)+",
                                             ".{2}",
                                             "[\\s\\d]+",
                                             "\\D\\W?",
                                             "\xC3\xA9+|\\.",
                                             "(a|b|)(c|)",
                                             "^a.b$",
                                             "[-a]+",
                                             "[a\\-c]+",
                                             "x{0}a",
                                             "(?:a|bc){0,2}c?",
                                             "(?P<n>a)b",
                                             "[\\x{e9}b]+",
                                             "a{2,}",
                                             "(a{1}){2}",
                                             "(a|ab)(c|bcd)",
                                             "[^\\n]{0,3}1",
                                             "(?#note)a+?b??"};
  int checked = 0;
  for (const std::string& p : patterns) {
    Pcre2Oracle pcre(p);
    ASSERT_TRUE(pcre.ok()) << p;
    const auto g = compile(p);
    ASSERT_NE(g, nullptr);
    agree(pcre, GrammarMatcher(g), "", 4, p, checked);
    if (::testing::Test::HasFatalFailure()) return;
  }
  EXPECT_GT(checked, 3000);
}

TEST(RegexTest, BadPatternsAreRefusedWithPcre2sMessageAndOffset) {
  EXPECT_EQ(error_of("a(b"),
            "invalid regular expression: missing closing parenthesis at byte offset 3");
  EXPECT_EQ(error_of("[z-a]"),
            "invalid regular expression: range out of order in character class at byte offset 3");
  EXPECT_EQ(error_of("*a"),
            "invalid regular expression: quantifier does not follow a repeatable item at byte "
            "offset 0");
  EXPECT_EQ(
      error_of("a\xFF"),
      "invalid regular expression: UTF-8 error: illegal byte (0xfe or 0xff) at byte offset 1");
  std::string deep(300, '(');
  deep += "a" + std::string(300, ')');
  EXPECT_EQ(error_of(deep),
            "invalid regular expression: parentheses are too deeply nested at byte offset 251");
}

TEST(RegexTest, ConstructsAGrammarCannotExpressAreRefusedByName) {
  const std::pair<const char*, const char*> cases[] = {
      {"(a)\\1", "backreference \\1 at byte offset 3"},
      {"(?P<x>a)(?P=x)", "named backreference (?P= at byte offset 8"},
      {"a(?=b)b", "lookahead (?= at byte offset 1"},
      {"a(?!c)b", "negative lookahead (?! at byte offset 1"},
      {"(?<=a)b", "lookbehind (?<= at byte offset 0"},
      {"(?<!a)b", "negative lookbehind (?<! at byte offset 0"},
      {"(?>a)b", "atomic group (?> at byte offset 0"},
      {"a++", "possessive quantifier at byte offset 2"},
      {"(?i)a", "inline flags (?i at byte offset 0"},
      {"a^b", "anchor ^ inside the pattern at byte offset 1"},
      {"a$b", "anchor $ inside the pattern at byte offset 1"},
      {"a\\bc", "word boundary \\b at byte offset 1"},
      {"\\p{L}", "Unicode property \\p at byte offset 0"},
      {"[[:alpha:]]", "POSIX class [: at byte offset 1"},
      {"a\\Kb", "escape \\K at byte offset 1"},
  };
  for (const auto& [pattern, what] : cases) {
    EXPECT_EQ(error_of(pattern), std::string("unsupported regular expression construct: ") + what)
        << pattern;
  }
}

// Quantified groups each add a level to the expression tree (PCRE2 refuses a quantifier right
// after another, and groups past 250): past 250 levels the pattern is refused by name, at the
// offset of the quantifier or group past the bound, before any tree deeper than the lowering's
// bound is built.
TEST(RegexTest, DeeplyNestedQuantifiedGroupsAreRefusedByName) {
  const auto chain = [](int levels) {
    std::string p;
    for (int i = 0; i < levels; ++i) p += "(?:";
    p += "a";
    for (int i = 0; i < levels; ++i) p += "){1}";
    return p;
  };
  // 'a' is level 1; level j's {1} (at 3 * 250 + 1 + 4 * (j - 1) + 1) makes level j + 1.
  EXPECT_EQ(error_of(chain(250)),
            "unsupported regular expression construct: groups and repetitions nested deeper than "
            "250 at byte offset 1748");
  const auto g = compile(chain(249));
  ASSERT_NE(g, nullptr);
  EXPECT_TRUE(accepts(g, "a"));
  EXPECT_FALSE(accepts(g, "aa"));
  std::string stars = std::string(200, '(') + "a*";
  for (int i = 0; i < 200; ++i) stars += ")*";
  EXPECT_THAT(error_of(stars),
              ::testing::StartsWith("unsupported regular expression construct: groups and "
                                    "repetitions nested deeper than 250 at byte offset "));
}

TEST(RegexTest, HugeRepetitionCountsAreBoundedAndTheGrammarSizeIsCapped) {
  EXPECT_EQ(error_of("a{10001}"), "repetition count 10001 at byte offset 1 is above 10000");
  EXPECT_EQ(error_of("a{2,99999999999999999999}"),
            "invalid regular expression: number too big in {} quantifier at byte offset 9");
  EXPECT_EQ(error_of("(ab){2,10001}"), "repetition count 10001 at byte offset 4 is above 10000");
  // Nesting multiplies the language, not the grammar: each level is one rule.
  const auto nested = compile("((a{10000}){10000}){10000}");
  GrammarMatcher m(nested);
  EXPECT_TRUE(m.advance(std::string(20000, 'a')));
  EXPECT_FALSE(m.complete());
  std::string wide;
  for (int i = 0; i < 210; ++i) wide += "a{10000}";
  EXPECT_EQ(error_of(wide), "the grammar is too large: more than 2097152 symbols");
}

// A repeated group of n nullable parts is rewritten as n alternatives of n - i parts each: past
// the symbol cap it is refused before any of them is built (n = 100000, a 200 KB pattern, would
// otherwise copy 5e9 parts).
TEST(RegexTest, ARepeatedGroupOfManyNullablePartsIsRefusedBeforeItIsBuilt) {
  std::string many = "(?:";
  for (int i = 0; i < 100000; ++i) many += "a?";
  many += ")*";
  EXPECT_EQ(error_of(many), "the grammar is too large: more than 2097152 symbols");
  std::string few = "(?:";
  for (int i = 0; i < 20; ++i) few += "a?";
  few += ")*b";
  EXPECT_TRUE(accepts(compile(few), "aaab"));
}

TEST(RegexTest, EmptyLanguagesAndTheEmptyPattern) {
  EXPECT_EQ(error_of("[^\\x00-\\x{10FFFF}]"),
            "the grammar's language is empty: rule 'pattern' derives no finite string");
  EXPECT_TRUE(accepts(compile("a|[^\\x00-\\x{10FFFF}]"), "a"));  // the dead branch is dropped
  GrammarMatcher empty(compile(""));
  EXPECT_TRUE(empty.complete());
  EXPECT_FALSE(empty.can_continue());  // only the end of the output (EOS) may follow
  GrammarMatcher done(compile("ab"));
  EXPECT_TRUE(done.advance("ab"));
  EXPECT_TRUE(done.complete());
  EXPECT_FALSE(done.can_continue());
}

TEST(RegexTest, AMaskForAPatternNoTokenCanStartAllowsNothing) {
  const TokenIndex index({"a", "ab", "b", "", "\xC3", "\xA9"});
  std::vector<uint32_t> mask(static_cast<size_t>(index.mask_words()));
  index.fill_mask(GrammarMatcher(compile("c+")), mask.data());
  EXPECT_EQ(mask[0], 0u);
  index.fill_mask(GrammarMatcher(compile("\xC3\xA9|ab?")), mask.data());
  EXPECT_EQ(mask[0], 0b010011u);  // "a", "ab", and the first byte of é
}

}  // namespace
}  // namespace simpler::grammar::regex_test
