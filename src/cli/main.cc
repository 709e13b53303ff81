// The `simpler` command.
#include <cstdio>
#include <vector>

#include "cli/commands.h"

int main(int argc, char** argv) {
  CLI::App app{"simpler: run programs on accelerator devices (sim device embedded)"};
  app.require_subcommand(1);
  std::vector<simpler::cli::Runner> runners;
  runners.push_back(simpler::cli::add_run_command(app));
  runners.push_back(simpler::cli::add_bench_commands(app));
  runners.push_back(simpler::cli::add_make_model_command(app));
  runners.push_back(simpler::cli::add_generate_command(app));
  CLI11_PARSE(app, argc, argv);
  for (auto& r : runners) {
    int rc = r();
    if (rc >= 0) return rc;  // the runner whose subcommand was chosen
  }
  return 0;
}
