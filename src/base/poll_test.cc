#include "base/poll.h"

#include <atomic>
#include <thread>

#include "gtest/gtest.h"

namespace simpler::base {
namespace {

TEST(PollYielding, ReturnsAsSoonAsReadyAndFalseAfterItsWindow) {
  int looks = 0;
  EXPECT_TRUE(poll_yielding([&] { return ++looks == 3; }, 1'000'000'000));
  EXPECT_EQ(looks, 3);
  const int64_t t0 = now_ns();
  EXPECT_FALSE(poll_yielding([] { return false; }, 200'000));
  EXPECT_GE(now_ns() - t0, 200'000);
  looks = 0;
  EXPECT_FALSE(poll_yielding([&] { return ++looks > 1; }, 0));  // no window: one look
  EXPECT_EQ(looks, 1);
}

TEST(PollYielding, SeesAnotherThreadsStore) {
  std::atomic<bool> flag{false};
  std::thread t([&] { flag.store(true); });
  EXPECT_TRUE(poll_yielding([&] { return flag.load(); }, 5'000'000'000));
  t.join();
}

TEST(AdaptivePoll, PollsWhilePollingPaysThenSleepsAndProbesAgain) {
  AdaptivePoll a(1000);
  EXPECT_EQ(a.window_ns(), 1000);
  a.polled(false);
  EXPECT_EQ(a.window_ns(), 1000);  // one miss is noise
  a.polled(true);                  // a catch forgives it
  a.polled(false);
  EXPECT_EQ(a.window_ns(), 1000);
  a.polled(false);  // two misses in a row: sleep at once, probing every kProbeEvery-th wait
  int polls = 0;
  for (int i = 0; i < 4 * AdaptivePoll::kProbeEvery; ++i) {
    if (a.window_ns() > 0) ++polls;
  }
  EXPECT_EQ(polls, 4);
  a.polled(true);  // a probe caught its event: polling again on every wait
  for (int i = 0; i < 8; ++i) EXPECT_EQ(a.window_ns(), 1000);
}

TEST(AdaptivePoll, PollRecordsOnlyFullWindows) {
  AdaptivePoll a(20'000'000);  // 20 ms: a probe looks more than once even on a loaded machine
  int looks = 0;
  // Cut short by the caller's limit: not a miss of this waiter's window.
  for (int i = 0; i < 5; ++i) EXPECT_FALSE(a.poll([&] { return ++looks < 0; }, 1'000));
  EXPECT_EQ(a.window_ns(), 20'000'000);
  EXPECT_FALSE(a.poll([] { return false; }));
  EXPECT_FALSE(a.poll([] { return false; }));
  // Asleep at once now: the first wait probes a full window, the next ones look once.
  looks = 0;
  EXPECT_FALSE(a.poll([&] { return ++looks < 0; }));
  EXPECT_GT(looks, 1);
  for (int i = 1; i < AdaptivePoll::kProbeEvery; ++i) {
    looks = 0;
    EXPECT_FALSE(a.poll([&] { return ++looks < 0; }));
    EXPECT_EQ(looks, 1) << i;
  }
  // The next probe catches its event: polling resumes on every wait.
  EXPECT_TRUE(a.poll([] { return true; }));
  EXPECT_EQ(a.window_ns(), 20'000'000);
}

}  // namespace
}  // namespace simpler::base
