// The pre-tokenizer regex runs under PCRE2 limits: a backtracking pattern from a hostile
// tokenizer.json fails encoding with RESOURCE_EXHAUSTED instead of running away, and Qwen3's own
// pattern stays inside the limits on long runs of every character class.
#include <fstream>
#include <sstream>
#include <string>

#include "base/sanitizers.h"
#include "base/test_temp_dir.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "simpler/tokenizer/tokenizer.h"
#include "tokenizer/tokenizer_test_util.h"

namespace simpler::llm {
namespace {

using ::testing::HasSubstr;

// The real tokenizer.json with its Split pattern replaced by `pattern`, loaded from a test dir.
// The file is edited as text (the first "Regex" string after "pre_tokenizer"): parsing and
// dumping its 11 MB as JSON took most of this suite's time under the sanitizers.
absl::StatusOr<Tokenizer> qwen3_with_split_pattern(const std::string& pattern) {
  auto dir = default_tokenizer_dir();
  if (!dir.ok()) return dir.status();
  std::ifstream in(*dir + "/tokenizer.json");
  std::stringstream buffer;
  buffer << in.rdbuf();
  std::string text = buffer.str();
  const size_t key = text.find("\"Regex\"", text.find("\"pre_tokenizer\""));
  const size_t colon = key == std::string::npos ? key : text.find(':', key);
  const size_t begin = colon == std::string::npos ? colon : text.find('"', colon);
  if (begin == std::string::npos) {
    return absl::InternalError("no pre_tokenizer Regex string in " + *dir + "/tokenizer.json");
  }
  size_t end = begin + 1;  // the closing quote, past escaped characters
  while (end < text.size() && text[end] != '"') end += text[end] == '\\' ? 2 : 1;
  if (end >= text.size()) return absl::InternalError("unterminated Regex string");
  text.replace(begin, end + 1 - begin, nlohmann::json(pattern).dump());
  const auto out_dir = simpler::testing::test_dir("tokenizer_regex_limits_test");
  std::ofstream(out_dir / "tokenizer.json") << text;
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

class Qwen3RegexLimitsTest : public testing::Qwen3TokenizerFixture {};

TEST_F(Qwen3RegexLimitsTest, Qwen3PatternEncodesLongRunsOfEveryClass) {
  // 1 MiB runs in the release leg; a sanitizer's 5x slower matcher gets 128 KiB runs, still far
  // past the lengths where a per-match limit would show.
  constexpr size_t kRun = SIMPLER_SANITIZED ? size_t{1} << 17 : size_t{1} << 20;
  for (const char* unit : {"a", " ", "1", "!", "\n", " \n", "\xe4\xbd\xa0", "'s"}) {
    std::string text;
    while (text.size() < kRun) text += unit;
    text += "x";
    auto ids = tok().try_encode(text);
    ASSERT_TRUE(ids.ok()) << "run of '" << unit << "': " << ids.status();
    EXPECT_EQ(tok().decode(*ids), text) << "run of '" << unit << "'";
  }
}

}  // namespace
}  // namespace simpler::llm
