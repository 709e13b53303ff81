#include "simpler/base/clock.h"

#include <cmath>
#include <limits>

#include "absl/status/status.h"

namespace simpler::base {

int64_t now_ns() { return to_ns(std::chrono::steady_clock::now()); }

Deadline Deadline::after(std::chrono::nanoseconds d) {
  return {Kind::kAt, std::chrono::steady_clock::now() + d};
}

bool Deadline::expired() const {
  switch (kind) {
    case Kind::kForever:
      return false;
    case Kind::kPoll:
      return true;
    case Kind::kAt:
      return std::chrono::steady_clock::now() >= at;
  }
  return true;
}

absl::StatusOr<Deadline> deadline_from_seconds(double seconds) {
  if (std::isnan(seconds)) {
    return absl::InvalidArgumentError(
        "timeout is NaN; pass seconds >= 0, +inf to wait forever, "
        "or a negative value to poll once");
  }
  if (seconds < 0) return Deadline::poll();
  // Anything that does not fit the steady clock's remaining range waits forever.
  const auto now = std::chrono::steady_clock::now();
  const double max_s =
      std::chrono::duration<double>(std::chrono::steady_clock::time_point::max() - now).count();
  if (std::isinf(seconds) || seconds >= max_s * 0.5) return Deadline::forever();
  const auto d =
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::duration<double>(seconds));
  return Deadline{Deadline::Kind::kAt, now + d};
}

}  // namespace simpler::base
