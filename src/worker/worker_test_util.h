// Shared helpers of the worker tests, which live beside them in simpler::worker::testing.
#pragma once

#include <atomic>
#include <chrono>
#include <string>
#include <string_view>
#include <thread>

#include "base/test_status.h"
#include "base/test_wait.h"
#include "gtest/gtest.h"
#include "simpler/base/env.h"
#include "simpler/base/status.h"
#include "simpler/device/fault_plan.h"
#include "simpler/worker/worker.h"

namespace simpler::worker::testing {

using simpler::testing::eventually;

using simpler::testing::contains;

// Whether `s` is an error of `code` whose message contains `needle`; a failure shows `s`:
//   EXPECT_TRUE(fails_with(s, absl::StatusCode::kNotFound, "no such file"));
inline ::testing::AssertionResult fails_with(const absl::Status& s, absl::StatusCode code,
                                             const std::string& needle) {
  if (s.code() == code && contains(s, needle)) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "expected " << absl::StatusCodeToString(code)
                                       << " containing \"" << needle << "\", got " << s;
}

// Options of the worker tests: 2 cores, no injected faults (whatever the
// environment says), the given depth, grant and operation timeout.
inline WorkerOptions test_options(int depth = 1, int grant = 0, double timeout_s = 10) {
  WorkerOptions o;
  o.num_cores = 2;
  o.launch_depth = depth;
  o.run_grant = grant;
  o.faults.emplace();
  o.operation_timeout_s = timeout_s;
  return o;
}

// test_options(depth, grant, timeout_s) with the fault plan `plan` injected (FaultPlan::parse's
// syntax, e.g. "run=1:task=0:kind=hang").
inline WorkerOptions faulty_options(std::string_view plan, int depth = 1, int grant = 0,
                                    double timeout_s = 10) {
  WorkerOptions o = test_options(depth, grant, timeout_s);
  o.faults = device::FaultPlan::parse(plan).value();
  return o;
}

// `o` with its operation timeouts measured on `env`'s clock, which only the test moves.
inline WorkerOptions on_fake_clock(base::FakeEnv& env, WorkerOptions o) {
  o.env = &env;
  return o;
}

// out[0] = 3 * in[0] + scalar(2); INOUT-free so runs are independent.
inline absl::Status affine_kernel(const task::KernelContext& ctx) {
  const int64_t x = ctx.tensor(0).data<int64_t>()[0];
  ctx.tensor(1).data<int64_t>()[0] = 3 * x + ctx.scalar_i64(2);
  return absl::OkStatus();
}

// Sleeps scalar(0) microseconds: a kernel that occupies its core for a chosen time.
inline absl::Status sleep_kernel(const task::KernelContext& ctx) {
  // The kernel's duration is the workload these tests run (run times the lane measures and
  // predicts, runs that queue behind a busy device), not a wait for another thread's state.
  std::this_thread::sleep_for(std::chrono::microseconds(ctx.scalar_i64(0)));
  return absl::OkStatus();
}

// A gate a kernel waits at until the test opens it: holds a run on the device for exactly as
// long as the test needs. The waiting kernel sleeps on the flag (C++20 atomic wait) and open()
// wakes it. Thread-safe; outlives every run given its address.
class Gate {
 public:
  explicit Gate(bool open = false) : open_(open) {}
  Gate(const Gate&) = delete;
  Gate& operator=(const Gate&) = delete;

  void open() {
    open_.store(true, std::memory_order_release);
    open_.notify_all();
  }
  bool is_open() const { return open_.load(std::memory_order_acquire); }
  // Returns once open() was called.
  void wait() const {
    while (!open_.load(std::memory_order_acquire)) open_.wait(false, std::memory_order_acquire);
  }

 private:
  std::atomic<bool> open_;
};

// Waits until the Gate whose address is scalar(0) is open: a run that stays on the device until
// the test opens its gate.
inline absl::Status gate_kernel(const task::KernelContext& ctx) {
  reinterpret_cast<const Gate*>(static_cast<uintptr_t>(ctx.scalar_i64(0)))->wait();
  return absl::OkStatus();
}

// Counts its executions: adds 1 to the std::atomic<int> whose address is
// scalar(0). Tells a test which runs' kernels reached a core, whatever their
// status (HOST outputs of a failed run are not copied back).
inline absl::Status count_kernel(const task::KernelContext& ctx) {
  reinterpret_cast<std::atomic<int>*>(static_cast<uintptr_t>(ctx.scalar_i64(0)))
      ->fetch_add(1, std::memory_order_relaxed);
  return absl::OkStatus();
}

// A program of `tasks` independent tasks of `kernel`, each given the run's
// scalar(0): the shape of the sleep, gate and count programs below.
inline task::ChipCallable scalar_program(std::string name, task::KernelFn kernel, int tasks = 1) {
  return task::ChipCallable{name,
                            [tasks](task::OrchestrationContext& ctx, const task::TaskArgs& args) {
                              for (int i = 0; i < tasks; ++i) {
                                task::TaskArgs a;
                                a.add_scalar_i64(args.scalar_i64(0));
                                SIMPLER_RETURN_IF_ERROR(ctx.submit(0, a));
                              }
                              return absl::OkStatus();
                            },
                            {{name, kernel}}};
}

// Args whose scalar(0) is the address of `object` (a gate or a counter).
inline task::TaskArgs address_args(const void* object) {
  task::TaskArgs a;
  a.add_scalar_i64(static_cast<int64_t>(reinterpret_cast<uintptr_t>(object)));
  return a;
}

inline task::ChipCallable sleep_program() { return scalar_program("sleep", sleep_kernel); }
inline task::ChipCallable gate_program() { return scalar_program("gate", gate_kernel); }
inline task::TaskArgs gate_args(const Gate& gate) { return address_args(&gate); }
// `tasks` independent count_kernel tasks on the run's counter.
inline task::ChipCallable count_program(int tasks) {
  return scalar_program("count", count_kernel, tasks);
}
inline task::TaskArgs count_args(std::atomic<int>& counter) { return address_args(&counter); }

// A program of `tasks` affine tasks (a chain over the run's HOST args: in -> out),
// the first computing out = 3*in + k, later ones recomputing the same value.
inline task::ChipCallable affine_program(int tasks = 1) {
  return task::ChipCallable{"affine",
                            [tasks](task::OrchestrationContext& ctx, const task::TaskArgs& args) {
                              for (int i = 0; i < tasks; ++i) {
                                task::TaskArgs a;
                                a.add_tensor(args.tensor(0), task::ArgDirection::kIn)
                                    .add_tensor(args.tensor(1), task::ArgDirection::kOut)
                                    .add_scalar_i64(args.scalar_i64(2));
                                SIMPLER_RETURN_IF_ERROR(ctx.submit(0, a));
                              }
                              return absl::OkStatus();
                            },
                            {{"affine", affine_kernel}}};
}

// Args for affine_program over host cells `in` and `out`.
inline task::TaskArgs affine_args(int64_t* in, int64_t* out, int64_t k) {
  task::TaskArgs a;
  a.add_tensor(*task::Tensor::contiguous(reinterpret_cast<uintptr_t>(in), {1},
                                         task::DataType::kInt64, task::MemoryKind::kHost),
               task::ArgDirection::kIn);
  a.add_tensor(*task::Tensor::contiguous(reinterpret_cast<uintptr_t>(out), {1},
                                         task::DataType::kInt64, task::MemoryKind::kHost),
               task::ArgDirection::kOut);
  a.add_scalar_i64(k);
  return a;
}

inline bool counts_consistent(const ArenaCounts& c) {
  return c.free + c.live + c.quarantined == c.grant;
}

}  // namespace simpler::worker::testing
