#include "simpler/base/env.h"

#include <algorithm>
#include <limits>

namespace simpler::base {

namespace {

class RealEnv final : public Env {
 public:
  int64_t now_ns() const override { return base::now_ns(); }
  bool wait(Event& event, const Deadline& deadline) override { return event.wait(deadline); }
  bool wait(CondVar& cv, MutexLock& lock, const Deadline& deadline) override {
    switch (deadline.kind) {
      case Deadline::Kind::kForever:
        cv.wait(lock);
        return true;
      case Deadline::Kind::kPoll:
        return false;
      case Deadline::Kind::kAt:
        return cv.wait_until(lock, deadline.at) || !expired(deadline);
    }
    return false;
  }
};

constexpr int64_t kFakeSliceNs = 1'000'000;  // a FakeEnv wait re-checks its deadline this often

}  // namespace

Env& Env::real() {
  static RealEnv* env = new RealEnv();  // never destroyed: components may outlive statics
  return *env;
}

absl::StatusOr<Deadline> Env::deadline_after(double seconds) const {
  // The table is deadline_from_seconds'; only the origin differs.
  absl::StatusOr<Deadline> d = deadline_from_seconds(seconds);
  if (!d.ok() || d->kind != Deadline::Kind::kAt) return d;
  const int64_t offset = now_ns() - base::now_ns();
  if (offset > 0 && to_ns(d->at) > std::numeric_limits<int64_t>::max() - offset) {
    return Deadline::forever();
  }
  return Deadline::until(steady_time(to_ns(d->at) + offset));
}

Deadline Env::after(std::chrono::nanoseconds d) const {
  return Deadline::until(steady_time(now_ns() + d.count()));
}

bool Env::expired(const Deadline& deadline) const { return remaining_ns(deadline) <= 0; }

int64_t Env::remaining_ns(const Deadline& deadline) const {
  switch (deadline.kind) {
    case Deadline::Kind::kForever:
      return std::numeric_limits<int64_t>::max();
    case Deadline::Kind::kPoll:
      return 0;
    case Deadline::Kind::kAt:
      return to_ns(deadline.at) - now_ns();
  }
  return 0;
}

// Counts a wait bounded by a deadline for await_timed_waiters() while it is in progress.
class FakeEnv::TimedWait {
 public:
  explicit TimedWait(FakeEnv& env) : env_(env) {
    MutexLock lock(env_.mu_);
    ++env_.timed_waiters_;
    env_.changed_.notify_all();
  }
  ~TimedWait() {
    MutexLock lock(env_.mu_);
    --env_.timed_waiters_;
    env_.changed_.notify_all();
  }
  TimedWait(const TimedWait&) = delete;
  TimedWait& operator=(const TimedWait&) = delete;

 private:
  FakeEnv& env_;
};

int64_t FakeEnv::now_ns() const {
  return base::now_ns() + skew_ns_.load(std::memory_order_acquire);
}

bool FakeEnv::wait(Event& event, const Deadline& deadline) {
  if (deadline.kind != Deadline::Kind::kAt) return event.wait(deadline);
  TimedWait counted(*this);
  while (true) {
    const int64_t left = remaining_ns(deadline);
    if (left <= 0) return event.is_signaled();
    if (event.wait(Deadline::after(std::chrono::nanoseconds(std::min(left, kFakeSliceNs))))) {
      return true;
    }
  }
}

bool FakeEnv::wait(CondVar& cv, MutexLock& lock, const Deadline& deadline) {
  if (deadline.kind == Deadline::Kind::kForever) {
    cv.wait(lock);
    return true;
  }
  if (deadline.kind == Deadline::Kind::kPoll) return false;
  TimedWait counted(*this);
  const int64_t left = remaining_ns(deadline);
  if (left <= 0) return false;
  // One slice: the caller re-checks its condition and calls again.
  (void)cv.wait_until(lock, std::chrono::steady_clock::now() +
                                std::chrono::nanoseconds(std::min(left, kFakeSliceNs)));
  return !expired(deadline);
}

void FakeEnv::advance(std::chrono::nanoseconds d) {
  if (d.count() <= 0) return;
  skew_ns_.fetch_add(d.count(), std::memory_order_acq_rel);
  MutexLock lock(mu_);
  changed_.notify_all();
}

bool FakeEnv::await_timed_waiters(int32_t n, std::chrono::milliseconds real_timeout) {
  const auto until = std::chrono::steady_clock::now() + real_timeout;
  MutexLock lock(mu_);
  while (timed_waiters_ < n) {
    if (!changed_.wait_until(lock, until)) return timed_waiters_ >= n;
  }
  return true;
}

int32_t FakeEnv::timed_waiters() const {
  MutexLock lock(mu_);
  return timed_waiters_;
}

}  // namespace simpler::base
