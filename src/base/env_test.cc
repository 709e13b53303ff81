#include "simpler/base/env.h"

#include <cmath>
#include <limits>
#include <thread>

#include "gtest/gtest.h"

namespace simpler::base {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;

TEST(Env, RealEnvIsTheSteadyClockAndKeepsTheTimeoutTable) {
  Env& env = Env::real();
  const int64_t before = now_ns();
  const int64_t t = env.now_ns();
  EXPECT_LE(before, t);
  EXPECT_LE(t, now_ns());
  EXPECT_EQ(env.deadline_after(std::nan("")).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(env.deadline_after(std::numeric_limits<double>::infinity())->is_forever());
  EXPECT_EQ(env.deadline_after(-1)->kind, Deadline::Kind::kPoll);
  EXPECT_TRUE(env.expired(Deadline::poll()));
  EXPECT_FALSE(env.expired(Deadline::forever()));
  const Deadline soon = *env.deadline_after(0.05);
  EXPECT_FALSE(env.expired(soon));
  Event never;
  EXPECT_FALSE(env.wait(never, soon));  // times out on the real clock
  EXPECT_TRUE(env.expired(soon));
}

TEST(FakeEnv, AdvanceMovesTheClockAndExpiresDeadlinesWithoutWaiting) {
  FakeEnv env;
  const Deadline in_an_hour = *env.deadline_after(3600);
  EXPECT_FALSE(env.expired(in_an_hour));
  EXPECT_GT(env.remaining_ns(in_an_hour), 3599LL * 1'000'000'000);
  const int64_t t0 = env.now_ns();
  env.advance(seconds(3601));
  EXPECT_GE(env.now_ns() - t0, 3601LL * 1'000'000'000);
  EXPECT_TRUE(env.expired(in_an_hour));
  env.advance(seconds(-5));  // a negative step is ignored: the clock is monotonic
  EXPECT_TRUE(env.expired(in_an_hour));
}

TEST(FakeEnv, AWaitBoundedByADeadlineEndsWhenTheClockIsAdvancedPastIt) {
  FakeEnv env;
  Event never;
  const Deadline deadline = *env.deadline_after(3600);
  const int64_t start = now_ns();
  std::thread waiter([&] { EXPECT_FALSE(env.wait(never, deadline)); });
  ASSERT_TRUE(env.await_timed_waiters(1, milliseconds(5'000)));
  env.advance(seconds(3600));
  waiter.join();
  EXPECT_LT(now_ns() - start, 5'000'000'000);  // not the hour
  EXPECT_EQ(env.timed_waiters(), 0);
}

TEST(FakeEnv, AWaitEndsAtOnceWhenTheEventIsSignalled) {
  FakeEnv env;
  Event e;
  std::thread signaller([&] {
    ASSERT_TRUE(env.await_timed_waiters(1, milliseconds(5'000)));
    e.signal();
  });
  EXPECT_TRUE(env.wait(e, *env.deadline_after(3600)));
  signaller.join();
}

TEST(FakeEnv, ACondVarWaitReportsTheDeadlineOnlyOnceItPassed) {
  FakeEnv env;
  Mutex mu;
  CondVar cv;
  const Deadline deadline = *env.deadline_after(3600);
  MutexLock lock(mu);
  EXPECT_TRUE(env.wait(cv, lock, deadline));  // one slice, deadline still ahead
  env.advance(seconds(3600));
  EXPECT_FALSE(env.wait(cv, lock, deadline));
  EXPECT_FALSE(env.wait(cv, lock, Deadline::poll()));
}

TEST(FakeEnv, AwaitTimedWaitersTimesOutWhenNobodyWaits) {
  FakeEnv env;
  EXPECT_FALSE(env.await_timed_waiters(1, milliseconds(20)));
}

}  // namespace
}  // namespace simpler::base
