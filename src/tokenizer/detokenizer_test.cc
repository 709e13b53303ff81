#include "simpler/tokenizer/detokenizer.h"

#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tokenizer/tokenizer_test_util.h"

namespace simpler::llm {
namespace {

// The real Qwen3 tokenizer, loaded once for the suite.
class DetokenizerTest : public testing::Qwen3TokenizerFixture {
 protected:
  // Streams `ids` one token at a time; checks every delta is whole UTF-8 and
  // that the deltas add up to decode(ids). Returns the deltas.
  static std::vector<std::string> stream(const std::vector<int32_t>& ids, bool skip = false) {
    IncrementalDetokenizer d(tokenizer_.get(), skip);
    std::vector<std::string> deltas;
    for (int32_t id : ids) {
      deltas.push_back(d.push(std::span<const int32_t>(&id, 1)));
      EXPECT_TRUE(valid_utf8(deltas.back())) << "delta splits a character after id " << id;
    }
    deltas.push_back(d.finish());
    std::string joined;
    for (const auto& s : deltas) joined += s;
    EXPECT_EQ(joined, tokenizer_->decode(ids, skip));
    EXPECT_EQ(d.text(), joined);
    EXPECT_EQ(d.num_ids(), static_cast<int64_t>(ids.size()));
    return deltas;
  }
};

TEST_F(DetokenizerTest, CharactersSplitAcrossTokensAreNeverSplitInADelta) {
  // Emoji and CJK text: byte-level BPE spreads some characters over tokens.
  const std::string text = "Hi 😀🦊 中文字符 naïve café 🎉 done";
  const std::vector<int32_t> ids = tokenizer_->encode(text);
  bool some_token_is_partial = false;
  for (int32_t id : ids) {
    const std::string one = tokenizer_->decode(std::vector<int32_t>{id});
    some_token_is_partial = some_token_is_partial || one.find("\xEF\xBF\xBD") != std::string::npos;
  }
  ASSERT_TRUE(some_token_is_partial) << "the text no longer exercises partial-character tokens";
  const auto deltas = stream(ids);
  std::string joined;
  for (const auto& s : deltas) joined += s;
  EXPECT_EQ(joined, text);
}

TEST_F(DetokenizerTest, RandomTokenSequencesConcatenateToTheirDecodeExactly) {
  std::mt19937 rng(7);
  std::uniform_int_distribution<int32_t> any(0, tokenizer_->vocab_size() - 1);
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<int32_t> ids(1 + trial % 40);
    for (auto& id : ids) id = any(rng);
    stream(ids, /*skip=*/trial % 2 == 1);
  }
}

TEST_F(DetokenizerTest, AnIncompleteCharacterAtTheEndIsReleasedByFinish) {
  // The first token of a multi-token character alone: held back until finish,
  // which releases it as decode renders it (U+FFFD).
  std::vector<int32_t> ids;
  for (const char* rare : {"🦊", "𝄞", "🫠", "䶵", "𓀀"}) {
    ids = tokenizer_->encode(rare);
    if (ids.size() > 1 && tokenizer_->decode(std::vector<int32_t>{ids[0]}).find("\xEF\xBF\xBD") !=
                              std::string::npos) {
      break;
    }
    ids.clear();
  }
  ASSERT_FALSE(ids.empty()) << "no candidate character spans several tokens";
  IncrementalDetokenizer d(tokenizer_.get());
  EXPECT_EQ(d.push(std::span<const int32_t>(ids.data(), 1)), "");
  EXPECT_EQ(d.finish(), tokenizer_->decode(std::vector<int32_t>{ids[0]}));
}

// The token whose raw bytes are exactly `bytes`, or -1.
int32_t byte_token(const Tokenizer& t, const std::string& bytes) {
  for (int32_t id = 0; id < t.vocab_size(); ++id) {
    if (t.decode_bytes(std::vector<int32_t>{id}) == bytes) return id;
  }
  return -1;
}

TEST_F(DetokenizerTest, InvalidBytesAreReleasedAtOnceAndOnlyAnIncompleteCharacterIsHeld) {
  const int32_t cont = byte_token(*tokenizer_, "\x80");  // a lone continuation byte: invalid
  const int32_t e4 = byte_token(*tokenizer_, "\xE4");
  const int32_t b8 = byte_token(*tokenizer_, "\xB8");
  const int32_t ad = byte_token(*tokenizer_, "\xAD");
  ASSERT_TRUE(cont >= 0 && e4 >= 0 && b8 >= 0 && ad >= 0);
  IncrementalDetokenizer d(tokenizer_.get());
  // A model emitting invalid bytes forever: each is U+FFFD at once, nothing accumulates
  // (a push costs its own bytes, not the history's).
  for (int i = 0; i < 20000; ++i) {
    ASSERT_EQ(d.push(std::span<const int32_t>(&cont, 1)), "\xEF\xBF\xBD") << "push " << i;
  }
  // E4 B8 AD is U+4E2D: held until complete.
  EXPECT_EQ(d.push(std::span<const int32_t>(&e4, 1)), "");
  EXPECT_EQ(d.push(std::span<const int32_t>(&b8, 1)), "");
  EXPECT_EQ(d.push(std::span<const int32_t>(&ad, 1)), "\xE4\xB8\xAD");
  // A lead byte followed by a byte it cannot take: both become U+FFFD at once (E4 then 80 is
  // one maximal subpart, E4 then E4 releases the first E4).
  EXPECT_EQ(d.push(std::span<const int32_t>(&e4, 1)), "");
  EXPECT_EQ(d.push(std::span<const int32_t>(&e4, 1)), "\xEF\xBF\xBD");
  EXPECT_EQ(d.finish(), "\xEF\xBF\xBD");
  std::vector<int32_t> all(20000, cont);
  for (int32_t id : {e4, b8, ad, e4, e4}) all.push_back(id);
  EXPECT_EQ(d.text(), tokenizer_->decode(all));
}

TEST(StopStringMatcher, AStopStringSpanningDeltasCutsTheTextBeforeIt) {
  auto m = StopStringMatcher::create({"lazy dog", "END"});
  ASSERT_TRUE(m.ok());
  std::string released;
  bool stopped = false;
  for (const char* delta : {"The quick brown fox jumps over the la", "zy", " do", "g and more"}) {
    auto r = m->push(delta);
    released += r.text;
    // Never releases the stop string or a prefix of it that later completes.
    EXPECT_EQ(released.find("la"), std::string::npos) << released;
    if (r.stopped) {
      stopped = true;
      EXPECT_EQ(r.stop_index, 0);
    }
  }
  EXPECT_TRUE(stopped);
  EXPECT_EQ(released, "The quick brown fox jumps over the ");
  EXPECT_TRUE(m->push("more").stopped);
  EXPECT_EQ(m->finish(), "");
}

TEST(StopStringMatcher, AHeldPrefixThatDoesNotCompleteIsReleased) {
  auto m = StopStringMatcher::create({"</answer>"});
  ASSERT_TRUE(m.ok());
  auto a = m->push("x </ans");
  EXPECT_EQ(a.text, "x ");
  EXPECT_FALSE(a.stopped);
  auto b = m->push("wer> not quite");
  EXPECT_EQ(b.text, "");  // "</answer>" completed: nothing after "x " is released
  EXPECT_TRUE(b.stopped);
  auto n = StopStringMatcher::create({"</answer>"});
  auto c = n->push("x </ans");
  auto d = n->push("wered");
  EXPECT_EQ(c.text + d.text, "x </answered");
  EXPECT_FALSE(d.stopped);
  EXPECT_EQ(n->finish(), "");
  auto e = n->push("tail </an");
  EXPECT_EQ(e.text, "tail ");
  EXPECT_EQ(n->finish(), "</an");  // the request ended: the held prefix is text after all
}

TEST(StopStringMatcher, TheEarliestMatchWinsAndMultibyteStopsWork) {
  auto m = StopStringMatcher::create({"cd", "bc", "中文"});
  ASSERT_TRUE(m.ok());
  auto r = m->push("abcd");
  EXPECT_TRUE(r.stopped);
  EXPECT_EQ(r.text, "a");
  EXPECT_EQ(r.stop_index, 1);
  auto u = StopStringMatcher::create({"中文"});
  auto x = u->push("说中");
  EXPECT_EQ(x.text, "说");
  auto y = u->push("文");
  EXPECT_TRUE(y.stopped);
  EXPECT_EQ(y.text, "");
}

// Before min_tokens no stop string may end (vLLM checks them only from
// min_tokens on); one that starts before and ends after still matches.
TEST(StopStringMatcher, NoStopStringEndsBeforeTheMatcherIsArmed) {
  auto m = StopStringMatcher::create({"END"});
  ASSERT_TRUE(m.ok());
  auto a = m->push("one END two E", /*armed=*/false);
  EXPECT_FALSE(a.stopped);
  EXPECT_EQ(a.text, "one END two ");  // "E" may begin a stop string: held
  auto b = m->push("ND three", /*armed=*/true);
  EXPECT_TRUE(b.stopped);
  EXPECT_EQ(b.text, "");
  auto n = StopStringMatcher::create({"END"});
  EXPECT_FALSE(n->push("xEND", false).stopped);
  auto c = n->push(" yEND z", true);
  EXPECT_TRUE(c.stopped);
  EXPECT_EQ(c.text, " y");
}

TEST(StopStringMatcher, EmptyOrInvalidStopStringsAreRefusedNamingTheirIndex) {
  auto empty = StopStringMatcher::create({"ok", ""});
  ASSERT_FALSE(empty.ok());
  EXPECT_EQ(empty.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(empty.status().message(), "stop string 1 is empty");
  auto bad = StopStringMatcher::create({"\xff\xfe"});
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().message(), "stop string 0 is not valid UTF-8");
}

}  // namespace
}  // namespace simpler::llm
