// The model of an LLM benchmark: its config, checked against the benchmark's requests, and the
// FLOP counts of its steps, the numerators of the GFLOP/s figures.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "simpler/base/status.h"
#include "simpler/model/model_config.h"

namespace simpler::cli {

// `model`'s config (ModelConfig::load's errors), checked to hold a request of each of
// `prompt_lens` tokens followed by `max_tokens` more: ModelConfig::check_request's error with
// `flag` (the benchmark's flag that asked for it) before its message.
inline absl::StatusOr<llm::ModelConfig> load_config_for(const std::string& model,
                                                        const std::vector<int>& prompt_lens,
                                                        int64_t max_tokens,
                                                        const std::string& flag) {
  SIMPLER_ASSIGN_OR_RETURN(llm::ModelConfig config, llm::ModelConfig::load(model));
  for (int len : prompt_lens) {
    if (absl::Status s = config.check_request(std::vector<int64_t>(len, 0), max_tokens); !s.ok()) {
      return base::annotate(s, flag + ": ");
    }
  }
  return config;
}

// Multiply-accumulates of the weight matrices per decode row (the projections and the LM head;
// the attention over a short context is negligible): a step of B rows is 2·B·this FLOPs.
inline int64_t matrix_macs_per_row(const llm::ModelConfig& c) {
  const int64_t h = c.hidden_size, q = c.num_attention_heads * c.head_dim,
                kv = c.num_key_value_heads * c.head_dim;
  return c.num_hidden_layers * (q * h + 2 * kv * h + h * q + 3 * c.intermediate_size * h) +
         c.vocab_size * h;
}

// Multiply-accumulates of the attention of a `len`-token prompt processed from an empty cache
// (causal: position p attends positions 0 ... p): per layer and query head, the scores q·k and the
// weighted sums of V, head_dim each per (position, attended position) pair, len·(len + 1) / 2
// pairs. At 512 tokens of qwen3-0.6b this is 6.7% of the prompt's matrix multiply-accumulates.
inline int64_t prompt_attention_macs(const llm::ModelConfig& c, int64_t len) {
  return c.num_hidden_layers * c.num_attention_heads * 2 * c.head_dim * (len * (len + 1) / 2);
}

}  // namespace simpler::cli
