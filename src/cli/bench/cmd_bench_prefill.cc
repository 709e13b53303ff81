// `simpler bench prefill`: time to first token of long prompts, one row per prompt length,
// against the measured f32 FMA peak (and the bf16 GEMM library with --precision bf16, PyTorch or
// llama.cpp with --compare).
#include <algorithm>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cli/bench/bench_commands.h"
#include "cli/bench/bench_llamacpp.h"
#include "cli/bench/bench_probes.h"
#include "cli/bench/bench_workload.h"
#include "cli/bench/model_flops.h"
#include "cli/commands.h"
#include "cli/engine_flags.h"
#include "cli/request_run.h"
#include "nlohmann/json.hpp"
#include "simpler/base/status.h"
#include "simpler/base/thread.h"
#include "simpler/engine/kv_pages.h"
#include "simpler/engine/llm_engine.h"
#include "simpler/kernels/kernels.h"
#include "simpler/model/model_config.h"

namespace simpler::cli {

namespace {

constexpr const char* kBenchPrefillCommand = "bench prefill";

struct PrefillFlags {
  std::string model;
  std::vector<int> prompt_lens{128, 512};
  std::string compare;
  EngineFlags engine;
};

// The compute limit, measured in the same process just before the rows: every hardware
// thread's FMA chains on the fastest target this CPU has (whatever target the kernels run), and
// the figure on paper.
struct ComputePeak {
  llm::KernelIsa isa;       // the kernels' target
  llm::KernelIsa peak_isa;  // the probe's
  double flop_per_s = 0;
  TheoreticalPeak paper;
  bool below_half_paper = false;
};

ComputePeak measure_compute_peak(const CommonOptions& common) {
  ComputePeak p;
  p.isa = llm::resolve_kernel_isa(common.kernel_isa());
  p.peak_isa = llm::resolve_kernel_isa(llm::KernelIsa::kAuto);
  p.flop_per_s = llm::measure_f32_fma_peak(p.peak_isa);
  p.paper = theoretical_f32_fma_peak();
  p.below_half_paper = p.paper.flop_per_s > 0 && p.flop_per_s < p.paper.flop_per_s / 2;
  return p;
}

// The time to first token of a `len`-token prompt on a fresh engine: the best of 3 prompts
// (distinct ids, so nothing is reused between them), ms.
absl::StatusOr<double> best_ttft_ms(const PrefillFlags& st, const llm::ModelConfig& config, int len,
                                    base::TraceRecorder* trace) {
  EngineFlags row_flags = st.engine;
  row_flags.max_num_seqs = 1;
  row_flags.max_num_batched_tokens = std::max(512, len);
  row_flags.num_pages = static_cast<int32_t>(llm::pages_needed(len + 1, row_flags.page_size));
  SIMPLER_ASSIGN_OR_RETURN(llm::EngineOptions eo, engine_options(row_flags, {}, trace));
  SIMPLER_ASSIGN_OR_RETURN(std::unique_ptr<llm::LlmEngine> engine,
                           llm::LlmEngine::create(st.model, eo));
  double best_ms = 1e30;
  for (int rep = 0; rep < 3; ++rep) {
    llm::RequestSpec spec;
    spec.prompt_ids = bench::synthetic_prompt(len, config.vocab_size, 100 + rep);
    spec.max_tokens = 1;
    spec.sampling.temperature = 0;
    spec.sampling.ignore_eos = true;
    std::vector<llm::RequestSpec> specs;
    specs.push_back(std::move(spec));
    RequestRun run = run_requests({engine.get()}, std::move(specs), kBenchPrefillCommand, false);
    for (const ChoiceResult& c : run.results[0]) {
      if (!c.error.ok()) return c.error;
    }
    best_ms = std::min(best_ms, (run.all_first_token_ns - run.start_ns) / 1e6);
  }
  SIMPLER_RETURN_IF_ERROR(engine->shutdown(base::Deadline::poll()));
  return best_ms;
}

nlohmann::json prefill_row_json(const PrefillFlags& st, const ComputePeak& peak, int len,
                                double best_ms, double gflops) {
  const CommonOptions& common = st.engine.common;
  const llm::Precision precision =
      llm::effective_precision(common.kernel_isa(), common.precision());
  return {{"model", st.model},
          {"prompt_len", len},
          {"kernel_isa", llm::name_of(peak.isa)},
          {"precision", llm::name_of(precision)},
          {"ttft_ms", best_ms},
          {"tokens_per_s", len / (best_ms / 1e3)},
          {"gflop_per_s", gflops},
          {"peak_gflop_per_s", peak.flop_per_s / 1e9},
          {"peak_isa", llm::name_of(peak.peak_isa)},
          {"theoretical_peak_gflop_per_s", peak.paper.flop_per_s / 1e9},
          {"theoretical_peak", peak.paper.formula},
          {"peak_below_half_theoretical", peak.below_half_paper},
          {"fraction_of_peak", gflops * 1e9 / peak.flop_per_s},
          {"fraction_of_theoretical_peak",
           peak.paper.flop_per_s > 0 ? gflops * 1e9 / peak.paper.flop_per_s : 0.0}};
}

bool is_bf16(const CommonOptions& common) {
  return llm::effective_precision(common.kernel_isa(), common.precision()) == llm::Precision::kBf16;
}

// The row's figures of the bf16 GEMM library (--precision bf16) and the peers, added to `out`.
absl::Status add_reference_figures(const PrefillFlags& st, const llm::ModelConfig& config, int len,
                                   double best_ms, double gflops, LlamaCppPeer* peer, int threads,
                                   nlohmann::json* out) {
  if (is_bf16(st.engine.common)) {
    // The bf16 GEMM library on the same shapes: one layer's projections with the prompt's rows
    // (every layer has the same shapes), every hardware thread.
    const int64_t h = config.hidden_size, I = config.intermediate_size,
                  q = config.num_attention_heads * config.head_dim,
                  kv = config.num_key_value_heads * config.head_dim;
    std::string impl;
    SIMPLER_ASSIGN_OR_RETURN(
        double lib, bf16_gemm_library_flops(
                        len, {{q, h}, {kv, h}, {kv, h}, {h, q}, {I, h}, {I, h}, {h, I}}, 0, &impl));
    (*out)["library"] = absl::StrCat("oneDNN ", impl);
    (*out)["library_gflop_per_s"] = lib / 1e9;
    (*out)["fraction_of_library"] = gflops * 1e9 / lib;
  }
  if (st.compare == "torch") {
    SIMPLER_RETURN_IF_ERROR(add_torch_figures(st.model, {"--prompt-len", std::to_string(len)},
                                              "ttft_ms", "torch_ttft_ms", best_ms, out));
  }
  if (peer != nullptr) {
    SIMPLER_ASSIGN_OR_RETURN(double theirs, peer->prefill_tokens_per_s(len, threads));
    add_llamacpp_figures(*peer, theirs, len / (best_ms / 1e3), out);
  }
  return absl::OkStatus();
}

void print_prefill_row(const PrefillFlags& st, const ComputePeak& peak, int len, double best_ms,
                       double gflops, const LlamaCppPeer* peer, int threads,
                       const nlohmann::json& out) {
  if (st.engine.common.json) return print_json_line(out);
  std::printf(
      "prefill: %d-token prompt on %s: time to first token %.1f ms (%.1f tokens/s), %.1f "
      "GFLOP/s (%.1f GFLOP, %.1f of them attention) = %.1f%% of the measured f32 FMA peak "
      "%.1f GFLOP/s (%s, every hardware thread; on paper %.1f GFLOP/s = %s: %.1f%% of it)\n",
      len, llm::name_of(peak.isa), best_ms, len / (best_ms / 1e3), gflops,
      out["gflop"].get<double>(), out["attention_gflop"].get<double>(),
      100 * gflops * 1e9 / peak.flop_per_s, peak.flop_per_s / 1e9, llm::name_of(peak.peak_isa),
      peak.paper.flop_per_s / 1e9, peak.paper.formula.c_str(),
      100 * out["fraction_of_theoretical_peak"].get<double>());
  if (is_bf16(st.engine.common)) {
    std::printf(
        "  precision bf16: %.1f%% of the bf16 GEMM library on the same shapes (%s, every "
        "hardware thread: %.1f GFLOP/s)\n",
        100 * out["fraction_of_library"].get<double>(), out["library"].get<std::string>().c_str(),
        out["library_gflop_per_s"].get<double>());
  }
  if (st.compare == "torch") print_torch_line(out, "torch_ttft_ms", 1, "");
  print_llamacpp_line(peer, threads, out);
}

int run_bench_prefill(const PrefillFlags& st) {
  const CommonOptions& common = st.engine.common;
  base::TraceRecorder trace;
  auto config = load_config_for(st.model, st.prompt_lens, 1, "--prompt-lens");
  if (!config.ok()) return fail(kBenchPrefillCommand, config.status());
  const ComputePeak peak = measure_compute_peak(common);
  const int threads = common.cores > 0 ? common.cores : base::hardware_threads();
  absl::StatusOr<std::optional<LlamaCppPeer>> peer =
      prepare_peer_if_compared(st.compare, st.model, common.kernel_isa());
  if (!peer.ok()) return fail(kBenchPrefillCommand, peer.status());
  if (peak.below_half_paper) {
    std::fprintf(stderr,
                 "bench prefill: the measured f32 FMA peak %.1f GFLOP/s is below half the "
                 "theoretical %.1f GFLOP/s (%s): the CPUs are shared, throttled or slower than "
                 "their clock says\n",
                 peak.flop_per_s / 1e9, peak.paper.flop_per_s / 1e9, peak.paper.formula.c_str());
  }
  const int64_t lm_macs = config->vocab_size * config->hidden_size;
  const int64_t layer_macs = matrix_macs_per_row(*config) - lm_macs;
  LlamaCppPeer* peer_ptr = peer->has_value() ? &**peer : nullptr;
  for (int len : st.prompt_lens) {
    absl::StatusOr<double> best_ms = best_ttft_ms(st, *config, len, &trace);
    if (!best_ms.ok())
      return fail_with_trace(kBenchPrefillCommand, best_ms.status(), trace, common.trace_path);
    // Every prompt position goes through the layers' projections and attends the positions up
    // to its own; the LM head runs for the last one only.
    const double attention_flop = 2.0 * static_cast<double>(prompt_attention_macs(*config, len));
    const double flop = 2.0 * (static_cast<double>(len) * layer_macs + lm_macs) + attention_flop;
    const double gflops = flop / (*best_ms / 1e3) / 1e9;
    nlohmann::json out = prefill_row_json(st, peak, len, *best_ms, gflops);
    out["gflop"] = flop / 1e9;
    out["attention_gflop"] = attention_flop / 1e9;
    if (absl::Status s =
            add_reference_figures(st, *config, len, *best_ms, gflops, peer_ptr, threads, &out);
        !s.ok()) {
      return fail(kBenchPrefillCommand, s);
    }
    print_prefill_row(st, peak, len, *best_ms, gflops, peer_ptr, threads, out);
  }
  return write_trace(trace, common.trace_path) ? 0 : 1;
}

}  // namespace

Runner add_bench_prefill_command(CLI::App* bench) {
  auto st = std::make_shared<PrefillFlags>();
  auto* cmd = add_model_command(
      bench, "prefill", "time to first token of long prompts, against the measured f32 FMA peak",
      &st->model);
  cmd->add_option("--prompt-lens", st->prompt_lens, "prompt lengths in tokens, one row each")
      ->delimiter(',')
      ->check(int_in(1, 1 << 16))
      ->capture_default_str();
  add_compare_flag(cmd, &st->compare, "the prompts", "llama-bench", "prompt length");
  add_engine_flags(cmd, &st->engine, {.allow_unused_tensors = true});
  return run_if_parsed(cmd, st, run_bench_prefill);
}

}  // namespace simpler::cli
