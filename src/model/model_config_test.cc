#include "simpler/model/model_config.h"

#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/test_temp_dir.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/model_test_util.h"
#include "nlohmann/json.hpp"

namespace simpler::llm {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using testing::msg;
using testing::qwen3_06b_config;
using testing::shape_fields;
using testing::shape_of;

absl::StatusOr<ModelConfig> parse(const json& j, const std::string& generation = "") {
  return ModelConfig::parse(j.dump(), generation);
}

// Why ModelConfig::parse refuses this config.json (and generation_config.json) text; the refusal
// must be INVALID_ARGUMENT.
std::string refusal(std::string_view config_json, std::string_view generation_json = {}) {
  auto c = ModelConfig::parse(config_json, generation_json);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << c.status();
  return msg(c.status());
}

TEST(ModelConfig, ParsesQwen3_06B) {
  auto c = parse(qwen3_06b_config());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(shape_of(*c), shape_fields(qwen3_06b_config()));
  EXPECT_DOUBLE_EQ(c->rms_norm_eps, 1e-6);
  EXPECT_DOUBLE_EQ(c->rope_theta, 1e6);
  EXPECT_TRUE(c->tie_word_embeddings);
  EXPECT_EQ(c->bos_token_id, 151643);
  EXPECT_THAT(c->eos_token_ids, ElementsAre(151645));
  EXPECT_EQ(c->torch_dtype, "bfloat16");
  EXPECT_EQ(c->q_size(), 2048);
  EXPECT_EQ(c->kv_size(), 1024);
}

TEST(ModelConfig, HeadDimDefaultsToHiddenOverHeadsAndMayDifferFromIt) {
  json j = qwen3_06b_config();
  j.erase("head_dim");
  auto c = parse(j);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->head_dim, 64);  // 1024 / 16
  j["head_dim"] = 128;         // != 1024 / 16, as in the real model
  c = parse(j);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->head_dim, 128);
}

TEST(ModelConfig, OptionalFieldsTakeQwen3ConfigDefaults) {
  json j = qwen3_06b_config();
  for (const char* f : {"rms_norm_eps", "rope_theta", "max_position_embeddings",
                        "tie_word_embeddings", "eos_token_id", "bos_token_id", "torch_dtype"}) {
    j.erase(f);
  }
  auto c = parse(j);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_DOUBLE_EQ(c->rms_norm_eps, 1e-6);
  EXPECT_DOUBLE_EQ(c->rope_theta, 10000.0);
  EXPECT_EQ(c->max_position_embeddings, 32768);
  EXPECT_FALSE(c->tie_word_embeddings);
  EXPECT_TRUE(c->eos_token_ids.empty());
  EXPECT_FALSE(c->bos_token_id.has_value());
}

TEST(ModelConfig, KvHeadsNotDividingHeadsIsRefused) {
  json j = qwen3_06b_config();
  j["num_key_value_heads"] = 6;
  EXPECT_EQ(refusal(j.dump()),
            "config.json: field 'num_key_value_heads': 6 does not divide num_attention_heads 16");
}

TEST(ModelConfig, EosMayBeIntOrListAndGenerationConfigAddsStopIds) {
  json j = qwen3_06b_config();
  auto c = parse(j);
  ASSERT_TRUE(c.ok());
  EXPECT_THAT(c->stop_ids(), ElementsAre(151645));

  j["eos_token_id"] = {151645, 151643};
  c = parse(j);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_THAT(c->eos_token_ids, ElementsAre(151645, 151643));

  j["eos_token_id"] = 151645;
  c = parse(j, R"({"bos_token_id": 151643, "eos_token_id": [151645, 151643], "top_k": 20})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_THAT(c->generation_eos_token_ids, ElementsAre(151645, 151643));
  EXPECT_THAT(c->stop_ids(), ElementsAre(151645, 151643));

  c = parse(j, R"({"eos_token_id": 151643})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_THAT(c->stop_ids(), ElementsAre(151645, 151643));
}

TEST(ModelConfig, BadEosTypeAndOutOfVocabIdAreRefusedNamingFileAndField) {
  json j = qwen3_06b_config();
  j["eos_token_id"] = "151645";
  EXPECT_THAT(refusal(j.dump()), HasSubstr("config.json: field 'eos_token_id'"));

  j["eos_token_id"] = 200000;
  EXPECT_THAT(refusal(j.dump()), HasSubstr("config.json: field 'eos_token_id': token id 200000"));

  j["eos_token_id"] = 151645;
  EXPECT_THAT(refusal(j.dump(), R"({"eos_token_id": [1, "x"]})"),
              HasSubstr("generation_config.json: field 'eos_token_id'"));
}

TEST(ModelConfig, UnknownArchitectureIsRefused) {
  json j = qwen3_06b_config();
  j["architectures"] = {"LlamaForCausalLM"};
  j["model_type"] = "llama";
  const std::string refused = refusal(j.dump());
  EXPECT_THAT(refused, HasSubstr("unknown architecture [LlamaForCausalLM]"));
  EXPECT_THAT(refused, HasSubstr("config.json"));

  j.erase("architectures");
  j["model_type"] = "qwen3";  // model_type alone is enough
  EXPECT_TRUE(parse(j).ok());
}

TEST(ModelConfig, MissingRequiredFieldIsNamed) {
  for (const char* field : {"hidden_size", "intermediate_size", "num_hidden_layers",
                            "num_attention_heads", "num_key_value_heads", "vocab_size"}) {
    SCOPED_TRACE(field);
    json j = qwen3_06b_config();
    j.erase(field);
    EXPECT_EQ(refusal(j.dump()),
              std::string("config.json: missing required field '") + field + "'");
  }
}

TEST(ModelConfig, WrongTypesAndUnsupportedFeaturesAreNamed) {
  json j = qwen3_06b_config();
  j["hidden_size"] = "1024";
  EXPECT_THAT(refusal(j.dump()), HasSubstr("field 'hidden_size': must be an integer"));

  j = qwen3_06b_config();
  j["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}};
  EXPECT_THAT(refusal(j.dump()), HasSubstr("field 'rope_scaling': unsupported"));

  j = qwen3_06b_config();
  j["head_dim"] = 0;
  EXPECT_THAT(refusal(j.dump()), HasSubstr("field 'head_dim': must be positive"));

  EXPECT_THAT(refusal("{not json"),
              HasSubstr("config.json: malformed JSON: parse error at line 1, column 3"));
}

TEST(ModelConfig, LoadReadsBothFilesAndNamesPaths) {
  const fs::path dir = simpler::testing::test_dir("simpler_model_config_test");
  auto missing = ModelConfig::load(dir.string());
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(msg(missing.status()), HasSubstr((dir / "config.json").string()));

  std::ofstream(dir / "config.json") << qwen3_06b_config().dump();
  std::ofstream(dir / "generation_config.json") << R"({"eos_token_id": [151645, 151643]})";
  auto c = ModelConfig::load(dir.string());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_THAT(c->stop_ids(), ElementsAre(151645, 151643));

  std::ofstream(dir / "generation_config.json") << R"({"eos_token_id": )";
  c = ModelConfig::load(dir.string());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(msg(c.status()), HasSubstr((dir / "generation_config.json").string()));
}

TEST(ModelConfig, TensorNamesAndShapesFollowTheCheckpointLayout) {
  json j = qwen3_06b_config();
  j["num_hidden_layers"] = 2;
  j["tie_word_embeddings"] = false;
  auto c = parse(j);
  ASSERT_TRUE(c.ok());
  std::vector<WeightSpec> specs = c->tensor_names_and_shapes();
  ASSERT_EQ(specs.size(), 1u + 2 * 11 + 2);
  EXPECT_EQ(specs[0].name, "model.embed_tokens.weight");
  EXPECT_EQ(specs[0].shape, (std::vector<int64_t>{151936, 1024}));
  auto find = [&](const std::string& name) -> std::vector<int64_t> {
    for (const WeightSpec& s : specs) {
      if (s.name == name) return s.shape;
    }
    ADD_FAILURE() << "no " << name;
    return {};
  };
  EXPECT_EQ(find("model.layers.1.input_layernorm.weight"), (std::vector<int64_t>{1024}));
  EXPECT_EQ(find("model.layers.1.self_attn.q_proj.weight"), (std::vector<int64_t>{2048, 1024}));
  EXPECT_EQ(find("model.layers.1.self_attn.k_proj.weight"), (std::vector<int64_t>{1024, 1024}));
  EXPECT_EQ(find("model.layers.1.self_attn.v_proj.weight"), (std::vector<int64_t>{1024, 1024}));
  EXPECT_EQ(find("model.layers.1.self_attn.o_proj.weight"), (std::vector<int64_t>{1024, 2048}));
  EXPECT_EQ(find("model.layers.1.self_attn.q_norm.weight"), (std::vector<int64_t>{128}));
  EXPECT_EQ(find("model.layers.1.self_attn.k_norm.weight"), (std::vector<int64_t>{128}));
  EXPECT_EQ(find("model.layers.1.post_attention_layernorm.weight"), (std::vector<int64_t>{1024}));
  EXPECT_EQ(find("model.layers.1.mlp.gate_proj.weight"), (std::vector<int64_t>{3072, 1024}));
  EXPECT_EQ(find("model.layers.1.mlp.up_proj.weight"), (std::vector<int64_t>{3072, 1024}));
  EXPECT_EQ(find("model.layers.1.mlp.down_proj.weight"), (std::vector<int64_t>{1024, 3072}));
  EXPECT_EQ(find("model.norm.weight"), (std::vector<int64_t>{1024}));
  EXPECT_EQ(specs.back().name, "lm_head.weight");

  j["tie_word_embeddings"] = true;
  c = parse(j);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->tensor_names_and_shapes().back().name, "model.norm.weight");
}

TEST(ModelConfig, ConfigJsonRoundTrips) {
  auto c = parse(qwen3_06b_config(), R"({"eos_token_id": [151645, 151643]})");
  ASSERT_TRUE(c.ok());
  auto again = ModelConfig::parse(c->to_config_json(), c->to_generation_config_json());
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->to_config_json(), c->to_config_json());
  EXPECT_THAT(again->stop_ids(), ElementsAre(151645, 151643));
}

// `{"field": [[[...]]]}` nested `depth` deep, as text (json::dump of it would recurse).
std::string with_deep_value(const std::string& field, int depth) {
  json j = qwen3_06b_config();
  j.erase(field);
  std::string text = j.dump();
  text.pop_back();  // the closing brace
  return text + ", \"" + field + "\": " + std::string(depth, '[') + std::string(depth, ']') + "}";
}

TEST(ModelConfigBadInput, DeeplyNestedValuesAreRefusedWithoutCrashing) {
  for (const char* field : {"hidden_size", "rope_scaling", "eos_token_id"}) {
    SCOPED_TRACE(field);
    EXPECT_EQ(refusal(with_deep_value(field, 100000)),
              std::string("config.json: JSON nested deeper than 64 levels at /") + field);
  }
  EXPECT_EQ(refusal(qwen3_06b_config().dump(), "{\"eos_token_id\": " + std::string(100000, '[') +
                                                   std::string(100000, ']') + "}"),
            "generation_config.json: JSON nested deeper than 64 levels at /eos_token_id");
}

TEST(ModelConfigBadInput, ABadValueNestedWithinTheBoundIsQuotedShort) {
  json j = qwen3_06b_config();
  json deep = json::array();
  json* cur = &deep;
  for (int i = 0; i < 60; ++i) {
    cur->push_back(json::array({std::string(2000, 'x')}));
    cur = &cur->back();
  }
  j["rope_scaling"] = deep;
  const std::string refused = refusal(j.dump());
  EXPECT_THAT(refused,
              ::testing::StartsWith(
                  "config.json: field 'rope_scaling': unsupported: only null, got [[\"xxxxxxx"));
  EXPECT_THAT(refused, ::testing::EndsWith("xxx..."));
  EXPECT_LT(refused.size(), 200u);
}

TEST(ModelConfigBadInput, TrailingNulAndGarbageAfterTheObjectAreRefused) {
  const std::string text = qwen3_06b_config().dump() + std::string("\0garbage", 8);
  EXPECT_EQ(refusal(text), absl::StrCat("config.json: malformed JSON: NUL byte at offset ",
                                        qwen3_06b_config().dump().size()));
}

TEST(ModelConfigBadInput, AnIntegerAboveTheSignedRangeIsNotReadAsNegative) {
  json j = qwen3_06b_config();
  j["hidden_size"] = 18446744073709551615ull;
  EXPECT_EQ(refusal(j.dump()),
            "config.json: field 'hidden_size': 18446744073709551615 is above the largest integer "
            "accepted, 9223372036854775807");
  j = qwen3_06b_config();
  j["eos_token_id"] = json::array({1, 18446744073709551615ull});
  EXPECT_EQ(refusal(j.dump()),
            "config.json: field 'eos_token_id': token id 18446744073709551615 is out of range");
}

TEST(ModelConfigBadInput, FloatsOutsideFloat32sRangeAreRefusedAtLoad) {
  for (const auto& [field, value] :
       std::vector<std::pair<std::string, double>>{{"rms_norm_eps", 1e300},
                                                   {"rope_theta", 1e300},
                                                   {"rope_theta", 1e-300},
                                                   {"rms_norm_eps", 1e-300}}) {
    SCOPED_TRACE(absl::StrCat(field, " ", value));
    json j = qwen3_06b_config();
    j[field] = value;
    EXPECT_EQ(
        refusal(j.dump()),
        absl::StrCat("config.json: field '", field,
                     "': must be positive and within float32's normal range [",
                     std::numeric_limits<float>::min(), ", ", std::numeric_limits<float>::max(),
                     "] (the kernels compute in float32), got ", value));
  }
}

TEST(ModelConfigBadInput, ShapeProductsThatOverflowAreRefusedBeforeUse) {
  json j = qwen3_06b_config();
  j["num_attention_heads"] = int64_t{1} << 40;
  j["num_key_value_heads"] = int64_t{1} << 40;
  j["head_dim"] = int64_t{1} << 40;
  EXPECT_EQ(refusal(j.dump()),
            "config.json: field 'head_dim': q_proj of hidden_size 1024 x num_attention_heads "
            "1099511627776 x head_dim 1099511627776 f32 elements overflows 64-bit byte sizes");
}

TEST(ModelConfigBadInput, ADuplicateKeyIsRefused) {
  std::string text = qwen3_06b_config().dump();
  text.pop_back();
  EXPECT_EQ(refusal(text + ", \"num_hidden_layers\": 2}"),
            "config.json: duplicate key 'num_hidden_layers' in the object at /");
}

TEST(ModelConfigBadInput, AFifoAsConfigIsRefusedWithoutBlocking) {
  const fs::path dir = simpler::testing::test_dir("simpler_model_config_test");
  ASSERT_EQ(::mkfifo((dir / "config.json").c_str(), 0600), 0);
  auto c = ModelConfig::load(dir.string());
  ASSERT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(msg(c.status()), (dir / "config.json").string() + " is not a regular file (a FIFO)");
}

TEST(ModelConfigBadInput, AFileGivenAsTheModelDirectoryIsNamedAsSuch) {
  const fs::path dir = simpler::testing::test_dir("simpler_model_config_test");
  std::ofstream(dir / "config.json") << qwen3_06b_config().dump();
  const std::string file = (dir / "config.json").string();
  auto c = ModelConfig::load(file);
  ASSERT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(msg(c.status()), "model directory '" + file + "' is a file, not a directory");
}

TEST(ModelConfigBadInput, CheckRequestValidatesLengthAndIdsBeforeAnythingIsSized) {
  auto c = parse(qwen3_06b_config());
  ASSERT_TRUE(c.ok());
  const std::vector<int64_t> ok = {1, 2, 3};
  EXPECT_TRUE(c->check_request(ok, 32).ok());
  EXPECT_EQ(msg(c->check_request(ok, 2147483647)),
            "prompt of 3 tokens + 2147483647 new tokens exceeds max_position_embeddings 40960");
  const std::vector<int64_t> long_prompt(1'000'000, 1);
  EXPECT_EQ(msg(c->check_request(long_prompt, 1)),
            "prompt of 1000000 tokens + 1 new tokens exceeds max_position_embeddings 40960");
  const std::vector<int64_t> wide = {1, 10'000'000'000};
  EXPECT_EQ(msg(c->check_request(wide, 1)),
            "token id 10000000000 outside the vocabulary [0, 151936)");
  EXPECT_EQ(msg(c->check_request({}, 1)), "empty prompt");
}

}  // namespace
}  // namespace simpler::llm
