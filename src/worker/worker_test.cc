#include "simpler/worker/worker.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <future>
#include <limits>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "simpler/base/process.h"
#include "worker/run_shared.h"
#include "worker/worker_test_util.h"

namespace simpler::worker::testing {
namespace {

// Fires the operation timeout the lane is waiting on: waits until a wait
// bounded by a deadline is in progress on `env` (the lane computed the
// deadline before it began waiting), then moves the clock past it.
void pass_timeout(base::FakeEnv& env, double timeout_s) {
  ASSERT_TRUE(env.await_timed_waiters(1, std::chrono::seconds(10)));
  env.advance(std::chrono::nanoseconds(static_cast<int64_t>((timeout_s + 1) * 1e9)));
}

TEST(WorkerInit, InvalidOptionsAreRefusedNamingTheField) {
  {
    Worker w(test_options(2, 1));
    absl::Status s = w.init();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(contains(s, "run_grant 1 is below launch_depth 2")) << s;
  }
  {
    WorkerOptions o = test_options();
    o.launch_depth = 0;
    EXPECT_TRUE(contains(Worker(o).init(), "launch_depth 0"));
  }
  {
    WorkerOptions o = test_options();  // a thread a core: it aborted on bad_alloc
    o.num_cores = 1 << 30;
    absl::Status s = Worker(o).init();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(contains(s, "num_cores 1073741824 outside [0, 1024]")) << s;
  }
  {
    WorkerOptions o = test_options();
    o.run_grant = kMaxRunGrant + 1;
    EXPECT_TRUE(contains(Worker(o).init(), "run_grant"));
  }
  {
    WorkerOptions o = test_options();  // the default grant: the depth is what is out of range
    o.launch_depth = kMaxRunGrant + 1;
    absl::Status s = Worker(o).init();
    EXPECT_TRUE(contains(s, "launch_depth 1025 above 1024")) << s;
  }
  {
    WorkerOptions o = test_options();  // at the cap the default grant is the cap
    o.launch_depth = kMaxRunGrant;
    EXPECT_EQ(o.effective_grant(), kMaxRunGrant);
    EXPECT_TRUE(o.validate().ok());
  }
  {
    WorkerOptions o = test_options();
    o.operation_timeout_s = std::nan("");
    EXPECT_TRUE(contains(Worker(o).init(), "operation_timeout_s"));
  }
  {
    WorkerOptions o = test_options();
    o.platform = "cuda";
    EXPECT_TRUE(contains(Worker(o).init(), "platform 'cuda'"));
  }
  {
    WorkerOptions o = test_options();
    o.level = 3;
    EXPECT_TRUE(contains(Worker(o).init(), "level 3"));
  }
}

// The queries before init() (and after a failed one) answer zeros: they dereferenced a null chip.
TEST(WorkerInit, QueriesBeforeInitAnswerZeros) {
  WorkerOptions o = test_options();
  o.num_cores = -1;
  Worker w(o);
  for (int attempt = 0; attempt < 2; ++attempt) {
    EXPECT_EQ(w.caps().num_cores, 0);
    EXPECT_EQ(w.resources().grant, 0);
    EXPECT_EQ(w.lane_stats().submitted, 0u);
    EXPECT_EQ(w.capture_stats().graphs, 0);
    EXPECT_FALSE(w.init().ok());  // the second round: after a failed init()
  }
}

TEST(WorkerInit, DefaultGrantIsDepthPlusOne) {
  Worker w(test_options(3));
  ASSERT_TRUE(w.init().ok());
  EXPECT_EQ(w.resources().grant, 4);
  EXPECT_EQ(w.resources().free, 4);
}

TEST(WorkerInit, MalformedSimFaultsEnvironmentIsRefusedAtStartUp) {
  WorkerOptions o = test_options();
  o.faults.reset();  // read the environment
  ::setenv("SIMPLER_SIM_FAULTS", "run=1:task=0:kind=meltdown", 1);
  Worker w(o);
  absl::Status s = w.init();
  ::unsetenv("SIMPLER_SIM_FAULTS");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(contains(s, "SIMPLER_SIM_FAULTS")) << s;
  EXPECT_TRUE(contains(s, "unknown kind 'meltdown'")) << s;
}

TEST(WorkerInit, SimFaultsEnvironmentIsApplied) {
  WorkerOptions o = test_options();
  o.faults.reset();
  ::setenv("SIMPLER_SIM_FAULTS", "run=0:task=0:kind=kernel_error", 1);
  Worker w(o);
  auto h = w.register_callable(affine_program());
  ASSERT_TRUE(w.init().ok());
  ::unsetenv("SIMPLER_SIM_FAULTS");
  int64_t in = 1, out = 0;
  EXPECT_EQ(w.run(*h, affine_args(&in, &out, 0)).code(), absl::StatusCode::kInternal);
}

TEST(WorkerRegistration, OnlyBeforeInitAndUniqueNames) {
  Worker w(test_options());
  ASSERT_TRUE(w.register_callable(affine_program()).ok());
  auto dup = w.register_callable(affine_program());
  EXPECT_TRUE(contains(dup.status(), "already registered"));
  task::ChipCallable broken{"broken", nullptr, {}};
  EXPECT_EQ(w.register_callable(broken).status().code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(w.init().ok());
  EXPECT_EQ(w.register_callable(sleep_program()).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(w.init().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(WorkerMemory, MallocCopyFreeWithBoundsChecks) {
  Worker w(test_options());
  EXPECT_EQ(w.malloc(8).status().code(), absl::StatusCode::kFailedPrecondition);  // before init
  ASSERT_TRUE(w.init().ok());
  DeviceBuffer b = *w.malloc(32);
  std::vector<uint8_t> in(32, 7), out(32, 0);
  ASSERT_TRUE(w.copy_to(b, in.data(), 32).ok());
  ASSERT_TRUE(w.copy_from(out.data(), b, 16, 16).ok());
  EXPECT_EQ(out[0], 7);
  EXPECT_TRUE(contains(w.copy_to(b, in.data(), 32, 1), "exceeds the 32-byte buffer"));
  EXPECT_TRUE(contains(b.tensor({9}, task::DataType::kFloat32).status(), "exceeds"));
  const absl::Status resized = w.free(DeviceBuffer{b.address, 16});  // freed it all
  EXPECT_EQ(resized.code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(contains(resized, "(16 bytes): the buffer there has 32 bytes")) << resized;
  ASSERT_TRUE(w.copy_to(b, in.data(), 32).ok());  // still live
  ASSERT_TRUE(w.free(b).ok());
  EXPECT_EQ(w.free(b).code(), absl::StatusCode::kNotFound);
}

// affine_program's arguments over `n` int64 HOST values each (the kernel reads and writes the
// first; the rest is staged like it).
task::TaskArgs wide_affine_args(std::vector<int64_t>& in, std::vector<int64_t>& out) {
  task::TaskArgs a;
  const auto n = static_cast<int64_t>(in.size());
  a.add_tensor(*task::Tensor::contiguous(reinterpret_cast<uintptr_t>(in.data()), {n},
                                         task::DataType::kInt64, task::MemoryKind::kHost),
               task::ArgDirection::kIn)
      .add_tensor(*task::Tensor::contiguous(reinterpret_cast<uintptr_t>(out.data()), {n},
                                            task::DataType::kInt64, task::MemoryKind::kHost),
                  task::ArgDirection::kOut)
      .add_scalar_i64(1);
  return a;
}

// On a capped heap the staging that idle resource sets cache gives way to an allocation that
// finds no room: a user malloc after the runs retired, and a run after one refused at prepare
// (which left its set's first buffer allocated). Both failed while no run held any memory.
TEST(WorkerMemory, IdleStagingGivesWayWhenTheHeapIsFull) {
  WorkerOptions o = test_options();
  o.device_memory_bytes = 1 << 20;
  Worker w(o);
  auto h = w.register_callable(affine_program());
  ASSERT_TRUE(w.init().ok());
  std::vector<int64_t> in(40000, 5), out(40000, 0);  // 2 x 320 KB staged
  ASSERT_TRUE(w.run(*h, wide_affine_args(in, out)).ok());
  EXPECT_EQ(out[0], 16);
  absl::StatusOr<DeviceBuffer> b = w.malloc(600'000);
  ASSERT_TRUE(b.ok()) << b.status();
  ASSERT_TRUE(w.free(*b).ok());

  std::vector<int64_t> big_in(70000, 5), big_out(70000, 0);  // 2 x 560 KB: cannot fit
  const absl::Status refused = w.run(*h, wide_affine_args(big_in, big_out));
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  for (int i = 0; i < 3; ++i) {  // each set, whichever the lane hands out
    out[0] = 0;
    const absl::Status s = w.run(*h, wide_affine_args(in, out));
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_EQ(out[0], 16);
  }
  EXPECT_TRUE(w.close().ok());  // the refused run's error was delivered by run()
}

// A request near 2^64 bytes is refused, capped heap or not (the page rounding wrapped to a tiny
// mapping and the heap's count wrapped: malloc succeeded and the first copy into it crashed),
// and the heap's accounting is intact after it.
TEST(WorkerMemory, AnAllocationNear2To64BytesIsRefusedAndTheHeapKeepsItsCount) {
  for (uint64_t heap : {uint64_t{0}, uint64_t{1} << 20}) {
    WorkerOptions o = test_options();
    o.device_memory_bytes = heap;
    Worker w(o);
    ASSERT_TRUE(w.init().ok());
    DeviceBuffer small = *w.malloc(100);
    for (uint64_t bytes : {~uint64_t{0} - 64, ~uint64_t{0}, uint64_t{1} << 63}) {
      absl::StatusOr<DeviceBuffer> b = w.malloc(bytes);
      EXPECT_EQ(b.status().code(), absl::StatusCode::kResourceExhausted) << bytes;
      EXPECT_TRUE(contains(b.status(), absl::StrCat("requested ", bytes, " bytes"))) << b.status();
    }
    if (heap != 0) {  // exactly the rest fits, a byte more does not
      EXPECT_EQ(w.malloc(heap - 100 + 1).status().code(), absl::StatusCode::kResourceExhausted);
      absl::StatusOr<DeviceBuffer> rest = w.malloc(heap - 100);
      ASSERT_TRUE(rest.ok()) << rest.status();
      EXPECT_TRUE(w.free(*rest).ok());
    }
    EXPECT_TRUE(w.free(small).ok());
    EXPECT_TRUE(w.close().ok());
  }
}

// Waits at the testing::Gate whose address is scalar(1) (none when 0), then adds 1 to its tensor.
absl::Status touch_after_gate(const task::KernelContext& ctx) {
  if (const int64_t gate = ctx.scalar_i64(1); gate != 0) {
    reinterpret_cast<const testing::Gate*>(static_cast<uintptr_t>(gate))->wait();
  }
  ctx.tensor(0).data<int32_t>()[0] += 1;
  return absl::OkStatus();
}

task::ChipCallable touch_program() {
  return {
      "touch",
      [](task::OrchestrationContext& ctx, const task::TaskArgs& args) {
        task::TaskArgs a;
        a.add_tensor(args.tensor(0), task::ArgDirection::kInOut).add_scalar_i64(args.scalar_i64(1));
        return ctx.submit(0, a);
      },
      {{"touch", touch_after_gate}}};
}

TEST(WorkerMemory, FreeingABufferNamedByALiveRunIsRefusedNamingTheRun) {
  Worker w(test_options());
  auto h = w.register_callable(touch_program());
  ASSERT_TRUE(w.init().ok());
  DeviceBuffer b = *w.malloc(4);
  testing::Gate gate;  // holds run 0 on the device while the free is tried
  task::TaskArgs a;
  a.add_tensor(*b.tensor({1}, task::DataType::kInt32), task::ArgDirection::kInOut)
      .add_scalar_i64(static_cast<int64_t>(reinterpret_cast<uintptr_t>(&gate)));
  RunHandle r = *w.submit(*h, a);
  absl::Status s = w.free(b);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(contains(s, "in use by run 0")) << s;
  gate.open();
  ASSERT_TRUE(r.wait().ok());
  int32_t v = 0;
  ASSERT_TRUE(w.copy_from(&v, b, 4).ok());
  EXPECT_EQ(v, 1);  // the buffer survived the refused free
  EXPECT_TRUE(w.free(b).ok());
}

// A close() racing the first one returns only once that one drained the runs (it returned OK at
// once, with a run still on the device).
TEST(WorkerClose, ASecondConcurrentCloseReturnsOnlyOnceTheRunsAreDrained) {
  Worker w(test_options());
  auto h = w.register_callable(touch_program());
  ASSERT_TRUE(w.init().ok());
  DeviceBuffer b = *w.malloc(4);
  testing::Gate gate;  // holds the run on the device while both closes are called
  task::TaskArgs a;
  a.add_tensor(*b.tensor({1}, task::DataType::kInt32), task::ArgDirection::kInOut)
      .add_scalar_i64(static_cast<int64_t>(reinterpret_cast<uintptr_t>(&gate)));
  RunHandle r = *w.submit(*h, a);
  std::thread first([&] { EXPECT_TRUE(w.close().ok()); });
  while (true) {  // until the first close() began: the Worker then refuses calls
    absl::StatusOr<DeviceBuffer> probe = w.malloc(4);
    if (!probe.ok()) break;
    (void)w.free(*probe);  // refused only when the close began in between (it frees all)
    std::this_thread::yield();
  }
  // A racing close bounded by a deadline returns at it, the first close going on.
  const absl::Status polled = w.close(base::Deadline::poll());
  EXPECT_EQ(polled.code(), absl::StatusCode::kDeadlineExceeded) << polled;
  EXPECT_FALSE(r.done());
  std::atomic<pid_t> second_tid{0};
  std::atomic<bool> second_returned{false};
  bool done_when_second_returned = false;
  std::thread second([&] {
    second_tid.store(static_cast<pid_t>(syscall(SYS_gettid)));
    EXPECT_TRUE(w.close().ok());
    done_when_second_returned = r.done();
    second_returned.store(true);
  });
  // Until the second close() returned or sleeps (waiting for the first): then the run may end.
  while (second_tid.load() == 0) std::this_thread::yield();
  while (!second_returned.load() && base::process_state(second_tid.load()) != 'S') {
    std::this_thread::yield();
  }
  gate.open();
  second.join();
  first.join();
  EXPECT_TRUE(done_when_second_returned) << "the second close() returned with the run in flight";
  EXPECT_TRUE(r.wait().ok());
}

// A submit that checked its tensors, then waited for a resource set while
// the buffer was freed, is refused when its run registers (not executed on
// freed memory); the free itself succeeds, as no registered run named it.
TEST(WorkerMemory, FreeWhileASubmitWaitsForASetRefusesThatSubmit) {
  Worker w(test_options(1, 1));
  auto gate = w.register_callable(gate_program());
  auto h = w.register_callable(touch_program());
  ASSERT_TRUE(w.init().ok());
  testing::Gate open;
  RunHandle holder = *w.submit(*gate, gate_args(open));  // takes the only set
  DeviceBuffer b = *w.malloc(4);
  task::TaskArgs a;
  a.add_tensor(*b.tensor({1}, task::DataType::kInt32), task::ArgDirection::kInOut)
      .add_scalar_i64(0);
  absl::StatusOr<RunHandle> waiting = absl::UnknownError("not submitted");
  std::thread submitter([&] { waiting = w.submit(*h, a); });  // blocks in admission
  // Free only once the submit passed its first check and waits for a set.
  EXPECT_TRUE(testing::eventually([&] { return w.resources().waiting != 0; }));
  EXPECT_EQ(w.resources().waiting, 1);
  EXPECT_TRUE(w.free(b).ok());
  open.open();
  submitter.join();
  EXPECT_EQ(waiting.status().code(), absl::StatusCode::kInvalidArgument) << waiting.status();
  // Refused by the re-check at prepare, after the run registered.
  EXPECT_TRUE(contains(waiting.status(), "prepare: argument 0")) << waiting.status();
  EXPECT_TRUE(contains(waiting.status(), "not inside a live allocation")) << waiting.status();
  EXPECT_TRUE(holder.wait().ok());
  EXPECT_TRUE(w.close().ok());
}

TEST(WorkerSubmit, DeviceTensorOutsideAnyAllocationIsRefusedAtSubmit) {
  Worker w(test_options());
  auto h = w.register_callable(touch_program());
  ASSERT_TRUE(w.init().ok());
  DeviceBuffer b = *w.malloc(4);
  task::TaskArgs a;
  task::Tensor t = *b.tensor({1}, task::DataType::kInt32);
  t.shape[0] = 2;
  a.add_tensor(t, task::ArgDirection::kInOut).add_scalar_i64(0);
  auto r = w.submit(*h, a);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(contains(r.status(), "argument 0")) << r.status();
  EXPECT_EQ(w.lane_stats().submitted, 0u);  // no identity was consumed
  task::CallConfig bad;
  bad.timeout_s = -1;
  EXPECT_EQ(w.submit(*h, a, bad).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(w.submit(CallableHandle{9}, a).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(w.close().ok());
}

TEST(RunHandleWait, TimeoutTable) {
  Worker w(test_options());
  auto h = w.register_callable(gate_program());
  ASSERT_TRUE(w.init().ok());
  testing::Gate gate;  // the run is not finished until the table's unfinished rows are checked
  RunHandle r = *w.submit(*h, gate_args(gate));
  // NaN: refused, run untouched.
  absl::Status nan = r.wait(std::nan(""));
  EXPECT_EQ(nan.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(contains(nan, "NaN"));
  // Negative: polls once.
  absl::Status poll = r.wait(-1.0);
  EXPECT_EQ(poll.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(contains(poll, "run 0 not finished (polled once)")) << poll;
  EXPECT_TRUE(contains(r.wait(-std::numeric_limits<double>::infinity()), "(polled once)"));
  // A short timeout expires and does not deliver.
  EXPECT_EQ(r.wait(0.01).code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_FALSE(r.done());
  gate.open();
  // Beyond the clock's range: forever.
  EXPECT_TRUE(r.wait(1e300).ok());
  EXPECT_TRUE(r.wait(std::numeric_limits<double>::infinity()).ok());
  EXPECT_TRUE(r.wait(-1.0).ok());  // done: a poll now succeeds
  EXPECT_EQ(r.state(), RunState::kRetired);
}

TEST(RunHandleWait, AnEmptyHandleAnswersEveryCallWithoutARun) {
  RunHandle empty;
  EXPECT_FALSE(empty.valid());
  EXPECT_TRUE(empty.done());
  EXPECT_EQ(empty.state(), RunState::kCancelled);
  EXPECT_EQ(empty.id().value, 0u);
  EXPECT_EQ(empty.wait().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(empty.wait(0.1).code(), absl::StatusCode::kFailedPrecondition);
  const RunResult& r = empty.result();
  EXPECT_EQ(r.status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(contains(r.status, "empty RunHandle")) << r.status;
}

TEST(RunHandleWait, TimedOutWaitIsNotADelivery) {
  Worker w(faulty_options("run=0:task=1:kind=kernel_error"));
  // Both tasks wait at the gate; task 1 fails.
  auto h = w.register_callable(testing::scalar_program("gate", testing::gate_kernel, 2));
  ASSERT_TRUE(w.init().ok());
  testing::Gate gate;
  RunHandle r = *w.submit(*h, gate_args(gate));
  EXPECT_EQ(r.wait(0.01).code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(r.wait(-1).code(), absl::StatusCode::kDeadlineExceeded);
  gate.open();
  absl::Status c = w.close();
  EXPECT_TRUE(r.done());
  EXPECT_EQ(c.code(), absl::StatusCode::kInternal);
  EXPECT_TRUE(contains(c, "run 0 task 1 (kernel 'gate')")) << c;
  // wait after close still returns the run's own error.
  EXPECT_EQ(r.wait().code(), absl::StatusCode::kInternal);
}

// A RunProgress for tests: counts its calls, runs `on_poll` in each, and records the windows'
// outcomes.
class TestProgress final : public RunProgress {
 public:
  explicit TestProgress(int64_t window_ns) : window_ns_(window_ns) {}
  void poll() override {
    if (window_ns_ > 0 && !open.load() && polls_need_window) nested = true;
    ++calls;
    last_call_ns = base::now_ns();
    if (std::this_thread::get_id() != owner) other_thread = true;
    if (on_poll) on_poll(calls.load());
  }
  void begin_window() override {
    if (open.exchange(true)) nested = true;
    ++begun;
  }
  void end_window() override {
    if (!open.exchange(false)) nested = true;
    ++ended;
  }
  int64_t poll_window_ns() override { return window_ns_; }
  void polled(bool finished) override { (finished ? finished_windows : missed_windows)++; }

  std::function<void(int)> on_poll;
  std::atomic<int> calls{0}, finished_windows{0}, missed_windows{0};
  // Windows opened and closed, whether one is open now, and whether the calls ever came out of
  // order (a begin inside an open window, an end with none open).
  std::atomic<int> begun{0}, ended{0};
  std::atomic<bool> open{false}, nested{false};
  bool polls_need_window = false;  // every poll must come inside a window
  std::atomic<int64_t> last_call_ns{0};
  std::atomic<bool> other_thread{false};
  const std::thread::id owner = std::this_thread::get_id();

 private:
  const int64_t window_ns_;
};

// A run with a RunProgress (an L3 run: its waiter collects the children's completions itself):
// wait() polls it on its own thread and returns as soon as it finished the run.
TEST(RunHandleProgress, WaitMakesProgressOnItsOwnThreadUntilTheRunIsDone) {
  auto shared = std::make_shared<RunShared>();
  // A window far longer than needed: the run is finished by the poll, never by a sleep.
  auto p = std::make_shared<TestProgress>(10'000'000'000);
  p->polls_need_window = true;
  p->on_poll = [&](int calls) {
    if (calls == 5) {
      shared->result.status = absl::InternalError("finished by progress");
      shared->finalized.signal(shared->result.status);
    }
  };
  shared->progress = p;
  RunHandle h(shared);
  const absl::Status st = h.wait();
  EXPECT_EQ(st.code(), absl::StatusCode::kInternal);
  EXPECT_TRUE(contains(st, "finished by progress")) << st;
  EXPECT_EQ(p->calls.load(), 5);  // not called again once the run was done
  EXPECT_FALSE(p->other_thread.load());
  EXPECT_EQ(p->finished_windows.load(), 1);
  // The polls came inside one window, closed once the run was done.
  EXPECT_EQ(p->begun.load(), 1);
  EXPECT_EQ(p->ended.load(), 1);
  EXPECT_FALSE(p->open.load());
  EXPECT_FALSE(p->nested.load());
  EXPECT_TRUE(shared->delivered.load());
  // Done: neither wait() nor result() polls again.
  EXPECT_EQ(h.wait().code(), absl::StatusCode::kInternal);
  EXPECT_EQ(h.result().status.code(), absl::StatusCode::kInternal);
  EXPECT_EQ(p->calls.load(), 5);
}

TEST(RunHandleProgress, APollPollsOnceAZeroWindowSleepsAtOnceAndResultPollsToo) {
  auto shared = std::make_shared<RunShared>();
  auto p = std::make_shared<TestProgress>(10'000'000'000);
  shared->progress = p;
  RunHandle h(shared);
  EXPECT_EQ(h.wait(-1).code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(p->calls.load(), 1);
  EXPECT_EQ(p->finished_windows.load() + p->missed_windows.load(), 0);  // no window
  EXPECT_EQ(p->begun.load(), 0);
  EXPECT_FALSE(shared->delivered.load());
  // A timed wait shorter than the window polls until its deadline: not a full window.
  EXPECT_EQ(h.wait(0.05).code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_GT(p->calls.load(), 1);
  EXPECT_EQ(p->missed_windows.load(), 0);
  EXPECT_EQ(p->begun.load(), 1);  // a window nonetheless, closed at the deadline
  EXPECT_EQ(p->ended.load(), 1);
  // result(): polls, and returns once progress finished the run.
  const int before = p->calls.load();
  p->on_poll = [&](int calls) {
    if (calls == before + 30) shared->finalized.signal();
  };
  EXPECT_TRUE(h.result().status.ok());
  EXPECT_EQ(p->calls.load(), before + 30);
  EXPECT_EQ(p->begun.load(), 2);
  EXPECT_EQ(p->ended.load(), 2);
  EXPECT_FALSE(p->nested.load());
  // A progress whose window is 0 (its runs outlast polling): one look, then sleep.
  auto shared2 = std::make_shared<RunShared>();
  auto p2 = std::make_shared<TestProgress>(0);
  shared2->progress = p2;
  std::thread finisher([&] {
    // Once the waiter took its one look (it then sleeps, or finds the run finished).
    EXPECT_TRUE(testing::eventually([&] { return p2->calls.load() >= 1; }));
    shared2->finalized.signal();
  });
  EXPECT_TRUE(RunHandle(shared2).wait().ok());
  EXPECT_EQ(p2->calls.load(), 1);
  EXPECT_EQ(p2->begun.load(), 0);  // no window opened
  finisher.join();
}

// The poll is bounded (ARCHITECTURE.md invariant 9): after its window the waiter sleeps until
// another thread finishes the run, and the missed window is reported.
TEST(RunHandleProgress, ThePollIsBoundedThenTheWaiterSleeps) {
  auto shared = std::make_shared<RunShared>();
  auto p = std::make_shared<TestProgress>(50'000);
  shared->progress = p;
  RunHandle h(shared);
  constexpr int64_t kFinishAfterNs = 300'000'000;
  std::thread finisher([&] {
    // A real-time span is what is under test: the waiter must be asleep, not polling, for the
    // last 100 ms of it (checked below through the time of its last look).
    std::this_thread::sleep_for(std::chrono::nanoseconds(kFinishAfterNs));
    shared->finalized.signal();
  });
  const int64_t t0 = base::now_ns();
  EXPECT_TRUE(h.wait().ok());
  EXPECT_GE(base::now_ns() - t0, kFinishAfterNs / 2);
  EXPECT_GE(p->calls.load(), 1);
  EXPECT_EQ(p->missed_windows.load(), 1);
  EXPECT_EQ(p->finished_windows.load(), 0);
  // The window was closed before the waiter slept (whatever it kept asleep is awake again).
  EXPECT_EQ(p->begun.load(), 1);
  EXPECT_EQ(p->ended.load(), 1);
  EXPECT_FALSE(p->nested.load());
  // Asleep long before the finisher: no look in the last 100 ms before it (a scheduler delay of
  // the waiter's poll, however long, still ends far earlier).
  EXPECT_LT(p->last_call_ns.load() - t0, kFinishAfterNs - 100'000'000);
  finisher.join();
}

// on_finalized: once per run, in run order, with the run's own final result (what an L3 child's
// mailbox relies on to write terminal states in order).
TEST(WorkerNotify, OnFinalizedComesOncePerRunInRunOrderWithItsResult) {
  Worker w(faulty_options("run=2:task=0:kind=kernel_error", 2));
  auto h = w.register_callable(affine_program(2));
  ASSERT_TRUE(w.init().ok());
  struct Seen {
    std::mutex mu;
    std::vector<std::pair<uint64_t, absl::StatusCode>> order;
  } seen;
  constexpr int kRuns = 12;
  int64_t in[kRuns], out[kRuns] = {};
  std::vector<RunHandle> hs;
  for (int i = 0; i < kRuns; ++i) {
    in[i] = i;
    hs.push_back(*w.submit(*h, affine_args(&in[i], &out[i], 1), {},
                           std::numeric_limits<double>::infinity(), [&seen](const RunResult& r) {
                             // The result is final: terminal state and status written.
                             EXPECT_TRUE(r.terminal_state == RunState::kCompleted ||
                                         r.terminal_state == RunState::kFailed);
                             std::lock_guard<std::mutex> l(seen.mu);
                             seen.order.emplace_back(r.id.value, r.status.code());
                           }));
  }
  for (int i = 0; i < kRuns; ++i) (void)hs[i].wait();
  EXPECT_TRUE(w.close().ok());  // run 2's error was delivered by its wait()
  std::lock_guard<std::mutex> l(seen.mu);
  ASSERT_EQ(seen.order.size(), static_cast<size_t>(kRuns));
  for (int i = 0; i < kRuns; ++i) {
    EXPECT_EQ(seen.order[i].first, static_cast<uint64_t>(i));
    EXPECT_EQ(seen.order[i].second, i == 2 ? absl::StatusCode::kInternal : absl::StatusCode::kOk)
        << i;
  }
}

// An on_finalized that throws on the lane thread (it ended the process): caught, the runs go on,
// and close() returns it as INTERNAL, counting the others.
TEST(WorkerNotify, AThrowingOnFinalizedIsKeptForCloseAndTheRunsGoOn) {
  Worker w(test_options());
  auto h = w.register_callable(affine_program());
  ASSERT_TRUE(w.init().ok());
  int64_t in = 5, out = 0;
  const auto boom = [](const RunResult&) { throw std::runtime_error("callback boom"); };
  for (int i = 0; i < 2; ++i) {
    RunHandle r = *w.submit(*h, affine_args(&in, &out, 1), {}, 10.0, boom);
    EXPECT_TRUE(r.wait().ok());
  }
  out = 0;
  ASSERT_TRUE(w.run(*h, affine_args(&in, &out, 1)).ok());
  EXPECT_EQ(out, 16);
  const absl::Status s = w.close();
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
  EXPECT_TRUE(contains(s, "run 0 on_finalized threw")) << s;
  EXPECT_TRUE(contains(s, "callback boom")) << s;
  EXPECT_TRUE(contains(s, "(and 1 more on_finalized calls threw)")) << s;
}

TEST(WorkerFaults, KernelErrorFailsOnlyItsRunAndCountersReturnToBaseline) {
  Worker w(faulty_options("run=1:task=0:kind=kernel_error:code=7", 2));
  auto h = w.register_callable(affine_program(3));
  ASSERT_TRUE(w.init().ok());
  int64_t in[4] = {1, 2, 3, 4}, out[4] = {};
  std::vector<RunHandle> hs;
  for (int i = 0; i < 4; ++i) hs.push_back(*w.submit(*h, affine_args(&in[i], &out[i], 10)));
  EXPECT_TRUE(hs[0].wait().ok());
  absl::Status s = hs[1].wait();
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
  EXPECT_TRUE(contains(s, "run 1 task 0 (kernel 'affine')")) << s;
  EXPECT_TRUE(contains(s, "code 7")) << s;
  EXPECT_EQ(hs[1].result().terminal_state, RunState::kFailed);
  EXPECT_TRUE(hs[2].wait().ok());
  EXPECT_TRUE(hs[3].wait().ok());
  EXPECT_EQ(out[0], 13);
  EXPECT_EQ(out[2], 19);
  EXPECT_EQ(out[3], 22);
  EXPECT_TRUE(w.lane_stats().in_flight == 0);
  ArenaCounts c = w.resources();
  EXPECT_EQ(c.free, c.grant);
  EXPECT_TRUE(w.lane_stats().launched == 0);
  // Still healthy.
  EXPECT_TRUE(w.run(*h, affine_args(&in[0], &out[0], 0)).ok());
  EXPECT_TRUE(w.close().ok());  // the error was delivered
}

class WorkerFaultsPlacement : public ::testing::TestWithParam<task::GraphPlacement> {};

// Run 0 holds the device (gated) while runs 1-3 are launched behind it at
// depth 4; run 1's second task raises a device fault once the gate opens.
TEST_P(WorkerFaultsPlacement, DeviceFaultPoisonsTheLane) {
  WorkerOptions o = faulty_options("run=1:task=1:kind=device_fault:code=507018", 4, 5);
  o.placement = GetParam();
  Worker w(o);
  auto gate = w.register_callable(gate_program());
  auto h = w.register_callable(testing::count_program(3));
  ASSERT_TRUE(w.init().ok());
  testing::Gate open;
  RunHandle first = *w.submit(*gate, gate_args(open));
  std::atomic<int> executed[4] = {0, 0, 0, 0};  // kernel executions per run
  std::vector<RunHandle> hs;
  for (int i = 1; i < 4; ++i) {
    auto r = w.submit(*h, testing::count_args(executed[i]));
    ASSERT_TRUE(r.ok()) << r.status();
    hs.push_back(*r);
  }
  EXPECT_EQ(w.lane_stats().launched, 4);  // all four sit on the device stream
  open.open();
  EXPECT_TRUE(first.wait().ok());
  absl::Status s = hs[0].wait();
  EXPECT_TRUE(base::is_unrecoverable(s));
  EXPECT_TRUE(contains(s, "run 1 task 1 (kernel 'count')")) << s;
  EXPECT_TRUE(contains(s, "507018")) << s;
  // The counters do see executions: run 1's task 0 ran (task 1 faulted
  // before its kernel; task 2 may have started before the fault was seen).
  EXPECT_GE(executed[1].load(), 1);
  for (size_t i = 1; i < hs.size(); ++i) {
    absl::Status later = hs[i].wait();
    EXPECT_TRUE(base::is_unrecoverable(later)) << later;
    EXPECT_TRUE(contains(later, "lane poisoned by run 1: ")) << later;
    // The faulted device executes nothing queued behind the fault.
    EXPECT_EQ(executed[i + 1].load(), 0) << "run " << i + 1 << " executed behind the fault";
  }
  auto refused = w.submit(*h, testing::count_args(executed[0]));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(contains(refused.status(), "lane poisoned by run 1: ")) << refused.status();
  ArenaCounts c = w.resources();
  EXPECT_TRUE(counts_consistent(c));
  EXPECT_EQ(c.quarantined, 1);
  const auto close_start = std::chrono::steady_clock::now();
  EXPECT_TRUE(w.close().ok());  // every error above was delivered
  EXPECT_LT(std::chrono::steady_clock::now() - close_start, std::chrono::seconds(5));
  c = w.resources();
  EXPECT_EQ(c.live, 0);
  EXPECT_EQ(c.quarantined, 1);
  EXPECT_EQ(executed[0].load(), 0);
}

INSTANTIATE_TEST_SUITE_P(BothPlacements, WorkerFaultsPlacement,
                         ::testing::Values(task::GraphPlacement::kDevice,
                                           task::GraphPlacement::kHost));

// A kernel error fails its run only, in either placement.
TEST_P(WorkerFaultsPlacement, KernelErrorFailsOnlyItsRun) {
  WorkerOptions o = faulty_options("run=1:task=0:kind=kernel_error:code=3", 2);
  o.placement = GetParam();
  Worker w(o);
  auto h = w.register_callable(affine_program(2));
  ASSERT_TRUE(w.init().ok());
  int64_t in[3] = {1, 2, 3}, out[3] = {};
  std::vector<RunHandle> hs;
  for (int i = 0; i < 3; ++i) hs.push_back(*w.submit(*h, affine_args(&in[i], &out[i], 1)));
  EXPECT_TRUE(hs[0].wait().ok());
  absl::Status s = hs[1].wait();
  EXPECT_FALSE(base::is_unrecoverable(s));
  EXPECT_TRUE(contains(s, "injected kernel_error, code 3")) << s;
  EXPECT_TRUE(hs[2].wait().ok());
  EXPECT_EQ(out[0], 4);
  EXPECT_EQ(out[2], 10);
  EXPECT_EQ(w.resources().quarantined, 0);
  EXPECT_TRUE(w.close().ok());
}

// The stream refuses run 1's launch while run 0 still executes: run 1 fails
// with the launch error (returned by the submit that launched it), later
// submits are refused with the poison, and run 0 — launched before — still
// finishes with its own result.
TEST(WorkerFaults, RefusedLaunchPoisonsOnlyRunsBehindIt) {
  Worker w(faulty_options("run=1:task=0:kind=launch_refused", 4, 5));
  auto gate = w.register_callable(gate_program());
  auto h = w.register_callable(testing::count_program(1));
  ASSERT_TRUE(w.init().ok());
  testing::Gate open;
  RunHandle first = *w.submit(*gate, gate_args(open));
  std::atomic<int> executed{0};
  auto refused = w.submit(*h, testing::count_args(executed));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnavailable) << refused.status();
  EXPECT_TRUE(contains(refused.status(), "run 1 launch: stream refused the launch of run 1"))
      << refused.status();
  auto behind = w.submit(*h, testing::count_args(executed));
  EXPECT_EQ(behind.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(contains(behind.status(), "lane poisoned by run 1: ")) << behind.status();
  open.open();
  EXPECT_TRUE(first.wait().ok()) << first.wait();
  EXPECT_EQ(first.result().terminal_state, RunState::kCompleted);
  EXPECT_TRUE(w.close().ok());    // both errors were delivered by submit
  EXPECT_EQ(executed.load(), 0);  // run 1 never reached the device
  EXPECT_EQ(w.resources().live, 0);
  EXPECT_EQ(w.resources().quarantined, 0);  // nothing of run 1 reached the device
}

// Run 0 hangs until its timeout while run 2's launch is refused with run 1
// launched between them: the earlier, unrecoverable run 0 names the poison,
// so run 1 fails with "lane poisoned by run 0" without a full timeout wait,
// and only run 0's set is quarantined.
TEST(WorkerFaults, TimeoutBeforeARefusedLaunchNamesThePoison) {
  base::FakeEnv env;
  const WorkerOptions o = on_fake_clock(
      env, faulty_options("run=0:task=0:kind=hang,run=2:task=0:kind=launch_refused", 3, 4));
  Worker w(o);
  auto h = w.register_callable(testing::count_program(1));
  ASSERT_TRUE(w.init().ok());
  std::atomic<int> executed[3] = {0, 0, 0};
  RunHandle r0 = *w.submit(*h, testing::count_args(executed[0]));
  RunHandle r1 = *w.submit(*h, testing::count_args(executed[1]));
  auto r2 = w.submit(*h, testing::count_args(executed[2]));
  EXPECT_EQ(r2.status().code(), absl::StatusCode::kUnavailable) << r2.status();
  pass_timeout(env, o.operation_timeout_s);
  absl::Status s0 = r0.wait();
  EXPECT_EQ(s0.code(), absl::StatusCode::kDeadlineExceeded) << s0;
  const auto t1 = std::chrono::steady_clock::now();
  absl::Status s1 = r1.wait();
  EXPECT_TRUE(contains(s1, "lane poisoned by run 0: ")) << s1;
  EXPECT_LT(std::chrono::steady_clock::now() - t1, std::chrono::seconds(3));
  auto later = w.submit(*h, testing::count_args(executed[2]));
  EXPECT_TRUE(contains(later.status(), "lane poisoned by run 0: ")) << later.status();
  EXPECT_EQ(w.resources().quarantined, 1);
  (void)w.close();
  EXPECT_EQ(executed[1].load() + executed[2].load(), 0);
}

TEST(WorkerFaults, HangTimesOutQuarantinesAndCloseStillReturns) {
  base::FakeEnv env;
  const WorkerOptions o = on_fake_clock(env, faulty_options("run=1:task=0:kind=hang", 2, 0, 30));
  Worker w(o);
  auto h = w.register_callable(affine_program());
  ASSERT_TRUE(w.init().ok());
  int64_t in[3] = {1, 2, 3}, out[3] = {};
  RunHandle r0 = *w.submit(*h, affine_args(&in[0], &out[0], 0));
  RunHandle r1 = *w.submit(*h, affine_args(&in[1], &out[1], 0));
  auto r2 = w.submit(*h, affine_args(&in[2], &out[2], 0));
  EXPECT_TRUE(r0.wait().ok());
  pass_timeout(env, o.operation_timeout_s);  // the lane now waits on run 1 alone
  absl::Status s = r1.wait();
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded);
  // One sentence: the run, the task still executing and its kernel, the limit.
  EXPECT_TRUE(contains(s,
                       "run 1 did not finish within the operation timeout of 30 s; still "
                       "executing: task 0 (kernel 'affine', block 0 on core "))
      << s;
  EXPECT_TRUE(contains(s, "; device aborted")) << s;
  EXPECT_FALSE(contains(s, "device reports")) << s;
  EXPECT_EQ(std::string(s.message()).find("operation timeout"),
            std::string(s.message()).rfind("operation timeout"))
      << "the message repeats itself: " << s;
  EXPECT_TRUE(base::is_unrecoverable(s));
  if (r2.ok()) {
    absl::Status s2 = r2->wait();
    EXPECT_TRUE(contains(s2,
                         "lane poisoned by run 1: run 1 did not finish within the operation "
                         "timeout of 30 s; still executing: task 0 (kernel 'affine'"))
        << s2;
  }
  EXPECT_EQ(w.resources().quarantined, 1);
  EXPECT_TRUE(counts_consistent(w.resources()));
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_TRUE(w.close().ok());
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
}

TEST(WorkerClose, ReturnsTheFirstUndeliveredErrorCountingTheOthers) {
  Worker w(faulty_options(
      "run=1:task=0:kind=kernel_error,run=2:task=0:kind=kernel_error,run=4:task=0:kind=kernel_"
      "error",
      1, 4));
  auto h = w.register_callable(affine_program());
  ASSERT_TRUE(w.init().ok());
  int64_t in = 1, out[6] = {};
  std::vector<RunHandle> hs;
  for (int i = 0; i < 6; ++i) hs.push_back(*w.submit(*h, affine_args(&in, &out[i], 0)));
  EXPECT_FALSE(hs[2].wait().ok());  // delivered: not reported again
  hs.clear();                       // dropped unwaited
  absl::Status c = w.close();
  EXPECT_EQ(c.code(), absl::StatusCode::kInternal);
  EXPECT_TRUE(contains(c, "run 1 task 0")) << c;
  EXPECT_TRUE(contains(c, "(and 1 more undelivered run error)")) << c;
  EXPECT_TRUE(w.close().ok());  // idempotent
  EXPECT_EQ(w.submit(*h, affine_args(&in, &out[0], 0)).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST(WorkerRun, RunIsSubmitThenWait) {
  Worker w(test_options());
  auto h = w.register_callable(affine_program());
  ASSERT_TRUE(w.init().ok());
  int64_t in = 5, out = 0;
  ASSERT_TRUE(w.run(*h, affine_args(&in, &out, 1)).ok());
  EXPECT_EQ(out, 16);
  EXPECT_EQ(w.lane_stats().submitted, 1u);
}

// Task 0 adds 1 to tensor 0 (INOUT); task 1 copies tensor 1 (IN) into tensor 2 (OUT).
task::ChipCallable increment_then_copy_program() {
  return {"increment_then_copy",
          [](task::OrchestrationContext& ctx, const task::TaskArgs& args) -> absl::Status {
            task::TaskArgs inc;
            inc.add_tensor(args.tensor(0), task::ArgDirection::kInOut);
            SIMPLER_RETURN_IF_ERROR(ctx.submit(0, inc));
            task::TaskArgs copy;
            copy.add_tensor(args.tensor(1), task::ArgDirection::kIn)
                .add_tensor(args.tensor(2), task::ArgDirection::kOut);
            return ctx.submit(1, copy);
          },
          {{"increment",
            [](const task::KernelContext& c) {
              c.tensor(0).data<int64_t>()[0] += 1;
              return absl::OkStatus();
            }},
           {"copy", [](const task::KernelContext& c) {
              c.tensor(1).data<int64_t>()[0] = c.tensor(0).data<int64_t>()[0];
              return absl::OkStatus();
            }}}};
}

task::Tensor host_i64(int64_t* p) {
  return *task::Tensor::contiguous(reinterpret_cast<uintptr_t>(p), {1}, task::DataType::kInt64,
                                   task::MemoryKind::kHost);
}

// HOST tensors that view the same memory are ordered as DEVICE ones are (by their overlap): the
// copy reads the cell after the increment, on both graph placements and through a captured
// graph's replays; a replay whose HOST tensors overlap otherwise than at capture is refused.
// (Each HOST tensor once had a staging buffer of its own: the copy read the old value.)
TEST(WorkerSubmit, OverlappingHostTensorsAreOrderedAsDeviceOnesAre) {
  for (task::GraphPlacement placement :
       {task::GraphPlacement::kDevice, task::GraphPlacement::kHost}) {
    WorkerOptions o = test_options();
    o.placement = placement;
    Worker w(o);
    auto h = w.register_callable(increment_then_copy_program());
    ASSERT_TRUE(w.init().ok());
    int64_t x = 10, out = -1;
    task::TaskArgs args;
    args.add_tensor(host_i64(&x), task::ArgDirection::kInOut)
        .add_tensor(host_i64(&x), task::ArgDirection::kIn)
        .add_tensor(host_i64(&out), task::ArgDirection::kOut);
    ASSERT_TRUE(w.run(*h, args).ok());
    EXPECT_EQ(x, 11);
    EXPECT_EQ(out, 11) << "the copy did not wait for the increment";

    task::CallConfig captured;
    captured.capture_key = 7;
    for (int64_t expect : {12, 13}) {  // the capture, then a replay
      ASSERT_TRUE(w.run(*h, args, captured).ok());
      EXPECT_EQ(x, expect);
      EXPECT_EQ(out, expect);
    }
    int64_t y = 20;
    task::TaskArgs apart;
    apart.add_tensor(host_i64(&x), task::ArgDirection::kInOut)
        .add_tensor(host_i64(&y), task::ArgDirection::kIn)
        .add_tensor(host_i64(&out), task::ArgDirection::kOut);
    const absl::Status s = w.run(*h, apart, captured);
    EXPECT_FALSE(s.ok());
    EXPECT_TRUE(contains(s, "overlap")) << s;
    EXPECT_TRUE(w.close().ok());
  }
}

// A strided HOST output (every other cell of an array) is staged with the host's bytes in its
// gaps, so the copy-back, which spans them, leaves the cells between its elements as they were
// (they came back as the staging buffer's zeros).
TEST(WorkerSubmit, AStridedHostOutputLeavesTheCellsBetweenItsElementsAlone) {
  Worker w(test_options());
  auto h = w.register_callable(task::one_kernel_callable("fill", [](const task::KernelContext& c) {
    const task::Tensor& t = c.tensor(0);
    for (int64_t i = 0; i < t.shape[0]; ++i) t.data<int64_t>()[i * t.strides[0]] = 100;
    return absl::OkStatus();
  }));
  ASSERT_TRUE(w.init().ok());
  std::vector<int64_t> cells = {1, 2, 3, 4, 5, 6, 7, 8};
  task::Tensor every_other = host_i64(cells.data());
  every_other.shape[0] = 4;
  every_other.strides[0] = 2;
  task::TaskArgs args;
  args.add_tensor(every_other, task::ArgDirection::kOut);
  ASSERT_TRUE(w.run(*h, args).ok());
  EXPECT_EQ(cells, (std::vector<int64_t>{100, 2, 100, 4, 100, 6, 100, 8}));
  EXPECT_TRUE(w.close().ok());
}

// Waits at the testing::Gate whose address is scalar(1) (none when 0), then writes 7.
absl::Status gated_write(const task::KernelContext& ctx) {
  if (const int64_t gate = ctx.scalar_i64(1); gate != 0) {
    reinterpret_cast<const testing::Gate*>(static_cast<uintptr_t>(gate))->wait();
  }
  ctx.tensor(0).data<int32_t>()[0] = 7;
  return absl::OkStatus();
}

// One gated_write task at `gate` (none when null).
task::ChipCallable gated_write_program(const testing::Gate* gate) {
  const auto address = static_cast<int64_t>(reinterpret_cast<uintptr_t>(gate));
  return {"slow_write",
          [address](task::OrchestrationContext& ctx, const task::TaskArgs& args) {
            task::TaskArgs a;
            a.add_tensor(args.tensor(0), task::ArgDirection::kOut).add_scalar_i64(address);
            return ctx.submit(0, a);
          },
          {{"slow_write", gated_write}}};
}

TEST(WorkerFaults, BuffersOfATimedOutRunStayInUseUntilClose) {
  base::FakeEnv env;
  const WorkerOptions o = on_fake_clock(env, test_options(1));
  Worker w(o);
  testing::Gate gate;  // the kernel runs on until the test opens it
  auto h = w.register_callable(gated_write_program(&gate));
  ASSERT_TRUE(w.init().ok());
  DeviceBuffer b = *w.malloc(4);
  task::TaskArgs a;
  a.add_tensor(*b.tensor({1}, task::DataType::kInt32), task::ArgDirection::kOut);
  RunHandle r = *w.submit(*h, a);
  pass_timeout(env, o.operation_timeout_s);  // while the kernel waits at its gate
  absl::Status s = r.wait();
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  // The kernel is still running: freeing its buffer must be refused.
  absl::Status f = w.free(b);
  EXPECT_EQ(f.code(), absl::StatusCode::kFailedPrecondition) << f;
  EXPECT_TRUE(contains(f, "named by run 0, which is quarantined")) << f;
  EXPECT_EQ(w.resources().quarantined, 1);
  gate.open();
  EXPECT_TRUE(w.close().ok());  // joins the device; the kernel finished into live memory
}

TEST(WorkerFaults, PerRunTimeoutFromCallConfigIsHonoured) {
  base::FakeEnv env;
  WorkerOptions o = on_fake_clock(env, test_options(1));
  o.operation_timeout_s = 3600;
  testing::Gate gate;  // outlives the worker: its kernel waits here until the end of the test
  Worker w(o);
  auto h = w.register_callable(gate_program());
  ASSERT_TRUE(w.init().ok());
  task::CallConfig c;
  c.timeout_s = 30;
  RunHandle r = *w.submit(*h, gate_args(gate), c);
  pass_timeout(env, c.timeout_s);  // past the run's 30 s, far short of the lane's hour
  absl::Status s = r.wait();
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(contains(s, "operation timeout of 30 s")) << s;
  gate.open();
}

TEST(WorkerFaults, RunsBehindAHangFailWithThePoisonCauseQuickly) {
  base::FakeEnv env;
  const WorkerOptions o = on_fake_clock(env, faulty_options("run=0:task=0:kind=hang", 4, 4));
  Worker w(o);
  auto h = w.register_callable(affine_program());
  ASSERT_TRUE(w.init().ok());
  int64_t in[4] = {1, 2, 3, 4}, out[4] = {};
  std::vector<RunHandle> hs;
  for (int i = 0; i < 4; ++i) hs.push_back(*w.submit(*h, affine_args(&in[i], &out[i], 0)));
  pass_timeout(env, o.operation_timeout_s);
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(hs[0].wait().code(), absl::StatusCode::kDeadlineExceeded);
  for (int i = 1; i < 4; ++i) {
    absl::Status s = hs[i].wait();
    EXPECT_TRUE(contains(s, "lane poisoned by run 0")) << "run " << i << ": " << s;
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(3));
  EXPECT_TRUE(w.close().ok());
}

TEST(WorkerFaults, PoisonWhileARunIsPreparingIsReturnedBySubmit) {
  Worker w(faulty_options("run=0:task=0:kind=device_fault"));
  // Run 0: device-built, its only task faults after the kernel starts.
  auto fault = w.register_callable(gated_write_program(nullptr));
  // Run 1: host-built; its orchestration (prepare) goes on only once run 0 has failed.
  RunHandle r0;
  auto slow_prepare = w.register_callable(
      task::ChipCallable{"slow_prepare",
                         [&r0](task::OrchestrationContext& ctx, const task::TaskArgs& args) {
                           EXPECT_TRUE(testing::eventually([&] { return r0.done(); }));
                           task::TaskArgs a;
                           a.add_tensor(args.tensor(0), task::ArgDirection::kOut).add_scalar_i64(0);
                           return ctx.submit(0, a);
                         },
                         {{"slow_write", gated_write}},
                         task::GraphPlacement::kHost});
  ASSERT_TRUE(w.init().ok());
  DeviceBuffer b = *w.malloc(4);
  task::TaskArgs a;
  a.add_tensor(*b.tensor({1}, task::DataType::kInt32), task::ArgDirection::kOut);
  r0 = *w.submit(*fault, a);
  auto r1 = w.submit(*slow_prepare, a);  // poisoned by run 0 while preparing
  ASSERT_FALSE(r1.ok());
  EXPECT_TRUE(contains(r1.status(), "lane poisoned by run 0")) << r1.status();
  EXPECT_TRUE(base::is_unrecoverable(r0.wait()));
  EXPECT_TRUE(counts_consistent(w.resources()));
  EXPECT_TRUE(w.close().ok());
}

}  // namespace
}  // namespace simpler::worker::testing

namespace simpler::worker::testing {
namespace {

// close(deadline) on the injected clock: a run that hangs is left alone for as long as the
// clock says the deadline is ahead (an hour here, none of it waited for), and cancelled the
// moment the test moves the clock past it.
TEST(WorkerClose, ACloseDeadlineIsMeasuredOnTheInjectedClock) {
  base::FakeEnv env;
  Worker w(on_fake_clock(env, faulty_options("run=1:task=0:kind=hang", 2, 0, 7200)));
  auto h = w.register_callable(affine_program());
  ASSERT_TRUE(w.init().ok());
  int64_t in = 1, out[2] = {};
  RunHandle r0 = *w.submit(*h, affine_args(&in, &out[0], 0));
  RunHandle r1 = *w.submit(*h, affine_args(&in, &out[1], 0));
  ASSERT_TRUE(r0.wait().ok());
  std::promise<void> returned;
  std::future<void> has_returned = returned.get_future();
  absl::Status closed;
  std::thread closer([&] {
    closed = w.close(env.after(std::chrono::hours(1)));
    returned.set_value();
  });
  // The lane's reap and close() both wait on the fake clock now.
  ASSERT_TRUE(env.await_timed_waiters(2, std::chrono::seconds(10)));
  // Something that must not happen: close returning while its deadline is ahead. 50 ms of real
  // time in which it could have returned (a bounded wait that must time out).
  EXPECT_EQ(has_returned.wait_for(std::chrono::milliseconds(50)), std::future_status::timeout)
      << "close returned before its deadline on the injected clock";
  EXPECT_FALSE(r1.done());
  env.advance(std::chrono::hours(1) + std::chrono::seconds(1));
  closer.join();
  EXPECT_EQ(closed.code(), absl::StatusCode::kCancelled) << closed;
  EXPECT_TRUE(contains(closed, "run 1 cancelled: the lane was closed at its close deadline"))
      << closed;
  EXPECT_EQ(r1.result().status.code(), absl::StatusCode::kCancelled);
}

}  // namespace
}  // namespace simpler::worker::testing
