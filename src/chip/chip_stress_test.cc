// Stress of the executor / sim device hand-off: many short runs, launched
// while earlier runs execute, with host pauses so device threads fall asleep.
// A lost wake-up, completion or core thread hangs a run. SIMPLER_CHIP_STRESS_RUNS
// overrides the run counts (soak: e.g. 1000000).
#include <chrono>
#include <cstdlib>
#include <deque>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include "base/test_wait.h"
#include "chip/chip_runtime.h"
#include "device/sim_device_test_util.h"
#include "gtest/gtest.h"
#include "simpler/base/clock.h"
#include "simpler/base/status.h"

namespace simpler::chip {
namespace {

using task::ArgDirection;
using task::DataType;
using task::Tensor;

absl::Status busy(const task::KernelContext& ctx) {
  const auto n = static_cast<int32_t>(ctx.scalar(1));
  volatile int32_t s = 0;
  for (int32_t i = 0; i < n; ++i) s = s + 1;
  ctx.tensor(0).data<int32_t>()[ctx.block_idx] += 1;
  return absl::OkStatus();
}

// Threads of this process whose name starts with `prefix` (/proc/self/task/*/comm).
int live_threads(const std::string& prefix) {
  int n = 0;
  for (const auto& e : std::filesystem::directory_iterator("/proc/self/task")) {
    std::ifstream f(e.path() / "comm");
    std::string name;
    std::getline(f, name);
    if (name.rfind(prefix, 0) == 0) ++n;
  }
  return n;
}

// Whether the process has `want` sim-core threads. A joined thread of an earlier test's device
// may still be listed for a moment (the kernel reaps it after waking its joiner), so a count
// above `want` is looked at again until it settles; one below it stays below (a core thread of
// the open device exited) and fails at the deadline.
bool core_threads_settle_at(int want) {
  return simpler::testing::eventually([&] { return live_threads("sim-core") == want; });
}

int stress_runs(int fallback) {
  const char* env = std::getenv("SIMPLER_CHIP_STRESS_RUNS");
  return env != nullptr ? std::atoi(env) : fallback;
}

void busy_wait_ns(int64_t ns) {
  const int64_t until = base::now_ns() + ns;
  while (base::now_ns() < until) {
  }
}

using SchedulerCore = device::SimDeviceOptions::SchedulerCore;

// A sim device with two cores (this machine class's hardware threads) and its stream; with
// SchedulerCore::kOn the stream's scheduler thread stands in for core 0 on short jobs.
struct TwoCoreDevice {
  explicit TwoCoreDevice(SchedulerCore sc) {
    device::SimDeviceOptions o;
    o.num_cores = 2;
    o.scheduler_core = sc;
    o.spin_ns = 20'000;  // the orchestrations' pauses below are sized to outlast it
    device = std::move(device::create_sim_device(o)).value();
    stream = device->create_stream().value();
  }
  int core_threads = 2;
  std::unique_ptr<device::Device> device;
  device::Stream* stream = nullptr;
};

// Each stress runs with the scheduler only scheduling and with it standing in for core 0.
class ChipStressTest : public ::testing::TestWithParam<SchedulerCore> {};
INSTANTIATE_TEST_SUITE_P(SchedulerCore, ChipStressTest, device::testing::scheduler_core_modes(),
                         device::testing::scheduler_core_test_name);

// Random graphs of 1-12 tasks (1, 2 or 16 blocks, kernels of 0 to ~100 µs) over
// four buffers, at most two runs queued, with host pauses so device threads
// fall asleep between runs and orchestrations that pause after their first task.
// Every run finishes, every block's increment lands, the cores stay alive.
TEST_P(ChipStressTest, ShortRunsWithHostPausesAllFinish) {
  const int runs = stress_runs(2000);
  TwoCoreDevice chip(GetParam());
  device::Device* dev = chip.device.get();
  device::Stream* stream = chip.stream;
  constexpr int kBuffers = 4, kMaxBlocks = 16;
  std::vector<Tensor> bufs;
  for (int i = 0; i < kBuffers; ++i) {
    bufs.push_back(
        *Tensor::contiguous(*dev->malloc(kMaxBlocks * 4), {kMaxBlocks}, DataType::kInt32));
  }
  std::vector<std::vector<int32_t>> expected(kBuffers, std::vector<int32_t>(kMaxBlocks, 0));
  struct Task {
    int buf, blocks, spin;
  };
  struct Run {
    std::vector<Task> tasks;
    bool pause = false;
    std::unique_ptr<task::ChipCallable> callable;
    RunReport report;
    std::shared_ptr<device::LaunchRecord> record;
  };
  std::deque<std::unique_ptr<Run>> live;
  const ChipOptions opt;
  const task::TaskArgs none;
  std::mt19937 rng(1);
  auto pick = [&rng](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  auto reap = [&live] {
    Run& r = *live.front();
    ASSERT_TRUE(r.record->done.wait(base::Deadline::after(std::chrono::seconds(10))))
        << "run " << r.record->run_id << " hung";
    ASSERT_TRUE(r.record->done.status().ok()) << r.record->done.status();
    live.pop_front();
  };
  for (int n = 0; n < runs; ++n) {
    auto run = std::make_unique<Run>();
    Run* rp = run.get();
    run->pause = pick(0, 1) == 1;
    for (int t = pick(1, 12); t > 0; --t) {
      const int b = pick(0, 9), k = pick(0, 9);
      Task task{pick(0, kBuffers - 1),
                b < 6   ? 1
                : b < 9 ? 2
                        : kMaxBlocks,
                k < 4   ? 0
                : k < 8 ? 2000
                : k < 9 ? 20000
                        : 200000};
      for (int i = 0; i < task.blocks; ++i) ++expected[task.buf][i];
      run->tasks.push_back(task);
    }
    run->callable = std::make_unique<task::ChipCallable>(
        task::ChipCallable{"stress",
                           [rp, &bufs](task::OrchestrationContext& ctx, const task::TaskArgs&) {
                             for (const Task& t : rp->tasks) {
                               task::TaskArgs a;
                               a.add_tensor(bufs[t.buf], ArgDirection::kInOut)
                                   .add_scalar(static_cast<uint64_t>(t.spin));
                               SIMPLER_RETURN_IF_ERROR(ctx.submit(0, a, t.blocks));
                               // Host work after the first task: a lone job's deferred core
                               // wake-up is sent while the job waits.
                               if (rp->pause && &t == &rp->tasks.front()) busy_wait_ns(30'000);
                             }
                             return absl::OkStatus();
                           },
                           {{"busy", busy}}});
    auto rec = stream->launch(n + 1, [rp, &opt, &none](device::ExecContext& ctx) {
      return execute_run(ctx, *rp->callable, none, opt, 0, false, &rp->report);
    });
    ASSERT_TRUE(rec.ok()) << rec.status();
    run->record = *rec;
    live.push_back(std::move(run));
    // At most two runs queued; now and then wait for all and pause so the
    // device threads go to sleep.
    const bool drain = pick(0, 3) == 0;
    while (live.size() > (drain ? 0u : 1u)) {
      reap();
      if (HasFatalFailure()) return;
    }
    if (n % 1000 == 999) {
      ASSERT_TRUE(core_threads_settle_at(chip.core_threads))
          << "a core thread exited while the device was open (after run " << n + 1 << ")";
    }
    // Jitter: a pause of varying length, long enough now and then for the idle device threads
    // to pass their spin and go to sleep.
    if (drain) simpler::testing::spin_for(std::chrono::microseconds(pick(0, 300)));
  }
  while (!live.empty()) {
    reap();
    if (HasFatalFailure()) return;
  }
  EXPECT_TRUE(core_threads_settle_at(chip.core_threads))
      << "a core thread exited while the device was open";
  for (int i = 0; i < kBuffers; ++i) {
    for (int j = 0; j < kMaxBlocks; ++j) {
      EXPECT_EQ(bufs[i].data<int32_t>()[j], expected[i][j]) << "buffer " << i << " element " << j;
    }
  }
}

// The scheduler runs a lone job itself when its core has not taken it, while
// that core may be waking up for it (its deferred wake-up was sent because the
// orchestration took a while): each run here lines the two up at a varying
// offset. Every run must finish and both core threads must stay alive.
TEST_P(ChipStressTest, LoneJobRunInlineWhileItsCoreWakesUp) {
  const int runs = stress_runs(20000);
  TwoCoreDevice chip(GetParam());
  device::Device* dev = chip.device.get();
  device::Stream* stream = chip.stream;
  const Tensor b = *Tensor::contiguous(*dev->malloc(64 * 4), {64}, DataType::kInt32);
  std::atomic<int64_t> delay_ns{0};
  const task::ChipCallable c{
      "lone",
      [&](task::OrchestrationContext& ctx, const task::TaskArgs&) {
        task::TaskArgs a;
        a.add_tensor(b, ArgDirection::kInOut).add_scalar(0);
        SIMPLER_RETURN_IF_ERROR(ctx.submit(0, a));  // deferred wake-up: its core sleeps
        busy_wait_ns(25'000);                       // longer than spin_ns (20 µs)
        SIMPLER_RETURN_IF_ERROR(ctx.submit(0, a));  // waits on the first: sends the wake-up
        busy_wait_ns(delay_ns.load(std::memory_order_relaxed));
        return absl::OkStatus();  // finish(): runs the first job inline unless its core took it
      },
      {{"busy", busy}}};
  ChipOptions opt;
  task::TaskArgs none;
  RunReport report;
  std::mt19937 rng(3);
  for (int r = 0; r < runs; ++r) {
    delay_ns.store(std::uniform_int_distribution<int64_t>(0, 40'000)(rng),
                   std::memory_order_relaxed);
    auto rec = stream->launch(r + 1, [&](device::ExecContext& ctx) {
      return execute_run(ctx, c, none, opt, 0, false, &report);
    });
    ASSERT_TRUE(rec.ok());
    ASSERT_TRUE((*rec)->done.wait(base::Deadline::after(std::chrono::seconds(10))))
        << "run " << r + 1 << " hung";
    ASSERT_TRUE((*rec)->done.status().ok()) << (*rec)->done.status();
    if (r % 500 == 499) {
      ASSERT_TRUE(core_threads_settle_at(chip.core_threads))
          << "a core thread exited while the device was open (after run " << r + 1 << ")";
    }
  }
}

}  // namespace
}  // namespace simpler::chip
