#include "simpler/chip/tensor_map.h"

#include <algorithm>
#include <set>

#include "gtest/gtest.h"

namespace simpler::chip {
namespace {

class TensorMapTest : public ::testing::Test {
 protected:
  std::vector<uint64_t> access(uint64_t b, uint64_t e, bool write, uint64_t task) {
    std::vector<uint64_t> deps;
    map_.access(
        b, e, write, task, [this](uint64_t t) { return done_.count(t) > 0; }, &deps);
    std::sort(deps.begin(), deps.end());
    deps.erase(std::unique(deps.begin(), deps.end()), deps.end());
    return deps;
  }
  TensorMap map_;
  std::set<uint64_t> done_;
};

using V = std::vector<uint64_t>;

TEST_F(TensorMapTest, ReadAfterWrite) {
  EXPECT_EQ(access(0, 100, true, 0), V{});
  EXPECT_EQ(access(0, 100, false, 1), V{0});
}

TEST_F(TensorMapTest, WriteAfterReadWaitsForAllReaders) {
  access(0, 100, true, 0);
  access(0, 50, false, 1);
  access(50, 100, false, 2);
  EXPECT_EQ(access(0, 100, true, 3), (V{0, 1, 2}));
}

TEST_F(TensorMapTest, WriteAfterWrite) {
  access(0, 64, true, 0);
  EXPECT_EQ(access(0, 64, true, 1), V{0});
  EXPECT_EQ(access(0, 64, false, 2), V{1});
}

TEST_F(TensorMapTest, PartialOverlapIsByteExact) {
  access(0, 100, true, 0);
  access(100, 200, true, 1);
  EXPECT_EQ(access(99, 101, false, 2), (V{0, 1}));
  EXPECT_EQ(access(100, 101, false, 3), V{1});
  EXPECT_EQ(access(150, 250, true, 4), (V{1}));  // WAW on [150,200), nothing on [200,250)
  EXPECT_EQ(access(0, 99, true, 5), V{0});       // reader 2 started at 99: no WAR
  EXPECT_EQ(access(98, 100, true, 6), (V{0, 2, 5}));
}

TEST_F(TensorMapTest, DisjointRangesAreIndependent) {
  access(0, 10, true, 0);
  EXPECT_EQ(access(10, 20, true, 1), V{});
  EXPECT_EQ(access(20, 30, false, 2), V{});
}

TEST_F(TensorMapTest, ReadOverAGapBecomesReaderOfTheGap) {
  access(10, 20, true, 0);
  EXPECT_EQ(access(0, 30, false, 1), V{0});
  EXPECT_EQ(access(0, 5, true, 2), V{1});    // WAR on the gap before
  EXPECT_EQ(access(25, 30, true, 3), V{1});  // WAR on the gap after
}

TEST_F(TensorMapTest, FinishedTasksAreNotDependencies) {
  access(0, 10, true, 0);
  done_.insert(0);
  EXPECT_EQ(access(0, 10, false, 1), V{});
}

TEST_F(TensorMapTest, ATaskDoesNotDependOnItself) {
  EXPECT_EQ(access(0, 10, false, 0), V{});
  EXPECT_EQ(access(0, 10, true, 0), V{});
}

TEST_F(TensorMapTest, RangesOfFinishedTasksAreDroppedWithoutChangingAnswers) {
  // 20000 tasks each write their own range and finish: the map stays near
  // its sweep floor instead of tracking 20000 ranges.
  constexpr uint64_t kTasks = 20000;
  size_t largest = 0;
  for (uint64_t t = 0; t < kTasks; ++t) {
    EXPECT_EQ(access(t * 64, t * 64 + 64, true, t), V{});
    done_.insert(t);
    largest = std::max(largest, map_.size());
  }
  EXPECT_LE(largest, 2 * TensorMap::kMinSweepEntries);
  // An unfinished writer survives any number of sweeps and still orders its readers.
  const uint64_t live = kTasks;
  access(1 << 30, (1 << 30) + 64, true, live);
  for (uint64_t t = kTasks + 1; t < 2 * kTasks; ++t) {
    access(t * 64, t * 64 + 64, true, t);
    done_.insert(t);
  }
  EXPECT_EQ(access(1 << 30, (1 << 30) + 8, false, 2 * kTasks), V{live});
  // A range whose writer finished long ago creates no dependency.
  EXPECT_EQ(access(0, 64, false, 2 * kTasks + 1), V{});
}

TEST_F(TensorMapTest, RangesOfUnfinishedTasksAreAllKept) {
  for (uint64_t t = 0; t < 1000; ++t) access(t * 64, t * 64 + 64, true, t);
  EXPECT_EQ(map_.size(), 1000u);
  for (uint64_t t = 0; t < 1000; t += 97)
    EXPECT_EQ(access(t * 64, t * 64 + 1, false, 5000 + t), V{t});
}

}  // namespace
}  // namespace simpler::chip
