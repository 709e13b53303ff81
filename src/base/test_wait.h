// Test helper: waiting for a state that no event announces (a counter reaching a value, a
// process gone, a thread blocked), bounded by a deadline that fails the test instead of a sleep
// that hopes the state was reached.
#pragma once

#include <chrono>
#include <thread>

namespace simpler::testing {

// Looks at `ready()` until it returns true or `timeout` (real time) passes; returns the last
// look. A test asserts on the result (ASSERT_TRUE(eventually(...)) << "what never happened"), so
// a state that is never reached fails the test at the deadline, however fast or slow the machine.
// The default deadline is a hang detector, not a speed limit: a minute, since ThreadSanitizer on
// a 2-vCPU machine shared with other builds took over 10 s to decode 64 tokens of the tiny model.
// The first looks only yield the CPU; later ones are 200 µs apart, so a long wait does not take a
// CPU from the threads it waits for (the machines tests run on may have only two). Thread-safe
// as ready() is.
template <typename F>
[[nodiscard]] bool eventually(F&& ready,
                              std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
  const auto until = std::chrono::steady_clock::now() + timeout;
  for (int looks = 0; !ready(); ++looks) {
    if (std::chrono::steady_clock::now() >= until) return ready();
    if (looks < 100) {
      std::this_thread::yield();
    } else {
      // The pause between looks of a poll (the deadline above decides the outcome, not this):
      // the one sleep of the waiting helpers, so a state without a notification costs no CPU.
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }
  return true;
}

// Keeps this thread busy for `d` without sleeping (yielding the CPU between looks at the clock):
// the jitter of a stress test, which varies where one thread's steps fall among another's. Not
// a wait for anything.
inline void spin_for(std::chrono::nanoseconds d) {
  const auto until = std::chrono::steady_clock::now() + d;
  while (std::chrono::steady_clock::now() < until) std::this_thread::yield();
}

}  // namespace simpler::testing
