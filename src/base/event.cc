#include "simpler/base/event.h"

#include <algorithm>
#include <thread>

namespace simpler::base {

bool Event::signal(absl::Status status) {
  bool wake;
  {
    MutexLock lock(mu_);
    if (signaled_.load(std::memory_order_relaxed)) return false;
    status_ = std::move(status);
    // Release: publishes status_ and everything the signaller wrote before.
    signaled_.store(true, std::memory_order_release);
    wake = must_wake(untimed_waiters_, timed_waiters_, latest_deadline_ns_,
                     timed_waiters_ > 0 ? now_ns() : 0);
  }
  // A waiter whose deadline has passed is woken by its own timer and re-checks
  // signaled_ under mu_, so skipping the notification loses no wake-up.
  if (wake) cv_.notify_all();
  return true;
}

bool Event::wait(const Deadline& deadline, int64_t spin_ns) {
  if (is_signaled()) return true;
  if (deadline.kind == Deadline::Kind::kPoll) return false;
  if (spin_ns > 0) {
    const int64_t until = now_ns() + spin_ns;
    while (now_ns() < until) {
      if (is_signaled()) return true;
      cpu_relax();
    }
  }
  MutexLock lock(mu_);
  if (deadline.is_forever()) {
    ++untimed_waiters_;
    while (!signaled_.load(std::memory_order_acquire)) cv_.wait(lock);
    --untimed_waiters_;
    return true;
  }
  ++timed_waiters_;
  latest_deadline_ns_ = std::max(latest_deadline_ns_, to_ns(deadline.at));
  while (!signaled_.load(std::memory_order_acquire) && cv_.wait_until(lock, deadline.at)) {
  }
  const bool signaled = signaled_.load(std::memory_order_acquire);
  if (--timed_waiters_ == 0) latest_deadline_ns_ = 0;
  return signaled;
}

absl::Status Event::status() const {
  MutexLock lock(mu_);
  return status_;
}

}  // namespace simpler::base
