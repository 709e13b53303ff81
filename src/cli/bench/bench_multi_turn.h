// The multi-turn workload of `simpler bench throughput --workload multi-turn` (and its run):
// conversations that share one system prompt, each turn's prompt being the previous turn's prompt,
// its answer and a new user message — the traffic prefix caching is for (docs/design/
// prefix_cache.md). Private to the CLI.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "cli/bench/bench_workload.h"
#include "simpler/engine/llm_engine.h"
#include "simpler/model/model_config.h"

namespace simpler::cli::bench {

// `conversations` conversations of `turns` turns. Every conversation starts with `system` (the
// shared system prompt); turn t appends user[c][t] and then the model's answer of
// output_lens[c][t] tokens (greedy, ignore_eos). All ids and lengths come from the seed.
struct MultiTurnWorkload {
  int64_t conversations = 0, turns = 0;
  std::vector<int32_t> system;
  std::vector<std::vector<std::vector<int32_t>>> user;  // [conversation][turn]
  std::vector<std::vector<int64_t>> output_lens;        // [conversation][turn]
  int64_t longest = 0;  // tokens of the longest conversation at its end
};

// INVALID_ARGUMENT naming the conversation when its last turn would not fit the model
// (ModelConfig::check_request), or when conversations, turns or system_len is not positive.
absl::StatusOr<MultiTurnWorkload> make_multi_turn_workload(const llm::ModelConfig& config,
                                                           int64_t conversations, int64_t turns,
                                                           int64_t system_len, LenRange user,
                                                           LenRange output, uint64_t seed);

// One turn as it ran.
struct TurnResult {
  int64_t ttft_ns = 0;  // arrival to first token
  int64_t tokens = 0;
  int64_t prompt_tokens = 0, cached_tokens = 0;
  bool ok = false;  // finished by length with every token
  absl::Status error;
};

// One run of the workload on a fresh engine, after one warm-up request: every conversation
// starts at once; a turn is submitted (from the engine's output callback) as soon as the previous
// turn's final event came.
struct MultiTurnRun {
  std::vector<std::vector<TurnResult>> turns;  // [conversation][turn]
  int64_t start_ns = 0, end_ns = 0;
  int64_t output_tokens = 0;
  llm::EngineMetrics metrics;
  absl::Status closed;  // the engine's shutdown
};

// Errors: the engine's creation, and the warm-up request's. A refused or failed turn ends its
// conversation and is recorded in its TurnResult.
absl::StatusOr<MultiTurnRun> run_multi_turn(const std::string& model, const llm::EngineOptions& eo,
                                            const MultiTurnWorkload& w);

}  // namespace simpler::cli::bench
