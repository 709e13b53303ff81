#include "simpler/tokenizer/tokenizer.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tokenizer/tokenizer_test_util.h"

namespace simpler::llm {
namespace {

using ::testing::ElementsAre;
using ::testing::ElementsAreArray;
using ::testing::HasSubstr;

constexpr const char* kReplacement = "\xEF\xBF\xBD";  // U+FFFD

class Qwen3TokenizerTest : public testing::Qwen3TokenizerFixture {};

TEST_F(Qwen3TokenizerTest, LoadsVocabularyAddedTokensAndConfig) {
  EXPECT_EQ(tok().vocab_size(), 151669);
  EXPECT_EQ(tok().token_to_id("Ġworld"), 1879);
  EXPECT_EQ(tok().id_to_token(1879), "Ġworld");
  EXPECT_EQ(tok().token_to_id("<|endoftext|>"), 151643);
  EXPECT_EQ(tok().token_to_id("<|im_start|>"), 151644);
  EXPECT_EQ(tok().token_to_id("<|im_end|>"), 151645);
  EXPECT_EQ(tok().id_to_token(151667), "<think>");
  EXPECT_EQ(tok().token_to_id("no such token"), std::nullopt);
  EXPECT_EQ(tok().id_to_token(151669), std::nullopt);
  EXPECT_EQ(tok().id_to_token(-1), std::nullopt);
  EXPECT_TRUE(tok().is_special(151644));
  EXPECT_FALSE(tok().is_special(151667));  // <think> is added but not special
  EXPECT_FALSE(tok().is_special(1879));
  EXPECT_EQ(tok().eos_token_id(), 151645);
  EXPECT_EQ(tok().pad_token_id(), 151643);
}

// Expected ids come from the JavaScript reference (@lenml/tokenizers).
TEST_F(Qwen3TokenizerTest, EncodesKnownStringsLikeTheReference) {
  EXPECT_THAT(tok().encode("Hello world"), ElementsAre(9707, 1879));
  EXPECT_THAT(tok().encode("The quick brown fox jumps over the lazy dog."),
              ElementsAre(785, 3974, 13876, 38835, 34208, 916, 279, 15678, 5562, 13));
  EXPECT_THAT(tok().encode("I'm here, aren't you?"),
              ElementsAre(40, 2776, 1588, 11, 7629, 944, 498, 30));
  EXPECT_THAT(tok().encode("  leading spaces\n\n\ttab"), ElementsAre(220, 6388, 12621, 271, 58149));
  EXPECT_THAT(tok().encode("日本語のテキスト"),
              ElementsAre(101059, 102819, 15767, 56833, 61803, 70534));
  EXPECT_THAT(tok().encode("👍🏽"), ElementsAre(144349, 145375));
  EXPECT_THAT(tok().encode(" 123456789"), ElementsAre(220, 16, 17, 18, 19, 20, 21, 22, 23, 24));
  EXPECT_THAT(tok().encode(""), ElementsAre());
}

TEST_F(Qwen3TokenizerTest, DecomposedTextIsNormalizedToNfcBeforeEncoding) {
  EXPECT_THAT(tok().encode("Café"), ElementsAre(34, 2577, 963));
  EXPECT_THAT(tok().encode("Cafe\xCC\x81"), ElementsAre(34, 2577, 963));  // e + U+0301
}

TEST_F(Qwen3TokenizerTest, SpecialTokenTextInsidePromptBecomesItsId) {
  EXPECT_THAT(tok().encode("<|im_start|>"), ElementsAre(151644));
  EXPECT_THAT(tok().encode("<|endoftext|>"), ElementsAre(151643));
  EXPECT_THAT(tok().encode("a<|endoftext|>b"), ElementsAre(64, 151643, 65));
  EXPECT_THAT(tok().encode("<|im_start|>user\nhi<|im_end|>"),
              ElementsAre(151644, 872, 198, 6023, 151645));
  // Non-special added tokens are matched too.
  EXPECT_THAT(tok().encode("<think>\nok\n</think>"), ElementsAre(151667, 198, 562, 198, 151668));
  // A partial special token is ordinary text.
  const std::vector<int32_t> partial = tok().encode("<|im_start");
  EXPECT_THAT(partial, ::testing::Not(::testing::Contains(151644)));
  EXPECT_EQ(tok().decode(partial), "<|im_start");
}

// A single user turn as Qwen3's chat template renders it (ChatTemplate): the ChatML markers are
// their special tokens' ids.
TEST_F(Qwen3TokenizerTest, ChatMlMarkersEncodeToTheirSpecialTokens) {
  EXPECT_THAT(tok().encode("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"),
              ElementsAre(151644, 872, 198, 13048, 151645, 198, 151644, 77091, 198));
}

TEST_F(Qwen3TokenizerTest, IdsWithoutEntryDecodeToNothing) {
  const std::vector<int32_t> ids = {9707, 151669, -1, 151935, 1 << 30, 1879};
  EXPECT_EQ(tok().decode(ids), "Hello world");
  EXPECT_EQ(tok().decode(std::vector<int32_t>{151700}), "");
  EXPECT_EQ(tok().decode(std::vector<int32_t>{}), "");
}

TEST_F(Qwen3TokenizerTest, InvalidUtf8DecodesToReplacementCharacter) {
  const int32_t byte_ff = id("ÿ");  // the byte-level token of the lone byte 0xFF
  EXPECT_EQ(byte_ff, 187);
  EXPECT_EQ(tok().decode(std::vector<int32_t>{byte_ff}), kReplacement);
  EXPECT_EQ(tok().decode(std::vector<int32_t>{byte_ff, 9707}), std::string(kReplacement) + "Hello");
  // "é" is C3 A9: each half alone is invalid, together they are "é".
  const int32_t c3 = id("Ã");
  const int32_t a9 = id("©");
  EXPECT_EQ(tok().decode(std::vector<int32_t>{c3}), kReplacement);
  EXPECT_EQ(tok().decode(std::vector<int32_t>{a9}), kReplacement);
  EXPECT_EQ(tok().decode(std::vector<int32_t>{c3, a9}), "é");
  // An incomplete sequence before an ASCII token is one U+FFFD.
  const int32_t e2 = id("â");
  const int32_t x82 = id("Ĥ");
  EXPECT_EQ(tok().decode(std::vector<int32_t>{e2, x82, 9707}), std::string(kReplacement) + "Hello");
}

TEST_F(Qwen3TokenizerTest, InvalidUtf8InputIsEncodedAsReplacementCharacter) {
  EXPECT_EQ(tok().encode("a\xFF"
                         "b"),
            tok().encode("a\xEF\xBF\xBD"
                         "b"));
  EXPECT_EQ(tok().encode("\xC3"), tok().encode(kReplacement));
}

TEST_F(Qwen3TokenizerTest, SpecialTokensAreKeptOrSkippedOnDecode) {
  const std::vector<int32_t> ids = tok().encode("<|im_start|>user\nhi<|im_end|><think>");
  EXPECT_EQ(tok().decode(ids), "<|im_start|>user\nhi<|im_end|><think>");
  EXPECT_EQ(tok().decode(ids, /*skip_special_tokens=*/true), "user\nhi<think>");
}

TEST_F(Qwen3TokenizerTest, DecodeOfEncodeIsNfcOfText) {
  const std::vector<std::string> texts = {
      "",
      " ",
      "Hello, world! How are you doing today?",
      "e\xCC\x81 and Cafe\xCC\x81 cre\xCC\x80me",  // decomposed accents
      "\xE2\x84\xAB",                              // U+212B ANGSTROM SIGN -> U+00C5
      "\xE1\x84\x80\xE1\x85\xA1\xE1\x86\xA8",      // Hangul jamo -> U+AC01
      "中文，日本語、한국어",
      "👨‍👩‍👧‍👦 👍🏿 🏳️‍🌈",
      "line\r\nline\r\n\r\n",
      "\t\ttabs\tand    spaces   \n",
      "a\xC2\xA0"
      "b\xE3\x80\x80"
      "c",  // U+00A0, U+3000
      std::string(3000, ' '),
      std::string(500, '7'),
      std::string("x\0y", 3),  // embedded NUL
      "def f(x):\n    return x ** 2  # square\n",
      "Ελληνικά Русский العربية עברית हिन्दी ไทย",
  };
  for (const std::string& text : texts) {
    EXPECT_EQ(tok().decode(tok().encode(text)), Tokenizer::nfc(text))
        << ::testing::PrintToString(text);
  }
  EXPECT_EQ(Tokenizer::nfc("e\xCC\x81"), "\xC3\xA9");
}

TEST_F(Qwen3TokenizerTest, EncodingTwoThousandTokensTakesWellUnderASecond) {
  // Pseudo-random words, numbers, punctuation and CJK so that the BPE cache
  // does not make the work trivial.
  std::string text;
  uint32_t state = 12345;
  const auto next = [&] { return state = state * 1664525u + 1013904223u; };
  const char* cjk[] = {"模型", "语言", "世界", "計算", "テスト"};
  while (text.size() < 9000) {
    const uint32_t r = next() % 10;
    if (r < 6) {
      const int length = 2 + static_cast<int>(next() % 9);
      text += ' ';
      for (int i = 0; i < length; ++i) text += static_cast<char>('a' + next() % 26);
    } else if (r < 7) {
      text += " " + std::to_string(next() % 100000);
    } else if (r < 8) {
      text += cjk[next() % 5];
    } else if (r < 9) {
      text += ".,;:!?\n"[next() % 7];
    } else {
      text += "\n\n";
    }
  }
  const auto start = std::chrono::steady_clock::now();
  const std::vector<int32_t> ids = tok().encode(text);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_GE(ids.size(), 2000u);
  EXPECT_LT(seconds, 0.5) << ids.size() << " tokens";
  std::printf("encoded %zu bytes into %zu tokens in %.2f ms\n", text.size(), ids.size(),
              seconds * 1e3);
  EXPECT_EQ(tok().decode(ids), text);
}

TEST_F(Qwen3TokenizerTest, ConcurrentEncodesAgree) {
  const std::string text =
      "Threads share one tokenizer: 共享的分词器 👍🏽 " + std::string(100, '-');
  const std::vector<int32_t> expected = tok().encode(text);
  std::vector<std::vector<int32_t>> results(4);
  std::vector<std::thread> threads;
  for (auto& result : results) {
    threads.emplace_back([&] {
      for (int i = 0; i < 50; ++i) result = tok().encode(text);
    });
  }
  for (auto& thread : threads) thread.join();
  for (const auto& result : results) EXPECT_EQ(result, expected);
}

// ---------------------------------------------------------------------------
// Small hand-made tokenizer.json files: BPE mechanics and load errors.

class TokenizerFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::path(::testing::TempDir()) /
           ("tokenizer_test_" +
            std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()));
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  std::string write(const std::string& name, const std::string& content) {
    const std::string path = (dir_ / name).string();
    std::ofstream(path) << content;
    return path;
  }

  // A byte-level BPE over GPT-2's byte alphabet plus `merges`.
  static nlohmann::json minimal(const std::vector<std::pair<std::string, std::string>>& merges) {
    nlohmann::json vocab = nlohmann::json::object();
    int32_t next_id = 0;
    uint32_t extra = 256;
    for (uint32_t b = 0; b < 256; ++b) {
      const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || b >= 174;
      const uint32_t cp = printable ? b : extra++;
      std::string s;
      if (cp < 0x80) {
        s += static_cast<char>(cp);
      } else {
        s += static_cast<char>(0xC0 | (cp >> 6));
        s += static_cast<char>(0x80 | (cp & 0x3F));
      }
      vocab[s] = next_id++;
    }
    nlohmann::json merge_list = nlohmann::json::array();
    for (const auto& [a, b] : merges) {
      if (!vocab.contains(a + b)) vocab[a + b] = next_id++;
      merge_list.push_back(nlohmann::json::array({a, b}));
    }
    return {
        {"version", "1.0"},
        {"added_tokens",
         {{{"id", next_id}, {"content", "<s>"}, {"special", true}},
          {{"id", next_id + 1},
           {"content", "<pad>"},
           {"special", true},
           {"lstrip", true},
           {"rstrip", true}}}},
        {"normalizer", {{"type", "NFC"}}},
        {"pre_tokenizer",
         {{"type", "Sequence"},
          {"pretokenizers",
           {{{"type", "Split"},
             {"pattern", {{"Regex", " ?\\p{L}+| ?\\p{N}|\\s+|[^\\s\\p{L}\\p{N}]+"}}},
             {"behavior", "Isolated"},
             {"invert", false}},
            {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}}}}},
        {"decoder", {{"type", "ByteLevel"}}},
        {"model",
         {{"type", "BPE"}, {"vocab", vocab}, {"merges", merge_list}, {"dropout", nullptr}}},
    };
  }

  absl::StatusOr<Tokenizer> load(const nlohmann::json& json) {
    return Tokenizer::load_files(write("tokenizer.json", json.dump()), "");
  }

  std::filesystem::path dir_;
};

TEST_F(TokenizerFileTest, MergesApplyLowestRankFirstAndLeftmostOnTies) {
  auto tokenizer = load(minimal({{"a", "a"}, {"b", "c"}, {"aa", "bc"}, {"a", "b"}}));
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
  const auto id = [&](const std::string& t) { return *tokenizer->token_to_id(t); };
  // "aaa": the leftmost (a, a) merges first.
  EXPECT_THAT(tokenizer->encode("aaa"), ElementsAre(id("aa"), id("a")));
  // "aabc": (a,a) rank 0 and (b,c) rank 1 merge before (a,b) rank 3, then (aa,bc).
  EXPECT_THAT(tokenizer->encode("aabc"), ElementsAre(id("aabc")));
  // "abc": (b,c) rank 1 beats (a,b) rank 3.
  EXPECT_THAT(tokenizer->encode("abc"), ElementsAre(id("a"), id("bc")));
  EXPECT_EQ(tokenizer->decode(tokenizer->encode("aabc abc")), "aabc abc");
  EXPECT_EQ(tokenizer->vocab_size(), 256 + 4 + 2);
}

TEST_F(TokenizerFileTest, AddedTokenStripFlagsTrimNeighbouringWhitespace) {
  auto tokenizer = load(minimal({}));
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
  const int32_t s = *tokenizer->token_to_id("<s>");
  const int32_t pad = *tokenizer->token_to_id("<pad>");
  EXPECT_EQ(tokenizer->encode("x <s> y"),
            (std::vector<int32_t>{*tokenizer->token_to_id("x"), *tokenizer->token_to_id("Ġ"), s,
                                  *tokenizer->token_to_id("Ġ"), *tokenizer->token_to_id("y")}));
  EXPECT_EQ(
      tokenizer->encode("x  <pad> \t y"),
      (std::vector<int32_t>{*tokenizer->token_to_id("x"), pad, *tokenizer->token_to_id("y")}));
}

TEST_F(TokenizerFileTest, MissingFileIsNotFoundNamingThePath) {
  auto tokenizer = Tokenizer::load((dir_ / "nowhere").string());
  ASSERT_FALSE(tokenizer.ok());
  EXPECT_EQ(tokenizer.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(tokenizer.status().message(),
              HasSubstr((dir_ / "nowhere" / "tokenizer.json").string()));
}

TEST_F(TokenizerFileTest, MalformedJsonIsInvalidArgumentNamingTheFile) {
  const std::string path = write("tokenizer.json", "{\"model\": {\"type\": \"BPE\",");
  auto tokenizer = Tokenizer::load_files(path, "");
  ASSERT_FALSE(tokenizer.ok());
  EXPECT_EQ(tokenizer.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(tokenizer.status().message(), HasSubstr(path + ": malformed JSON"));
}

TEST_F(TokenizerFileTest, UnsupportedModelTypeIsUnimplementedNamingTheField) {
  nlohmann::json json = minimal({});
  json["model"]["type"] = "WordPiece";
  auto tokenizer = load(json);
  ASSERT_FALSE(tokenizer.ok());
  EXPECT_EQ(tokenizer.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_EQ(tokenizer.status().message(),
            (dir_ / "tokenizer.json").string() +
                ": field 'model.type': unsupported model type \"WordPiece\" (only BPE)");
}

TEST_F(TokenizerFileTest, MissingOrMistypedFieldsAreNamed) {
  {
    nlohmann::json json = minimal({});
    json["model"].erase("vocab");
    auto tokenizer = load(json);
    ASSERT_FALSE(tokenizer.ok());
    EXPECT_EQ(tokenizer.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(tokenizer.status().message(), HasSubstr("field 'model.vocab': missing"));
  }
  {
    nlohmann::json json = minimal({});
    json["model"]["merges"] = nlohmann::json::array({nlohmann::json::array({"a", "zz"})});
    auto tokenizer = load(json);
    ASSERT_FALSE(tokenizer.ok());
    EXPECT_THAT(tokenizer.status().message(),
                HasSubstr("field 'model.merges[0]': token \"zz\" is not in model.vocab"));
  }
  {
    nlohmann::json json = minimal({});
    json["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "(unclosed";
    auto tokenizer = load(json);
    ASSERT_FALSE(tokenizer.ok());
    EXPECT_THAT(tokenizer.status().message(),
                HasSubstr("field 'pre_tokenizer.pretokenizers[0].pattern': regex does not "
                          "compile"));
  }
  {
    nlohmann::json json = minimal({});
    json["normalizer"] = {{"type", "NFKC"}};
    auto tokenizer = load(json);
    ASSERT_FALSE(tokenizer.ok());
    EXPECT_EQ(tokenizer.status().code(), absl::StatusCode::kUnimplemented);
    EXPECT_THAT(tokenizer.status().message(), HasSubstr("field 'normalizer.type'"));
  }
}

// model.vocab and model.merges, the big tables, are read straight from the text: each error of
// their entries names the entry (the smallest bad key of the vocabulary, the first bad merge in
// order), and the text's bounds (depth, duplicate keys, NUL bytes) hold inside them as elsewhere.
TEST_F(TokenizerFileTest, BadVocabularyAndMergeEntriesAreNamedAndTheJsonBoundsHoldInside) {
  using namespace std::string_literals;
  const std::string path = (dir_ / "tokenizer.json").string();
  const auto message = [&](const nlohmann::json& json) {
    return std::string(load(json).status().message());
  };
  const auto field = [&](const std::string& name, const std::string& detail) {
    return path + ": field '" + name + "': " + detail;
  };
  nlohmann::json json = minimal({{"a", "b"}});
  json["model"]["vocab"]["zz"] = -1;
  json["model"]["vocab"]["yy"] = {{"id", 1}};
  json["model"]["vocab"]["xx"] = int64_t{1} << 25;
  EXPECT_EQ(message(json), field("model.vocab[\"xx\"]", "expected an integer id in [0, 2^24]"));
  json = minimal({{"a", "b"}});
  json["model"]["vocab"] = nlohmann::json::array({1});
  EXPECT_EQ(message(json), field("model.vocab", "expected an object"));
  json = minimal({{"a", "b"}});
  json["model"]["merges"] = "a b";
  EXPECT_EQ(message(json), field("model.merges", "expected an array"));
  json["model"].erase("merges");
  EXPECT_EQ(message(json), field("model.merges", "missing"));
  const std::string pair_or_string = "expected [\"left\", \"right\"] or \"left right\"";
  const auto array = [](std::initializer_list<nlohmann::json> items) {
    nlohmann::json out = nlohmann::json::array();
    for (const nlohmann::json& item : items) out.push_back(item);
    return out;
  };
  const std::pair<nlohmann::json, std::string> merges[] = {
      {array({array({"a", "b"}), "ab"}), field("model.merges[1]", "expected \"left right\"")},
      {array({"a b", array({"a"})}), field("model.merges[1]", pair_or_string)},
      {array({array({"a", array({"b"})})}), field("model.merges[0]", pair_or_string)},
      {array({array({"a", "b", "c"})}), field("model.merges[0]", pair_or_string)},
      {array({7}), field("model.merges[0]", pair_or_string)},
      {array({"a zz", 7}), field("model.merges[0]", "token \"zz\" is not in model.vocab")}};
  for (const auto& [list, want] : merges) {
    json["model"]["merges"] = list;
    EXPECT_EQ(message(json), want) << list.dump();
  }
  json["model"]["merges"] = array({"a b"});  // the "left right" form
  auto loaded = load(json);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_THAT(loaded->encode("ab"), ElementsAre(*loaded->token_to_id("ab")));

  const std::string text = minimal({{"a", "b"}}).dump();
  const auto load_text = [&](const std::string& edited) {
    return std::string(
        Tokenizer::load_files(write("tokenizer.json", edited), "").status().message());
  };
  const auto replaced = [&](const std::string& from, const std::string& to) {
    const size_t at = text.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    return std::string(text).replace(at, from.size(), to);
  };
  EXPECT_EQ(load_text(replaced("\"a\":97,", "\"a\":97,\"a\":98,")),
            path + ": duplicate key 'a' in the object at /model/vocab");
  EXPECT_EQ(load_text(replaced("\"version\"", "\"version\":1,\"version\"")),
            path + ": duplicate key 'version' in the object at /");
  const std::string deep = std::string(100, '[') + std::string(100, ']');
  EXPECT_EQ(load_text(replaced("\"a\":97,", "\"a\":" + deep + ",")),
            path + ": JSON nested deeper than 64 levels at /model/vocab/a");
  EXPECT_EQ(load_text(replaced("\"merges\":[", "\"merges\":[" + deep + ",")),
            path + ": JSON nested deeper than 64 levels at /model/merges");
  EXPECT_EQ(
      load_text(replaced("\"a\":97,", "\"a\":97,\"\0\":1,"s)),
      path + ": malformed JSON: NUL byte at offset " + std::to_string(text.find("\"a\":97,") + 8));
  EXPECT_THAT(load_text(text + "]"), HasSubstr(path + ": malformed JSON: "));
  EXPECT_THAT(load_text(replaced("\"merges\":[[", "\"merges\":[[,")),
              HasSubstr(path + ": malformed JSON: "));
}

TEST_F(TokenizerFileTest, ConfigTokensMustExist) {
  const std::string json = write("tokenizer.json", minimal({}).dump());
  const std::string config = write("tokenizer_config.json", R"({"eos_token": "</missing>"})");
  auto tokenizer = Tokenizer::load_files(json, config);
  ASSERT_FALSE(tokenizer.ok());
  EXPECT_EQ(tokenizer.status().message(),
            config + ": field 'eos_token': token \"</missing>\" is not in the vocabulary");
  write("tokenizer_config.json", R"({"eos_token": {"content": "<s>"}, "pad_token": null})");
  auto loaded = Tokenizer::load(dir_.string());
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->eos_token_id(), loaded->token_to_id("<s>"));
  EXPECT_EQ(loaded->pad_token_id(), std::nullopt);
}

TEST_F(TokenizerFileTest, ANumberOutsideTheDoubleRangeIsAnErrorNotAnAbort) {
  std::string text = minimal({}).dump();
  text.pop_back();
  const std::string json = write("tokenizer.json", text + ", \"truncation\": 1e400}");
  auto tokenizer = Tokenizer::load_files(json, "");
  ASSERT_EQ(tokenizer.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(tokenizer.status().message(),
            json + ": malformed JSON: number overflow parsing '1e400'");
  write("tokenizer.json", minimal({}).dump());
  const std::string config = write("tokenizer_config.json", R"({"model_max_length": 1e400})");
  tokenizer = Tokenizer::load_files(json, config);
  ASSERT_EQ(tokenizer.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(tokenizer.status().message(),
            config + ": malformed JSON: number overflow parsing '1e400'");
}

TEST_F(TokenizerFileTest, ADeeplyNestedEosTokenIsRefusedWithoutCrashing) {
  const std::string json = write("tokenizer.json", minimal({}).dump());
  const std::string config =
      write("tokenizer_config.json",
            "{\"eos_token\": " + std::string(100000, '[') + std::string(100000, ']') + "}");
  auto tokenizer = Tokenizer::load_files(json, config);
  ASSERT_EQ(tokenizer.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(tokenizer.status().message(),
            config + ": JSON nested deeper than 64 levels at /eos_token");
  // Within the bound, the bad value is quoted short.
  write("tokenizer_config.json",
        "{\"eos_token\": " + std::string(60, '[') + std::string(60, ']') + "}");
  tokenizer = Tokenizer::load_files(json, config);
  ASSERT_EQ(tokenizer.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(tokenizer.status().message(), config + ": field 'eos_token': expected a string, got " +
                                              std::string(60, '[') + std::string(20, ']') + "...");
}

TEST_F(TokenizerFileTest, ALongMissingTokenIsQuotedShort) {
  const std::string json = write("tokenizer.json", minimal({}).dump());
  const std::string config =
      write("tokenizer_config.json", "{\"eos_token\": \"" + std::string(100000, 'z') + "\"}");
  auto tokenizer = Tokenizer::load_files(json, config);
  ASSERT_EQ(tokenizer.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(tokenizer.status().message(), config + ": field 'eos_token': token \"" +
                                              std::string(79, 'z') +
                                              "... is not in the vocabulary");
}

TEST_F(TokenizerFileTest, DefaultDirFromEnvironmentMustHoldTokenizerJson) {
  const char* saved = std::getenv("SIMPLER_TOKENIZER_DIR");
  const std::string saved_value = saved != nullptr ? saved : "";
  setenv("SIMPLER_TOKENIZER_DIR", dir_.string().c_str(), 1);
  auto missing = default_tokenizer_dir();
  write("tokenizer.json", "{}");
  auto present = default_tokenizer_dir();
  if (saved != nullptr) {
    setenv("SIMPLER_TOKENIZER_DIR", saved_value.c_str(), 1);
  } else {
    unsetenv("SIMPLER_TOKENIZER_DIR");
  }
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(missing.status().message(), HasSubstr("npm ci"));
  EXPECT_THAT(missing.status().message(), HasSubstr((dir_ / "tokenizer.json").string()));
  ASSERT_TRUE(present.ok()) << present.status();
  EXPECT_EQ(*present, dir_.string());
}

}  // namespace
}  // namespace simpler::llm
