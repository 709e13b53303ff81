// The `simpler bench` subcommands, one file each (cmd_bench_<name>.cc). Each registers itself on
// the `bench` subcommand; its runner returns -1 unless that subcommand was parsed, else the
// process exit code.
#pragma once

#include "CLI/CLI.hpp"
#include "cli/commands.h"

namespace simpler::cli {

Runner add_bench_dispatch_command(CLI::App* bench);
Runner add_bench_pipeline_command(CLI::App* bench);
Runner add_bench_decode_command(CLI::App* bench);
Runner add_bench_prefill_command(CLI::App* bench);
Runner add_bench_load_command(CLI::App* bench);
Runner add_bench_throughput_command(CLI::App* bench);
Runner add_bench_mailbox_command(CLI::App* bench);
Runner add_bench_serve_command(CLI::App* bench);

}  // namespace simpler::cli
