// Worker: the public face of simpler. At level 2 it owns one chip: one device, one run lane and
// its run resources (the runtime's ChipWorker, behind Worker::Impl).
#pragma once

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "simpler/base/clock.h"
#include "simpler/base/env.h"
#include "simpler/base/trace.h"
#include "simpler/chip/chip_options.h"
#include "simpler/device/device.h"
#include "simpler/device/fault_plan.h"
#include "simpler/task/call_config.h"
#include "simpler/task/callable.h"
#include "simpler/task/task_args.h"
#include "simpler/worker/run_handle.h"
#include "simpler/worker/worker_stats.h"

namespace simpler::worker {

struct WorkerOptions {
  int32_t level = 2;             // only 2 (one chip) exists today
  std::string platform = "sim";  // device backend
  int32_t device_id = 0;
  int32_t num_cores = 0;     // in [0, device::kMaxSimCores]; 0 = one per hardware thread
  int32_t launch_depth = 1;  // in [1, kMaxRunGrant] (invariant 6)
  // Run resource sets. 0 = launch_depth + 1 (kMaxRunGrant when the depth is
  // kMaxRunGrant); otherwise in [launch_depth, kMaxRunGrant].
  int32_t run_grant = 0;
  double operation_timeout_s = 60;  // per-run device time limit once at the stream head
  // Sim heap capacity in bytes; 0 = host-limited. The runs' staging (HOST tensors, graph images)
  // counts against it: each resource set caches its staging for its next run, and that cache is
  // given back when an allocation (malloc, a run's staging) finds no room, or when a run fails at
  // prepare for want of room.
  uint64_t device_memory_bytes = 0;
  // CPUs for the sim device's threads; empty = unrestricted. See
  // SimDeviceOptions::cpus: a CPU this machine does not have fails init().
  std::vector<int> device_cpus;
  chip::ChipOptions chip;
  // Default graph placement (a CallConfig or callable placement overrides it).
  task::GraphPlacement placement = task::GraphPlacement::kDevice;
  // Fault plan for the sim device; unset = parse SIMPLER_SIM_FAULTS at init().
  std::optional<device::FaultPlan> faults;
  base::TraceRecorder* trace = nullptr;  // not owned; must outlive the Worker
  // The clock operation timeouts, admission and close() deadlines are
  // measured on (not owned; must outlive the Worker); null = the real one.
  // Tests pass a base::FakeEnv to fire a timeout when they choose.
  base::Env* env = nullptr;
  // Captured graphs kept (CallConfig::capture_key; docs/design/capture_replay.md): beyond it
  // the least recently used is dropped (never under a run that replays it).
  int32_t max_captured_graphs = 64;

  // INVALID_ARGUMENT naming the field: level != 2, unknown platform, negative
  // ids or cores, depth < 1 or above kMaxRunGrant, grant below the depth
  // ("run_grant 1 is below launch_depth 2") or above kMaxRunGrant,
  // NaN/non-positive/infinite timeout, max_captured_graphs < 1.
  absl::Status validate() const;
  int32_t effective_grant() const {
    if (run_grant != 0) return run_grant;
    return launch_depth >= kMaxRunGrant ? launch_depth : launch_depth + 1;
  }
};

// A registered callable.
struct CallableHandle {
  uint32_t index = 0;
};

// A device allocation made through a Worker. Plain value; does not own.
struct DeviceBuffer {
  uint64_t address = 0;
  uint64_t bytes = 0;
  // A contiguous tensor view at `offset` bytes; INVALID_ARGUMENT when it does
  // not fit the buffer (task::Tensor::in_buffer).
  absl::StatusOr<task::Tensor> tensor(std::initializer_list<int64_t> shape, task::DataType dtype,
                                      uint64_t offset = 0) const;
  absl::StatusOr<task::Tensor> tensor(const std::vector<int64_t>& shape, task::DataType dtype,
                                      uint64_t offset = 0) const;
};

// The error that explains `refusal`: when `refusal` refused a submit because
// the lane was poisoned by run N (base::poisoned_by) and `find(N)` returns
// that run's handle, run N's own error (waiting for it to finalize: it ends
// like any run, behind the runs launched before it); otherwise `refusal`. A
// caller holding the handles of its runs in flight uses it to report the
// failing run's own error and code, whichever of its submit or its wait
// notices the failure first.
absl::Status poison_cause(const absl::Status& refusal,
                          absl::FunctionRef<std::optional<RunHandle>(uint64_t run)> find);

// The public Worker. Typical use:
//   Worker w(opts); auto h = w.register_callable(prog); w.init();
//   auto buf = w.malloc(n); w.copy_to(buf, host, n);
//   RunHandle r = w.submit(*h, args).value(); r.wait(5.0); w.close();
// register_callable only before init(); everything else after init() and
// before close(), from any thread (thread-safe).
class Worker {
 public:
  explicit Worker(WorkerOptions options);
  ~Worker();  // close(), discarding its status
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  // Before init(). INVALID_ARGUMENT for an invalid callable (see
  // ChipCallable::validate) or a duplicate name; FAILED_PRECONDITION after init().
  absl::StatusOr<CallableHandle> register_callable(task::ChipCallable callable);
  // Validates the options, starts the device and the lane. FAILED_PRECONDITION
  // when called twice; INVALID_ARGUMENT from WorkerOptions::validate or a
  // malformed SIMPLER_SIM_FAULTS (with the reason).
  absl::Status init();

  // Device memory (zeroed). Errors: device allocation errors (device::Device::malloc:
  // INVALID_ARGUMENT for 0 bytes, RESOURCE_EXHAUSTED when it does not fit); FAILED_PRECONDITION
  // before init / after close.
  absl::StatusOr<DeviceBuffer> malloc(uint64_t bytes);
  // FAILED_PRECONDITION naming the callable when the buffer is bound to one
  // (bind(); unbind it first), naming the run when a run that has not retired
  // names the buffer in its arguments or its callable's bindings, or when a
  // quarantined run did (then until close(): its device use was never proven
  // finished); NOT_FOUND for an unknown buffer, or one whose `bytes` differ from the
  // allocation's (nothing is freed then). A successful free drops every captured graph
  // that uses the buffer at a fixed address (docs/design/capture_replay.md). Atomic with respect to
  // submit: a run admitted after the free is refused at submit (its tensor is no longer a live
  // allocation).
  absl::Status free(const DeviceBuffer& buffer);
  // Copies between host memory and a buffer (bytes at `offset`). Ordered after
  // every run submitted before: waits for them to finish on the device first.
  // INVALID_ARGUMENT when the range exceeds the buffer.
  absl::Status copy_to(const DeviceBuffer& dst, const void* src, uint64_t bytes,
                       uint64_t offset = 0);
  absl::Status copy_from(void* dst, const DeviceBuffer& src, uint64_t bytes, uint64_t offset = 0);

  // Submits a run and returns its live handle at once. HOST tensors in `args` are staged: their
  // host memory must stay valid until the run finalizes; those whose host bytes overlap share
  // one staging buffer, so tasks on them are ordered by the overlap as on DEVICE tensors. Errors
  // found here are returned here: INVALID_ARGUMENT (unknown callable handle, bad args or config, a
  // tensor outside any live allocation, a null HOST pointer), FAILED_PRECONDITION (before init /
  // after close; "lane poisoned by run N: ...", carrying base::poisoned_by; a bound buffer of the
  // callable that is no longer a live allocation, naming it), DEADLINE_EXCEEDED (no resource set by
  // the admission timeout), INTERNAL ("run N prepare: ... threw <type>: <what>" when a host-built
  // orchestration throws; recoverable), device allocation errors while staging, and the device
  // stream's refusal of this run's launch when it launched in this call ("run N launch: ..."; it
  // poisons the lane). With a capture_key (task::CallConfig): INVALID_ARGUMENT naming the argument
  // and both values when a replay's arguments break the captured signature (shape, dtype, strides,
  // a non-parameter scalar, how tensors of one memory kind overlap), FAILED_PRECONDITION naming the
  // buffer, task and argument when memory a captured graph uses at a fixed address is no longer the
  // allocation the graph was captured over (freed, or freed and allocated again at that address:
  // another device::Device::allocation_id; the graph is dropped; the next run under the key
  // captures again), and RESOURCE_EXHAUSTED when a captured run needs more tasks than the chip's
  // max_graph_tasks (here for a host-built graph; by the handle for a device-built one). Later
  // errors are the run's own, delivered by its handle. `admission_timeout_s` bounds the wait for a
  // free resource set (same timeout rules as RunHandle::wait). `on_finalized`, when set, is called
  // with the run's result once its handle is done, on the worker's lane thread (or the completion
  // poller's that reaped it: set_completion_polling), in run order, with no lock held; it must be
  // brief, and never submit to this worker or wait for its runs (the thread that retires them is
  // the one running it). A waiter may see the handle done before the call ran; close() returns only
  // after every call finished (it joins the lane thread). It is called for every run this returns a
  // handle for; for a run refused here it may or may not be. Being called delivers nothing: an
  // error only it saw still counts as undelivered at close(). An exception it throws on the lane
  // thread is caught and logged, the runs go on, and close() returns it as INTERNAL ("run N
  // on_finalized threw <type>: <what>") when no run error is undelivered; on a completion poller's
  // thread it propagates out of poll_completions.
  absl::StatusOr<RunHandle> submit(
      CallableHandle callable, const task::TaskArgs& args, const task::CallConfig& config = {},
      double admission_timeout_s = std::numeric_limits<double>::infinity(),
      std::function<void(const RunResult&)> on_finalized = {});
  // Polled completion (as io_uring's IOPOLL, where the submitter reaps by polling): while a caller
  // has it on, the worker's lane thread is not woken for runs and does not reap them; the caller
  // reaps finished runs (in run order, their on_finalized called on its thread) with
  // poll_completions(), which never blocks and returns how many runs retired. Each `true` must be
  // matched by a `false`; while its polling is on, a thread must not wait for this worker's runs
  // (RunHandle::wait, run(), copy_to/copy_from, which wait for the lane to go idle): nobody else
  // reaps them. poll_completions never waits for the device; an exception thrown by an
  // on_finalized it calls propagates out of it. For a thread that polls anyway and submits short
  // runs (an L3 child's mailbox server). After init(), before close(); thread-safe; before init()
  // or after close() set_completion_polling does nothing and poll_completions returns 0.
  void set_completion_polling(bool on);
  int32_t poll_completions();

  // Exactly submit(...) then wait().
  absl::Status run(CallableHandle callable, const task::TaskArgs& args,
                   const task::CallConfig& config = {});

  // Drains every run, closes the device and returns the first run error no
  // wait() delivered, counting the others. Idempotent: a call racing the first waits
  // until that one returned, then returns OK (so does a later call); with a deadline, a racing
  // call that outlives it returns DEADLINE_EXCEEDED while the first goes on. Never from an
  // on_finalized (the close joins the thread that runs it). A run that never
  // finishes is bounded by the operation timeout; a device thread stuck in a
  // kernel that never returns is abandoned after the device's close grace
  // (abandoned_threads(); Device::close).
  absl::Status close();
  // close(), bounded by `deadline` (the fatal path: an error is known and
  // nothing in flight is wanted any more). Runs still in flight when it
  // passes fail CANCELLED naming the first error's cause and the lane is
  // poisoned; launched ones are quarantined (their device use is unproven). `deadline` is on
  // WorkerOptions::env's clock. Returns within about the
  // deadline plus the device's close grace even when a kernel never returns:
  // such a device thread is abandoned (abandoned_threads()).
  absl::Status close(const base::Deadline& deadline);

  // Binds `buffer` to `callable`: declares that the callable's runs use the
  // buffer although it is not among their arguments (a model's weights and
  // KV pool, captured by its orchestration). A bound buffer cannot be freed
  // (free() is FAILED_PRECONDITION naming the callable) until unbind(); each
  // run of the callable protects it like an argument until the run retires.
  // After init(), before close(); thread-safe. Errors: INVALID_ARGUMENT
  // (unknown callable handle), NOT_FOUND (not a live buffer of this Worker,
  // or `buffer.bytes` differs from the allocation), ALREADY_EXISTS (already
  // bound to it), FAILED_PRECONDITION (before init / after close). A submit
  // of `callable` whose bound buffer is no longer a live allocation (freed
  // behind the Worker, e.g. through device()) is refused with
  // FAILED_PRECONDITION naming the buffer.
  absl::Status bind(CallableHandle callable, const DeviceBuffer& buffer);
  // Undoes bind(). NOT_FOUND when not bound; FAILED_PRECONDITION naming the
  // run while a run of `callable` has not retired.
  absl::Status unbind(CallableHandle callable, const DeviceBuffer& buffer);

  // Queries, thread-safe; before init() (or when init() failed) they answer zeros.
  const device::DeviceCaps& caps() const;
  ArenaCounts resources() const;
  LaneStats lane_stats() const;
  // The counts of captured graphs (CallConfig::capture_key).
  CaptureStats capture_stats() const;
  // Device threads close() had to abandon inside kernels that never returned
  // (see Device::close); 0 normally.
  int32_t abandoned_threads() const;
  const WorkerOptions& options() const;
  // The device, for layers above that need raw access (tests, benchmarks). After init() only:
  // a call before it aborts the process naming the defect.
  device::Device& device();

 private:
  // The chip, the registered callables and the buffer table (worker.cc).
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace simpler::worker
