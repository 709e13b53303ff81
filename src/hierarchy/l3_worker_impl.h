// L3Worker::Impl: the state behind the public L3Worker (simpler/hierarchy/l3_worker.h) — the
// children's endpoints, the shared host heap, the runs in flight with their tasks and TensorMap,
// the per-child dispatch queues and the sub-task pool. Private to the runtime.
//
// l3_worker_impl.cc holds the lifecycle (init, close), the host heap and the calls into one
// child; l3_scheduler.cc holds the scheduler: orchestration, dependencies, dispatch, completion
// and retirement in run order.
//
// The scheduler is a monitor, not a thread: whoever brings news — the caller's submit(), an
// endpoint's completion, a sub-task's end — takes mu_ and advances the runs itself (retires the
// finished ones, orchestrates queued runs while the launch depth allows, dispatches ready
// tasks). No hand-off to a scheduler thread sits on a run's path.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "base/poll.h"
#include "base/work_queue.h"
#include "chip/tensor_map.h"
#include "hierarchy/endpoint.h"
#include "simpler/base/sync.h"
#include "simpler/base/thread_annotations.h"
#include "simpler/hierarchy/l3_worker.h"
#include "worker/run_shared.h"

namespace simpler::hierarchy {

// Which Impl this thread is orchestrating for (an orchestration runs with mu_ held): L3Context
// calls are checked against it, and the worker's own API refuses to be called from inside.
inline thread_local const void* t_orchestrating = nullptr;

// What a thread waiting on an L3 run does between looks (RunShared::progress): collects the
// children's finished tasks itself (Endpoint::poll), so a run's end reaches its waiter without
// two thread hand-offs (child endpoint thread -> scheduler -> waiter) — on a machine with few
// CPUs each one is a sleeping thread's wake-up (docs/benchmarks.md). Shared with the runs'
// handles, which may outlive the worker: close() detaches the endpoints first, waiting for a
// poll in progress. While any waiter's poll window is open the endpoints' own threads are not
// woken for finished runs (Endpoint::set_waiter_polling): a sleeping collector woken for a run
// its waiter is about to collect anyway costs the child a system call and puts a third runnable
// thread on a machine with few CPUs (docs/benchmarks.md). Thread-safe.
class ChildPoller {
 public:
  explicit ChildPoller(std::vector<Endpoint*> endpoints) : endpoints_(std::move(endpoints)) {}

  void poll();
  // A waiter's poll window opens / closes (windows of several waiters overlap; the endpoints
  // hear of the first opening and the last closing, which collects once per endpoint).
  void begin_window();
  void end_window();
  // The endpoints' threads collect again (and wait for close()'s drain) from here on.
  void detach();

 private:
  // Clears every endpoint's flag even when a collection it runs throws (the first exception is
  // rethrown after): a flag left set would leave that endpoint's thread unwoken.
  static void stop_polling(const std::vector<Endpoint*>& endpoints);

  base::Mutex mu_;
  std::vector<Endpoint*> endpoints_ SIMPLER_GUARDED_BY(mu_);
  int32_t windows_ SIMPLER_GUARDED_BY(mu_) = 0;  // poll windows open now
};

// How long a waiter on an L3 run polls the children before sleeping (ns).
inline constexpr int64_t kWaitPollNs = 50'000;

// The RunProgress of one program's runs: polls the children while that pays off for this
// program (base::AdaptivePoll: a program whose runs outlast the window has its waiters sleep at
// once, woken by the child endpoint's thread — a poller left runnable next to a computing device
// thread would wait out that thread's time slice). Thread-safe.
class ProgramProgress final : public worker::RunProgress {
 public:
  explicit ProgramProgress(std::shared_ptr<ChildPoller> children)
      : children_(std::move(children)) {}
  void poll() override { children_->poll(); }
  void begin_window() override { children_->begin_window(); }
  void end_window() override { children_->end_window(); }
  int64_t poll_window_ns() override { return adaptive_.window_ns(); }
  void polled(bool finished) override { adaptive_.polled(finished); }

 private:
  const std::shared_ptr<ChildPoller> children_;
  base::AdaptivePoll adaptive_{kWaitPollNs};
};

// Owned by its L3Worker. Registration (the public fields) before init() on the caller's thread;
// everything else thread-safe, under mu_ where it says SIMPLER_REQUIRES(mu_).
class L3Worker::Impl {
 public:
  explicit Impl(const L3Options& options) : options_(options) {}

  // ---- registration ----
  std::vector<task::ChipCallable> callables;
  std::vector<std::pair<std::string, SubFn>> subs;
  std::vector<L3Program> programs;
  std::vector<std::function<absl::Status(int32_t, worker::Worker&)>> setups;

  absl::Status check_registration(const char* what) const;
  // FAILED_PRECONDITION when called from one of this worker's orchestrations (it holds mu_).
  absl::Status check_not_orchestrating(const char* what) const;

  // ---- lifecycle (l3_worker_impl.cc) ----
  absl::Status init();
  absl::Status close();

  // ---- host heap ----
  absl::StatusOr<HostBuffer> create_buffer(uint64_t bytes);
  absl::Status free_buffer(const HostBuffer& b);

  // ---- one child ----
  absl::StatusOr<worker::DeviceBuffer> child_malloc(int32_t child, uint64_t bytes);
  absl::Status child_free(int32_t child, const worker::DeviceBuffer& buffer);
  absl::Status copy_child(bool to_child, int32_t child, const worker::DeviceBuffer& device,
                          const HostBuffer& host, uint64_t bytes, uint64_t offset);
  std::vector<std::string> describe_children() const;
  uint64_t next_level_dispatched() const { return dispatched_.load(std::memory_order_relaxed); }

  // ---- runs (l3_scheduler.cc) ----
  absl::StatusOr<worker::RunHandle> submit(ProgramHandle program, const task::TaskArgs& args);

 private:
  struct Queued {
    uint32_t program;
    task::TaskArgs args;
    std::shared_ptr<worker::RunShared> shared;
  };
  struct SubJob {
    uint64_t task;
    uint32_t fn;
    task::TaskArgs args;
  };

  // One task of a run in flight.
  struct Task {
    size_t run = 0;      // index into runs_ (RunCtx) at submission: RunCtx::seq
    int32_t child = -1;  // -1: a host sub-task
    uint32_t fn = 0;     // callable or sub index
    uint32_t index = 0;  // the task's index in its run
    task::TaskArgs args;
    task::CallConfig config;
    int32_t waiting = 0;  // unfinished dependencies
    std::vector<uint64_t> dependents;
    bool dispatched = false;
    bool done = false;
    absl::Status status;
    worker::RunHandle handle;
  };
  // One L3 run in flight: orchestrated (or being orchestrated) and not finalized.
  struct RunCtx {
    uint64_t seq = 0;  // the run's id
    Queued queued;
    bool orchestrated = false;
    absl::Status orchestration;
    int64_t unfinished = 0;
    std::vector<uint64_t> tasks;  // task ids in task order
  };

  // The orchestration's view while one run is orchestrated (with mu_ held, on the thread that
  // advanced the runs). Valid only during its orchestration call, on that call's thread.
  class Exec final : public L3Context {
   public:
    Exec(Impl& impl, RunCtx& run) : impl_(impl), run_(run) {}
    absl::StatusOr<uint32_t> submit_next_level(ChildCallable callable, const task::TaskArgs& args,
                                               int32_t child,
                                               const task::CallConfig& config) override;
    absl::StatusOr<uint32_t> submit_sub(SubHandle fn, const task::TaskArgs& args) override;
    int32_t num_children() const override {
      return static_cast<int32_t>(impl_.options_.device_ids.size());
    }

   private:
    absl::Status check_context() const;
    Impl& impl_;
    RunCtx& run_;
  };

  // ---- init steps (l3_worker_impl.cc) ----
  // Maps the shared host heap (children inherit it at the same address).
  absl::Status map_heap();
  // Starts every child (process children forked while this process is single-threaded).
  absl::StatusOr<std::vector<std::unique_ptr<Endpoint>>> start_children();
  // The waiters' poller over the endpoints and each program's RunProgress; the endpoints'
  // completion callbacks; the sub-task threads.
  void start_polling();
  void start_threads();
  absl::Status close_children();

  absl::Status check_child(int32_t child) const;
  bool in_heap_locked(uint64_t address, uint64_t bytes) const SIMPLER_REQUIRES(mu_);
  bool initialized() const { return initialized_.load(std::memory_order_acquire); }
  // A child's endpoint; children_ does not change between init() and close().
  Endpoint& endpoint(int32_t child) const SIMPLER_NO_THREAD_SAFETY_ANALYSIS {
    return *children_[child];
  }

  // ---- scheduler (l3_scheduler.cc) ----
  // The host heap ranges `args` name, kept until run `seq` finalizes (free_buffer checks them).
  void note_ranges_locked(uint64_t seq, const task::TaskArgs& args) SIMPLER_REQUIRES(mu_);
  std::string name_task(const Task& k) const;
  RunCtx* run_of_locked(uint64_t seq) SIMPLER_REQUIRES(mu_);
  uint32_t add_task_locked(RunCtx& run, int32_t child, uint32_t fn, const task::TaskArgs& args,
                           const task::CallConfig& config) SIMPLER_REQUIRES(mu_);
  // The dependencies of task `id` (of `child`, -1 for a sub-task) on the tasks in flight, from
  // the TensorMap; sorted, without repeats.
  std::vector<uint64_t> dependencies_locked(uint64_t id, uint64_t seq, int32_t child,
                                            const task::TaskArgs& args) SIMPLER_REQUIRES(mu_);
  void try_dispatch_child_locked(int32_t child) SIMPLER_REQUIRES(mu_);
  void dispatch_locked(uint64_t id) SIMPLER_REQUIRES(mu_);
  void on_child_done_locked(int32_t child, uint64_t run) SIMPLER_REQUIRES(mu_);
  void finish_locked(uint64_t id, const absl::Status& status) SIMPLER_REQUIRES(mu_);
  void advance_locked() SIMPLER_REQUIRES(mu_);
  // Runs the orchestration of the run just moved in flight, on this thread.
  void orchestrate_locked(RunCtx& r) SIMPLER_REQUIRES(mu_);
  void retire_finished_locked() SIMPLER_REQUIRES(mu_);
  // Writes the finished front run's result (status: its first failed task in task order).
  absl::Status finalize_result_locked(RunCtx& r) SIMPLER_REQUIRES(mu_);
  void sub_loop();

  const L3Options options_;
  bool started_ = false;  // init() began: registration is over (caller's thread)
  std::vector<std::thread> sub_threads_;

  base::Mutex mu_;
  base::CondVar cv_;
  // Set once the children run (init), cleared when they are closed; children_ is fixed between.
  std::atomic<bool> initialized_{false};
  std::vector<std::unique_ptr<Endpoint>> children_ SIMPLER_GUARDED_BY(mu_);
  std::shared_ptr<ChildPoller> poller_ SIMPLER_GUARDED_BY(mu_);  // set in init, with children_
  std::vector<std::shared_ptr<ProgramProgress>> progress_ SIMPLER_GUARDED_BY(mu_);  // by program
  std::deque<Queued> queue_ SIMPLER_GUARDED_BY(mu_);
  uint64_t next_run_ SIMPLER_GUARDED_BY(mu_) = 0;
  bool ready_ SIMPLER_GUARDED_BY(mu_) = false;
  bool closing_ SIMPLER_GUARDED_BY(mu_) = false;
  bool closed_ SIMPLER_GUARDED_BY(mu_) = false;
  bool close_done_ SIMPLER_GUARDED_BY(mu_) = false;
  int64_t queued_or_running_ SIMPLER_GUARDED_BY(mu_) = 0;  // submitted, not finalized
  std::atomic<uint64_t> dispatched_{0};
  // Runs in flight (orchestrated, not finalized), their tasks by id, the TensorMap over all of
  // them, each child's queue of next-level tasks not yet dispatched, each child's dispatched
  // and unfinished tasks, and child run -> task.
  std::deque<RunCtx> inflight_ SIMPLER_GUARDED_BY(mu_);
  std::map<uint64_t, Task> tasks_ SIMPLER_GUARDED_BY(mu_);
  uint64_t next_task_ SIMPLER_GUARDED_BY(mu_) = 0;
  chip::TensorMap map_ SIMPLER_GUARDED_BY(mu_);
  std::vector<std::deque<uint64_t>> child_queue_ SIMPLER_GUARDED_BY(mu_);
  std::vector<int64_t> child_in_flight_ SIMPLER_GUARDED_BY(mu_);
  std::map<std::pair<int32_t, uint64_t>, uint64_t> by_child_run_ SIMPLER_GUARDED_BY(mu_);
  std::vector<std::shared_ptr<worker::RunShared>> failed_ SIMPLER_GUARDED_BY(mu_);
  uint8_t* heap_ SIMPLER_GUARDED_BY(mu_) = nullptr;            // set in init, cleared in close
  std::map<uint64_t, uint64_t> free_ SIMPLER_GUARDED_BY(mu_);  // offset -> bytes
  std::map<uint64_t, uint64_t> used_ SIMPLER_GUARDED_BY(mu_);
  // Heap ranges [begin, end) each run that has not finalized names (its args and its tasks').
  std::map<uint64_t, std::vector<std::pair<uint64_t, uint64_t>>> named_ SIMPLER_GUARDED_BY(mu_);
  base::WorkQueue<SubJob> sub_jobs_;  // for the sub-task threads
};

}  // namespace simpler::hierarchy
