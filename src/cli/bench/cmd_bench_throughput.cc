// `simpler bench throughput`: serving throughput of LlmEngine on a random workload, the shape of
// vLLM's benchmark_throughput / benchmark_serving.
//
// The workload: --num-prompts requests, each with an input length and an output length drawn
// uniformly from --input-len-range / --output-len-range and random token ids, all determined by
// --seed. Every request is greedy with ignore_eos and max_tokens = its output length, so it
// produces exactly that many tokens. (Uniform requests: --input-len-range A:A
// --output-len-range B:B.)
//
// Two runs of that workload, each on a fresh engine with the same options:
//   * continuous: requests arrive at --request-rate (all at once by default, else Poisson
//     arrivals seeded from --seed; the caller's thread sleeps until each arrival) and the engine
//     batches them continuously; timed from the first arrival to the last final event;
//   * static: batches of --max-num-seqs requests, the next batch submitted when every request of
//     the previous one finished (each batch waits for its longest member).
// Reported: output tokens/s of both and their ratio, requests/s, TTFT, inter-token latency and
// TPOT percentiles, preemptions and errors of the continuous run.
//
// --workload multi-turn instead: --num-prompts conversations of --turns turns sharing one
// --system-prompt-len system prompt (bench_multi_turn.h), run twice on fresh engines, with
// prefix caching off and on; reported per turn: TTFT p50 / p99 and the prompt tokens served from
// the cache, and the output tokens/s of both runs.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "cli/bench/bench_commands.h"
#include "cli/bench/bench_multi_turn.h"
#include "cli/bench/bench_workload.h"
#include "cli/commands.h"
#include "cli/engine_flags.h"
#include "nlohmann/json.hpp"
#include "simpler/base/clock.h"
#include "simpler/base/status.h"
#include "simpler/base/sync.h"
#include "simpler/base/thread_annotations.h"
#include "simpler/engine/kv_pages.h"
#include "simpler/engine/llm_engine.h"
#include "simpler/model/model_config.h"

namespace simpler::cli {

namespace {

using namespace bench;  // NOLINT: the shared workload helpers

constexpr const char* kBenchThroughputCommand = "bench throughput";

struct ThroughputState {
  std::string model;
  WorkloadFlags workload;
  int64_t ttft_probe_len = 512;
  EngineFlags engine;
};

// One run of the multi-turn workload, summarized per turn.
struct MultiTurnSummary {
  double wall_s = 0, output_tokens_per_s = 0;
  int64_t failed_turns = 0;
  std::vector<double> ttft50_ms, ttft99_ms;    // per turn
  std::vector<int64_t> prompt_tokens, cached;  // per turn, summed over conversations
  std::string first_error;
};

MultiTurnSummary summarize(const MultiTurnRun& run, int64_t turns) {
  MultiTurnSummary s;
  s.wall_s = (run.end_ns - run.start_ns) / 1e9;
  s.output_tokens_per_s = s.wall_s > 0 ? run.output_tokens / s.wall_s : 0;
  for (int64_t t = 0; t < turns; ++t) {
    std::vector<double> ttft;
    int64_t prompt = 0, cached = 0;
    for (const auto& conv : run.turns) {
      const TurnResult& r = conv[t];
      if (!r.ok) {
        if (!r.error.ok() && s.failed_turns == 0) s.first_error = r.error.ToString();
        s.failed_turns += r.error.ok() ? 0 : 1;
        continue;
      }
      ttft.push_back(r.ttft_ns / 1e6);
      prompt += r.prompt_tokens;
      cached += r.cached_tokens;
    }
    s.ttft50_ms.push_back(percentile(ttft, 0.5));
    s.ttft99_ms.push_back(percentile(ttft, 0.99));
    s.prompt_tokens.push_back(prompt);
    s.cached.push_back(cached);
  }
  return s;
}

nlohmann::json multi_turn_json(const MultiTurnSummary& s) {
  nlohmann::json turns = nlohmann::json::array();
  for (size_t t = 0; t < s.ttft50_ms.size(); ++t) {
    turns.push_back({{"turn", t},
                     {"ttft_p50_ms", s.ttft50_ms[t]},
                     {"ttft_p99_ms", s.ttft99_ms[t]},
                     {"prompt_tokens", s.prompt_tokens[t]},
                     {"cached_tokens", s.cached[t]}});
  }
  return {{"wall_s", s.wall_s},
          {"output_tokens_per_s", s.output_tokens_per_s},
          {"failed_turns", s.failed_turns},
          {"turns", turns}};
}

void print_multi_turn(const ThroughputState& st, const MultiTurnSummary& off,
                      const MultiTurnSummary& on) {
  if (st.engine.common.json) {
    nlohmann::json out = {
        {"benchmark", "throughput"},
        {"workload", "multi-turn"},
        {"conversations", st.workload.num_prompts},
        {"turns", st.workload.turns},
        {"system_prompt_len", st.workload.system_prompt_len},
        {"seed", st.workload.seed},
        {"prefix_caching_off", multi_turn_json(off)},
        {"prefix_caching_on", multi_turn_json(on)},
        {"output_tokens_per_s_on_over_off",
         off.output_tokens_per_s > 0 ? on.output_tokens_per_s / off.output_tokens_per_s : 0.0}};
    print_json_line(out);
    return;
  }
  std::printf("multi-turn: %lld conversations x %lld turns, system prompt %lld tokens\n",
              static_cast<long long>(st.workload.num_prompts),
              static_cast<long long>(st.workload.turns),
              static_cast<long long>(st.workload.system_prompt_len));
  std::printf("turn | TTFT p50 / p99 ms, cache off | cache on | prompt tokens cached (on)\n");
  for (size_t t = 0; t < on.ttft50_ms.size(); ++t) {
    std::printf("%4zu | %8.1f / %8.1f | %8.1f / %8.1f | %lld of %lld\n", t, off.ttft50_ms[t],
                off.ttft99_ms[t], on.ttft50_ms[t], on.ttft99_ms[t],
                static_cast<long long>(on.cached[t]), static_cast<long long>(on.prompt_tokens[t]));
  }
  std::printf("output tokens/s: cache off %.1f, cache on %.1f (on / off: %.2fx)\n",
              off.output_tokens_per_s, on.output_tokens_per_s,
              off.output_tokens_per_s > 0 ? on.output_tokens_per_s / off.output_tokens_per_s : 0);
}

// --workload multi-turn: the same conversations with prefix caching off, then on.
int run_multi_turn_bench(const ThroughputState& st) {
  auto config = llm::ModelConfig::load(st.model);
  if (!config.ok()) return fail(kBenchThroughputCommand, config.status());
  const WorkloadFlags& wf = st.workload;
  auto workload = make_multi_turn_workload(*config, wf.num_prompts, wf.turns, wf.system_prompt_len,
                                           wf.input_lens(), wf.output_lens(), wf.seed);
  if (!workload.ok()) return fail(kBenchThroughputCommand, workload.status());
  base::TraceRecorder trace;
  auto options = engine_options(st.engine, {.request_tokens = workload->longest}, &trace);
  if (!options.ok()) return fail(kBenchThroughputCommand, options.status());
  llm::EngineOptions eo = *std::move(options);
  eo.max_waiting = static_cast<int32_t>(std::max<int64_t>(wf.num_prompts, 1));
  MultiTurnSummary summary[2];
  for (bool caching : {false, true}) {
    eo.enable_prefix_caching = caching;
    std::cerr << "simpler " << kBenchThroughputCommand << ": multi-turn, prefix caching "
              << (caching ? "on" : "off") << "\n";
    auto run = run_multi_turn(st.model, eo, *workload);
    if (!run.ok()) return fail(kBenchThroughputCommand, run.status());
    summary[caching] = summarize(*run, st.workload.turns);
    if (summary[caching].failed_turns > 0) {
      return fail(kBenchThroughputCommand,
                  absl::InternalError(
                      absl::StrCat(summary[caching].failed_turns,
                                   " turns failed; the first: ", summary[caching].first_error)));
    }
  }
  print_multi_turn(st, summary[0], summary[1]);
  return 0;
}

// The idle-engine TTFT probe: one prompt of `len` tokens (seeded ids), one output token, on a
// fresh engine. Its TTFT against the device time of the steps that prefilled it (every step of
// the run: the prompt is alone).
struct TtftProbe {
  double ttft_ms = 0;
  double prefill_device_ms = 0;
  int64_t steps = 0;
  double ratio() const { return prefill_device_ms > 0 ? ttft_ms / prefill_device_ms : 0; }
};

// Whether a --ttft-probe-len prompt (and its one new token) fits the model: checked before the
// workload runs, so a probe the model cannot hold is refused at once.
absl::Status check_ttft_probe_len(const ThroughputState& st, const llm::ModelConfig& config) {
  if (st.ttft_probe_len == 0) return absl::OkStatus();
  const std::vector<int64_t> prompt(static_cast<size_t>(st.ttft_probe_len), 0);
  return base::annotate(config.check_request(prompt, 1), "--ttft-probe-len: ");
}

// The idle-engine TTFT probe of --ttft-probe-len (0 = none: `*probe` stays empty; its length was
// checked by check_ttft_probe_len). 0 when it ran or was skipped, else the exit code after
// printing the error.
int run_ttft_probe(const ThroughputState& st, const llm::ModelConfig& config,
                   const llm::EngineOptions& eo, const base::TraceRecorder& trace,
                   std::optional<TtftProbe>* probe) {
  if (st.ttft_probe_len == 0) return 0;
  Workload one;
  SplitMix64 ids(st.workload.seed ^ 0x9e3779b97f4a7c15ull);
  std::vector<int64_t> prompt(static_cast<size_t>(st.ttft_probe_len));
  for (int64_t& id : prompt) id = ids.uniform(0, config.vocab_size - 1);
  one.prompts.emplace_back(prompt.begin(), prompt.end());
  one.output_lens.push_back(1);
  one.arrival_offsets_ns.push_back(0);
  one.input_tokens = st.ttft_probe_len;
  one.output_tokens = 1;
  one.longest = st.ttft_probe_len + 1;
  llm::EngineOptions po = eo;
  po.runner.num_pages = static_cast<int32_t>(
      std::max<int64_t>(eo.runner.num_pages, llm::pages_needed(one.longest, eo.runner.page_size)));
  auto run = run_workload(st.model, po, one, /*static_batches=*/false, kBenchThroughputCommand);
  if (!run.ok())
    return fail_with_trace(kBenchThroughputCommand, run.status(), trace,
                           st.engine.common.trace_path);
  if (run->requests.empty() || run->requests[0].first_token_ns == 0) {
    return fail(kBenchThroughputCommand,
                absl::InternalError("the TTFT probe's request produced no token"));
  }
  TtftProbe p;
  p.ttft_ms = (run->requests[0].first_token_ns - run->requests[0].arrival_ns) / 1e6;
  for (const llm::StepRecord& r : run->steps) {
    p.prefill_device_ms += (r.device_end_ns - r.device_start_ns) / 1e6;
    ++p.steps;
  }
  *probe = p;
  return 0;
}

// Everything the benchmark prints: the workload, the engine's sizes and both runs.
struct Report {
  LenRange in, out;
  double rate = 0;
  const Workload* w = nullptr;
  int32_t seqs = 0, batched = 0, pages = 0, page_size = 0;
  const RunResult* continuous = nullptr;
  const RunResult* fixed = nullptr;
  RunStats c, s;            // of the continuous and the static run
  double ratio = 0;         // continuous / static output tokens/s
  int64_t preemptions = 0;  // of the continuous run
  double ttft50 = 0, ttft99 = 0, itl50 = 0, itl99 = 0, tpot50 = 0, tpot99 = 0, e2e50 = 0, e2e99 = 0;
  std::optional<TtftProbe> probe;
};

void print_json(const ThroughputState& st, const Report& r) {
  nlohmann::json j = {
      {"model", st.model},
      {"num_prompts", st.workload.num_prompts},
      {"input_len_range", {r.in.lo, r.in.hi}},
      {"output_len_range", {r.out.lo, r.out.hi}},
      {"request_rate", std::isfinite(r.rate) ? nlohmann::json(r.rate) : nlohmann::json(nullptr)},
      {"seed", st.workload.seed},
      {"max_num_seqs", r.seqs},
      {"max_num_batched_tokens", r.batched},
      {"page_size", r.page_size},
      {"num_pages", r.pages},
      {"launch_depth", st.engine.common.launch_depth},
      {"total_input_tokens", r.w->input_tokens},
      {"total_output_tokens", r.c.output_tokens},
      {"wall_s", r.c.wall_s},
      {"output_tokens_per_s", r.c.output_tokens_per_s},
      {"requests_per_s", r.c.requests_per_s},
      {"ttft_ms_mean", mean(r.c.ttft_ms)},
      {"ttft_ms_p50", r.ttft50},
      {"ttft_ms_p99", r.ttft99},
      {"itl_ms_mean", mean(r.c.itl_ms)},
      {"itl_ms_p50", r.itl50},
      {"itl_ms_p99", r.itl99},
      {"tpot_ms_p50", r.tpot50},
      {"tpot_ms_p99", r.tpot99},
      {"e2e_ms_p50", r.e2e50},
      {"e2e_ms_p99", r.e2e99},
      {"steps", r.c.steps},
      {"mean_rows_per_step", r.c.mean_rows_per_step},
      {"preemptions", r.preemptions},
      {"errors", r.c.errors},
      {"short_outputs", r.c.short_outputs},
      {"static_wall_s", r.s.wall_s},
      {"static_output_tokens_per_s", r.s.output_tokens_per_s},
      {"static_steps", r.s.steps},
      {"static_mean_rows_per_step", r.s.mean_rows_per_step},
      {"static_preemptions", r.fixed->metrics.preemptions_total},
      {"static_errors", r.s.errors},
      {"continuous_over_static", r.ratio},
      {"kernel_isa", llm::name_of(llm::resolve_kernel_isa(st.engine.common.kernel_isa()))}};
  if (r.probe) {
    j["ttft_probe_input_len"] = st.ttft_probe_len;
    j["ttft_probe_ms"] = r.probe->ttft_ms;
    j["ttft_probe_prefill_device_ms"] = r.probe->prefill_device_ms;
    j["ttft_probe_steps"] = r.probe->steps;
    j["ttft_probe_over_prefill_device"] = r.probe->ratio();
  }
  print_json_line(j);
}

void print_text(const ThroughputState& st, const Report& r) {
  std::printf(
      "workload: %lld prompts, input %lld..%lld, output %lld..%lld tokens (seed %llu): %lld "
      "input + %lld output tokens; request rate %s/s\n",
      static_cast<long long>(st.workload.num_prompts), static_cast<long long>(r.in.lo),
      static_cast<long long>(r.in.hi), static_cast<long long>(r.out.lo),
      static_cast<long long>(r.out.hi), static_cast<unsigned long long>(st.workload.seed),
      static_cast<long long>(r.w->input_tokens), static_cast<long long>(r.w->output_tokens),
      st.workload.request_rate.c_str());
  std::printf(
      "continuous: %lld output tokens in %.2f s = %.1f output tokens/s, %.2f requests/s; %lld "
      "steps (%.1f rows each), %lld preemptions, %lld errors\n",
      static_cast<long long>(r.c.output_tokens), r.c.wall_s, r.c.output_tokens_per_s,
      r.c.requests_per_s, static_cast<long long>(r.c.steps), r.c.mean_rows_per_step,
      static_cast<long long>(r.preemptions), static_cast<long long>(r.c.errors));
  std::printf(
      "  TTFT ms p50 %.2f p99 %.2f; ITL ms p50 %.2f p99 %.2f; TPOT ms p50 %.2f p99 %.2f; "
      "E2E ms p50 %.1f p99 %.1f\n",
      r.ttft50, r.ttft99, r.itl50, r.itl99, r.tpot50, r.tpot99, r.e2e50, r.e2e99);
  std::printf(
      "static batches of %d: %lld output tokens in %.2f s = %.1f output tokens/s; %lld steps "
      "(%.1f rows each), %lld errors\n",
      r.seqs, static_cast<long long>(r.s.output_tokens), r.s.wall_s, r.s.output_tokens_per_s,
      static_cast<long long>(r.s.steps), r.s.mean_rows_per_step,
      static_cast<long long>(r.s.errors));
  std::printf("output tokens/s, continuous / static: %.2fx\n", r.ratio);
  if (r.probe) {
    std::printf(
        "idle engine, one %lld-token prompt: first token after %.2f ms; its %lld prefill "
        "step(s) took %.2f ms of device time; TTFT / prefill device time: %.3fx\n",
        static_cast<long long>(st.ttft_probe_len), r.probe->ttft_ms,
        static_cast<long long>(r.probe->steps), r.probe->prefill_device_ms, r.probe->ratio());
  }
}

// The numbers are printed first; a request that failed, or an engine that did not close cleanly,
// makes the call fail.
int exit_code(const ThroughputState& st, const Report& r, const base::TraceRecorder& trace) {
  int rc = write_trace(trace, st.engine.common.trace_path) ? 0 : 1;
  if (r.c.short_outputs + r.s.short_outputs > 0) {
    std::cerr << "simpler " << kBenchThroughputCommand << ": " << r.c.short_outputs
              << " continuous and " << r.s.short_outputs
              << " static request(s) finished with fewer tokens than their output length\n";
  }
  auto check = [&rc](const char* name, const RunStats& stats, const RunResult& run) {
    if (stats.errors > 0) {
      std::cerr << "simpler " << kBenchThroughputCommand << ": " << name << " run: " << stats.errors
                << " request(s) failed; the first: " << stats.first_error << "\n";
      rc = 1;
    }
    if (!run.closed.ok()) {
      std::cerr << "simpler " << kBenchThroughputCommand << ": " << name
                << " run: engine shutdown: " << run.closed << "\n";
      rc = 1;
    }
  };
  check("continuous", r.c, *r.continuous);
  check("static", r.s, *r.fixed);
  return rc;
}

int run_bench_throughput(const ThroughputState& st) {
  if (st.workload.kind == "multi-turn") return run_multi_turn_bench(st);
  Report r;
  r.in = st.workload.input_lens();
  r.out = st.workload.output_lens();
  r.rate = st.workload.rate();
  auto config = llm::ModelConfig::load(st.model);
  if (!config.ok()) return fail(kBenchThroughputCommand, config.status());
  if (absl::Status ck = check_ttft_probe_len(st, *config); !ck.ok()) {
    return fail(kBenchThroughputCommand, ck);
  }
  auto workload = make_workload(*config, st.workload);
  if (!workload.ok()) return fail(kBenchThroughputCommand, workload.status());
  const Workload& w = *workload;
  r.w = &w;

  base::TraceRecorder trace;
  auto options = engine_options(st.engine, {.request_tokens = w.longest}, &trace);
  if (!options.ok()) return fail(kBenchThroughputCommand, options.status());
  llm::EngineOptions eo = *std::move(options);
  r.seqs = eo.runner.max_num_seqs;
  r.batched = eo.runner.max_num_batched_tokens;
  r.pages = eo.runner.num_pages;
  r.page_size = eo.runner.page_size;
  eo.max_waiting = static_cast<int32_t>(std::max<int64_t>(st.workload.num_prompts, 1));
  eo.record_steps = true;

  std::cerr << "simpler " << kBenchThroughputCommand << ": " << st.workload.num_prompts
            << " prompts (input " << r.in.lo << ".." << r.in.hi << ", output " << r.out.lo << ".."
            << r.out.hi << " tokens, seed " << st.workload.seed << "): " << w.input_tokens
            << " input + " << w.output_tokens << " output tokens; request rate "
            << st.workload.request_rate << "/s, max_num_seqs " << r.seqs
            << ", max_num_batched_tokens " << r.batched << ", " << r.pages << " KV pages of "
            << r.page_size << " tokens\n";

  auto continuous =
      run_workload(st.model, eo, w, /*static_batches=*/false, kBenchThroughputCommand);
  if (!continuous.ok()) {
    return fail_with_trace(kBenchThroughputCommand, continuous.status(), trace,
                           st.engine.common.trace_path);
  }
  r.continuous = &*continuous;
  r.c = run_stats(*continuous, w);
  std::cerr << "simpler " << kBenchThroughputCommand << ": continuous run: " << r.c.wall_s
            << " s (engine loaded in " << continuous->load_s << " s)\n";
  auto fixed = run_workload(st.model, eo, w, /*static_batches=*/true, kBenchThroughputCommand);
  if (!fixed.ok()) {
    return fail_with_trace(kBenchThroughputCommand, fixed.status(), trace,
                           st.engine.common.trace_path);
  }
  r.fixed = &*fixed;
  r.s = run_stats(*fixed, w);
  std::cerr << "simpler " << kBenchThroughputCommand << ": static run: " << r.s.wall_s << " s\n";

  r.ratio = r.s.output_tokens_per_s > 0 ? r.c.output_tokens_per_s / r.s.output_tokens_per_s : 0;
  if (int rc = run_ttft_probe(st, *config, eo, trace, &r.probe); rc != 0) return rc;
  r.preemptions = continuous->metrics.preemptions_total;
  r.ttft50 = percentile(r.c.ttft_ms, 0.5), r.ttft99 = percentile(r.c.ttft_ms, 0.99);
  r.itl50 = percentile(r.c.itl_ms, 0.5), r.itl99 = percentile(r.c.itl_ms, 0.99);
  r.tpot50 = percentile(r.c.tpot_ms, 0.5), r.tpot99 = percentile(r.c.tpot_ms, 0.99);
  r.e2e50 = percentile(r.c.e2e_ms, 0.5), r.e2e99 = percentile(r.c.e2e_ms, 0.99);
  if (st.engine.common.json) {
    print_json(st, r);
  } else {
    print_text(st, r);
  }
  return exit_code(st, r, trace);
}

}  // namespace

Runner add_bench_throughput_command(CLI::App* bench) {
  auto st = std::make_shared<ThroughputState>();
  auto* cmd = add_model_command(
      bench, "throughput",
      "serving throughput on a random workload: continuous batching vs static batches", &st->model);
  add_workload_flags(cmd, &st->workload, "the static run ignores it", /*multi_turn=*/true);
  cmd->add_option("--ttft-probe-len", st->ttft_probe_len,
                  "then one prompt of this many tokens on an idle engine: its time to first token "
                  "against the device time of its prefill steps (0 = skip)")
      ->check(int_in(0, std::numeric_limits<int32_t>::max()))
      ->capture_default_str();
  add_engine_flags(cmd, &st->engine,
                   {.max_num_seqs = "requests running at once; also the static batch size",
                    .max_num_batched_tokens = true,
                    .page_size = true,
                    .num_pages = "KV cache pages (0 = max-num-seqs requests of the workload's "
                                 "longest input + output at once)",
                    .allow_unused_tensors = true,
                    .prefix_caching = true});
  return run_if_parsed(cmd, st, run_bench_throughput);
}

}  // namespace simpler::cli
