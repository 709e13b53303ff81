// Subcommands of the `simpler` CLI. Each registers itself on the CLI11 app and
// returns the process exit code when run.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <utility>

#include "CLI/CLI.hpp"
#include "nlohmann/json_fwd.hpp"
#include "simpler/base/trace.h"
#include "simpler/kernels/kernels.h"
#include "simpler/worker/worker.h"

namespace simpler::cli {

// Bounds of the flags (README, "Flag bounds"). A value past its bound is refused while parsing,
// naming the flag, the value and the bound.
inline constexpr int64_t kMaxCores = 256;              // --cores (sim core threads)
inline constexpr int64_t kMaxRequests = 4096;          // --requests, --batch, prompts per file
inline constexpr double kMaxTimeoutS = 1e6;            // --timeout, seconds
inline constexpr int64_t kMaxPageSize = 1 << 16;       // --page-size, tokens
inline constexpr int64_t kMaxBatchedTokens = 1 << 16;  // --max-num-batched-tokens
inline constexpr int64_t kMaxRepeats = 1'000'000;      // --repeats, --runs, --steps
inline constexpr int64_t kMaxTasks = 100'000'000;      // bench dispatch --tasks
inline constexpr double kMaxDeviceUs = 1e7;            // bench pipeline --device-us
inline constexpr int64_t kMaxShards = 10'000;          // make-model --shards
inline constexpr int64_t kMaxLayers = 10'000;          // make-model --layers
inline constexpr int64_t kMaxHiddenSize = 1 << 20;     // make-model --hidden-size

// A CLI11 check for integers in [lo, hi]. Its message states the value and the bound ("2000 is
// above the maximum of 1024"); CLI11 puts the flag's name in front.
CLI::Validator int_in(int64_t lo, int64_t hi);
// A CLI11 check for unsigned 64-bit integers (seeds): "-1" and values past 2^64 - 1 are refused,
// not wrapped or saturated.
CLI::Validator uint64_in();
// A CLI11 check for finite numbers in [lo, hi], or in (lo, hi] when `lo_open`.
CLI::Validator number_in(double lo, double hi, bool lo_open = false);

// What a command's --model takes: a model directory or a .gguf file, or a directory alone (a
// command that reads the checkpoint's own files: export-gguf).
enum class ModelSource { kDirOrGguf, kDirOnly };

// Adds the subcommand `name` (`help` in --help) of `parent` for a command that reads a model,
// with its required --model flag (`model_help`) writing into `*model`, which must outlive the
// parse. The flag parser refuses a path that does not exist, or is not what `source` takes, naming
// it whole. The subcommand is owned by `parent`.
CLI::App* add_model_command(CLI::App* parent, const std::string& name, const std::string& help,
                            std::string* model,
                            const std::string& model_help = "model directory or .gguf file",
                            ModelSource source = ModelSource::kDirOrGguf);

// Options shared by every command that creates a Worker.
struct CommonOptions {
  int32_t cores = 0;
  int32_t launch_depth = 1;
  int32_t run_grant = 0;
  double timeout_s = 60;
  std::string trace_path;
  std::string placement = "device";
  bool json = false;
  std::string kernel_isa_name = "auto";  // LLM commands only (add_kernel_isa_to)
  std::string precision_name = "int8";   // LLM commands only (add_kernel_isa_to)

  void add_to(CLI::App* app, bool with_json = true);
  // --kernel-isa auto|avx512|x86-64-v3|portable: the LLM kernels' ISA target (refused when the
  // CPU lacks it, naming what it has); --precision
  // exact|bf16: their numerics.
  void add_kernel_isa_to(CLI::App* app);
  worker::WorkerOptions worker_options(base::TraceRecorder* trace) const;
  llm::KernelIsa kernel_isa() const;
  llm::Precision precision() const;
};

using Runner = std::function<int()>;

// The Runner of a command whose whole work is `run(*flags)` once its flags are parsed: -1 unless
// `cmd` was the subcommand parsed, else `run`'s exit code.
template <typename Flags>
Runner run_if_parsed(const CLI::App* cmd, std::shared_ptr<Flags> flags, int (*run)(const Flags&)) {
  return [cmd, flags = std::move(flags), run]() -> int { return cmd->parsed() ? run(*flags) : -1; };
}

Runner add_run_command(CLI::App& app);
Runner add_bench_commands(CLI::App& app);
Runner add_make_model_command(CLI::App& app);
Runner add_export_gguf_command(CLI::App& app);
Runner add_generate_command(CLI::App& app);
Runner add_serve_command(CLI::App& app);
Runner add_l3_example_command(CLI::App& app);

// Prints `j` as one line on stdout (base::dump_replacing: invalid UTF-8 replaced): the output of
// a command's --json.
void print_json_line(const nlohmann::json& j);

// Writes the trace when a path was given; prints the error and returns false on failure.
bool write_trace(const base::TraceRecorder& trace, const std::string& path);

// The exit of a failed command: prints "simpler <cmd>: <error>" on stderr, returns 1.
int fail(const std::string& cmd, const absl::Status& error);

// The exit of a command that failed after its Worker was created: writes the trace when a
// path was given (the spans of the failed run are the most useful ones), then prints
// "simpler <cmd>: <error>" as the last line on stderr and returns 1.
int fail_with_trace(const std::string& cmd, const absl::Status& error,
                    const base::TraceRecorder& trace, const std::string& path);

}  // namespace simpler::cli
