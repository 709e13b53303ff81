// Runtime benchmarks behind `simpler bench dispatch` and `simpler bench pipeline`.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"
#include "simpler/worker/worker.h"

namespace simpler::cli {

// One dispatch pattern's result: ns per task of the device-side run time
// (device end - device start) / tasks, and host wall time of the whole run.
struct DispatchRow {
  std::string pattern;  // "independent", "chain", "8_chains"
  // "uncaptured" (orchestrated, dependencies inferred), or "replayed" (the pattern's captured
  // graph replayed: CallConfig::capture_key). StarPU's rows are "uncaptured".
  std::string mode = "uncaptured";
  int64_t tasks = 0;
  double ns_per_task = 0;  // device time of the run per task
  double prepare_us = 0;   // host prepare of the run
  double wall_ms = 0;
};

// The dispatch patterns, in the order bench_dispatch runs them.
inline constexpr const char* kDispatchPatterns[] = {"independent", "chain", "8_chains"};

// Runs `tasks` empty kernels per pattern, dependencies inferred by the TensorMap; then
// captures the pattern's graph, replays it once to warm up and replays it again: two rows per
// pattern (uncaptured, replayed). `patterns` names the patterns to run (kDispatchPatterns; empty
// = all of them); an unknown name is INVALID_ARGUMENT.
absl::StatusOr<std::vector<DispatchRow>> bench_dispatch(
    const worker::WorkerOptions& options, int64_t tasks,
    const std::vector<std::string>& patterns = {});

// One pipeline row. Times in µs.
struct PipelineRow {
  int depth = 1;
  double host_us = 0;
  double device_us = 0;
  int runs = 0;
  double runs_per_s = 0;
  double device_busy = 0;  // sum of device run time / wall span of the device runs
  double gap_us_p50 = 0;   // first task start of run k+1 - last task end of run k
  double gap_us_p99 = 0;
  double host_cpu_us_per_run = 0;  // CPU time of the submitting thread per run
  bool pinned = false;             // host and device threads on disjoint CPUs
  // What the tail is made of (counts over the runs - 1 gaps): gaps over
  // 20 µs, and runs the host launched only after the previous run's last
  // task had ended (the host was late: the device could not start at once).
  // The latter compares the host's launch time with device timestamps, which
  // share one clock on the sim device.
  int gaps_over_20us = 0;
  int late_launches = 0;
};

// How bench_pipeline places threads on CPUs.
enum class PinMode {
  kOff,   // wherever the OS schedules them
  kAuto,  // device threads on the last allowed CPU, the host's on the others
          // (needs >= 2 allowed CPUs; otherwise off)
};

// For each depth in `depths` and each host time H in `host_us`: a program of
// one task spinning `device_us` µs on one core; the host spins H µs of
// "prepare" per run and keeps at most `depth` runs outstanding (at depth 1 it
// waits for run k before preparing k+1, as a decode loop that needs run k's
// token on the host must). Like a serving loop, it reads each run's timing
// once it has waited for the run and drops the handle, so results are not
// retained and the heap stays at a steady size. Each row's Worker takes
// `options` with launch_depth set to the row's depth: options.run_grant (0 =
// depth + 1; a grant below a row's depth fails that row's init, naming both)
// and options.num_cores (the CLI passes 1 unless --cores says otherwise) apply
// to every row. With PinMode::kAuto the calling thread stays pinned to the
// host CPUs afterwards.
absl::StatusOr<std::vector<PipelineRow>> bench_pipeline(worker::WorkerOptions options,
                                                        const std::vector<int>& depths,
                                                        double device_us,
                                                        const std::vector<double>& host_us,
                                                        int runs, PinMode pin);

// The rows as JSON objects (nlohmann::json j = row), keyed by their field names.
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(DispatchRow, pattern, mode, tasks, ns_per_task, prepare_us,
                                   wall_ms)
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(PipelineRow, depth, host_us, device_us, runs, runs_per_s,
                                   device_busy, gap_us_p50, gap_us_p99, host_cpu_us_per_run, pinned,
                                   gaps_over_20us, late_launches)

}  // namespace simpler::cli
