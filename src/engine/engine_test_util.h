// Shared by the engine test binaries: the small Qwen3-shaped checkpoint they run on.
#pragma once

#include <string>

#include "simpler/model/make_model.h"

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

}  // namespace simpler::llm
