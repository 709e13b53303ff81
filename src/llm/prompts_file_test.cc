#include "simpler/llm/prompts_file.h"

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
  EXPECT_THAT(std::get<std::vector<int32_t>>(**spec), ElementsAre(9707, 11, 1879));
}

TEST(PromptsFileTest, MalformedLinesAreRefusedWithTheirReason) {
  EXPECT_EQ(parse_prompts_line("[1, 2]").status(), absl::InvalidArgumentError("not a JSON object"));
  EXPECT_EQ(parse_prompts_line("{\"prompt\": ").status(),
            absl::InvalidArgumentError("not a JSON object"));
  EXPECT_EQ(parse_prompts_line(R"({"prompt_ids": [1, 2.5]})").status(),
            absl::InvalidArgumentError("prompt_ids holds a non-integer"));
  EXPECT_EQ(parse_prompts_line(R"({"prompt": 3})").status(),
            absl::InvalidArgumentError("needs \"prompt\" (string) or \"prompt_ids\" (array)"));
}

}  // namespace
}  // namespace simpler::llm
