// Clocks and timeouts.
#pragma once

#include <chrono>
#include <cstdint>

#include "absl/status/statusor.h"

namespace simpler::base {

using SteadyTime = std::chrono::steady_clock::time_point;

// Monotonic nanoseconds since an arbitrary epoch (steady_clock). Thread-safe.
int64_t now_ns();

// Conversions between now_ns() values and steady_clock time points.
inline SteadyTime steady_time(int64_t ns) { return SteadyTime(std::chrono::nanoseconds(ns)); }
inline int64_t to_ns(SteadyTime t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
}

// A CPU hint for spin loops (x86 PAUSE); keeps the thread on its core.
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// A point in time to stop waiting, or "forever", or "poll once".
// Plain value.
struct Deadline {
  enum class Kind { kForever, kAt, kPoll };
  Kind kind = Kind::kForever;
  SteadyTime at{};

  static Deadline forever() { return {}; }
  static Deadline poll() { return {Kind::kPoll, {}}; }
  static Deadline after(std::chrono::nanoseconds d);
  // At time point `t` (steady_clock); a past `t` behaves like poll().
  static Deadline until(SteadyTime t) { return {Kind::kAt, t}; }
  bool is_forever() const { return kind == Kind::kForever; }
  // True once the deadline passed (always true for kPoll, never for kForever).
  bool expired() const;
};

// Converts a timeout in seconds into a Deadline by ARCHITECTURE.md's table:
//   NaN                               -> INVALID_ARGUMENT ("timeout is NaN")
//   +inf, or beyond the clock's range -> forever
//   negative (including -inf)         -> poll once
//   otherwise                         -> now + seconds
absl::StatusOr<Deadline> deadline_from_seconds(double seconds);

}  // namespace simpler::base
