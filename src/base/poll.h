// Bounded polling before sleeping, and when it is worth it.
#pragma once

#include <atomic>
#include <cstdint>
#include <limits>
#include <thread>

#include "simpler/base/clock.h"

namespace simpler::base {

// Polls `ready()` for up to `poll_ns` nanoseconds, yielding the CPU (sched_yield) between looks;
// returns ready(). For a bounded wait on an event another thread produces, before sleeping:
// unlike a cpu_relax spin it hands this CPU to a runnable thread at each look, and on a machine
// with few CPUs the producer is often that thread (measured in docs/benchmarks.md: a
// pause-spin held the producer off its CPU for the whole spin). Thread-safe (as ready() is).
template <typename F>
bool poll_yielding(F&& ready, int64_t poll_ns) {
  if (ready()) return true;
  if (poll_ns <= 0) return false;
  const int64_t until = now_ns() + poll_ns;
  while (now_ns() < until) {
    std::this_thread::yield();
    if (ready()) return true;
  }
  return false;
}

// One bounded poll of a wait before it sleeps: polls `ready()` (yielding) for `window_ns`, cut to
// `max_ns` (the wait's own deadline); with no window, looks once. The outcome goes to
// `record(caught)` when it says something about the window: the event came, or the full window
// passed without it (a window cut short by the deadline is no verdict). Returns ready().
template <typename F, typename R>
bool poll_window(F&& ready, int64_t window_ns, int64_t max_ns, R&& record) {
  const int64_t window = window_ns < max_ns ? window_ns : max_ns;
  if (window <= 0) return ready();
  const bool caught = poll_yielding(ready, window);
  if (caught || window == window_ns) record(caught);
  return caught;
}

// Whether a waiter polls before it sleeps, by whether polling paid off lately (adaptive
// spinning, as in glibc's adaptive mutexes): polls that catch their event keep the waiter
// polling; after kMissesToSleep polls in a row that did not, it sleeps at once, and polls again
// on every kProbeEvery-th wait, to notice when events come quickly again.
//
// Why it matters: a polling thread stays runnable, and one that shares its CPU with a thread that
// computes (on the sim device, a kernel) waits behind it for that thread's whole time slice —
// with nothing to wake it early, since it is not asleep — where a sleeping waiter is woken onto an
// idle CPU (docs/benchmarks.md: L3 runs of 200 µs kernels lost a whole run each second
// time while the parent's pollers sat behind the kernel). Thread-safe (relaxed atomics: a lost
// update only shifts one decision).
class AdaptivePoll {
 public:
  static constexpr int32_t kMissesToSleep = 2;
  static constexpr int32_t kProbeEvery = 16;

  explicit AdaptivePoll(int64_t window_ns) : window_ns_(window_ns) {}

  // How long this wait polls: the full window, or 0 (sleep at once).
  int64_t window_ns() {
    if (misses_.load(std::memory_order_relaxed) < kMissesToSleep) return window_ns_;
    return waits_.fetch_add(1, std::memory_order_relaxed) % kProbeEvery == 0 ? window_ns_ : 0;
  }
  // How a wait that polled ended: whether its event came within the window.
  void polled(bool caught) {
    if (caught) {
      misses_.store(0, std::memory_order_relaxed);
    } else if (misses_.load(std::memory_order_relaxed) < kMissesToSleep) {
      misses_.fetch_add(1, std::memory_order_relaxed);
    }
  }
  // Polls `ready()` for this wait's window (yielding), at most `max_ns`, and records the outcome
  // of a full window; returns ready().
  template <typename F>
  bool poll(F&& ready, int64_t max_ns = std::numeric_limits<int64_t>::max()) {
    return poll_window(ready, window_ns(), max_ns, [this](bool caught) { polled(caught); });
  }

 private:
  const int64_t window_ns_;
  std::atomic<int32_t> misses_{0};
  std::atomic<int32_t> waits_{0};
};

}  // namespace simpler::base
