#include "cli/engine_flags.h"

#include <algorithm>
#include <limits>

#include "absl/strings/str_cat.h"
#include "simpler/engine/kv_pages.h"

namespace simpler::cli {

namespace {

// Shows the option's default in the help unless it is 0 (the help says what 0 sizes).
CLI::Option* show_nonzero_default(CLI::Option* option, int64_t value) {
  return value != 0 ? option->capture_default_str() : option;
}

}  // namespace

void add_engine_flags(CLI::App* cmd, EngineFlags* flags, const EngineFlagSet& set) {
  constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();
  if (set.max_num_seqs != nullptr) {
    const int64_t lo = flags->max_num_seqs == 0 ? 0 : 1;
    show_nonzero_default(cmd->add_option("--max-num-seqs", flags->max_num_seqs, set.max_num_seqs)
                             ->check(int_in(lo, kMaxRequests)),
                         flags->max_num_seqs);
  }
  if (set.max_num_batched_tokens) {
    show_nonzero_default(
        cmd->add_option("--max-num-batched-tokens", flags->max_num_batched_tokens,
                        "token budget per step: prompt chunks and decode rows (0 = max(512, "
                        "max-num-seqs))")
            ->check(int_in(0, kMaxBatchedTokens)),
        flags->max_num_batched_tokens);
  }
  if (set.page_size) {
    show_nonzero_default(
        cmd->add_option("--page-size", flags->page_size, "KV cache page size in tokens")
            ->check(int_in(1, kMaxPageSize)),
        flags->page_size);
  }
  if (set.num_pages != nullptr) {
    show_nonzero_default(cmd->add_option("--num-pages", flags->num_pages, set.num_pages)
                             ->check(int_in(0, kInt32Max)),
                         flags->num_pages);
  }
  if (set.max_waiting) {
    show_nonzero_default(
        cmd->add_option("--max-waiting", flags->max_waiting, "waiting requests before 429")
            ->check(int_in(1, 1 << 20)),
        flags->max_waiting);
  }
  if (set.allow_unused_tensors) {
    cmd->add_flag("--allow-unused-tensors", flags->allow_unused_tensors,
                  "accept a checkpoint holding tensors the config does not use (extra heads)");
  }
  if (set.host_sampling) {
    cmd->add_flag("--host-sampling", flags->host_sampling,
                  "sample on the host from logits read back every step (falls back to serial "
                  "launch: the next step needs the host's token first)");
  }
  if (set.prefix_caching) {
    cmd->add_flag("--enable-prefix-caching,!--no-enable-prefix-caching",
                  flags->enable_prefix_caching,
                  "reuse the KV pages of earlier requests whose tokens start the same way "
                  "(default on; the {false} shown is --no-enable-prefix-caching's value; "
                  "docs/design/prefix_cache.md); the tokens are the same either way")
        ->capture_default_str();
  }
  if (set.capture) {
    cmd->add_option_function<std::string>(
           "--capture", [flags](const std::string& v) { flags->capture = v == "on"; },
           "capture the step program once per step shape and replay it (default off: it is not "
           "shown to win yet; docs/design/capture_replay.md); the tokens are the same either way")
        ->check(CLI::IsMember({"on", "off"}))
        ->default_str("off");
    show_nonzero_default(cmd->add_option("--max-captured-graphs", flags->max_captured_graphs,
                                         "captured step graphs kept (least recently used go)")
                             ->check(int_in(1, 1 << 16)),
                         flags->max_captured_graphs);
  }
  flags->common.add_to(cmd, set.json);
  if (set.kernel_isa) flags->common.add_kernel_isa_to(cmd);
}

absl::StatusOr<llm::EngineOptions> engine_options(const EngineFlags& flags, const EngineLoad& load,
                                                  base::TraceRecorder* trace) {
  constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();
  llm::EngineOptions eo;
  llm::RunnerOptions& ro = eo.runner;
  ro.worker = flags.common.worker_options(trace);
  ro.kernel_isa = flags.common.kernel_isa();
  ro.precision = flags.common.precision();
  ro.page_size = flags.page_size;
  ro.allow_unused_tensors = flags.allow_unused_tensors;
  ro.host_sampling = flags.host_sampling;
  ro.capture = flags.capture;
  ro.worker.max_captured_graphs = flags.max_captured_graphs;
  if (flags.max_num_seqs > 0 && flags.max_num_seqs < load.together) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max-num-seqs ", flags.max_num_seqs, " is below the ", load.together,
                     " choices of a prompt (-n/--requests), which run at once"));
  }
  ro.max_num_seqs =
      flags.max_num_seqs > 0
          ? flags.max_num_seqs
          : static_cast<int32_t>(std::max(std::clamp<int64_t>(load.requests, 1, 256),
                                          std::clamp<int64_t>(load.together, 1, kMaxRequests)));
  ro.max_num_batched_tokens = flags.max_num_batched_tokens > 0 ? flags.max_num_batched_tokens
                                                               : std::max(512, ro.max_num_seqs);
  if (ro.max_num_batched_tokens < ro.max_num_seqs) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--max-num-batched-tokens ", ro.max_num_batched_tokens, " is below --max-num-seqs ",
        ro.max_num_seqs, " (every running request needs a row per step)"));
  }
  if (flags.num_pages > 0) {
    ro.num_pages = flags.num_pages;
  } else if (load.pages > 0) {
    ro.num_pages = static_cast<int32_t>(std::min(load.pages, kInt32Max));
  } else if (load.request_tokens > 0) {
    ro.num_pages = static_cast<int32_t>(std::min(
        ro.max_num_seqs * llm::pages_needed(load.request_tokens, ro.page_size), kInt32Max));
  }
  eo.max_waiting = flags.max_waiting;
  eo.enable_prefix_caching = flags.enable_prefix_caching;
  return eo;
}

}  // namespace simpler::cli
