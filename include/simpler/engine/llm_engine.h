// LlmEngine: continuous batching for a Qwen3 model (docs/design/engine.md).
//
// Thread model (vLLM v1 / llama.cpp server; ARCHITECTURE.md, Serving):
//   * callers (any thread) talk to the engine only through thread-safe queues:
//     add_request, abort, next_output, metrics, shutdown;
//   * one engine-loop thread owns the Scheduler (admission, chunked prefill,
//     preemption, KV pages), every request's state and the model runner. It
//     schedules a step, submits it as one run (early enqueue: up to the
//     Worker's launch_depth steps in flight, each reading the previous step's
//     sampled tokens from device memory) and retires steps in order;
//   * one output-processor thread detokenizes incrementally, matches stop
//     strings and delivers RequestOutput events to each request's bounded
//     queue or callback. A slow consumer never blocks the loop: a choice
//     whose event finds max_buffered_outputs undelivered events queued loses
//     it and ends with kAbort and a reason that says so.
//
// Request lifecycle: add_request -> waiting -> running (prefill chunks, then
// one decode position per step; possibly preempted and recomputed) ->
// finished with `stop` (stop id or stop string), `length` (max_tokens),
// `abort` (abort(), a consumer that fell behind, shutdown) or `error` (a step
// it had a row in failed; the engine became unhealthy). Every request ends
// with exactly one final event (RequestOutput::finished).
//
// Failure (ARCHITECTURE.md, Poison): a recoverable step error fails the
// requests with a row in that step (and through them every later in-flight
// row that read their tokens), each with the step's error naming its run and
// task; other requests go on. An unrecoverable one (device fault, timeout)
// fails every request with the cause, refuses new ones with it and makes the
// engine unhealthy (health()); the timed-out step's pages are quarantined.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "simpler/base/clock.h"
#include "simpler/engine/metrics.h"
#include "simpler/engine/runner_options.h"
#include "simpler/grammar/grammar.h"
#include "simpler/model/model_config.h"
#include "simpler/model/qwen3_program.h"
#include "simpler/tokenizer/tokenizer.h"

namespace simpler::llm {

using RequestId = uint64_t;

// Test and dump hooks (src/engine/engine_test_hooks.h: raw logits, K/V, the pages a request
// held, the scheduler's invariant check); opaque here.
struct RequestHooks;
struct OutputHooks;
class EngineTestAccess;
class LlmDataParallel;
class Qwen3ModelRunner;

struct EngineOptions {
  RunnerOptions runner;        // worker, KV pool, max_num_seqs, max_num_batched_tokens, ...
  int32_t max_waiting = 1024;  // waiting-queue capacity (RESOURCE_EXHAUSTED past it)
  // Undelivered output events one request may have before it is aborted as
  // a consumer that fell behind (> 0).
  int32_t max_buffered_outputs = 4096;
  // Text deltas and stop strings need a tokenizer (shared, must outlive the
  // engine); without one, text is empty and stop strings are refused.
  const Tokenizer* tokenizer = nullptr;
  // Keep a StepRecord per step (benchmarks; grows by one per step).
  bool record_steps = false;
  // Prefix caching (docs/design/prefix_cache.md): full KV pages whose steps retired are kept,
  // keyed by their tokens, and a later request that starts with the same tokens maps them into
  // its block table and prefills only the rest. Tokens are the same with it on and off.
  bool enable_prefix_caching = true;
};

// The sampling and stopping part of a request (OpenAI / vLLM names and defaults).
struct RequestSampling {
  float temperature = 1.0f;  // 0: greedy
  float top_p = 1.0f;
  int32_t top_k = 0;  // 0 or -1: off
  float min_p = 0.0f;
  float presence_penalty = 0.0f;
  float frequency_penalty = 0.0f;
  float repetition_penalty = 1.0f;
  std::optional<uint64_t> seed;  // none: a distinct seed per request
  // none: no logprobs; n in [0, kMaxLogprobs = 20]: each token's logprob (of the raw logits;
  // under a grammar, of the logits after its mask; min_tokens does not change them) and its n
  // most likely alternatives (OpenAI `logprobs`), fewer where a grammar leaves fewer tokens.
  std::optional<int32_t> logprobs;
  // vLLM's prompt_logprobs: none: none; n in [0, kMaxLogprobs]: each prompt token after the
  // first gets its logprob under the logits of the position before it (raw, log_softmax in
  // f64) and the n most likely alternatives there, in RequestOutput::prompt_logprobs. Costs one
  // LM-head row per prompt position: only such requests compute them, their prefill chunks are
  // at most max_num_seqs - 1 positions, and they take no pages from the prefix cache. Needs
  // max_num_seqs >= 2. Every choice (`n`) computes its own.
  std::optional<int32_t> prompt_logprobs;
  int32_t min_tokens = 0;
  bool ignore_eos = false;
  // Besides the model's EOS ids. A choice that ends on a stop id (EOS or one of these) outputs
  // its id and logprob but not its text (vLLM's include_stop_str_in_output false).
  std::vector<int32_t> stop_token_ids;
  std::vector<std::string> stop;  // stop strings (need a tokenizer)
  // Structured outputs (docs/design/structured_outputs.md): every output token keeps the
  // output's bytes a valid prefix of this grammar's language (a mask on the logits before
  // every other transform), and a stop id is allowed only where the output is a complete
  // sentence; a choice whose output is complete and cannot continue finishes with kStop. Needs
  // the tokenizer (EngineOptions::tokenizer). A constrained choice runs serially: its next row
  // is scheduled only after its previous token retired (other requests keep early enqueue).
  std::shared_ptr<const grammar::Grammar> grammar;
};

struct RequestSpec {
  std::vector<int32_t> prompt_ids;  // >= 1 ids in [0, vocab_size)
  int64_t max_tokens = 16;          // >= 1; prompt + max_tokens <= max_position_embeddings
  int32_t n = 1;                    // choices (clone requests), in [1, max_num_seqs]
  RequestSampling sampling;
  std::string caller_id;  // optional, echoed in every RequestOutput
  // Called on the output-processor thread for each event, in order. Without
  // it, events queue for next_output(). Must not block; it may call
  // add_request, abort and metrics. shutdown, and a next_output that would
  // wait, return FAILED_PRECONDITION there (only that thread ends the wait).
  std::function<void(const struct RequestOutput&)> on_output;
  // Test and dump hooks (engine_test_hooks.h); null: none.
  std::shared_ptr<const RequestHooks> hooks;
};

enum class OutputFinish : uint8_t { kNone, kStop, kLength, kAbort, kError };
const char* finish_reason_name(OutputFinish reason);  // "", "stop", "length", "abort", "error"

struct TokenLogprob {
  float logprob = 0.0f;
  // Up to RequestSampling::logprobs entries, each logprob finite (a masked token is none).
  std::vector<std::pair<int32_t, float>> top;
};

// One event of one choice of a request.
struct RequestOutput {
  RequestId id = 0;
  int32_t index = 0;  // choice
  std::string caller_id;
  std::vector<int32_t> token_ids;      // new tokens since the previous event
  std::vector<TokenLogprob> logprobs;  // parallel to token_ids when logprobs were asked
  // With RequestSampling::prompt_logprobs, on the choice's event carrying its first token (only
  // there, once, even when the choice is preempted and recomputed): one entry per prompt token,
  // the first empty (no logits precede it).
  std::vector<std::optional<TokenLogprob>> prompt_logprobs;
  std::vector<int64_t> token_times_ns;  // when each token's step retired (steady clock)
  // New text (complete UTF-8 characters only); a stop id that ends the choice adds none
  // (RequestSampling::stop_token_ids).
  std::string text;
  OutputFinish finish = OutputFinish::kNone;
  bool finished() const { return finish != OutputFinish::kNone; }
  absl::Status error;  // finish kError (and kAbort with a reason)
  // Final event only: usage and timing (steady-clock ns; 0 = did not happen).
  int64_t prompt_tokens = 0;
  int64_t completion_tokens = 0;
  // Prompt tokens whose KV came from the prefix cache at the choice's first admission
  // (OpenAI's usage.prompt_tokens_details.cached_tokens); 0 without prefix caching.
  int64_t cached_tokens = 0;
  int64_t arrival_ns = 0, scheduled_ns = 0, first_token_ns = 0, finished_ns = 0;
  int64_t num_preemptions = 0;
  // Set only for a request with RequestSpec::hooks: what they asked for (engine_test_hooks.h).
  std::shared_ptr<const OutputHooks> hooks;
};

// Per-step record (EngineOptions::record_steps).
struct StepRecord {
  int64_t step_id = 0;
  int64_t rows = 0, tokens = 0, logit_rows = 0;
  int64_t submit_ns = 0, retire_ns = 0;
  int64_t device_start_ns = 0, device_end_ns = 0;
  int32_t effective_depth = 0;
  int64_t in_flight_at_submit = 0;  // steps in flight when it was submitted, itself included
  // The step run's host prepare (worker::RunTiming: staging, and a host-built graph's
  // orchestration or a replay's binding), and the tasks it ran (chip::RunReport).
  int64_t prepare_ns = 0;
  uint64_t tasks = 0;
};

class LlmEngine {
 public:
  // Loads the model (Qwen3ModelRunner::create) and starts the loop and output
  // threads. Errors: the runner's, and INVALID_ARGUMENT naming the option.
  static absl::StatusOr<std::unique_ptr<LlmEngine>> create(const std::string& model_dir,
                                                           const EngineOptions& options);
  // One engine per child of an L3 worker: LlmDataParallel (data_parallel.h).
  ~LlmEngine();  // shutdown(0) if not shut down

  // The request limits, in tokens: the max_tokens a request whose prompt has `prompt_tokens`
  // tokens runs with. With `max_tokens`, that value once it fits; without, vLLM's default:
  // min(max_position_embeddings - prompt_tokens, pool tokens - prompt_tokens + 1), where the
  // pool holds num_pages * page_size tokens (the last new token needs no KV slot). Errors, all
  // INVALID_ARGUMENT:
  //   * "the prompt is empty" (prompt_tokens < 1);
  //   * "max_tokens must be >= 1, got M";
  //   * "this model's maximum context length is C tokens; the prompt has P tokens and
  //     max_tokens is M (P+M in all), which exceeds max_position_embeddings" (the OpenAI
  //     wording clients parse; the sum is left out when it overflows int64);
  //   * "the request can never fit the KV cache: prompt of P tokens + max_tokens M needs N
  //     pages of T tokens, and the pool holds K pages";
  //   * without max_tokens, "the prompt has P tokens; the model's context holds C and the KV
  //     cache T: no room for one new token".
  // add_request applies the same checks. Thread-safe (reads only the immutable config and
  // options); does not count a refusal in metrics().
  absl::StatusOr<int64_t> max_tokens_for(int64_t prompt_tokens,
                                         std::optional<int64_t> max_tokens) const;

  // Checks and queues a request. INVALID_ARGUMENT naming the field and the
  // numbers (max_tokens_for's errors for the prompt's length and max_tokens,
  // an id outside the vocabulary, n outside [1, max_num_seqs], a sampling
  // parameter out of range, stop strings without a tokenizer, too many stop
  // ids, n > max_waiting, a grammar without a tokenizer, prompt_logprobs outside [0, 20] or with
  // max_num_seqs < 2); RESOURCE_EXHAUSTED when max_waiting
  // requests wait; the engine's unhealthy cause (its code) after an unrecoverable failure;
  // FAILED_PRECONDITION after shutdown began. Each refusal counts in metrics().requests_refused.
  // Thread-safe.
  absl::StatusOr<RequestId> add_request(RequestSpec spec);

  // Aborts every choice of a request: queued ones never run, running ones
  // stop at the next step boundary (their pages come back behind the fence);
  // each gets a final event with finish kAbort. OK means the abort was
  // queued: a choice the engine finished before applying it keeps its own
  // finish reason. NOT_FOUND when the id is unknown or every choice's final
  // event was already delivered (then nothing changes).
  absl::Status abort(RequestId id);

  // Drops every entry of the prefix cache once the engine loop applies it (before it schedules
  // its next step): later requests prefill their prompts in full until their pages are cached
  // again; pages held by running requests stay with them. OK means queued;
  // FAILED_PRECONDITION after shutdown began. Thread-safe.
  absl::Status reset_prefix_cache();

  // The next event of a request without on_output (any choice, in order per
  // choice). DEADLINE_EXCEEDED when none came by the deadline; NOT_FOUND for
  // an unknown id or one whose every final event was already returned (or
  // that delivers to a callback); FAILED_PRECONDITION instead of waiting when
  // called from an on_output callback. Thread-safe; one reader per request.
  absl::StatusOr<RequestOutput> next_output(RequestId id,
                                            base::Deadline deadline = base::Deadline::forever());

  // Stops admission, lets running and waiting requests finish until
  // `drain_deadline`, aborts the rest (final events with kAbort), stops the
  // threads and closes the Worker (bounded by the deadline plus the device's
  // close grace). Returns the first error nobody received (the Worker's close
  // status, or the unhealthy cause). Idempotent; thread-safe;
  // FAILED_PRECONDITION from an on_output callback (it joins that thread).
  absl::Status shutdown(base::Deadline drain_deadline = base::Deadline::poll());

  // OK while healthy; the unrecoverable cause after a device fault / timeout.
  absl::Status health() const;
  EngineMetrics metrics() const;
  std::vector<StepRecord> step_records() const;
  const ModelConfig& config() const { return config_; }
  const Qwen3Dims& dims() const { return dims_; }
  const EngineOptions& options() const { return options_; }
  uint64_t weight_bytes_per_step() const { return weight_bytes_per_step_; }

 private:
  friend class EngineTestAccess;
  friend class LlmDataParallel;
  struct Impl;
  LlmEngine() = default;
  // Over a runner made by the caller (one per L3 child). INVALID_ARGUMENT when the runner is
  // null or was made with RunnerOptions other than options.runner (page_size, num_pages,
  // max_num_seqs, max_num_batched_tokens, host_sampling, launch_depth); otherwise as create's.
  static absl::StatusOr<std::unique_ptr<LlmEngine>> create(std::unique_ptr<Qwen3ModelRunner> runner,
                                                           const EngineOptions& options);
  ModelConfig config_;
  Qwen3Dims dims_;
  EngineOptions options_;
  uint64_t weight_bytes_per_step_ = 0;
  std::unique_ptr<Impl> impl_;
};

}  // namespace simpler::llm
