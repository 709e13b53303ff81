#include "cli/prompts_file.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace simpler::llm {
namespace {

using ::testing::ElementsAre;

TEST(PromptsFileTest, BlankLineIsSkipped) {
  for (const char* line : {"", " ", "\t \r"}) {
    auto spec = parse_prompts_line(line);
    ASSERT_TRUE(spec.ok()) << spec.status();
    EXPECT_FALSE(spec->has_value()) << "'" << line << "'";
  }
}

TEST(PromptsFileTest, PromptLineGivesItsText) {
  auto spec = parse_prompts_line(R"({"prompt": "caf\u00e9\n"})");
  ASSERT_TRUE(spec.ok()) << spec.status();
  ASSERT_TRUE(spec->has_value());
  EXPECT_EQ(std::get<std::string>(**spec), "caf\xc3\xa9\n");
}

TEST(PromptsFileTest, PromptIdsLineGivesItsIds) {
  auto spec = parse_prompts_line("{\"prompt_ids\": [9707, 11, 1879]}\r");
  ASSERT_TRUE(spec.ok()) << spec.status();
  ASSERT_TRUE(spec->has_value());
  EXPECT_THAT(std::get<std::vector<int64_t>>(**spec), ElementsAre(9707, 11, 1879));
}

TEST(PromptsFileTest, IdsAreKeptWideNotNarrowed) {
  auto spec = parse_prompts_line(R"({"prompt_ids": [4294967301, 10000000000, -3]})");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_THAT(std::get<std::vector<int64_t>>(**spec), ElementsAre(4294967301LL, 10000000000LL, -3));
  auto huge = parse_prompts_line(R"({"prompt_ids": [1, 18446744073709551615]})", "p.jsonl:2");
  EXPECT_EQ(huge.status(),
            absl::InvalidArgumentError(
                "p.jsonl:2: prompt_ids[1] = 18446744073709551615 is not a token id"));
}

TEST(PromptsFileTest, MalformedLinesAreRefusedWithTheirReason) {
  EXPECT_EQ(parse_prompts_line("[1, 2]", "f:1").status(),
            absl::InvalidArgumentError("f:1: expected a JSON object, got array [1,2]"));
  absl::Status truncated = parse_prompts_line("{\"prompt\": ", "f:2").status();
  EXPECT_EQ(truncated.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(std::string(truncated.message()).rfind("f:2", 0), 0u) << truncated;
  // The parser's own position is the column within the line: no second line number after f:5.
  EXPECT_EQ(std::string(parse_prompts_line(R"({"prompt": "x", bad})", "f:5").status().message())
                .rfind("f:5: malformed JSON: parse error at column 17: syntax error", 0),
            0u)
      << parse_prompts_line(R"({"prompt": "x", bad})", "f:5").status();
  EXPECT_EQ(parse_prompts_line(R"({"prompt_ids": [1, 2.5]})", "f:3").status(),
            absl::InvalidArgumentError("f:3: prompt_ids[1] is not an integer: 2.5"));
  EXPECT_EQ(parse_prompts_line(R"({"prompt": 3})", "f:4").status(),
            absl::InvalidArgumentError("f:4: needs \"prompt\" (string) or \"prompt_ids\" (array)"));
  EXPECT_FALSE(parse_prompts_line(std::string("{\"prompt\": \"a\"}\0xyz", 17)).ok());
}

TEST(PromptsFileTest, UnknownKeysAndBothPromptsAreRefusedNamingTheKey) {
  EXPECT_EQ(
      parse_prompts_line(R"({"prompt":"A","max_tokens":5,"temperature":9})", "p.jsonl:4").status(),
      absl::InvalidArgumentError("p.jsonl:4: unknown key \"max_tokens\" (a line holds "
                                 "\"prompt\" or \"prompt_ids\" and nothing else)"));
  EXPECT_EQ(
      parse_prompts_line(R"({"prompt":"A","prompt_ids":[1]})", "p.jsonl:5").status(),
      absl::InvalidArgumentError("p.jsonl:5: give one of \"prompt\" and \"prompt_ids\", not both"));
}

}  // namespace
}  // namespace simpler::llm
