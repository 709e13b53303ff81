#include "worker/run_resource_arena.h"

#include <thread>

#include "base/test_wait.h"
#include "gtest/gtest.h"

namespace simpler::worker {
namespace {

class ArenaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    device::SimDeviceOptions o;
    o.num_cores = 1;
    dev_ = std::move(device::create_sim_device(o)).value();
  }
  std::unique_ptr<device::Device> dev_;
};

TEST_F(ArenaTest, CountsAlwaysSumToTheGrant) {
  RunResourceArena a(dev_.get(), 3);
  auto r1 = *a.acquire(base::Deadline::forever());
  auto r2 = *a.acquire(base::Deadline::forever());
  ArenaCounts c = a.counts();
  EXPECT_EQ(c.live, 2);
  EXPECT_EQ(c.free, 1);
  ASSERT_TRUE(a.quarantine(r1).ok());
  c = a.counts();
  EXPECT_EQ(c.quarantined, 1);
  EXPECT_EQ(c.free + c.live + c.quarantined, 3);
  ASSERT_TRUE(a.release(r2).ok());
  EXPECT_EQ(a.counts().free, 2);
}

TEST_F(ArenaTest, StaleGenerationIsRefused) {
  RunResourceArena a(dev_.get(), 1);
  auto r1 = *a.acquire(base::Deadline::forever());
  ASSERT_TRUE(a.release(r1).ok());
  auto r2 = *a.acquire(base::Deadline::forever());
  EXPECT_EQ(r1.index, r2.index);
  EXPECT_NE(r1.generation, r2.generation);
  absl::Status s = a.release(r1);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("stale reference"), std::string_view::npos);
  EXPECT_FALSE(a.staging(r1, 0, 8).ok());
  EXPECT_EQ(a.counts().live, 1);  // the stale release changed nothing
  EXPECT_TRUE(a.release(r2).ok());
}

// A set's records belong to the run holding the set: a stale reference gets
// none, the next holder of a released set gets the same records (capacity
// kept), and a quarantined set's records are never handed out again.
TEST_F(ArenaTest, RunRecordsFollowTheSetAndStayWithAQuarantinedOne) {
  RunResourceArena a(dev_.get(), 2);
  auto r1 = *a.acquire(base::Deadline::forever());
  auto r2 = *a.acquire(base::Deadline::forever());
  RunRecords* rec1 = *a.records(r1);
  RunRecords* rec2 = *a.records(r2);
  EXPECT_NE(rec1, rec2);
  rec1->report.tasks.resize(100);
  rec1->report.blocks.resize(100);
  ASSERT_TRUE(a.release(r1).ok());
  EXPECT_EQ(a.records(r1).status().code(), absl::StatusCode::kFailedPrecondition);
  auto r3 = *a.acquire(base::Deadline::forever());
  ASSERT_EQ(r3.index, r1.index);
  RunRecords* rec3 = *a.records(r3);
  EXPECT_EQ(rec3, rec1);
  rec3->reset();
  EXPECT_TRUE(rec3->report.tasks.empty());
  EXPECT_TRUE(rec3->report.blocks.empty());
  EXPECT_GE(rec3->report.tasks.capacity(), 100u);  // no allocation for the next run
  ASSERT_TRUE(a.quarantine(r2).ok());
  ASSERT_TRUE(a.release(r3).ok());
  for (int i = 0; i < 3; ++i) {
    auto r = *a.acquire(base::Deadline::forever());
    EXPECT_NE(*a.records(r), rec2) << "a quarantined set's records were reused";
    ASSERT_TRUE(a.release(r).ok());
  }
}

TEST_F(ArenaTest, AcquireBlocksUntilAReleaseOrItsDeadline) {
  RunResourceArena a(dev_.get(), 1);
  auto r = *a.acquire(base::Deadline::forever());
  auto polled = a.acquire(base::Deadline::poll());
  EXPECT_EQ(polled.status().code(), absl::StatusCode::kDeadlineExceeded);
  auto timed = a.acquire(base::Deadline::after(std::chrono::milliseconds(20)));
  EXPECT_EQ(timed.status().code(), absl::StatusCode::kDeadlineExceeded);
  std::thread t([&] {
    EXPECT_TRUE(testing::eventually([&] { return a.counts().waiting == 1; }));  // it blocks
    (void)a.release(r);
  });
  auto got = a.acquire(base::Deadline::forever());
  t.join();
  EXPECT_TRUE(got.ok());
}

TEST_F(ArenaTest, AllQuarantinedFailsInsteadOfWaitingForever) {
  RunResourceArena a(dev_.get(), 1);
  auto r = *a.acquire(base::Deadline::forever());
  ASSERT_TRUE(a.quarantine(r).ok());
  auto s = a.acquire(base::Deadline::forever());
  EXPECT_EQ(s.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.status().message().find("quarantined"), std::string_view::npos);
}

TEST_F(ArenaTest, StagingBuffersAreReusedAndGrow) {
  RunResourceArena a(dev_.get(), 1);
  auto r = *a.acquire(base::Deadline::forever());
  auto b1 = *a.staging(r, 0, 100);
  auto b2 = *a.staging(r, 0, 80);
  EXPECT_EQ(b1.address, b2.address);
  auto b3 = *a.staging(r, 0, 1000);
  EXPECT_GE(b3.capacity, 1000u);
  EXPECT_TRUE(dev_->check_range(b3.address, 1000).ok());
}

TEST_F(ArenaTest, ShutdownWakesBlockedAcquire) {
  RunResourceArena a(dev_.get(), 1);
  ASSERT_TRUE(a.acquire(base::Deadline::forever()).ok());  // the only set is now live
  std::thread t([&] {
    EXPECT_TRUE(testing::eventually([&] { return a.counts().waiting == 1; }));  // it blocks
    a.shutdown();
  });
  auto s = a.acquire(base::Deadline::forever());
  t.join();
  EXPECT_EQ(s.status().code(), absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace simpler::worker
