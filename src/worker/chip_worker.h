// ChipWorker: one chip — device, stream, run lane and run resources. Private to the runtime; the
// public Worker owns one at level 2.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "simpler/base/clock.h"
#include "simpler/device/device.h"
#include "simpler/task/callable.h"
#include "simpler/worker/worker.h"
#include "worker/chip_run_lane.h"
#include "worker/run_resource_arena.h"

namespace simpler::worker {

// One chip: device, stream, run lane and run resources. Owned by a level-2
// Worker. Thread-safe after init().
class ChipWorker {
 public:
  explicit ChipWorker(WorkerOptions options) : options_(std::move(options)) {}
  ~ChipWorker();
  // `callables` must outlive the ChipWorker (or be kept, see close()).
  absl::Status init(const std::vector<std::shared_ptr<const task::ChipCallable>>* callables);
  device::Device& device() { return *device_; }
  ChipRunLane& lane() { return *lane_; }
  RunResourceArena& arena() { return *arena_; }
  // Drains the lane (bounded by `deadline`, see ChipRunLane::close) and closes
  // the device. When the device had to abandon threads stuck in kernels, the
  // device, the arena (the run records those threads read) and the callables
  // are kept until the process exits (base::keep_until_exit).
  absl::Status close(const base::Deadline& deadline = base::Deadline::forever());
  int32_t abandoned_threads() const { return abandoned_; }

 private:
  WorkerOptions options_;
  const std::vector<std::shared_ptr<const task::ChipCallable>>* callables_ = nullptr;
  int32_t abandoned_ = 0;
  std::shared_ptr<device::Device> device_;
  device::Stream* stream_ = nullptr;
  std::shared_ptr<RunResourceArena> arena_;
  std::unique_ptr<ChipRunLane> lane_;
  bool closed_ = false;
};

}  // namespace simpler::worker
