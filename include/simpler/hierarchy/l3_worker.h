// A level-3 worker: a host orchestrating several chips (ARCHITECTURE.md "L3").
//
// An L3 *program* is a host orchestration function. It submits next-level tasks — a run of a
// chip callable on one child (submit_next_level) — and host sub-tasks (submit_sub); a host
// TensorMap infers the dependencies between them from their tagged tensors (IN / OUT / INOUT;
// read-after-write, write-after-read, write-after-write, byte-exact), and a scheduler dispatches
// each task once its inputs are ready: next-level tasks to their child's endpoint (its transport),
// sub-tasks to a pool of host threads.
//
// L3 runs have the L2 run semantics: submit() returns a live RunHandle without waiting for the
// run (it orchestrates it on the caller's thread when the launch depth allows); runs finalize in
// submission order; a run's error (the first failed task in task order, naming the task, its
// child and callable) is delivered to its handle exactly once; close() drains and returns only
// errors no wait() delivered. Early enqueue across the boundary: with launch_depth 2 the next
// run is orchestrated while the current one executes and its ready next-level tasks are staged
// on their children behind the current run's (a task goes to a child only after every earlier
// task for that child, of any run, was dispatched; one TensorMap spans the runs in flight, so
// a staged task also waits for an earlier run's writers and readers of its buffers). A run's
// report lists each next-level task's device start and end (core = the child).
//
// Children run in thread mode (an L2 Worker in this process) or process mode (forked children
// behind shared-memory mailboxes; init() must run before this process starts any thread, and
// only callables registered before init() exist in the children).
//
// Threads: there is no scheduler thread. The scheduler is a monitor advanced by whoever brings
// news — submit() on the caller's thread, a child's completion on its endpoint's thread or on a
// thread waiting for a run, a sub-task's end on its pool thread — so no hand-off sits on a run's
// path. A thread in wait() / result() on an L3 run first collects the children's finished tasks
// itself, polling up to 50 µs while that pays off for the run's program
// (it stops polling for a program whose runs outlast that window), then sleeps until the endpoints'
// threads finish the run; while any waiter polls, those threads are not woken for finished runs
// (the last waiter to stop collects once). Its handle may outlive
// the worker (close() detaches the polling). An orchestration
// therefore runs on one of those threads with the worker's lock held: it must be quick, must
// not block, and must not call this worker's methods (they refuse with FAILED_PRECONDITION);
// it submits through its L3Context only. Sub-tasks run on sub_threads pool threads.
//
// Memory: host tensors of next-level tasks must lie in buffers from create_buffer(): a shared
// host heap mapped before the children are forked, at the same address in every child, and
// staged onto the child's device by its L2 lane. Device tensors are child device buffers
// (child_malloc, filled with copy_to_child): uploaded once, they stay on the child (weights).
#pragma once

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "simpler/task/call_config.h"
#include "simpler/task/callable.h"
#include "simpler/task/task_args.h"
#include "simpler/worker/run_handle.h"
#include "simpler/worker/worker.h"

namespace simpler::hierarchy {

enum class ChildMode { kThread, kProcess };
std::string_view name_of(ChildMode mode);
// "thread" / "process"; INVALID_ARGUMENT otherwise.
absl::StatusOr<ChildMode> parse_child_mode(std::string_view text);

struct L3Options {
  std::vector<int32_t> device_ids = {0, 1};  // one child chip worker per id, in this order
  ChildMode child_mode = ChildMode::kThread;
  // Every child's L2 options (device_id is replaced by the child's id).
  worker::WorkerOptions child;
  int32_t sub_threads = 2;  // host threads running sub-tasks, >= 1
  // L3 runs in flight at once, in [1, 16]. 2 (the default) stages run k+1 while run k
  // executes: its orchestration runs and its ready next-level tasks go to their children,
  // queued behind run k's on each child's lane (never ahead of them). 1 = serial.
  int32_t launch_depth = 2;
  uint64_t host_heap_bytes = 64ull << 20;  // shared host heap for create_buffer (reserved lazily)

  // INVALID_ARGUMENT naming the field: no device ids, a negative or repeated id, sub_threads
  // < 1, launch_depth outside [1, 16], a zero heap, or an invalid child option.
  absl::Status validate() const;
};

// A host sub-task: runs on a host thread with the task's arguments (HOST tensors and scalars).
using SubFn = std::function<absl::Status(const task::TaskArgs& args)>;

struct ChildCallable {
  uint32_t index = 0;
};
struct SubHandle {
  uint32_t index = 0;
};
struct ProgramHandle {
  uint32_t index = 0;
};

// What an L3 orchestration submits through. Valid only during the orchestration call, from its
// thread (FAILED_PRECONDITION otherwise).
class L3Context {
 public:
  virtual ~L3Context() = default;
  // A run of `callable` on child `child` (0-based index into L3Options::device_ids) with
  // `args`: scalars, HOST tensors inside create_buffer() buffers, and DEVICE tensors in that
  // child's buffers (child_malloc; checked live by the child: a stale one fails the task).
  // Returns the task's index in this run. INVALID_ARGUMENT: unknown callable or child, invalid
  // args or config, a HOST tensor outside the shared heap.
  virtual absl::StatusOr<uint32_t> submit_next_level(ChildCallable callable,
                                                     const task::TaskArgs& args, int32_t child,
                                                     const task::CallConfig& config = {}) = 0;
  // A host sub-task `fn` with `args` (scalars and HOST tensors anywhere in this process).
  // INVALID_ARGUMENT: unknown sub, invalid args, a DEVICE tensor.
  virtual absl::StatusOr<uint32_t> submit_sub(SubHandle fn, const task::TaskArgs& args) = 0;
  virtual int32_t num_children() const = 0;
};

using L3Orchestration = std::function<absl::Status(L3Context& ctx, const task::TaskArgs& args)>;

struct L3Program {
  std::string name;
  L3Orchestration orchestration;
};

// A buffer in the shared host heap. Plain value; does not own.
struct HostBuffer {
  uint64_t address = 0;
  uint64_t bytes = 0;
  // A contiguous HOST tensor view at `offset` bytes; INVALID_ARGUMENT when it does not fit
  // (task::Tensor::in_buffer).
  absl::StatusOr<task::Tensor> tensor(std::initializer_list<int64_t> shape, task::DataType dtype,
                                      uint64_t offset = 0) const;
  template <typename T>
  T* data() const {
    return reinterpret_cast<T*>(static_cast<uintptr_t>(address));
  }
};

// Thread-safe after init(); register_* only before init().
class L3Worker {
 public:
  explicit L3Worker(L3Options options);
  ~L3Worker();  // close(), discarding its status
  L3Worker(const L3Worker&) = delete;
  L3Worker& operator=(const L3Worker&) = delete;

  // Before init(). INVALID_ARGUMENT for an invalid callable or program, a duplicate name, an
  // empty sub; FAILED_PRECONDITION after init().
  absl::StatusOr<ChildCallable> register_callable(task::ChipCallable callable);
  absl::StatusOr<SubHandle> register_sub(std::string name, SubFn fn);
  absl::StatusOr<ProgramHandle> register_program(L3Program program);
  // Before init(): `setup` runs on every child's side once its worker is initialized, before
  // it serves a run (ChildSpec::setups; a process child runs it in the child process, so what
  // it fills is that child's own copy). It gets the child's index and its L2 worker: device
  // buffers and weights a callable needs are made there, where the device is. A setup's error
  // fails init() naming the child (thread mode), or stops the child so that every run on it
  // fails naming the child and the error (process mode). INVALID_ARGUMENT for an empty
  // function; FAILED_PRECONDITION after init().
  absl::Status register_child_setup(
      std::function<absl::Status(int32_t child, worker::Worker& worker)> setup);

  // Validates the options, maps the shared host heap, starts the children (process mode: forks
  // them; FAILED_PRECONDITION when this process already runs threads; a child setup's error),
  // then the sub-task threads. On error nothing is left running.
  absl::Status init();

  // A buffer of `bytes` (> 0) in the shared host heap, 64-byte aligned, zero-filled.
  // RESOURCE_EXHAUSTED when the heap has no such free range (naming its size);
  // FAILED_PRECONDITION before init() or after close().
  absl::StatusOr<HostBuffer> create_buffer(uint64_t bytes);
  // Returns a buffer to the heap. NOT_FOUND for an address create_buffer did not return;
  // FAILED_PRECONDITION naming the run while an L3 run that has not finalized names memory of
  // the buffer in its arguments or in a task it submitted (as Worker::free at L2). Memory a
  // program reaches other than through those is the caller's to keep alive.
  absl::Status free_buffer(const HostBuffer& buffer);

  // Device memory on child `child` (zeroed) and its release. INVALID_ARGUMENT for an unknown
  // child; the child's own errors otherwise (prefixed with its description).
  absl::StatusOr<worker::DeviceBuffer> child_malloc(int32_t child, uint64_t bytes);
  absl::Status child_free(int32_t child, const worker::DeviceBuffer& buffer);
  // Copies `bytes` between a create_buffer() buffer (from its start) and a child device buffer
  // (at `offset`). FAILED_PRECONDITION while any L3 run is queued or executing (a run may use
  // either buffer); INVALID_ARGUMENT for an unknown child, a host range outside `host` or a
  // device range outside the buffer.
  absl::Status copy_to_child(int32_t child, const worker::DeviceBuffer& dst, const HostBuffer& src,
                             uint64_t bytes, uint64_t offset = 0);
  absl::Status copy_from_child(int32_t child, const HostBuffer& dst,
                               const worker::DeviceBuffer& src, uint64_t bytes,
                               uint64_t offset = 0);

  // Queues a run of `program` with `args` and returns its live handle; when fewer than
  // launch_depth runs are in flight the run is orchestrated and its ready tasks dispatched on
  // this thread first (the orchestration's time; nothing waits for the children). Errors:
  // FAILED_PRECONDITION before init(), after close() or from an orchestration of this worker,
  // INVALID_ARGUMENT (unknown program, invalid args). The run's own errors come through its
  // handle.
  absl::StatusOr<worker::RunHandle> submit(ProgramHandle program, const task::TaskArgs& args);
  // submit(...).wait().
  absl::Status run(ProgramHandle program, const task::TaskArgs& args);

  // Refuses new submits, drains queued runs, stops the sub-task threads, closes every child.
  // Returns the first L3 run error no wait() delivered (with the count of the others), else the
  // first child close error; OK when none. Idempotent: a concurrent second call returns OK once
  // the first finished. No other method may race it (as any use after close).
  absl::Status close();

  int32_t num_children() const { return static_cast<int32_t>(options_.device_ids.size()); }
  // Next-level tasks handed to children so far (for tests and benchmarks; relaxed counter).
  uint64_t next_level_dispatched() const;
  // The child endpoints' descriptions, in child order (after init()).
  std::vector<std::string> describe_children() const;

  class Impl;

 private:
  L3Options options_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace simpler::hierarchy
