// `simpler bench dispatch`: ns per task for empty kernels, per dependency pattern, orchestrated
// and replayed from a captured graph (and StarPU's with --compare starpu).
#include <cstdio>
#include <memory>
#include <vector>

#include "cli/bench/bench_commands.h"
#include "cli/bench/bench_runtime.h"
#include "cli/bench/bench_starpu.h"
#include "cli/commands.h"
#include "nlohmann/json.hpp"
#include "simpler/base/thread.h"

namespace simpler::cli {

namespace {

struct DispatchFlags {
  int64_t tasks = 100000;
  std::string compare;
  std::vector<std::string> patterns;
  CommonOptions common;
};

int run_bench_dispatch(const DispatchFlags& st) {
  base::TraceRecorder trace;
  auto rows = bench_dispatch(st.common.worker_options(&trace), st.tasks, st.patterns);
  if (!rows.ok()) {
    return fail_with_trace("bench dispatch", rows.status(), trace, st.common.trace_path);
  }
  std::vector<DispatchRow> starpu_rows;
  int ncpu = st.common.cores;
  if (ncpu == 0) ncpu = base::hardware_threads();
  if (st.compare == "starpu") {
    auto peer = bench_dispatch_starpu(ncpu, st.tasks);
    if (!peer.ok()) return fail("bench dispatch", peer.status());
    starpu_rows = std::move(*peer);
  }
  // StarPU's row of a pattern (its rows are one per pattern, uncaptured).
  auto peer_of = [&](const DispatchRow& r) -> const DispatchRow* {
    for (const DispatchRow& p : starpu_rows) {
      if (p.pattern == r.pattern) return &p;
    }
    return nullptr;
  };
  if (st.common.json) {  // one object per row, as --json's help says
    for (const DispatchRow& r : *rows) {
      nlohmann::json j = r;
      if (const DispatchRow* p = peer_of(r)) {
        j["starpu_ns_per_task"] = p->ns_per_task;
        j["starpu_over_simpler"] = p->ns_per_task / r.ns_per_task;
      }
      print_json_line(j);
    }
  } else {
    std::printf("%-12s %-10s %10s %12s %12s %10s", "pattern", "mode", "tasks", "ns/task",
                "prepare us", "wall ms");
    if (!starpu_rows.empty()) std::printf(" %16s %8s", "StarPU ns/task", "ratio");
    std::printf("\n");
    for (const DispatchRow& r : *rows) {
      std::printf("%-12s %-10s %10lld %12.1f %12.1f %10.1f", r.pattern.c_str(), r.mode.c_str(),
                  static_cast<long long>(r.tasks), r.ns_per_task, r.prepare_us, r.wall_ms);
      if (const DispatchRow* p = peer_of(r)) {
        std::printf(" %16.1f %7.1fx", p->ns_per_task, p->ns_per_task / r.ns_per_task);
      }
      std::printf("\n");
    }
    if (!starpu_rows.empty()) {
      std::printf(
          "StarPU %s: %d CPU workers, STARPU_SCHED=eager, inferred (STARPU_RW) "
          "dependencies; ratio = StarPU ns / simpler ns; replayed = the pattern's graph "
          "captured once (CallConfig::capture_key) and replayed\n",
          starpu_version().c_str(), ncpu);
    }
  }
  return write_trace(trace, st.common.trace_path) ? 0 : 1;
}

}  // namespace

Runner add_bench_dispatch_command(CLI::App* bench) {
  auto st = std::make_shared<DispatchFlags>();
  auto* cmd = bench->add_subcommand("dispatch", "ns per task for empty kernels");
  cmd->add_option("--tasks", st->tasks, "tasks per pattern")
      ->check(int_in(1, kMaxTasks))
      ->capture_default_str();
  cmd->add_option("--patterns", st->patterns,
                  "the patterns to run (default all; StarPU runs all of its own)")
      ->delimiter(',')
      ->check(CLI::IsMember({"independent", "chain", "8_chains"}));
  cmd->add_option("--compare", st->compare,
                  "starpu: run the same patterns on StarPU (Debian libstarpu-dev) after the sim "
                  "device closed, with the same CPU count, and print both")
      ->check(CLI::IsMember({"starpu"}));
  st->common.add_to(cmd);
  return run_if_parsed(cmd, st, run_bench_dispatch);
}

}  // namespace simpler::cli
