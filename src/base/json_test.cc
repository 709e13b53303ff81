#include "simpler/base/json.h"

#include <sys/stat.h>

#include <fstream>
#include <string>

#include "base/test_temp_dir.h"
#include "gtest/gtest.h"
#include "simpler/base/file.h"

namespace simpler::base {
namespace {

using nlohmann::json;

std::string nested(const std::string& prefix, int depth, const std::string& suffix) {
  return prefix + std::string(depth, '[') + std::string(depth, ']') + suffix;
}

TEST(ParseJsonBounded, ParsesAnObjectWithTrailingWhitespace) {
  auto j = parse_json_bounded("{\"a\": [1, {\"b\": 2}]}  \n\t ", "x.json");
  ASSERT_TRUE(j.ok()) << j.status();
  EXPECT_EQ((*j)["a"][1]["b"], 2);
}

TEST(ParseJsonBounded, RefusesAValueNestedDeeperThanTheBoundNamingItsPath) {
  // 100,000 levels: nlohmann's dump() of this value overflows the stack.
  auto j = parse_json_bounded(nested("{\"hidden_size\": ", 100000, "}"), "config.json");
  ASSERT_EQ(j.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(j.status().message(), "config.json: JSON nested deeper than 64 levels at /hidden_size");
}

TEST(ParseJsonBounded, AcceptsExactlyTheMaximumDepth) {
  EXPECT_TRUE(parse_json_bounded(nested("", 4, ""), "x", 4).ok());
  auto j = parse_json_bounded(nested("", 5, ""), "x", 4);
  EXPECT_EQ(j.status().message(), "x: JSON nested deeper than 4 levels at /");
}

TEST(ParseJsonBounded, TurnsANumberOutsideTheDoubleRangeIntoAnError) {
  // nlohmann throws out_of_range (not parse_error) for this.
  auto j = parse_json_bounded("{\"model_max_length\": 1e400}", "tokenizer_config.json");
  ASSERT_EQ(j.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(j.status().message(),
            "tokenizer_config.json: malformed JSON: number overflow parsing '1e400'");
}

TEST(ParseJsonBounded, RefusesANulByteAndTheGarbageAfterIt) {
  const std::string text("{\"a\": 1}\0garbage", 16);
  auto j = parse_json_bounded(text, "h");
  ASSERT_EQ(j.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(j.status().message(), "h: malformed JSON: NUL byte at offset 8");
}

TEST(ParseJsonBounded, RefusesTrailingGarbage) {
  auto j = parse_json_bounded("{} x", "h");
  ASSERT_EQ(j.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(std::string(j.status().message())
                  .starts_with("h: malformed JSON: parse error at line 1, column 4: syntax error"))
      << j.status();
}

TEST(ParseJsonBounded, RefusesADuplicateKeyNamingItAndItsObject) {
  auto j = parse_json_bounded(R"({"weight_map": {"a": "x", "b": "y", "a": "z"}})", "index.json");
  ASSERT_EQ(j.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(j.status().message(), "index.json: duplicate key 'a' in the object at /weight_map");
  // The same key in different objects is fine.
  EXPECT_TRUE(parse_json_bounded(R"({"a": {"a": 1}, "b": {"a": 2}})", "x").ok());
}

TEST(ParseOrderedJsonBounded, KeepsKeyOrderAndAppliesTheSameBounds) {
  auto j = parse_ordered_json_bounded(R"({"z": 1, "a": {"y": 2, "b": 3}})", "body");
  ASSERT_TRUE(j.ok()) << j.status();
  EXPECT_EQ(j->dump(), R"({"z":1,"a":{"y":2,"b":3}})");
  EXPECT_EQ(parse_ordered_json_bounded(nested("", 5, ""), "x", 4).status().message(),
            "x: JSON nested deeper than 4 levels at /");
  EXPECT_EQ(parse_ordered_json_bounded(R"({"t": {"k": 1, "k": 2}})", "body").status().message(),
            "body: duplicate key 'k' in the object at /t");
}

TEST(ParseJsonBounded, RefusesInvalidUtf8AndALoneSurrogate) {
  auto bad = parse_json_bounded("{\"prompt\": \"\xff\"}", "p:1");
  ASSERT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(std::string(bad.status().message()).starts_with("p:1: malformed JSON: "))
      << bad.status();
  EXPECT_NE(bad.status().message().find("UTF-8"), std::string::npos) << bad.status();
  auto lone = parse_json_bounded(R"({"prompt": "\ud800"})", "p:2");
  ASSERT_EQ(lone.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(lone.status().message().find("surrogate"), std::string::npos) << lone.status();
}

TEST(ParseJsonBounded, BoundsTheQuotedParserMessage) {
  // An unterminated string of 1 MB: the parser's "last read" holds all of it.
  auto j = parse_json_bounded("\"" + std::string(1 << 20, 'a'), "big");
  ASSERT_FALSE(j.ok());
  EXPECT_LE(j.status().message().size(), 300u);
}

TEST(QuoteJsonPrefix, BoundsAValueOfAnyDepthWithoutRecursing) {
  json deep = json::array();
  json* cur = &deep;
  for (int i = 0; i < 200000; ++i) {
    cur->push_back(json::array());
    cur = &cur->back();
  }
  const std::string q = quote_json_prefix(deep, 40);
  EXPECT_EQ(q, std::string(40, '[') + "...");
}

TEST(QuoteJsonPrefix, QuotesSmallValuesWhole) {
  EXPECT_EQ(quote_json_prefix(json::parse(R"({"a":[1,2.5,"x"],"b":null})")),
            R"({"a":[1,2.5,"x"],"b":null})");
  EXPECT_EQ(quote_json_prefix(json(std::string(1000, 'y')), 10), "\"yyyyyyyyy...");
}

TEST(QuoteJsonPrefix, ReplacesBytesThatAreNotUtf8) {
  EXPECT_EQ(quote_json_prefix(json(std::string("a\xff"))), "\"a\xEF\xBF\xBD\"");
}

TEST(DumpReplacing, ReplacesBytesThatAreNotUtf8InsteadOfThrowing) {
  json j = {{"model", std::string("dir\xff")}};
  EXPECT_THROW((void)j.dump(), json::type_error);
  EXPECT_EQ(dump_replacing(j), "{\"model\":\"dir\xEF\xBF\xBD\"}");
}

TEST(ReadRegularFile, RefusesAFifoWithoutBlocking) {
  const auto dir = simpler::testing::test_dir("json_test");
  const std::string fifo = (dir / "model.safetensors").string();
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  auto text = read_regular_file(fifo);
  ASSERT_EQ(text.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(text.status().message(), fifo + " is not a regular file (a FIFO)");
}

TEST(ReadRegularFile, SaysADirectoryIsADirectory) {
  const auto dir = simpler::testing::test_dir("json_test");
  auto text = read_regular_file(dir.string());
  ASSERT_EQ(text.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(text.status().message(), dir.string() + " is a directory");
}

TEST(ReadRegularFile, ReadsAFileAndNamesAMissingOne) {
  const auto dir = simpler::testing::test_dir("json_test");
  std::ofstream(dir / "a.json") << "{}";
  EXPECT_EQ(*read_regular_file((dir / "a.json").string()), "{}");
  auto missing = read_regular_file((dir / "b.json").string());
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(read_regular_file((dir / "a.json").string(), 1).status().message(),
            (dir / "a.json").string() + " is 2 bytes, above the limit of 1");
}

}  // namespace
}  // namespace simpler::base
