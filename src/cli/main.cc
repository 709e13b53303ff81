// The `simpler` command.
#include <cstdio>
#include <exception>
#include <new>
#include <string>
#include <vector>

#include "cli/commands.h"

int main(int argc, char** argv) {
  CLI::App app{"simpler: run programs on accelerator devices (sim device embedded)"};
  // "simpler <version>" on stdout, exit 0; the version is the CMake project's.
  app.set_version_flag("--version", std::string("simpler ") + SIMPLER_VERSION);
  app.require_subcommand(1);
  std::vector<simpler::cli::Runner> runners;
  runners.push_back(simpler::cli::add_run_command(app));
  runners.push_back(simpler::cli::add_bench_commands(app));
  runners.push_back(simpler::cli::add_make_model_command(app));
  runners.push_back(simpler::cli::add_export_gguf_command(app));
  runners.push_back(simpler::cli::add_generate_command(app));
  runners.push_back(simpler::cli::add_serve_command(app));
  runners.push_back(simpler::cli::add_l3_example_command(app));
  CLI11_PARSE(app, argc, argv);
  // The flags are bounded so that nothing should throw; an allocation or a thread start that
  // still fails is reported as an error exit, not an abort.
  try {
    for (auto& r : runners) {
      int rc = r();
      if (rc >= 0) return rc;  // the runner whose subcommand was chosen
    }
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "simpler: out of host memory (an allocation failed)\n");
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "simpler: unexpected error: %s\n", e.what());
    return 1;
  }
  return 0;
}
