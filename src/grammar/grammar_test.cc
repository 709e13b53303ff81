#include "simpler/grammar/grammar.h"

#include <random>
#include <string>
#include <vector>

#include "base/sanitizers.h"
#include "gmock/gmock.h"
#include "grammar/grammar_test_util.h"
#include "gtest/gtest.h"
#include "simpler/grammar/json_schema.h"

namespace simpler::grammar {
namespace {

using ::testing::HasSubstr;

// S ::= "a" S "b" | "c"  (a^n c b^n: needs the stack, not a regular language)
std::shared_ptr<const Grammar> anbn() {
  GrammarBuilder b;
  const uint32_t s = b.add_rule("S");
  GrammarBuilder::Sequence rec = b.literal("a");
  rec.push_back(GrammarBuilder::ref(s));
  b.append_literal("b", rec);
  b.add_alternative(s, rec);
  b.add_alternative(s, b.literal("c"));
  return *std::move(b).build(s);
}

using testing::accepts;

std::vector<int32_t> allowed(const TokenIndex& index, const GrammarMatcher& m) {
  std::vector<uint32_t> mask(static_cast<size_t>(index.mask_words()));
  index.fill_mask(m, mask.data());
  std::vector<int32_t> ids;
  for (int32_t t = 0; t < index.vocab_size(); ++t) {
    if ((mask[t / 32] >> (t % 32)) & 1) ids.push_back(t);
  }
  return ids;
}

TEST(GrammarTest, AcceptsExactlyTheSentencesOfANestedLanguage) {
  const auto g = anbn();
  for (const char* ok : {"c", "acb", "aaacbbb"}) EXPECT_TRUE(accepts(g, ok)) << ok;
  for (const char* bad : {"", "a", "ab", "acbb", "aacb", "cc", "acbx"}) {
    EXPECT_FALSE(accepts(g, bad)) << bad;
  }
}

TEST(GrammarTest, AdvanceIsAllOrNothingAndKnowsPrefixesFromSentences) {
  GrammarMatcher m(anbn());
  EXPECT_TRUE(m.advance("aa"));
  EXPECT_FALSE(m.complete());
  EXPECT_TRUE(m.can_continue());
  EXPECT_FALSE(m.advance("cbx"));  // refused as a whole: the state is still after "aa"
  EXPECT_TRUE(m.advance("c"));
  EXPECT_TRUE(m.advance("b"));
  EXPECT_FALSE(m.complete());
  EXPECT_TRUE(m.advance("b"));
  EXPECT_TRUE(m.complete());
  EXPECT_FALSE(m.can_continue());
}

TEST(GrammarTest, AdvancesByTokenBytesThatSplitAUtf8Character) {
  const auto g = json_object_grammar();
  GrammarMatcher m(g);
  const std::string text = "{\"k\":\"\xC3\xA9\xF0\x9F\x98\x80\"}";  // é, 😀
  for (size_t i = 0; i < text.size(); ++i) {
    ASSERT_TRUE(m.advance(text.substr(i, 1))) << "byte " << i;
  }
  EXPECT_TRUE(m.complete());
  GrammarMatcher bad(g);
  EXPECT_TRUE(bad.advance("{\"k\":\"\xC3"));
  EXPECT_FALSE(bad.advance("\""));        // a lead byte must be followed by a continuation
  EXPECT_FALSE(bad.advance("\xC0\x80"));  // no overlong encodings
}

TEST(GrammarTest, LeftRecursionIsRefusedNamingTheRule) {
  GrammarBuilder b;
  const uint32_t e = b.add_rule("expr");
  const uint32_t opt = b.optional(b.literal("-"), "sign");
  b.add_alternative(
      e, {GrammarBuilder::ref(opt), GrammarBuilder::ref(e), b.bytes(ByteClass::of('+'))});
  b.add_alternative(e, b.literal("1"));
  const auto g = std::move(b).build(e);
  ASSERT_FALSE(g.ok());
  EXPECT_EQ(g.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(g.status().message(), "rule 'expr' is left-recursive");
}

TEST(GrammarTest, AnEmptyLanguageIsRefusedNamingTheRoot) {
  GrammarBuilder b;
  const uint32_t loop = b.add_rule("loop");  // loop ::= "x" loop: no finite string
  GrammarBuilder::Sequence s = b.literal("x");
  s.push_back(GrammarBuilder::ref(loop));
  b.add_alternative(loop, s);
  const auto g = std::move(b).build(loop);
  ASSERT_FALSE(g.ok());
  EXPECT_EQ(g.status().message(),
            "the grammar's language is empty: rule 'loop' derives no finite string");
  GrammarBuilder b2;
  const uint32_t none = b2.add_rule("none");
  EXPECT_EQ(std::move(b2).build(none).status().message(),
            "the grammar's language is empty: rule 'none' derives no finite string");
}

TEST(GrammarTest, DeadEndAlternativesAreDroppedSoEveryAcceptedPrefixCanFinish) {
  GrammarBuilder b;
  const uint32_t dead = b.add_rule("dead");  // no alternatives
  const uint32_t root = b.add_rule("root");
  GrammarBuilder::Sequence trap = b.literal("ab");
  trap.push_back(GrammarBuilder::ref(dead));
  b.add_alternative(root, trap);
  b.add_alternative(root, b.literal("ac"));
  const auto g = *std::move(b).build(root);
  GrammarMatcher m(g);
  EXPECT_TRUE(m.advance("a"));
  EXPECT_FALSE(m.advance("b"));
  EXPECT_TRUE(accepts(g, "ac"));
}

TEST(GrammarTest, EmptyByteClassesAndUndefinedRulesAreRefused) {
  GrammarBuilder b;
  const uint32_t r = b.add_rule("r");
  b.add_alternative(r, {b.bytes(ByteClass{})});
  EXPECT_EQ(std::move(b).build(r).status().message(), "rule 'r' has an empty byte class");
  GrammarBuilder b2;
  const uint32_t r2 = b2.add_rule("r2");
  b2.add_alternative(r2, {GrammarBuilder::ref(7)});
  EXPECT_EQ(std::move(b2).build(r2).status().message(),
            "rule 'r2' refers to rule 7, which is undefined");
  EXPECT_EQ(std::move(GrammarBuilder()).build(0).status().message(),
            "root rule 0 is outside the 0 rules");
}

TEST(GrammarTest, TheMaskOnASmallVocabularyIsExactlyTheTokensThatKeepAValidPrefix) {
  // ids:                          0    1     2     3    4   5    6      7    8
  const TokenIndex index({"a", "aa", "acb", "c", "b", "", "cbb", "ab", "a"});
  EXPECT_EQ(index.vocab_size(), 9);
  GrammarMatcher m(anbn());
  EXPECT_THAT(allowed(index, m), ::testing::ElementsAre(0, 1, 2, 3, 8));  // "" (special): never
  ASSERT_TRUE(m.advance("a"));
  // "cbb" would close one more "a" than was opened; "ab" needs "a" or "c" after "a".
  EXPECT_THAT(allowed(index, m), ::testing::ElementsAre(0, 1, 2, 3, 8));
  ASSERT_TRUE(m.advance("c"));
  EXPECT_THAT(allowed(index, m), ::testing::ElementsAre(4));
  ASSERT_TRUE(m.advance("b"));
  EXPECT_THAT(allowed(index, m), ::testing::ElementsAre());  // complete: only the end is left
}

TEST(GrammarTest, TheTrieMaskAgreesWithAdvancingEveryTokenOnItsOwn) {
  std::vector<std::string> vocab;
  for (int c = 1; c < 256; ++c) vocab.push_back(std::string(1, static_cast<char>(c)));
  for (const char* t : {"{\"", "\":", "\",\"", "true", "false", "null", "]}", "[1,", "\"}", "é",
                        "\xF0\x9F", "\x98\x80", "12", "-0.5e+3", "\\u00", "\\n", "{}", "[]"}) {
    vocab.push_back(t);
  }
  const TokenIndex index(vocab);
  const auto g = json_object_grammar();
  std::mt19937_64 rng(5);
  GrammarMatcher m(g);
  for (int step = 0; step < 60 && m.can_continue(); ++step) {
    const std::vector<int32_t> ids = allowed(index, m);
    std::vector<int32_t> brute;
    for (int32_t t = 0; t < static_cast<int32_t>(vocab.size()); ++t) {
      GrammarMatcher copy = m;
      if (copy.advance(vocab[t])) brute.push_back(t);
    }
    ASSERT_EQ(ids, brute) << "step " << step;
    ASSERT_FALSE(ids.empty());
    ASSERT_TRUE(m.advance(vocab[ids[rng() % ids.size()]]));
  }
}

// Stacks are copied per byte, so a byte costs O(depth): 1000 levels take ~0.3 s in release
// (fewer under the sanitizers, which run it 30x slower).
TEST(GrammarTest, DeepNestingIsParsedWithoutRecursionLimits) {
  const int depth = SIMPLER_SANITIZED ? 300 : 1000;
  std::string text;
  for (int i = 0; i < depth; ++i) text += "{\"a\":";
  text += "[]";
  for (int i = 0; i < depth; ++i) text += "}";
  GrammarMatcher m(json_object_grammar());
  ASSERT_TRUE(m.advance(text));
  EXPECT_TRUE(m.complete());
  GrammarMatcher open(json_object_grammar());
  ASSERT_TRUE(open.advance(text.substr(0, text.size() - 1)));
  EXPECT_FALSE(open.complete());
}

}  // namespace
}  // namespace simpler::grammar
