#include "simpler/base/event.h"

#include <atomic>
#include <thread>

#include "gtest/gtest.h"

namespace simpler::base {
namespace {

TEST(Event, WaiterWakesWithSignalledStatus) {
  Event e;
  std::thread t([&] { e.signal(absl::InternalError("boom")); });
  EXPECT_TRUE(e.wait(Deadline::forever()));
  t.join();
  EXPECT_EQ(e.status(), absl::InternalError("boom"));
}

TEST(Event, OnlyFirstSignalCounts) {
  Event e;
  EXPECT_TRUE(e.signal(absl::OkStatus()));
  EXPECT_FALSE(e.signal(absl::InternalError("late")));
  EXPECT_TRUE(e.status().ok());
}

TEST(Event, PollDoesNotBlockAndTimeoutExpires) {
  Event e;
  EXPECT_FALSE(e.wait(Deadline::poll()));
  EXPECT_FALSE(e.wait(Deadline::after(std::chrono::milliseconds(5))));
  EXPECT_FALSE(e.is_signaled());
}

TEST(Event, ManyWaitersAllWake) {
  Event e;
  std::vector<std::thread> ts;
  std::atomic<int> woke{0};
  for (int i = 0; i < 8; ++i)
    ts.emplace_back([&e, &woke, i] {
      if (e.wait(Deadline::forever(), i % 2 ? 50'000 : 0)) woke++;
    });
  e.signal();
  for (auto& t : ts) t.join();
  EXPECT_EQ(woke.load(), 8);
}

TEST(Event, SignalWakesOnlyWaitersThatMayStillSleepLong) {
  // No waiter: nothing to wake.
  EXPECT_FALSE(Event::must_wake(0, 0, 0, 1'000));
  // A waiter without a deadline always needs the wake-up.
  EXPECT_TRUE(Event::must_wake(1, 0, 0, 1'000));
  EXPECT_TRUE(Event::must_wake(1, 2, 500, 1'000));
  // Timed waiters: only while the latest deadline is ahead.
  EXPECT_TRUE(Event::must_wake(0, 1, 1'001, 1'000));
  EXPECT_FALSE(Event::must_wake(0, 1, 1'000, 1'000));
  EXPECT_FALSE(Event::must_wake(0, 3, 999, 1'000));
}

TEST(Event, SignalBeforeATimedWaitersDeadlineIsNeverLost) {
  // A signal that completes before the waiter's deadline must wake it: the
  // waiter returns true. Signals land around the deadline, before and after.
  for (int i = 0; i < 200; ++i) {
    Event e;
    const int64_t deadline_ns = now_ns() + 2'000'000;
    std::atomic<bool> result{false};
    std::thread waiter([&] { result = e.wait(Deadline::until(steady_time(deadline_ns))); });
    const int64_t signal_at = deadline_ns - 1'000'000 + (i % 20) * 100'000;
    while (now_ns() < signal_at) std::this_thread::yield();
    e.signal();
    const int64_t signalled_by = now_ns();
    waiter.join();
    if (signalled_by < deadline_ns) {
      EXPECT_TRUE(result.load()) << "signal at deadline-" << deadline_ns - signalled_by
                                 << " ns was lost";
    }
    EXPECT_TRUE(e.is_signaled());
  }
}

}  // namespace
}  // namespace simpler::base
