// The engine flags of the LLM commands (`generate`, `serve`, `bench decode|prefill|load|
// throughput|serve`): their values (EngineFlags), the function that adds a command's share of
// them to its CLI11 subcommand, and the one that turns them into the engine's EngineOptions.
#pragma once

#include <cstdint>

#include "CLI/CLI.hpp"
#include "absl/status/statusor.h"
#include "cli/commands.h"
#include "simpler/base/trace.h"
#include "simpler/engine/llm_engine.h"

namespace simpler::cli {

// The values of every engine-related flag. A command's defaults are the values the fields hold
// when add_engine_flags is called. Plain value, owned by the command's state; thread-compatible.
struct EngineFlags {
  // --cores, --launch-depth, --run-grant, --timeout, --graph-placement, --trace, --json,
  // --kernel-isa, --precision.
  CommonOptions common;
  // --max-num-seqs: requests running at once. 0 (accepted where it is the default): sized from
  // the command's requests (EngineLoad::requests).
  int32_t max_num_seqs = 16;
  int32_t max_num_batched_tokens = 0;  // --max-num-batched-tokens; 0: max(512, max_num_seqs)
  int32_t page_size = 16;              // --page-size, tokens per KV page
  int32_t num_pages = 0;               // --num-pages; 0: sized from the command's EngineLoad
  int32_t max_waiting = 1024;          // --max-waiting: the engine's waiting-queue capacity
  bool allow_unused_tensors = false;   // --allow-unused-tensors
  bool host_sampling = false;          // --host-sampling
  // --enable-prefix-caching / --no-enable-prefix-caching (EngineOptions::enable_prefix_caching).
  bool enable_prefix_caching = true;
  // --capture on|off (RunnerOptions::capture) and --max-captured-graphs
  // (WorkerOptions::max_captured_graphs).
  bool capture = false;
  int32_t max_captured_graphs = 64;
};

// Which engine flags a command offers. A flag whose 0 means something that depends on the
// command takes its help text here (nullptr: not offered).
struct EngineFlagSet {
  const char* max_num_seqs = nullptr;  // --max-num-seqs's help
  bool max_num_batched_tokens = false;
  bool page_size = false;
  const char* num_pages = nullptr;  // --num-pages's help: what 0 sizes
  bool max_waiting = false;
  bool allow_unused_tensors = false;
  bool host_sampling = false;
  bool prefix_caching = false;  // --enable-prefix-caching / --no-enable-prefix-caching
  bool capture = false;         // --capture on|off and --max-captured-graphs
  bool json = true;             // --json (CommonOptions::add_to)
  bool kernel_isa = true;       // --kernel-isa and --precision (CommonOptions::add_kernel_isa_to)
};

// Adds the flags of `set` to `cmd`, writing into `*flags` (which must outlive `cmd`'s parse), in
// this order: the sizing flags, --max-waiting, --allow-unused-tensors, --host-sampling,
// --enable-prefix-caching, --capture and --max-captured-graphs, then the device flags
// (CommonOptions). A default other than 0 is shown
// in the help; a 0 is explained by the flag's help instead.
void add_engine_flags(CLI::App* cmd, EngineFlags* flags, const EngineFlagSet& set);

// What a command knows about its load, for the sizing flags left at 0.
struct EngineLoad {
  // --max-num-seqs 0: this many requests run at once (clamped to [1, 256]), and at least
  // `together` (the choices of one prompt, which run at once: OpenAI's n).
  int64_t requests = 1;
  int64_t together = 1;
  // --num-pages 0: this many pages when > 0; else max_num_seqs requests of `request_tokens`
  // tokens each (when > 0); else the runner's default.
  int64_t pages = 0;
  int64_t request_tokens = 0;
};

// The engine options of `flags`: the worker (tracing into `trace` when --trace was given), the
// kernels, the KV pool and the batch limits, the flags left at 0 sized from `load`, and
// max_waiting. The caller sets the tokenizer, record_steps and a max_waiting of its own.
// INVALID_ARGUMENT naming both flags when --max-num-batched-tokens is below --max-num-seqs, and
// when a --max-num-seqs given is below load.together (a prompt's choices could never run).
absl::StatusOr<llm::EngineOptions> engine_options(const EngineFlags& flags, const EngineLoad& load,
                                                  base::TraceRecorder* trace);

}  // namespace simpler::cli
