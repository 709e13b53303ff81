// Qwen3Engine: a Qwen3 model on a Worker, decoding batches of requests through
// a paged KV cache. Each decode step is one run of the decode program
// (qwen3_program.h) for the whole batch; prompts go through the same decode
// path one position per step (the LM head is computed only at rows that need
// logits: a request's last prompt position and its decode positions).
//
// Device-side token feedback: a step reads the previous step's sampled tokens
// from device memory (a token_feedback task in front of the program, a
// token_save task behind it), so step t+1 is submitted before step t
// completes and up to launch_depth steps are in flight. The host reads tokens
// behind the device; a request that hit a stop id is found up to depth-1
// steps late and the extra tokens are discarded (its pages are released once
// the last step that wrote them was processed).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "simpler/llm/model_config.h"
#include "simpler/llm/qwen3_program.h"
#include "simpler/worker/worker.h"

namespace simpler::llm {

struct EngineOptions {
  worker::WorkerOptions worker;  // device, cores, launch depth, grant, timeout, trace
  int32_t page_size = 16;        // tokens per KV page (> 0)
  // The pool's size is create()'s `num_pages` (see pages_for()).
  // create() refuses a checkpoint holding a tensor the config does not use (a second layer
  // when config.json says one, an lm_head with tied embeddings) unless this is set, for
  // checkpoints with extra heads.
  bool allow_unused_tensors = false;
};

// Per-request output.
struct RequestResult {
  std::vector<int32_t> prompt_ids;
  std::vector<int32_t> tokens;  // generated ids; includes the stop id when one stopped it
  // "stop" (a stop id), "length" (max_new_tokens) or "error" (`status` says why).
  std::string finish_reason;
  // OK, or why the request was refused (RESOURCE_EXHAUSTED: it can never fit
  // the KV pool, naming its pages and the pool's).
  absl::Status status;
  std::vector<int32_t> pages;  // KV pages the request held when it finished
  // Logits (f32 [V]) at requested decode steps (step s picks generated token s).
  std::map<int32_t, std::vector<float>> logits;
  // K and V read back from the page pool at requested positions: [layers][kv_heads·head_dim].
  struct Kv {
    std::vector<std::vector<float>> k, v;
  };
  std::map<int64_t, Kv> kv;
};

struct GenerateOptions {
  int32_t max_new_tokens = 32;  // >= 1
  std::set<int32_t> stop_ids;   // a request stops after generating one of these
  std::set<int32_t> logits_steps;
  std::set<int64_t> kv_positions;
  // Sample on the host (greedy over logits read back every step) instead of
  // feeding the device's sampled tokens to the next step. The next step then
  // needs a host-side value first, so launch falls back to serial (effective
  // depth 1) and a warning says so. Tokens are identical either way.
  bool host_sampling = false;
  // Called after every step with (step, total_steps_upper_bound); on the caller's thread.
  std::function<void(int64_t step, int64_t steps_bound)> progress;
};

struct GenerateStats {
  int64_t steps = 0;          // runs submitted (one per step)
  int64_t prompt_tokens = 0;  // summed over requests
  int64_t generated_tokens = 0;
  double total_ms = 0;
  double prefill_ms = 0;               // until every request produced its first token
  double decode_ms = 0;                // after that
  std::vector<double> step_ms;         // host wall time per step
  std::vector<double> device_step_us;  // device time per step (run start..end)
  int32_t requested_depth = 1;         // the Worker's launch_depth
  double effective_depth = 0;          // mean RunResult::effective_depth over the steps
  // Most steps submitted and not yet read back by the host at once: the
  // launch depth when steps are enqueued before their predecessors' tokens
  // are read (device-side token feedback), 1 with serial launch.
  int32_t max_steps_in_flight = 0;
  bool serial_launch = false;  // host sampling forced serial launch (and a warning)
};

struct GenerateResult {
  std::vector<RequestResult> requests;
  GenerateStats stats;
};

// Owns a Worker with the decode program registered, the model's weights in
// device memory (f32, uploaded once), the scratch activations and the KV page
// pool. Thread-compatible: one thread drives generate().
class Qwen3Engine {
 public:
  // Loads config, weights (converted to f32) and uploads them. `max_batch`
  // requests at most per step; `num_pages` (> 0) pages of options.page_size
  // tokens in the KV pool, allocated once on the device (pages_for() sizes it
  // for a set of requests). Errors name the file and tensor (see
  // ModelWeights; INVALID_ARGUMENT for a tensor the config does not use, see
  // EngineOptions::allow_unused_tensors) or the option (INVALID_ARGUMENT for
  // num_pages <= 0).
  static absl::StatusOr<std::unique_ptr<Qwen3Engine>> create(const std::string& model_dir,
                                                             const EngineOptions& options,
                                                             int32_t max_batch, int32_t num_pages);

  // KV pages needed by `prompts` with `max_new_tokens` each.
  static int32_t pages_for(const std::vector<std::vector<int32_t>>& prompts, int32_t max_new_tokens,
                           int32_t page_size);

  // Decodes every prompt (ids) greedily until a stop id or max_new_tokens, all
  // requests batched per step. INVALID_ARGUMENT for an empty prompt, an id
  // outside the vocabulary, more requests than max_batch, or prompt +
  // max_new_tokens beyond max_position_embeddings. A request that can never
  // fit the page pool alone is refused before any work (its RequestResult's
  // status and finish_reason "error") and the others are served;
  // RESOURCE_EXHAUSTED when requests that fit alone exhaust the pool
  // together. Run errors: the failing step's own error (whichever of its
  // wait or a later submit noticed it first), returned as soon as it is
  // known: steps still in flight are not waited for (the next generate()
  // drains them first; close(deadline) cancels them). After a recoverable
  // error the engine stays usable; after an unrecoverable one (device fault,
  // timeout) its Worker is poisoned and every later generate() fails with
  // that cause.
  absl::StatusOr<GenerateResult> generate(const std::vector<std::vector<int32_t>>& prompts,
                                          const GenerateOptions& options);

  const ModelConfig& config() const { return config_; }
  const Qwen3Dims& dims() const { return dims_; }
  worker::Worker& worker() { return *worker_; }
  // The device buffers the decode program uses without naming them in a
  // run's arguments (weights, scratch, token buffers, KV pool), all bound to
  // it (Worker::bind): none can be freed while the engine lives.
  std::vector<worker::DeviceBuffer> bound_buffers() const;
  // f32 bytes of every weight a decode step streams (projections, norms, LM head).
  uint64_t weight_bytes_per_step() const { return weight_bytes_per_step_; }
  // Closes the Worker (Worker::close(deadline): steps still in flight when
  // the deadline passes are cancelled — the fatal path passes an expired
  // one) and releases what failed generate() calls left in flight. Returns
  // the Worker's close status: after a failed generate() that includes the
  // cancellation of the steps it left in flight (consequences of the error
  // generate() returned). Idempotent.
  absl::Status close(const base::Deadline& deadline = base::Deadline::forever());
  ~Qwen3Engine();

 private:
  Qwen3Engine() = default;
  // Waits for the steps a failed generate() left in flight, then releases
  // their host buffers.
  void drain_orphans();
  ModelConfig config_;
  Qwen3Dims dims_;
  EngineOptions options_;
  int32_t max_batch_ = 0;
  int32_t num_pages_ = 0;
  std::unique_ptr<worker::Worker> worker_;
  worker::CallableHandle decode_;
  std::vector<worker::DeviceBuffer> buffers_;
  worker::DeviceBuffer kv_buffer_;
  worker::DeviceBuffer feed_ids_;  // i32 [max_batch]: the step's input ids (device)
  worker::DeviceBuffer last_ids_;  // i32 [max_batch]: the previous step's sampled ids
  Qwen3KvPools kv_pools_;
  uint64_t weight_bytes_per_step_ = 0;
  struct Holder;
  std::shared_ptr<Holder> holder_;
  // Steps a failed generate() returned without waiting for: their handles and
  // the host buffers they stage into (type-erased), kept until drained.
  struct Orphans {
    std::vector<worker::RunHandle> handles;
    std::shared_ptr<void> owner;
  };
  std::vector<Orphans> orphans_;
};

}  // namespace simpler::llm
