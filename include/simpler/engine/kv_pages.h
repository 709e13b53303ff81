// The KV cache's sizes as engine users see them: pages per state (EngineMetrics::kv_pages) and
// how many pages a workload needs (to size RunnerOptions::num_pages). The pool and block tables
// themselves are the engine's (src/engine/kv_cache.h).
#pragma once

#include <cstdint>

#include "absl/status/statusor.h"

namespace simpler::llm {

// Number of pages holding `tokens` tokens: ceil(tokens / page_size); 0 for
// tokens <= 0. Requires page_size > 0 (aborts otherwise: a program bug).
int64_t pages_needed(int64_t tokens, int64_t page_size);

// Pages for `num_requests` requests that each hold at most
// min(prompt_len + max_new_tokens, max_position_embeddings) tokens:
// num_requests · pages_needed(that, page_size). INVALID_ARGUMENT naming the
// field when page_size or max_position_embeddings <= 0, a count is negative,
// or the total does not fit int32.
absl::StatusOr<int32_t> default_num_pages(int64_t prompt_len, int64_t max_new_tokens,
                                          int64_t num_requests, int64_t page_size,
                                          int64_t max_position_embeddings);

// Pages per state (ARCHITECTURE.md, Serving); free + used + fenced + quarantined == the
// pool's size.
struct PageCounts {
  int32_t free = 0;
  int32_t used = 0;
  int32_t fenced = 0;
  int32_t quarantined = 0;
  int32_t total() const { return free + used + fenced + quarantined; }
};

}  // namespace simpler::llm
