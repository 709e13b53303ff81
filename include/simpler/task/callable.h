// Kernels, orchestration functions and callables (programs).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "simpler/task/call_config.h"
#include "simpler/task/task_args.h"

namespace simpler::task {

// One cache line of the state an SPMD task's blocks share (KernelContext::task_lines): a word
// the blocks update atomically, alone on its 64-byte line so that two blocks' words, or two
// tasks', never share a line.
struct alignas(64) TaskLine {
  std::atomic<uint64_t> word{0};
};

// What a kernel invocation sees: its task's arguments (tensors already
// resolved to device addresses) and its SPMD block. Valid only during the call.
struct KernelContext {
  const Arg* args = nullptr;
  uint32_t num_args = 0;
  int32_t block_idx = 0;  // 0 <= block_idx < block_dim
  int32_t block_dim = 1;
  int32_t core = 0;  // the core running this block
  uint64_t run_id = 0;
  uint32_t task_index = 0;
  // For a task of several blocks, block_dim lines that its blocks share and nothing else touches
  // while the task runs, as a GPU kernel's blocks share counters in global memory: every word is
  // 0 when the task's first block starts, and what a block stores there its partner blocks see
  // (atomics; the device gives no other ordering between blocks). A kernel uses them to hand its
  // work out to its blocks as each becomes free, instead of splitting it by block_idx, so that a
  // block on a slower core takes less (the matmul kernels do; docs/design/scheduler.md). Null for a
  // one-block task, and from a device or caller that provides none: the kernel then splits its work
  // by block_idx. Rules for a kernel that uses them: one scheme per task (the words start at 0
  // once, so two claim loops over the same lines would find them used up); never wait for a
  // partner block (blocks may run one after another on one core, and after a failure or an abort
  // some never start): a block that finds nothing left is done, and the blocks that run do all
  // the work between them. Owned by the executor (host memory on the sim device); valid during
  // the call.
  TaskLine* task_lines = nullptr;

  // Argument `i` of the task: tensor() for a tensor argument, scalar*() for a scalar one. An index
  // past the task's arguments, or an argument of the other kind, is a kernel bug: it throws
  // std::out_of_range naming both, which fails the run as any exception a kernel throws does
  // (it read past the array, or a tensor's fields as a scalar).
  const Tensor& tensor(uint32_t i) const {
    if (i >= num_args || args[i].direction == ArgDirection::kScalar) [[unlikely]] {
      throw_bad_arg(i, "tensor");
    }
    return args[i].tensor;
  }
  uint64_t scalar(uint32_t i) const {
    if (i >= num_args || args[i].direction != ArgDirection::kScalar) [[unlikely]] {
      throw_bad_arg(i, "scalar");
    }
    return args[i].scalar;
  }
  int64_t scalar_i64(uint32_t i) const { return static_cast<int64_t>(scalar(i)); }
  float scalar_f32(uint32_t i) const;

 private:
  [[noreturn]] void throw_bad_arg(uint32_t i, const char* kind) const;
};

// A kernel: one compute function, called once per block on a core thread.
// Must be thread-safe across blocks and tasks; returns a non-OK status to
// report failure (a recoverable error of its run).
using KernelFn = absl::Status (*)(const KernelContext&);

struct Kernel {
  std::string name;
  KernelFn fn = nullptr;
};

// Index of a kernel inside its callable.
using KernelIndex = uint32_t;

// Interface the orchestration function submits tasks through. Implemented by
// the chip layer. Owner-thread only (the thread running the orchestration).
class OrchestrationContext {
 public:
  virtual ~OrchestrationContext() = default;
  // Submits one task: `kernel` of the running callable over `args`, run once
  // per block for block_dim blocks. Dependencies on earlier tasks are inferred
  // from overlapping tensor ranges. Blocks while the task ring is full.
  // Errors: INVALID_ARGUMENT (unknown kernel, bad args, tensor outside any
  // live device allocation, block_dim < 1), RESOURCE_EXHAUSTED (the task can
  // never fit the ring), or the run's first task error (the run is failing).
  virtual absl::Status submit(KernelIndex kernel, const TaskArgs& args, int32_t block_dim = 1) = 0;
  // Number of cores this run may use.
  virtual int32_t num_cores() const = 0;
  // 0-based id of the run being orchestrated.
  virtual uint64_t run_id() const = 0;
};

// Orchestration: reads the run's arguments and submits tasks. Must be
// reentrant (runs of one callable may be orchestrated on different threads one
// after another) and must not block on anything but `ctx`.
using OrchestrationFn =
    std::function<absl::Status(OrchestrationContext& ctx, const TaskArgs& args)>;

// A program: an orchestration function plus the kernels it may invoke.
// Immutable after construction; shared by handle. Thread-safe.
struct ChipCallable {
  std::string name;
  OrchestrationFn orchestration;
  std::vector<Kernel> kernels;
  GraphPlacement placement = GraphPlacement::kDefault;

  // Index of the kernel named `name`; NOT_FOUND names callable and kernel.
  absl::StatusOr<KernelIndex> kernel_index(std::string_view name) const;
  // INVALID_ARGUMENT when the name is empty, orchestration missing, the placement
  // unknown, a kernel has no name or no function, or two kernels share a name.
  absl::Status validate() const;
};

// The callable of a program that is one kernel call: named `name`, with the one kernel `kernel`
// (also named `name`), whose orchestration submits that kernel once (block_dim 1) over the run's
// arguments as they are. Invalid (see ChipCallable::validate) when `name` is empty or `kernel`
// is null.
ChipCallable one_kernel_callable(std::string name, KernelFn kernel);

}  // namespace simpler::task
