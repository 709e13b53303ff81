// Contracts of the run pipeline that other async runtimes' bug reports broke
// (stranded handles, buffers freed under a running run, exceptions escaping
// threads, state/done disagreement, unbounded close): each test states one.
#include <atomic>
#include <chrono>
#include <stdexcept>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "simpler/base/status.h"
#include "simpler/worker/worker.h"
#include "worker/worker_test_util.h"

namespace simpler::worker::testing {
namespace {

// An affine_program whose orchestration submits its task, then throws.
task::ChipCallable throwing_orchestration(task::GraphPlacement placement) {
  task::ChipCallable c = affine_program();
  c.name = "thrower";
  c.placement = placement;
  auto inner = c.orchestration;
  c.orchestration = [inner](task::OrchestrationContext& ctx,
                            const task::TaskArgs& args) -> absl::Status {
    absl::Status s = inner(ctx, args);
    if (s.ok()) throw std::runtime_error("orchestration exploded");
    return s;
  };
  return c;
}

absl::Status throwing_kernel(const task::KernelContext&) {
  throw std::logic_error("kernel exploded");
}

task::ChipCallable throwing_kernel_program(task::GraphPlacement placement) {
  task::ChipCallable c = affine_program();
  c.name = "boom";
  c.placement = placement;
  c.kernels = {{"boom_kernel", throwing_kernel}};
  return c;
}

class WorkerExceptions : public ::testing::TestWithParam<task::GraphPlacement> {};

// A throwing orchestration is its run's error (INTERNAL, recoverable), delivered
// once; the lane goes on and close() returns. Host-built: submit returns it.
TEST_P(WorkerExceptions, AThrowingOrchestrationFailsOnlyItsRun) {
  const task::GraphPlacement placement = GetParam();
  Worker w(test_options(2));
  auto bad = w.register_callable(throwing_orchestration(placement));
  auto good = w.register_callable(affine_program());
  ASSERT_TRUE(w.init().ok());
  int64_t in = 5, out = 0, out2 = 0;
  absl::Status err;
  absl::StatusOr<RunHandle> r = w.submit(*bad, affine_args(&in, &out, 1));
  if (placement == task::GraphPlacement::kHost) {
    ASSERT_FALSE(r.ok());
    err = r.status();
  } else {
    ASSERT_TRUE(r.ok()) << r.status();
    err = r->wait(5.0);
  }
  EXPECT_EQ(err.code(), absl::StatusCode::kInternal) << err;
  EXPECT_TRUE(contains(err,
                       "run 0 orchestration of 'thrower' threw std::runtime_error: "
                       "orchestration exploded"))
      << err;
  EXPECT_FALSE(base::is_unrecoverable(err)) << err;
  // The lane goes on: a valid run submitted next completes.
  absl::StatusOr<RunHandle> next = w.submit(*good, affine_args(&in, &out2, 1));
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_TRUE(next->wait(5.0).ok());
  EXPECT_EQ(out2, 16);
  EXPECT_TRUE(w.lane_stats().retired >= 1);
  EXPECT_TRUE(counts_consistent(w.resources()));
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_TRUE(w.close().ok());  // the error was delivered (by submit or wait)
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
}

// A throwing kernel fails its task (INTERNAL, recoverable, naming run, task and
// kernel); nothing aborts and the lane goes on.
TEST_P(WorkerExceptions, AThrowingKernelFailsOnlyItsRunNamingTheTask) {
  Worker w(test_options(2));
  auto bad = w.register_callable(throwing_kernel_program(GetParam()));
  auto good = w.register_callable(affine_program());
  ASSERT_TRUE(w.init().ok());
  int64_t in = 5, out = 0, out2 = 0;
  absl::StatusOr<RunHandle> r = w.submit(*bad, affine_args(&in, &out, 1));
  ASSERT_TRUE(r.ok()) << r.status();
  const absl::Status err = r->wait(5.0);
  EXPECT_TRUE(fails_with(err, absl::StatusCode::kInternal,
                         "run 0 task 0 (kernel 'boom_kernel') block 0: kernel threw "
                         "std::logic_error: kernel exploded"));
  EXPECT_FALSE(base::is_unrecoverable(err));
  EXPECT_EQ(r->result().report.tasks_failed, 1u);
  EXPECT_TRUE(w.submit(*good, affine_args(&in, &out2, 1))->wait(5.0).ok());
  EXPECT_EQ(out2, 16);
  EXPECT_TRUE(w.close().ok());
}

// A kernel that reads an argument its task does not have, or one of the other kind, fails its run
// naming the call (it read past the argument array: a crash, or garbage).
TEST(WorkerKernelArgs, AnArgumentPastTheTasksOrOfTheOtherKindFailsTheRun) {
  Worker w(test_options());
  auto past =
      w.register_callable(task::one_kernel_callable("past", [](const task::KernelContext& c) {
        (void)c.tensor(3);
        return absl::OkStatus();
      }));
  auto kind =
      w.register_callable(task::one_kernel_callable("kind", [](const task::KernelContext& c) {
        (void)c.scalar_i64(0);  // argument 0 is a tensor
        return absl::OkStatus();
      }));
  ASSERT_TRUE(w.init().ok());
  int64_t in = 5, out = 0;
  EXPECT_TRUE(fails_with(w.run(*past, affine_args(&in, &out, 1)), absl::StatusCode::kInternal,
                         "KernelContext::tensor(3) in run 0 task 0: the task has 3 arguments"));
  EXPECT_TRUE(fails_with(w.run(*kind, affine_args(&in, &out, 1)), absl::StatusCode::kInternal,
                         "KernelContext::scalar(0) in run 1 task 0: argument 0 is a tensor"));
  EXPECT_TRUE(w.close().ok());
}

INSTANTIATE_TEST_SUITE_P(BothPlacements, WorkerExceptions,
                         ::testing::Values(task::GraphPlacement::kDevice,
                                           task::GraphPlacement::kHost),
                         [](const auto& info) {
                           return info.param == task::GraphPlacement::kHost ? "HostBuilt"
                                                                            : "DeviceBuilt";
                         });

// A program whose one task reads 64 bytes of a device buffer it captured
// (not an argument) and waits on the run's gate: the Qwen3 decode program's
// shape. Callables are registered before init and buffers allocated after it,
// so the callable reads the address once it is known, as the engine does.
task::ChipCallable captured_reader(std::shared_ptr<const std::atomic<uint64_t>> address) {
  return task::ChipCallable{
      "reader",
      [address](task::OrchestrationContext& ctx, const task::TaskArgs& args) {
        task::TaskArgs a;
        a.add_scalar_i64(args.scalar_i64(0));
        a.add_tensor(*task::Tensor::contiguous(address->load(), {8}, task::DataType::kInt64),
                     task::ArgDirection::kIn);
        return ctx.submit(0, a);
      },
      {{"gate", testing::gate_kernel}}};
}

TEST(WorkerBind, ABoundBufferCannotBeFreedWhileARunReadsItNorUnboundUntilTheRunRetires) {
  auto address = std::make_shared<std::atomic<uint64_t>>(0);
  Worker w(test_options(2));
  auto h = w.register_callable(captured_reader(address));
  ASSERT_TRUE(w.init().ok());
  DeviceBuffer weights = *w.malloc(64);
  address->store(weights.address);
  ASSERT_TRUE(w.bind(*h, weights).ok());

  // Bound, no run: free names the binding.
  absl::Status f0 = w.free(weights);
  EXPECT_EQ(f0.code(), absl::StatusCode::kFailedPrecondition) << f0;
  EXPECT_TRUE(contains(f0, "is bound to callable 'reader'")) << f0;

  testing::Gate gate;
  RunHandle r = *w.submit(*h, gate_args(gate));
  // While the run reads the buffer: neither free nor unbind.
  absl::Status f1 = w.free(weights);
  EXPECT_EQ(f1.code(), absl::StatusCode::kFailedPrecondition) << f1;
  absl::Status u1 = w.unbind(*h, weights);
  EXPECT_EQ(u1.code(), absl::StatusCode::kFailedPrecondition) << u1;
  EXPECT_TRUE(contains(u1, "from 'reader': run 0 of it has not retired")) << u1;
  gate.open();
  ASSERT_TRUE(r.wait(5.0).ok());
  // Retired: unbind, then free, succeed.
  EXPECT_TRUE(w.unbind(*h, weights).ok());
  EXPECT_TRUE(w.free(weights).ok());
  EXPECT_TRUE(w.close().ok());
}

TEST(WorkerBind, ASubmitWhoseBoundBufferIsGoneIsRefusedNamingTheBuffer) {
  auto address = std::make_shared<std::atomic<uint64_t>>(0);
  Worker w(test_options());
  auto h = w.register_callable(captured_reader(address));
  ASSERT_TRUE(w.init().ok());
  DeviceBuffer weights = *w.malloc(64);
  address->store(weights.address);
  ASSERT_TRUE(w.bind(*h, weights).ok());
  // Freed behind the Worker's back (raw device access).
  ASSERT_TRUE(w.device().free(weights.address).ok());
  testing::Gate gate(/*open=*/true);
  absl::StatusOr<RunHandle> r = w.submit(*h, gate_args(gate));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
  EXPECT_TRUE(contains(r.status(), "submit of 'reader': its bound device buffer 0x")) << r.status();
  EXPECT_TRUE(contains(r.status(), "(64 bytes) is no longer a live allocation")) << r.status();
  EXPECT_TRUE(counts_consistent(w.resources()));
  EXPECT_TRUE(w.close().ok());
}

TEST(WorkerBind, BindAndUnbindRefuseWhatTheyCannotDo) {
  Worker w(test_options());
  auto h = w.register_callable(gate_program());
  DeviceBuffer never{0x1000, 64};
  EXPECT_EQ(w.bind(*h, never).code(), absl::StatusCode::kFailedPrecondition);  // before init
  ASSERT_TRUE(w.init().ok());
  DeviceBuffer b = *w.malloc(64);
  absl::Status unknown = w.bind(*h, never);
  EXPECT_EQ(unknown.code(), absl::StatusCode::kNotFound) << unknown;
  EXPECT_TRUE(contains(unknown, "not a live buffer of this Worker")) << unknown;
  EXPECT_EQ(w.bind(CallableHandle{7}, b).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(w.bind(*h, DeviceBuffer{b.address, 32}).code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(w.bind(*h, b).ok());
  EXPECT_EQ(w.bind(*h, b).code(), absl::StatusCode::kAlreadyExists);
  EXPECT_TRUE(w.unbind(*h, b).ok());
  absl::Status again = w.unbind(*h, b);
  EXPECT_EQ(again.code(), absl::StatusCode::kNotFound) << again;
  EXPECT_TRUE(contains(again, "is not bound to 'gate'")) << again;
  EXPECT_TRUE(w.free(b).ok());
  EXPECT_TRUE(w.close().ok());
}

// state() and done() are published in one order: no observer sees RETIRED (or
// any state past LAUNCHED) while done() is false.
TEST(RunHandleState, NoObserverSeesATerminalStateWhileDoneIsFalse) {
  Worker w(test_options(2));
  auto h = w.register_callable(testing::count_program(1));
  ASSERT_TRUE(w.init().ok());
  std::atomic<int> counter{0};
  constexpr int kRuns = 3000;
  std::vector<RunHandle> handles(kRuns);
  std::atomic<int> submitted{0};
  std::atomic<bool> stop{false};
  std::atomic<int64_t> violations{0}, terminal_seen{0};
  std::thread observer([&] {
    while (!stop.load()) {
      const int n = submitted.load(std::memory_order_acquire);
      for (int i = std::max(0, n - 8); i < n; ++i) {
        const RunState s = handles[i].state();
        const bool d = handles[i].done();
        if (s >= RunState::kCompleted) {
          ++terminal_seen;
          if (!d) ++violations;
        }
      }
    }
  });
  for (int i = 0; i < kRuns; ++i) {
    handles[i] = *w.submit(*h, testing::count_args(counter));
    submitted.store(i + 1, std::memory_order_release);
  }
  for (auto& r : handles) ASSERT_TRUE(r.wait(10.0).ok());
  stop.store(true);
  observer.join();
  EXPECT_EQ(violations.load(), 0);
  EXPECT_GT(terminal_seen.load(), 0);
  for (auto& r : handles) {
    EXPECT_TRUE(r.done());
    EXPECT_EQ(r.state(), RunState::kRetired);
    EXPECT_EQ(r.result().terminal_state, RunState::kCompleted);
  }
  EXPECT_TRUE(w.close().ok());
}

// tasks_completed counts tasks that completed successfully; the failed task
// is named separately.
TEST(RunReport, TheFailedTaskIsNotCountedAsCompleted) {
  Worker w(faulty_options("run=0:task=1:kind=kernel_error"));
  auto h = w.register_callable(affine_program(3));
  ASSERT_TRUE(w.init().ok());
  int64_t in = 1, out = 0;
  RunHandle r = *w.submit(*h, affine_args(&in, &out, 0));
  EXPECT_EQ(r.wait(5.0).code(), absl::StatusCode::kInternal);
  const chip::RunReport& rep = r.result().report;
  // Task 2 is submitted, or refused when task 1 already failed: the device may run a task at the
  // orchestration's poll after its submit, before the next submit.
  EXPECT_GE(rep.tasks_submitted, 2u);
  EXPECT_LE(rep.tasks_submitted, 3u);
  EXPECT_EQ(rep.tasks_completed, 1u);  // task 0; task 2 waits on task 1 (WAW) and never runs
  EXPECT_EQ(rep.tasks_failed, 1u);
  EXPECT_EQ(rep.first_failed_task, 1);
  (void)w.close();
}

// A real overrun (a kernel still running, not an injected hang) is named in
// the timeout: run, task, kernel, limit; one sentence.
TEST(WorkerTimeout, AnOverrunNamesTheTaskStillExecutingAndItsKernel) {
  Worker w(test_options(1, 0, 0.3));
  auto h = w.register_callable(gate_program());
  ASSERT_TRUE(w.init().ok());
  testing::Gate gate;
  RunHandle r = *w.submit(*h, gate_args(gate));
  absl::Status s = r.wait(5.0);
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_TRUE(contains(s,
                       "run 0 did not finish within the operation timeout of 0.3 s; still "
                       "executing: task 0 (kernel 'gate', block 0 on core "))
      << s;
  EXPECT_TRUE(contains(s, "s); device aborted")) << s;
  gate.open();  // the kernel returns: close joins every device thread
  (void)w.close();
  EXPECT_EQ(w.abandoned_threads(), 0);
}

// close(deadline): a known error is reported at once; runs still in flight at
// the deadline fail CANCELLED naming the first error, and close returns
// promptly although a later run hangs (it would otherwise take the 60 s
// operation timeout).
TEST(WorkerClose, ABoundedCloseCancelsWhatIsInFlightNamingTheFirstError) {
  Worker w(faulty_options("run=2:task=0:kind=kernel_error,run=3:task=0:kind=hang", 4, 0, 60));
  auto h = w.register_callable(affine_program());
  ASSERT_TRUE(w.init().ok());
  int64_t in = 1, out[6] = {};
  std::vector<RunHandle> hs;
  for (int i = 0; i < 6; ++i) hs.push_back(*w.submit(*h, affine_args(&in, &out[i], 0)));
  EXPECT_TRUE(hs[0].wait(5.0).ok());
  EXPECT_TRUE(hs[1].wait(5.0).ok());
  absl::Status e2 = hs[2].wait(5.0);
  EXPECT_EQ(e2.code(), absl::StatusCode::kInternal) << e2;
  const auto t0 = std::chrono::steady_clock::now();
  absl::Status closed = w.close(base::Deadline::after(std::chrono::milliseconds(100)));
  const auto took = std::chrono::steady_clock::now() - t0;
  EXPECT_LT(took, std::chrono::seconds(3));
  // Runs 3..5 were in flight: CANCELLED, naming run 2's error as the first.
  for (int i = 3; i < 6; ++i) {
    ASSERT_TRUE(hs[i].done()) << i;
    const RunResult& res = hs[i].result();
    EXPECT_EQ(res.status.code(), absl::StatusCode::kCancelled) << i << ": " << res.status;
    EXPECT_TRUE(contains(res.status, "first error: run 2: run 2 task 0 (kernel 'affine')"))
        << res.status;
  }
  EXPECT_TRUE(contains(hs[3].result().status,
                       "run 3 cancelled: the lane was closed at its close deadline with the run "
                       "still in flight"))
      << hs[3].result().status;
  // Nobody had waited for runs 3..5 when close returned: it reports the first.
  EXPECT_EQ(closed.code(), absl::StatusCode::kCancelled) << closed;
  EXPECT_TRUE(contains(closed, "run 3 cancelled: ")) << closed;
  EXPECT_TRUE(contains(closed, "(and 2 more undelivered run errors)")) << closed;
  EXPECT_TRUE(counts_consistent(w.resources()));
  // Run 3 is quarantined unless the abort released its hang before the lane
  // looked (then the device proved it done).
  EXPECT_LE(w.resources().quarantined, 1);
  EXPECT_EQ(w.abandoned_threads(), 0);  // the abort released the hang: all joined
}

TEST(WorkerClose, ABoundedCloseWithNothingInFlightIsAnOrdinaryClose) {
  Worker w(test_options(2));
  auto h = w.register_callable(affine_program());
  ASSERT_TRUE(w.init().ok());
  int64_t in = 1, out = 0;
  ASSERT_TRUE(w.submit(*h, affine_args(&in, &out, 0))->wait(5.0).ok());
  EXPECT_TRUE(w.close(base::Deadline::poll()).ok());
  EXPECT_EQ(w.resources().quarantined, 0);
  EXPECT_EQ(w.submit(*h, affine_args(&in, &out, 0)).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace simpler::worker::testing
