// RunReport: what one executed run reports besides its status (RunResult::report).
#pragma once

#include <cstdint>
#include <vector>

namespace simpler::chip {

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

// Device timestamps of one block of a task (steady-clock ns) and the core that ran it: an SPMD
// task's blocks run on different cores and need not start or end together, which its TaskTiming
// (first start, last end, block 0's core) does not show.
struct BlockTiming {
  uint32_t task = 0;
  uint32_t kernel = 0;
  int32_t block = 0;  // 0 <= block < block_dim
  int32_t block_dim = 1;
  int32_t core = 0;
  int64_t start_ns = 0;
  int64_t end_ns = 0;
};

// What one executed run reports besides its status. Written by the device
// thread executing the run; read by the host after the launch record's event.
struct RunReport {
  // Tasks admitted: the orchestration's submits up to a failure; a device-built replay of a
  // captured graph admits the whole graph at once, so there it is the graph's task count.
  uint64_t tasks_submitted = 0;
  uint64_t tasks_completed = 0;    // finished successfully (every block OK)
  uint64_t tasks_failed = 0;       // finished with an error in some block
  int64_t first_failed_task = -1;  // the first task that finished failed; -1 = none
  std::vector<TaskTiming> tasks;   // filled when `record_task_timing`, in completion order
  // Every block of those tasks, filled with them, in the order the blocks completed.
  std::vector<BlockTiming> blocks;
};

}  // namespace simpler::chip
