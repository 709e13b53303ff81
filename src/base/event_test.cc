#include "simpler/base/event.h"

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

}  // namespace
}  // namespace simpler::base
