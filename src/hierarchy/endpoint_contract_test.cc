// One contract, three endpoints: the run semantics an L3 parent relies on, stated once and run
// against the in-process lane, a thread child behind a mailbox and a forked process child
// behind a shared-memory mailbox.
#include <sys/mman.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <mutex>
#include <set>
#include <thread>

#include "gtest/gtest.h"
#include "hierarchy/close_race_test_util.h"
#include "hierarchy/endpoint.h"
#include "simpler/base/clock.h"
#include "simpler/base/enum_names.h"
#include "simpler/device/fault_plan.h"
#include "worker/worker_test_util.h"

namespace simpler::hierarchy {
namespace {

using worker::RunHandle;
using worker::testing::affine_kernel;
using worker::testing::contains;
using worker::testing::sleep_kernel;

enum class Kind { kLane, kThread, kProcess };

constexpr base::EnumNames<Kind> kKindNames = {
    {Kind::kLane, "lane"}, {Kind::kThread, "thread"}, {Kind::kProcess, "process"}};

std::string kind_name(Kind k) { return std::string(kKindNames.name(k, "?")); }

// Host memory every kind of child sees at the same address: a shared mapping
// made before any child is forked.
struct SharedCells {
  SharedCells() {
    void* p = mmap(nullptr, kBytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    EXPECT_NE(p, MAP_FAILED);
    cells = static_cast<int64_t*>(p);
  }
  ~SharedCells() { munmap(cells, kBytes); }
  static constexpr size_t kBytes = 1 << 16;
  int64_t* cells;
};

// out = 3 * in + k over two HOST cells; then sleeps scalar(3) µs.
task::ChipCallable affine_sleep_program() {
  return {"affine_sleep",
          [](task::OrchestrationContext& ctx, const task::TaskArgs& args) {
            task::TaskArgs a;
            a.add_tensor(args.tensor(0), task::ArgDirection::kIn)
                .add_tensor(args.tensor(1), task::ArgDirection::kOut)
                .add_scalar_i64(args.scalar_i64(2));
            SIMPLER_RETURN_IF_ERROR(ctx.submit(0, a));
            task::TaskArgs s;
            s.add_scalar_i64(args.scalar_i64(3));
            return ctx.submit(1, s);
          },
          {{"affine", affine_kernel}, {"sleep", sleep_kernel}}};
}

RunRequest affine_request(int64_t* in, int64_t* out, int64_t k, int64_t sleep_us = 0) {
  RunRequest r;
  r.callable = "affine_sleep";
  task::Tensor ti =
      *task::Tensor::contiguous(reinterpret_cast<uintptr_t>(in), {1}, task::DataType::kInt64);
  task::Tensor to =
      *task::Tensor::contiguous(reinterpret_cast<uintptr_t>(out), {1}, task::DataType::kInt64);
  ti.memory = task::MemoryKind::kHost;
  to.memory = task::MemoryKind::kHost;
  r.args.add_tensor(ti, task::ArgDirection::kIn)
      .add_tensor(to, task::ArgDirection::kOut)
      .add_scalar_i64(k)
      .add_scalar_i64(sleep_us);
  return r;
}

// The shared mapping of the running test (set by the fixture): the child's host_ranges.
std::pair<uint64_t, uint64_t> g_shared_range;

ChildSpec spec_with(const std::string& faults = "") {
  ChildSpec spec;
  spec.host_ranges = {g_shared_range};
  spec.index = 1;
  spec.options = worker::testing::test_options(2);
  if (!faults.empty()) spec.options.faults = *device::FaultPlan::parse(faults);
  spec.callables.push_back(affine_sleep_program());
  return spec;
}

std::unique_ptr<Endpoint> start(Kind kind, const ChildSpec& spec) {
  absl::StatusOr<std::unique_ptr<Endpoint>> e;
  switch (kind) {
    case Kind::kLane:
      e = start_lane_child(spec);
      break;
    case Kind::kThread:
      e = start_thread_child(spec);
      break;
    case Kind::kProcess:
      e = start_process_child(spec);
      break;
  }
  EXPECT_TRUE(e.ok()) << e.status();
  return e.ok() ? std::move(*e) : nullptr;
}

class EndpointContract : public ::testing::TestWithParam<Kind> {
 protected:
  void SetUp() override {
    const auto base = reinterpret_cast<uintptr_t>(mem.cells);
    g_shared_range = {base, base + SharedCells::kBytes};
    // ThreadSanitizer runs a background thread of its own: no fork is safe there, and
    // start_process_child refuses it. The process kind runs in the other legs.
    if (GetParam() == Kind::kProcess && process_thread_count() != 1) {
      GTEST_SKIP() << "this process already runs " << process_thread_count()
                   << " threads (a sanitizer's): process children cannot be forked";
    }
  }
  SharedCells mem;  // before the child: a process child maps it at the same address
};

TEST_P(EndpointContract, ARunComputesItsResultAndItsHandleCompletes) {
  auto e = start(GetParam(), spec_with());
  ASSERT_NE(e, nullptr);
  EXPECT_NE(e->describe().find("child 1 (" + kind_name(GetParam())), std::string::npos)
      << e->describe();
  mem.cells[0] = 5;
  RunHandle h = *e->submit(affine_request(&mem.cells[0], &mem.cells[1], 1));
  EXPECT_TRUE(h.wait().ok());
  EXPECT_TRUE(h.done());
  EXPECT_EQ(h.state(), worker::RunState::kRetired);
  EXPECT_EQ(h.result().terminal_state, worker::RunState::kCompleted);
  EXPECT_EQ(mem.cells[1], 16);
  EXPECT_TRUE(e->close().ok());
}

// A mailbox's grant changes while runs go on (grown, then shrunk); runs submitted across the
// changes all finish with their own results. A lane has no mailbox and says so.
TEST_P(EndpointContract, TheMailboxGrantChangesWhileRunsGoOn) {
  auto e = start(GetParam(), spec_with());
  ASSERT_NE(e, nullptr);
  if (GetParam() == Kind::kLane) {
    EXPECT_EQ(e->mailbox_grant(), 0u);
    EXPECT_TRUE(contains(e->set_mailbox_grant(8), "child 1 (lane) has no mailbox")) << "lane";
    EXPECT_TRUE(e->close().ok());
    return;
  }
  const uint32_t initial = e->mailbox_grant();
  EXPECT_GE(initial, 1u);
  std::vector<RunHandle> hs;
  int next = 0;
  auto submit_some = [&](int n) {
    for (int i = 0; i < n; ++i, ++next) {
      mem.cells[2 * next] = next;
      hs.push_back(
          *e->submit(affine_request(&mem.cells[2 * next], &mem.cells[2 * next + 1], 7, 300)));
    }
  };
  submit_some(4);
  ASSERT_TRUE(e->set_mailbox_grant(16).ok());
  EXPECT_EQ(e->mailbox_grant(), 16u);
  submit_some(12);
  absl::Status refused = e->set_mailbox_grant(0);
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << refused;
  EXPECT_TRUE(contains(refused, "child 1 (")) << refused;
  EXPECT_EQ(e->mailbox_grant(), 16u);
  for (RunHandle& h : hs) ASSERT_TRUE(h.wait().ok());
  ASSERT_TRUE(e->set_mailbox_grant(1).ok());  // nothing held above: the table shrinks
  EXPECT_EQ(e->mailbox_grant(), 1u);
  submit_some(4);
  for (int i = 0; i < next; ++i) {
    ASSERT_TRUE(hs[i].wait().ok()) << i;
    EXPECT_EQ(mem.cells[2 * i + 1], 3 * i + 7) << i;
  }
  EXPECT_TRUE(e->close().ok());
}

TEST_P(EndpointContract, RunsFinishInSubmissionOrderWithTheirOwnResults) {
  auto e = start(GetParam(), spec_with());
  ASSERT_NE(e, nullptr);
  constexpr int kRuns = 24;
  std::vector<RunHandle> hs;
  for (int i = 0; i < kRuns; ++i) {
    mem.cells[2 * i] = i;
    // Earlier runs sleep longer: completion order cannot follow run length.
    hs.push_back(*e->submit(
        affine_request(&mem.cells[2 * i], &mem.cells[2 * i + 1], 100, (kRuns - i) * 200)));
  }
  for (int i = 0; i < kRuns; ++i) {
    ASSERT_TRUE(hs[i].wait().ok()) << i;
    for (int j = 0; j < i; ++j) ASSERT_TRUE(hs[j].done()) << j << " behind " << i;
    EXPECT_EQ(hs[i].id().value, static_cast<uint64_t>(i));
    EXPECT_EQ(mem.cells[2 * i + 1], 3 * i + 100);
  }
  EXPECT_TRUE(e->close().ok());
}

TEST_P(EndpointContract, AKernelErrorFailsOnlyItsRunNamingTheChildAndIsDeliveredOnce) {
  auto e = start(GetParam(), spec_with("run=1:task=0:kind=kernel_error"));
  ASSERT_NE(e, nullptr);
  std::vector<RunHandle> hs;
  for (int i = 0; i < 3; ++i) {
    hs.push_back(*e->submit(affine_request(&mem.cells[2 * i], &mem.cells[2 * i + 1], 0)));
  }
  EXPECT_TRUE(hs[0].wait().ok());
  absl::Status s = hs[1].wait();
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
  EXPECT_TRUE(contains(s, "child 1 (" + kind_name(GetParam()))) << s;
  EXPECT_TRUE(contains(s, "injected kernel_error")) << s;
  EXPECT_EQ(hs[1].result().terminal_state, worker::RunState::kFailed);
  EXPECT_TRUE(hs[2].wait().ok());
  EXPECT_TRUE(e->close().ok());  // delivered by wait(): not reported again
}

TEST_P(EndpointContract, CloseReturnsTheFirstUndeliveredErrorCountingTheOthers) {
  auto e =
      start(GetParam(), spec_with("run=1:task=0:kind=kernel_error,run=2:task=0:kind=kernel_error,"
                                  "run=3:task=0:kind=kernel_error"));
  ASSERT_NE(e, nullptr);
  std::vector<RunHandle> hs;
  for (int i = 0; i < 5; ++i) {
    hs.push_back(*e->submit(affine_request(&mem.cells[2 * i], &mem.cells[2 * i + 1], 0)));
  }
  EXPECT_FALSE(hs[2].wait().ok());  // delivered
  hs.clear();                       // the rest dropped unwaited
  absl::Status c = e->close();
  EXPECT_EQ(c.code(), absl::StatusCode::kInternal) << c;
  EXPECT_TRUE(contains(c, "run 1 task 0")) << c;
  EXPECT_TRUE(contains(c, "(and 1 more undelivered run error)")) << c;
  EXPECT_TRUE(e->close().ok());  // idempotent
  absl::StatusOr<RunHandle> after = e->submit(affine_request(&mem.cells[0], &mem.cells[1], 0));
  EXPECT_EQ(after.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(contains(after.status(), "submit after close()")) << after.status();
}

TEST_P(EndpointContract, WhatTheParentCanSeeIsRefusedAtSubmitAndHarmsNoOtherRun) {
  auto e = start(GetParam(), spec_with());
  ASSERT_NE(e, nullptr);
  RunRequest unknown = affine_request(&mem.cells[0], &mem.cells[1], 0);
  unknown.callable = "no_such_program";
  EXPECT_EQ(e->submit(unknown).status().code(), absl::StatusCode::kNotFound);
  RunRequest bad = affine_request(&mem.cells[0], &mem.cells[1], 0);
  bad.config.timeout_s = std::nan("");
  EXPECT_EQ(e->submit(bad).status().code(), absl::StatusCode::kInvalidArgument);
  mem.cells[0] = 2;
  RunHandle ok = *e->submit(affine_request(&mem.cells[0], &mem.cells[1], 0));
  EXPECT_TRUE(ok.wait().ok());
  EXPECT_EQ(ok.id().value, 0u);  // refusals took no identity
  EXPECT_EQ(mem.cells[1], 6);
  EXPECT_TRUE(e->close().ok());
}

TEST_P(EndpointContract, ADeviceFaultPoisonsTheChildAndLaterRunsFailNamingIt) {
  auto e = start(GetParam(), spec_with("run=0:task=0:kind=device_fault"));
  ASSERT_NE(e, nullptr);
  RunHandle r0 = *e->submit(affine_request(&mem.cells[0], &mem.cells[1], 0, 1000));
  RunHandle r1 = *e->submit(affine_request(&mem.cells[2], &mem.cells[3], 0));
  absl::Status s0 = r0.wait();
  EXPECT_TRUE(contains(s0, "injected device_fault")) << s0;
  absl::Status s1 = r1.wait();
  EXPECT_TRUE(contains(s1, "lane poisoned by run 0")) << s1;
  EXPECT_TRUE(contains(s1, "child 1 (")) << s1;
  (void)e->close();
}

TEST_P(EndpointContract, TwoSubmittingThreadsGetUniqueIdentitiesAndExactResults) {
  auto e = start(GetParam(), spec_with());
  ASSERT_NE(e, nullptr);
  constexpr int kPerThread = 40;
  std::vector<RunHandle> hs[2];
  std::thread t[2];
  for (int k = 0; k < 2; ++k) {
    t[k] = std::thread([&, k] {
      for (int i = 0; i < kPerThread; ++i) {
        const int cell = 2 * (k * kPerThread + i);
        mem.cells[cell] = cell;
        absl::StatusOr<RunHandle> h =
            e->submit(affine_request(&mem.cells[cell], &mem.cells[cell + 1], k));
        ASSERT_TRUE(h.ok()) << h.status();
        hs[k].push_back(*h);
      }
    });
  }
  for (auto& th : t) th.join();
  std::set<uint64_t> ids;
  for (int k = 0; k < 2; ++k) {
    for (int i = 0; i < kPerThread; ++i) {
      ASSERT_TRUE(hs[k][i].wait().ok());
      ids.insert(hs[k][i].id().value);
      const int cell = 2 * (k * kPerThread + i);
      EXPECT_EQ(mem.cells[cell + 1], 3 * cell + k);
    }
  }
  EXPECT_EQ(ids.size(), 2u * kPerThread);
  EXPECT_TRUE(e->close().ok());
}

// close() racing two submitting threads: every submit is either refused ("submit after
// close()") or its run completes; nothing hangs and nothing is lost.
TEST_P(EndpointContract, CloseRacingSubmitsNeitherHangsNorLosesRuns) {
  for (int round = 0; round < 5; ++round) {
    auto e = start(GetParam(), spec_with());
    ASSERT_NE(e, nullptr);
    testing::race_close_against_submits(
        [&](int k, int i) {
          const int cell = 2 * (k * 200 + i);
          return e->submit(affine_request(&mem.cells[cell], &mem.cells[cell + 1], 0, 50));
        },
        [&] { return e->close(); }, 200, /*after_submits=*/5 + 40 * round);
  }
}

// poll(): waiters collecting finished runs on their own threads race the endpoint's own
// thread; every run is still delivered exactly once, in run order, with its own result (and a
// failed run's error stays its own).
TEST_P(EndpointContract, PollersRacingTheEndpointsThreadDeliverEachRunOnceInOrder) {
  auto e = start(GetParam(), spec_with("run=7:task=0:kind=kernel_error"));
  ASSERT_NE(e, nullptr);
  std::mutex mu;
  std::vector<uint64_t> done_order;
  std::atomic<int> on_pollers{0};
  std::set<std::thread::id> poller_ids;
  std::atomic<bool> stop{false};
  std::vector<std::thread> pollers;
  for (int k = 0; k < 2; ++k) {
    pollers.emplace_back([&] {
      while (!stop.load()) {
        e->poll();
        std::this_thread::yield();
      }
    });
  }
  // Its owner turns "a waiter polls" on and off meanwhile (each turn-off collects once), so
  // runs finish with the endpoint's thread both kept asleep and woken.
  std::thread toggler([&] {
    for (bool on = true; !stop.load(); on = !on) {
      e->set_waiter_polling(on);
      simpler::testing::spin_for(std::chrono::microseconds(on ? 300 : 100));  // jitter
    }
    e->set_waiter_polling(false);
  });
  {
    std::lock_guard<std::mutex> lock(mu);
    for (const auto& t : pollers) poller_ids.insert(t.get_id());
  }
  e->set_on_done([&](uint64_t run) {
    std::lock_guard<std::mutex> lock(mu);
    done_order.push_back(run);
    if (poller_ids.count(std::this_thread::get_id()) != 0) ++on_pollers;
  });
  constexpr int kRuns = 60;
  std::vector<RunHandle> hs;
  for (int i = 0; i < kRuns; ++i) {
    mem.cells[2 * i] = i;
    hs.push_back(
        *e->submit(affine_request(&mem.cells[2 * i], &mem.cells[2 * i + 1], 1, (i % 3) * 20)));
  }
  for (int i = 0; i < kRuns; ++i) {
    const absl::Status st = hs[i].wait();
    if (i == 7) {
      EXPECT_TRUE(contains(st, "injected kernel_error")) << st;
    } else {
      ASSERT_TRUE(st.ok()) << i << ": " << st;
      EXPECT_EQ(mem.cells[2 * i + 1], 3 * i + 1) << i;
    }
  }
  stop = true;
  for (auto& t : pollers) t.join();
  toggler.join();
  EXPECT_TRUE(e->close().ok());  // run 7's error was delivered by its wait()
  std::lock_guard<std::mutex> lock(mu);
  ASSERT_EQ(done_order.size(), static_cast<size_t>(kRuns));
  for (int i = 0; i < kRuns; ++i) EXPECT_EQ(done_order[i], static_cast<uint64_t>(i));
  ::testing::Test::RecordProperty("runs_delivered_on_pollers", on_pollers.load());
}

// While a waiter polls, the endpoint's own thread is not woken for finished runs; when the
// polling stops, the call that stops it delivers what finished meanwhile, and later runs are
// delivered by the endpoint's thread again with nobody polling.
TEST_P(EndpointContract, WhatFinishedWhileAWaiterPolledIsDeliveredWhenThePollingStops) {
  auto e = start(GetParam(), spec_with());
  ASSERT_NE(e, nullptr);
  std::mutex mu;
  std::vector<std::pair<uint64_t, std::thread::id>> done;
  e->set_on_done([&](uint64_t run) {
    std::lock_guard<std::mutex> lock(mu);
    done.emplace_back(run, std::this_thread::get_id());
  });
  for (int round = 0; round < 3; ++round) {
    e->set_waiter_polling(true);
    constexpr int kRuns = 4;
    std::vector<RunHandle> hs;
    for (int i = 0; i < kRuns; ++i) {
      const int k = round * kRuns + i;
      mem.cells[2 * k] = k;
      hs.push_back(*e->submit(affine_request(&mem.cells[2 * k], &mem.cells[2 * k + 1], 1, 0)));
    }
    // The runs finish on the child (each takes microseconds, milliseconds under a sanitizer);
    // nobody polls. One that is slower still finishes after the clear below, and is then
    // delivered by the endpoint's woken thread. A sleep: what is under test is what the child
    // reported unseen, and no state shows a report short of collecting it (the output cells are
    // written by the child's threads without synchronization the test could share).
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    const int64_t cleared = base::now_ns();
    e->set_waiter_polling(false);
    // Delivered promptly: by the call above (the endpoint's thread was not woken) or, for a
    // report that came after the clear, by the endpoint's woken thread — not on the endpoint
    // thread's own timed look a second later (what a clear that did not collect would leave).
    for (int i = 0; i < kRuns; ++i) {
      const int64_t left_ns = 900'000'000 - (base::now_ns() - cleared);
      ASSERT_TRUE(simpler::testing::eventually([&] { return hs[i].done(); },
                                               std::chrono::milliseconds(left_ns / 1'000'000)))
          << "round " << round << " run " << i;
      EXPECT_TRUE(hs[i].wait().ok());
      EXPECT_EQ(mem.cells[2 * (round * kRuns + i) + 1], 3 * (round * kRuns + i) + 1);
    }
  }
  size_t by_caller = 0;
  {
    std::lock_guard<std::mutex> lock(mu);
    ASSERT_EQ(done.size(), 12u);
    for (size_t i = 0; i < done.size(); ++i) {
      EXPECT_EQ(done[i].first, i);
      if (done[i].second == std::this_thread::get_id()) ++by_caller;
    }
  }
  EXPECT_GE(by_caller, 1u);  // the stopping call delivered runs itself
  // Nobody polls now: a run is delivered by the endpoint's own thread.
  mem.cells[100] = 5;
  absl::StatusOr<RunHandle> h = e->submit(affine_request(&mem.cells[100], &mem.cells[101], 1, 0));
  ASSERT_TRUE(h.ok()) << h.status();
  ASSERT_TRUE(h->wait(10).ok());
  EXPECT_EQ(mem.cells[101], 16);
  // The handle is done before its on_done callback runs: give the callback its moment.
  const auto count = [&] {
    std::lock_guard<std::mutex> lock(mu);
    return done.size();
  };
  EXPECT_TRUE(simpler::testing::eventually([&] { return count() >= 13; }));
  {
    std::lock_guard<std::mutex> lock(mu);
    ASSERT_EQ(done.size(), 13u);
    EXPECT_NE(done.back().second, std::this_thread::get_id());
  }
  EXPECT_TRUE(e->close().ok());
}

// Child device memory: allocated, filled from shared host memory, used by a run as DEVICE
// tensors, read back, freed — and each misuse refused naming the child.
TEST_P(EndpointContract, ChildDeviceBuffersCarryARunsInputsAndOutputs) {
  auto e = start(GetParam(), spec_with());
  ASSERT_NE(e, nullptr);
  absl::StatusOr<worker::DeviceBuffer> in = e->malloc(8);
  absl::StatusOr<worker::DeviceBuffer> out = e->malloc(8);
  ASSERT_TRUE(in.ok()) << in.status();
  ASSERT_TRUE(out.ok()) << out.status();
  mem.cells[0] = 7;
  ASSERT_TRUE(e->copy_to(*in, &mem.cells[0], 8).ok());
  RunRequest r;
  r.callable = "affine_sleep";
  r.args.add_tensor(*in->tensor({1}, task::DataType::kInt64), task::ArgDirection::kIn)
      .add_tensor(*out->tensor({1}, task::DataType::kInt64), task::ArgDirection::kOut)
      .add_scalar_i64(2)
      .add_scalar_i64(0);
  ASSERT_TRUE(e->submit(r)->wait().ok());
  mem.cells[1] = 0;
  ASSERT_TRUE(e->copy_from(&mem.cells[1], *out, 8).ok());
  EXPECT_EQ(mem.cells[1], 23);
  // Host memory the child does not share is refused before anything is sent.
  int64_t private_cell = 0;
  absl::Status bad = e->copy_to(*in, &private_cell, 8);
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument) << bad;
  EXPECT_TRUE(contains(bad, "is not memory the child shares")) << bad;
  // A range past the buffer, from the child's worker, named.
  absl::Status past = e->copy_to(*in, &mem.cells[0], 16);
  EXPECT_EQ(past.code(), absl::StatusCode::kInvalidArgument) << past;
  EXPECT_TRUE(contains(past, "child 1 (")) << past;
  EXPECT_TRUE(e->free(*in).ok());
  absl::Status twice = e->free(*in);
  EXPECT_EQ(twice.code(), absl::StatusCode::kNotFound) << twice;
  EXPECT_TRUE(contains(twice, "child 1 (")) << twice;
  EXPECT_TRUE(e->free(*out).ok());
  EXPECT_TRUE(e->close().ok());
}

INSTANTIATE_TEST_SUITE_P(AllEndpoints, EndpointContract,
                         ::testing::Values(Kind::kLane, Kind::kThread, Kind::kProcess),
                         [](const auto& info) { return kind_name(info.param); });

}  // namespace
}  // namespace simpler::hierarchy
