#include "base/work_queue.h"

#include <atomic>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace simpler::base {
namespace {

TEST(WorkQueue, ItemsComeOutInOrderAndCloseDrainsThenEnds) {
  WorkQueue<int> q;
  EXPECT_TRUE(q.push(1));
  EXPECT_TRUE(q.push(2));
  q.close();
  EXPECT_FALSE(q.push(3));  // refused after close
  EXPECT_EQ(q.pop(), 1);
  EXPECT_EQ(q.pop(), 2);
  EXPECT_EQ(q.pop(), std::nullopt);
  EXPECT_EQ(q.pop(), std::nullopt);
}

// Several consumers and producers: every item is taken exactly once, and the
// consumers blocked on an empty queue wake at close().
TEST(WorkQueue, EachItemIsTakenOnceAcrossConsumers) {
  WorkQueue<int> q;
  constexpr int kItems = 20000;
  std::vector<std::atomic<int>> seen(kItems);
  std::vector<std::thread> consumers;
  for (int c = 0; c < 3; ++c) {
    consumers.emplace_back([&] {
      while (std::optional<int> i = q.pop()) seen[*i].fetch_add(1);
    });
  }
  std::thread producers[2];
  for (int p = 0; p < 2; ++p) {
    producers[p] = std::thread([&, p] {
      for (int i = p; i < kItems; i += 2) ASSERT_TRUE(q.push(i));
    });
  }
  for (auto& t : producers) t.join();
  q.close();
  for (auto& t : consumers) t.join();
  for (int i = 0; i < kItems; ++i) ASSERT_EQ(seen[i].load(), 1) << i;
}

}  // namespace
}  // namespace simpler::base
