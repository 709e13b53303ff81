// `simpler run LIB`: load a program library and run its self-checks.
#include <cstdio>
#include <iostream>

#include "absl/strings/str_cat.h"
#include "cli/commands.h"
#include "nlohmann/json.hpp"
#include "simpler/worker/program_library.h"

namespace simpler::cli {

Runner add_run_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("run", "load a program library (.so) and run its self-checks");
  struct State {
    std::string lib;
    int repeats = 1;
    CommonOptions common;
  };
  auto st = std::make_shared<State>();
  cmd->add_option("lib", st->lib, "path of the program library")->required();
  cmd->add_option("--repeats", st->repeats, "run every self-check this many times")
      ->check(int_in(1, kMaxRepeats))
      ->capture_default_str();
  st->common.add_to(cmd);
  return [cmd, st]() -> int {
    if (!cmd->parsed()) return -1;
    auto lib = worker::ProgramLibrary::load(st->lib);
    if (!lib.ok()) return fail("run", lib.status());
    if (lib->self_checks().empty()) {
      return fail("run",
                  absl::InvalidArgumentError(absl::StrCat("program library '", st->lib,
                                                          "' has no self-checks: nothing to run")));
    }
    base::TraceRecorder trace;
    auto results = worker::run_self_checks(*lib, st->common.worker_options(&trace), st->repeats);
    if (!results.ok()) {
      return fail_with_trace("run", results.status(), trace, st->common.trace_path);
    }
    double max_err = 0;
    bool all = true;
    nlohmann::json checks = nlohmann::json::array();
    for (const auto& r : *results) {
      max_err = std::max(max_err, r.max_abs_error);
      all = all && r.passed;
      const double device_us = (r.run.timing.device_end_ns - r.run.timing.device_start_ns) / 1e3;
      if (st->common.json) {
        checks.push_back({{"name", r.name},
                          {"max_abs_error", r.max_abs_error},
                          {"tolerance", r.tolerance},
                          {"passed", r.passed},
                          {"run_id", r.run.id.value},
                          {"device_us", device_us}});
      } else {
        std::printf("%-28s run %-4llu max_abs_error %.3e (tolerance %.1e) %s  device %.1f us\n",
                    r.name.c_str(), static_cast<unsigned long long>(r.run.id.value),
                    r.max_abs_error, r.tolerance, r.passed ? "ok" : "FAILED", device_us);
      }
    }
    if (st->common.json) {
      nlohmann::json out = {{"library", lib->name()},
                            {"checks", checks},
                            {"max_abs_error", max_err},
                            {"passed", all}};
      print_json_line(out);
    } else {
      std::printf("%s: max error %.3e over %zu runs: %s\n", lib->name().c_str(), max_err,
                  results->size(), all ? "PASSED" : "FAILED");
    }
    if (!write_trace(trace, st->common.trace_path)) return 1;
    return all ? 0 : 1;
  };
}

}  // namespace simpler::cli
