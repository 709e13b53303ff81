// The one completion primitive: a one-shot event carrying a status.
#pragma once

#include <atomic>

#include "absl/status/status.h"
#include "simpler/base/clock.h"
#include "simpler/base/sync.h"

namespace simpler::base {

// One-shot completion with a result status. `signal` publishes the status
// with release semantics; a waiter that observes completion (acquire) sees
// every store the signaller made before `signal`. Waiters without a deadline
// sleep on a condition variable; nothing sleeps for a fixed time.
//
// The signaller wakes sleepers only when one may still be asleep for long: a
// waiter with no deadline, or one whose deadline is still ahead. Waiters
// whose deadlines have all passed wake on their own timers and find the
// event signalled, so signalling costs no futex wake for them — it matters
// when the signaller is a device thread at a run boundary and the waiter
// (the run lane) was held off its CPU just past its deadline.
// Thread-safe. Not reusable: create one per completion.
class Event {
 public:
  // Records `status` and wakes all waiters. Only the first call has effect;
  // returns false for later calls.
  bool signal(absl::Status status = absl::OkStatus());

  // True once signalled. Lock-free.
  bool is_signaled() const { return signaled_.load(std::memory_order_acquire); }

  // Waits until signalled or `deadline`. Returns true when signalled.
  // `spin_ns` > 0 spins (pausing the CPU, not yielding: base::poll_yielding is
  // the polite poll) that long before sleeping; device threads use at most
  // ~50 µs, host waiters 0.
  bool wait(const Deadline& deadline, int64_t spin_ns = 0);

  // The signalled status. Requires is_signaled().
  absl::Status status() const;

  // Whether a signal must wake sleepers: some waiter has no deadline, or the
  // latest deadline among timed waiters (ns on base::now_ns's clock) is after
  // `now`. Exposed for tests.
  static bool must_wake(int32_t untimed_waiters, int32_t timed_waiters, int64_t latest_deadline_ns,
                        int64_t now) {
    return untimed_waiters > 0 || (timed_waiters > 0 && latest_deadline_ns > now);
  }

 private:
  std::atomic<bool> signaled_{false};
  mutable Mutex mu_;
  CondVar cv_;
  absl::Status status_ SIMPLER_GUARDED_BY(mu_);
  int32_t untimed_waiters_ SIMPLER_GUARDED_BY(mu_) = 0;
  int32_t timed_waiters_ SIMPLER_GUARDED_BY(mu_) = 0;
  // At least every current timed waiter's deadline (ns); reset when none is left.
  int64_t latest_deadline_ns_ SIMPLER_GUARDED_BY(mu_) = 0;
};

}  // namespace simpler::base
