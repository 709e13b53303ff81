#include "simpler/engine/llm_engine.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <deque>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <thread>
#include <unordered_map>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "engine/engine_test_hooks.h"
#include "engine/kv_cache.h"
#include "engine/model_runner.h"
#include "engine/scheduler.h"
#include "simpler/base/enum_names.h"
#include "simpler/base/log.h"
#include "simpler/base/status.h"
#include "simpler/base/sync.h"
#include "simpler/base/thread.h"
#include "simpler/tokenizer/detokenizer.h"

namespace simpler::llm {

namespace {

constexpr base::EnumNames<OutputFinish> kFinishNames = {{OutputFinish::kNone, ""},
                                                        {OutputFinish::kStop, "stop"},
                                                        {OutputFinish::kLength, "length"},
                                                        {OutputFinish::kAbort, "abort"},
                                                        {OutputFinish::kError, "error"}};

}  // namespace

const char* finish_reason_name(OutputFinish reason) { return kFinishNames.c_name(reason, ""); }

namespace {

OutputFinish to_output(FinishReason r) {
  switch (r) {
    case FinishReason::kStop:
      return OutputFinish::kStop;
    case FinishReason::kLength:
      return OutputFinish::kLength;
    case FinishReason::kAbort:
      return OutputFinish::kAbort;
    case FinishReason::kError:
      return OutputFinish::kError;
  }
  return OutputFinish::kError;
}

std::chrono::steady_clock::time_point in_ms(int64_t ms) {
  return std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
}

}  // namespace

// A request's delivery point: its queue (or callback) and how many choices
// are still open. Shared by callers, the output thread and the engine.
struct Delivery {
  base::Mutex mu;
  base::CondVar cv;
  std::deque<RequestOutput> queue SIMPLER_GUARDED_BY(mu);
  int32_t open_choices SIMPLER_GUARDED_BY(mu) = 0;  // without a final event queued
  int32_t unread_finals SIMPLER_GUARDED_BY(mu) = 0;
  std::function<void(const RequestOutput&)> callback;  // immutable
  std::string caller_id;                               // immutable
};

namespace {

// Registration (the first event of every choice): what the output thread keeps.
struct ChoiceInit {
  RequestId rid = 0;
  int32_t index = 0;
  int64_t arrival_ns = 0;
  std::shared_ptr<Delivery> delivery;
  std::shared_ptr<const RequestSpec> spec;
};

// One event from the loop to the output processor.
struct LoopEvent {
  uint64_t sid = 0;
  std::vector<int32_t> tokens;
  std::vector<TokenLogprob> logprobs;
  std::vector<std::optional<TokenLogprob>> prompt_logprobs;  // with the choice's first token
  std::vector<int64_t> times;
  std::map<int64_t, std::vector<float>> logits;
  std::map<int64_t, Qwen3ModelRunner::Kv> kv;
  bool final = false;
  // The last of `tokens` is a stop id that ended the choice (the model's EOS, or one of the
  // request's stop_token_ids): its id and logprob are output, its text is not (vLLM's
  // include_stop_str_in_output false, the default).
  bool ends_on_stop_token = false;
  OutputFinish finish = OutputFinish::kNone;
  absl::Status error;
  int64_t completion_tokens = 0;
  int64_t scheduled_ns = 0, first_token_ns = 0, finished_ns = 0, num_preemptions = 0;
  int64_t cached_tokens = 0;
  std::vector<int32_t> pages;
  std::vector<int64_t> page_steps;
  int64_t last_step = 0;
  std::optional<ChoiceInit> init;
};

}  // namespace

struct LlmEngine::Impl {
  // ---- immutable after create ----
  LlmEngine* engine = nullptr;
  EngineOptions options;
  std::unique_ptr<Qwen3ModelRunner> runner;
  std::vector<int32_t> eos_ids;
  int64_t max_model_len = 0;

  // ---- the inbox: callers and the output thread -> loop ----
  struct Command {
    enum Kind { kAdd, kAbort, kStop, kAbortChoice, kResetPrefixCache } kind;
    RequestId rid = 0;
    uint64_t sid = 0;
    int64_t keep = 0;
    absl::Status reason;
    struct NewChoice {
      uint64_t sid;
      int32_t index;
      SamplingParams params;
    };
    std::vector<NewChoice> choices;
    std::shared_ptr<const RequestSpec> spec;
    std::shared_ptr<Delivery> delivery;
    int64_t arrival_ns = 0;
  };
  base::Mutex mu;
  base::CondVar inbox_cv;
  std::deque<Command> inbox SIMPLER_GUARDED_BY(mu);
  int64_t waiting_choices SIMPLER_GUARDED_BY(mu) = 0;  // in the inbox or the scheduler's queue
  bool draining SIMPLER_GUARDED_BY(mu) = false;
  base::Deadline drain_deadline SIMPLER_GUARDED_BY(mu);
  bool stop_loop SIMPLER_GUARDED_BY(mu) = false;
  absl::Status unhealthy SIMPLER_GUARDED_BY(mu);
  uint64_t next_rid SIMPLER_GUARDED_BY(mu) = 1;
  uint64_t next_sid SIMPLER_GUARDED_BY(mu) = 1;
  SeedAllocator seeds SIMPLER_GUARDED_BY(mu);
  std::unordered_map<RequestId, std::shared_ptr<Delivery>> deliveries SIMPLER_GUARDED_BY(mu);
  EngineMetrics metrics SIMPLER_GUARDED_BY(mu);
  std::vector<StepRecord> step_records SIMPLER_GUARDED_BY(mu);
  absl::Status invariant_violation SIMPLER_GUARDED_BY(mu);
  std::atomic<bool> check_invariants{false};

  // ---- the outbox: loop -> output thread ----
  base::Mutex out_mu;
  base::CondVar out_cv;
  std::deque<LoopEvent> outbox SIMPLER_GUARDED_BY(out_mu);
  bool out_done SIMPLER_GUARDED_BY(out_mu) = false;  // the loop exited: drain and stop

  std::thread loop_thread, output_thread;
  // Their ids, written by create() before any caller can see the engine.
  std::thread::id loop_thread_id, output_thread_id;
  std::once_flag shutdown_once;
  absl::Status shutdown_status;

  // ---- loop-owned ----
  struct Choice {
    RequestId rid = 0;
    int32_t index = 0;
    std::shared_ptr<const RequestSpec> spec;
    SamplingParams params;
    std::vector<int32_t> tokens;  // prompt, then accepted outputs
    int64_t prompt_len = 0;
    int64_t arrival_ns = 0, scheduled_ns = 0, first_token_ns = 0, last_token_ns = 0;
    std::vector<int32_t> pages;                      // its block table after its latest step
    std::vector<int64_t> page_steps;                 // the step that allocated each of `pages`
    int64_t last_step = 0;                           // its latest step
    std::optional<grammar::GrammarMatcher> matcher;  // with a grammar: the output's parse state
    std::vector<uint32_t> mask;                      // the mask of its latest logit row
    // Prompt logprobs (RequestSampling::prompt_logprobs): the alternatives asked (-1: none),
    // each prompt token's score as its steps retire (the first has none), and whether they went
    // out (with its first token; a recompute after that asks for none).
    int32_t prompt_logprobs = -1;
    std::vector<std::optional<TokenLogprob>> prompt_scores;
    bool prompt_scores_sent = false;
  };
  std::optional<Scheduler> scheduler;
  std::unordered_map<uint64_t, Choice> choices;  // live and not yet reported final
  std::vector<std::string> token_bytes;          // per id, for grammars (empty: special)
  std::optional<grammar::TokenIndex> token_trie;
  // Token masks by (grammar, parser state): states repeat within a request (every character of
  // a JSON string leads back to the same state) and across requests of one schema. The cache
  // holds a reference to each grammar it has masks of, so no address is reused while cached;
  // emptied when it holds kMaskCacheEntries masks (each mask_words(V) words: 19 KiB for Qwen3).
  static constexpr size_t kMaskCacheEntries = 1024;
  std::map<const grammar::Grammar*, std::shared_ptr<const grammar::Grammar>> mask_grammars;
  absl::flat_hash_map<std::pair<const grammar::Grammar*, grammar::GrammarMatcher::Stacks>,
                      std::vector<uint32_t>>
      mask_cache;
  struct InFlight {
    int64_t step_id = 0;
    StepPlan plan;
    std::unique_ptr<StepInFlight> step;  // null: submit failed with `submit_error`
    absl::Status submit_error;
    int64_t in_flight_at_submit = 0;
  };
  std::deque<InFlight> in_flight;
  // Set when the loop leaves: steps cancelled by the shutdown's close are
  // not a failure of the engine.
  bool closing = false;
  int64_t cancel_at_ns = 0;  // after the drain deadline: when to stop waiting for steps

  // ---- output-thread-owned ----
  struct OutChoice {
    uint64_t sid = 0;
    RequestId rid = 0;
    int32_t index = 0;
    std::shared_ptr<Delivery> delivery;
    std::shared_ptr<const RequestSpec> spec;
    std::optional<IncrementalDetokenizer> detok;
    std::optional<StopStringMatcher> stops;
    int64_t generated = 0;
    int64_t arrival_ns = 0;
    bool stop_matched = false;  // waiting for the loop's final event
    int64_t keep = 0;
    // An event of it was dropped (its queue was full): it ends as an abort.
    bool overflowed = false;
    int64_t delivered_tokens = 0;  // tokens of the events handed to its consumer
  };
  std::unordered_map<uint64_t, OutChoice> out_choices;  // output thread only

  // add_request's checks: the SamplingParams of a valid request, or why it is refused.
  absl::StatusOr<SamplingParams> check_request(const RequestSpec& spec) const;
  absl::StatusOr<SamplingParams> sampling_params(const RequestSampling& rs) const;
  // Queues a checked request (seeds it); refuses while unhealthy, draining or full.
  absl::StatusOr<RequestId> enqueue(RequestSpec spec, SamplingParams p);
  // Queues a command for the loop and wakes it.
  void post_locked(Command c) SIMPLER_REQUIRES(mu) {
    inbox.push_back(std::move(c));
    inbox_cv.notify_one();
  }
  void post(Command c) {
    base::MutexLock l(mu);
    post_locked(std::move(c));
  }
  void loop();
  void output_loop();
  void fail_all_live(const absl::Status& cause);
  void apply(Command& c);
  bool submit_one();
  // Structured outputs: the vocabulary's trie (built on the first constrained request), the
  // choice's token mask for its next row, and its grammar advanced by an accepted token (the
  // choice fails when the grammar refuses it and stops when its output is complete and final).
  const grammar::TokenIndex& token_index();
  void fill_grammar_mask(Choice& ch);
  void advance_grammar(uint64_t sid, Choice& ch, int32_t token);
  void retire_front();
  // retire_front's parts, in order. The step's status (its submit's, its run's or collect's)
  // and, when OK, its samples.
  absl::Status wait_step(const InFlight& f, std::vector<RowSample>& samples);
  // The K/V a request's hooks asked for, read from the step's slots into its event.
  void dump_kv(const InFlight& f, std::unordered_map<uint64_t, LoopEvent>& events);
  // The scheduler's verdict on the step's samples (stop ids checked per row).
  std::vector<AcceptedSample> retire_rows(const InFlight& f, const std::vector<RowSample>& samples);
  // One accepted token (and its logprobs and logits from `s`, when it has one) into `ev`.
  static void accept(const Choice& ch, const AcceptedSample& a, const RowSample* s, LoopEvent& ev);
  void accept_samples(const InFlight& f, const std::vector<RowSample>& samples, int64_t now,
                      std::unordered_map<uint64_t, LoopEvent>& events);
  // The step's prompt logprobs into their choices (those not sent yet).
  void store_prompt_logprobs(const InFlight& f);
  // A failed step: its rows fail; an unrecoverable error makes the engine unhealthy.
  void fail_step(const InFlight& f, const absl::Status& status);
  // The step's histograms and, with record_steps, its StepRecord.
  void record_step(const InFlight& f, int64_t now) SIMPLER_REQUIRES(mu);
  void publish_finished(int64_t now);
  void refresh_gauges();
  void emit(LoopEvent ev) {
    base::MutexLock l(out_mu);
    outbox.push_back(std::move(ev));
    out_cv.notify_one();
  }
  void deliver(OutChoice& oc, RequestOutput out);
  // Finish counters (metrics): +delta for `finish`. Requires mu.
  void count_finish(OutputFinish finish, int64_t delta) SIMPLER_REQUIRES(mu);
  void handle_event(LoopEvent& ev);
  void register_choice(const LoopEvent& ev);
  // Appends `delta` to out.text through the choice's stop strings, if any; true when one
  // matched (the choice then keeps its tokens so far).
  bool push_text(OutChoice& oc, const std::string& delta, RequestOutput& out);
  // The event's tokens, logprobs and text into `out` (up to a matched stop string); returns
  // the event's test hooks (RequestSpec::hooks), or null.
  std::shared_ptr<OutputHooks> fold_tokens(OutChoice& oc, LoopEvent& ev, RequestOutput& out);
  // A final event's finish reason, error, usage, timing and hooks (the event's `hooks` plus
  // the pages) into `out`.
  void finish_output(OutChoice& oc, LoopEvent& ev, RequestOutput& out,
                     std::shared_ptr<OutputHooks> hooks);
};

namespace {

absl::Status check_engine_options(const EngineOptions& options) {
  return base::require_positive({{"max_waiting", options.max_waiting},
                                 {"max_buffered_outputs", options.max_buffered_outputs}});
}

}  // namespace

absl::StatusOr<std::unique_ptr<LlmEngine>> LlmEngine::create(const std::string& model_dir,
                                                             const EngineOptions& options) {
  SIMPLER_RETURN_IF_ERROR(check_engine_options(options));
  SIMPLER_ASSIGN_OR_RETURN(std::unique_ptr<Qwen3ModelRunner> runner,
                           Qwen3ModelRunner::create(model_dir, options.runner));
  return create(std::move(runner), options);
}

absl::StatusOr<std::unique_ptr<LlmEngine>> LlmEngine::create(
    std::unique_ptr<Qwen3ModelRunner> runner, const EngineOptions& options) {
  SIMPLER_RETURN_IF_ERROR(check_engine_options(options));
  if (runner == nullptr) return absl::InvalidArgumentError("LlmEngine::create: no runner");
  const RunnerOptions& ro = runner->options();
  if (ro.page_size != options.runner.page_size || ro.num_pages != options.runner.num_pages ||
      ro.max_num_seqs != options.runner.max_num_seqs ||
      ro.max_num_batched_tokens != options.runner.max_num_batched_tokens ||
      ro.host_sampling != options.runner.host_sampling ||
      ro.worker.launch_depth != options.runner.worker.launch_depth) {
    return absl::InvalidArgumentError(
        "LlmEngine::create: the runner was made with other RunnerOptions (page_size, num_pages, "
        "max_num_seqs, max_num_batched_tokens, host_sampling or launch_depth) than "
        "EngineOptions::runner");
  }
  std::unique_ptr<LlmEngine> e(new LlmEngine());
  e->options_ = options;
  auto impl = std::make_unique<Impl>();
  impl->engine = e.get();
  impl->options = options;
  impl->runner = std::move(runner);
  e->config_ = impl->runner->config();
  e->dims_ = impl->runner->dims();
  e->weight_bytes_per_step_ = impl->runner->weight_bytes_per_step();
  for (int64_t id : e->config_.stop_ids()) impl->eos_ids.push_back(static_cast<int32_t>(id));
  impl->max_model_len = e->config_.max_position_embeddings;
  SchedulerOptions so;
  so.max_num_batched_tokens = options.runner.max_num_batched_tokens;
  so.max_num_seqs = options.runner.max_num_seqs;
  // Preempted requests go back to the waiting queue: room for all of them.
  so.max_waiting = options.max_waiting + options.runner.max_num_seqs;
  so.page_size = options.runner.page_size;
  so.num_pages = options.runner.num_pages;
  so.max_model_len = impl->max_model_len;
  so.enable_prefix_caching = options.enable_prefix_caching;
  SIMPLER_ASSIGN_OR_RETURN(Scheduler sched, Scheduler::create(so));
  impl->scheduler.emplace(std::move(sched));
  {
    base::MutexLock l(impl->mu);
    EngineMetrics& m = impl->metrics;
    m.time_to_first_token_s = Histogram::with_bounds(ttft_buckets_s());
    m.inter_token_latency_s = Histogram::with_bounds(inter_token_buckets_s());
    m.e2e_request_latency_s = Histogram::with_bounds(request_latency_buckets_s());
    m.request_queue_time_s = Histogram::with_bounds(request_latency_buckets_s());
    m.step_time_s = Histogram::with_bounds(inter_token_buckets_s());
    m.rows_per_step = Histogram::with_bounds(build_1_2_5_buckets(options.runner.max_num_seqs));
    m.tokens_per_step =
        Histogram::with_bounds(build_1_2_5_buckets(options.runner.max_num_batched_tokens));
    m.grammar_mask_time_s = Histogram::with_bounds(
        {1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1, 0.2, 0.5, 1.0});
    m.kv_pages_total = options.runner.num_pages;
    m.kv_pages.free = options.runner.num_pages;
  }
  Impl* raw = impl.get();
  impl->loop_thread = std::thread([raw] {
    base::set_thread_name("engine-loop");
    raw->loop();
  });
  impl->output_thread = std::thread([raw] {
    base::set_thread_name("engine-output");
    raw->output_loop();
  });
  impl->loop_thread_id = impl->loop_thread.get_id();
  impl->output_thread_id = impl->output_thread.get_id();
  e->impl_ = std::move(impl);
  return e;
}

LlmEngine::~LlmEngine() {
  if (impl_) (void)shutdown(base::Deadline::poll());
}

absl::StatusOr<int64_t> LlmEngine::max_tokens_for(int64_t prompt_tokens,
                                                  std::optional<int64_t> max_tokens) const {
  const int64_t plen = prompt_tokens;
  if (plen < 1) return absl::InvalidArgumentError("the prompt is empty");
  const int64_t context = config_.max_position_embeddings;
  const RunnerOptions& ro = options_.runner;
  const int64_t pool_tokens = static_cast<int64_t>(ro.num_pages) * ro.page_size;
  if (!max_tokens.has_value()) {
    const int64_t room = std::min(context - plen, pool_tokens - plen + 1);
    if (room < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("the prompt has ", plen, " tokens; the model's context holds ", context,
                       " and the KV cache ", pool_tokens, ": no room for one new token"));
    }
    return room;
  }
  const int64_t mt = *max_tokens;
  if (mt < 1) return absl::InvalidArgumentError(absl::StrCat("max_tokens must be >= 1, got ", mt));
  if (mt > context - plen) {  // plen + mt could overflow
    const bool sum_fits = mt <= std::numeric_limits<int64_t>::max() - plen;
    return absl::InvalidArgumentError(
        absl::StrCat("this model's maximum context length is ", context, " tokens; the prompt has ",
                     plen, " tokens and max_tokens is ", mt,
                     (sum_fits ? absl::StrCat(" (", plen + mt, " in all)") : std::string()),
                     ", which exceeds max_position_embeddings"));
  }
  const int64_t need = pages_needed(plen + mt - 1, ro.page_size);
  if (need > ro.num_pages) {
    return absl::InvalidArgumentError(
        absl::StrCat("the request can never fit the KV cache: prompt of ", plen,
                     " tokens + max_tokens ", mt, " needs ", need, " pages of ", ro.page_size,
                     " tokens, and the pool holds ", ro.num_pages, " pages"));
  }
  return mt;
}

namespace {

// The model's EOS ids and the request's stop ids into `p` (ignore_eos masks only the EOS ids).
// INVALID_ARGUMENT for an id outside the vocabulary or more than kMaxSamplingStopIds in all.
absl::Status set_stop_ids(const std::vector<int32_t>& eos_ids,
                          const std::vector<int32_t>& stop_token_ids, int32_t vocab_size,
                          SamplingParams& p) {
  std::vector<std::pair<int32_t, bool>> stop_ids;  // (id, is_eos)
  for (int32_t id : eos_ids) stop_ids.emplace_back(id, true);
  for (int32_t id : stop_token_ids) {
    if (id < 0 || id >= vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat(
          "stop_token_ids entry ", id, " is outside the vocabulary [0, ", vocab_size, ")"));
    }
    bool dup = false;
    for (auto& [sid, eos] : stop_ids) {
      if (sid == id) {
        eos = false;  // the request's own stop id: ignore_eos does not disable it
        dup = true;
      }
    }
    if (!dup) stop_ids.emplace_back(id, false);
  }
  if (stop_ids.size() > static_cast<size_t>(kMaxSamplingStopIds)) {
    return absl::InvalidArgumentError(absl::StrCat("stop_token_ids: ", stop_ids.size(),
                                                   " stop ids with the model's ", eos_ids.size(),
                                                   " EOS ids, at most ", kMaxSamplingStopIds));
  }
  for (size_t i = 0; i < stop_ids.size(); ++i) {
    p.stop_ids[i] = stop_ids[i].first;
    if (stop_ids[i].second) p.eos_mask |= static_cast<uint8_t>(1u << i);
  }
  return absl::OkStatus();
}

// A request's count of top alternatives (`name`: logprobs or prompt_logprobs): absent, or in
// [0, kMaxLogprobs].
absl::Status check_logprobs_count(const char* name, std::optional<int32_t> count) {
  if (!count.has_value() || (*count >= 0 && *count <= kMaxLogprobs)) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(name, " must be in [0, ", kMaxLogprobs, "] (or absent), got ", *count));
}

}  // namespace

absl::StatusOr<SamplingParams> LlmEngine::Impl::sampling_params(const RequestSampling& rs) const {
  const int32_t vocab_size = engine->dims().vocab_size;
  SamplingParams p;
  p.temperature = rs.temperature;
  p.top_p = rs.top_p;
  p.top_k = rs.top_k;
  p.min_p = rs.min_p;
  p.presence_penalty = rs.presence_penalty;
  p.frequency_penalty = rs.frequency_penalty;
  p.repetition_penalty = rs.repetition_penalty;
  p.logprobs = rs.logprobs.has_value() ? *rs.logprobs : -1;
  SIMPLER_RETURN_IF_ERROR(check_logprobs_count("logprobs", rs.logprobs));
  SIMPLER_RETURN_IF_ERROR(check_logprobs_count("prompt_logprobs", rs.prompt_logprobs));
  if (rs.prompt_logprobs.has_value() && options.runner.max_num_seqs < 2) {
    return absl::InvalidArgumentError(absl::StrCat(
        "prompt_logprobs need max_num_seqs >= 2 (a prompt position's logits take a row of the "
        "step besides its own), got ",
        options.runner.max_num_seqs));
  }
  p.min_tokens = rs.min_tokens;
  p.ignore_eos = rs.ignore_eos ? 1 : 0;
  SIMPLER_RETURN_IF_ERROR(set_stop_ids(eos_ids, rs.stop_token_ids, vocab_size, p));
  if (rs.grammar != nullptr) {
    if (options.tokenizer == nullptr) {
      return absl::InvalidArgumentError(
          "a grammar (structured output) needs a tokenizer; the engine was created without one");
    }
    p.masked = 1;
  }
  SIMPLER_RETURN_IF_ERROR(p.validate(vocab_size));
  if (!rs.stop.empty()) {
    if (options.tokenizer == nullptr) {
      return absl::InvalidArgumentError(
          "stop strings need a tokenizer; the engine was created without one");
    }
    SIMPLER_RETURN_IF_ERROR(StopStringMatcher::create(rs.stop).status());
  }
  return p;
}

absl::StatusOr<SamplingParams> LlmEngine::Impl::check_request(const RequestSpec& spec) const {
  const int32_t vocab_size = engine->dims().vocab_size;
  for (size_t i = 0; i < spec.prompt_ids.size(); ++i) {
    const int32_t id = spec.prompt_ids[i];
    if (id < 0 || id >= vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat(
          "prompt_ids[", i, "] = ", id, " is outside the vocabulary [0, ", vocab_size, ")"));
    }
  }
  const int64_t plen = static_cast<int64_t>(spec.prompt_ids.size());
  SIMPLER_RETURN_IF_ERROR(engine->max_tokens_for(plen, spec.max_tokens).status());
  const int32_t max_num_seqs = options.runner.max_num_seqs;
  if (spec.n < 1 || spec.n > max_num_seqs) {
    return absl::InvalidArgumentError(
        absl::StrCat("n must be in [1, max_num_seqs ", max_num_seqs, "], got ", spec.n));
  }
  if (spec.n > options.max_waiting) {
    // Its choices wait together: it would never fit an empty waiting queue.
    return absl::InvalidArgumentError(
        absl::StrCat("n ", spec.n, " exceeds max_waiting ", options.max_waiting,
                     ": the request's choices could never wait in the queue at once"));
  }
  return sampling_params(spec.sampling);
}

absl::StatusOr<RequestId> LlmEngine::Impl::enqueue(RequestSpec spec, SamplingParams p) {
  auto delivery = std::make_shared<Delivery>();
  delivery->callback = spec.on_output;
  delivery->caller_id = spec.caller_id;
  {
    base::MutexLock dl(delivery->mu);
    delivery->open_choices = spec.n;
    delivery->unread_finals = spec.n;
  }
  const int32_t n = spec.n;
  const std::optional<uint64_t> seed = spec.sampling.seed;
  auto shared = std::make_shared<const RequestSpec>(std::move(spec));
  base::MutexLock l(mu);
  absl::Status refusal;
  if (!unhealthy.ok()) {
    refusal = base::annotate(unhealthy, "the engine is unhealthy: ");
  } else if (draining) {
    refusal = absl::FailedPreconditionError("the engine is shutting down");
  } else if (waiting_choices + n > options.max_waiting) {
    refusal = absl::ResourceExhaustedError(
        absl::StrCat("the waiting queue is full: ", waiting_choices, " requests wait, max_waiting ",
                     options.max_waiting, (n > 1 ? absl::StrCat(" (this one adds ", n, ")") : "")));
  }
  if (!refusal.ok()) {
    ++metrics.requests_refused;
    return refusal;
  }
  p.seed = seed.has_value() ? *seed : seeds.next();
  Command c;
  c.kind = Command::kAdd;
  c.rid = next_rid++;
  c.spec = shared;
  c.delivery = delivery;
  c.arrival_ns = base::now_ns();
  for (int32_t i = 0; i < n; ++i) c.choices.push_back({next_sid++, i, p});
  waiting_choices += n;
  deliveries.emplace(c.rid, delivery);
  const RequestId rid = c.rid;
  post_locked(std::move(c));
  return rid;
}

absl::StatusOr<RequestId> LlmEngine::add_request(RequestSpec spec) {
  Impl& im = *impl_;
  absl::StatusOr<SamplingParams> params = im.check_request(spec);
  if (!params.ok()) {
    base::MutexLock l(im.mu);
    ++im.metrics.requests_refused;
    return params.status();
  }
  return im.enqueue(std::move(spec), *params);
}

absl::Status LlmEngine::abort(RequestId id) {
  Impl& im = *impl_;
  base::MutexLock l(im.mu);
  auto it = im.deliveries.find(id);
  bool open = false;
  if (it != im.deliveries.end()) {
    base::MutexLock dl(it->second->mu);
    open = it->second->open_choices > 0;
  }
  if (!open) {
    return absl::NotFoundError(
        absl::StrCat("abort of request ", id, ", which is unknown or already finished"));
  }
  Impl::Command c;
  c.kind = Impl::Command::kAbort;
  c.rid = id;
  im.post_locked(std::move(c));
  return absl::OkStatus();
}

absl::Status LlmEngine::reset_prefix_cache() {
  Impl& im = *impl_;
  base::MutexLock l(im.mu);
  if (im.draining) {
    return absl::FailedPreconditionError("reset_prefix_cache after shutdown began");
  }
  Impl::Command c;
  c.kind = Impl::Command::kResetPrefixCache;
  im.post_locked(std::move(c));
  return absl::OkStatus();
}

absl::StatusOr<RequestOutput> LlmEngine::next_output(RequestId id, base::Deadline deadline) {
  Impl& im = *impl_;
  std::shared_ptr<Delivery> d;
  {
    base::MutexLock l(im.mu);
    auto it = im.deliveries.find(id);
    if (it == im.deliveries.end() || it->second->callback) {
      return absl::NotFoundError(absl::StrCat(
          "request ", id, " is unknown, finished and fully read, or delivers to a callback"));
    }
    d = it->second;
  }
  base::MutexLock dl(d->mu);
  while (d->queue.empty()) {
    if (deadline.expired()) {
      return absl::DeadlineExceededError(absl::StrCat("no output of request ", id, " yet"));
    }
    if (std::this_thread::get_id() == im.output_thread_id) {
      // An on_output callback: only this thread could deliver what it waits for.
      return absl::FailedPreconditionError(absl::StrCat(
          "next_output of request ", id,
          " would wait on the engine's output thread (an on_output callback), which delivers it"));
    }
    if (deadline.is_forever()) {
      d->cv.wait(dl);
    } else {
      d->cv.wait_until(dl, deadline.at);
    }
  }
  RequestOutput out = std::move(d->queue.front());
  d->queue.pop_front();
  const bool last = out.finished() && --d->unread_finals == 0;
  dl.unlock();  // lock order: im.mu before a delivery's mu
  if (last) {
    base::MutexLock l(im.mu);
    im.deliveries.erase(id);
  }
  return out;
}

absl::Status LlmEngine::health() const {
  base::MutexLock l(impl_->mu);
  return impl_->unhealthy;
}

EngineMetrics LlmEngine::metrics() const {
  base::MutexLock l(impl_->mu);
  EngineMetrics m = impl_->metrics;
  m.healthy = impl_->unhealthy.ok();
  m.unhealthy_cause = std::string(impl_->unhealthy.message());
  return m;
}

std::vector<StepRecord> LlmEngine::step_records() const {
  base::MutexLock l(impl_->mu);
  return impl_->step_records;
}

absl::Status EngineTestAccess::invariant_violation(const LlmEngine& engine) {
  base::MutexLock l(engine.impl_->mu);
  return engine.impl_->invariant_violation;
}

void EngineTestAccess::set_check_invariants(LlmEngine& engine, bool on) {
  engine.impl_->check_invariants.store(on);
}

absl::StatusOr<std::unique_ptr<LlmEngine>> EngineTestAccess::create(
    std::unique_ptr<Qwen3ModelRunner> runner, const EngineOptions& options) {
  return LlmEngine::create(std::move(runner), options);
}

worker::CaptureStats EngineTestAccess::capture_stats(const LlmEngine& engine) {
  worker::Worker* w = engine.impl_->runner->worker();
  return w != nullptr ? w->capture_stats() : worker::CaptureStats{};
}

absl::Status LlmEngine::shutdown(base::Deadline drain_deadline) {
  Impl& im = *impl_;
  if (std::this_thread::get_id() == im.output_thread_id ||
      std::this_thread::get_id() == im.loop_thread_id) {
    // It joins both threads: an on_output callback cannot wait for its own thread.
    return absl::FailedPreconditionError(
        "shutdown called on the engine's own thread (an on_output callback); call it from "
        "another thread");
  }
  std::call_once(im.shutdown_once, [&] {
    {
      base::MutexLock l(im.mu);
      im.draining = true;
      im.drain_deadline = drain_deadline;
      im.inbox_cv.notify_one();
    }
    im.loop_thread.join();
    im.output_thread.join();
    absl::Status closed = im.runner->close(base::Deadline::poll());
    base::MutexLock l(im.mu);
    im.shutdown_status = !im.unhealthy.ok() ? im.unhealthy : closed;
  });
  return im.shutdown_status;
}

// ---- the engine loop ---------------------------------------------------------------------

void LlmEngine::Impl::apply(Command& c) {
  const int64_t now = base::now_ns();
  switch (c.kind) {
    case Command::kAdd: {
      for (const Command::NewChoice& nc : c.choices) {
        Choice ch;
        ch.rid = c.rid;
        ch.index = nc.index;
        ch.spec = c.spec;
        ch.params = nc.params;
        ch.tokens = c.spec->prompt_ids;
        ch.prompt_len = static_cast<int64_t>(ch.tokens.size());
        ch.arrival_ns = c.arrival_ns;
        SchedulerRequest sr;
        sr.id = nc.sid;
        sr.prompt_len = ch.prompt_len;
        sr.max_tokens = c.spec->max_tokens;
        sr.sampling_id = nc.sid;
        // A request that dumps K/V reads it from the rows that compute it: none of its
        // positions may come from the prefix cache.
        const bool dumps_kv = c.spec->hooks != nullptr && !c.spec->hooks->kv_positions.empty();
        if (!dumps_kv) sr.prompt = ch.tokens;
        if (c.spec->sampling.grammar != nullptr) {
          ch.matcher.emplace(c.spec->sampling.grammar);
          sr.host_feedback = true;
        }
        if (c.spec->sampling.prompt_logprobs.has_value()) {
          ch.prompt_logprobs = *c.spec->sampling.prompt_logprobs;
          ch.prompt_scores.resize(static_cast<size_t>(ch.prompt_len));
          sr.prompt_logits = true;
        }
        absl::Status s;
        {
          base::MutexLock l(mu);
          s = unhealthy.ok() ? scheduler->add(sr) : unhealthy;
        }
        choices.emplace(nc.sid, std::move(ch));
        // Register the choice with the output thread before any token of it.
        LoopEvent reg;
        reg.sid = nc.sid;
        reg.init.emplace();
        reg.init->rid = c.rid;
        reg.init->index = nc.index;
        reg.init->arrival_ns = c.arrival_ns;
        reg.init->delivery = c.delivery;
        reg.init->spec = c.spec;
        emit(std::move(reg));
        if (!s.ok()) {
          // Checked at add_request already; only a race with the engine turning unhealthy.
          LoopEvent ev;
          ev.sid = nc.sid;
          ev.final = true;
          ev.finish = OutputFinish::kError;
          ev.error = s;
          ev.finished_ns = now;
          emit(std::move(ev));
          choices.erase(nc.sid);
          base::MutexLock l(mu);
          count_finish(OutputFinish::kError, 1);
        }
      }
      break;
    }
    case Command::kAbort:
      for (const auto& [sid, ch] : choices) {
        if (ch.rid == c.rid) (void)scheduler->abort(sid);  // NOT_FOUND: already finishing
      }
      break;
    case Command::kStop:
      (void)scheduler->stop(c.sid, c.keep);  // NOT_FOUND: it finished meanwhile
      break;
    case Command::kAbortChoice:
      (void)scheduler->abort(c.sid);
      break;
    case Command::kResetPrefixCache:
      scheduler->reset_prefix_cache();
      break;
  }
}

void LlmEngine::Impl::fail_all_live(const absl::Status& cause) {
  for (uint64_t sid : scheduler->live_ids()) (void)scheduler->fail(sid, cause);
}

bool LlmEngine::Impl::submit_one() {
  std::optional<StepPlan> plan = scheduler->schedule();
  if (!plan.has_value()) return false;
  const int64_t now = base::now_ns();
  std::vector<RowInput> inputs(plan->rows.size());
  for (size_t i = 0; i < plan->rows.size(); ++i) {
    const StepRow& row = plan->rows[i];
    Choice& ch = choices.at(row.request_id);
    if (ch.scheduled_ns == 0) ch.scheduled_ns = now;
    // A table that is not an extension of the previous one: preempted and re-admitted.
    if (row.block_table.size() < ch.pages.size() ||
        !std::equal(ch.pages.begin(), ch.pages.end(), row.block_table.begin())) {
      ch.page_steps.clear();
    }
    ch.page_steps.resize(std::min(ch.page_steps.size(), row.block_table.size()));
    while (ch.page_steps.size() < row.block_table.size()) ch.page_steps.push_back(plan->step_id);
    ch.pages = row.block_table;
    ch.last_step = plan->step_id;
    RowInput& in = inputs[i];
    in.tokens = &ch.tokens;
    in.prompt_len = ch.prompt_len;
    in.params = &ch.params;
    in.choice = ch.index;
    in.prompt_logprobs = std::max(ch.prompt_logprobs, 0);
    if (row.logits && ch.matcher.has_value()) {
      fill_grammar_mask(ch);
      in.mask = &ch.mask;
    }
    if (row.logits) {
      const int64_t out_index = row.start + row.len - ch.prompt_len;
      in.want_logits =
          ch.spec->hooks != nullptr && ch.spec->hooks->logits_tokens.count(out_index) > 0;
    }
  }
  InFlight f;
  f.step_id = plan->step_id;
  f.in_flight_at_submit = static_cast<int64_t>(in_flight.size()) + 1;
  absl::StatusOr<std::unique_ptr<StepInFlight>> st = runner->submit(*plan, inputs);
  if (st.ok()) {
    f.step = *std::move(st);
  } else {
    f.submit_error = st.status();
  }
  f.plan = *std::move(plan);
  int64_t prompt_tokens = 0;
  for (const StepRow& row : f.plan.rows) prompt_tokens += row.prefill ? row.len : 0;
  {
    base::MutexLock l(mu);
    metrics.prompt_tokens_total += prompt_tokens;
    ++metrics.steps_total;
  }
  in_flight.push_back(std::move(f));
  return true;
}

const grammar::TokenIndex& LlmEngine::Impl::token_index() {
  if (!token_trie.has_value()) {
    const int32_t vocab = engine->dims().vocab_size;
    token_bytes.resize(vocab);
    for (int32_t id = 0; id < vocab; ++id) {
      token_bytes[id] = options.tokenizer->decode_bytes(std::span<const int32_t>(&id, 1), true);
    }
    token_trie.emplace(token_bytes);
  }
  return *token_trie;
}

void LlmEngine::Impl::fill_grammar_mask(Choice& ch) {
  const grammar::TokenIndex& index = token_index();  // built once, not counted as mask time
  const int64_t t0 = base::now_ns();
  const grammar::Grammar* g = ch.spec->sampling.grammar.get();
  auto key = std::make_pair(g, ch.matcher->stacks());
  if (auto it = mask_cache.find(key); it != mask_cache.end()) {
    ch.mask = it->second;
  } else {
    ch.mask.assign(static_cast<size_t>(index.mask_words()), 0);
    index.fill_mask(*ch.matcher, ch.mask.data());
    if (mask_cache.size() >= kMaskCacheEntries) {
      mask_cache.clear();
      mask_grammars.clear();
    }
    mask_grammars.emplace(g, ch.spec->sampling.grammar);
    mask_cache.emplace(std::move(key), ch.mask);
  }
  if (ch.matcher->complete()) {
    for (int32_t id : ch.params.stop_ids) {
      if (id >= 0) ch.mask[id >> 5] |= uint32_t{1} << (id & 31);
    }
  }
  base::MutexLock l(mu);
  metrics.grammar_mask_time_s.observe((base::now_ns() - t0) / 1e9);
}

void LlmEngine::Impl::advance_grammar(uint64_t sid, Choice& ch, int32_t token) {
  const bool stop_id = std::find(std::begin(ch.params.stop_ids), std::end(ch.params.stop_ids),
                                 token) != std::end(ch.params.stop_ids);
  if (stop_id && ch.matcher->complete()) return;  // the end of a complete output
  const std::string& bytes = token_bytes[token];
  if (bytes.empty() || !ch.matcher->advance(bytes)) {
    // The mask allowed only tokens the grammar accepts: a sampler that ignored it.
    (void)scheduler->fail(sid, absl::InternalError(absl::StrCat(
                                   "the sampled token ", token,
                                   " is outside the grammar's mask (structured output)")));
    return;
  }
  if (ch.matcher->complete() && !ch.matcher->can_continue()) {
    (void)scheduler->stop(sid, static_cast<int64_t>(ch.tokens.size()) - ch.prompt_len);
  }
}

absl::Status LlmEngine::Impl::wait_step(const InFlight& f, std::vector<RowSample>& samples) {
  if (!f.step) return f.submit_error;
  SIMPLER_RETURN_IF_ERROR(f.step->handle().wait());
  SIMPLER_ASSIGN_OR_RETURN(samples, runner->collect(*f.step));
  return absl::OkStatus();
}

void LlmEngine::Impl::dump_kv(const InFlight& f, std::unordered_map<uint64_t, LoopEvent>& events) {
  for (const StepRow& row : f.plan.rows) {
    auto it = choices.find(row.request_id);
    if (it == choices.end() || it->second.spec->hooks == nullptr) continue;
    const std::set<int64_t>& positions = it->second.spec->hooks->kv_positions;
    if (positions.empty()) continue;
    for (int64_t k = 0; k < row.len; ++k) {
      const int64_t pos = row.start + k;
      if (positions.count(pos) == 0) continue;
      auto kv = runner->read_kv(row.slots[k]);
      if (kv.ok()) events[row.request_id].kv[pos] = *std::move(kv);
    }
  }
}

std::vector<AcceptedSample> LlmEngine::Impl::retire_rows(const InFlight& f,
                                                         const std::vector<RowSample>& samples) {
  std::vector<RowResult> results(f.plan.rows.size());
  for (const RowSample& s : samples) {
    const StepRow& row = f.plan.rows[s.row];
    const auto it = choices.find(row.request_id);
    results[s.row].token = s.sample.id;
    if (it != choices.end()) {
      const int64_t generated = row.start + row.len - it->second.prompt_len + 1;
      results[s.row].stop = stops_on(it->second.params, s.sample.id, generated);
    }
  }
  absl::StatusOr<std::vector<AcceptedSample>> accepted =
      scheduler->on_step_retired(f.step_id, results);
  if (!accepted.ok()) {
    SIMPLER_LOG_ERROR("engine: retiring step {}: {}", f.step_id, accepted.status().ToString());
    std::abort();  // the loop's own bookkeeping is broken
  }
  return *std::move(accepted);
}

void LlmEngine::Impl::accept(const Choice& ch, const AcceptedSample& a, const RowSample* s,
                             LoopEvent& ev) {
  ev.tokens.push_back(a.token);
  if (s == nullptr) return;
  if (ch.params.logprobs >= 0) {
    TokenLogprob lp;
    lp.logprob = s->sample.logprob;
    for (int k = 0; k < ch.params.logprobs; ++k) {
      // A token a grammar's mask ruled out has no probability: it is no alternative, and -inf is
      // no JSON number.
      if (s->sample.top_ids[k] >= 0 && std::isfinite(s->sample.top_logprobs[k])) {
        lp.top.emplace_back(s->sample.top_ids[k], s->sample.top_logprobs[k]);
      }
    }
    ev.logprobs.push_back(std::move(lp));
  }
  if (!s->logits.empty()) ev.logits[a.index] = s->logits;
}

void LlmEngine::Impl::accept_samples(const InFlight& f, const std::vector<RowSample>& samples,
                                     int64_t now, std::unordered_map<uint64_t, LoopEvent>& events) {
  // Samples in row order; `samples` is in logit-row order, which is row order too.
  size_t si = 0;
  for (const AcceptedSample& a : retire_rows(f, samples)) {
    while (si < samples.size() && samples[si].row != a.row) ++si;
    Choice& ch = choices.at(a.request_id);
    ch.tokens.push_back(a.token);
    if (ch.matcher.has_value()) advance_grammar(a.request_id, ch, a.token);
    LoopEvent& ev = events[a.request_id];
    ev.times.push_back(now);
    accept(ch, a, si < samples.size() ? &samples[si] : nullptr, ev);
    ev.ends_on_stop_token = a.stop;  // retire_rows' stops_on
    if (a.index == 0 && ch.prompt_logprobs >= 0 && !ch.prompt_scores_sent) {
      ev.prompt_logprobs = std::move(ch.prompt_scores);
      ch.prompt_scores = {};
      ch.prompt_scores_sent = true;
    }
    base::MutexLock l(mu);
    ++metrics.generation_tokens_total;
    if (ch.first_token_ns == 0) {
      ch.first_token_ns = now;
      metrics.time_to_first_token_s.observe((now - ch.arrival_ns) / 1e9);
    } else {
      metrics.inter_token_latency_s.observe((now - ch.last_token_ns) / 1e9);
    }
    ch.last_token_ns = now;
  }
}

void LlmEngine::Impl::store_prompt_logprobs(const InFlight& f) {
  // Rows of a request preempted since the step was planned score the same tokens against the
  // same logits (its pages stayed fenced behind the step), so any row's scores are kept.
  for (const PromptLogprob& p : f.step->prompt_logprobs()) {
    auto it = choices.find(f.plan.rows[p.row].request_id);
    if (it == choices.end() || it->second.prompt_scores_sent) continue;
    Choice& ch = it->second;
    TokenLogprob lp;
    lp.logprob = p.score.logprob;
    for (int k = 0; k < ch.prompt_logprobs; ++k) {
      if (p.score.top_ids[k] >= 0) lp.top.emplace_back(p.score.top_ids[k], p.score.top_logprobs[k]);
    }
    ch.prompt_scores[static_cast<size_t>(p.position + 1)] = std::move(lp);
  }
}

void LlmEngine::Impl::fail_step(const InFlight& f, const absl::Status& status) {
  const bool fatal = base::is_unrecoverable(status);
  absl::Status s = scheduler->on_step_failed(
      f.step_id, fatal ? StepFailure::kUnrecoverable : StepFailure::kRecoverable, status);
  if (!s.ok()) {
    SIMPLER_LOG_ERROR("engine: failing step {}: {}", f.step_id, s.ToString());
    std::abort();
  }
  if (fatal && !closing) {
    base::MutexLock l(mu);
    if (unhealthy.ok()) {
      unhealthy = status;
      // The code and message, not ToString(): its payloads ([simpler/unrecoverable='1']) are
      // the runtime's bookkeeping, not news to whoever reads the log.
      SIMPLER_LOG_ERROR("engine: unrecoverable failure, the engine is unhealthy: {}: {}",
                        absl::StatusCodeToString(status.code()), std::string(status.message()));
    }
  }
}

void LlmEngine::Impl::record_step(const InFlight& f, int64_t now) {
  metrics.step_time_s.observe(f.step ? (now - f.step->submit_ns()) / 1e9 : 0);
  metrics.rows_per_step.observe(static_cast<double>(f.plan.rows.size()));
  metrics.tokens_per_step.observe(static_cast<double>(f.plan.num_tokens()));
  if (!options.record_steps) return;
  StepRecord r;
  r.step_id = f.step_id;
  r.rows = static_cast<int64_t>(f.plan.rows.size());
  r.tokens = f.plan.num_tokens();
  for (const StepRow& row : f.plan.rows) r.logit_rows += row.logits ? 1 : 0;
  r.retire_ns = now;
  r.in_flight_at_submit = f.in_flight_at_submit;
  if (f.step) {
    r.submit_ns = f.step->submit_ns();
    if (f.step->handle().done()) {
      const worker::RunResult& rr = f.step->handle().result();
      r.device_start_ns = rr.timing.device_start_ns;
      r.device_end_ns = rr.timing.device_end_ns;
      r.effective_depth = rr.effective_depth;
      r.prepare_ns = rr.timing.prepare_end_ns - rr.timing.prepare_start_ns;
      r.tasks = rr.report.tasks_submitted;
    }
  }
  step_records.push_back(r);
}

void LlmEngine::Impl::retire_front() {
  InFlight f = std::move(in_flight.front());
  in_flight.pop_front();
  const int64_t now = base::now_ns();
  std::vector<RowSample> samples;
  const absl::Status status = wait_step(f, samples);
  std::unordered_map<uint64_t, LoopEvent> events;
  if (status.ok()) {
    dump_kv(f, events);  // first: the rows' pages are still held or fenced behind this step
    store_prompt_logprobs(f);
    accept_samples(f, samples, now, events);
  } else {
    fail_step(f, status);
  }
  for (auto& [sid, ev] : events) {
    ev.sid = sid;
    emit(std::move(ev));
  }
  base::MutexLock l(mu);
  record_step(f, now);
}

// Final events of the choices the scheduler finished, sent after the gauges
// are refreshed: a consumer holding a final event sees metrics (running,
// waiting, pages, the waiting count add_request checks) without it.
void LlmEngine::Impl::publish_finished(int64_t now) {
  std::vector<LoopEvent> finals;
  for (FinishedRequest& fr : scheduler->take_finished()) {
    auto it = choices.find(fr.id);
    if (it == choices.end()) continue;
    Choice& ch = it->second;
    LoopEvent ev;
    ev.sid = fr.id;
    ev.final = true;
    ev.finish = to_output(fr.reason);
    ev.error = fr.error;
    ev.completion_tokens = static_cast<int64_t>(fr.output_tokens.size());
    ev.cached_tokens = fr.cached_tokens;
    ev.scheduled_ns = ch.scheduled_ns;
    ev.first_token_ns = ch.first_token_ns;
    ev.finished_ns = now;
    ev.pages = ch.pages;
    ev.page_steps = ch.page_steps;
    ev.last_step = ch.last_step;
    {
      base::MutexLock l(mu);
      count_finish(ev.finish, 1);
      metrics.e2e_request_latency_s.observe((now - ch.arrival_ns) / 1e9);
      if (ch.scheduled_ns != 0) {
        metrics.request_queue_time_s.observe((ch.scheduled_ns - ch.arrival_ns) / 1e9);
      }
    }
    finals.push_back(std::move(ev));
    choices.erase(it);
  }
  refresh_gauges();
  for (LoopEvent& ev : finals) emit(std::move(ev));
}

// The scheduler's gauges into the metrics. A newly scheduled choice leaves
// the waiting count when first scheduled.
void LlmEngine::Impl::refresh_gauges() {
  base::MutexLock l(mu);
  const SchedulerSnapshot snap = scheduler->snapshot();
  metrics.requests_waiting = snap.waiting;
  metrics.requests_running = snap.running;
  metrics.preemptions_total = snap.preempted_total;
  metrics.kv_pages = snap.pages;
  metrics.prefix_cache_queries_total = snap.prefix_cache_queries;
  metrics.prefix_cache_hits_total = snap.prefix_cache_hits;
  metrics.kv_pages_cached = snap.cached_pages;
  int64_t never_scheduled = 0;
  for (const auto& [sid, ch] : choices) never_scheduled += ch.scheduled_ns == 0 ? 1 : 0;
  int64_t inbox_adds = 0;
  for (const Command& c : inbox) {
    if (c.kind == Command::kAdd) inbox_adds += static_cast<int64_t>(c.choices.size());
  }
  waiting_choices = never_scheduled + inbox_adds;
  if (check_invariants.load() && invariant_violation.ok()) {
    invariant_violation = scheduler->check_invariants();
  }
}

void LlmEngine::Impl::loop() {
  const int32_t depth =
      options.runner.host_sampling ? 1 : std::max(1, options.runner.worker.launch_depth);
  while (true) {
    std::deque<Command> cmds;
    bool draining_now = false, drain_expired = false;
    {
      base::MutexLock l(mu);
      if (inbox.empty() && in_flight.empty() && !draining && scheduler->live_ids().empty()) {
        inbox_cv.wait_until(l, in_ms(50));
      }
      cmds.swap(inbox);
      draining_now = draining;
      drain_expired = draining && drain_deadline.expired();
    }
    for (Command& c : cmds) apply(c);
    absl::Status cause;
    {
      base::MutexLock l(mu);
      cause = unhealthy;
    }
    if (!cause.ok()) fail_all_live(cause);
    if (drain_expired) {
      for (uint64_t sid : scheduler->live_ids()) (void)scheduler->abort(sid);
    }
    // Submit while the launch depth allows (early enqueue).
    while (cause.ok() && static_cast<int32_t>(in_flight.size()) < depth && submit_one()) {
    }
    publish_finished(base::now_ns());  // refreshes the gauges
    if (in_flight.empty()) {
      if (draining_now && scheduler->live_ids().empty()) break;
      if (draining_now && !cause.ok()) break;
      continue;
    }
    InFlight& front = in_flight.front();
    bool done = true;
    if (front.step) {
      bool inbox_busy = false;
      {
        base::MutexLock l(mu);
        inbox_busy = !inbox.empty();
      }
      // Wait for the oldest step briefly, looking at the inbox in between;
      // after the drain deadline, not at all for a step the device never
      // finishes (shutdown then cancels it through the Worker's close).
      if (drain_expired) {
        // Every request is aborted; steps in flight get a grace to finish
        // (a few step times) before the close cancels them.
        if (cancel_at_ns == 0) cancel_at_ns = base::now_ns() + 2'000'000'000;
        done = front.step->handle().wait(0.005).ok() || front.step->handle().done();
        if (!done && base::now_ns() >= cancel_at_ns) break;
      } else {
        done = front.step->handle().wait(inbox_busy ? -1.0 : 0.002).ok() ||
               front.step->handle().done();
      }
    }
    if (!done) continue;
    retire_front();
    publish_finished(base::now_ns());
  }
  // Leaving: every live request ends (abort), steps still in flight are
  // cancelled by the runner's close and released with this thread's state.
  for (uint64_t sid : scheduler->live_ids()) (void)scheduler->abort(sid);
  while (!in_flight.empty() &&
         (!in_flight.front().step || in_flight.front().step->handle().done())) {
    retire_front();
  }
  if (!in_flight.empty()) {
    // Steps the device did not finish by the drain deadline: cancel them
    // (bounded close), then retire them in order.
    closing = true;
    (void)runner->close(base::Deadline::poll());
    while (!in_flight.empty()) retire_front();
  }
  publish_finished(base::now_ns());  // the final page states (freed, or quarantined by the close)
  base::MutexLock l(out_mu);
  out_done = true;
  out_cv.notify_one();
}

// ---- the output processor ----------------------------------------------------------------

void LlmEngine::Impl::deliver(OutChoice& oc, RequestOutput out) {
  Delivery& d = *oc.delivery;
  if (out.finished()) {
    base::MutexLock dl(d.mu);
    --d.open_choices;
  }
  if (d.callback) {
    oc.delivered_tokens += static_cast<int64_t>(out.token_ids.size());
    d.callback(out);
    if (out.finished()) {
      base::MutexLock l(mu);
      base::MutexLock dl(d.mu);
      if (--d.unread_finals == 0) deliveries.erase(oc.rid);
    }
    return;
  }
  bool overflow = false;
  {
    base::MutexLock dl(d.mu);
    if (!out.finished() && static_cast<int64_t>(d.queue.size()) >= options.max_buffered_outputs) {
      overflow = true;
    } else {
      oc.delivered_tokens += static_cast<int64_t>(out.token_ids.size());
      d.queue.push_back(std::move(out));
      d.cv.notify_all();
    }
  }
  if (overflow && !oc.overflowed) {
    oc.overflowed = true;
    Command c;
    c.kind = Command::kAbortChoice;
    c.sid = oc.sid;
    post(std::move(c));
  }
}

void LlmEngine::Impl::count_finish(OutputFinish finish, int64_t delta) {
  switch (finish) {
    case OutputFinish::kStop:
      metrics.requests_finished_stop += delta;
      break;
    case OutputFinish::kLength:
      metrics.requests_finished_length += delta;
      break;
    case OutputFinish::kAbort:
      metrics.requests_finished_abort += delta;
      break;
    case OutputFinish::kError:
      metrics.requests_finished_error += delta;
      break;
    case OutputFinish::kNone:
      break;
  }
}

// Registration: the first event of every choice (see apply()).
void LlmEngine::Impl::register_choice(const LoopEvent& ev) {
  OutChoice oc;
  oc.sid = ev.sid;
  oc.rid = ev.init->rid;
  oc.index = ev.init->index;
  oc.arrival_ns = ev.init->arrival_ns;
  oc.delivery = ev.init->delivery;
  oc.spec = ev.init->spec;
  if (options.tokenizer != nullptr) {
    oc.detok.emplace(options.tokenizer);
    if (!oc.spec->sampling.stop.empty()) {
      auto m = StopStringMatcher::create(oc.spec->sampling.stop);
      if (m.ok()) oc.stops.emplace(*std::move(m));  // checked at add_request
    }
  }
  out_choices.emplace(ev.sid, std::move(oc));
}

bool LlmEngine::Impl::push_text(OutChoice& oc, const std::string& delta, RequestOutput& out) {
  if (!oc.stops) {
    out.text += delta;
    return false;
  }
  const int64_t min_tokens = oc.spec->sampling.min_tokens;
  StopStringMatcher::Result r = oc.stops->push(delta, oc.generated >= min_tokens);
  out.text += r.text;
  if (!r.stopped) return false;
  oc.stop_matched = true;
  oc.keep = oc.generated;
  return true;
}

std::shared_ptr<OutputHooks> LlmEngine::Impl::fold_tokens(OutChoice& oc, LoopEvent& ev,
                                                          RequestOutput& out) {
  if (oc.stop_matched || oc.overflowed) return nullptr;
  out.prompt_logprobs = std::move(ev.prompt_logprobs);
  for (size_t k = 0; k < ev.tokens.size(); ++k) {
    ++oc.generated;
    out.token_ids.push_back(ev.tokens[k]);
    if (k < ev.logprobs.size()) out.logprobs.push_back(ev.logprobs[k]);
    if (k < ev.times.size()) out.token_times_ns.push_back(ev.times[k]);
    if (ev.ends_on_stop_token && k + 1 == ev.tokens.size()) break;  // its text is not output
    if (oc.detok &&
        push_text(oc, oc.detok->push(std::span<const int32_t>(&ev.tokens[k], 1)), out)) {
      Command c;
      c.kind = Command::kStop;
      c.sid = ev.sid;
      c.keep = oc.keep;
      post(std::move(c));
      break;
    }
  }
  if (oc.spec->hooks == nullptr || (ev.logits.empty() && ev.kv.empty())) return nullptr;
  auto hooks = std::make_shared<OutputHooks>();
  hooks->logits = std::move(ev.logits);
  hooks->kv = std::move(ev.kv);
  return hooks;
}

void LlmEngine::Impl::finish_output(OutChoice& oc, LoopEvent& ev, RequestOutput& out,
                                    std::shared_ptr<OutputHooks> hooks) {
  if (oc.overflowed) {
    // An event of this choice was dropped: whatever ended it in the loop
    // (the abort the overflow asked for, or its own end reached first), its
    // consumer lacks tokens. It ends as that abort, counting the tokens it
    // delivered.
    out.finish = OutputFinish::kAbort;
    out.error = absl::ResourceExhaustedError(absl::StrCat(
        "request ", oc.rid, " choice ", oc.index, " aborted: its consumer fell behind by ",
        options.max_buffered_outputs, " undelivered outputs (max_buffered_outputs)"));
    out.completion_tokens = oc.delivered_tokens;
  } else {
    if (oc.detok && !oc.stop_matched) {
      if (!push_text(oc, oc.detok->finish(), out) && oc.stops) out.text += oc.stops->finish();
    }
    // A matched stop string decides, whatever the loop ended the choice
    // with meanwhile (its tokens past the stop were dropped).
    out.finish = oc.stop_matched ? OutputFinish::kStop : ev.finish;
    out.error = oc.stop_matched ? absl::OkStatus() : ev.error;
    out.completion_tokens = oc.stop_matched ? oc.keep : ev.completion_tokens;
  }
  out.prompt_tokens = static_cast<int64_t>(oc.spec->prompt_ids.size());
  out.cached_tokens = ev.cached_tokens;
  out.arrival_ns = oc.arrival_ns;
  out.scheduled_ns = ev.scheduled_ns;
  out.first_token_ns = ev.first_token_ns;
  out.finished_ns = ev.finished_ns;
  if (oc.spec->hooks != nullptr) {
    if (hooks == nullptr) hooks = std::make_shared<OutputHooks>();
    hooks->pages = std::move(ev.pages);
    hooks->page_steps = std::move(ev.page_steps);
    hooks->last_step = ev.last_step;
  }
  out.hooks = std::move(hooks);
  if (out.finish != ev.finish) {
    // The loop counted its own reason; the event's decides (before the
    // consumer can see it).
    base::MutexLock l(mu);
    count_finish(ev.finish, -1);
    count_finish(out.finish, 1);
  }
}

void LlmEngine::Impl::handle_event(LoopEvent& ev) {
  if (ev.init.has_value()) return register_choice(ev);
  auto it = out_choices.find(ev.sid);
  if (it == out_choices.end()) return;  // a choice already finalized
  OutChoice& oc = it->second;
  RequestOutput out;
  out.id = oc.rid;
  out.index = oc.index;
  out.caller_id = oc.delivery->caller_id;
  std::shared_ptr<OutputHooks> hooks = fold_tokens(oc, ev, out);  // RequestSpec::hooks
  if (ev.final) {
    finish_output(oc, ev, out, std::move(hooks));
    deliver(oc, std::move(out));
    out_choices.erase(it);
    return;
  }
  if (out.token_ids.empty() && out.text.empty() && hooks == nullptr) return;
  out.hooks = std::move(hooks);
  deliver(oc, std::move(out));
}

void LlmEngine::Impl::output_loop() {
  while (true) {
    std::deque<LoopEvent> batch;
    bool done = false;
    {
      base::MutexLock l(out_mu);
      while (outbox.empty() && !out_done) out_cv.wait(l);
      batch.swap(outbox);
      done = out_done;
    }
    for (LoopEvent& ev : batch) handle_event(ev);
    if (done) {
      base::MutexLock l(out_mu);
      if (outbox.empty()) break;
    }
  }
}

}  // namespace simpler::llm
