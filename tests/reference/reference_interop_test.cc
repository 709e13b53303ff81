// Both directions of the model file format between the C++ code and the numpy reference
// (tests/reference/qwen3_ref.py, run with SIMPLER_PYTHON3):
//   * checkpoints written by the reference's own safetensors writer load in C++
//     (ModelConfig::load, ModelWeights::open, to_f32) with the values the reference reads;
//   * checkpoints written by make_model load in the reference with the values C++ reads, and
//     the reference can decode with them.
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "base/test_temp_dir.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "simpler/model/make_model.h"
#include "simpler/model/model_config.h"
#include "simpler/model/safetensors.h"

namespace simpler::llm {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using ::testing::ElementsAreArray;

fs::path test_dir() { return simpler::testing::test_dir("simpler_reference_interop_test"); }

using simpler::testing::read_file;

// Runs qwen3_ref.py with `args`; fails the test with its stderr when it exits non-zero.
bool run_reference(const std::string& args, const fs::path& log) {
  const std::string command = std::string("'") + SIMPLER_PYTHON3 + "' '" + SIMPLER_QWEN3_REF +
                              "' " + args + " > '" + log.string() + "' 2>&1";
  const int rc = std::system(command.c_str());
  EXPECT_EQ(rc, 0) << command << "\n" << read_file(log);
  return rc == 0;
}

struct Stats {
  double sum = 0, sum_sq = 0;
  std::vector<double> first;
};

Stats stats_of(const std::vector<float>& v) {
  Stats s;
  for (float x : v) s.sum += x, s.sum_sq += static_cast<double>(x) * x;
  for (size_t i = 0; i < v.size() && i < 4; ++i) s.first.push_back(v[i]);
  return s;
}

// Loads `dir` in C++ and checks config, names, shapes, dtypes and values against the
// reference's `inspect` output for the same directory.
void expect_cpp_matches_reference(const fs::path& dir, const fs::path& work) {
  const fs::path inspect = work / (dir.filename().string() + ".inspect.json");
  ASSERT_TRUE(
      run_reference("inspect --model '" + dir.string() + "' --out '" + inspect.string() + "'",
                    work / "inspect.log"));
  const json ref = json::parse(read_file(inspect));
  EXPECT_TRUE(ref["missing"].empty()) << ref["missing"].dump();

  auto config = ModelConfig::load(dir.string());
  ASSERT_TRUE(config.ok()) << config.status();
  const json& rc = ref["config"];
  EXPECT_EQ(config->hidden_size, rc["hidden_size"].get<int64_t>());
  EXPECT_EQ(config->intermediate_size, rc["intermediate_size"].get<int64_t>());
  EXPECT_EQ(config->num_hidden_layers, rc["num_hidden_layers"].get<int64_t>());
  EXPECT_EQ(config->num_attention_heads, rc["num_attention_heads"].get<int64_t>());
  EXPECT_EQ(config->num_key_value_heads, rc["num_key_value_heads"].get<int64_t>());
  EXPECT_EQ(config->head_dim, rc["head_dim"].get<int64_t>());
  EXPECT_EQ(config->vocab_size, rc["vocab_size"].get<int64_t>());
  EXPECT_EQ(config->max_position_embeddings, rc["max_position_embeddings"].get<int64_t>());
  EXPECT_EQ(config->tie_word_embeddings, rc["tie_word_embeddings"].get<bool>());
  EXPECT_DOUBLE_EQ(config->rms_norm_eps, rc["rms_norm_eps"].get<double>());
  EXPECT_DOUBLE_EQ(config->rope_theta, rc["rope_theta"].get<double>());
  EXPECT_THAT(config->stop_ids(), ElementsAreArray(rc["stop_ids"].get<std::vector<int64_t>>()));

  // The same expected weight list on both sides.
  const std::vector<WeightSpec> specs = config->tensor_names_and_shapes();
  ASSERT_EQ(specs.size(), ref["expected"].size());
  for (size_t i = 0; i < specs.size(); ++i) {
    EXPECT_EQ(specs[i].name, ref["expected"][i][0].get<std::string>());
    EXPECT_EQ(specs[i].shape, ref["expected"][i][1].get<std::vector<int64_t>>());
  }

  auto weights = ModelWeights::open(dir.string());
  ASSERT_TRUE(weights.ok()) << weights.status();
  EXPECT_EQ(weights->names().size(), ref["tensors"].size());
  for (const WeightSpec& spec : specs) {
    SCOPED_TRACE(spec.name);
    auto view = weights->get(spec.name, spec.shape);
    ASSERT_TRUE(view.ok()) << view.status();
    const json& rt = ref["tensors"][spec.name];
    EXPECT_EQ(std::string(task::safetensors_name(view->dtype)), rt["dtype"].get<std::string>());
    EXPECT_EQ(fs::path(std::string(view->file)).filename().string(), rt["file"].get<std::string>());
    auto values = to_f32(*view);
    ASSERT_TRUE(values.ok()) << values.status();
    const Stats s = stats_of(*values);
    const double sum_sq = rt["sum_sq"].get<double>();
    EXPECT_NEAR(s.sum_sq, sum_sq, 1e-9 * sum_sq);
    EXPECT_NEAR(s.sum, rt["sum"].get<double>(), 1e-9 * sum_sq + 1e-12);
    EXPECT_THAT(s.first, ElementsAreArray(rt["first"].get<std::vector<double>>()));
  }
}

TEST(ReferenceInterop, ReferenceCheckpointsLoadInCpp) {
  const fs::path work = test_dir();
  struct Variant {
    const char* name;
    const char* args;
  };
  const Variant variants[] = {
      // Small vocabulary, tied, BF16, one file.
      {"bf16_tied",
       "--dtype bf16 --seed 3 --vocab 512 --hidden 64 --heads 4 --kv-heads 2 "
       "--head-dim 32 --layers 2 --intermediate 96"},
      // F16, untied with an F32 lm_head, head_dim left to its default, 3 shards.
      {"f16_untied_sharded",
       "--dtype f16 --seed 4 --vocab 300 --hidden 64 --heads 4 --kv-heads 1 --head-dim 16 "
       "--omit-head-dim --layers 3 --intermediate 80 --untied --lm-head-dtype f32 --shards 3"},
      // F32, the real vocabulary and token ids, 2 shards.
      {"f32_real_vocab",
       "--dtype f32 --seed 5 --vocab 151936 --hidden 32 --heads 2 "
       "--kv-heads 2 --head-dim 16 --layers 1 --intermediate 48 --shards 2"},
  };
  for (const Variant& v : variants) {
    SCOPED_TRACE(v.name);
    const fs::path dir = work / v.name;
    ASSERT_TRUE(
        run_reference("write-model --out '" + dir.string() + "' " + v.args, work / "write.log"));
    expect_cpp_matches_reference(dir, work);
  }
  // The variants' particulars reached C++.
  auto untied = ModelConfig::load((work / "f16_untied_sharded").string());
  ASSERT_TRUE(untied.ok());
  EXPECT_EQ(untied->head_dim, 16);
  EXPECT_FALSE(untied->tie_word_embeddings);
  auto weights = ModelWeights::open((work / "f16_untied_sharded").string());
  ASSERT_TRUE(weights.ok());
  EXPECT_EQ(weights->num_files(), 3u);
  EXPECT_EQ(weights->get("lm_head.weight")->dtype, task::DataType::kFloat32);
  EXPECT_EQ(weights->get("model.norm.weight")->dtype, task::DataType::kFloat16);
  auto real = ModelConfig::load((work / "f32_real_vocab").string());
  ASSERT_TRUE(real.ok());
  EXPECT_THAT(real->stop_ids(), ::testing::ElementsAre(151645, 151643));
  EXPECT_EQ(real->bos_token_id, 151643);
}

TEST(ReferenceInterop, MakeModelCheckpointsLoadAndDecodeInReference) {
  const fs::path work = test_dir();

  MakeModelOptions small;
  small.seed = 11;
  small.out_dir = (work / "small_f32_sharded").string();
  small.dtype = task::DataType::kFloat32;
  small.shards = 4;
  small.overrides.vocab_size = 700;
  small.overrides.hidden_size = 64;
  small.overrides.intermediate_size = 96;
  small.overrides.head_dim = 32;
  small.overrides.num_hidden_layers = 3;
  small.overrides.tie_word_embeddings = false;
  ASSERT_TRUE(make_model(small).ok());
  expect_cpp_matches_reference(work / "small_f32_sharded", work);

  MakeModelOptions tiny;  // the tiny preset as shipped: bf16, tied, real vocabulary
  tiny.seed = 12;
  tiny.out_dir = (work / "tiny_bf16").string();
  ASSERT_TRUE(make_model(tiny).ok());
  expect_cpp_matches_reference(work / "tiny_bf16", work);

  // The reference decodes with a make-model checkpoint.
  const fs::path out = work / "generate.json";
  ASSERT_TRUE(run_reference("generate --model '" + tiny.out_dir +
                                "' --prompt-ids 1,2,3 --prompt-ids 9 --max-new-tokens 6"
                                " --dump-logits-steps 0 --dump-kv-positions 0,2 --out '" +
                                out.string() + "'",
                            work / "generate.log"));
  const json result = json::parse(read_file(out));
  ASSERT_EQ(result["requests"].size(), 2u);
  for (const json& r : result["requests"]) {
    const auto tokens = r["tokens"].get<std::vector<int64_t>>();
    ASSERT_FALSE(tokens.empty());
    EXPECT_LE(tokens.size(), 6u);
    for (int64_t t : tokens) {
      EXPECT_GE(t, 0);
      EXPECT_LT(t, 151936);
    }
    EXPECT_EQ(r["logits"]["0"].size(), 151936u);
  }
  const json& kv = result["requests"][0]["kv"]["2"];
  ASSERT_EQ(kv["k"].size(), 2u);         // layers
  ASSERT_EQ(kv["k"][0].size(), 2u);      // KV heads
  ASSERT_EQ(kv["k"][0][0].size(), 64u);  // head_dim
}

}  // namespace
}  // namespace simpler::llm
