// Test and dump hooks of LlmEngine: what tests (and `simpler generate`'s `--dump-*` flags and
// `--json` page report) ask of a request beyond its tokens, and access to the engine's internal
// checks. Private to the engine's tests and the CLI's dump mode; not part of the public API.
//
// A request asks through RequestSpec::hooks; its events then carry RequestOutput::hooks (an
// event's logits and K/V; the final event's pages). Plain values; thread-compatible.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/model_runner.h"
#include "simpler/engine/llm_engine.h"

namespace simpler::llm {

struct RequestHooks {
  // Raw logits of these output tokens (0 = first), K/V of these positions (read back when the
  // step writing them retires; a request with kv_positions takes nothing from the prefix cache,
  // so every position is written by a step of its own).
  std::set<int64_t> logits_tokens;
  std::set<int64_t> kv_positions;
};

struct OutputHooks {
  std::map<int64_t, std::vector<float>> logits;  // RequestHooks::logits_tokens hits
  std::map<int64_t, Qwen3ModelRunner::Kv> kv;    // RequestHooks::kv_positions hits
  // Final event: the KV pages the choice held after the last step it had a row in (a choice
  // preempted and not re-admitted since holds none now: it reports those of its last step), the
  // engine step that allocated each, and that last step (steps are numbered from 1; a page freed
  // by one request is reused only by steps after that request's last step).
  std::vector<int32_t> pages;
  std::vector<int64_t> page_steps;
  int64_t last_step = 0;
};

// The hooks of an event, or an empty set when it has none.
inline const OutputHooks& hooks_of(const RequestOutput& out) {
  static const OutputHooks kNone;
  return out.hooks != nullptr ? *out.hooks : kNone;
}

class EngineTestAccess {
 public:
  // Checks the scheduler's page invariants at every step while on.
  static void set_check_invariants(LlmEngine& engine, bool on);
  // The first violation found, or OK.
  static absl::Status invariant_violation(const LlmEngine& engine);
  // LlmEngine over a runner made by the test (LlmEngine::create's runner overload).
  static absl::StatusOr<std::unique_ptr<LlmEngine>> create(std::unique_ptr<Qwen3ModelRunner> runner,
                                                           const EngineOptions& options);
  // The captured-graph counts of the runner's own Worker (RunnerOptions::capture); zeros for a
  // runner on an L3 child. Before shutdown().
  static worker::CaptureStats capture_stats(const LlmEngine& engine);
};

}  // namespace simpler::llm
