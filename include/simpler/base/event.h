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
// Thread-safe. Not reusable: create one per completion.
class Event {
 public:
  // Records `status` and wakes all waiters. Only the first call has effect;
  // returns false for later calls.
  bool signal(absl::Status status = absl::OkStatus());

  // True once signalled. Lock-free.
  bool is_signaled() const { return signaled_.load(std::memory_order_acquire); }

  // Waits until signalled or `deadline`. Returns true when signalled.
  // `spin_ns` > 0 spins (yielding) that long before sleeping; device threads
  // use at most ~50 µs, host waiters 0.
  bool wait(const Deadline& deadline, int64_t spin_ns = 0);

  // The signalled status. Requires is_signaled().
  absl::Status status() const;

 private:
  std::atomic<bool> signaled_{false};
  mutable Mutex mu_;
  CondVar cv_;
  absl::Status status_ SIMPLER_GUARDED_BY(mu_);
};

}  // namespace simpler::base
