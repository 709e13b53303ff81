// The device abstraction: memory, in-order streams, launches, cores.
//
// A Device owns device memory and one or more in-order Streams. A Stream runs
// work items one after another on the device's scheduler thread (the role of
// the Ascend AICPU); a launch item gets an ExecContext through which it hands
// jobs to the device's cores (the AICore role) and collects their completions.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "simpler/base/event.h"
#include "simpler/device/fault_plan.h"
#include "simpler/task/callable.h"

namespace simpler::device {

// Capabilities are data.
struct DeviceCaps {
  std::string platform;  // "sim"
  int32_t device_id = 0;
  int32_t num_cores = 0;            // cores that run kernel blocks in parallel
  uint64_t memory_bytes = 0;        // device heap capacity in bytes (0 = host-limited)
  bool device_built_graphs = true;  // orchestration may run on the device
};

// One kernel block to run on a core.
struct CoreJob {
  task::KernelFn fn = nullptr;
  const task::Arg* args = nullptr;  // must stay valid until the job completes
  uint32_t num_args = 0;
  int32_t block_idx = 0;
  int32_t block_dim = 1;
  uint32_t task_index = 0;  // index of the task inside its run
  uint64_t tag = 0;         // opaque to the device, returned in the completion
  uint32_t kernel = 0;      // index of the kernel in the run's callable (diagnostics)
  // What the block's duration depends on (job_shape_key of this job), when the caller has it
  // precomputed (a captured graph's task: fixed by the graph); 0 = not given, the device computes
  // it. A hint: a wrong value only blends duration estimates, never changes what runs.
  uint64_t shape = 0;
  // Whether the caller reads the completion's start_ns and end_ns. False lets a device leave
  // them 0 (it may still time some of the job's runs for its own duration estimates): a clock
  // read costs 20-100 ns on a VM, as much as dispatching an empty kernel.
  bool timed = true;
  // The task's shared lines (task::KernelContext::task_lines), block_dim of them, zeroed by the
  // caller before the task's first block starts and kept until its last block completes; null
  // for none. The device passes it to the kernel as it is.
  task::TaskLine* task_lines = nullptr;
};

// What a block's duration depends on, by which a device keeps its duration estimates: the
// kernel, the block count and the bytes the tensor arguments span (a decode step's q projection
// and its LM head share a kernel but differ 75-fold in time; successive steps repeat the same
// keys). Never 0. A collision only blends two estimates. Thread-safe (pure). Two forms, the same
// key: job_shape_key_of for a caller that has summed the spans already (`tensor_bytes`: the bytes
// the tensor arguments span together), job_shape_key from the arguments themselves.
inline uint64_t job_shape_key_of(task::KernelFn fn, uint64_t tensor_bytes, int32_t block_dim) {
  const auto f = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(fn));
  const uint64_t key =
      f ^ (tensor_bytes * 0x9E3779B97F4A7C15ull) ^ (static_cast<uint64_t>(block_dim) << 48);
  return key != 0 ? key : 1;
}
inline uint64_t job_shape_key(task::KernelFn fn, const task::Arg* args, uint32_t num_args,
                              int32_t block_dim) {
  uint64_t bytes = 0;
  for (uint32_t i = 0; i < num_args; ++i) {
    if (args[i].direction != task::ArgDirection::kScalar) bytes += args[i].tensor.span_bytes();
  }
  return job_shape_key_of(fn, bytes, block_dim);
}

// A job a core is executing, for diagnostics (Device::executing()).
struct ExecutingJob {
  uint64_t run_id = 0;
  uint32_t task_index = 0;
  uint32_t kernel = 0;  // CoreJob::kernel
  int32_t block_idx = 0;
  int32_t core = 0;
  int64_t start_ns = 0;  // now_ns() when the block started
};

// The outcome of one CoreJob. Timestamps are now_ns() on the thread that ran it; both 0 when the
// job was started untimed (CoreJob::timed) and the device did not time this run of it.
struct CoreCompletion {
  int32_t core = 0;
  uint64_t tag = 0;
  uint32_t task_index = 0;
  int32_t block_idx = 0;
  absl::Status status;
  int64_t start_ns = 0;
  int64_t end_ns = 0;
};

// What a launched item sees while it executes on the device. Owner-thread
// only: used by the stream's scheduler thread during one launch.
class ExecContext {
 public:
  virtual ~ExecContext() = default;
  virtual int32_t num_cores() const = 0;
  // Id of the run being executed (fault plans key on it).
  virtual uint64_t run_id() const = 0;
  // Jobs one core may hold started and not yet returned by next_completion (>= 1): its job
  // queue. The core runs them one at a time in the order they were started.
  virtual int32_t core_queue_depth() const { return 1; }
  // Hands `job` to core `core` (0 <= core < num_cores), which holds fewer than
  // core_queue_depth() jobs started and not yet returned.
  virtual void start(int32_t core, const CoreJob& job) = 0;
  // Next completion of a started job. With `block`, waits (sleeping, with at
  // most ~50 µs of spinning) until one is available — every started job
  // completes, an injected hang when the device is aborted. Without `block`,
  // returns false when none is available. The sim device may run the job
  // inside a blocking call itself (SimDeviceOptions::run_jobs_inline), and
  // inside a non-blocking call too (SimDeviceOptions::scheduler_core): a
  // single-block job its core timed short, and any of core 0's jobs — however
  // long — once it has waited spin_ns, so a non-blocking call can take as long
  // as that job; the completion is the same as if its core had run it. Before running one of core
  // 0's jobs longer than 10 µs inline, the sim device waits up to 10 µs for another core's job
  // predicted to end by then, blocking or not, and returns that completion first (the caller can
  // then hand that core its next job instead of leaving it idle while the scheduler runs its own).
  virtual bool next_completion(CoreCompletion* out, bool block) = 0;
  // True once the device was aborted; the launch should stop and return.
  virtual bool aborted() const = 0;
  // OK when [address, address + bytes) lies inside one live device allocation;
  // INVALID_ARGUMENT describing the range otherwise.
  virtual absl::Status check_range(uint64_t address, uint64_t bytes) const = 0;
};

// Body of a launch: runs on the scheduler thread. Its status becomes the
// launch's status. An exception escaping it is caught by the stream and
// becomes the launch's INTERNAL (recoverable) status; the same holds for a
// kernel (KernelFn) throwing on a core: its block's status.
using LaunchFn = std::function<absl::Status(ExecContext&)>;

// Completion record of one stream item. `done` is signalled (release) after
// status and timestamps are written; readers wait on `done` (acquire) first.
struct LaunchRecord {
  uint64_t run_id = 0;
  int64_t start_ns = 0;  // device time the item started
  int64_t end_ns = 0;    // device time the item finished
  base::Event done;      // carries the item's status
};

// An in-order queue of device work. Items execute strictly one after another
// in enqueue order; the next starts the moment the previous ended, with no
// host round trip. A launch that ends with an unrecoverable error (device
// fault, hang released by an abort) aborts the device before the next item
// starts: the items queued behind it never execute and fail as aborted.
// Thread-safe.
class Stream {
 public:
  virtual ~Stream() = default;
  // Enqueues a launch of `fn` for run `run_id`; returns its record at once.
  // FAILED_PRECONDITION when the device was aborted or closed; UNAVAILABLE
  // when the stream refuses the launch (sim: an injected launch_refused).
  // On an error nothing was enqueued.
  virtual absl::StatusOr<std::shared_ptr<LaunchRecord>> launch(uint64_t run_id, LaunchFn fn) = 0;
  // Enqueues a host function executed in stream order (used for ordered
  // copies); returns its record.
  virtual absl::StatusOr<std::shared_ptr<LaunchRecord>> enqueue_host(
      std::function<absl::Status()> fn) = 0;
  // Number of items enqueued but not finished.
  virtual size_t pending() const = 0;
};

// A device. Thread-safe unless a method says otherwise.
class Device {
 public:
  virtual ~Device() = default;
  virtual const DeviceCaps& caps() const = 0;

  // Allocates `bytes` (> 0) of zeroed device memory, 64-byte aligned.
  // INVALID_ARGUMENT for 0 bytes; RESOURCE_EXHAUSTED naming the request and
  // the free capacity when the heap is full, or naming the limit when `bytes` is above
  // the largest allocation (the sim device: 2^47 bytes, the user address space).
  virtual absl::StatusOr<uint64_t> malloc(uint64_t bytes) = 0;
  // Frees an allocation by its base address; NOT_FOUND when `address` is not
  // the base of a live allocation (double free, interior pointer).
  virtual absl::Status free(uint64_t address) = 0;
  // See ExecContext::check_range.
  virtual absl::Status check_range(uint64_t address, uint64_t bytes) const = 0;
  // The id of the live allocation that holds all of [address, address + bytes): every malloc
  // gets the next id (1, 2, 3, ...), never reused for the device's life, so memory freed and
  // allocated again at the same address has another id. INVALID_ARGUMENT as check_range when the
  // range is not inside one live allocation.
  virtual absl::StatusOr<uint64_t> allocation_id(uint64_t address, uint64_t bytes) const = 0;
  // The id the next malloc will get: every live allocation's id is below it.
  virtual uint64_t next_allocation_id() const = 0;
  // How many frees the device has had (close counts as one): monotonic, and a free counts before
  // its memory goes, so a caller that read N, then found ranges live (allocation_id), knows they
  // are still live, in the same allocations, while the count is still N.
  virtual uint64_t free_count() const = 0;
  // Synchronous copies between host memory and a device range (bounds-checked,
  // not ordered against streams; see Stream::enqueue_host for ordered copies).
  virtual absl::Status copy_to_device(uint64_t dst, const void* src, uint64_t bytes) = 0;
  virtual absl::Status copy_from_device(void* dst, uint64_t src, uint64_t bytes) = 0;
  // Bytes currently allocated and number of live allocations.
  virtual uint64_t allocated_bytes() const = 0;
  virtual size_t live_allocations() const = 0;

  // Creates an in-order stream owned by the device (valid until close()).
  virtual absl::StatusOr<Stream*> create_stream() = 0;

  // Aborts all device work: hung tasks return, running launches see
  // ExecContext::aborted() and dispatch nothing more (blocks already on cores
  // finish), queued and later items fail with `reason`. Idempotent.
  virtual void abort(const absl::Status& reason) = 0;
  virtual bool aborted() const = 0;

  // What the cores are executing now: a best-effort snapshot (each field is
  // read without stopping the cores), for error messages such as a timeout
  // naming the task that was still running.
  virtual std::vector<ExecutingJob> executing() const = 0;

  // Aborts what is still running, joins every device thread and releases all
  // memory. Idempotent; the device is unusable afterwards. Bounded: a device
  // thread that does not exit within the device's close grace (one deadline
  // shared by all its threads; a thread not inside a kernel or a launch — idle, it exits as
  // soon as it is scheduled — gets 10 s of its own instead, so a loaded machine's delay is not
  // mistaken for a stuck kernel) because it is inside a kernel that never returns is abandoned —
  // detached, logged and counted in base::abandoned_threads() — and then no memory is released: the
  // owner must keep the device (and whatever the abandoned thread may read: run records, callables)
  // alive with base::keep_until_exit (see abandoned_threads()).
  virtual void close() = 0;
  // Device threads close() abandoned (0 when every thread was joined).
  virtual int32_t abandoned_threads() const = 0;
};

// The most core threads a sim device runs (each is a host thread).
inline constexpr int32_t kMaxSimCores = 1024;

// Options of the sim device.
struct SimDeviceOptions {
  int32_t device_id = 0;
  // Core threads, at most kMaxSimCores; 0 = one per hardware thread (chosen by measurement on 2
  // vCPUs: docs/benchmarks-history.md, "decode, prefill and load at the machine's limits").
  int32_t num_cores = 0;
  // Heap capacity in bytes; 0 = limited only by host memory.
  uint64_t memory_bytes = 0;
  FaultPlan faults;
  // Longest a device thread waits awake before sleeping, in ns (≤ 50 µs): core threads
  // pause-spin for their next job, the stream's scheduler polls (yielding the CPU) for the next
  // launch. 50 µs: on a 2-vCPU VM a sleeping core thread takes 60-120 µs to wake, and with the
  // scheduler standing in for core 0 (scheduler_core) the other core's next job often comes
  // 20-50 µs after its last (batch-1 decode +14% against 20 µs, in docs/benchmarks.md).
  int64_t spin_ns = 50'000;
  // When the scheduler waits on exactly one job that its core thread has not
  // picked up yet, the scheduler runs the job itself (timestamps, faults and
  // the completion's core are those of the job's core). This keeps the run
  // boundary on an awake thread: a chain of single-block tasks, and run k+1's
  // first task after run k's last, start without a cross-thread wake-up.
  // false: every job runs on a core thread (the model's literal shape).
  bool run_jobs_inline = true;
  // Whether the stream's scheduler thread stands in for core 0: core 0's jobs, long ones too, run
  // on the scheduler thread when it next waits for a completion, after the completions already
  // there are handled (a poll between an orchestration's submits runs one once it has waited
  // spin_ns, or at once when it is short), and core 0's thread runs none. Besides, at a
  // core_queue_depth of 1, a single-block job of any core that its core timed short runs on the
  // scheduler thread (attributed to that core), in a blocking or non-blocking next_completion,
  // while the jobs the scheduler holds so add up to at most 10 µs: handing such a job to another
  // thread would cost more than running it. A core thread per CPU plus a spinning scheduler
  // oversubscribe the CPUs: three threads spinning on two CPUs turn each hand-off between
  // dependent short tasks into a wait for a CPU (~30 µs on a 2-vCPU VM; docs/benchmarks.md).
  // Where CPUs are to spare the scheduler is better left to schedule.
  // kAuto: on when run_jobs_inline is true and the cores are at least the CPUs the device
  // threads may run on (`cpus`, else the hardware threads).
  enum class SchedulerCore { kAuto, kOn, kOff };
  SchedulerCore scheduler_core = SchedulerCore::kAuto;
  // Jobs each core may hold started and not yet returned (ExecContext::core_queue_depth), in
  // [1, 64]: a core thread drains every job queued to it per wake-up instead of handing each one
  // back before it gets the next. 1 (the default) = one job at a time: on 2 vCPUs deeper queues
  // measured no faster for independent or chained empty tasks and far slower for 8 interleaved
  // chains (~24 µs a task at depth 8 against ~0.3-0.7 µs at 1: a core's queue holds chains that
  // wait behind each other while the other core idles; docs/design/scheduler.md).
  int32_t core_queue_depth = 1;
  // CPUs the device's threads (stream schedulers, cores) run on; empty = no
  // restriction. Modelling a separate accelerator: give the device CPUs the
  // host threads do not use (`simpler bench pipeline --pin auto`).
  std::vector<int> cpus;
  // How long close() waits, in seconds (finite, >= 0), for the device threads
  // to exit after it aborted the device before abandoning those still inside
  // a kernel (see Device::close).
  double close_grace_s = 1.0;
};

// Creates the thread-based sim device. INVALID_ARGUMENT for negative cores,
// spin_ns outside [0, 50'000], core_queue_depth outside [1, 64], a negative or non-finite
// close_grace_s, or `cpus` naming a CPU this
// machine does not have. A CPU that exists but lies outside the process's cpuset is found only when
// a device thread pins itself: that thread logs a warning and runs unpinned.
absl::StatusOr<std::unique_ptr<Device>> create_sim_device(const SimDeviceOptions& options);

}  // namespace simpler::device
