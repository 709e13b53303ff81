// The pre-tokenizer regex runs under PCRE2 limits: a backtracking pattern from a hostile
// tokenizer.json fails encoding with RESOURCE_EXHAUSTED instead of running away, and Qwen3's own
// pattern stays inside the limits on long runs of every character class.
#include <fstream>
#include <sstream>
#include <string>

#include "base/test_temp_dir.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "simpler/tokenizer/tokenizer.h"

namespace simpler::llm {
namespace {

using ::testing::HasSubstr;

// The real tokenizer.json with its Split pattern replaced by `pattern`, loaded from a test dir.
absl::StatusOr<Tokenizer> qwen3_with_split_pattern(const std::string& pattern) {
  auto dir = default_tokenizer_dir();
  if (!dir.ok()) return dir.status();
  std::ifstream in(*dir + "/tokenizer.json");
  std::stringstream text;
  text << in.rdbuf();
  auto root = nlohmann::json::parse(text.str());
  root["pre_tokenizer"]["pretokenizers"][0]["pattern"] = {{"Regex", pattern}};
  const auto out_dir = simpler::testing::test_dir("tokenizer_regex_limits_test");
  std::ofstream(out_dir / "tokenizer.json") << root.dump();
  return Tokenizer::load(out_dir.string());
}

TEST(TokenizerRegexLimitsTest, BacktrackingPatternFailsWithResourceExhausted) {
  auto tok = qwen3_with_split_pattern("(a+)+$");
  ASSERT_TRUE(tok.ok()) << tok.status();
  const std::string text = "x " + std::string(40, 'a') + "!";
  auto ids = tok->try_encode(text);
  EXPECT_EQ(ids.status().code(), absl::StatusCode::kResourceExhausted) << ids.status();
  EXPECT_THAT(ids.status().message(),
              HasSubstr("pre-tokenizer regex gave up searching from byte 0 of a 43-byte section"));
  EXPECT_THAT(ids.status().message(), HasSubstr("match limit"));
  EXPECT_TRUE(tok->encode(text).empty());
  // Text the pattern handles quickly still encodes.
  auto ok = tok->try_encode("ab aa");
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(tok->decode(*ok), "ab aa");
}

TEST(TokenizerRegexLimitsTest, Qwen3PatternEncodesLongRunsOfEveryClass) {
  auto dir = default_tokenizer_dir();
  ASSERT_TRUE(dir.ok()) << dir.status();
  auto tok = Tokenizer::load(*dir);
  ASSERT_TRUE(tok.ok()) << tok.status();
  constexpr size_t kRun = 1 << 20;
  for (const char* unit : {"a", " ", "1", "!", "\n", " \n", "\xe4\xbd\xa0", "'s"}) {
    std::string text;
    while (text.size() < kRun) text += unit;
    text += "x";
    auto ids = tok->try_encode(text);
    ASSERT_TRUE(ids.ok()) << "run of '" << unit << "': " << ids.status();
    EXPECT_EQ(tok->decode(*ids), text) << "run of '" << unit << "'";
  }
}

}  // namespace
}  // namespace simpler::llm
