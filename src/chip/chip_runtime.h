// Executes one run on one device: orchestration context, TensorMap dependency
// inference, a bounded task ring with backpressure, dispatch of ready task
// blocks to the device's cores, and per-task error attribution. Private to the
// runtime; its public types are chip_options.h and run_report.h.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <type_traits>
#include <vector>

#include "absl/status/status.h"
#include "simpler/chip/chip_options.h"
#include "simpler/chip/run_report.h"
#include "simpler/device/device.h"
#include "simpler/task/callable.h"

namespace simpler::chip {

struct GraphRecording;

// Executes `callable` with `args` (already resolved to device tensors) on the
// device behind `ctx`: runs the orchestration function, which submits tasks
// (device-built graph), and dispatches them until all finished or one failed.
// Uses at most `max_cores` cores (0 = all).
//
// Errors: the orchestration's own error, a submit-time error (bad kernel, bad
// args, tensor outside any live allocation, a task that can never fit), or the
// first task error, as "run R task T (kernel 'K'): <cause>" keeping the
// cause's code and its unrecoverable mark. On error no new task is dispatched;
// blocks already running are drained before returning. An exception thrown by
// the orchestration or a kernel is that function's error (INTERNAL,
// recoverable: "run R orchestration of 'C' threw <type>: <what>", "run R task
// T (kernel 'K') block B: kernel threw <type>: <what>").
//
// `capture`, when set, receives the run's graph (GraphRecording): every task the run admitted,
// with its full predecessor list (the TensorMap forgets no finished task meanwhile); a run that
// submits more than options.max_graph_tasks tasks then fails with RESOURCE_EXHAUSTED. Complete
// only when the run returned OK.
absl::Status execute_run(device::ExecContext& ctx, const task::ChipCallable& callable,
                         const task::TaskArgs& args, const ChipOptions& options, int32_t max_cores,
                         bool record_task_timing, RunReport* report,
                         GraphRecording* capture = nullptr);

// ---- Host-built graphs ----------------------------------------------------
//
// The host runs the orchestration during prepare and writes the finished
// graph as an image into a run-owned device buffer; the device validates the
// image, then only executes it. The image is a plain, versioned byte layout
// with offsets (never host pointers):
//
//   GraphImageHeader
//   GraphImageTask[num_tasks]         at tasks_offset
//   task::Arg[num_args]               at args_offset  (device tensors, scalars)
//   uint32_t preds[num_preds]         at preds_offset (indices of earlier tasks)
//
// Task i's arguments are args[args_begin, args_begin + num_args) and its
// predecessors preds[preds_begin, preds_begin + num_preds), every index < i.

inline constexpr uint32_t kGraphImageMagic = 0x53475246;  // "FRGS" little-endian
inline constexpr uint32_t kGraphImageVersion = 1;

struct GraphImageHeader {
  uint32_t magic = kGraphImageMagic;
  uint32_t version = kGraphImageVersion;
  uint32_t num_tasks = 0;
  uint32_t num_args = 0;
  uint32_t num_preds = 0;
  uint32_t num_kernels = 0;  // of the callable it was built for
  uint64_t run_id = 0;
  uint64_t tasks_offset = 0;
  uint64_t args_offset = 0;
  uint64_t preds_offset = 0;
  uint64_t total_bytes = 0;
};
static_assert(std::is_trivially_copyable_v<GraphImageHeader>);
static_assert(sizeof(GraphImageHeader) == 64);

struct GraphImageTask {
  uint32_t kernel = 0;
  int32_t block_dim = 1;
  uint32_t args_begin = 0;
  uint32_t num_args = 0;
  uint32_t preds_begin = 0;
  uint32_t num_preds = 0;
};
static_assert(std::is_trivially_copyable_v<GraphImageTask>);
static_assert(sizeof(GraphImageTask) == 24);

// Checks a device range; the Device's check_range on the host.
using RangeCheck = std::function<absl::Status(uint64_t address, uint64_t bytes)>;

// What one run's orchestration submitted, with every dependency resolved: task i's arguments
// are args[args_begin, + num_args) and its predecessors preds[preds_begin, + num_preds) —
// sorted, unique, every earlier task it overlaps (RAW, WAR, WAW), finished or not, as a
// TensorMap that forgets nothing infers them. The host-built image and a captured graph are
// made from it. Value type, thread-compatible.
struct GraphRecording {
  std::vector<GraphImageTask> tasks;
  std::vector<task::Arg> args;
  std::vector<uint32_t> preds;
  // The successor lists (empty until link_successors): task i's successors are
  // succs[succ_begin[i], succ_begin[i + 1]), sorted; succ_begin has tasks.size() + 1 entries.
  std::vector<uint32_t> succ_begin;
  std::vector<uint32_t> succs;
  // Task i's device::job_shape_key (empty until compute_job_shapes): fixed by the graph, since a
  // replay binds arguments of the captured shapes to the same kernels, so a replayed job carries
  // it (CoreJob::shape) and the device need not compute it again.
  std::vector<uint64_t> job_shapes;
  // Computes succ_begin and succs from the predecessors (the inverse relation). O(tasks + preds).
  void link_successors();
  // Computes job_shapes from the tasks, their recorded arguments and `callable`'s kernels (the
  // callable the graph was recorded from). O(tasks + args).
  void compute_job_shapes(const task::ChipCallable& callable);
  // Whether the successor lists belong to the current tasks.
  bool linked() const {
    return succ_begin.size() == tasks.size() + 1 && succs.size() == preds.size();
  }
  // Appends a task; `deps` must be sorted and unique, every element below tasks.size().
  void add(task::KernelIndex kernel, int32_t block_dim, const task::Arg* task_args, size_t num_args,
           const std::vector<uint64_t>& deps);
  void clear() {
    tasks.clear();
    args.clear();
    preds.clear();
    succ_begin.clear();
    succs.clear();
    job_shapes.clear();
  }
};

// The header of `recording`'s graph image (layout above) for run `run_id` of a callable of
// `num_kernels` kernels: its counts, offsets and total_bytes.
GraphImageHeader graph_image_header(const GraphRecording& recording, uint32_t num_kernels,
                                    uint64_t run_id);

// The graph image of `recording` (layout above) for run `run_id` of a callable of
// `num_kernels` kernels, with `args` (recording.args.size() entries) as its argument table.
std::vector<uint8_t> graph_image(const GraphRecording& recording, const task::Arg* args,
                                 uint32_t num_kernels, uint64_t run_id);

// Runs `callable`'s orchestration on the calling (host) thread against a recording context
// and returns what it submitted. `num_cores` is what the orchestration sees as
// ctx.num_cores(). Errors as for build_graph_image.
absl::StatusOr<GraphRecording> record_graph(const task::ChipCallable& callable,
                                            const task::TaskArgs& args, const ChipOptions& options,
                                            int32_t num_cores, uint64_t run_id,
                                            const RangeCheck& check_range);

// Runs `callable`'s orchestration on the calling (host) thread against a
// recording context and returns the graph image. `num_cores` is what the
// orchestration sees as ctx.num_cores(). Errors as for execute_run's
// submit-time errors, plus RESOURCE_EXHAUSTED when the run needs more than
// options.max_graph_tasks tasks (the run can never fit its image).
absl::StatusOr<std::vector<uint8_t>> build_graph_image(const task::ChipCallable& callable,
                                                       const task::TaskArgs& args,
                                                       const ChipOptions& options,
                                                       int32_t num_cores, uint64_t run_id,
                                                       const RangeCheck& check_range);

// Validates the image at [image_address, + image_bytes) on the device (magic,
// version, run id, offsets and counts, kernel indices, predecessor indices,
// argument ranges) and executes it. A malformed image is INVALID_ARGUMENT
// naming the field; otherwise as execute_run.
absl::Status execute_graph_image(device::ExecContext& ctx, const task::ChipCallable& callable,
                                 uint64_t image_address, uint64_t image_bytes,
                                 const ChipOptions& options, int32_t max_cores,
                                 bool record_task_timing, RunReport* report);

// Executes a recorded graph without orchestration, validation or dependency inference: task i
// is `recording.tasks[i]` over `args` (recording.args.size() arguments, already checked by the
// caller: a captured graph's bound arguments, which must stay valid until it returns) behind its
// recorded predecessors. Errors and their attribution as execute_run's task errors (task i keeps
// index i). A linked recording (link_successors) is admitted whole: no task ring, each task
// starts with its predecessor count and a finished one releases its successor lists, and
// RunReport::tasks_submitted is its task count even when a task fails; an unlinked one is
// admitted task by task through the ring as execute_run's tasks are.
absl::Status execute_recorded(device::ExecContext& ctx, const task::ChipCallable& callable,
                              const GraphRecording& recording, const task::Arg* args,
                              const ChipOptions& options, int32_t max_cores,
                              bool record_task_timing, RunReport* report);

}  // namespace simpler::chip
