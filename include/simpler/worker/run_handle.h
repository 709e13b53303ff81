// RunHandle: the caller's live view of one submitted run.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "simpler/base/event.h"
#include "simpler/base/ids.h"
#include "simpler/chip/chip_runtime.h"

namespace simpler::worker {

// Lifecycle of a run (ARCHITECTURE.md "Run lifecycle"). The lane tracks a run
// through ACCEPTED .. a terminal state, then finalizes and retires it in one
// step without naming those two states; a RunHandle shows ACCEPTED, PREPARED
// and LAUNCHED while the run is not done, then RETIRED (see
// RunHandle::state()); the terminal state it reached is
// RunResult::terminal_state. FINALIZED names the architecture's stage and is
// never reported.
enum class RunState : uint8_t {
  kAccepted,   // identity assigned
  kPrepared,   // resources granted, arguments staged
  kLaunched,   // on the device stream
  kCompleted,  // terminal: device finished it successfully
  kFailed,     // terminal: it failed (its own error or lane poison)
  kCancelled,  // terminal: never launched (lane poisoned or closed first)
  kFinalized,  // results, timing and error copied into the handle
  kRetired,    // resource set back (free or quarantined)
};
std::string_view name_of(RunState state);

// Host and device timestamps of one run, steady-clock ns (base::now_ns()).
// 0 = the step did not happen.
struct RunTiming {
  int64_t submit_ns = 0;
  int64_t prepare_start_ns = 0;
  int64_t prepare_end_ns = 0;
  int64_t launch_ns = 0;
  int64_t device_start_ns = 0;  // device scheduler started the run
  int64_t device_end_ns = 0;    // device scheduler finished it
  int64_t complete_ns = 0;      // the host observed completion (reap)
  int64_t finalize_ns = 0;
};

// What a finished run reports.
struct RunResult {
  base::RunId id;
  // The resource set the run held (index and generation): with `id`, the
  // run's full identity. Every lane operation on the set names this
  // generation and a stale one is refused (ARCHITECTURE.md invariant 10).
  base::SlotRef resource_set;
  absl::Status status;
  RunState terminal_state = RunState::kCompleted;
  RunTiming timing;
  chip::RunReport report;  // tasks submitted/completed and per-task device timing
  int32_t requested_depth = 1;
  // Runs on the device stream when this run launched, itself included: 1 +
  // earlier runs launched and not yet finished by the device (their launch
  // records unsignalled). In [1, requested_depth]; 0 = never launched.
  int32_t effective_depth = 0;
};

// What wait() and result() do while they poll a run before sleeping (RunShared::progress): they
// call poll() between looks, yielding the CPU, for poll_window_ns() (at most the wait's timeout),
// between begin_window() and end_window(), then sleep on the run's event; a poll-once wait, or
// a window of 0, calls poll() once and opens no window. Implementations are thread-safe; poll()
// never blocks; end_window() may wait briefly for a collection in progress on another thread,
// and whatever the run's completion sets off (an L3 scheduler's next dispatch) may run on the
// waiter's thread inside these calls, before wait() returns.
class RunProgress {
 public:
  virtual ~RunProgress() = default;
  // Moves the run toward completion on the calling thread and returns at once.
  virtual void poll() = 0;
  // A waiter's poll window opens / closes on the calling thread (windows of several waiters may
  // overlap). While one is open, whatever would otherwise be woken to finish the run may stay
  // asleep (an L3 child endpoint's collector thread); end_window() makes sure nothing that
  // finished meanwhile is left for a thread that was not woken (it may collect, briefly waiting
  // for a collection in progress). Called once each per window, end_window() also when the run
  // finished within it.
  virtual void begin_window() = 0;
  virtual void end_window() = 0;
  // How long this wait polls before sleeping, in ns (0: sleep at once; at most ~50 µs —
  // ARCHITECTURE.md invariant 9, no waiter spins without bound).
  virtual int64_t poll_window_ns() = 0;
  // How a full poll window ended: whether the run finished within it.
  virtual void polled(bool finished) = 0;
};

// State shared by a run's lane entry and its handles. Internal.
struct RunShared {
  base::RunId id;
  // Progress while not done: ACCEPTED, PREPARED or LAUNCHED (release by the
  // lane, acquire by state()). Never a later state: done-ness is `finalized`.
  std::atomic<RunState> state{RunState::kAccepted};
  // Signalled at finalize (release); `result` is written before it and is
  // immutable after.
  base::Event finalized;
  RunResult result;
  std::atomic<bool> delivered{false};
  // Optional: how a waiter moves this run toward completion on its own thread (an L3 run's
  // waiter collects its children's finished tasks, so the run's end reaches it without two thread
  // hand-offs: hierarchy/l3_worker.h). Set before the first handle exists; never changed.
  std::shared_ptr<RunProgress> progress;
};

// A live handle to one run. Copyable; all copies view the same run. The run
// finalizes whether or not anyone waits (dropping every handle is fine; close()
// then reports an error nobody received). Thread-safe.
class RunHandle {
 public:
  RunHandle() = default;
  explicit RunHandle(std::shared_ptr<RunShared> shared) : shared_(std::move(shared)) {}

  // False for a default-constructed (empty) handle. On an empty handle every
  // call is still defined: id() is RunId{0}, done() is true (there is nothing
  // to wait for), state() is CANCELLED, wait() and result().status are
  // FAILED_PRECONDITION ("... empty RunHandle").
  bool valid() const { return shared_ != nullptr; }
  base::RunId id() const { return shared_ ? shared_->id : base::RunId{}; }
  // True once the run is finalized and retired (its result is available).
  bool done() const { return !shared_ || shared_->finalized.is_signaled(); }
  // The run's progress: ACCEPTED, PREPARED or LAUNCHED while not done();
  // RETIRED once done() (how it ended: result().terminal_state). One
  // publication order makes the two agree for every observer: the lane
  // writes the result, retires the run and then signals `finalized`
  // (release); state() reads RETIRED only from that signal (acquire). So a
  // thread that reads RETIRED then calls done() gets true, and done() never
  // turns false again. (A state read first may still be LAUNCHED while a
  // done() read after it is already true: the run finished in between.)
  RunState state() const {
    if (!shared_) return RunState::kCancelled;
    if (shared_->finalized.is_signaled()) return RunState::kRetired;
    return shared_->state.load(std::memory_order_acquire);
  }

  // Waits for the run to finalize and returns its status, delivering it (an
  // error delivered here is not reported again by Worker::close()).
  // `timeout_s` in seconds: NaN -> INVALID_ARGUMENT; +inf or beyond the clock's
  // range -> forever; negative -> poll once. When the run is not done by then:
  // DEADLINE_EXCEEDED ("run N not finished after T s"); the run is left alone
  // and nothing is delivered. Sleeps on an event. A run with a RunProgress (an
  // L3 run) is first polled, yielding the CPU between looks, for its poll
  // window (at most the timeout); a negative timeout polls it once.
  absl::Status wait(double timeout_s) const;
  absl::Status wait() const;  // forever

  // Waits forever, then returns the full result (delivering its status as
  // wait() does). The status is also inside RunResult::status.
  const RunResult& result() const;

 private:
  std::shared_ptr<RunShared> shared_;
};

// close()'s report (ARCHITECTURE.md invariant 4): of the failed runs in `failed` (in run
// order), those whose error no wait() / result() delivered are marked delivered, and the first
// one's status is returned with the count of the others in its message ("... (and 2 more
// undelivered run errors)"), payloads kept; OK when every error was delivered. Clears `failed`.
// Not thread-safe with respect to `failed`; the delivered flags are atomic.
absl::Status report_undelivered(std::vector<std::shared_ptr<RunShared>>* failed);

}  // namespace simpler::worker
