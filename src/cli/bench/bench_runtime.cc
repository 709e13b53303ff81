#include "cli/bench/bench_runtime.h"

#include <sys/resource.h>
#include <time.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "cli/bench/bench_stats.h"
#include "simpler/base/clock.h"
#include "simpler/base/status.h"
#include "simpler/base/thread.h"
#include "simpler/task/callable.h"

namespace simpler::cli {

namespace {

absl::Status empty_kernel(const task::KernelContext&) { return absl::OkStatus(); }

// Spins scalar(0) ns on the core.
absl::Status spin_kernel(const task::KernelContext& ctx) {
  const int64_t until = base::now_ns() + ctx.scalar_i64(0);
  while (base::now_ns() < until) {
  }
  return absl::OkStatus();
}

void spin_for_ns(int64_t ns) {
  const int64_t until = base::now_ns() + ns;
  while (base::now_ns() < until) {
  }
}

double thread_cpu_us() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

}  // namespace

absl::StatusOr<std::vector<DispatchRow>> bench_dispatch(const worker::WorkerOptions& options,
                                                        int64_t tasks,
                                                        const std::vector<std::string>& patterns) {
  if (tasks <= 0) return absl::InvalidArgumentError("bench dispatch: --tasks must be > 0");
  for (const std::string& p : patterns) {
    if (std::find(std::begin(kDispatchPatterns), std::end(kDispatchPatterns), p) ==
        std::end(kDispatchPatterns)) {
      return absl::InvalidArgumentError(absl::StrCat("bench dispatch: unknown pattern '", p, "'"));
    }
  }
  worker::Worker w(options);
  // Run args: 0 = slots buffer (int64 [tasks] DEVICE), scalar 1 = pattern.
  auto prog = w.register_callable(
      task::ChipCallable{"dispatch",
                         [](task::OrchestrationContext& ctx, const task::TaskArgs& args) {
                           const task::Tensor& slots = args.tensor(0);
                           const int64_t n = slots.shape[0];
                           const int64_t pattern = args.scalar_i64(1);
                           // One argument list for every task (clear keeps its capacity): the
                           // runtime copies what it keeps at submit.
                           task::TaskArgs a;
                           for (int64_t i = 0; i < n; ++i) {
                             const int64_t slot = pattern == 0 ? i : (pattern == 1 ? 0 : i % 8);
                             task::Tensor t = slots;
                             t.address = slots.address + slot * 8;
                             t.shape[0] = 1;
                             a.clear();
                             a.add_tensor(t, task::ArgDirection::kInOut);
                             SIMPLER_RETURN_IF_ERROR(ctx.submit(0, a));
                           }
                           return absl::OkStatus();
                         },
                         {{"empty", empty_kernel}}});
  SIMPLER_RETURN_IF_ERROR(prog.status());
  SIMPLER_RETURN_IF_ERROR(w.init());
  SIMPLER_ASSIGN_OR_RETURN(worker::DeviceBuffer buf, w.malloc(tasks * 8));
  SIMPLER_ASSIGN_OR_RETURN(task::Tensor slots, buf.tensor({tasks}, task::DataType::kInt64));
  std::vector<DispatchRow> rows;
  for (int pattern = 0; pattern < 3; ++pattern) {
    const std::string name = kDispatchPatterns[pattern];
    if (!patterns.empty() && std::find(patterns.begin(), patterns.end(), name) == patterns.end()) {
      continue;
    }
    task::TaskArgs args;
    args.add_tensor(slots, task::ArgDirection::kInOut).add_scalar_i64(pattern);
    // Uncaptured; then captured under the pattern's key and replayed once (neither measured:
    // the first replay in a resource set sizes its bound arguments), and replayed.
    for (const char* mode : {"uncaptured", "capture", "warm-up", "replayed"}) {
      task::CallConfig cfg;
      cfg.task_timing = false;
      if (mode != std::string_view("uncaptured")) cfg.capture_key = pattern + 1;
      const int64_t t0 = base::now_ns();
      SIMPLER_ASSIGN_OR_RETURN(worker::RunHandle h, w.submit(*prog, args, cfg));
      SIMPLER_RETURN_IF_ERROR(h.wait());
      const int64_t t1 = base::now_ns();
      if (mode == std::string_view("capture") || mode == std::string_view("warm-up")) continue;
      const auto& r = h.result();
      DispatchRow row;
      row.pattern = name;
      row.mode = mode;
      row.tasks = tasks;
      row.ns_per_task =
          static_cast<double>(r.timing.device_end_ns - r.timing.device_start_ns) / tasks;
      row.prepare_us = (r.timing.prepare_end_ns - r.timing.prepare_start_ns) / 1e3;
      row.wall_ms = (t1 - t0) / 1e6;
      rows.push_back(row);
    }
  }
  SIMPLER_RETURN_IF_ERROR(w.close());
  return rows;
}

absl::StatusOr<std::vector<PipelineRow>> bench_pipeline(worker::WorkerOptions options,
                                                        const std::vector<int>& depths,
                                                        double device_us,
                                                        const std::vector<double>& host_us,
                                                        int runs, PinMode pin) {
  if (runs < 2) return absl::InvalidArgumentError("bench pipeline: --runs must be >= 2");
  bool pinned = false;
  if (pin == PinMode::kAuto) {
    SIMPLER_ASSIGN_OR_RETURN(std::vector<int> cpus, base::allowed_cpus());
    if (cpus.size() >= 2) {
      options.device_cpus = {cpus.back()};
      cpus.pop_back();
      // Threads the host creates from here on (the lane thread) inherit this.
      SIMPLER_RETURN_IF_ERROR(base::pin_this_thread(cpus));
      pinned = true;
    }
  }
  std::vector<PipelineRow> rows;
  for (double h_us : host_us) {
    for (int depth : depths) {
      options.launch_depth = depth;  // run_grant and num_cores: as the caller set them
      worker::Worker w(options);
      // Run args: scalar 0 = the spin in ns.
      auto prog = w.register_callable(task::one_kernel_callable("spin", spin_kernel));
      SIMPLER_RETURN_IF_ERROR(prog.status());
      SIMPLER_RETURN_IF_ERROR(w.init());
      task::TaskArgs args;
      args.add_scalar_i64(static_cast<int64_t>(device_us * 1000));
      // The host consumes each run's result once it has waited for it and
      // drops the handle, as a serving loop does: results are not retained,
      // so the heap (and the device thread's allocations for the run report)
      // reaches a steady state instead of growing by every run's report.
      struct Sample {
        int64_t first_start_ns = 0;
        int64_t last_end_ns = 0;
        int64_t busy_ns = 0;
        int64_t launch_ns = 0;  // host clock (the sim device's clock too)
      };
      std::vector<Sample> samples(runs);
      std::vector<worker::RunHandle> in_flight(depth);  // run i lives in slot i % depth
      auto consume = [&](int i) -> absl::Status {
        worker::RunHandle& h = in_flight[i % depth];
        SIMPLER_RETURN_IF_ERROR(h.wait());
        const auto& tasks = h.result().report.tasks;
        if (tasks.empty()) return absl::InternalError("bench pipeline: no task timing");
        samples[i] = {tasks.front().start_ns, tasks.back().end_ns,
                      tasks.front().end_ns - tasks.front().start_ns, h.result().timing.launch_ns};
        h = worker::RunHandle();
        return absl::OkStatus();
      };
      const double cpu0 = thread_cpu_us();
      const int64_t t0 = base::now_ns();
      for (int i = 0; i < runs; ++i) {
        // Keep at most `depth` runs outstanding from the host's point of view.
        if (i >= depth) SIMPLER_RETURN_IF_ERROR(consume(i - depth));
        spin_for_ns(static_cast<int64_t>(h_us * 1000));  // host prepare
        SIMPLER_ASSIGN_OR_RETURN(in_flight[i % depth], w.submit(*prog, args));
      }
      for (int i = std::max(0, runs - depth); i < runs; ++i) SIMPLER_RETURN_IF_ERROR(consume(i));
      const int64_t t1 = base::now_ns();
      const double cpu1 = thread_cpu_us();
      std::vector<double> gaps;
      gaps.reserve(runs);
      double busy_ns = 0;
      int over_20us = 0, late = 0;
      for (int i = 0; i < runs; ++i) {
        busy_ns += samples[i].busy_ns;
        if (i == 0) continue;
        gaps.push_back((samples[i].first_start_ns - samples[i - 1].last_end_ns) / 1e3);
        if (gaps.back() > 20) ++over_20us;
        if (samples[i].launch_ns > samples[i - 1].last_end_ns) ++late;
      }
      const double span_ns = samples.back().last_end_ns - samples.front().first_start_ns;
      PipelineRow row;
      row.depth = depth;
      row.host_us = h_us;
      row.device_us = device_us;
      row.runs = runs;
      row.runs_per_s = runs / ((t1 - t0) / 1e9);
      row.device_busy = span_ns > 0 ? busy_ns / span_ns : 0;
      row.gap_us_p50 = percentile(gaps, 0.5);
      row.gap_us_p99 = percentile(gaps, 0.99);
      row.host_cpu_us_per_run = (cpu1 - cpu0) / runs;
      row.pinned = pinned;
      row.gaps_over_20us = over_20us;
      row.late_launches = late;
      rows.push_back(row);
      SIMPLER_RETURN_IF_ERROR(w.close());
    }
  }
  return rows;
}

}  // namespace simpler::cli
