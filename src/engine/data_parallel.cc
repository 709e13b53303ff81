#include "simpler/engine/data_parallel.h"

#include <utility>

#include "engine/model_runner.h"
#include "simpler/base/status.h"

namespace simpler::llm {

absl::StatusOr<std::unique_ptr<LlmDataParallel>> LlmDataParallel::prepare(
    hierarchy::L3Worker& l3, const std::string& model_dir, const RunnerOptions& options) {
  SIMPLER_ASSIGN_OR_RETURN(std::unique_ptr<Qwen3DataParallel> dp,
                           Qwen3DataParallel::prepare(l3, model_dir, options));
  std::unique_ptr<LlmDataParallel> out(new LlmDataParallel());
  out->dp_ = std::move(dp);
  return out;
}

absl::StatusOr<std::unique_ptr<LlmEngine>> LlmDataParallel::create_engine(
    int32_t child, const EngineOptions& options) {
  SIMPLER_ASSIGN_OR_RETURN(std::unique_ptr<Qwen3ModelRunner> runner, dp_->runner(child));
  return LlmEngine::create(std::move(runner), options);
}

int32_t LlmDataParallel::num_children() const { return dp_->num_children(); }

const std::string& LlmDataParallel::capture_off_reason() const { return dp_->capture_off_reason(); }

LlmDataParallel::~LlmDataParallel() = default;

}  // namespace simpler::llm
