#include "simpler/model/make_model.h"

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>

#include "base/test_temp_dir.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/model_test_util.h"
#include "simpler/model/model_config.h"
#include "simpler/model/safetensors.h"

namespace simpler::llm {
namespace {

namespace fs = std::filesystem;
using task::DataType;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using testing::qwen3_06b_config;
using testing::shape_fields;
using testing::shape_of;

fs::path make_model_dir() { return simpler::testing::test_dir("simpler_make_model_test"); }

using simpler::testing::read_file;

// A small variant of tiny: small vocabulary, untied, head_dim != hidden/heads.
MakeModelOptions small(const fs::path& out) {
  MakeModelOptions o;
  o.preset = "tiny";
  o.seed = 7;
  o.out_dir = out.string();
  o.overrides = {.hidden_size = 64,
                 .intermediate_size = 96,
                 .head_dim = 32,
                 .vocab_size = 1000,
                 .tie_word_embeddings = false};
  return o;
}

// Loads `dir` and checks every expected tensor by name, shape and dtype.
void expect_loadable(const fs::path& dir, DataType dtype, const ModelConfig& expected) {
  auto config = ModelConfig::load(dir.string());
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->to_config_json(), expected.to_config_json());
  auto weights = ModelWeights::open(dir.string());
  ASSERT_TRUE(weights.ok()) << weights.status();
  const std::vector<WeightSpec> specs = config->tensor_names_and_shapes();
  EXPECT_EQ(weights->names().size(), specs.size());
  for (const WeightSpec& spec : specs) {
    auto view = weights->get(spec.name, spec.shape, {dtype});
    ASSERT_TRUE(view.ok()) << view.status();
    auto values = to_f32(*view);
    ASSERT_TRUE(values.ok());
    double sum = 0, sumsq = 0;
    for (float v : *values) sum += v, sumsq += double(v) * v;
    const double n = static_cast<double>(values->size());
    const double mean = sum / n, stddev = std::sqrt(sumsq / n - mean * mean);
    if (spec.name.ends_with("norm.weight")) {
      EXPECT_NEAR(mean, 1.0, 0.05) << spec.name;
      EXPECT_NEAR(stddev, 0.1, 0.04) << spec.name;
    } else {
      EXPECT_NEAR(stddev, 1.0 / std::sqrt(double(spec.shape[1])), 0.02) << spec.name;
    }
  }
}

TEST(MakeModel, TinyPresetMatchesTheSpecifiedShape) {
  auto c = preset_config("tiny");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(shape_of(*c), nlohmann::json::parse(R"({"hidden_size": 128, "intermediate_size": 384,
      "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
      "vocab_size": 151936, "max_position_embeddings": 4096})"));
  EXPECT_TRUE(c->tie_word_embeddings);
  EXPECT_THAT(c->stop_ids(), ElementsAre(151645, 151643));
  auto big = preset_config("qwen3-0.6b");
  ASSERT_TRUE(big.ok());
  EXPECT_EQ(shape_of(*big), shape_fields(qwen3_06b_config()));
}

TEST(MakeModel, UnknownPresetAndBadOptionsAreRefused) {
  auto c = preset_config("qwen9");
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(c.status().message()), HasSubstr("unknown model preset 'qwen9'"));

  const fs::path dir = make_model_dir();
  MakeModelOptions o = small(dir / "m");
  o.overrides.num_key_value_heads = 3;
  absl::Status s = make_model(o);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("num_key_value_heads"));

  o = small(dir / "m");
  o.dtype = DataType::kInt32;
  EXPECT_EQ(make_model(o).code(), absl::StatusCode::kInvalidArgument);
  o = small(dir / "m");
  o.shards = 0;
  EXPECT_EQ(make_model(o).code(), absl::StatusCode::kInvalidArgument);
}

// Sizes within the flags' bounds can ask for petabytes (a 2^31 - 1 vocabulary of 2^20-wide
// rows): refused before a file is written, stating both sizes, instead of filling the disk.
TEST(MakeModel, AModelLargerThanTheFreeSpaceIsRefusedBeforeAnythingIsWritten) {
  const fs::path dir = make_model_dir() / "huge";
  MakeModelOptions o = small(dir);
  o.overrides.vocab_size = 2147483647;
  o.overrides.hidden_size = 1 << 20;
  const absl::Status s = make_model(o);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("GB of weights, more than the "));
  EXPECT_THAT(std::string(s.message()), HasSubstr(" GB free on " + dir.string()));
  EXPECT_TRUE(fs::is_empty(dir));
}

TEST(MakeModel, SmallVocabKeepsTokenIdsInsideIt) {
  ModelConfigOverrides o;
  o.vocab_size = 1000;
  auto c = preset_config("tiny", o);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->bos_token_id, 998);
  EXPECT_THAT(c->stop_ids(), ElementsAre(999, 998));
}

TEST(MakeModel, WritesLoadableSingleFileModelBf16) {
  const fs::path dir = make_model_dir() / "m";
  MakeModelOptions o = small(dir);
  ASSERT_TRUE(make_model(o).ok());
  EXPECT_TRUE(fs::exists(dir / "model.safetensors"));
  EXPECT_FALSE(fs::exists(dir / "model.safetensors.index.json"));
  auto expected = preset_config("tiny", o.overrides);
  ASSERT_TRUE(expected.ok());
  expected->torch_dtype = "bfloat16";
  expect_loadable(dir, DataType::kBFloat16, *expected);
  auto config = ModelConfig::load(dir.string());
  ASSERT_TRUE(config.ok());
  EXPECT_THAT(config->stop_ids(), ElementsAre(999, 998));
}

TEST(MakeModel, WritesLoadableShardedModelF32WithSameValuesAsUnsharded) {
  const fs::path root = make_model_dir();
  MakeModelOptions o = small(root / "sharded");
  o.dtype = DataType::kFloat32;
  o.shards = 3;
  ASSERT_TRUE(make_model(o).ok());
  EXPECT_TRUE(fs::exists(root / "sharded" / "model.safetensors.index.json"));
  for (int i = 1; i <= 3; ++i) {
    EXPECT_TRUE(fs::exists(root / "sharded" /
                           ("model-0000" + std::to_string(i) + "-of-00003.safetensors")));
  }
  auto expected = preset_config("tiny", o.overrides);
  ASSERT_TRUE(expected.ok());
  expected->torch_dtype = "float32";
  expect_loadable(root / "sharded", DataType::kFloat32, *expected);

  MakeModelOptions single = o;
  single.shards = 1;
  single.out_dir = (root / "single").string();
  ASSERT_TRUE(make_model(single).ok());
  auto a = ModelWeights::open((root / "sharded").string());
  auto b = ModelWeights::open((root / "single").string());
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->num_files(), 3u);
  for (const std::string& name : a->names()) {
    auto va = a->get(name);
    auto vb = b->get(name);
    ASSERT_TRUE(va.ok() && vb.ok());
    ASSERT_EQ(va->bytes.size(), vb->bytes.size());
    EXPECT_EQ(std::memcmp(va->bytes.data(), vb->bytes.data(), va->bytes.size()), 0) << name;
  }
}

TEST(MakeModel, DeterministicInSeed) {
  const fs::path root = make_model_dir();
  MakeModelOptions o = small(root / "a");
  ASSERT_TRUE(make_model(o).ok());
  o.out_dir = (root / "b").string();
  ASSERT_TRUE(make_model(o).ok());
  o.out_dir = (root / "c").string();
  o.seed = 8;
  ASSERT_TRUE(make_model(o).ok());
  const std::string a = read_file(root / "a" / "model.safetensors");
  EXPECT_EQ(a, read_file(root / "b" / "model.safetensors"));
  EXPECT_NE(a, read_file(root / "c" / "model.safetensors"));
  EXPECT_EQ(a.size(), read_file(root / "c" / "model.safetensors").size());
}

TEST(MakeModel, RewritingReplacesAnEarlierCheckpoint) {
  const fs::path dir = make_model_dir() / "m";
  MakeModelOptions o = small(dir);
  o.shards = 2;
  ASSERT_TRUE(make_model(o).ok());
  o.shards = 1;
  ASSERT_TRUE(make_model(o).ok());
  EXPECT_FALSE(fs::exists(dir / "model.safetensors.index.json"));
  EXPECT_FALSE(fs::exists(dir / "model-00001-of-00002.safetensors"));
  auto weights = ModelWeights::open(dir.string());
  ASSERT_TRUE(weights.ok()) << weights.status();
  EXPECT_EQ(weights->num_files(), 1u);
}

// A directory of other files, or a Hugging Face checkpoint (config.json with
// transformers_version), is refused before anything there changes: make-model replaced the
// latter's weights and wrote beside the former's files.
TEST(MakeModel, ADirectoryItDidNotWriteIsRefusedAndLeftAsItWas) {
  const fs::path dir = make_model_dir() / "other";
  fs::create_directories(dir);
  { std::ofstream(dir / "README.md") << "notes\n"; }
  { std::ofstream(dir / "model.safetensors") << "their weights"; }
  absl::Status s = make_model(small(dir));
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("holds files make-model does not write (README.md)"));
  EXPECT_EQ(read_file(dir / "model.safetensors"), "their weights");
  EXPECT_FALSE(fs::exists(dir / "config.json"));

  fs::remove(dir / "README.md");
  { std::ofstream(dir / ".gitkeep") << ""; }  // hidden files do not count
  { std::ofstream(dir / "config.json") << R"({"transformers_version": "4.51.0"})"; }
  s = make_model(small(dir));
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("holds a Hugging Face checkpoint"));
  EXPECT_EQ(read_file(dir / "model.safetensors"), "their weights");

  { std::ofstream(dir / "plain_file") << "x"; }
  s = make_model(small(dir / "plain_file"));
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("is not a directory"));
}

TEST(MakeModel, CopiesTokenizerFilesAndNamesAMissingOne) {
  const fs::path root = make_model_dir();
  const fs::path tok = root / "tok";
  fs::create_directories(tok);
  std::ofstream(tok / "tokenizer.json") << R"({"model": {}})";
  MakeModelOptions o = small(root / "m");
  o.tokenizer_dir = tok.string();
  absl::Status s = make_model(o);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(s.message()), HasSubstr("tokenizer_config.json"));
  EXPECT_FALSE(fs::exists(root / "m" / "config.json"));  // checked before writing

  std::ofstream(tok / "tokenizer_config.json") << R"({"eos_token": "<|im_end|>"})";
  ASSERT_TRUE(make_model(o).ok());
  EXPECT_EQ(read_file(root / "m" / "tokenizer.json"), R"({"model": {}})");
  EXPECT_EQ(read_file(root / "m" / "tokenizer_config.json"), R"({"eos_token": "<|im_end|>"})");
}

}  // namespace
}  // namespace simpler::llm
