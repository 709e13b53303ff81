#include "simpler/base/clock.h"

#include <cmath>
#include <limits>

#include "gtest/gtest.h"

namespace simpler::base {
namespace {

TEST(Clock, NsAndSteadyTimeConvertBothWays) {
  const int64_t t = now_ns();
  EXPECT_EQ(to_ns(steady_time(t)), t);
  const SteadyTime later = steady_time(t + 1'500);
  EXPECT_EQ(std::chrono::duration_cast<std::chrono::nanoseconds>(later - steady_time(t)).count(),
            1'500);
}

TEST(DeadlineFromSeconds, NanIsRefusedAsInvalidArgument) {
  auto d = deadline_from_seconds(std::nan(""));
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(d.status().message().find("NaN"), std::string_view::npos);
}

TEST(DeadlineFromSeconds, PositiveInfinityWaitsForever) {
  auto d = deadline_from_seconds(std::numeric_limits<double>::infinity());
  ASSERT_TRUE(d.ok());
  EXPECT_TRUE(d->is_forever());
  EXPECT_FALSE(d->expired());
}

TEST(DeadlineFromSeconds, BeyondClockRangeWaitsForever) {
  auto d = deadline_from_seconds(1e300);
  ASSERT_TRUE(d.ok());
  EXPECT_TRUE(d->is_forever());
}

TEST(DeadlineFromSeconds, NegativePollsOnce) {
  for (double s : {-1.0, -std::numeric_limits<double>::infinity(), -1e-9}) {
    auto d = deadline_from_seconds(s);
    ASSERT_TRUE(d.ok());
    EXPECT_EQ(d->kind, Deadline::Kind::kPoll);
    EXPECT_TRUE(d->expired());
  }
}

TEST(DeadlineFromSeconds, FiniteValueIsAPointInTime) {
  auto d = deadline_from_seconds(0.05);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->kind, Deadline::Kind::kAt);
  EXPECT_FALSE(d->expired());
  auto zero = deadline_from_seconds(0.0);
  ASSERT_TRUE(zero.ok());
  EXPECT_EQ(zero->kind, Deadline::Kind::kAt);
}

TEST(Deadline, UntilIsAPointInTime) {
  const Deadline past = Deadline::until(steady_time(now_ns() - 1'000'000));
  EXPECT_EQ(past.kind, Deadline::Kind::kAt);
  EXPECT_TRUE(past.expired());
  EXPECT_FALSE(Deadline::until(steady_time(now_ns() + 60'000'000'000)).expired());
}

}  // namespace
}  // namespace simpler::base
