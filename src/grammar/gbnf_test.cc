#include "simpler/grammar/gbnf.h"

#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "grammar/expr.h"
#include "grammar/grammar_test_util.h"
#include "gtest/gtest.h"

namespace simpler::grammar::gbnf_test {
namespace {

std::string read_testdata(const std::string& name) {
  std::ifstream in(std::string(SIMPLER_GRAMMAR_TESTDATA) + "/" + name);
  EXPECT_TRUE(in.good()) << name;
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

using testing::accepts;

std::shared_ptr<const Grammar> compile(std::string_view text) {
  return testing::compiled_or_fail(compile_gbnf(text), text);
}

std::string error_of(std::string_view text) {
  return testing::refusal_of(compile_gbnf(text), text);
}

// `r1 ::= r2 r2`, ..., `r30 ::= "a" | ""`: the first byte can come from 2^30 places, each its
// own parser stack. Listing them is bounded (GrammarMatcher::kExpansionBudget): at the start the
// grammar is refused; after a prefix the step is a dead end, in bounded time.
std::string doubling_rules(int levels) {
  std::string text;
  for (int i = 1; i < levels; ++i) {
    text += "r" + std::to_string(i) + " ::= r" + std::to_string(i + 1) + " r" +
            std::to_string(i + 1) + "\n";
  }
  return text + "r" + std::to_string(levels) + " ::= \"a\" | \"\"\n";
}

TEST(GbnfTest, AGrammarWhosePlacesForABytesAreExponentialIsBoundedNotStalled) {
  EXPECT_THAT(error_of("root ::= r1 r1\n" + doubling_rules(30)),
              ::testing::StartsWith("the grammar is too ambiguous: the places its first byte can "
                                    "come from take more than 262144 steps to list"));
  const auto late = compile("root ::= \"x\" r1 r1 \"y\"\n" + doubling_rules(30));
  ASSERT_NE(late, nullptr);
  GrammarMatcher m(late);
  EXPECT_FALSE(m.advance("x"));  // past the budget: refused, as a byte no stack takes
  // A few levels stay well inside the budget and parse as before.
  const auto small = compile("root ::= r1 r1 \"y\"\n" + doubling_rules(6));
  EXPECT_TRUE(accepts(small, "aaay"));
  EXPECT_TRUE(accepts(small, "y"));
}

TEST(GbnfTest, LlamaCppsJsonGrammarAcceptsJsonObjectsOnly) {
  const auto g = compile(read_testdata("json.gbnf"));
  ASSERT_NE(g, nullptr);
  EXPECT_TRUE(accepts(g, R"({"a": [1, 2.5, -3e4, "x\n\u00e9"], "b": {"c": true, "d": null}})"));
  EXPECT_TRUE(accepts(g, "{\n  \"k\": \"\xE4\xB8\xAD\"\n}"));
  EXPECT_TRUE(accepts(g, "{}"));
  for (const char* bad : {"[1]", R"({"a":})", R"({"a": 01})", "{\"a\": \"\x01\"}", R"({'a': 1})"}) {
    EXPECT_FALSE(accepts(g, bad)) << bad;
  }
  GrammarMatcher m(g);
  EXPECT_TRUE(m.advance(R"({"a": [tr)"));
  EXPECT_FALSE(m.complete());
}

TEST(GbnfTest, LlamaCppsArithmeticAndListGrammars) {
  const auto arithmetic = compile(read_testdata("arithmetic.gbnf"));
  ASSERT_NE(arithmetic, nullptr);
  EXPECT_TRUE(accepts(arithmetic, "x+1=y\n"));
  EXPECT_TRUE(accepts(arithmetic, "(a*2 )/b_1= 3\nc=d\n"));
  for (const char* bad : {"=1\n", "x+=1\n", "X=1\n", "x=1"}) {
    EXPECT_FALSE(accepts(arithmetic, bad)) << bad;
  }
  const auto list = compile(read_testdata("list.gbnf"));
  ASSERT_NE(list, nullptr);
  EXPECT_TRUE(accepts(list,
                      "- milk\n- \xC3\xA9"
                      "clair\n"));
  EXPECT_FALSE(accepts(list, "- \n"));
  EXPECT_FALSE(accepts(list, "- a\xE2\x80\xA8z\n"));  // U+2028 is excluded
  EXPECT_FALSE(accepts(list, "- a\xC2\x85z\n"));      // so is U+0085
}

TEST(GbnfTest, RulesCanBeUsedBeforeTheyAreDefinedAndContinueAfterAlternationOrInGroups) {
  const auto g = compile(
      "# greeting\n"
      "root ::= greeting (\n"
      "  \" \" name   # a comment inside a group\n"
      ")? |\n"
      "  \"bye\"\n"
      "\n"
      "greeting ::= (\"hi\" | \"hello\") [!.]{0,2}\n"
      "name ::= [A-Z] [a-z]* \"\\u00e9\"?\n");
  ASSERT_NE(g, nullptr);
  for (const char* ok : {"hi", "hello!!", "hi. Bob", "hi Zo\xC3\xA9", "bye"}) {
    EXPECT_TRUE(accepts(g, ok)) << ok;
  }
  for (const char* bad : {"hello!!!", "hi bob", "bye ", "hibye"}) {
    EXPECT_FALSE(accepts(g, bad)) << bad;
  }
}

TEST(GbnfTest, RepetitionCountsAndNullableItems) {
  const auto g = compile("root ::= (\"a\"?)* \"b\" [0-9]{2} \"c\"{1,} \"d\"{2,3}\n");
  ASSERT_NE(g, nullptr);  // ("a"?)* is read as ("a")*: no left-recursive rule
  EXPECT_TRUE(accepts(g, "b12cdd"));
  EXPECT_TRUE(accepts(g, "aab12cccddd"));
  EXPECT_FALSE(accepts(g, "b1cdd"));
  EXPECT_FALSE(accepts(g, "b12dd"));
  EXPECT_FALSE(accepts(g, "b12cdddd"));
}

TEST(GbnfTest, ParseErrorsNameTheLineAndColumn) {
  const std::pair<const char*, const char*> cases[] = {
      {"root ::= foo\n", "rule 'foo' is used at 1:10 but never defined"},
      {"root ::= \"abc\n", "unterminated string literal at 1:10"},
      {"root ::= [a-", "unterminated character class at 1:10"},
      {"root = \"a\"", "expected ::= after the rule name at 1:6"},
      {"root ::= (\"a\"\n", "expected ) at 2:1"},
      {"root ::= \"a\"\n\n  ::= \"b\"", "expected a rule name at 3:3"},
      {"root ::= \"\\q\"", "unknown escape \\q at 1:11"},
      {"root ::= \"\\x4\"", "expected 2 hex digits after \\x at 1:11"},
      {"root ::= * \"a\"", "repetition without a preceding item at 1:10"},
      {"root ::= \"a\" ) \"b\"", "expected a newline or the end after the rule at 1:14"},
      {"root ::= [z-a]", "a range in a character class ends below its start at 1:11"},
      {"root ::= \"a\"{3,2}", "a repetition's maximum is below its minimum at 1:13"},
      {"root ::= <think> \"a\"", "token references (<...>, !<...>) are not supported at 1:10"},
      {"root ::= \"a\"{10001}", "repetition count 10001 at 1:14 is above 10000"},
      {"root ::= \"a\"\nroot ::= \"b\"", "rule 'root' is defined twice (at 1:1 and 2:1)"},
      {"item ::= \"a\"\n", "the grammar has no 'root' rule"},
  };
  for (const auto& [text, message] : cases) EXPECT_EQ(error_of(text), message) << text;
}

TEST(GbnfTest, LeftRecursionAndEmptyLanguagesAreRefusedNamingTheRule) {
  EXPECT_EQ(error_of("root ::= root \"a\" | \"b\""), "rule 'root' is left-recursive");
  EXPECT_EQ(error_of("root ::= ws* \"b\"\nws ::= \" \"?"),
            "rule 'root (repetition at 1:12)' is left-recursive");
  EXPECT_EQ(error_of("root ::= \"a\" root"),
            "the grammar's language is empty: rule 'root' derives no finite string");
  EXPECT_EQ(error_of("root ::= [^\\x00-\\U0010FFFF]"),
            "the grammar's language is empty: rule 'root' derives no finite string");
}

TEST(GbnfTest, DeepNestingAndTheMaskAgreeWithAdvancingEachToken) {
  const auto nest = [](int n) {
    return "root ::= " + std::string(n, '(') + "\"x\"" + std::string(n, ')');
  };
  const auto g = compile(nest(250));
  ASSERT_NE(g, nullptr);
  EXPECT_TRUE(accepts(g, "x"));
  EXPECT_EQ(error_of(nest(100000)), "groups and repetitions nested deeper than 250 at 1:260");
  EXPECT_THAT(error_of("root ::= \"a\"" + std::string(100000, '?')),
              ::testing::HasSubstr("groups and repetitions nested deeper than 250 at 1:"));
  const auto json = compile(read_testdata("json.gbnf"));
  const std::vector<std::string> vocab = {"{",   "{\"", "\"",   "a", ":",    " ",  "\n",
                                          "}",   "[",   "1",    "-", "true", "tr", "\\",
                                          "\\u", "é",   "\x01", "",  ",",    "]"};
  const TokenIndex index(vocab);
  GrammarMatcher m(json);
  for (const char* step : {"", "{", "\"a", "\":", " [", "1", ",tr", "ue]", "}"}) {
    ASSERT_TRUE(m.advance(step)) << step;
    std::vector<uint32_t> mask(static_cast<size_t>(index.mask_words()));
    index.fill_mask(m, mask.data());
    for (size_t t = 0; t < vocab.size(); ++t) {
      GrammarMatcher copy = m;
      const bool want = !vocab[t].empty() && copy.advance(vocab[t]);
      EXPECT_EQ(((mask[t / 32] >> (t % 32)) & 1) != 0, want)
          << "after '" << step << "': " << vocab[t];
    }
  }
  EXPECT_TRUE(m.complete());
}

// Every group and repetition names its generated rule after its place: in a 1 MiB grammar of
// ~26,000 lines, the places cost a binary search over the line starts each (their work is
// counted), not a scan from the start of the text.
TEST(GbnfTest, AMegabyteGrammarFindsItsPlacesInLogarithmicWork) {
  std::string text = "root ::= r0\n";
  int lines = 1;
  while (text.size() < (size_t{1} << 20)) {
    text += "r" + std::to_string(lines - 1) + " ::= (\"a\" | \"b\"){1,2} \"c\"?\n";
    ++lines;
  }
  int64_t steps = 0;
  absl::StatusOr<std::shared_ptr<const Grammar>> g = internal::compile_gbnf_counting(text, steps);
  ASSERT_TRUE(g.ok()) << g.status();
  // Three places a line (the group, {1,2} and ?), each at most ceil(log2(lines)) = 15 steps.
  EXPECT_GT(steps, 0);
  EXPECT_LE(steps, int64_t{3} * lines * 15);
  const std::string last = "r" + std::to_string(lines - 2);
  bool found = false;
  for (uint32_t r = 0; r < (*g)->num_rules(); ++r) {
    found = found || (*g)->rule_name(r) == last + " (group at " + std::to_string(lines) + ":" +
                                               std::to_string(last.size() + 6) + ")";
  }
  EXPECT_TRUE(found) << "no group named after line " << lines;
  EXPECT_TRUE(accepts(*g, "abc"));
  EXPECT_FALSE(accepts(*g, "abbc"));
}

// Generated rules name their rule, shortened past 48 bytes: a 4 KiB rule name with 200 repeated
// groups gives names of at most 48 + 3 + the place's bytes each, not hundreds of copies of the
// name (3 MiB of names before).
TEST(GbnfTest, GeneratedRuleNamesDoNotCopyALongRuleName) {
  const std::string name = "n" + std::string(4095, 'x');
  std::string text = "root ::= " + name + "\n" + name + " ::=";
  for (int i = 0; i < 200; ++i) text += " (\"a\" | \"b\"){1,2}";
  const auto g = compile(text);
  ASSERT_NE(g, nullptr);
  size_t total = 0;
  for (uint32_t r = 0; r < g->num_rules(); ++r) {
    const std::string& n = g->rule_name(r);
    total += n.size();
    if (n != "root" && n != name) {
      EXPECT_THAT(n, ::testing::StartsWith(name.substr(0, 48) + "... ("));
      EXPECT_LE(n.size(), 48u + 3u + 40u) << n;
    }
  }
  EXPECT_LE(total, 2 * name.size() + g->num_rules() * (48 + 3 + 40));
  EXPECT_TRUE(accepts(g, std::string(200, 'a')));
  EXPECT_TRUE(accepts(g, std::string(400, 'b')));
  EXPECT_FALSE(accepts(g, std::string(199, 'a')));
}

}  // namespace
}  // namespace simpler::grammar::gbnf_test
