// LlmDataParallel: one LlmEngine per child of an L3 worker (vLLM's data_parallel_size;
// docs/design/l3_hierarchy.md). Every child loads the whole model into its own device memory in
// a child setup (in the child process in process mode); each engine has its own scheduler and
// KV pool on its child and submits each step as an L3 run on it. Requests are split between the
// engines by the caller, and a request's tokens do not depend on the chip it ran on. Use:
//   L3Worker l3(options);                                   // device_ids: one child per chip
//   auto dp = LlmDataParallel::prepare(l3, model_dir, engine_options.runner);  // before init()
//   l3.init();                                              // children load the model
//   auto e0 = (*dp)->create_engine(0, engine_options);     // one engine per child
// The L3 worker must outlive the engines. Thread safety: prepare and create_engine from one
// thread; each engine as LlmEngine.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "simpler/engine/llm_engine.h"
#include "simpler/engine/runner_options.h"
#include "simpler/hierarchy/l3_worker.h"

namespace simpler::llm {

class Qwen3DataParallel;

class LlmDataParallel {
 public:
  // Before l3.init(): checks the options and the checkpoint here (errors as LlmEngine::create's,
  // naming the file or tensor, before any child starts) and registers the step program and the
  // child setup that loads the model on every child. Errors of the L3 worker's registration
  // (FAILED_PRECONDITION after its init()) as they are.
  static absl::StatusOr<std::unique_ptr<LlmDataParallel>> prepare(hierarchy::L3Worker& l3,
                                                                  const std::string& model_dir,
                                                                  const RunnerOptions& options);
  // After l3.init(): an engine whose steps run on child `child`; options.runner must be the
  // options given to prepare (INVALID_ARGUMENT otherwise, as LlmEngine::create's). INVALID_ARGUMENT
  // for a child outside [0, num_children); FAILED_PRECONDITION before init(). A child whose setup
  // failed (a process child) fails each step naming the child and the error.
  absl::StatusOr<std::unique_ptr<LlmEngine>> create_engine(int32_t child,
                                                           const EngineOptions& options);
  int32_t num_children() const;
  // Why options.capture was turned off (steps on L3 children run uncaptured: capture keys do not
  // cross the L3 mailbox), empty when it was not asked for. prepare sets it and logs it once;
  // capture on is never an error here. The reference lives as long as this object; read it after
  // prepare, not while another thread runs prepare.
  const std::string& capture_off_reason() const;
  ~LlmDataParallel();

 private:
  LlmDataParallel() = default;
  std::unique_ptr<Qwen3DataParallel> dp_;
};

}  // namespace simpler::llm
