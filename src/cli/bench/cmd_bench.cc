// `simpler bench dispatch|pipeline|decode|prefill|load|throughput|mailbox|serve`: the `bench`
// subcommand and its benchmarks, each registered from its own file (bench_commands.h).
#include <vector>

#include "cli/bench/bench_commands.h"
#include "cli/commands.h"

namespace simpler::cli {

Runner add_bench_commands(CLI::App& app) {
  auto* bench = app.add_subcommand("bench", "benchmarks; each prints its numbers");
  bench->require_subcommand(1);
  // In the order `simpler bench --help` lists them.
  std::vector<Runner> runners = {
      add_bench_dispatch_command(bench), add_bench_pipeline_command(bench),
      add_bench_decode_command(bench),   add_bench_prefill_command(bench),
      add_bench_load_command(bench),     add_bench_throughput_command(bench),
      add_bench_mailbox_command(bench),  add_bench_serve_command(bench)};
  return [bench, runners]() -> int {
    if (!bench->parsed()) return -1;
    for (const Runner& run : runners) {
      if (int rc = run(); rc != -1) return rc;
    }
    return 0;
  };
}

}  // namespace simpler::cli
