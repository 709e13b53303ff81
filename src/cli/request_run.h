// Requests run through LlmEngines to their end, every event collected: the shared core of
// `generate` and `bench decode|prefill`.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "engine/engine_test_hooks.h"
#include "simpler/engine/llm_engine.h"

namespace simpler::cli {

// One choice's collected output. Plain value; thread-compatible.
struct ChoiceResult {
  std::vector<int32_t> tokens;
  std::string text;
  std::string finish_reason;
  absl::Status error;
  // The dumps a request with RequestSpec::hooks asked for (engine_test_hooks.h: `generate`'s
  // `--dump-*` flags and its page report).
  std::vector<int32_t> pages;
  std::vector<int64_t> page_steps;
  int64_t last_step = 0;
  std::map<int64_t, std::vector<float>> logits;
  std::map<int64_t, llm::Qwen3ModelRunner::Kv> kv;
  int64_t arrival_ns = 0, first_token_ns = 0, finished_ns = 0;
  int64_t cached_tokens = 0;  // prompt tokens served by the prefix cache
  std::vector<int64_t> token_times_ns;
  bool done = false;
};

// Requests run through LlmEngines: results[i] holds request i's choices. Plain value, filled by
// run_requests; thread-compatible.
struct RequestRun {
  std::vector<std::vector<ChoiceResult>> results;
  int64_t start_ns = 0, end_ns = 0;
  int64_t all_first_token_ns = 0;  // when every served choice had its first token
};

// Runs `specs` to their end: request r goes to engines[r % engines.size()] (data parallel: one
// engine per chip). Collects every event through callbacks (so no request's queue can fill up
// while another is read); a request the engine refuses gets finish_reason "error" and the
// refusal. With `progress`, reports progress once a second on stderr as "simpler <command>: ...".
// Blocks until every choice finished.
RequestRun run_requests(const std::vector<llm::LlmEngine*>& engines,
                        std::vector<llm::RequestSpec> specs, const char* command, bool progress);

// Mean effective depth and most steps in flight over an engine's step records.
struct DepthStats {
  double effective_depth = 0;
  int64_t max_steps_in_flight = 0;
  int64_t steps = 0;
};
DepthStats depth_stats(const std::vector<llm::StepRecord>& records);

}  // namespace simpler::cli
