// ChipOptions: the limits of the task ring one run executes on (WorkerOptions::chip).
#pragma once

#include <cstdint>

#include "absl/status/status.h"

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
  // Tasks a host-built graph image holds. A run that submits more can never
  // fit its image: it fails at once with RESOURCE_EXHAUSTED.
  uint32_t max_graph_tasks = 1u << 20;

  // INVALID_ARGUMENT naming the field when a limit is 0.
  absl::Status validate() const;
};

}  // namespace simpler::chip
