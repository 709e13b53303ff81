// The environment a component's time-based decisions run against: the clock its timeouts and
// deadlines are measured on, and the waits those deadlines bound. After LevelDB's `Env`:
// production code uses Env::real(); a test injects a FakeEnv whose clock it can move forward, so
// a 60 s operation timeout fires at once, at a point the test chose, instead of after a real
// sleep raced against other threads.
//
// What is on an Env's clock: deadlines (Deadline::at holds an Env time) and the waits they bound.
// What is not: timestamps (RunTiming, trace spans, device records) stay on base::now_ns(), the
// clock the device stamps with, so host and device events share one timeline.
#pragma once

#include <chrono>
#include <cstdint>

#include "absl/status/statusor.h"
#include "simpler/base/clock.h"
#include "simpler/base/event.h"
#include "simpler/base/sync.h"

namespace simpler::base {

// Thread-safe. Not copyable. An Env outlives every component given it.
class Env {
 public:
  Env() = default;
  Env(const Env&) = delete;
  Env& operator=(const Env&) = delete;
  virtual ~Env() = default;

  // The process-wide real environment (steady_clock; never destroyed).
  static Env& real();

  // Nanoseconds on this Env's clock. For the real Env, base::now_ns().
  virtual int64_t now_ns() const = 0;

  // A deadline `seconds` from now on this clock, by base::deadline_from_seconds' table (NaN:
  // INVALID_ARGUMENT; +inf or beyond the clock's range: forever; negative: poll once).
  absl::StatusOr<Deadline> deadline_after(double seconds) const;
  Deadline after(std::chrono::nanoseconds d) const;
  // Whether `deadline` (on this clock) has passed: always for kPoll, never for kForever.
  bool expired(const Deadline& deadline) const;
  // Nanoseconds until `deadline` on this clock: <= 0 once passed (and for kPoll), INT64_MAX for
  // kForever.
  int64_t remaining_ns(const Deadline& deadline) const;

  // Waits until `event` is signalled or `deadline` (on this clock) passes; true when signalled.
  // A kPoll deadline looks once; kForever sleeps until signalled.
  virtual bool wait(Event& event, const Deadline& deadline) = 0;
  // cv.wait_until on this clock: returns when notified (or spuriously; callers re-check their
  // condition) or once `deadline` passed; false only when it returned because the deadline
  // passed. `lock` must hold the mutex `cv` is used with.
  virtual bool wait(CondVar& cv, MutexLock& lock, const Deadline& deadline) = 0;
};

// A fake clock for tests: base::now_ns() plus a skew that advance() moves forward, so time
// still flows (nothing waits for ever because a test forgot to advance) and a test can jump past
// a deadline at the moment it chooses. Waits bounded by a deadline re-check it at least every
// millisecond, so an advance() is seen within about a millisecond. Thread-safe.
class FakeEnv final : public Env {
 public:
  int64_t now_ns() const override;
  bool wait(Event& event, const Deadline& deadline) override;
  bool wait(CondVar& cv, MutexLock& lock, const Deadline& deadline) override;

  // Moves the clock forward by `d` (>= 0).
  void advance(std::chrono::nanoseconds d);
  // Waits (real time, at most `real_timeout`) until at least `n` waits bounded by a deadline
  // are in progress on this Env; true when there are. A test calls it before advance() so the
  // deadline it means to pass has been computed (the waiter computed it before waiting).
  bool await_timed_waiters(int32_t n, std::chrono::milliseconds real_timeout);
  // Waits bounded by a deadline in progress now.
  int32_t timed_waiters() const;

 private:
  class TimedWait;
  std::atomic<int64_t> skew_ns_{0};
  mutable Mutex mu_;
  CondVar changed_;
  int32_t timed_waiters_ SIMPLER_GUARDED_BY(mu_) = 0;
};

}  // namespace simpler::base
