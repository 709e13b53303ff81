// The L3 worker: a tensor-parallel MLP across two sim chips with a host sub-task summing the
// partial results, checked against a reference; the L2 run semantics at L3; thread and process
// modes with identical results.
#include "simpler/hierarchy/l3_worker.h"

#include <signal.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <functional>
#include <random>
#include <string>
#include <thread>

#include "gtest/gtest.h"
#include "hierarchy/close_race_test_util.h"
#include "hierarchy/endpoint.h"
#include "simpler/base/clock.h"
#include "simpler/base/process.h"
#include "simpler/device/fault_plan.h"
#include "simpler/hierarchy/tp_mlp.h"
#include "worker/worker_test_util.h"

namespace simpler::hierarchy {
namespace {

using worker::RunHandle;
using worker::testing::contains;

absl::Status noop_kernel(const task::KernelContext&) { return absl::OkStatus(); }

task::ChipCallable noop_program() {
  return {"noop",
          [](task::OrchestrationContext& ctx, const task::TaskArgs&) {
            return ctx.submit(0, task::TaskArgs{});
          },
          {{"noop", noop_kernel}}};
}

// Registers "on_child" on `w` (not started yet): one noop task on the child its args name
// (on_child).
ProgramHandle register_on_child_program(L3Worker& w) {
  ChildCallable noop = *w.register_callable(noop_program());
  return *w.register_program(
      {"on_child", [noop](L3Context& ctx, const task::TaskArgs& a) -> absl::Status {
         return ctx.submit_next_level(noop, {}, static_cast<int32_t>(a.scalar_i64(0))).status();
       }});
}
task::TaskArgs on_child(int64_t child) {
  task::TaskArgs a;
  a.add_scalar_i64(child);
  return a;
}

L3Options options(ChildMode mode, const std::string& faults = "") {
  L3Options o;
  o.device_ids = {0, 1};
  o.child_mode = mode;
  o.child = worker::testing::test_options(2);
  if (!faults.empty()) o.child.faults = *device::FaultPlan::parse(faults);
  o.host_heap_bytes = 4 << 20;
  return o;
}

// The example program (tp_mlp.h) over two children, registered before init.
struct TpMlpOn {
  explicit TpMlpOn(L3Worker& w) : m(*TpMlp::register_on(w, TpMlpShape{})), program(m->program()) {}
  absl::Status allocate(L3Worker&) { return m->allocate(); }
  std::vector<double> fill(uint32_t seed) { return *m->fill(seed); }
  std::unique_ptr<TpMlp> m;
  ProgramHandle program;
};

class L3 : public ::testing::TestWithParam<ChildMode> {
 protected:
  void SetUp() override {
    if (GetParam() == ChildMode::kProcess && process_thread_count() != 1) {
      GTEST_SKIP() << "a sanitizer runs a thread of its own here: process children cannot be "
                      "forked";
    }
  }
};

TEST_P(L3, ATensorParallelMlpAcrossTwoChipsMatchesTheReference) {
  L3Worker w(options(GetParam()));
  TpMlpOn mlp(w);
  ASSERT_TRUE(w.init().ok());
  ASSERT_TRUE(mlp.allocate(w).ok());
  const std::string kind = GetParam() == ChildMode::kThread ? "lane" : "process";
  EXPECT_NE(w.describe_children()[1].find("child 1 (" + kind), std::string::npos)
      << w.describe_children()[1];
  for (uint32_t seed = 1; seed <= 3; ++seed) {
    const std::vector<double> ref = mlp.fill(seed);
    RunHandle h = *w.submit(mlp.program, {});
    ASSERT_TRUE(h.wait().ok()) << h.wait();
    EXPECT_EQ(h.result().report.tasks_submitted, 3u);
    for (size_t i = 0; i < ref.size(); ++i) {
      EXPECT_NEAR(mlp.m->y()[i], ref[i], 1e-4 * (1 + std::abs(ref[i]))) << i;
    }
  }
  EXPECT_TRUE(w.close().ok());
}

// A sub-task that records the order tasks ran in, for dependency checks.
std::atomic<int> g_clock{0};
absl::Status stamp(const task::TaskArgs& args) {
  args.tensor(0).data<int64_t>()[0] = ++g_clock;
  return absl::OkStatus();
}
absl::Status fail_sub(const task::TaskArgs&) { return absl::InternalError("the sub failed"); }

TEST_P(L3, DependenciesFollowTheTaggedTensorsAndAFailedTasksDependentsDoNotRun) {
  L3Worker w(options(GetParam()));
  SubHandle stamp_h = *w.register_sub("stamp", stamp);
  SubHandle fail_h = *w.register_sub("fail", fail_sub);
  HostBuffer cells;
  ProgramHandle chain = *w.register_program(
      {"chain", [&](L3Context& ctx, const task::TaskArgs&) -> absl::Status {
         // t0 writes cell 0; t1 INOUT cell 0 (after t0, RAW); t2 reads cell 0 (after t1);
         // t3 writes cell 1 independently; t4 fails; t5 reads t4's output cell 2: not run.
         auto cell = [&](int i) { return *cells.tensor({1}, task::DataType::kInt64, 8 * i); };
         task::TaskArgs a0, a1, a2, a3, a4, a5;
         a0.add_tensor(cell(0), task::ArgDirection::kOut);
         a1.add_tensor(cell(0), task::ArgDirection::kInOut);
         a2.add_tensor(cell(3), task::ArgDirection::kOut)
             .add_tensor(cell(0), task::ArgDirection::kIn);
         a3.add_tensor(cell(1), task::ArgDirection::kOut);
         a4.add_tensor(cell(2), task::ArgDirection::kOut);
         a5.add_tensor(cell(4), task::ArgDirection::kOut)
             .add_tensor(cell(2), task::ArgDirection::kIn);
         SIMPLER_RETURN_IF_ERROR(ctx.submit_sub(stamp_h, a0).status());
         SIMPLER_RETURN_IF_ERROR(ctx.submit_sub(stamp_h, a1).status());
         SIMPLER_RETURN_IF_ERROR(ctx.submit_sub(stamp_h, a2).status());
         SIMPLER_RETURN_IF_ERROR(ctx.submit_sub(stamp_h, a3).status());
         SIMPLER_RETURN_IF_ERROR(ctx.submit_sub(fail_h, a4).status());
         return ctx.submit_sub(stamp_h, a5).status();
       }});
  ASSERT_TRUE(w.init().ok());
  cells = *w.create_buffer(64);
  g_clock = 0;
  RunHandle h = *w.submit(chain, {});
  absl::Status s = h.wait();
  EXPECT_EQ(h.result().report.tasks_submitted, 6u);
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
  EXPECT_TRUE(contains(s, "L3 run 0 task 4 (host sub 'fail'): the sub failed")) << s;
  const int64_t* c = cells.data<int64_t>();
  // t2 stamps cell 3 after t1 restamped cell 0 after t0.
  EXPECT_GT(c[3], c[0]);
  EXPECT_GT(c[0], 0);
  EXPECT_EQ(c[4], 0) << "a task whose input task failed ran";
  EXPECT_TRUE(w.close().ok());  // delivered by wait()
}

TEST_P(L3, RunsAreFifoErrorsAreDeliveredOnceAndCloseReportsTheUndelivered) {
  // Child 0's run 1 fails (the second next-level task it gets).
  L3Worker w(options(GetParam(), "run=1:task=0:kind=kernel_error"));
  TpMlpOn mlp(w);
  ASSERT_TRUE(w.init().ok());
  ASSERT_TRUE(mlp.allocate(w).ok());
  (void)mlp.fill(7);
  std::vector<RunHandle> hs;
  for (int i = 0; i < 4; ++i) hs.push_back(*w.submit(mlp.program, {}));
  EXPECT_TRUE(hs[3].wait().ok());
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(hs[i].done()) << "run " << i << " behind run 3";
  EXPECT_TRUE(hs[0].wait().ok());
  absl::Status s1 = hs[1].wait();
  EXPECT_TRUE(contains(s1, "L3 run 1 task 0 (child 0, callable 'mlp_shard'): child 0 (")) << s1;
  EXPECT_TRUE(contains(s1, "injected kernel_error")) << s1;
  EXPECT_TRUE(hs[2].wait().ok());
  for (int i = 0; i < 4; ++i) EXPECT_EQ(hs[i].id().value, static_cast<uint64_t>(i));
  EXPECT_TRUE(w.close().ok());  // every error was delivered
  EXPECT_EQ(w.submit(mlp.program, {}).status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST_P(L3, AnOrchestrationErrorFailsItsRunAndCloseReportsItWhenNobodyWaited) {
  L3Worker w(options(GetParam()));
  ChildCallable shard = *w.register_callable(noop_program());
  ProgramHandle p = *w.register_program(
      {"bad_args", [&](L3Context& ctx, const task::TaskArgs&) -> absl::Status {
         task::TaskArgs a;
         int64_t outside = 0;  // not in the shared heap: a child cannot see it
         a.add_tensor(*task::Tensor::contiguous(reinterpret_cast<uintptr_t>(&outside), {1},
                                                task::DataType::kInt64),
                      task::ArgDirection::kIn);
         a[0].tensor.memory = task::MemoryKind::kHost;
         return ctx.submit_next_level(shard, a, 0).status();
       }});
  ASSERT_TRUE(w.init().ok());
  RunHandle h = *w.submit(p, {});
  h = RunHandle();  // dropped unwaited
  absl::Status c = w.close();
  EXPECT_EQ(c.code(), absl::StatusCode::kInvalidArgument) << c;
  EXPECT_TRUE(contains(c, "L3 run 0 orchestration ('bad_args'): submit_next_level: argument 0"))
      << c;
  EXPECT_TRUE(contains(c, "not inside the shared host heap")) << c;
}

TEST_P(L3, InvalidUseIsRefusedWithClearErrors) {
  L3Options bad = options(GetParam());
  bad.device_ids = {0, 0};
  EXPECT_TRUE(contains(L3Worker(bad).init(), "id 0 repeats"));
  L3Worker w(options(GetParam()));
  TpMlpOn mlp(w);
  EXPECT_EQ(w.submit(mlp.program, {}).status().code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(w.init().ok());
  EXPECT_TRUE(contains(w.register_callable(noop_program()).status(), "after init()"));
  EXPECT_EQ(w.submit(ProgramHandle{9}, {}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(w.create_buffer(0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(w.create_buffer(8 << 20).status().code(), absl::StatusCode::kResourceExhausted);
  HostBuffer a = *w.create_buffer(100);
  EXPECT_TRUE(w.free_buffer(a).ok());
  EXPECT_EQ(w.free_buffer(a).code(), absl::StatusCode::kNotFound);
  HostBuffer whole = *w.create_buffer(4 << 20);  // coalesced back into one range
  EXPECT_TRUE(w.free_buffer(whole).ok());
  EXPECT_TRUE(contains(w.child_malloc(2, 8).status(), "child 2 outside [0, 2)"));
  worker::DeviceBuffer d = *w.child_malloc(1, 64);
  HostBuffer h = *w.create_buffer(32);
  EXPECT_TRUE(
      contains(w.copy_to_child(1, d, h, 64), "64 bytes do not fit the 32-byte host buffer"));
  EXPECT_TRUE(w.copy_to_child(1, d, h, 32, 32).ok());
  EXPECT_EQ(w.copy_to_child(1, d, h, 32, 48).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(w.child_free(1, d).ok());
  EXPECT_EQ(w.child_free(1, d).code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(w.close().ok());
}

// What a child setup leaves for its callable: one value per child, filled on the child's side.
int64_t g_setup_value[2] = {0, 0};

// Copies this child's setup value (the child's index is scalar 0) into argument 1.
absl::Status read_setup_value(const task::KernelContext& ctx) {
  ctx.tensor(1).data<int64_t>()[0] = g_setup_value[ctx.scalar(0)];
  return absl::OkStatus();
}

TEST_P(L3, AChildSetupRunsOnTheChildsSideBeforeItServes) {
  g_setup_value[0] = g_setup_value[1] = 0;
  L3Worker w(options(GetParam()));
  ASSERT_TRUE(w.register_child_setup([](int32_t child, worker::Worker& cw) -> absl::Status {
                 // The child's own worker: device memory is made here, where the device is.
                 SIMPLER_ASSIGN_OR_RETURN(worker::DeviceBuffer b, cw.malloc(64));
                 if (b.bytes != 64) return absl::InternalError("malloc(64) gave another size");
                 g_setup_value[child] = 7 * (child + 1);
                 return absl::OkStatus();
               }).ok());
  EXPECT_EQ(w.register_child_setup(nullptr).code(), absl::StatusCode::kInvalidArgument);
  ChildCallable read =
      *w.register_callable(task::one_kernel_callable("read_setup", read_setup_value));
  HostBuffer out;
  ProgramHandle both = *w.register_program(
      {"both", [&](L3Context& ctx, const task::TaskArgs&) -> absl::Status {
         for (int32_t c = 0; c < 2; ++c) {
           task::TaskArgs a;
           a.add_scalar(c).add_tensor(*out.tensor({1}, task::DataType::kInt64, 8 * c),
                                      task::ArgDirection::kOut);
           SIMPLER_RETURN_IF_ERROR(ctx.submit_next_level(read, a, c).status());
         }
         return absl::OkStatus();
       }});
  ASSERT_TRUE(w.init().ok());
  EXPECT_TRUE(
      contains(w.register_child_setup([](int32_t, worker::Worker&) { return absl::OkStatus(); }),
               "after init()"));
  out = *w.create_buffer(16);
  ASSERT_TRUE(w.run(both, {}).ok());
  EXPECT_EQ(out.data<int64_t>()[0], 7);
  EXPECT_EQ(out.data<int64_t>()[1], 14);
  if (GetParam() == ChildMode::kProcess) {
    // Each process child filled its own copy; this process's stayed untouched.
    EXPECT_EQ(g_setup_value[0], 0);
    EXPECT_EQ(g_setup_value[1], 0);
  }
  EXPECT_TRUE(w.close().ok());
}

TEST_P(L3, AFailingChildSetupNamesTheChildAndItsError) {
  L3Worker w(options(GetParam()));
  ASSERT_TRUE(w.register_child_setup([](int32_t child, worker::Worker&) -> absl::Status {
                 if (child == 1) return absl::NotFoundError("weights.safetensors: no such file");
                 return absl::OkStatus();
               }).ok());
  TpMlpOn mlp(w);
  absl::Status init = w.init();
  if (GetParam() == ChildMode::kThread) {
    EXPECT_TRUE(contains(init, "L3 init, child 1: setup: weights.safetensors: no such file"))
        << init;
    return;
  }
  ASSERT_TRUE(init.ok()) << init;  // a process child reports through its mailbox
  absl::Status s = w.child_malloc(1, 64).status();
  EXPECT_TRUE(contains(s, "child 1 (process")) << s;
  EXPECT_TRUE(contains(s, "could not start its worker: setup: weights.safetensors: no such file"))
      << s;
  (void)w.close();
}

// The scheduler has no thread: an orchestration runs with the worker's lock held on the thread
// that advanced the runs. Calling the worker from there is refused (not a deadlock), and so is
// an L3Context used from another thread during the call.
TEST_P(L3, AnOrchestrationCallingItsOwnWorkerIsRefusedAndSoIsItsContextOnAnotherThread) {
  L3Worker w(options(GetParam()));
  SubHandle stamp_h = *w.register_sub("stamp", stamp);
  HostBuffer cell;
  absl::Status from_other_thread;
  ProgramHandle reenter =
      *w.register_program({"reenter", [&](L3Context&, const task::TaskArgs&) -> absl::Status {
                             return w.create_buffer(64).status();
                           }});
  ProgramHandle cross = *w.register_program(
      {"cross", [&](L3Context& ctx, const task::TaskArgs&) -> absl::Status {
         task::TaskArgs a;
         a.add_tensor(*cell.tensor({1}, task::DataType::kInt64), task::ArgDirection::kOut);
         std::thread other([&] { from_other_thread = ctx.submit_sub(stamp_h, a).status(); });
         other.join();
         return ctx.submit_sub(stamp_h, a).status();  // on its own thread: accepted
       }});
  ASSERT_TRUE(w.init().ok());
  cell = *w.create_buffer(64);
  absl::Status s = w.run(reenter, {});
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_TRUE(contains(s,
                       "L3 run 0 orchestration ('reenter'): create_buffer called from an L3 "
                       "orchestration of the same worker"))
      << s;
  RunHandle h = *w.submit(cross, {});
  EXPECT_TRUE(h.wait().ok()) << h.wait();
  EXPECT_EQ(h.result().report.tasks_submitted, 1u);  // only the one from its own thread
  EXPECT_EQ(from_other_thread.code(), absl::StatusCode::kFailedPrecondition) << from_other_thread;
  EXPECT_TRUE(contains(from_other_thread,
                       "outside its orchestration call (or from another "
                       "thread)"))
      << from_other_thread;
  EXPECT_TRUE(w.close().ok());
}

// A sub-task that holds its run until the worker::testing::Gate at scalar 0 is open.
absl::Status hold_until_released(const task::TaskArgs& args) {
  reinterpret_cast<const worker::testing::Gate*>(static_cast<uintptr_t>(args.scalar(0)))->wait();
  return absl::OkStatus();
}

TEST_P(L3, FreeBufferIsRefusedOnlyForABufferARunInFlightNames) {
  L3Worker w(options(GetParam()));
  SubHandle hold = *w.register_sub("hold", hold_until_released);
  ProgramHandle prog = *w.register_program(
      {"hold", [&](L3Context& ctx, const task::TaskArgs& args) -> absl::Status {
         task::TaskArgs a;
         a.add_scalar(args.scalar(0)).add_tensor(args.tensor(1), task::ArgDirection::kInOut);
         return ctx.submit_sub(hold, a).status();
       }});
  ASSERT_TRUE(w.init().ok());
  HostBuffer named = *w.create_buffer(256), other = *w.create_buffer(256);
  worker::testing::Gate release;
  task::TaskArgs args;
  args.add_scalar(static_cast<int64_t>(reinterpret_cast<uintptr_t>(&release)))
      .add_tensor(*named.tensor({8}, task::DataType::kInt32, 64), task::ArgDirection::kInOut);
  RunHandle h = *w.submit(prog, args);
  EXPECT_TRUE(w.free_buffer(other).ok());  // no run names it: freed while the run executes
  absl::Status refused = w.free_buffer(named);
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  EXPECT_TRUE(contains(refused, "L3 run 0 names the buffer")) << refused;
  release.open();
  ASSERT_TRUE(h.wait().ok());
  EXPECT_TRUE(w.free_buffer(named).ok());  // finalized: nothing names it any more
  EXPECT_TRUE(w.close().ok());
}

INSTANTIATE_TEST_SUITE_P(Modes, L3, ::testing::Values(ChildMode::kThread, ChildMode::kProcess),
                         [](const auto& info) { return std::string(name_of(info.param)); });

// The same program in thread and process mode gives bit-identical results.
TEST(L3Modes, ThreadAndProcessModesGiveIdenticalResults) {
  if (process_thread_count() != 1) GTEST_SKIP() << "a sanitizer's thread: no fork here";
  std::vector<float> out[2];
  for (ChildMode mode : {ChildMode::kProcess, ChildMode::kThread}) {
    L3Worker w(options(mode));
    TpMlpOn mlp(w);
    ASSERT_TRUE(w.init().ok());
    ASSERT_TRUE(mlp.allocate(w).ok());
    (void)mlp.fill(11);
    ASSERT_TRUE(w.run(mlp.program, {}).ok());
    const TpMlpShape& shape = mlp.m->shape();
    out[mode == ChildMode::kThread].assign(mlp.m->y(), mlp.m->y() + shape.batch * shape.hidden);
    EXPECT_TRUE(w.close().ok());
  }
  EXPECT_EQ(out[0], out[1]);
}

}  // namespace
}  // namespace simpler::hierarchy

namespace simpler::hierarchy {
namespace {

// Waits until the int64 at scalar(0) (the shared heap: not staged, so the test can open it
// while the kernel runs) is non-zero, then stores the next value of the counter at scalar(1)
// into the int64 after the gate. Argument 0 (an INOUT HOST tensor) only orders the task.
absl::Status gate_then_stamp(const task::KernelContext& ctx) {
  auto* cell = reinterpret_cast<std::atomic<int64_t>*>(static_cast<uintptr_t>(ctx.scalar(1)));
  auto* counter = reinterpret_cast<std::atomic<int64_t>*>(static_cast<uintptr_t>(ctx.scalar(2)));
  // Polled, yielding: in process mode the cell is shared with the parent process, which a
  // process-private atomic wait would not see.
  while (cell[0].load() == 0) std::this_thread::yield();
  cell[1].store(counter->fetch_add(1) + 1);
  return absl::OkStatus();
}

task::ChipCallable gate_program() { return task::one_kernel_callable("gate", gate_then_stamp); }

absl::Status open_gate(const task::TaskArgs& args) {
  reinterpret_cast<std::atomic<int64_t>*>(static_cast<uintptr_t>(args.scalar(1)))->store(1);
  return absl::OkStatus();
}

// Each run: one gated next-level task on child 0 over its own two cells; run 0's task also
// waits for a host sub-task (a dependency) when `sub_first` is set.
struct Staging {
  // Registers the program on `w`, which is not started yet.
  explicit Staging(L3Worker& w) : w(w) {
    gate = *w.register_callable(gate_program());
    opener = *w.register_sub("open_gate", open_gate);
    program = *w.register_program(
        {"gated", [this](L3Context& ctx, const task::TaskArgs& a) -> absl::Status {
           const int64_t slot = a.scalar_i64(0);
           const bool sub_first = a.scalar_i64(1) != 0;
           // The ordering tensor: 8 bytes of the run's own (the gate cells are reached by
           // address, unstaged).
           task::Tensor order = *heap.tensor({1}, task::DataType::kInt64, 512 + 8 * slot);
           const uint64_t gate_cell = reinterpret_cast<uintptr_t>(cell(static_cast<int>(slot), 0));
           if (sub_first) {
             task::TaskArgs s;
             s.add_tensor(order, task::ArgDirection::kInOut).add_scalar(gate_cell);
             SIMPLER_RETURN_IF_ERROR(ctx.submit_sub(opener, s).status());
           }
           task::TaskArgs t;
           t.add_tensor(order, task::ArgDirection::kInOut)
               .add_scalar(gate_cell)
               .add_scalar(reinterpret_cast<uintptr_t>(counter()));
           return ctx.submit_next_level(gate, t, 0).status();
         }});
  }
  std::atomic<int64_t>* counter() {
    return reinterpret_cast<std::atomic<int64_t>*>(heap.address + 1024);
  }
  std::atomic<int64_t>* cell(int slot, int i) {
    return reinterpret_cast<std::atomic<int64_t>*>(heap.address + 16 * slot + 8 * i);
  }
  // Starts the worker and makes the heap the runs' cells live in.
  absl::Status start() {
    SIMPLER_RETURN_IF_ERROR(w.init());
    SIMPLER_ASSIGN_OR_RETURN(heap, w.create_buffer(2048));
    return absl::OkStatus();
  }
  // Submits the run of `slot` (its task gated on cell(slot, 0)).
  RunHandle submit(int64_t slot, bool sub_first) {
    task::TaskArgs a;
    a.add_scalar_i64(slot).add_scalar_i64(sub_first ? 1 : 0);
    return *w.submit(program, a);
  }
  L3Worker& w;
  ChildCallable gate;
  SubHandle opener;
  ProgramHandle program;
  HostBuffer heap;
};

bool eventually(const std::function<bool()>& cond) {
  return simpler::testing::eventually(cond, std::chrono::seconds(5));
}

TEST_P(L3, WhileARunExecutesTheNextRunsTaskIsStagedOnItsChild) {
  L3Worker w(options(GetParam()));
  Staging st(w);
  ASSERT_TRUE(st.start().ok());
  RunHandle r0 = st.submit(0, false);
  RunHandle r1 = st.submit(1, false);
  // Run 0 holds child 0 (its gate is closed); run 1's task goes out anyway.
  EXPECT_TRUE(eventually([&] { return w.next_level_dispatched() == 2; }));
  EXPECT_FALSE(r0.done());
  st.cell(1, 0)->store(1);  // run 1's gate first: it still runs after run 0 (child FIFO)
  st.cell(0, 0)->store(1);
  EXPECT_TRUE(r0.wait().ok());
  EXPECT_TRUE(r1.wait().ok());
  EXPECT_EQ(st.cell(0, 1)->load(), 1);
  EXPECT_EQ(st.cell(1, 1)->load(), 2);
  ASSERT_EQ(r1.result().report.tasks.size(), 1u);
  EXPECT_EQ(r1.result().report.tasks[0].core, 0);  // the child
  EXPECT_GE(r1.result().report.tasks[0].start_ns, r0.result().report.tasks[0].end_ns);
  EXPECT_TRUE(w.close().ok());
}

// A waiter polls the children itself and keeps their endpoints' threads asleep meanwhile
// (Endpoint::set_waiter_polling); once it stops, runs nobody polls for are finished by those
// threads again, promptly — not on a timed look (a mailbox collector's is 1 s).
TEST_P(L3, RunsNobodyPollsForFinishPromptlyAfterPolledWaits) {
  L3Worker w(options(GetParam()));
  ChildCallable noop = *w.register_callable(noop_program());
  ProgramHandle both = *w.register_program(
      {"both_children", [noop](L3Context& ctx, const task::TaskArgs&) -> absl::Status {
         for (int32_t c = 0; c < ctx.num_children(); ++c) {
           SIMPLER_RETURN_IF_ERROR(ctx.submit_next_level(noop, {}, c).status());
         }
         return absl::OkStatus();
       }});
  ASSERT_TRUE(w.init().ok());
  for (int i = 0; i < 20; ++i) ASSERT_TRUE(w.submit(both, {})->wait().ok());  // polled waits
  const int64_t t0 = base::now_ns();
  for (int i = 0; i < 5; ++i) {
    RunHandle h = *w.submit(both, {});
    // done() only looks: the children's endpoints deliver the run by themselves.
    ASSERT_TRUE(eventually([&] { return h.done(); })) << "run " << i;
    EXPECT_TRUE(h.wait().ok());
  }
  EXPECT_LT(base::now_ns() - t0, 2'500'000'000) << "unpolled runs waited for timed looks";
  EXPECT_TRUE(w.close().ok());
}

TEST_P(L3, AtDepthOneTheNextRunWaitsForTheCurrentOne) {
  L3Options o = options(GetParam());
  o.launch_depth = 1;
  L3Worker w(o);
  Staging st(w);
  ASSERT_TRUE(st.start().ok());
  RunHandle r0 = st.submit(0, false);
  RunHandle r1 = st.submit(1, false);
  EXPECT_TRUE(eventually([&] { return w.next_level_dispatched() == 1; }));
  // Run 1 is not orchestrated while run 0 runs: 30 ms in which a second dispatch would show (a
  // bounded wait that must time out).
  EXPECT_FALSE(simpler::testing::eventually([&] { return w.next_level_dispatched() != 1; },
                                            std::chrono::milliseconds(30)));
  EXPECT_EQ(w.next_level_dispatched(), 1u);
  st.cell(0, 0)->store(1);
  st.cell(1, 0)->store(1);
  EXPECT_TRUE(r1.wait().ok());
  EXPECT_TRUE(r0.done());
  EXPECT_TRUE(w.close().ok());
}

// Run 0's task on child 0 waits for a host sub-task; run 1's task on child 0
// is ready at once but must not overtake it.
TEST_P(L3, AStagedTaskNeverOvertakesAnEarlierRunsTaskOnItsChild) {
  L3Worker w(options(GetParam()));
  Staging st(w);
  ASSERT_TRUE(st.start().ok());
  st.cell(1, 0)->store(1);            // run 1's gate is open from the start
  RunHandle r0 = st.submit(0, true);  // its sub opens its gate
  RunHandle r1 = st.submit(1, false);
  EXPECT_TRUE(r0.wait().ok());
  EXPECT_TRUE(r1.wait().ok());
  EXPECT_EQ(st.cell(0, 1)->load(), 1) << "run 1's task reached child 0 before run 0's";
  EXPECT_EQ(st.cell(1, 1)->load(), 2);
  EXPECT_TRUE(w.close().ok());
}

}  // namespace
}  // namespace simpler::hierarchy

namespace simpler::hierarchy {
namespace {

absl::Status nothing(const task::TaskArgs&) { return absl::OkStatus(); }

// close() racing two threads that submit L3 runs: every submit is refused or its run finishes.
TEST_P(L3, CloseRacingSubmitsNeitherHangsNorLosesRuns) {
  for (int round = 0; round < 5; ++round) {
    L3Worker w(options(GetParam()));
    TpMlpOn mlp(w);
    SubHandle sub = *w.register_sub("nothing", nothing);
    ProgramHandle host_only = *w.register_program(
        {"host_only", [&](L3Context& ctx, const task::TaskArgs&) -> absl::Status {
           return ctx.submit_sub(sub, {}).status();
         }});
    ASSERT_TRUE(w.init().ok());
    ASSERT_TRUE(mlp.allocate(w).ok());
    (void)mlp.fill(3);
    testing::race_close_against_submits(
        [&](int, int i) { return w.submit(i % 2 == 0 ? host_only : mlp.program, {}); },
        [&] { return w.close(); }, 100, /*after_submits=*/5 + 20 * round);
  }
}

}  // namespace
}  // namespace simpler::hierarchy

namespace simpler::hierarchy {
namespace {

// A next-level task naming a child buffer that was freed fails its run, naming the range, and
// harms no later run.
TEST_P(L3, ATaskOnAFreedChildBufferFailsItsRunNamingTheRange) {
  L3Worker w(options(GetParam()));
  ChildCallable noop_h = *w.register_callable(noop_program());
  worker::DeviceBuffer gone;
  ProgramHandle p = *w.register_program(
      {"uses_buffer", [&](L3Context& ctx, const task::TaskArgs& a) -> absl::Status {
         task::TaskArgs t;
         if (a.scalar_i64(0) != 0) {
           t.add_tensor(*gone.tensor({2}, task::DataType::kInt64), task::ArgDirection::kIn);
         }
         return ctx.submit_next_level(noop_h, t, 1).status();
       }});
  ASSERT_TRUE(w.init().ok());
  gone = *w.child_malloc(1, 16);
  ASSERT_TRUE(w.child_free(1, gone).ok());
  task::TaskArgs stale, fine;
  stale.add_scalar_i64(1);
  fine.add_scalar_i64(0);
  absl::Status s = w.run(p, stale);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_TRUE(contains(s, "L3 run 0 task 0 (child 1, callable 'noop')")) << s;
  EXPECT_TRUE(contains(s, "is not inside a live allocation")) << s;
  EXPECT_TRUE(w.run(p, fine).ok());
  EXPECT_TRUE(w.close().ok());
}

}  // namespace
}  // namespace simpler::hierarchy

namespace simpler::hierarchy {
namespace {

// An L3 run's waiter collects the children's completions itself (RunShared::progress): waiters
// racing close() finish with every run's result, and handles outlive the worker (waiting on
// them after it is destroyed touches none of its endpoints).
TEST_P(L3, WaitersRacingCloseGetEveryRunAndHandlesOutliveTheWorker) {
  for (int round = 0; round < 4; ++round) {
    auto w = std::make_unique<L3Worker>(options(GetParam()));
    ProgramHandle p = register_on_child_program(*w);
    ASSERT_TRUE(w->init().ok());
    constexpr int kRuns = 40;
    std::vector<RunHandle> hs;
    for (int i = 0; i < kRuns; ++i) hs.push_back(*w->submit(p, on_child(i % 2)));
    std::vector<std::thread> waiters;
    std::atomic<int> ok{0};
    for (int k = 0; k < 2; ++k) {
      waiters.emplace_back([&, k] {
        for (int i = k; i < kRuns; i += 2) {
          if (hs[i].wait().ok()) ++ok;
        }
      });
    }
    simpler::testing::spin_for(
        std::chrono::microseconds(100 * round));  // jitter: where close falls
    EXPECT_TRUE(w->close().ok());                 // drains every run: nothing is lost or failed
    w.reset();  // destroyed while the waiters may still be polling
    for (auto& t : waiters) t.join();
    EXPECT_EQ(ok.load(), kRuns);
    for (RunHandle& h : hs) {
      EXPECT_TRUE(h.wait(-1).ok());
      EXPECT_EQ(h.result().report.tasks_submitted, 1u);
    }
  }
}

}  // namespace
}  // namespace simpler::hierarchy

namespace simpler::hierarchy {
namespace {

// Child 0 of a process-mode L3 worker on `o` meets its fault in its run 1: what a waiter on that
// run gets and after how long, whether child 1 goes on, what a later run on child 0 gets, and
// whether close() returns OK (every error delivered by a wait).
struct FaultedChild {
  absl::Status failed, later;
  std::chrono::steady_clock::duration waited{};
  bool other_ok = false, closed_ok = false;
};
FaultedChild run_into_child_0_fault(const L3Options& o) {
  FaultedChild f;
  L3Worker w(o);
  ProgramHandle p = register_on_child_program(w);
  EXPECT_TRUE(w.init().ok());
  const task::TaskArgs on0 = on_child(0), on1 = on_child(1);
  EXPECT_TRUE(w.run(p, on0).ok());  // child 0's run 0
  const auto t0 = std::chrono::steady_clock::now();
  RunHandle faulted = *w.submit(p, on0);  // child 0's run 1: the fault
  f.failed = faulted.wait(30.0);
  f.waited = std::chrono::steady_clock::now() - t0;
  f.other_ok = w.run(p, on1).ok();  // child 1's run 0
  f.later = w.run(p, on0);          // refused by the lost child, named
  f.closed_ok = w.close().ok();
  return f;
}

// A process child killed mid-run (SIGKILL, the fault plan's process_kill): a thread waiting on an
// L3 run whose task it held — polling that child's mailbox itself — gets the failure naming the
// child and the signal promptly; runs on the other child go on.
TEST_P(L3, AWaiterOnAKilledChildsRunGetsItsDeathAndTheOtherChildGoesOn) {
  if (GetParam() != ChildMode::kProcess) GTEST_SKIP() << "a thread child shares this process";
  // Each child kills itself in its run 1 (only child 0 gets a second run here).
  const FaultedChild f =
      run_into_child_0_fault(options(GetParam(), "run=1:task=0:kind=process_kill"));
  EXPECT_LT(f.waited, std::chrono::seconds(3));
  EXPECT_FALSE(f.failed.ok());
  EXPECT_TRUE(contains(f.failed, "child 0 (process ")) << f.failed;
  EXPECT_TRUE(contains(f.failed, "killed by signal 9")) << f.failed;
  EXPECT_TRUE(f.other_ok);
  EXPECT_TRUE(contains(f.later, "killed by signal 9")) << f.later;
  EXPECT_TRUE(f.closed_ok);
}

// A process child that stops answering mid-run (SIGSTOP, the fault plan's process_stop), where its
// own operation timeout cannot fire: the parent's watch fails the run it held once it completed
// nothing for twice that timeout plus 1 s (0.25 s here: 1.5 s), naming the child and the stall,
// and kills it; the other child goes on, and close() returns.
TEST_P(L3, AStoppedChildsRunsFailAtItsStallLimitAndTheOtherChildGoesOn) {
  if (GetParam() != ChildMode::kProcess) GTEST_SKIP() << "a thread child shares this process";
  L3Options o = options(GetParam(), "run=1:task=0:kind=process_stop");
  o.child.operation_timeout_s = 0.25;
  const FaultedChild f = run_into_child_0_fault(o);
  EXPECT_GE(f.waited, std::chrono::milliseconds(1400));
  EXPECT_LT(f.waited, std::chrono::seconds(10));
  EXPECT_FALSE(f.failed.ok());
  EXPECT_TRUE(contains(f.failed, "child 0 (process ")) << f.failed;
  EXPECT_TRUE(contains(f.failed,
                       "run(s) in flight, past twice its operation timeout plus 1 s (1.5 s): "
                       "it is stopped or hung; killed"))
      << f.failed;
  EXPECT_TRUE(f.other_ok);
  EXPECT_TRUE(contains(f.later, "it is stopped or hung")) << f.later;
  EXPECT_TRUE(f.closed_ok);
}

// A process child stopped (SIGSTOP) while the parent has a control command out to it and no run
// in flight: the same watch fails the command once the child answered nothing for twice its
// operation timeout plus 1 s, naming the command, and kills the child; the other child goes on,
// and close() returns. Without the watch the command waits out its own 600 s limit.
TEST_P(L3, AStoppedChildsControlCommandFailsAtItsStallLimit) {
  if (GetParam() != ChildMode::kProcess) GTEST_SKIP() << "a thread child shares this process";
  L3Options o = options(GetParam());
  o.child.operation_timeout_s = 0.25;
  L3Worker w(o);
  ProgramHandle p = register_on_child_program(w);
  ASSERT_TRUE(w.init().ok());
  ASSERT_TRUE(w.run(p, on_child(0)).ok());
  const std::string child0 = w.describe_children()[0];  // "child 0 (process N)"
  const size_t at = child0.find("(process ");
  ASSERT_NE(at, std::string::npos) << child0;
  const pid_t pid = static_cast<pid_t>(std::stol(child0.substr(at + 9)));
  ASSERT_EQ(kill(pid, SIGSTOP), 0);
  const auto by = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (base::process_state(pid) != 'T' && std::chrono::steady_clock::now() < by) {
    std::this_thread::yield();
  }
  ASSERT_EQ(base::process_state(pid), 'T') << "child 0 did not stop";

  const auto t0 = std::chrono::steady_clock::now();
  absl::StatusOr<worker::DeviceBuffer> b = w.child_malloc(0, 4096);
  const auto waited = std::chrono::steady_clock::now() - t0;
  EXPECT_GE(waited, std::chrono::milliseconds(1400));
  EXPECT_LT(waited, std::chrono::seconds(10));
  ASSERT_FALSE(b.ok());
  EXPECT_TRUE(contains(b.status(), "child 0 (process ")) << b.status();
  EXPECT_TRUE(contains(b.status(),
                       "with its malloc command unanswered, past twice its operation timeout plus "
                       "1 s (1.5 s): it is stopped or hung; killed"))
      << b.status();
  EXPECT_TRUE(w.run(p, on_child(1)).ok());
  absl::StatusOr<worker::DeviceBuffer> other = w.child_malloc(1, 4096);
  EXPECT_TRUE(other.ok()) << other.status();
  if (other.ok()) {
    EXPECT_TRUE(w.child_free(1, *other).ok());
  }
  EXPECT_TRUE(contains(w.run(p, on_child(0)), "it is stopped or hung"));
  EXPECT_TRUE(w.close().ok());
}

// A command a working child takes long to answer is not a stall: here child 0 still runs its
// setup (2 s of work, as a model load) when the malloc comes, past the 1.5 s stall limit; it is
// never stopped, so the malloc waits for it and succeeds.
TEST_P(L3, ACommandAWorkingChildIsSlowToAnswerIsNotAStall) {
  if (GetParam() != ChildMode::kProcess) GTEST_SKIP() << "the watch is the process children's";
  L3Options o = options(GetParam());
  o.child.operation_timeout_s = 0.25;
  L3Worker w(o);
  ASSERT_TRUE(w.register_child_setup([](int32_t child, worker::Worker&) {
                 if (child != 0) return absl::OkStatus();
                 const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(2);
                 volatile uint64_t work = 0;
                 while (std::chrono::steady_clock::now() < until)
                   work = work + 1;  // busy, as a load
                 return absl::OkStatus();
               }).ok());
  ASSERT_TRUE(w.init().ok());
  absl::StatusOr<worker::DeviceBuffer> b = w.child_malloc(0, 4096);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_TRUE(w.child_free(0, *b).ok());
  EXPECT_TRUE(w.close().ok());
}

}  // namespace
}  // namespace simpler::hierarchy
