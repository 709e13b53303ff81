// ChipRunLane: the one owner of a lane's runs. Private to the runtime (the public Worker owns
// one through its ChipWorker).
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "chip/chip_runtime.h"
#include "simpler/base/clock.h"
#include "simpler/base/env.h"
#include "simpler/base/sync.h"
#include "simpler/base/trace.h"
#include "simpler/device/device.h"
#include "simpler/task/call_config.h"
#include "simpler/task/callable.h"
#include "simpler/worker/run_handle.h"
#include "simpler/worker/worker_stats.h"
#include "worker/captured_graph_cache.h"
#include "worker/run_resource_arena.h"
#include "worker/run_shared.h"

namespace simpler::worker {

struct LaneOptions {
  // Runs launched but not complete at once (invariant 6); >= 1.
  int32_t launch_depth = 1;
  // Longest a launched run may execute once it reached the head of the device
  // stream, in seconds (finite, > 0). Past it the run fails with
  // DEADLINE_EXCEEDED, the device is aborted and the lane poisoned.
  double operation_timeout_s = 60.0;
  chip::ChipOptions chip;
  // Where task graphs are built when neither the CallConfig nor the callable
  // says (kDefault here means device-built).
  task::GraphPlacement placement = task::GraphPlacement::kDevice;
  // Optional span sink (not owned; must outlive the lane).
  base::TraceRecorder* trace = nullptr;
  // The clock operation timeouts, the poison drain window and close()'s
  // deadline are measured on (not owned; must outlive the lane); null = the
  // real one. Tests pass a base::FakeEnv.
  base::Env* env = nullptr;
  // Captured graphs kept (CallConfig::capture_key; LRU beyond it); >= 1.
  int32_t max_captured_graphs = 64;
};

// One run's lane-side state: identity, state, resource set, staged tensors,
// launch record, timing (ARCHITECTURE.md's `ChipRun`). Defined and owned by
// the lane; nothing outside it keeps a copy.
struct ChipRun;

// Owns the runs of one lane (one device stream): FIFO admission, run identity,
// prepare -> launch -> reap -> finalize -> retire, terminal states, poison,
// drain and close — all under one mutex (`mu_`). A lane thread reaps launched
// runs in order, launches successors as the depth allows and finalizes, so
// runs progress and retire whether or not anyone waits — or, while a caller
// has completion polling on (set_completion_polling), that caller does, on its
// own thread (poll_completions).
//
// Lock order: mu_ before the arena's and the stream's locks; the lane thread
// never holds mu_ while waiting on the device.
// Thread-safe.
class ChipRunLane {
 public:
  // `device`, `stream` and `arena` must outlive the lane.
  ChipRunLane(device::Device* device, device::Stream* stream, RunResourceArena* arena,
              LaneOptions options);
  ~ChipRunLane();

  // Admits a run: validates, takes a resource set (blocking until one is free
  // or `admission` passes), assigns its RunId, prepares it (stages HOST
  // tensors) and launches it when the depth allows. Returns a live handle.
  // `callable` must stay alive until the lane is closed.
  // Errors found here are returned here: INVALID_ARGUMENT (bad args/config,
  // tensor outside any live allocation, null HOST pointer), FAILED_PRECONDITION
  // ("lane poisoned by run N: ...", carrying base::poisoned_by; closed lane; a
  // bound buffer of the callable that is no longer a live allocation, naming
  // it), DEADLINE_EXCEEDED (no resource set by `admission`), INTERNAL ("run N
  // prepare: ... threw <type>: <what>" when a host-built orchestration
  // throws; recoverable), device allocation errors while staging,
  // and the stream's refusal of this run's launch when the launch happened in
  // this call ("run N launch: ..."; it poisons the lane). A launch refused
  // later (by the lane thread) is the run's error, delivered by its handle.
  // Runs launched before a refused launch finish with their own results.
  // `on_finalized`, when set, is called once the run is finalized and retired (its handle is
  // done), on the lane thread — or on the completion poller's thread that reaped it
  // (poll_completions) — with no lock held, before the next run is finalized. It must be brief
  // and must not submit to this lane or wait for its runs (the thread that retires them is the
  // one running it). Runs are retired in order, so notifications come in run order.
  absl::StatusOr<RunHandle> submit(const task::ChipCallable* callable, const task::TaskArgs& args,
                                   const task::CallConfig& config,
                                   const base::Deadline& admission = base::Deadline::forever(),
                                   std::function<void(const RunResult&)> on_finalized = {});

  // Frees device memory unless a run still uses it, as one step: returns
  // FAILED_PRECONDITION naming the callable when a bound buffer (bind())
  // overlaps [address, address + bytes), naming the run when a run that is
  // not retired names a tensor inside the range in its arguments or its
  // callable's bindings, or a quarantined run did (then until close); otherwise returns
  // `release()`, called under the lane's lock, and once it succeeded drops every captured graph
  // that uses the range at a fixed address (the next submit under its key captures again). A submit
  // that checked its tensors before the free and registers its run after it re-checks them at
  // prepare and is refused, so no run ever executes on freed memory.
  absl::Status release_if_unused(uint64_t address, uint64_t bytes,
                                 absl::FunctionRef<absl::Status()> release);

  // Declares that `callable` reads or writes device memory [address, address
  // + bytes) that it captured rather than receiving it as an argument (e.g. a
  // model's weights and KV pool). While bound, the buffer cannot be freed
  // (release_if_unused refuses it, naming the callable), and every run of
  // `callable` protects it like an argument tensor until the run retires (or,
  // once quarantined, until close). Errors: INVALID_ARGUMENT (no callable, 0
  // bytes, a range outside any live allocation), ALREADY_EXISTS (the same
  // address is bound to `callable`), FAILED_PRECONDITION (closed lane).
  absl::Status bind(const task::ChipCallable* callable, uint64_t address, uint64_t bytes);
  // Undoes bind(). NOT_FOUND when `address` is not bound to `callable`;
  // FAILED_PRECONDITION naming the run when a run of `callable` has not
  // retired (it may still use the buffer).
  absl::Status unbind(const task::ChipCallable* callable, uint64_t address);

  // Polled completion (as io_uring's IOPOLL, where the submitter reaps by polling): while at least
  // one caller has it on, submit() does not wake the lane thread and the lane thread leaves
  // launched runs alone; the callers reap them with poll_completions(). This takes a thread
  // hand-off (and on a machine with few CPUs a polling lane thread competing for the CPU) out of
  // a short run's path when a thread polls anyway (an L3 child's mailbox server;
  // docs/benchmarks.md). Calls nest (counted); every set_completion_polling(true) must
  // be matched by a false, which wakes the lane thread when runs are left. The lane thread still
  // reaps while the lane closes and while a submit waits for a resource set, so a poller that
  // blocks in submit or stops polling cannot stall the lane; a run that never finishes is
  // noticed only once polling is off (its operation timeout is the lane thread's). While its
  // polling is on, a thread must not wait for this lane's runs (RunHandle::wait, wait_idle, and
  // the Worker calls built on them): nobody else reaps them. Thread-safe.
  void set_completion_polling(bool on);
  // Reaps, finalizes and retires, on the calling thread and in run order, the head runs whose
  // device work is done (and runs already terminal at the head), launching successors as the
  // depth allows; returns how many retired. Never waits for the device: returns 0 when another
  // thread holds the lane's lock or is retiring the head; what it does per run is the lane
  // thread's (HOST copy-back, the resource set's release, a successor's launch, an abort on a
  // device fault) plus that run's `on_finalized`, called here with no lock held — so the caller
  // must not hold anything that callback takes. An exception thrown by `on_finalized`
  // propagates out of this call (its run is retired; the count of this call is lost).
  // Thread-safe.
  int32_t poll_completions();

  // Waits until every run admitted so far has finished on the device.
  void wait_idle();

  // Refuses new submits, drains every admitted run (each bounded by the
  // operation timeout), stops the lane thread. Returns the first error in run
  // order that no wait()/result() delivered, with the count of the other
  // undelivered ones in its message; OK when there is none. Idempotent (later
  // calls, and calls racing the first, wait for it and return OK).
  absl::Status close();
  // close() bounded by `deadline` (on LaneOptions::env's clock): runs still in flight when it
  // passes fail with CANCELLED ("run N cancelled: the lane was closed at its close deadline with
  // the run still in flight; first error: run M: ..."), those launched are quarantined (their
  // device use is unproven), the lane is poisoned with that cause and the device aborted. Returns
  // within about 100 ms of the deadline (a 50 ms wait slice, then one 50 ms grace shared by the
  // launched runs for the device to drop what the abort stopped: a run proven done then is not
  // quarantined) even when a kernel never returns — except while a submitter
  // is still inside prepare (a host-built orchestration that does not return): its run belongs to
  // the submitter until prepare ends.
  absl::Status close(const base::Deadline& deadline);

  LaneStats stats() const;
  CaptureStats capture_stats() const;
  // The poison cause, OK when the lane is healthy.
  absl::Status poison() const;
  int32_t launch_depth() const { return options_.launch_depth; }

 private:
  // The lane thread's loop: reap the head run, finalize it, retire it.
  void lane_loop();
  // Waits (outside mu_) for the launched head run to end on the device,
  // bounded by its operation timeout, and gives it its terminal state.
  // `known_done`: the run's record is signalled, so nothing is awaited (mu_ stays held).
  void reap_locked(ChipRun& run, bool known_done) SIMPLER_REQUIRES(mu_);
  // Finalizes the terminal head run (mu_ released meanwhile and retaken, as in reap_locked),
  // retires it and calls its on_finalized with no lock held; the caller set head_claimed_,
  // cleared here once all of that is done (also when on_finalized throws, which is rethrown).
  // An exception its on_finalized throws propagates (a completion poller's), or, with
  // `keep_callback_errors` (the lane thread's), is kept for close() (callback_error_).
  void retire_claimed_head_locked(bool keep_callback_errors = false) SIMPLER_REQUIRES(mu_);
  // Clears head_claimed_ and wakes whoever waits for it (the lane thread, close()).
  void release_head_claim_locked() SIMPLER_REQUIRES(mu_);
  // Whether the lane thread leaves a launched head to completion pollers.
  bool left_to_pollers_locked() const SIMPLER_REQUIRES(mu_);
  absl::Status reaped_status_locked(ChipRun& run, bool done, const device::LaunchRecord& rec,
                                    double timeout_s) SIMPLER_REQUIRES(mu_);
  // Copies a terminal run's results into its handle's result (outside mu_:
  // the head run is terminal, so nothing else acts on it).
  void finalize(ChipRun& run);
  // Pops the finalized head run, gives its resource set back (or quarantines
  // it) and publishes its completion.
  void retire_head_locked() SIMPLER_REQUIRES(mu_);
  void set_state_locked(ChipRun& run, RunState state, absl::Status status = absl::OkStatus())
      SIMPLER_REQUIRES(mu_);
  void launch_ready_locked() SIMPLER_REQUIRES(mu_);
  int32_t launched_on_device_locked() const SIMPLER_REQUIRES(mu_);
  // Poisons the lane with `cause` of run `run` (unrecoverable): "lane poisoned
  // by run N: ...". The earliest such run names the poison.
  void poison_locked(uint64_t run, const absl::Status& cause) SIMPLER_REQUIRES(mu_);
  // Whether run `run` was launched behind the run that poisoned the lane
  // (runs launched before it finish with their own results).
  bool behind_poison_locked(uint64_t run) const SIMPLER_REQUIRES(mu_);
  // Waits for `rec` until `deadline`; true when it completed. Lane thread only.
  bool await_record(device::LaunchRecord& rec, int64_t expected_end,
                    const base::Deadline& deadline);
  // rec.done.wait(deadline), returning early (with whether the record is
  // done) once close() set interrupt_. Lane thread only.
  bool wait_record(device::LaunchRecord& rec, const base::Deadline& deadline);
  // After close()'s deadline: whether `rec` is done within what is left of the
  // shared grace window. Lane thread only.
  bool interrupted_wait(device::LaunchRecord& rec);
  void expire_close_locked() SIMPLER_REQUIRES(mu_);
  // The CANCELLED status of run `run` when close()'s deadline passed.
  absl::Status cancel_status_locked(uint64_t run) const SIMPLER_REQUIRES(mu_);
  std::string cancel_cause_locked() const SIMPLER_REQUIRES(mu_);
  // submit's steps, in order. acquire_set: a resource set by `admission` (the lane thread
  // reaps meanwhile, pollers or not). fill_records: the run's records in its set, for this
  // call (gives the set back on error). admit_locked: refused (giving the set back) when the
  // lane is closed or poisoned or a bound buffer of `callable` is not live; else assigns the
  // RunId and moves `run` into runs_. prepare_timed: prepare() outside mu_, an exception
  // turned into its error, timed and traced. launch_prepared: the run's state after
  // `prepared`, a launch attempt, and a wake of the lane thread unless pollers reap; returns
  // what submit returns for the run.
  absl::StatusOr<base::SlotRef> acquire_set(const base::Deadline& admission);
  absl::Status fill_records(ChipRun& run, const task::ChipCallable* callable,
                            const task::TaskArgs& args, const task::CallConfig& config);
  absl::Status admit_locked(std::unique_ptr<ChipRun>& run, const task::ChipCallable* callable)
      SIMPLER_REQUIRES(mu_);
  absl::Status prepare_timed(ChipRun& run);
  absl::Status launch_prepared(ChipRun& run, absl::Status prepared);
  absl::Status prepare(ChipRun& run);
  // Stages the run's HOST tensors (non-empty ones) in its set's staging buffers, copying the
  // inputs in; returns how many buffers it used. Tensors whose host byte ranges overlap share one
  // buffer covering their union, so their device views overlap as the host ones do and the
  // TensorMap orders the tasks on them.
  absl::StatusOr<size_t> stage_host_tensors(ChipRun& run);
  // Capture and replay (docs/design/capture_replay.md). admit_capture_locked: a run with a
  // capture key replays its cached graph (binding checked, fixed ranges checked live and
  // protected) or is marked capturing. stale_fixed_memory: FAILED_PRECONDITION naming the first
  // fixed range of `graph` that is no longer the allocation the graph recorded (freed, or freed
  // and allocated again: another Device::allocation_id), or, with an `epoch` (not 0), one
  // allocated at or after it. prepare_replay: binds the graph and, host-built, places
  // its image. build_capture: the capturing run's graph from its recording (probing declared
  // scalar parameters). place_image: a graph image into the run's staging slot `index`.
  absl::Status admit_capture_locked(ChipRun& run, const task::ChipCallable* callable)
      SIMPLER_REQUIRES(mu_);
  absl::Status stale_fixed_memory(const chip::CapturedGraph& graph, uint64_t epoch) const;
  absl::Status prepare_replay(ChipRun& run, size_t staged);
  absl::StatusOr<std::shared_ptr<const chip::CapturedGraph>> build_capture(
      ChipRun& run, chip::GraphRecording recording);
  absl::Status place_image(ChipRun& run, size_t index, const std::vector<uint8_t>& image);
  // The cores a run with `max_cores` may use (what its orchestration sees).
  int32_t cores_for(int32_t max_cores) const;
  void span(const char* name, int64_t start, int64_t end, uint64_t run, int32_t tid) const;

  device::Device* device_;
  device::Stream* stream_;
  RunResourceArena* arena_;
  const LaneOptions options_;
  base::Env& env_;

  mutable base::Mutex mu_;
  base::CondVar cv_;       // close() waiters: a run retired / the lane closed
  base::CondVar lane_cv_;  // the lane thread: a run to reap, launch or retire; closing
  // Completion pollers (set_completion_polling) and submits waiting for a resource set.
  int32_t completion_pollers_ SIMPLER_GUARDED_BY(mu_) = 0;
  int32_t admission_waiters_ SIMPLER_GUARDED_BY(mu_) = 0;
  // A thread (the lane thread or a poller) is reaping / finalizing / retiring the head run:
  // the head's only owner until it is retired and its on_finalized returned.
  bool head_claimed_ SIMPLER_GUARDED_BY(mu_) = false;
  std::deque<std::unique_ptr<ChipRun>> runs_ SIMPLER_GUARDED_BY(mu_);  // admitted, not retired
  uint64_t next_id_ SIMPLER_GUARDED_BY(mu_) = 0;
  int32_t launched_ SIMPLER_GUARDED_BY(mu_) = 0;
  // launched_, for the lane thread to read while it waits outside mu_.
  // Relaxed: a hint for whether to take a second look; publishes nothing.
  std::atomic<int32_t> launched_now_{0};
  absl::Status poison_ SIMPLER_GUARDED_BY(mu_);
  uint64_t poisoned_by_ SIMPLER_GUARDED_BY(mu_) = 0;  // the run whose error set poison_
  // Runs launched behind the poisoning run wait for the device until then.
  base::Deadline behind_poison_deadline_ SIMPLER_GUARDED_BY(mu_);
  bool closing_ SIMPLER_GUARDED_BY(mu_) = false;
  bool close_expired_ SIMPLER_GUARDED_BY(mu_) = false;    // close(deadline) passed
  int64_t close_expired_ns_ SIMPLER_GUARDED_BY(mu_) = 0;  // when (now_ns)
  // Set (release) once close()'s deadline passed: the lane thread stops
  // waiting for the device (acquire).
  std::atomic<bool> interrupt_{false};
  // Ends the shared grace window of interrupted_wait (now_ns), set before interrupt_.
  std::atomic<int64_t> interrupt_grace_end_ns_{0};
  static constexpr int64_t kInterruptGraceNs = 50'000'000;
  // The lane's first failed run's error (in retire order), for cancellation
  // messages. Never reset: whether a failed run and a later one were "in
  // flight together" depends on timing (a short run can retire before the
  // next submit), and a close's message must not.
  absl::Status first_error_ SIMPLER_GUARDED_BY(mu_);
  uint64_t first_error_run_ SIMPLER_GUARDED_BY(mu_) = 0;
  // Device buffers bound to callables (bind()): callable -> (address, bytes).
  std::unordered_map<const task::ChipCallable*, std::vector<std::pair<uint64_t, uint64_t>>>
      bindings_ SIMPLER_GUARDED_BY(mu_);
  bool closed_ SIMPLER_GUARDED_BY(mu_) = false;
  CapturedGraphCache graphs_ SIMPLER_GUARDED_BY(mu_);
  uint64_t retired_ SIMPLER_GUARDED_BY(mu_) = 0;
  std::vector<std::shared_ptr<RunShared>> failed_ SIMPLER_GUARDED_BY(mu_);
  // The first exception an on_finalized threw on the lane thread, as a status, and how many did:
  // close() returns it when no run error is undelivered.
  absl::Status callback_error_ SIMPLER_GUARDED_BY(mu_);
  int64_t callback_errors_ SIMPLER_GUARDED_BY(mu_) = 0;
  // [begin, end) device ranges named by retired-but-quarantined runs, with the run id.
  std::vector<std::pair<uint64_t, std::pair<uint64_t, uint64_t>>> quarantined_ranges_
      SIMPLER_GUARDED_BY(mu_);
  std::atomic<uint64_t> device_polls_{0};
  // Reap prediction: each callable's device run time (quick to follow
  // shorter runs, slow to follow longer ones; see lane_loop) and the last
  // observed device end, both in ns.
  std::unordered_map<const task::ChipCallable*, int64_t> run_ns_estimate_ SIMPLER_GUARDED_BY(mu_);
  int64_t last_device_end_ns_ SIMPLER_GUARDED_BY(mu_) = 0;
  int64_t timer_lateness_ns_ = 0;  // lane thread only
  std::thread thread_;
};

}  // namespace simpler::worker
