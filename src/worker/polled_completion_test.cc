// Polled completion (Worker::set_completion_polling / poll_completions; ChipRunLane): while a
// caller has it on, the lane thread leaves launched runs to that caller, which reaps them on its
// own thread; the lane thread takes over when polling stops, while a submit waits for a resource
// set, and while the lane closes. Runs retire once each, in run order, whoever reaps them.
#include <atomic>
#include <chrono>
#include <future>
#include <limits>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "simpler/base/status.h"
#include "simpler/worker/worker.h"
#include "worker/worker_test_util.h"

namespace simpler::worker::testing {
namespace {

constexpr double kForever = std::numeric_limits<double>::infinity();

// Registers affine_program on `w` (not started yet), starts `w` and turns its completion polling
// on: the set-up of most tests here. The callable's handle, or the first error.
absl::StatusOr<CallableHandle> start_polling(Worker& w) {
  SIMPLER_ASSIGN_OR_RETURN(CallableHandle h, w.register_callable(affine_program()));
  SIMPLER_RETURN_IF_ERROR(w.init());
  w.set_completion_polling(true);
  return h;
}

// Calls poll_completions() until `h` is done or 10 s passed; returns how many runs it retired.
int32_t poll_until_done(Worker& w, const RunHandle& h) {
  int32_t retired = 0;
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!h.done() && std::chrono::steady_clock::now() < until) {
    retired += w.poll_completions();
    std::this_thread::yield();
  }
  return retired;
}

TEST(PolledCompletion, ThePollerReapsOnItsOwnThreadAndTheLaneThreadLeavesTheRunAlone) {
  Worker w(testing::test_options(1));
  auto prog = start_polling(w);
  ASSERT_TRUE(prog.ok()) << prog.status();
  int64_t in = 4, out = 0;
  std::thread::id notified_on;
  auto h = w.submit(*prog, affine_args(&in, &out, 1), {}, kForever,
                    [&notified_on](const RunResult&) { notified_on = std::this_thread::get_id(); });
  ASSERT_TRUE(h.ok()) << h.status();
  // The device finishes a one-task run in microseconds; nobody but this thread reaps it: in
  // 100 ms the run must not become done (a bounded wait that must time out).
  EXPECT_FALSE(testing::eventually([&] { return h->done(); }, std::chrono::milliseconds(100)))
      << "the lane thread reaped a run left to the completion poller";
  EXPECT_EQ(h->state(), RunState::kLaunched);
  EXPECT_EQ(poll_until_done(w, *h), 1);
  ASSERT_TRUE(h->done());
  EXPECT_EQ(notified_on, std::this_thread::get_id());
  EXPECT_TRUE(h->wait().ok());
  EXPECT_EQ(out, 13);
  EXPECT_EQ(w.poll_completions(), 0);  // nothing left
  w.set_completion_polling(false);
  EXPECT_EQ(w.lane_stats().in_flight, 0);
  EXPECT_EQ(w.resources().free, w.resources().grant);
  EXPECT_TRUE(w.close().ok());
}

TEST(PolledCompletion, StoppingHandsTheRunsLeftToTheLaneThreadInOrder) {
  Worker w(testing::test_options(2, 3));
  auto prog = start_polling(w);
  ASSERT_TRUE(prog.ok()) << prog.status();
  w.set_completion_polling(true);  // nested: counted
  std::mutex mu;
  std::vector<uint64_t> order;
  std::vector<std::thread::id> threads;
  int64_t in[3] = {1, 2, 3}, out[3] = {};
  std::vector<RunHandle> hs;
  for (int i = 0; i < 3; ++i) {
    auto h =
        w.submit(*prog, affine_args(&in[i], &out[i], 0), {}, kForever, [&](const RunResult& r) {
          std::lock_guard<std::mutex> l(mu);
          order.push_back(r.id.value);
          threads.push_back(std::this_thread::get_id());
        });
    ASSERT_TRUE(h.ok()) << h.status();
    hs.push_back(*h);
  }
  // Neither with both pollers on nor with one must a run be reaped for 50 ms (the device
  // finishes them meanwhile): bounded waits that must time out.
  const auto any_done = [&hs] {
    for (const RunHandle& h : hs) {
      if (h.done()) return true;
    }
    return false;
  };
  EXPECT_FALSE(testing::eventually(any_done, std::chrono::milliseconds(50)));
  w.set_completion_polling(false);  // one poller still on
  EXPECT_FALSE(testing::eventually(any_done, std::chrono::milliseconds(50)));
  for (const RunHandle& h : hs) EXPECT_FALSE(h.done());
  w.set_completion_polling(false);  // the last one: the lane thread takes over
  for (const RunHandle& h : hs) EXPECT_TRUE(h.wait(10.0).ok());
  EXPECT_EQ(out[0], 3);
  EXPECT_EQ(out[2], 9);
  w.set_completion_polling(false);  // unmatched: ignored
  // A handle is done before its notification ran; close() returns after the last one.
  EXPECT_TRUE(w.close().ok());
  std::lock_guard<std::mutex> l(mu);
  ASSERT_EQ(order, (std::vector<uint64_t>{0, 1, 2}));
  for (const std::thread::id& t : threads) EXPECT_NE(t, std::this_thread::get_id());
}

// The poller itself blocks in submit waiting for the resource set its own earlier run holds:
// the lane thread reaps that run meanwhile, so the submit goes through.
TEST(PolledCompletion, ASubmitWaitingForAResourceSetIsNotStalledByThePoller) {
  Worker w(testing::test_options(1, 1));
  auto prog = start_polling(w);
  ASSERT_TRUE(prog.ok()) << prog.status();
  int64_t in[2] = {1, 2}, out[2] = {};
  auto first = w.submit(*prog, affine_args(&in[0], &out[0], 0));
  ASSERT_TRUE(first.ok()) << first.status();
  auto second = w.submit(*prog, affine_args(&in[1], &out[1], 0), {}, /*admission_timeout_s=*/10);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_TRUE(first->done());
  poll_until_done(w, *second);
  EXPECT_TRUE(second->wait(0.0).ok());
  EXPECT_EQ(out[1], 6);
  // A poll-only admission still fails at once when no set is free.
  auto held = w.submit(*prog, affine_args(&in[0], &out[0], 0));
  ASSERT_TRUE(held.ok());
  auto refused = w.submit(*prog, affine_args(&in[1], &out[1], 0), {}, /*admission_timeout_s=*/-1);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kDeadlineExceeded) << refused.status();
  poll_until_done(w, *held);
  EXPECT_TRUE(held->wait(0.0).ok());
  w.set_completion_polling(false);
  EXPECT_TRUE(w.close().ok());
}

TEST(PolledCompletion, CloseDrainsRunsLeftToAPollerThatStoppedPolling) {
  Worker w(testing::test_options(2, 3));
  auto prog = start_polling(w);  // and never turned off, never polled
  ASSERT_TRUE(prog.ok()) << prog.status();
  int64_t in[3] = {1, 2, 3}, out[3] = {};
  std::vector<RunHandle> hs;
  for (int i = 0; i < 3; ++i) hs.push_back(*w.submit(*prog, affine_args(&in[i], &out[i], 1)));
  const auto start = std::chrono::steady_clock::now();
  EXPECT_TRUE(w.close().ok());
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  for (const RunHandle& h : hs) EXPECT_TRUE(h.wait(0.0).ok());
  EXPECT_EQ(out[2], 10);
  w.set_completion_polling(false);  // after close: nothing
  EXPECT_EQ(w.poll_completions(), 0);
}

// Two affine runs (in 1 and 2, k 0) on a worker whose completions the test polls.
struct TwoPolledRuns {
  // Submits both runs to `prog` on `w`, then polls on this thread until the second is done: how
  // many runs the polls retired.
  int32_t submit_and_poll(Worker& w, CallableHandle prog) {
    first = *w.submit(prog, affine_args(&in[0], &out[0], 0));
    second = *w.submit(prog, affine_args(&in[1], &out[1], 0));
    return poll_until_done(w, second);
  }
  int64_t in[2] = {1, 2}, out[2] = {};
  RunHandle first, second;
};

// Errors reaped on the poller's thread: a kernel error fails its run only; a device fault
// poisons the lane, fails the runs behind it with the poison and aborts the device.
TEST(PolledCompletion, RunErrorsAndPoisonAreTheSameWhenThePollerReaps) {
  {
    Worker w(faulty_options("run=0:task=0:kind=kernel_error:code=7", 2));
    auto prog = start_polling(w);
    ASSERT_TRUE(prog.ok()) << prog.status();
    TwoPolledRuns bad_then_good;
    EXPECT_EQ(bad_then_good.submit_and_poll(w, *prog), 2);  // both reaped here
    EXPECT_TRUE(fails_with(bad_then_good.first.wait(0.0), absl::StatusCode::kInternal, "code 7"));
    EXPECT_TRUE(bad_then_good.second.wait(0.0).ok());
    EXPECT_EQ(bad_then_good.out[1], 6);
    EXPECT_TRUE(w.lane_stats().in_flight == 0);
    w.set_completion_polling(false);
    EXPECT_TRUE(w.close().ok());  // delivered
  }
  {
    Worker w(faulty_options("run=0:task=0:kind=device_fault:code=507018", 1, 2));
    auto prog = start_polling(w);
    ASSERT_TRUE(prog.ok()) << prog.status();
    TwoPolledRuns faulted_then_behind;
    EXPECT_EQ(faulted_then_behind.submit_and_poll(w, *prog), 2);  // both reaped here
    absl::Status s = faulted_then_behind.first.wait(0.0);
    EXPECT_TRUE(base::is_unrecoverable(s)) << s;
    EXPECT_TRUE(contains(s, "507018")) << s;
    absl::Status later = faulted_then_behind.second.wait(0.0);
    EXPECT_TRUE(contains(later, "lane poisoned by run 0: ")) << later;
    int64_t in = 1, out = 0;
    auto refused = w.submit(*prog, affine_args(&in, &out, 0));
    EXPECT_TRUE(contains(refused.status(), "lane poisoned by run 0: ")) << refused.status();
    EXPECT_EQ(w.resources().quarantined, 1);
    w.set_completion_polling(false);
    EXPECT_TRUE(w.close().ok());
  }
}

// A notification that throws on the poller's thread reaches the poller; the run is retired and
// the head released, so later runs still finish (here by the lane thread).
TEST(PolledCompletion, ANotificationThatThrowsOnThePollerReleasesTheHead) {
  Worker w(testing::test_options(1, 2));
  auto prog = start_polling(w);
  ASSERT_TRUE(prog.ok()) << prog.status();
  int64_t in[2] = {1, 2}, out[2] = {};
  RunHandle first = *w.submit(*prog, affine_args(&in[0], &out[0], 0), {}, kForever,
                              [](const RunResult&) { throw std::runtime_error("notify failed"); });
  RunHandle second = *w.submit(*prog, affine_args(&in[1], &out[1], 0));
  bool thrown = false;
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!thrown && std::chrono::steady_clock::now() < until) {
    try {
      (void)w.poll_completions();
    } catch (const std::runtime_error& e) {
      thrown = true;
      EXPECT_STREQ(e.what(), "notify failed");
    }
    std::this_thread::yield();
  }
  EXPECT_TRUE(thrown);
  EXPECT_TRUE(first.wait(0.0).ok());
  w.set_completion_polling(false);
  EXPECT_TRUE(second.wait(10.0).ok());
  EXPECT_EQ(out[1], 6);
  EXPECT_TRUE(w.close().ok());
}

// Concurrency: two pollers toggling polling and polling, against the lane thread and a
// submitter; every run retires once, in run order, with its own result. Runs go in rounds of
// 100 (at most 40) until both kinds of reaper took part, so a loaded machine that lets one of
// them miss a round cannot make the test fail.
TEST(PolledCompletion, PollersTogglingAgainstTheLaneThreadRetireEveryRunOnceInOrder) {
  Worker w(testing::test_options(2, 4));
  auto prog = w.register_callable(affine_program());
  ASSERT_TRUE(w.init().ok());
  constexpr int kPerRound = 100, kMaxRounds = 40, kMaxRuns = kPerRound * kMaxRounds;
  std::vector<int64_t> in(kMaxRuns), out(kMaxRuns, -1);
  std::mutex mu;
  std::vector<uint64_t> order;
  std::atomic<bool> stop{false};
  // in_call: pollers inside poll_completions whose count is not yet in by_pollers.
  std::atomic<int> by_pollers{0}, polling{0}, in_call{0};
  std::vector<std::thread> pollers;
  for (int p = 0; p < 2; ++p) {
    pollers.emplace_back([&w, &stop, &by_pollers, &polling, &in_call, p] {
      bool first = true;
      while (!stop.load(std::memory_order_acquire)) {
        w.set_completion_polling(true);
        if (first) polling.fetch_add(1, std::memory_order_release);
        first = false;
        const auto until =
            std::chrono::steady_clock::now() + std::chrono::microseconds(200 + 150 * p);
        while (std::chrono::steady_clock::now() < until) {
          in_call.fetch_add(1);
          by_pollers.fetch_add(w.poll_completions());
          in_call.fetch_sub(1);
          std::this_thread::yield();
        }
        w.set_completion_polling(false);
        // Off for 100 µs: the lane thread reaps meanwhile.
        const auto off_until = std::chrono::steady_clock::now() + std::chrono::microseconds(100);
        while (std::chrono::steady_clock::now() < off_until) std::this_thread::yield();
      }
    });
  }
  // Both pollers have turned polling on once before the first run goes in.
  while (polling.load(std::memory_order_acquire) < 2) std::this_thread::yield();
  int submitted = 0;
  for (int round = 0; round < kMaxRounds; ++round) {
    std::vector<RunHandle> hs;
    for (int i = submitted; i < submitted + kPerRound; ++i) {
      in[i] = i;
      auto h = w.submit(*prog, affine_args(&in[i], &out[i], 1), {}, kForever,
                        [&mu, &order](const RunResult& r) {
                          std::lock_guard<std::mutex> l(mu);
                          order.push_back(r.id.value);
                        });
      ASSERT_TRUE(h.ok()) << h.status();
      hs.push_back(*h);
    }
    for (const RunHandle& h : hs) EXPECT_TRUE(h.wait(30.0).ok());
    submitted += kPerRound;
    // Every run of the round is done; a poller that reaped some may not have added its count
    // yet (the runs finish inside its call). Once no call is in flight the count is exact: a
    // call started after the waits above finds nothing left to reap.
    while (in_call.load() != 0) std::this_thread::yield();
    const int polled = by_pollers.load();
    if (polled > 0 && polled < submitted) break;  // both kinds reaped some
  }
  stop.store(true, std::memory_order_release);
  for (std::thread& t : pollers) t.join();
  for (int i = 0; i < submitted; ++i) EXPECT_EQ(out[i], 3 * i + 1) << i;
  EXPECT_TRUE(w.close().ok());
  std::lock_guard<std::mutex> l(mu);
  ASSERT_EQ(order.size(), static_cast<size_t>(submitted));
  for (int i = 0; i < submitted; ++i) EXPECT_EQ(order[i], static_cast<uint64_t>(i));
  EXPECT_GT(by_pollers.load(), 0) << "the pollers never reaped in " << submitted << " runs";
  EXPECT_LT(by_pollers.load(), submitted) << "the lane thread never reaped while polling was off";
}

// A submit that waits for a resource set has the lane thread reap — also a run that another
// submitter's prepare launched while polling was on (the lane thread was asleep on the preparing
// head then).
TEST(PolledCompletion, ASubmitWaitingForASetIsNotStrandedByAnotherSubmittersLaunch) {
  WorkerOptions o = testing::test_options(1, 2);
  o.placement = task::GraphPlacement::kHost;  // orchestration runs in prepare, on the submitter
  Worker w(o);
  // Its orchestration waits for the gate whose address is scalar(0), then submits one task.
  auto slow = w.register_callable(task::ChipCallable{
      "slow_prepare",
      [](task::OrchestrationContext& ctx, const task::TaskArgs& args) {
        reinterpret_cast<const testing::Gate*>(static_cast<uintptr_t>(args.scalar_i64(0)))->wait();
        return ctx.submit(0, task::TaskArgs{});
      },
      {{"noop", [](const task::KernelContext&) { return absl::OkStatus(); }}}});
  auto prog = w.register_callable(affine_program());
  ASSERT_TRUE(w.init().ok());
  w.set_completion_polling(true);
  testing::Gate open;
  absl::StatusOr<RunHandle> first;
  std::thread other([&] { first = w.submit(*slow, testing::address_args(&open)); });
  while (w.lane_stats().in_flight < 1) std::this_thread::yield();  // its run is the head
  int64_t in[2] = {1, 2}, out[2] = {};
  RunHandle second = *w.submit(*prog, affine_args(&in[0], &out[0], 0));  // the second set
  std::thread opener([&] {
    // Once the submit below waits for a set.
    EXPECT_TRUE(testing::eventually([&] { return w.resources().waiting >= 1; }));
    open.open();
  });
  // No set is free until the head run retires; this thread polls nothing while it waits.
  auto third = w.submit(*prog, affine_args(&in[1], &out[1], 0), {}, /*admission_timeout_s=*/10);
  opener.join();
  other.join();
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_TRUE(third.ok()) << third.status();
  EXPECT_TRUE(first->wait(0.0).ok());
  poll_until_done(w, *third);
  EXPECT_TRUE(second.wait(0.0).ok());
  EXPECT_TRUE(third->wait(0.0).ok());
  EXPECT_EQ(out[1], 6);
  w.set_completion_polling(false);
  EXPECT_TRUE(w.close().ok());
}

// close() returns only after a notification running on a poller's thread returned (its run had
// already left the lane's queue).
TEST(PolledCompletion, CloseWaitsForANotificationRunningOnAPoller) {
  Worker w(testing::test_options(1));
  auto prog = w.register_callable(affine_program());
  ASSERT_TRUE(w.init().ok());
  std::atomic<bool> entered{false}, returned{false};
  testing::Gate release;
  int64_t in = 1, out = 0;
  w.set_completion_polling(true);
  RunHandle h = *w.submit(*prog, affine_args(&in, &out, 0), {}, kForever, [&](const RunResult&) {
    entered.store(true);
    release.wait();
    returned.store(true);
  });
  std::thread poller([&] { poll_until_done(w, h); });
  while (!entered.load()) std::this_thread::yield();
  std::promise<void> closed;
  std::future<void> has_closed = closed.get_future();
  std::thread closer([&] {
    EXPECT_TRUE(w.close().ok());
    EXPECT_TRUE(returned.load()) << "close() returned while a notification was running";
    closed.set_value();
  });
  // close() must not return while the notification runs: a bounded wait that must time out.
  EXPECT_EQ(has_closed.wait_for(std::chrono::milliseconds(100)), std::future_status::timeout);
  release.open();
  poller.join();
  closer.join();
  EXPECT_EQ(has_closed.wait_for(std::chrono::seconds(0)), std::future_status::ready);
  w.set_completion_polling(false);  // after close: nothing
}

// A run that never finishes while polling is on meets its operation timeout once polling stops
// (the lane thread applies it).
TEST(PolledCompletion, AHungRunTimesOutOncePollingStops) {
  Worker w(testing::test_options(1, 0, /*timeout_s=*/0.2));
  auto gate = w.register_callable(testing::gate_program());
  ASSERT_TRUE(w.init().ok());
  testing::Gate open;
  w.set_completion_polling(true);
  RunHandle h = *w.submit(*gate, testing::gate_args(open));
  // For 400 ms, twice its timeout, polling retires nothing and the run stays unfinished: nobody
  // applies the timeout while polling is on (a bounded wait that must time out).
  int32_t retired = 0;
  EXPECT_FALSE(testing::eventually(
      [&] {
        retired += w.poll_completions();
        return h.done();
      },
      std::chrono::milliseconds(400)));
  EXPECT_EQ(retired, 0);
  EXPECT_FALSE(h.done());
  w.set_completion_polling(false);
  absl::Status s = h.wait(10.0);
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_TRUE(contains(s, "did not finish within the operation timeout")) << s;
  open.open();  // the abort releases the kernel anyway; the gate lets it return for sure
  (void)w.close();
}

}  // namespace
}  // namespace simpler::worker::testing
