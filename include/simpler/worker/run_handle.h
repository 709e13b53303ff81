// RunHandle: the caller's live view of one submitted run.
#pragma once

#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "simpler/base/ids.h"
#include "simpler/chip/run_report.h"

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

// State shared by a run's lane entry and its handles; defined by the runtime (private).
struct RunShared;

// A live handle to one run. Copyable; all copies view the same run. The run
// finalizes whether or not anyone waits (dropping every handle is fine; close()
// then reports an error nobody received). Thread-safe.
class RunHandle {
 public:
  RunHandle() = default;
  // A handle on `shared` (the runtime makes these; RunShared is private to it).
  explicit RunHandle(std::shared_ptr<RunShared> shared);

  // False for a default-constructed (empty) handle. On an empty handle every
  // call is still defined: id() is RunId{0}, done() is true (there is nothing
  // to wait for), state() is CANCELLED, wait() and result().status are
  // FAILED_PRECONDITION ("... empty RunHandle").
  bool valid() const { return shared_ != nullptr; }
  base::RunId id() const;
  // True once the run is finalized and retired (its result is available).
  bool done() const;
  // The run's progress: ACCEPTED, PREPARED or LAUNCHED while not done();
  // RETIRED once done() (how it ended: result().terminal_state). One
  // publication order makes the two agree for every observer: the lane
  // writes the result, retires the run and then signals `finalized`
  // (release); state() reads RETIRED only from that signal (acquire). So a
  // thread that reads RETIRED then calls done() gets true, and done() never
  // turns false again. (A state read first may still be LAUNCHED while a
  // done() read after it is already true: the run finished in between.)
  RunState state() const;

  // Waits for the run to finalize and returns its status, delivering it (an
  // error delivered here is not reported again by Worker::close()).
  // `timeout_s` in seconds: NaN -> INVALID_ARGUMENT; +inf or beyond the clock's
  // range -> forever; zero or negative -> poll once. When the run is not done by then:
  // DEADLINE_EXCEEDED ("run N not finished after T s"; "... (polled once)"); the run is left
  // alone and nothing is delivered. A run that failed at its operation timeout is
  // DEADLINE_EXCEEDED too, as its own status: done() tells the two apart (true only for
  // the run's own). Sleeps on an event. A run with a RunProgress (an
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

}  // namespace simpler::worker
