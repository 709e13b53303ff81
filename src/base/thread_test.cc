#include "simpler/base/thread.h"

#include <sched.h>

#include <thread>

#include "gtest/gtest.h"

namespace simpler::base {
namespace {

TEST(Thread, AllowedCpusAreListed) {
  auto cpus = allowed_cpus();
  ASSERT_TRUE(cpus.ok());
  ASSERT_FALSE(cpus->empty());
  for (size_t i = 1; i < cpus->size(); ++i) EXPECT_LT((*cpus)[i - 1], (*cpus)[i]);
}

TEST(Thread, BadCpuListsAreRefusedNamingTheEntry) {
  absl::Status empty = check_cpus({});
  EXPECT_EQ(empty.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(empty.message().find("empty"), std::string_view::npos);
  absl::Status negative = check_cpus({-1});
  EXPECT_EQ(negative.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(negative.message().find("CPU -1"), std::string_view::npos);
  EXPECT_EQ(pin_this_thread({1 << 20}).code(), absl::StatusCode::kInvalidArgument);
}

TEST(Thread, PinnedThreadRunsOnItsCpuAndChildrenInheritIt) {
  const int cpu = allowed_cpus()->back();
  int seen = -1, child_seen = -1;
  std::thread t([&] {
    ASSERT_TRUE(pin_this_thread({cpu}).ok());
    seen = sched_getcpu();
    std::thread child([&] { child_seen = sched_getcpu(); });
    child.join();
  });
  t.join();
  EXPECT_EQ(seen, cpu);
  EXPECT_EQ(child_seen, cpu);
}

TEST(Thread, NamingAndTimerSlackAreBestEffort) {
  std::thread t([] {
    set_thread_name("a-name-longer-than-fifteen-bytes");
    use_precise_timers();
    char name[32] = {};
    pthread_getname_np(pthread_self(), name, sizeof(name));
    EXPECT_STREQ(name, "a-name-longer-t");
  });
  t.join();
}

}  // namespace
}  // namespace simpler::base
