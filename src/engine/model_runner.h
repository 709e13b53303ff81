// Qwen3ModelRunner: the model-runner boundary of the serving engine (vLLM's
// GPUModelRunner shape). The scheduler (scheduler.h) decides which positions
// of which requests run in a step; the runner turns that StepPlan into ONE run
// of the step program on the Worker and, once the run retired, hands back
// each logit row's sampled token. It knows nothing of request policy
// (admission, stops, preemption); the scheduler knows nothing of tensors.
//
// The step program (one ChipCallable, one run per step), in task order:
//   1. token_counts: for rows with fresh_state, clear the request's state
//      slot, then commit its known tokens (prompt ids kPrompt, kept output
//      tokens kGenerated) — sampling.h's per-request token counts;
//   2. token_feedback: input_ids[i] = host_ids[i] for prefill positions
//      (known on the host), last_ids[state_slot] for decode rows: the token
//      the request's previous step sampled, read from device memory, so step
//      t+1 is submitted before step t finished (early enqueue);
//   3. the Qwen3 decode program (qwen3_program.h): all rows' K/V written to
//      their slots, causal paged attention (several positions of one request
//      in one run attend causally within the chunk), logits of logit rows;
//   4. prompt_logprobs: for the prompt positions rows asked logits of (StepRow::prompt_logits;
//      their logit rows come after the sampled rows' and no sampler reads them), score_row of
//      the next prompt token and the row's top alternatives (sampling.h);
//   5. sample (sampling.h) for every sampled logit row with its SamplingParams,
//      position, choice and state slot; then token_counts kGenerated of the
//      sampled ids and token_scatter last_ids[state_slot] = sampled id.
// Dependencies are inferred from the tagged tensors (counts and last_ids are
// INOUT device buffers), so the tasks of one step and of consecutive steps
// are ordered exactly.
//
// Host sampling (RunnerOptions::host_sampling): logits are read back every
// step and the same sample_row math runs on the host with a host copy of the
// token counts; the next step needs those tokens first, so the engine runs
// one step at a time (documented as serial launch). Tokens are identical.
//
// Memory (device): weights (in their checkpoint dtype; norms f32), scratch for
// max_num_batched_tokens rows (logits for max_num_seqs rows: sampled and prompt-scored together),
// the KV pool, token counts i32 [max_num_seqs, V] and last_ids i32 [max_num_seqs]: the chip's
// state. The step program finds them there, not in its arguments; a run carries only host tensors
// and the chip's index. A runner with its own Worker binds them to the step callable
// (Worker::bind): none can be freed while a step may run.
//
// Data parallel over an L3 worker's children (Qwen3DataParallel below; vLLM's
// data_parallel_size): every child loads the whole model into its own device memory in a
// child setup (hierarchy/l3_worker.h: in the child process in process mode), and one runner
// per child submits each step as an L3 run whose one next-level task runs the step program
// on that child. Its host tensors are staged in one buffer of the L3 worker's shared host heap
// per step (freed when the StepInFlight is destroyed). Each runner is driven by its own engine
// (its own scheduler and KV pool on its child): requests are split between them, and a
// request's tokens do not depend on the chip it ran on.
//
// Thread safety: thread-compatible; one thread (the engine loop) drives it.
//
// Private to the engine (src/engine): users reach a runner through LlmEngine and
// LlmDataParallel (simpler/engine/data_parallel.h), its options through
// simpler/engine/runner_options.h.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/scheduler.h"
#include "simpler/engine/runner_options.h"
#include "simpler/hierarchy/l3_worker.h"
#include "simpler/kernels/sampling.h"
#include "simpler/model/model_config.h"
#include "simpler/model/qwen3_program.h"
#include "simpler/model/safetensors.h"
#include "simpler/worker/worker.h"

namespace simpler::llm {

// What the runner needs per row besides the StepRow (request state the
// engine owns). Pointers must stay valid until submit() returns.
struct RowInput {
  // The request's known tokens: prompt ids, then its accepted output tokens
  // (prefill rows read positions [start, start + len) from here; a
  // fresh_state row commits all of them to the token counts).
  const std::vector<int32_t>* tokens = nullptr;
  int64_t prompt_len = 0;
  const SamplingParams* params = nullptr;  // logit rows; validated by the engine
  int32_t choice = 0;                      // clone index (OpenAI `n`), Philox stream
  bool want_logits = false;                // logit row: read its raw logits back (tests, dumps)
  // Logit rows with params->masked: the token mask (mask_words(V) words, sampling.h), read
  // until submit() returns.
  const std::vector<uint32_t>* mask = nullptr;
  // Rows with StepRow::prompt_logits > 0: the top alternatives each of those positions reports,
  // in [0, kMaxLogprobs] (its prompt token's logprob is always reported).
  int32_t prompt_logprobs = 0;
};

// One prompt position a row asked logits of (StepRow::prompt_logits): the prompt token at
// position + 1 scored against the raw logits of `position` (score_row, sampling.h).
struct PromptLogprob {
  size_t row = 0;  // index into StepPlan::rows
  int64_t position = 0;
  SampleResult score;  // id: the token at position + 1; its logprob and top alternatives
};

// One logit row's outcome, in the order of the plan's logit rows.
struct RowSample {
  size_t row = 0;  // index into StepPlan::rows
  SampleResult sample;
  std::vector<float> logits;  // raw logits [V] when RowInput::want_logits
};

class Qwen3ModelRunner;

// A submitted step: its run and the host buffers it stages into, kept alive
// until the run finalized (the handle's destructor waits if it must).
class StepInFlight {
 public:
  ~StepInFlight();
  StepInFlight(const StepInFlight&) = delete;
  StepInFlight& operator=(const StepInFlight&) = delete;
  const worker::RunHandle& handle() const { return handle_; }
  int64_t step_id() const { return step_id_; }
  int64_t submit_ns() const { return submit_ns_; }
  // Positions run: the plan's, and a captured step's padding (Qwen3ModelRunner::pad_to_bucket).
  int64_t num_tokens() const { return static_cast<int64_t>(positions.size()); }
  int64_t num_logit_rows() const { return static_cast<int64_t>(row_of_logit_.size()); }
  // After Qwen3ModelRunner::collect: the prompt positions' logprobs, in row and position order.
  const std::vector<PromptLogprob>& prompt_logprobs() const { return prompt_results_; }

 private:
  friend class Qwen3ModelRunner;
  StepInFlight() = default;
  int64_t step_id_ = 0;
  int64_t submit_ns_ = 0;
  worker::RunHandle handle_;
  // A runner on an L3 child: the shared-heap buffer the run's host tensors live in, OUT
  // tensors copied back from it into the vectors below by collect(), and its release.
  struct CopyBack {
    void* dst;
    const void* src;
    uint64_t bytes;
  };
  std::vector<CopyBack> copy_back_;
  std::function<void()> release_staging_;
  // Host staging (IN) and results (OUT), referenced by the run's tensors.
  std::vector<int32_t> host_ids, src_slots, positions, slot_mapping, block_tables, context_lens,
      logit_rows, clear_slots, prompt_ids, prompt_slots, gen_ids, gen_slots, sample_slots;
  std::vector<SamplingParams> params;
  std::vector<SampleRowInfo> rows;
  std::vector<int32_t> out_ids, top_ids;
  std::vector<float> out_logprobs, top_logprobs, logits;
  std::vector<size_t> row_of_logit_;         // logit j -> plan row
  std::vector<uint8_t> want_logits_;         // per logit row
  std::vector<int32_t> logit_state_slot_;    // per logit row (host sampling)
  std::vector<SamplingParams> host_params_;  // host sampling: per logit row
  std::vector<SampleRowInfo> host_rows_;
  // Token masks: [ns, W] i32 words for the device sampler when a logit row is masked (empty
  // otherwise); per logit row for host sampling (empty: unmasked).
  std::vector<int32_t> masks;
  std::vector<const std::vector<uint32_t>*> mask_src_;
  std::vector<std::vector<uint32_t>> host_masks_;
  bool host_logits_ = false;
  // Prompt positions scored (their logit rows follow the sampled ones): the token each scores,
  // its top alternatives, and the results; (row, position) of each.
  std::vector<int32_t> score_ids, score_k, score_top_ids;
  std::vector<float> score_logprobs, score_top_logprobs;
  std::vector<std::pair<size_t, int64_t>> score_of_;
  std::vector<PromptLogprob> prompt_results_;
};

class Qwen3ModelRunner {
 public:
  // Loads config and weights (converted to f32), creates and initializes the
  // Worker and allocates everything above. INVALID_ARGUMENT naming the option
  // for a non-positive size or max_num_batched_tokens < max_num_seqs; errors
  // of ModelConfig / ModelWeights (naming the file and tensor) and of the
  // Worker (allocation).
  static absl::StatusOr<std::unique_ptr<Qwen3ModelRunner>> create(const std::string& model_dir,
                                                                  const RunnerOptions& options);

  // Submits one run for `plan` (rows as the scheduler made them; inputs[i]
  // belongs to plan.rows[i]). INVALID_ARGUMENT when inputs do not match the
  // rows or a row exceeds the step limits; the Worker's submit errors (e.g.
  // poisoned lane) as they are. With host sampling the previous step must
  // have been collected first, or have finished with an error (it is never
  // collected then); FAILED_PRECONDITION otherwise.
  absl::StatusOr<std::unique_ptr<StepInFlight>> submit(const StepPlan& plan,
                                                       std::span<const RowInput> inputs);

  // After step.handle() finished OK: every logit row's sample, in row order, and the step's
  // prompt_logprobs(). INTERNAL when a sampled id is outside the vocabulary (names the run).
  absl::StatusOr<std::vector<RowSample>> collect(StepInFlight& step);

  // K and V of one KV slot read back from the pool: [layers][kv_heads·head_dim] (tests, dumps).
  // FAILED_PRECONDITION for a runner on an L3 child (the pool is in the child's memory).
  struct Kv {
    std::vector<std::vector<float>> k, v;
  };
  absl::StatusOr<Kv> read_kv(int32_t slot);

  const ModelConfig& config() const { return config_; }
  const Qwen3Dims& dims() const { return dims_; }
  const RunnerOptions& options() const { return options_; }
  // The runner's own Worker; nullptr for a runner on an L3 child (the worker is the child's).
  worker::Worker* worker() { return worker_.get(); }
  // The device buffers the step program uses without naming them in a run's arguments, all
  // bound to the callable (Worker::bind); empty for a runner on an L3 child.
  std::vector<worker::DeviceBuffer> bound_buffers() const;
  // f32 bytes of every weight a step streams (projections, norms, LM head).
  uint64_t weight_bytes_per_step() const { return weight_bytes_per_step_; }
  // Worker::close(deadline). Idempotent. A runner on an L3 child closes nothing (the L3
  // worker is its owner's): its steps in flight finish on the child.
  absl::Status close(const base::Deadline& deadline = base::Deadline::forever());
  ~Qwen3ModelRunner();

  struct Holder;  // the chips' states the step callable reads (model_runner.cc)

 private:
  friend class Qwen3DataParallel;
  Qwen3ModelRunner() = default;
  // Config, dims and the checkpoint's tensor set checked against them; weight bytes per step.
  // Returns the checkpoint's weights, opened once for all of that and the upload.
  absl::StatusOr<ModelWeights> load_model_info(const std::string& model_dir);
  void init_host_sampling();
  // submit()'s steps, in order.
  struct HostArg;
  // FAILED_PRECONDITION while a host-sampling step is neither collected nor failed.
  absl::Status check_host_step_collected();
  // INVALID_ARGUMENT naming the step and row when row i does not fit its input or the limits
  // (prompt logits past the prompt's last position but one, prompt_logprobs outside
  // [0, kMaxLogprobs]).
  absl::Status check_row(const StepPlan& plan, size_t i, const RowInput& in) const;
  // A row that took its state slot: the slot's reset and its known tokens' counts.
  void add_fresh_state(StepInFlight& st, const StepRow& row, const RowInput& in);
  // The row's positions: input ids, slots, context lengths and block tables.
  void add_positions(StepInFlight& st, const StepRow& row, const RowInput& in,
                     int64_t max_blocks) const;
  // The row that samples: its logit row, sampling parameters and row info.
  static void add_logit_row(StepInFlight& st, size_t i, const StepRow& row, const RowInput& in);
  // The row's prompt positions to score (StepRow::prompt_logits) whose positions start at
  // index `first` of the step's; their logit rows are appended by add_score_rows.
  static void add_score_rows(StepInFlight& st, size_t i, const StepRow& row, const RowInput& in,
                             int64_t first, std::vector<int32_t>& logit_rows);
  // collect()'s prompt logprobs into step.prompt_logprobs().
  static void collect_prompt_logprobs(StepInFlight& step);
  // The limits on positions and logit rows; the output vectors sized.
  absl::Status size_outputs(StepInFlight& st, bool any_logits_wanted) const;
  // The run's host tensors, in argument order (see StepArg).
  static std::vector<HostArg> host_args(StepInFlight& s, int64_t max_blocks, int64_t vocab_size);
  // Copies the inputs into one L3 shared-heap buffer and points `args` at it.
  absl::Status stage_on_l3(StepInFlight& s, std::vector<HostArg>& args);
  absl::Status launch(StepInFlight& s, const std::vector<HostArg>& args);
  // Whether the step is captured (RunnerOptions::capture, an own worker, no token-count commits).
  bool captured(const StepInFlight& s) const;
  // A captured step padded to its bucket (rows as vLLM pads them for CUDA graphs): positions up
  // to the next power of two (1, 2, 4, ..., 32, ...), max_num_batched_tokens at most, each padded
  // one with token 0, position 0, slot_mapping -1 (no KV written), context length 0 (attention
  // reads no page: a zero row) and a zero block table `max_blocks` wide; sampled rows likewise up
  // to max_num_seqs - np, each padded one greedy without logprobs, reading the last position, with
  // state slot -1 (no token counts or last_ids read or written). collect() reads only the plan's
  // rows.
  void pad_to_bucket(StepInFlight& st, int64_t max_blocks, int64_t np) const;
  // The capture key of a step with host tensors `args` (0: uncaptured; RunnerOptions::capture).
  uint64_t capture_key(const StepInFlight& s, const std::vector<HostArg>& args);
  ModelConfig config_;
  Qwen3Dims dims_;
  RunnerOptions options_;
  std::unique_ptr<worker::Worker> worker_;  // own worker (nullptr on an L3 child)
  worker::CallableHandle step_;
  std::shared_ptr<Holder> holder_;
  int32_t chip_ = 0;  // index into the holder's chips (the L3 child)
  hierarchy::L3Worker* l3_ = nullptr;
  hierarchy::ProgramHandle l3_step_;
  uint64_t weight_bytes_per_step_ = 0;
  // Host sampling: token counts and last sampled id per state slot.
  std::vector<std::vector<int32_t>> host_counts_;
  std::vector<int32_t> host_last_ids_;
  // RunnerOptions::capture: a key (1, 2, ...) per distinct list of step argument shapes.
  std::map<std::vector<int64_t>, uint64_t> capture_keys_;
  bool host_step_pending_ = false;      // submitted, neither collected nor failed
  worker::RunHandle host_pending_run_;  // its run
};

// Data parallel over the children of an L3 worker (see the header comment). Use:
//   L3Worker l3(options);                      // device_ids: one child per chip
//   auto dp = Qwen3DataParallel::prepare(l3, model_dir, runner_options);   // before init()
//   l3.init();                                 // children load the model in their setup
//   auto r0 = (*dp)->runner(0), r1 = (*dp)->runner(1);                    // one per child
// Thread safety: prepare and runner() from one thread; each runner as Qwen3ModelRunner.
class Qwen3DataParallel {
 public:
  // Before l3.init(): checks the options and the checkpoint here (errors as
  // Qwen3ModelRunner::create's, naming the file or tensor, before any child starts) and registers
  // the step callable, the one-task L3 step program and the child setup that loads the model on
  // every child. The L3 worker must outlive every runner and every StepInFlight they made (a
  // step frees its staging buffer when destroyed). Errors of the L3 worker's registration
  // (FAILED_PRECONDITION after its init()) as they are.
  static absl::StatusOr<std::unique_ptr<Qwen3DataParallel>> prepare(hierarchy::L3Worker& l3,
                                                                    const std::string& model_dir,
                                                                    const RunnerOptions& options);
  // After l3.init(): the runner whose steps run on child `child`. INVALID_ARGUMENT for a child
  // outside [0, num_children); FAILED_PRECONDITION before init(). A child whose setup failed
  // (a process child) fails each step naming the child and the error.
  absl::StatusOr<std::unique_ptr<Qwen3ModelRunner>> runner(int32_t child);
  int32_t num_children() const { return l3_->num_children(); }
  // Why RunnerOptions::capture was turned off (its runners run every step uncaptured, and their
  // options().capture is false), empty when it was not asked for. prepare logs it once.
  const std::string& capture_off_reason() const { return capture_off_reason_; }

 private:
  Qwen3DataParallel() = default;
  hierarchy::L3Worker* l3_ = nullptr;
  std::string model_dir_;
  RunnerOptions options_;
  std::string capture_off_reason_;
  std::shared_ptr<Qwen3ModelRunner::Holder> holder_;
  hierarchy::ProgramHandle program_;
  std::unique_ptr<Qwen3ModelRunner> info_;  // config, dims, weight bytes (checked in prepare)
};

}  // namespace simpler::llm
