// `simpler bench pipeline`: early enqueue — runs/s, device busy time and launch gaps per launch
// depth against the host's prepare time.
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "cli/bench/bench_commands.h"
#include "cli/bench/bench_runtime.h"
#include "cli/commands.h"
#include "simpler/worker/worker_stats.h"

namespace simpler::cli {

namespace {

struct PipelineFlags {
  std::vector<int> depths{1, 2, 4};
  double device_us = 1000;
  std::vector<double> host_ratios{0.25, 1, 4};
  std::string pin = "auto";
  int runs = 200;
  CommonOptions common;
};

int run_bench_pipeline(const PipelineFlags& st, const CLI::App& cmd) {
  base::TraceRecorder trace;
  const double d = st.device_us;
  std::vector<double> host_us;
  for (double r : st.host_ratios) host_us.push_back(r * d);
  worker::WorkerOptions options = st.common.worker_options(&trace);
  if (cmd.get_option("--cores")->count() == 0) options.num_cores = 1;
  std::vector<int> depths = st.depths;
  if (cmd.get_option("--launch-depth")->count() > 0) {
    depths = {st.common.launch_depth};
  }
  auto rows = bench_pipeline(options, depths, d, host_us, st.runs,
                             st.pin == "auto" ? PinMode::kAuto : PinMode::kOff);
  if (!rows.ok()) {
    return fail_with_trace("bench pipeline", rows.status(), trace, st.common.trace_path);
  }
  if (st.common.json) {
    for (const auto& r : *rows) print_json_line(nlohmann::json(r));
  } else {
    if (!rows->empty()) {
      std::printf("host and device threads %s\n",
                  rows->front().pinned ? "pinned to disjoint CPUs" : "not pinned");
    }
    std::printf("%5s %8s %8s %10s %8s %10s %10s %12s %8s %6s\n", "depth", "H us", "D us", "runs/s",
                "busy", "gap p50", "gap p99", "host cpu us", "gap>20", "late");
    for (const auto& r : *rows) {
      std::printf("%5d %8.0f %8.0f %10.1f %7.1f%% %10.2f %10.2f %12.1f %8d %6d\n", r.depth,
                  r.host_us, r.device_us, r.runs_per_s, 100 * r.device_busy, r.gap_us_p50,
                  r.gap_us_p99, r.host_cpu_us_per_run, r.gaps_over_20us, r.late_launches);
    }
    std::printf(
        "gap>20: gaps over 20 µs; late: runs the host launched after the previous "
        "run's last task ended (of %d gaps per row)\n",
        rows->empty() ? 0 : rows->front().runs - 1);
  }
  return write_trace(trace, st.common.trace_path) ? 0 : 1;
}

}  // namespace

Runner add_bench_pipeline_command(CLI::App* bench) {
  auto st = std::make_shared<PipelineFlags>();
  auto* cmd = bench->add_subcommand("pipeline", "early enqueue: depth vs host/device time");
  auto* depths_opt = cmd->add_option("--depths", st->depths, "launch depths, one row each")
                         ->delimiter(',')
                         ->check(int_in(1, worker::kMaxRunGrant))
                         ->capture_default_str();
  cmd->add_option("--device-us", st->device_us, "device time D per run, µs")
      ->check(number_in(0, kMaxDeviceUs, /*lo_open=*/true))
      ->capture_default_str();
  cmd->add_option("--host-ratios", st->host_ratios, "host prepare time H as multiples of D")
      ->delimiter(',')
      ->check(number_in(0, 1000))
      ->capture_default_str();
  cmd->add_option("--pin", st->pin,
                  "auto: device threads on the last allowed CPU, host threads on the others "
                  "(host and device each get their own cores); off: no pinning")
      ->check(CLI::IsMember({"auto", "off"}))
      ->capture_default_str();
  cmd->add_option("--runs", st->runs, "runs per row")
      ->check(int_in(2, kMaxRepeats))
      ->capture_default_str();
  st->common.add_to(cmd);
  // --launch-depth D is --depths D; --cores defaults to 1 here (one task on one core).
  cmd->get_option("--launch-depth")->excludes(depths_opt);
  cmd->get_option("--cores")->default_str("1");
  return [cmd, st]() -> int {
    if (!cmd->parsed()) return -1;
    return run_bench_pipeline(*st, *cmd);
  };
}

}  // namespace simpler::cli
