#include "simpler/base/event.h"

#include <thread>

namespace simpler::base {

bool Event::signal(absl::Status status) {
  {
    MutexLock lock(mu_);
    if (signaled_.load(std::memory_order_relaxed)) return false;
    status_ = std::move(status);
    // Release: publishes status_ and everything the signaller wrote before.
    signaled_.store(true, std::memory_order_release);
  }
  cv_.notify_all();
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
  while (!signaled_.load(std::memory_order_acquire)) {
    if (deadline.is_forever()) {
      cv_.wait(lock);
    } else if (!cv_.wait_until(lock, deadline.at)) {
      return signaled_.load(std::memory_order_acquire);
    }
  }
  return true;
}

absl::Status Event::status() const {
  MutexLock lock(mu_);
  return status_;
}

}  // namespace simpler::base
