#include <iostream>

#include "cli/commands.h"

namespace simpler::cli {

void CommonOptions::add_to(CLI::App* app, bool with_json) {
  app->add_option("--cores", cores, "sim device cores (0 = hardware threads - 1)")
      ->check(CLI::NonNegativeNumber);
  app->add_option("--launch-depth", launch_depth, "runs launched on the device at once (>= 1)")
      ->check(CLI::PositiveNumber);
  app->add_option("--run-grant", run_grant,
                  "run resource sets (0 = launch depth + 1; must be >= launch depth)")
      ->check(CLI::NonNegativeNumber);
  app->add_option("--timeout", timeout_s, "operation timeout per run, seconds")
      ->check(CLI::PositiveNumber);
  app->add_option("--graph-placement", placement,
                  "where task graphs are built: device (orchestration on the device) or host "
                  "(built during prepare, executed from a graph image)")
      ->check(CLI::IsMember({"device", "host"}));
  app->add_option("--trace", trace_path, "write a Chrome/Perfetto trace JSON to this file");
  if (with_json) app->add_flag("--json", json, "print one JSON object on stdout");
}

worker::WorkerOptions CommonOptions::worker_options(base::TraceRecorder* trace) const {
  worker::WorkerOptions o;
  o.num_cores = cores;
  o.launch_depth = launch_depth;
  o.run_grant = run_grant;
  o.operation_timeout_s = timeout_s;
  o.trace = trace_path.empty() ? nullptr : trace;
  o.placement = placement == "host" ? task::GraphPlacement::kHost : task::GraphPlacement::kDevice;
  return o;
}

bool write_trace(const base::TraceRecorder& trace, const std::string& path) {
  if (path.empty()) return true;
  absl::Status s = trace.write(path);
  if (!s.ok()) {
    std::cerr << "simpler: " << s.message() << "\n";
    return false;
  }
  std::cerr << "simpler: wrote trace with " << trace.size() << " spans to " << path << "\n";
  return true;
}

int fail(const std::string& cmd, const absl::Status& error) {
  std::cerr << "simpler " << cmd << ": " << error.message() << "\n";
  return 1;
}

int fail_with_trace(const std::string& cmd, const absl::Status& error,
                    const base::TraceRecorder& trace, const std::string& path) {
  (void)write_trace(trace, path);  // a failure to write is reported on its own line
  return fail(cmd, error);
}

}  // namespace simpler::cli
