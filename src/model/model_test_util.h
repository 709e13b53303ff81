// Shared by the model tests: Qwen3-0.6B's config.json, a configuration's shape as one
// comparable value, make-model options for the tiny preset, and status text.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "simpler/model/make_model.h"
#include "simpler/model/model_config.h"
#include "simpler/tokenizer/tokenizer.h"

namespace simpler::llm::testing {

// The config.json of Qwen/Qwen3-0.6B.
inline nlohmann::json qwen3_06b_config() {
  return nlohmann::json::parse(R"({
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 1024, "initializer_range": 0.02, "intermediate_size": 3072,
    "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
    "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06, "rope_scaling": null, "rope_theta": 1000000,
    "sliding_window": null, "tie_word_embeddings": true, "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0", "use_cache": true, "use_sliding_window": false,
    "vocab_size": 151936})");
}

// The fields of `c` that fix its tensor shapes and positions, keyed by their config.json
// names: a test states a whole shape in one expectation, and a mismatch prints every field.
inline nlohmann::json shape_of(const ModelConfig& c) {
  return {{"hidden_size", c.hidden_size},
          {"intermediate_size", c.intermediate_size},
          {"num_hidden_layers", c.num_hidden_layers},
          {"num_attention_heads", c.num_attention_heads},
          {"num_key_value_heads", c.num_key_value_heads},
          {"head_dim", c.head_dim},
          {"vocab_size", c.vocab_size},
          {"max_position_embeddings", c.max_position_embeddings}};
}

// The same fields of a config.json, which must hold them all.
inline nlohmann::json shape_fields(const nlohmann::json& config) {
  nlohmann::json out = shape_of(ModelConfig{});
  for (auto& [name, value] : out.items()) value = config.at(name);
  return out;
}

// make-model options for the tiny preset at `seed` into `out_dir`, with Qwen3's tokenizer
// (default_tokenizer_dir; a test failure, and no tokenizer, when it is not found).
inline MakeModelOptions tiny_model_options(const std::string& out_dir, uint64_t seed) {
  MakeModelOptions o;
  o.preset = "tiny";
  o.seed = seed;
  o.out_dir = out_dir;
  absl::StatusOr<std::string> tok = default_tokenizer_dir();
  EXPECT_TRUE(tok.ok()) << tok.status();
  if (tok.ok()) o.tokenizer_dir = *tok;
  return o;
}

// The same with rows of whole K-quant super-blocks of 256 (hidden 256, intermediate 512: every
// matrix can be Q4_K or Q6_K) and `layers` layers.
inline MakeModelOptions k_quant_model_options(const std::string& out_dir, uint64_t seed,
                                              int64_t layers) {
  MakeModelOptions o = tiny_model_options(out_dir, seed);
  o.overrides.hidden_size = 256;
  o.overrides.intermediate_size = 512;
  o.overrides.num_hidden_layers = layers;
  return o;
}

// A status's message as a std::string, for matchers.
inline std::string msg(const absl::Status& s) { return std::string(s.message()); }

}  // namespace simpler::llm::testing
