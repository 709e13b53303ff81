// Thin annotated wrappers over std::mutex / std::condition_variable.
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>

#include "simpler/base/thread_annotations.h"

namespace simpler::base {

// A std::mutex that clang's thread-safety analysis understands. Thread-safe.
class SIMPLER_CAPABILITY("mutex") Mutex {
 public:
  void lock() SIMPLER_ACQUIRE() { mu_.lock(); }
  void unlock() SIMPLER_RELEASE() { mu_.unlock(); }
  // Takes the mutex when it is free; false (not taken) when another thread holds it.
  bool try_lock() SIMPLER_TRY_ACQUIRE(true) { return mu_.try_lock(); }
  std::mutex& native() { return mu_; }
  // Tells the thread-safety analysis that the caller holds this mutex where it cannot see the
  // acquisition (code called back while the lock is held, e.g. an L3 orchestration). No check
  // at run time: use it only behind a run-time check of its own.
  void assert_held() const SIMPLER_THREAD_ANNOTATION(assert_capability(this)) {}

 private:
  std::mutex mu_;
};

// RAII lock over Mutex. unlock() and lock() release and retake it inside the scope, in sight of
// the thread-safety analysis (it knows which guarded members may be touched in between); the
// destructor releases it only when held.
class SIMPLER_SCOPED_CAPABILITY MutexLock {
 public:
  explicit MutexLock(Mutex& mu) SIMPLER_ACQUIRE(mu) : lock_(mu.native()) {}
  // Adopts `mu`, which the caller already holds (after a successful try_lock()).
  MutexLock(Mutex& mu, std::adopt_lock_t) SIMPLER_REQUIRES(mu)
      : lock_(mu.native(), std::adopt_lock) {}
  ~MutexLock() SIMPLER_RELEASE() = default;
  void unlock() SIMPLER_RELEASE() { lock_.unlock(); }
  void lock() SIMPLER_ACQUIRE() { lock_.lock(); }
  std::unique_lock<std::mutex>& native() { return lock_; }

 private:
  std::unique_lock<std::mutex> lock_;
};

// Condition variable used with MutexLock. Thread-safe.
class CondVar {
 public:
  void wait(MutexLock& lock) { cv_.wait(lock.native()); }
  // Returns false when `deadline` passed before a notification.
  bool wait_until(MutexLock& lock, std::chrono::steady_clock::time_point deadline) {
    return cv_.wait_until(lock.native(), deadline) == std::cv_status::no_timeout;
  }
  void notify_one() { cv_.notify_one(); }
  void notify_all() { cv_.notify_all(); }

 private:
  std::condition_variable cv_;
};

}  // namespace simpler::base
