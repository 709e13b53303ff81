// Shared by the model tests: Qwen3-0.6B's config.json, a configuration's shape as one
// comparable value, and status text.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "nlohmann/json.hpp"
#include "simpler/model/model_config.h"

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

// A status's message as a std::string, for matchers.
inline std::string msg(const absl::Status& s) { return std::string(s.message()); }

}  // namespace simpler::llm::testing
