// RunShared and RunProgress: the state a run's lane entry shares with its RunHandles, and how a
// waiter moves a run toward completion. Private to the runtime (worker, hierarchy); the public
// face is simpler/worker/run_handle.h.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "simpler/base/event.h"
#include "simpler/base/ids.h"
#include "simpler/worker/run_handle.h"

namespace simpler::worker {

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

// State shared by a run's lane entry and its handles.
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

// close()'s report (ARCHITECTURE.md invariant 4): of the failed runs in `failed` (in run
// order), those whose error no wait() / result() delivered are marked delivered, and the first
// one's status is returned with the count of the others in its message ("... (and 2 more
// undelivered run errors)"), payloads kept; OK when every error was delivered. Clears `failed`.
// Not thread-safe with respect to `failed`; the delivered flags are atomic.
absl::Status report_undelivered(std::vector<std::shared_ptr<RunShared>>* failed);

}  // namespace simpler::worker
