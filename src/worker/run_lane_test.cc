// Contract tests of the run pipeline (ARCHITECTURE.md "Run lifecycle").
#include <atomic>
#include <map>
#include <random>
#include <set>
#include <thread>
#include <tuple>

#include "gtest/gtest.h"
#include "simpler/worker/worker.h"
#include "worker/worker_test_util.h"

namespace simpler::worker::testing {
namespace {

WorkerOptions opts(int depth, int grant = 0) { return testing::test_options(depth, grant, 20); }

task::TaskArgs sleep_args(int64_t us) {
  task::TaskArgs a;
  a.add_scalar_i64(us);
  return a;
}

class PipelineDepth : public ::testing::TestWithParam<std::tuple<int, task::GraphPlacement>> {
 protected:
  int depth() const { return std::get<0>(GetParam()); }
};

TEST_P(PipelineDepth, ThousandPipelinedRunsEachProduceTheirOwnResult) {
  WorkerOptions o = opts(depth());
  o.placement = std::get<1>(GetParam());
  Worker w(o);
  auto h = w.register_callable(affine_program(2));
  ASSERT_TRUE(w.init().ok());
  constexpr int kRuns = 1000;
  std::vector<int64_t> in(kRuns), out(kRuns, -1);
  std::vector<RunHandle> hs;
  for (int i = 0; i < kRuns; ++i) {
    in[i] = i;
    auto r = w.submit(*h, affine_args(&in[i], &out[i], 7));
    ASSERT_TRUE(r.ok()) << r.status();
    hs.push_back(*r);
  }
  for (int i = 0; i < kRuns; ++i) {
    ASSERT_TRUE(hs[i].wait().ok());
    EXPECT_EQ(hs[i].id().value, static_cast<uint64_t>(i));
  }
  for (int i = 0; i < kRuns; ++i) ASSERT_EQ(out[i], 3 * i + 7) << "run " << i;
  // Identity: RunId plus the generation of the set it held. Runs that held
  // the same set got strictly increasing generations; at most grant sets.
  std::map<uint32_t, uint32_t> last_generation;
  for (int i = 0; i < kRuns; ++i) {
    const base::SlotRef set = hs[i].result().resource_set;
    ASSERT_LT(set.index, static_cast<uint32_t>(depth() + 1)) << "run " << i;
    auto [it, fresh] = last_generation.emplace(set.index, set.generation);
    if (!fresh) {
      ASSERT_GT(set.generation, it->second) << "run " << i << " reused a set generation";
      it->second = set.generation;
    }
  }
  // FIFO and serial device: run k+1 starts on the device after run k ended.
  for (int i = 1; i < kRuns; ++i) {
    const RunTiming& a = hs[i - 1].result().timing;
    const RunTiming& b = hs[i].result().timing;
    ASSERT_LE(a.device_end_ns, b.device_start_ns) << "run " << i;
    ASSERT_LE(a.finalize_ns, b.finalize_ns);
    EXPECT_EQ(hs[i].result().requested_depth, depth());
    EXPECT_EQ(hs[i].result().report.tasks_completed, 2u);
  }
  // The depth, from timestamps alone: run i launches only after run i - depth
  // ended on the device (end is stamped before the record is signalled).
  // Its effective depth counts at least every earlier run still running on the
  // device when it launched, and at most the depth.
  for (int i = 0; i < kRuns; ++i) {
    const RunResult& r = hs[i].result();
    if (i >= depth()) {
      ASSERT_GE(r.timing.launch_ns, hs[i - depth()].result().timing.device_end_ns) << "run " << i;
    }
    int still_running = 0;
    for (int j = std::max(0, i - depth()); j < i; ++j) {
      if (hs[j].result().timing.device_end_ns > r.timing.launch_ns) ++still_running;
    }
    ASSERT_GE(r.effective_depth, 1 + still_running) << "run " << i;
    ASSERT_LE(r.effective_depth, depth()) << "run " << i;
  }
  EXPECT_TRUE(w.close().ok());
}

INSTANTIATE_TEST_SUITE_P(DepthsAndPlacements, PipelineDepth,
                         ::testing::Combine(::testing::Values(1, 2, 4),
                                            ::testing::Values(task::GraphPlacement::kDevice,
                                                              task::GraphPlacement::kHost)));

TEST(Pipeline, HostBuiltGraphErrorsAreReturnedBySubmit) {
  Worker w(opts(2));
  auto h = w.register_callable(
      task::ChipCallable{"bad_kernel",
                         [](task::OrchestrationContext& ctx, const task::TaskArgs&) {
                           return ctx.submit(5, task::TaskArgs{});
                         },
                         {{"sleep", testing::sleep_kernel}}});
  ASSERT_TRUE(w.init().ok());
  task::CallConfig host;
  host.placement = task::GraphPlacement::kHost;
  auto r = w.submit(*h, task::TaskArgs{}, host);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(r.status().message()).find("run 0 prepare: run 0 task 0: kernel index 5"),
            std::string::npos)
      << r.status();
  // The same program device-built fails on its handle instead.
  auto d = w.submit(*h, task::TaskArgs{});
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->wait().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(w.close().ok());  // both errors were delivered
  EXPECT_EQ(w.resources().free, w.resources().grant);
}

TEST(Pipeline, UnwaitedRunsAtGrantFourDoNotDeadlock) {
  Worker w(opts(2, 4));
  auto h = w.register_callable(affine_program());
  ASSERT_TRUE(w.init().ok());
  std::vector<int64_t> in(1000, 1), out(1000, 0);
  for (int i = 0; i < 1000; ++i) {
    auto r = w.submit(*h, affine_args(&in[i], &out[i], i));
    ASSERT_TRUE(r.ok()) << r.status();  // handle dropped at once
  }
  EXPECT_TRUE(w.close().ok());
  for (int i = 0; i < 1000; ++i) ASSERT_EQ(out[i], 3 + i);
}

TEST(Pipeline, WaitOnARunReturnsWhileLaterRunsAreQueued) {
  Worker w(opts(2, 4));
  auto h = w.register_callable(sleep_program());
  ASSERT_TRUE(w.init().ok());
  RunHandle a = *w.submit(*h, sleep_args(1'000));
  RunHandle b = *w.submit(*h, sleep_args(400'000));
  RunHandle c = *w.submit(*h, sleep_args(400'000));
  ASSERT_TRUE(a.wait().ok());
  EXPECT_FALSE(c.done());
  EXPECT_TRUE(b.wait().ok());
  EXPECT_TRUE(c.wait().ok());
}

// The results of two sleep runs submitted back to back at `depth` and `grant`, the first
// `first_us` long and the second 1 ms: whether the second launched before the first ended.
struct BackToBack {
  RunResult first, second;
};
absl::StatusOr<BackToBack> back_to_back(int depth, int grant, int64_t first_us) {
  Worker w(opts(depth, grant));
  SIMPLER_ASSIGN_OR_RETURN(CallableHandle h, w.register_callable(sleep_program()));
  SIMPLER_RETURN_IF_ERROR(w.init());
  SIMPLER_ASSIGN_OR_RETURN(RunHandle a, w.submit(h, sleep_args(first_us)));
  SIMPLER_ASSIGN_OR_RETURN(RunHandle b, w.submit(h, sleep_args(1'000)));
  SIMPLER_RETURN_IF_ERROR(b.wait());
  return BackToBack{a.result(), b.result()};
}

TEST(Pipeline, DepthTwoEnqueuesTheSuccessorBehindTheRunningRun) {
  absl::StatusOr<BackToBack> runs = back_to_back(2, 0, 100'000);
  ASSERT_TRUE(runs.ok()) << runs.status();
  EXPECT_EQ(runs->second.effective_depth, 2);
  // Launched while run 0 was executing: before run 0 finished on the device.
  EXPECT_LT(runs->second.timing.launch_ns, runs->first.timing.device_end_ns);
}

TEST(Pipeline, DepthOneLaunchesTheSuccessorOnlyAfterCompletion) {
  absl::StatusOr<BackToBack> runs = back_to_back(1, 3, 50'000);
  ASSERT_TRUE(runs.ok()) << runs.status();
  EXPECT_EQ(runs->second.effective_depth, 1);
  EXPECT_GE(runs->second.timing.launch_ns, runs->first.timing.device_end_ns);
}

TEST(Pipeline, SubmittingFromOneThreadAtDepthTwoNeverNeedsAWait) {
  Worker w(opts(2));  // grant 3
  auto h = w.register_callable(sleep_program());
  ASSERT_TRUE(w.init().ok());
  std::vector<RunHandle> hs;
  for (int i = 0; i < 20; ++i) {
    auto r = w.submit(*h, sleep_args(2'000), {}, 5.0);  // blocks on the grant, never deadlocks
    ASSERT_TRUE(r.ok()) << r.status();
    hs.push_back(*r);
  }
  EXPECT_TRUE(w.close().ok());
  for (auto& r : hs) EXPECT_TRUE(r.done());
}

TEST(Pipeline, AdmissionDeadlineIsBackpressureNotUnboundedMemory) {
  Worker w(opts(1, 1));
  auto h = w.register_callable(sleep_program());
  ASSERT_TRUE(w.init().ok());
  RunHandle a = *w.submit(*h, sleep_args(300'000));
  auto b = w.submit(*h, sleep_args(1), {}, 0.02);
  EXPECT_EQ(b.status().code(), absl::StatusCode::kDeadlineExceeded);
  auto nan = w.submit(*h, sleep_args(1), {}, std::nan(""));
  EXPECT_EQ(nan.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(a.wait().ok());
  EXPECT_EQ(w.lane_stats().submitted, 1u);
}

TEST(Pipeline, WaitingSleepsInsteadOfPollingTheDevice) {
  Worker w(opts(1));
  auto h = w.register_callable(sleep_program());
  ASSERT_TRUE(w.init().ok());
  RunHandle a = *w.submit(*h, sleep_args(500'000));
  const uint64_t before = w.lane_stats().device_polls;
  ASSERT_TRUE(a.wait().ok());
  EXPECT_LE(w.lane_stats().device_polls - before, 3u);
}

TEST(Pipeline, PredictedReapsStillBoundDevicePolls) {
  // Once the lane has timed a callable it reaps by the predicted end (the
  // event with a deadline just before it, a bounded poll, a second look, then
  // the event): still at most 3 polls.
  Worker w(opts(2));
  auto h = w.register_callable(sleep_program());
  ASSERT_TRUE(w.init().ok());
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(w.submit(*h, sleep_args(100'000))->wait().ok());
  RunHandle a = *w.submit(*h, sleep_args(300'000));  // longer than predicted
  const uint64_t before = w.lane_stats().device_polls;
  ASSERT_TRUE(a.wait().ok());
  EXPECT_LE(w.lane_stats().device_polls - before, 3u);
  // A run that ends earlier than predicted is reaped as well (no lost wake-up).
  RunHandle b = *w.submit(*h, sleep_args(1'000));
  ASSERT_TRUE(b.wait(5.0).ok());
}

TEST(Pipeline, SecondLookIsDecidedWhenTakenNotWhenTheWaitBegan) {
  // Run A overruns its prediction. Its successor B is launched only after the
  // lane began waiting for A (at depth 2 the host usually launches the
  // successor mid-run). The lane must still take its second timed look past
  // the predicted end before sleeping on the event: three polls for A, the
  // third counted as the lane goes to sleep on A's event — reached while A is
  // still held on the device, so this does not depend on timing. (Deciding
  // when the wait began gave two: first look, then the event.)
  // The fake clock runs with real time (nothing advances it here); it shows when the lane thread
  // waits, bounded by a deadline, for a run's record.
  base::FakeEnv env;
  WorkerOptions o = opts(2);
  o.env = &env;
  Worker w(o);
  auto gate = w.register_callable(testing::gate_program());
  auto sleep = w.register_callable(sleep_program());
  ASSERT_TRUE(w.init().ok());
  {  // teach the lane that the gate program takes ~300 ms (B below is launched long before A is
     // predicted to end): the run is held at its gate past a 300 ms wait that must time out
    testing::Gate open;
    RunHandle e = *w.submit(*gate, testing::gate_args(open));
    EXPECT_EQ(e.wait(0.3).code(), absl::StatusCode::kDeadlineExceeded);
    open.open();
    ASSERT_TRUE(e.wait().ok());
  }
  const uint64_t before = w.lane_stats().device_polls;
  testing::Gate open;
  RunHandle a = *w.submit(*gate, testing::gate_args(open));
  // The lane is waiting for A (asleep on its record until just before the predicted end).
  ASSERT_TRUE(env.await_timed_waiters(1, std::chrono::seconds(10)));
  RunHandle b = *w.submit(*sleep, sleep_args(1'000));
  EXPECT_EQ(b.state(), RunState::kLaunched);  // queued on the device behind A
  EXPECT_TRUE(testing::eventually([&] { return w.lane_stats().device_polls - before >= 3; }));
  EXPECT_EQ(w.lane_stats().device_polls - before, 3u) << "no second look before the event";
  EXPECT_FALSE(a.done());
  open.open();
  ASSERT_TRUE(a.wait().ok());
  ASSERT_TRUE(b.wait().ok());
  EXPECT_TRUE(w.close().ok());
}

TEST(Pipeline, RunMuchShorterThanPredictedIsReapedWhenItEnds) {
  // The lane predicts a callable's run time from its recent runs. A run far
  // shorter than that (a stale estimate) must be reaped when the device
  // finishes it, not when the prediction says: wait() returns long before
  // the predicted 300 ms have passed.
  Worker w(opts(1));
  auto h = w.register_callable(sleep_program());
  ASSERT_TRUE(w.init().ok());
  for (int i = 0; i < 2; ++i) ASSERT_TRUE(w.submit(*h, sleep_args(300'000))->wait().ok());
  RunHandle b = *w.submit(*h, sleep_args(1'000));
  ASSERT_TRUE(b.wait().ok());
  const int64_t reaped_after_ns = base::now_ns() - b.result().timing.device_end_ns;
  EXPECT_LT(reaped_after_ns, 150'000'000) << "reaped at the stale prediction, not at the end";
  EXPECT_LE(b.result().timing.device_end_ns - b.result().timing.device_start_ns, 150'000'000);
}

TEST(Pipeline, DepthCountsOnlyRunsTheDeviceHasNotFinished) {
  // Depth 1: B launches as soon as the device finished A, even when the lane
  // thread has not reaped A yet; its effective depth is 1 either way.
  Worker w(opts(1, 3));
  auto h = w.register_callable(sleep_program());
  ASSERT_TRUE(w.init().ok());
  for (int i = 0; i < 50; ++i) {
    RunHandle a = *w.submit(*h, sleep_args(200));
    RunHandle b = *w.submit(*h, sleep_args(200));
    ASSERT_TRUE(b.wait().ok());
    ASSERT_TRUE(a.wait().ok());
    EXPECT_EQ(a.result().effective_depth, 1);
    EXPECT_EQ(b.result().effective_depth, 1);
    // Serial on the device: B started after A ended.
    EXPECT_LE(a.result().timing.device_end_ns, b.result().timing.device_start_ns);
  }
}

TEST(Pipeline, ConcurrentSubmittersGetUniqueIdentitiesAndExactResults) {
  Worker w(opts(2, 4));
  auto h = w.register_callable(affine_program());
  ASSERT_TRUE(w.init().ok());
  constexpr int kThreads = 4, kPer = 100;
  std::vector<int64_t> in(kThreads * kPer), out(kThreads * kPer, -1);
  std::vector<std::vector<RunHandle>> handles(kThreads);
  std::vector<std::thread> ts;
  for (int t = 0; t < kThreads; ++t) {
    ts.emplace_back([&, t] {
      for (int i = 0; i < kPer; ++i) {
        const int k = t * kPer + i;
        in[k] = k;
        auto r = w.submit(*h, affine_args(&in[k], &out[k], 1));
        if (r.ok()) handles[t].push_back(*r);
      }
    });
  }
  for (auto& t : ts) t.join();
  std::set<uint64_t> ids;
  for (auto& hv : handles) {
    for (auto& r : hv) {
      EXPECT_TRUE(r.wait().ok());
      ids.insert(r.id().value);
    }
  }
  EXPECT_EQ(ids.size(), static_cast<size_t>(kThreads * kPer));
  for (int k = 0; k < kThreads * kPer; ++k) EXPECT_EQ(out[k], 3 * k + 1);
}

TEST(Pipeline, CloseRacingSubmitsNeitherHangsNorLosesRuns) {
  Worker w(opts(2, 3));
  auto h = w.register_callable(affine_program());
  ASSERT_TRUE(w.init().ok());
  std::vector<int64_t> in(10000, 2), out(10000, 0);
  std::atomic<int> accepted{0};
  std::vector<RunHandle> hs;
  std::thread t([&] {
    for (int i = 0; i < 10000; ++i) {
      auto r = w.submit(*h, affine_args(&in[i], &out[i], 0));
      if (!r.ok()) {
        EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
        break;
      }
      hs.push_back(*r);
      accepted++;
    }
  });
  // Close while the submitter is mid-stream: some runs accepted, most still to come.
  EXPECT_TRUE(testing::eventually([&] { return accepted.load() >= 50; }));
  EXPECT_TRUE(w.close().ok());
  t.join();
  for (auto& r : hs) {
    ASSERT_TRUE(r.done());
    EXPECT_TRUE(r.wait().ok());
  }
  for (int i = 0; i < accepted; ++i) EXPECT_EQ(out[i], 6);
}

TEST(Pipeline, ResourceCountsStayConsistentThroughARandomizedFaultRun) {
  std::mt19937 rng(1234);
  std::string plan;
  for (int run = 0; run < 60; ++run) {
    if (rng() % 5 == 0) {
      if (!plan.empty()) plan += ",";
      plan += "run=" + std::to_string(run) + ":task=0:kind=kernel_error";
    }
  }
  plan += ",run=70:task=0:kind=device_fault";
  WorkerOptions o = opts(2, 4);
  o.faults = *device::FaultPlan::parse(plan);
  Worker w(o);
  auto h = w.register_callable(affine_program(2));
  ASSERT_TRUE(w.init().ok());
  std::atomic<bool> stop{false};
  std::atomic<int> samples{0}, bad{0};
  std::thread sampler([&] {
    while (!stop) {
      if (!counts_consistent(w.resources())) bad++;
      samples++;
      std::this_thread::yield();
    }
  });
  std::vector<int64_t> in(100, 1), out(100, 0);
  int refused = 0;
  for (int i = 0; i < 100; ++i) {
    auto r = w.submit(*h, affine_args(&in[i], &out[i], i));
    if (!counts_consistent(w.resources())) bad++;  // also observed from the submitter
    if (!r.ok()) {
      EXPECT_NE(r.status().message().find("lane poisoned by run 70"), std::string_view::npos);
      ++refused;
    }
  }
  (void)w.close();
  while (samples.load() < 20) std::this_thread::yield();  // the sampler saw the end state too
  stop = true;
  sampler.join();
  EXPECT_EQ(bad.load(), 0);
  EXPECT_GT(samples.load(), 10);
  EXPECT_GT(refused, 0);
  // End state: every set came back except run 70's, which the device fault
  // left unproven (quarantined, still counted).
  ArenaCounts end = w.resources();
  EXPECT_EQ(end.live, 0);
  EXPECT_EQ(end.quarantined, 1);
  EXPECT_EQ(end.free, end.grant - 1);
  EXPECT_EQ(end.grant, 4);
}

TEST(Pipeline, TraceHasHostAndDeviceSpansCarryingTheRunId) {
  base::TraceRecorder trace;
  WorkerOptions o = opts(2);
  o.trace = &trace;
  Worker w(o);
  auto h = w.register_callable(affine_program(2));
  ASSERT_TRUE(w.init().ok());
  int64_t in[3] = {1, 2, 3}, out[3] = {};
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(w.submit(*h, affine_args(&in[i], &out[i], 0)).ok());
  ASSERT_TRUE(w.close().ok());
  std::map<std::string, std::set<int64_t>> runs_by_span;
  int device_tasks = 0;
  for (const auto& s : trace.spans()) {
    runs_by_span[s.name].insert(s.run_id);
    if (s.category == "device" && s.name == "affine") {
      ++device_tasks;
      EXPECT_GE(s.tid, 1);  // per core
    }
  }
  for (const char* name : {"submit", "prepare", "launch", "reap", "finalize", "retire", "run"}) {
    EXPECT_EQ(runs_by_span[name], (std::set<int64_t>{0, 1, 2})) << name;
  }
  EXPECT_EQ(device_tasks, 6);
}

}  // namespace
}  // namespace simpler::worker::testing
