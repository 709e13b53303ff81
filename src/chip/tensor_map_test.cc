#include "chip/tensor_map.h"

#include <algorithm>
#include <functional>
#include <random>
#include <set>
#include <utility>

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

// A brute-force model that tracks each byte's last writer and readers since; `run` feeds it and
// the map `tasks` random accesses from `next_range` (tasks finishing in random order) and checks
// every answer. Returns the largest number of ranges the map held.
class TensorMapModelTest : public TensorMapTest {
 protected:
  static constexpr uint64_t kBytes = 8192;
  using NextRange = std::function<std::pair<uint64_t, uint64_t>(std::mt19937_64&)>;

  size_t run(uint64_t tasks, const NextRange& next_range) {
    constexpr uint64_t kNoTask = ~uint64_t{0};
    std::vector<uint64_t> writer(kBytes, kNoTask);
    std::vector<std::vector<uint64_t>> readers(kBytes);
    std::mt19937_64 rng(7);
    std::vector<uint64_t> unfinished;
    size_t largest = 0;
    for (uint64_t task = 0; task < tasks; ++task) {
      // Finish a random earlier task now and then (monotone is_done).
      if (!unfinished.empty() && rng() % 3 != 0) {
        const size_t i = rng() % unfinished.size();
        done_.insert(unfinished[i]);
        unfinished[i] = unfinished.back();
        unfinished.pop_back();
      }
      const auto [b, e] = next_range(rng);
      const bool write = rng() % 2 == 0;
      std::set<uint64_t> want;
      auto add = [&](uint64_t t) {
        if (t != kNoTask && t != task && done_.count(t) == 0) want.insert(t);
      };
      for (uint64_t x = b; x < e; ++x) {
        add(writer[x]);
        if (write) {
          for (uint64_t r : readers[x]) add(r);
          writer[x] = task;
          readers[x].clear();
        } else {
          std::erase_if(readers[x], [&](uint64_t r) { return done_.count(r) > 0; });
          readers[x].push_back(task);
        }
      }
      EXPECT_EQ(access(b, e, write, task), V(want.begin(), want.end()))
          << "task " << task << (write ? " writes [" : " reads [") << b << ", " << e << ")";
      if (HasFailure()) return largest;
      unfinished.push_back(task);
      largest = std::max(largest, map_.size());
    }
    return largest;
  }
};

TEST_F(TensorMapModelTest, MatchesAByteByByteModelThroughSweeps) {
  // Random overlapping reads and writes over 8 KiB, with enough ranges alive that sweeps run.
  const size_t largest = run(20000, [](std::mt19937_64& rng) {
    const uint64_t b = rng() % kBytes;
    return std::pair{b, std::min(kBytes, b + 1 + rng() % 48)};
  });
  EXPECT_GT(largest, TensorMap::kMinSweepEntries) << "no sweep was exercised";
}

TEST_F(TensorMapModelTest, WholeBufferRepeatsAndFirstTouchesMatchTheModel) {
  // The one-lookup cases: the same 64-byte buffers read and written whole again and again, and
  // buffers touched for the first time (ascending, as an orchestration walks its outputs),
  // mixed with ranges that straddle or cut into them.
  uint64_t fresh = 4096;
  const size_t largest = run(20000, [&fresh](std::mt19937_64& rng) {
    switch (rng() % 4) {
      case 0:
      case 1: {
        const uint64_t b = rng() % 32 * 64;
        return std::pair{b, b + 64};
      }
      case 2: {
        const uint64_t b = fresh;
        fresh = fresh + 8 >= kBytes ? 4096 : fresh + 8;
        return std::pair{b, b + 8};
      }
      default: {
        const uint64_t b = rng() % 2048;
        return std::pair{b, b + 1 + rng() % 100};
      }
    }
  });
  EXPECT_GT(largest, 32u);
}

}  // namespace
}  // namespace simpler::chip
