// Shared by the engine test binaries: the small Qwen3-shaped checkpoint they run on.
#pragma once

#include <unistd.h>

#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "simpler/engine/llm_engine.h"
#include "simpler/model/make_model.h"
#include "simpler/tokenizer/tokenizer.h"

namespace simpler::llm {

// Options for make_model: the tiny preset cut to vocab 512, hidden 64, intermediate 128,
// 4 heads of 32 over 1 KV head, f32 — fast enough for thousands of engine steps per test.
inline MakeModelOptions small_test_model_options(const std::string& out_dir, uint64_t seed) {
  MakeModelOptions o;
  o.preset = "tiny";
  o.seed = seed;
  o.dtype = task::DataType::kFloat32;
  o.out_dir = out_dir;
  o.overrides.vocab_size = 512;
  o.overrides.hidden_size = 64;
  o.overrides.intermediate_size = 128;
  o.overrides.head_dim = 32;
  o.overrides.num_attention_heads = 4;
  o.overrides.num_key_value_heads = 1;
  return o;
}

// `count` random prompts of lengths [1, max_len] of ids in [0, max_id] (by default the whole
// vocabulary of small_test_model_options).
inline std::vector<std::vector<int32_t>> random_prompts(int count, int max_len, uint32_t seed,
                                                        int32_t max_id = 511) {
  std::mt19937 rng(seed);
  std::vector<std::vector<int32_t>> out;
  for (int i = 0; i < count; ++i) {
    std::vector<int32_t> p(std::uniform_int_distribution<int>(1, max_len)(rng));
    for (int32_t& t : p) t = std::uniform_int_distribution<int32_t>(0, max_id)(rng);
    out.push_back(std::move(p));
  }
  return out;
}

// A greedy request of `n` choices that ignores EOS: it always makes `max_tokens` tokens.
inline RequestSpec greedy(std::vector<int32_t> prompt, int64_t max_tokens, int n = 1) {
  RequestSpec s;
  s.prompt_ids = std::move(prompt);
  s.max_tokens = max_tokens;
  s.n = n;
  s.sampling.temperature = 0;
  s.sampling.ignore_eos = true;
  return s;
}

// A per-process folder under the temporary directory: <tmp>/<prefix><pid>.
inline std::string test_model_dir(const std::string& prefix) {
  return (std::filesystem::temp_directory_path() / (prefix + std::to_string(::getpid()))).string();
}

// Options for make_model: the tiny preset with the real Qwen3 vocabulary and tokenizer (seed 8)
// at half its width (hidden 64, head_dim 32: the 151936-row embeddings and LM head are most of
// its weights and of each step's work), for the tests of text and stop strings.
inline MakeModelOptions tiny_text_model_options(const std::string& out_dir) {
  MakeModelOptions o;
  o.preset = "tiny";
  o.seed = 8;
  o.out_dir = out_dir;
  o.tokenizer_dir = default_tokenizer_dir().value();
  o.overrides.hidden_size = 64;
  o.overrides.head_dim = 32;
  return o;
}

// Engine options for the test models on the sim device: 2 cores at launch depth `depth` with an
// empty fault plan, `pages` KV pages of `page_size` tokens, steps of at most `budget` tokens over
// at most `seqs` sequences.
inline EngineOptions small_engine_options(int depth, int pages = 256, int budget = 64,
                                          int seqs = 16, int page_size = 4) {
  EngineOptions eo;
  eo.runner.worker.num_cores = 2;
  eo.runner.worker.launch_depth = depth;
  eo.runner.worker.faults.emplace();
  eo.runner.page_size = page_size;
  eo.runner.num_pages = pages;
  eo.runner.max_num_batched_tokens = budget;
  eo.runner.max_num_seqs = seqs;
  return eo;
}

// An engine on the checkpoint in `dir`; a test failure and null when it cannot be created.
inline std::unique_ptr<LlmEngine> create_test_engine(const std::string& dir,
                                                     const EngineOptions& eo) {
  auto e = LlmEngine::create(dir, eo);
  EXPECT_TRUE(e.ok()) << e.status();
  return e.ok() ? std::move(e).value() : nullptr;
}

// A test suite on the tiny text model (tiny_text_model_options), made once per suite in
// test_model_dir(Suite::kDirPrefix), with its tokenizer: `Suite` derives from it and names the
// folder's prefix in a public `static constexpr const char* kDirPrefix`.
template <class Suite>
class TinyTextModelTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::string(test_model_dir(Suite::kDirPrefix));
    ASSERT_TRUE(make_model(tiny_text_model_options(*dir_)).ok());
    tokenizer_ = new Tokenizer(Tokenizer::load(*dir_).value());
  }
  static void TearDownTestSuite() {
    std::filesystem::remove_all(*dir_);
    delete tokenizer_;
    delete dir_;
  }
  static inline std::string* dir_ = nullptr;
  static inline Tokenizer* tokenizer_ = nullptr;
};

}  // namespace simpler::llm
