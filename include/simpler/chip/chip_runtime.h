// Executes one run on one device: orchestration context, TensorMap
// dependency inference, a bounded task ring with backpressure, dispatch of
// ready task blocks to the device's cores, and per-task error attribution.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "simpler/device/device.h"
#include "simpler/task/callable.h"

namespace simpler::chip {

// Limits of the task ring.
struct ChipOptions {
  // Tasks that may be submitted but not yet retired. When the ring is full,
  // orchestration waits for the oldest tasks to finish (backpressure).
  uint32_t ring_capacity = 4096;
  // Arguments one ring slot holds. A task with more can never fit: its run
  // fails at once with RESOURCE_EXHAUSTED.
  uint32_t max_task_args = 32;
  // Largest block_dim of one task.
  int32_t max_block_dim = 65536;

  // INVALID_ARGUMENT naming the field when a limit is 0.
  absl::Status validate() const;
};

// Device timestamps of one task (steady-clock ns; first block start, last
// block end) and the core that ran its block 0.
struct TaskTiming {
  uint32_t task = 0;
  uint32_t kernel = 0;
  int32_t core = 0;
  int32_t block_dim = 1;
  int64_t start_ns = 0;
  int64_t end_ns = 0;
};

// What one executed run reports besides its status. Written by the device
// thread executing the run; read by the host after the launch record's event.
struct RunReport {
  uint64_t tasks_submitted = 0;
  uint64_t tasks_completed = 0;
  std::vector<TaskTiming> tasks;  // filled when `record_task_timing`
};

// Executes `callable` with `args` (already resolved to device tensors) on the
// device behind `ctx`: runs the orchestration function, which submits tasks
// (device-built graph), and dispatches them until all finished or one failed.
// Uses at most `max_cores` cores (0 = all).
//
// Errors: the orchestration's own error, a submit-time error (bad kernel, bad
// args, tensor outside any live allocation, a task that can never fit), or the
// first task error, as "run R task T (kernel 'K'): <cause>" keeping the
// cause's code and its unrecoverable mark. On error no new task is dispatched;
// blocks already running are drained before returning.
absl::Status execute_run(device::ExecContext& ctx, const task::ChipCallable& callable,
                         const task::TaskArgs& args, const ChipOptions& options,
                         int32_t max_cores, bool record_task_timing, RunReport* report);

}  // namespace simpler::chip
