// FLOP counts of a model's steps, the numerators of the LLM benchmarks' GFLOP/s figures.
#pragma once

#include <cstdint>

#include "simpler/model/model_config.h"

namespace simpler::cli {

// Multiply-accumulates of the weight matrices per decode row (the projections and the LM head;
// the attention over a short context is negligible): a step of B rows is 2·B·this FLOPs.
inline int64_t matrix_macs_per_row(const llm::ModelConfig& c) {
  const int64_t h = c.hidden_size, q = c.num_attention_heads * c.head_dim,
                kv = c.num_key_value_heads * c.head_dim;
  return c.num_hidden_layers * (q * h + 2 * kv * h + h * q + 3 * c.intermediate_size * h) +
         c.vocab_size * h;
}

}  // namespace simpler::cli
