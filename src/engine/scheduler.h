// The continuous-batching scheduler (docs/design/scheduler.md): which requests
// run in the next step, which positions of each, and where their KV goes. Pure
// logic: no device, no tensors, no threads (ARCHITECTURE.md, Serving).
//
// Lifecycle of a request:
//   add() -> waiting (FCFS queue) -> admitted: running, prefilled in chunks
//   of up to the token budget, then one decode position per step -> finished
//   (stop / length / abort / error). A running request that needs pages that
//   are not there may be preempted: its pages are fenced, it goes back to the
//   head of the waiting queue keeping its retired output tokens, and on
//   re-admission its prompt plus those tokens are prefilled again (recompute).
//
// Lifecycle of a step:
//   schedule() -> StepPlan (counted as submitted from then on) -> exactly one
//   of on_step_retired() / on_step_failed(), in step-id order. Up to any
//   number of steps may be in flight (the launch depth is the caller's): a
//   decode row may read the token that an earlier, still running step samples
//   on the device. Rows of a request that finished or was preempted after the
//   step was planned are ignored when the step retires.
//
// Pages: a finished, aborted or preempted request's pages are fenced behind
// the last submitted step that reads or writes them and become free when that
// step retires or fails recoverably. A step that fails unrecoverably (e.g.
// timed out: device use unproven) quarantines every page its rows touch;
// quarantined pages stay counted and are never reused. Admission and
// allocation only ever use free pages; a running request that needs pages
// preempts the most recently admitted running requests only while free plus
// fenced pages do not cover its need, and otherwise waits for the fence, so
// preemption never cascades without making progress.
//
// Prefix caching (docs/design/prefix_cache.md; SchedulerOptions::
// enable_prefix_caching, for requests that carry their prompt's tokens): a
// request's full pages enter the pool's prefix cache as the steps that wrote
// them retire, and admission maps the longest cached chain that starts a
// request's known tokens into its block table, so only the rest is
// prefilled.
#pragma once

#include <cstdint>
#include <deque>
#include <optional>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "engine/kv_cache.h"

namespace simpler::llm {

struct SchedulerOptions {
  int32_t max_num_batched_tokens = 2048;  // token budget per step
  int32_t max_num_seqs = 256;             // row cap per step, and cap of running requests
  int32_t max_waiting = 1024;             // waiting-queue capacity
  int32_t page_size = 16;                 // tokens per KV page
  int32_t num_pages = 0;                  // pages in the KV pool
  int64_t max_model_len = 0;              // max_position_embeddings
  bool enable_prefix_caching = false;     // share proven full pages (prefix_cache.md)
};

// One request as the engine hands it over. Requests are admitted in the order
// of their add() calls (arrival order).
struct SchedulerRequest {
  SchedulerRequest() = default;
  SchedulerRequest(uint64_t id, int64_t prompt_len, int64_t max_tokens, uint64_t sampling_id = 0,
                   std::vector<int32_t> prompt = {})
      : id(id),
        prompt_len(prompt_len),
        max_tokens(max_tokens),
        sampling_id(sampling_id),
        prompt(std::move(prompt)) {}

  uint64_t id = 0;
  int64_t prompt_len = 0;
  int64_t max_tokens = 0;    // output tokens at most
  uint64_t sampling_id = 0;  // opaque handle of the sampling parameters
  // The prompt's token ids (prompt_len of them), or empty: such a request
  // neither uses nor fills the prefix cache.
  std::vector<int32_t> prompt;
  // The host must see each sampled token before the next row is planned (a grammar's mask
  // follows from it): no decode row while a sample of this request is in flight, so only this
  // request waits for its step to retire (serial launch for it, early enqueue for the others).
  bool host_feedback = false;
  // Prompt logprobs: until its first output token retired, every prefill row also asks for the
  // logits of its prompt positions before the last one (StepRow::prompt_logits). Each such
  // position takes one of the step's max_num_seqs rows (the runner's logit rows bound both), so
  // its prefill chunks are at most max_num_seqs - 1 positions until they reach the last one.
  // It never takes pages from the prefix cache (their positions would have no logits), though
  // it still fills it.
  bool prompt_logits = false;
};

enum class FinishReason : uint8_t { kStop, kLength, kAbort, kError };
inline constexpr int kNumFinishReasons = 4;

// One row of a step: positions [start, start + len) of one request. A prefill
// row's tokens are known on the host (prompt, or prompt + kept output tokens
// when recomputing); a decode row has len 1 and its input token is the one the
// previous step sampled for this request (possibly still on the device).
struct StepRow {
  uint64_t request_id = 0;
  uint64_t sampling_id = 0;
  int64_t start = 0;
  int64_t len = 0;
  bool prefill = false;
  bool logits = false;               // samples the token at position start + len
  std::vector<int32_t> slots;        // KV slot of each position, len entries
  std::vector<int32_t> block_table;  // the request's pages after this step
  // The request's per-request device state slot (e.g. its sampling token
  // counts, sampling.h) in [0, max_num_seqs): held from admission to finish
  // or preemption, reused by another request only after the last step that
  // used it retired. `fresh_state`: the first row since the request took
  // this slot (the engine clears the slot and commits the request's known
  // tokens before sampling).
  int32_t state_slot = -1;
  bool fresh_state = false;
  // Prompt logprobs (SchedulerRequest::prompt_logits): positions [start, start + prompt_logits)
  // also produce logits: each one's logits score the prompt token after it. Only prompt
  // positions before the last one; 0 for other rows.
  int64_t prompt_logits = 0;
};

// One step: decode rows first (in admission order), then prefill chunks.
struct StepPlan {
  int64_t step_id = 0;
  std::vector<StepRow> rows;
  int64_t num_tokens() const;
};

// What a retired step produced for one row; results are given in row order,
// one per row (token and stop are ignored for rows without logits).
struct RowResult {
  int32_t token = 0;
  // The token ends the request: a stop id (EOS, stop_token_ids); stop strings end it by stop().
  bool stop = false;
};

enum class StepFailure : uint8_t {
  kRecoverable,    // the step ended; its device use is proven finished
  kUnrecoverable,  // e.g. timed out; its pages may still be read or written
};

struct FinishedRequest {
  uint64_t id = 0;
  FinishReason reason = FinishReason::kStop;
  std::vector<int32_t> output_tokens;
  // kError only: why (the failed step's error given to on_step_failed, or
  // RESOURCE_EXHAUSTED with the numbers when quarantine left the pool too
  // small for the request).
  absl::Status error;
  // Prompt tokens its first admission found in the prefix cache (0 when it
  // was never admitted, or without prefix caching).
  int64_t cached_tokens = 0;
};

// A sample on_step_retired accepted: row `row` of the step gave request
// `request_id` its output token `token` (the `index`-th, 0-based). Rows whose
// request finished, was aborted or preempted since the step was scheduled are
// stale and not reported: the engine streams, detokenizes and commits (token
// counts) exactly the accepted samples.
struct AcceptedSample {
  size_t row = 0;
  uint64_t request_id = 0;
  int32_t token = 0;
  int64_t index = 0;
  bool stop = false;  // the token ended the request (RowResult::stop): its last output
};

struct SchedulerSnapshot {
  int64_t waiting = 0;
  int64_t running = 0;
  int64_t steps_in_flight = 0;
  int64_t preempted_total = 0;
  int64_t finished[kNumFinishReasons] = {};  // indexed by FinishReason
  PageCounts pages;
  int64_t state_slots_free = 0;    // of max_num_seqs
  int64_t state_slots_fenced = 0;  // released, waiting for their last step to retire
  // Prefix caching, in tokens (vLLM's prefix_cache_queries / _hits): every
  // admission queries its known tokens and hits its cached ones.
  int64_t prefix_cache_queries = 0;
  int64_t prefix_cache_hits = 0;
  int64_t cached_pages = 0;  // pages in the cache's index
};

// A live request as the scheduler sees it (for the engine and tests).
struct RequestInfo {
  bool running = false;
  int64_t prompt_len = 0;
  int64_t num_scheduled = 0;  // positions written or being written to the KV cache
  int64_t num_preemptions = 0;
  int64_t max_tokens = 0;
  int64_t pending_samples = 0;         // samples of steps in flight
  bool prefilled = false;              // prompt (and kept tokens) all scheduled
  std::vector<int32_t> output_tokens;  // retired tokens (kept across preemption)
  std::vector<int32_t> pages;
  int64_t cached_tokens = 0;  // as FinishedRequest::cached_tokens
};

// Owns the page pool, every live request's block table and the waiting and
// running queues. Owned by the engine loop for the engine's lifetime.
// Thread-compatible.
class Scheduler {
 public:
  // INVALID_ARGUMENT naming the field when a size is not positive (num_pages
  // may be 0 only to refuse everything) or the pool does not fit int32 slots.
  static absl::StatusOr<Scheduler> create(const SchedulerOptions& options);

  // Queues a request. INVALID_ARGUMENT naming the request when prompt_len or
  // max_tokens is not positive, when it asks for prompt_logits with max_num_seqs < 2 (no step
  // would hold a prompt position's logits beside its row), when prompt_len + max_tokens exceeds
  // max_model_len, or when the request alone needs more KV pages than the pool
  // holds (both numbers in the message); ALREADY_EXISTS for a live id;
  // RESOURCE_EXHAUSTED when max_waiting requests wait already.
  absl::Status add(const SchedulerRequest& spec);

  // Finishes a live request with kAbort; its pages are fenced. NOT_FOUND for
  // an id that is not live.
  absl::Status abort(uint64_t id);

  // Finishes a live request with kError carrying `error` (e.g. the engine
  // became unhealthy); its pages are fenced. NOT_FOUND for an id that is not
  // live.
  absl::Status fail(uint64_t id, absl::Status error);

  // Finishes a live request with kStop because the output processor matched a
  // stop string: its output keeps the first `keep_tokens` retired tokens (the
  // token the stop string ended in included), its pages are fenced, and its
  // samples still in flight become stale. NOT_FOUND for an id that is not
  // live; INVALID_ARGUMENT when keep_tokens is negative or more than it has.
  absl::Status stop(uint64_t id, int64_t keep_tokens);

  // The next step, or nullopt when no row can be scheduled now (nothing live,
  // or every live request waits for a step in flight to retire). Returns a
  // step whenever no step is in flight and a request is still live after the
  // call: a request that quarantine left a pool too small for finishes with
  // kError (see take_finished) instead of waiting forever.
  std::optional<StepPlan> schedule();

  // The oldest step in flight retired with one result per row. Returns the
  // samples it accepted, in row order (see AcceptedSample).
  // FAILED_PRECONDITION when step_id is not the oldest step in flight;
  // INVALID_ARGUMENT when results do not match its rows.
  absl::StatusOr<std::vector<AcceptedSample>> on_step_retired(int64_t step_id,
                                                              absl::Span<const RowResult> results);

  // The oldest step in flight failed with `cause` (the run's error). Its live
  // requests finish with kError carrying `cause`; kUnrecoverable quarantines
  // every page its rows touch and fails every other running request that
  // holds one of them (a shared cached page) as well. FAILED_PRECONDITION
  // when step_id is not the oldest step in flight.
  absl::Status on_step_failed(int64_t step_id, StepFailure failure,
                              const absl::Status& cause = absl::UnknownError("step failed"));

  // Requests finished since the last call, in finishing order.
  std::vector<FinishedRequest> take_finished();

  SchedulerSnapshot snapshot() const;
  std::optional<RequestInfo> find(uint64_t id) const;
  // Ids of the live requests (waiting and running), in no particular order.
  std::vector<uint64_t> live_ids() const;
  // Drops every entry of the prefix cache (PagePool::reset_cache); running
  // requests stop filling it until they are admitted again. Returns the
  // number of pages dropped.
  int32_t reset_prefix_cache();
  const PagePool& pool() const { return pool_; }

  // INTERNAL when the page states disagree with the live requests' block
  // tables: a used page whose holder count is not the number of live tables
  // holding it, a held page neither used nor quarantined, or counts that do
  // not sum to the pool. Linear; for tests and debug.
  absl::Status check_invariants() const;

 private:
  struct Request {
    explicit Request(const SchedulerRequest& s) : spec(s), table(s.id) {}
    SchedulerRequest spec;
    BlockTable table;
    std::vector<int32_t> outputs;  // retired samples
    int64_t pending = 0;           // samples of steps in flight
    int64_t last_step = 0;         // last submitted step touching table's pages
    uint64_t admitted_seq = 0;
    uint32_t incarnation = 0;  // bumped on preemption
    int64_t num_preemptions = 0;
    bool running = false;
    bool prefilled = false;      // the row sampling after the known tokens is scheduled
    int32_t state_slot = -1;     // while running
    bool fresh_state = false;    // no row since it took state_slot
    int64_t cached_tokens = -1;  // at the first admission; -1 before it
    // Prefix caching: the table's leading pages that are in the cache (hits,
    // then pages this request entered), and whether it still enters more
    // (false once a page's key was taken by another page, or after a reset).
    int64_t registered = 0;
    bool registering = true;
  };
  struct RowRecord {
    uint64_t id = 0;
    uint32_t incarnation = 0;
    bool logits = false;
    int64_t end = 0;  // positions [0, end) of the request are written once the row ran
    std::vector<int32_t> pages;
  };
  struct InFlightStep {
    int64_t step_id = 0;
    std::vector<RowRecord> rows;
  };

  Scheduler(const SchedulerOptions& options, PagePool pool)
      : options_(options), pool_(std::move(pool)) {}

  int64_t known_tokens(const Request& r) const;
  int64_t max_pages(const Request& r) const;
  bool decode_ready(const Request& r) const;
  bool has_work(const Request& r) const;
  void preempt(uint64_t id);
  void finish(uint64_t id, FinishReason reason, absl::Status error = absl::OkStatus());
  absl::Status quarantine_error(const Request& r) const;
  // Adds r's row of `len` positions; returns the rows of the step it takes (1 + its
  // prompt_logits).
  int64_t add_row(StepPlan& plan, InFlightStep& record, Request& r, int64_t len);
  // The longest chunk, up to `len`, from r's next position whose prompt logits fit in `rows`
  // rows besides its own (`len` itself without prompt logits); 0 when none does.
  int64_t logit_room(const Request& r, int64_t len, int64_t rows) const;
  // One schedule() call's step under construction: decode rows first, then prefill chunks.
  struct StepBuild {
    StepPlan decodes, prefills;
    InFlightStep decode_rec, prefill_rec;
    int64_t budget = 0;     // tokens left (max_num_batched_tokens)
    int64_t rows_left = 0;  // rows left (max_num_seqs)
    // Decode rows of running requests not yet visited; prefill chunks leave them their
    // token and row, so decodes come first whatever the admission order.
    int64_t later_decodes = 0;
    bool preempted = false;  // a step that preempted admits nothing (vLLM v1 does the same)
  };
  // schedule()'s parts. A row for running_[i], if it gets one; false when running_[i] left
  // the running list (preempted or finished), so that index is visited again.
  bool schedule_running(StepBuild& b, size_t i);
  void admit_waiting(StepBuild& b);
  void preempt_behind(StepBuild& b, size_t i, int64_t need);
  std::optional<uint64_t> victim_behind(size_t i) const;
  int64_t available_pages() const;  // free + fenced
  // Tokens r's pages and the free ones hold beyond its context.
  int64_t free_room(const Request& r) const;
  // Gives back r's state slot: free at once when its last step retired,
  // fenced behind that step otherwise.
  void release_state_slot(Request& r);
  absl::Status check_front(int64_t step_id) const;
  // Prefix caching (prefix_cache.md).
  bool caches(const Request& r) const;
  int32_t token_at(const Request& r, int64_t position) const;
  std::vector<int32_t> page_tokens(const Request& r, int64_t page) const;
  std::vector<int32_t> cached_prefix(const Request& r) const;
  bool prefix_in_flight(const Request& r, const std::vector<int32_t>& hits) const;
  void register_full_pages(Request& r, int64_t written);
  // Admits waiting_.front() with its cached prefix if its first chunk's pages are free.
  bool admit_front(StepBuild& b);
  void free_fenced_state_slots(int64_t step_id);
  absl::Status check_page_holders() const;

  SchedulerOptions options_;
  PagePool pool_;
  std::unordered_map<uint64_t, Request> requests_;  // live ones
  std::deque<uint64_t> waiting_;
  std::vector<uint64_t> running_;  // admission order
  std::deque<InFlightStep> in_flight_;
  std::vector<FinishedRequest> finished_;
  int64_t next_step_id_ = 1;
  uint64_t next_admitted_seq_ = 1;
  int64_t preempted_total_ = 0;
  int64_t prefix_cache_queries_ = 0;
  int64_t prefix_cache_hits_ = 0;
  int64_t finished_count_[kNumFinishReasons] = {};
  std::vector<int32_t> free_state_slots_;                        // stack
  std::vector<std::pair<int32_t, int64_t>> fenced_state_slots_;  // (slot, fence step)
};

}  // namespace simpler::llm
