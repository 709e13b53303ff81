// `simpler bench decode`: decode step time and weight bandwidth, one row per batch size, against
// the read-bandwidth probe (and PyTorch or llama.cpp with --compare).
#include <algorithm>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "cli/bench/bench_commands.h"
#include "cli/bench/bench_llamacpp.h"
#include "cli/bench/bench_probes.h"
#include "cli/bench/bench_stats.h"
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
#include "simpler/engine/model_files.h"
#include "simpler/model/model_config.h"

namespace simpler::cli {

namespace {

constexpr const char* kBenchDecodeCommand = "bench decode";
// The read probe's buffer: the checkpoint's size, but at least this many bytes (a small model's
// would fit in the caches and read faster than memory).
constexpr uint64_t kMinProbeBytes = uint64_t{64} << 20;

struct DecodeFlags {
  std::string model;
  int steps = 32;
  // Cached positions each request decodes after: its prompt's length, prefilled before the timed
  // steps (0: a one-token prompt).
  int context = 0;
  std::vector<int> batches{1};
  std::string compare;
  // --capture: a row per batch and value, in this order ("on": RunnerOptions::capture).
  std::vector<std::string> capture{"off"};
  // Unreported rows (the first batch and capture) run before the rows printed: 0 or 1.
  int warm_up_rows = 1;
  // The --capture list runs this many times per batch, alternated in one process (on,off,on,off,
  // ...), and a summary line per batch gives each mode's medians over its rows and their ratio.
  int repeat = 1;
  EngineFlags engine;
};

// The read-bandwidth probe just before and just after a row (each the best of its passes): the
// machine's memory bandwidth moves while a process runs (shared VMs: 17-42 GB/s within minutes
// on the 2-vCPU Zen 5 VM), so a row is held against the probes beside it, not against one taken
// at the start. The fraction uses the higher of the two: never in the row's favour.
struct ReadProbes {
  double before = 0, after = 0;
  double bytes_per_s() const { return std::max(before, after); }
};

// One row: the steady-state decode steps of `batch` requests (every step after the ones that
// prefilled the prompts: one token, or --context tokens). Wall time per step from their span
// (steps overlap at depth >= 2); device time per step as their median.
struct DecodeRow {
  int batch = 0;
  bool capture = false;
  int64_t decode_steps = 0;
  double step_ms = 0;
  double device_ms = 0;  // p50
  double tokens_per_s = 0;
  uint64_t weight_bytes = 0;  // per step
  double weight_bytes_per_s = 0;
  // K and V bytes the attention reads a step, at the steps' mean context (f32 pools).
  uint64_t kv_bytes = 0;
  double read_bytes_per_s = 0;  // (weights + K and V) per device step
  double gflops = 0;
  double prepare_us = 0;   // host prepare per step, p50
  double ns_per_task = 0;  // device time per task, p50 over the steps
  // Host turnaround, p50: from a decode step's device end to the next step's device start (the
  // retire, collect, schedule and submit between them; 0 at depth >= 2 when the next step was
  // already queued).
  double turnaround_us = 0;
  // The p50 of the retire-to-retire intervals of the decode steps: step_ms without the tail of
  // steps a loaded machine preempted (and without the few steps that captured a graph).
  double step_p50_ms = 0;
  DepthStats depth;
  // Set after the row ran: the probes beside it, and our tokens/s over llama.cpp's run just after
  // it (0 without --compare llama.cpp).
  ReadProbes probes;
  double over_llamacpp = 0;
  // The bytes a step reads (weights, K and V) per second over the probes' (the higher of the two).
  double fraction_of_read() const { return read_bytes_per_s / probes.bytes_per_s(); }
};

// Host prepare µs and device ns per task of the decode steps (all but the first).
void add_step_costs(const std::vector<llm::StepRecord>& records, DecodeRow* row) {
  std::vector<double> prepare_us, ns_per_task;
  for (size_t i = 1; i < records.size(); ++i) {
    prepare_us.push_back(records[i].prepare_ns / 1e3);
    if (records[i].tasks > 0) {
      ns_per_task.push_back(
          static_cast<double>(records[i].device_end_ns - records[i].device_start_ns) /
          static_cast<double>(records[i].tasks));
    }
  }
  row->prepare_us = percentile(std::move(prepare_us), 0.5);
  row->ns_per_task = percentile(std::move(ns_per_task), 0.5);
  std::vector<double> turnaround_us;
  for (size_t i = 2; i < records.size(); ++i) {
    const int64_t gap = records[i].device_start_ns - records[i - 1].device_end_ns;
    turnaround_us.push_back(static_cast<double>(std::max<int64_t>(gap, 0)) / 1e3);
  }
  row->turnaround_us = percentile(std::move(turnaround_us), 0.5);
  std::vector<double> step_ms;
  for (size_t i = 2; i < records.size(); ++i) {
    step_ms.push_back(static_cast<double>(records[i].retire_ns - records[i - 1].retire_ns) / 1e6);
  }
  row->step_p50_ms = percentile(std::move(step_ms), 0.5);
}

// The records of the decode steps: the last run of steps in which each of the `batch` rows fed
// one token (rows == tokens == batch), after the step before it, which stays first as the base of
// the first decode step's time (the step that fed the prompt's last tokens). A prompt of
// --context tokens takes steps of its own before them, and the copies of a request (batch > 1)
// start a step after the first copy (they wait for its prompt's pages) and end a step after it.
// With no such run, every record.
std::vector<llm::StepRecord> decode_records(std::vector<llm::StepRecord> records, int64_t batch) {
  auto full = [batch](const llm::StepRecord& r) { return r.rows == batch && r.tokens == batch; };
  size_t end = records.size();
  while (end > 0 && !full(records[end - 1])) --end;
  size_t begin = end;
  while (begin > 0 && full(records[begin - 1])) --begin;
  if (end == 0) return records;
  if (begin > 0) --begin;  // the step before the run
  return {records.begin() + static_cast<std::ptrdiff_t>(begin),
          records.begin() + static_cast<std::ptrdiff_t>(end)};
}

// K and V bytes a step's attention reads at `positions` cached positions in all (f32 pools).
uint64_t kv_bytes_per_step(const llm::ModelConfig& c, double positions) {
  return static_cast<uint64_t>(2.0 * static_cast<double>(c.num_hidden_layers) *
                               static_cast<double>(c.kv_size()) * sizeof(float) * positions);
}

// Runs `batch` greedy requests of a prompt of max(1, --context) tokens for --steps steps on a
// fresh engine.
absl::StatusOr<DecodeRow> run_decode_row(const DecodeFlags& st, const llm::ModelConfig& config,
                                         int batch, bool capture, base::TraceRecorder* trace) {
  EngineFlags row_flags = st.engine;
  row_flags.capture = capture;
  row_flags.max_num_seqs = batch;
  const int prompt = std::max(st.context, 1);
  row_flags.max_num_batched_tokens = std::max(batch, st.context > 0 ? 512 : 16);
  row_flags.num_pages =
      static_cast<int32_t>(batch * llm::pages_needed(prompt + st.steps, row_flags.page_size));
  SIMPLER_ASSIGN_OR_RETURN(llm::EngineOptions eo, engine_options(row_flags, {}, trace));
  eo.record_steps = true;
  eo.max_waiting = batch;
  SIMPLER_ASSIGN_OR_RETURN(std::unique_ptr<llm::LlmEngine> engine,
                           llm::LlmEngine::create(st.model, eo));
  llm::RequestSpec spec;
  spec.prompt_ids = bench::synthetic_prompt(prompt, config.vocab_size, 100);
  spec.max_tokens = st.steps;
  spec.n = batch;
  spec.sampling.temperature = 0;
  spec.sampling.ignore_eos = true;
  std::vector<llm::RequestSpec> specs;
  specs.push_back(std::move(spec));
  RequestRun run = run_requests({engine.get()}, std::move(specs), kBenchDecodeCommand, false);
  const std::vector<llm::StepRecord> records = decode_records(engine->step_records(), batch);
  DecodeRow row;
  row.batch = batch;
  row.capture = capture;
  add_step_costs(records, &row);
  row.weight_bytes = engine->weight_bytes_per_step();
  absl::Status closed = engine->shutdown(base::Deadline::poll());
  for (const ChoiceResult& c : run.results[0]) {
    if (!c.error.ok()) return c.error;
  }
  if (!closed.ok()) return closed;
  engine.reset();
  std::vector<double> device_us;
  for (size_t i = 1; i < records.size(); ++i) {
    device_us.push_back((records[i].device_end_ns - records[i].device_start_ns) / 1e3);
  }
  if (device_us.empty()) device_us.push_back(0);
  std::sort(device_us.begin(), device_us.end());
  row.decode_steps = std::max<int64_t>(1, static_cast<int64_t>(records.size()) - 1);
  const double decode_ms =
      records.size() > 1 ? (records.back().retire_ns - records.front().retire_ns) / 1e6 : 0;
  row.step_ms = decode_ms / row.decode_steps;
  row.device_ms = device_us[device_us.size() / 2] / 1e3;
  row.tokens_per_s = decode_ms > 0 ? batch * row.decode_steps / (decode_ms / 1e3) : 0;
  row.weight_bytes_per_s = row.device_ms > 0 ? row.weight_bytes / (row.device_ms / 1e3) : 0;
  // Decode step i (from 0) attends prompt + 1 + i positions a row (the copies, a step behind,
  // one fewer: ignored). The rows are copies of one request (RequestSpec::n): with prefix
  // caching they share the full pages of its prompt (docs/design/prefix_cache.md). Each row's
  // attention reads them (a row's own last page puts it in a tile of its own), but the copies
  // read the same layer's pages one after another, from the caches, so as bytes from memory
  // they count once; the rest counts per row.
  const int page = row_flags.page_size;
  const double shared =
      batch > 1 && row_flags.enable_prefix_caching ? static_cast<double>(prompt / page * page) : 0;
  row.kv_bytes = kv_bytes_per_step(
      config,
      shared + batch * (prompt - shared + 1 + (static_cast<double>(row.decode_steps) - 1) / 2));
  row.read_bytes_per_s =
      row.device_ms > 0 ? (row.weight_bytes + row.kv_bytes) / (row.device_ms / 1e3) : 0;
  row.gflops = row.device_ms > 0
                   ? 2.0 * batch * matrix_macs_per_row(config) / (row.device_ms / 1e3) / 1e9
                   : 0;
  row.depth = depth_stats(records);
  return row;
}

nlohmann::json decode_row_json(const DecodeFlags& st, const DecodeRow& row) {
  const ReadProbes& probes = row.probes;
  const CommonOptions& common = st.engine.common;
  return {{"model", st.model},
          {"batch", row.batch},
          {"capture", row.capture ? "on" : "off"},
          {"prepare_us_p50", row.prepare_us},
          {"ns_per_task_p50", row.ns_per_task},
          {"turnaround_us_p50", row.turnaround_us},
          {"step_ms_p50", row.step_p50_ms},
          {"steps", st.steps},
          {"decode_steps", row.decode_steps},
          {"context", st.context},
          {"launch_depth", common.launch_depth},
          {"kernel_isa", llm::name_of(llm::resolve_kernel_isa(common.kernel_isa()))},
          {"precision",
           llm::name_of(llm::effective_precision(common.kernel_isa(), common.precision()))},
          {"step_ms", row.step_ms},
          {"device_step_ms_p50", row.device_ms},
          {"effective_depth", row.depth.effective_depth},
          {"tokens_per_s", row.tokens_per_s},
          {"weight_bytes_per_step", row.weight_bytes},
          {"weight_gb_per_s", row.weight_bytes_per_s / 1e9},
          {"kv_bytes_per_step", row.kv_bytes},
          {"read_bytes_gb_per_s", row.read_bytes_per_s / 1e9},
          {"read_gb_per_s", probes.bytes_per_s() / 1e9},
          {"read_gb_per_s_before", probes.before / 1e9},
          {"read_gb_per_s_after", probes.after / 1e9},
          {"fraction_of_read_bandwidth", row.fraction_of_read()},
          {"gflop_per_s", row.gflops}};
}

// The peers' figures of the row, added to `out`: PyTorch eager (every hardware thread) with
// --compare torch, llama.cpp on `threads` threads when `peer` is set (and the row's
// over_llamacpp).
absl::Status add_peer_figures(const DecodeFlags& st, DecodeRow& row, LlamaCppPeer* peer,
                              int threads, nlohmann::json* out) {
  if (st.compare == "torch") {
    SIMPLER_RETURN_IF_ERROR(add_torch_figures(
        st.model, {"--batch", std::to_string(row.batch), "--steps", std::to_string(st.steps - 1)},
        "decode_step_ms", "torch_step_ms", row.step_ms, out));
  }
  if (peer != nullptr) {
    SIMPLER_ASSIGN_OR_RETURN(
        double theirs, peer->decode_tokens_per_s(row.batch, static_cast<int>(row.decode_steps),
                                                 threads, st.context));
    add_llamacpp_figures(*peer, theirs, row.tokens_per_s, out);
    row.over_llamacpp = row.tokens_per_s / theirs;
  }
  return absl::OkStatus();
}

void print_decode_row(const DecodeFlags& st, const DecodeRow& row, const LlamaCppPeer* peer,
                      int threads, const nlohmann::json& out) {
  const CommonOptions& common = st.engine.common;
  if (common.json) return print_json_line(out);
  const ReadProbes& probes = row.probes;
  std::printf(
      "decode: batch %d on %s, depth %d (effective %.2f), capture %s, context %d: step %.3f ms "
      "(p50 %.3f ms; device %.3f ms, %.0f ns a task; host prepare %.1f us; turnaround %.1f us), "
      "%.1f tokens/s, %.1f GFLOP/s; weights %.1f MB + K and V %.1f MB a step read at %.2f GB/s = "
      "%.1f%% of the read-bandwidth probe's %.2f GB/s (the higher of %.2f before the row and %.2f "
      "after it)\n",
      row.batch, llm::name_of(llm::resolve_kernel_isa(common.kernel_isa())), common.launch_depth,
      row.depth.effective_depth, row.capture ? "on" : "off", st.context, row.step_ms,
      row.step_p50_ms, row.device_ms, row.ns_per_task, row.prepare_us, row.turnaround_us,
      row.tokens_per_s, row.gflops, row.weight_bytes / 1e6, row.kv_bytes / 1e6,
      row.read_bytes_per_s / 1e9, 100 * row.fraction_of_read(), probes.bytes_per_s() / 1e9,
      probes.before / 1e9, probes.after / 1e9);
  if (row.fraction_of_read() > 1) {
    // A small model: its bytes stay in the CPU's caches from step to step, while the probe reads
    // at least kMinProbeBytes, from memory where that is larger than the caches.
    std::printf(
        "  (over 100%%: the %.1f MB a step reads stay in the CPU caches between steps; the probe "
        "reads at least %llu MiB, so this row says nothing about memory bandwidth)\n",
        (row.weight_bytes + row.kv_bytes) / 1e6,
        static_cast<unsigned long long>(kMinProbeBytes >> 20));
  }
  if (st.compare == "torch") print_torch_line(out, "torch_step_ms", 3, " per step");
  print_llamacpp_line(peer, threads, out);
}

// The medians of one capture mode's rows (step p50, device, turnaround, the fraction of the read
// probe, the ratio to llama.cpp: 0 where no row has one), 0s when it has none.
struct ModeMedians {
  int rows = 0;
  double step_ms = 0, device_ms = 0, turnaround_us = 0, fraction_of_read = 0, over_llamacpp = 0;
};
ModeMedians mode_medians(const std::vector<DecodeRow>& rows, bool capture) {
  std::vector<double> step, device, turnaround, fraction, over;
  for (const DecodeRow& r : rows) {
    if (r.capture != capture) continue;
    step.push_back(r.step_p50_ms);
    device.push_back(r.device_ms);
    turnaround.push_back(r.turnaround_us);
    fraction.push_back(r.fraction_of_read());
    if (r.over_llamacpp > 0) over.push_back(r.over_llamacpp);
  }
  return {static_cast<int>(step.size()),        percentile(std::move(step), 0.5),
          percentile(std::move(device), 0.5),   percentile(std::move(turnaround), 0.5),
          percentile(std::move(fraction), 0.5), percentile(std::move(over), 0.5)};
}

// One mode's medians as the summary's JSON.
nlohmann::json mode_json(const ModeMedians& m) {
  nlohmann::json j = {{"rows", m.rows},
                      {"step_ms_p50", m.step_ms},
                      {"device_step_ms_p50", m.device_ms},
                      {"turnaround_us_p50", m.turnaround_us},
                      {"fraction_of_read_bandwidth_p50", m.fraction_of_read}};
  if (m.over_llamacpp > 0) j["over_llamacpp_p50"] = m.over_llamacpp;
  return j;
}

// " a% of the read probe[, b× llama.cpp]" of one mode's medians, for the text summary.
std::string mode_text(const ModeMedians& m) {
  std::string t = absl::StrFormat(", %.1f%% of the read probe", 100 * m.fraction_of_read);
  if (m.over_llamacpp > 0) absl::StrAppendFormat(&t, ", %.2fx llama.cpp", m.over_llamacpp);
  return t;
}

// --repeat: one line per batch with each mode's medians over its rows and, when both modes ran,
// how many times faster replay's step and device step are than capture off's (> 1: replay wins).
void print_repeat_summary(const DecodeFlags& st, int batch, const std::vector<DecodeRow>& rows) {
  const ModeMedians on = mode_medians(rows, true), off = mode_medians(rows, false);
  const double step_ratio = on.step_ms > 0 && off.rows > 0 ? off.step_ms / on.step_ms : 0;
  const double device_ratio = on.device_ms > 0 && off.rows > 0 ? off.device_ms / on.device_ms : 0;
  if (st.engine.common.json) {
    return print_json_line({{"summary", "capture"},
                            {"batch", batch},
                            {"repeat", st.repeat},
                            {"on", mode_json(on)},
                            {"off", mode_json(off)},
                            {"replay_step_speedup", step_ratio},
                            {"replay_device_speedup", device_ratio}});
  }
  std::string modes;
  for (const auto& [name, m] : {std::pair{"on", on}, std::pair{"off", off}}) {
    if (m.rows == 0) continue;
    absl::StrAppendFormat(&modes,
                          "%scapture %s step p50 %.3f ms (device %.3f ms, turnaround %.1f us%s) "
                          "over %d rows",
                          modes.empty() ? "" : ", ", name, m.step_ms, m.device_ms, m.turnaround_us,
                          mode_text(m), m.rows);
  }
  if (on.rows > 0 && off.rows > 0) {
    absl::StrAppendFormat(&modes, ": replay %.2fx the speed of capture off (device %.2fx)",
                          step_ratio, device_ratio);
  }
  std::printf("decode summary: batch %d, %d rounds alternated: %s\n", batch, st.repeat,
              modes.c_str());
}

int run_bench_decode(const DecodeFlags& st) {
  const CommonOptions& common = st.engine.common;
  if (st.context > 0 && st.compare == "torch") {  // its script decodes after one token only
    return fail(kBenchDecodeCommand,
                absl::InvalidArgumentError(absl::StrCat(
                    "--compare torch decodes after a one-token prompt only, so it cannot be held "
                    "against --context ",
                    st.context,
                    "; compare with llama.cpp (--compare llama.cpp) or leave out "
                    "--compare")));
  }
  base::TraceRecorder trace;
  // The steps must fit the model's positions before the KV pool is sized for them.
  auto config = load_config_for(st.model, /*prompt_lens=*/{std::max(st.context, 1)}, st.steps,
                                st.context > 0 ? "--context and --steps" : "--steps");
  if (!config.ok()) return fail(kBenchDecodeCommand, config.status());
  // The peer's threads are ours (the sim device's cores: --cores, 0 = every hardware thread).
  const int threads = common.cores > 0 ? common.cores : base::hardware_threads();
  absl::StatusOr<std::optional<LlamaCppPeer>> peer =
      prepare_peer_if_compared(st.compare, st.model, common.kernel_isa());
  if (!peer.ok()) return fail(kBenchDecodeCommand, peer.status());
  // The read bandwidth, sized like the weights in the checkpoint's dtype (what a step reads),
  // measured just before and just after each row (ReadProbes).
  const uint64_t probe_bytes =
      std::max<uint64_t>(files_bytes(llm::model_checkpoint_files(st.model)), kMinProbeBytes);
  // A warm-up row, not reported (--warm-up-rows): the first engine of a process ran its steps
  // about 3x slower than the rows after it, in either capture mode (docs/design/capture_replay.md).
  base::TraceRecorder warmup_trace;
  for (int i = 0; i < st.warm_up_rows; ++i) {
    if (absl::StatusOr<DecodeRow> warm = run_decode_row(st, *config, st.batches.front(),
                                                        st.capture.front() == "on", &warmup_trace);
        !warm.ok()) {
      return fail(kBenchDecodeCommand, warm.status());
    }
  }
  for (int batch : st.batches) {
    std::vector<DecodeRow> rows;
    for (int r = 0; r < st.repeat; ++r) {
      for (const std::string& capture : st.capture) {
        absl::StatusOr<double> before = read_bandwidth_bytes_per_s(probe_bytes);
        if (!before.ok()) return fail(kBenchDecodeCommand, before.status());
        absl::StatusOr<DecodeRow> row = run_decode_row(st, *config, batch, capture == "on", &trace);
        if (!row.ok())
          return fail_with_trace(kBenchDecodeCommand, row.status(), trace, common.trace_path);
        absl::StatusOr<double> after = read_bandwidth_bytes_per_s(probe_bytes);
        if (!after.ok()) return fail(kBenchDecodeCommand, after.status());
        row->probes = {*before, *after};
        nlohmann::json out = decode_row_json(st, *row);
        LlamaCppPeer* peer_ptr = peer->has_value() ? &**peer : nullptr;
        if (absl::Status s = add_peer_figures(st, *row, peer_ptr, threads, &out); !s.ok()) {
          return fail(kBenchDecodeCommand, s);
        }
        print_decode_row(st, *row, peer_ptr, threads, out);
        rows.push_back(*row);
      }
    }
    if (st.repeat > 1) print_repeat_summary(st, batch, rows);
  }
  return write_trace(trace, common.trace_path) ? 0 : 1;
}

}  // namespace

Runner add_bench_decode_command(CLI::App* bench) {
  auto st = std::make_shared<DecodeFlags>();
  auto* cmd =
      add_model_command(bench, "decode", "decode step time and weight bandwidth", &st->model);
  // The first step feeds the prompt; the timed decode phase is the steps after it.
  cmd->add_option("--steps", st->steps, "steps to run (>= 2; the steps after the first are timed)")
      ->check(int_in(2, kMaxRepeats))
      ->capture_default_str();
  cmd->add_option("--context", st->context,
                  "cached positions each request decodes after: a prompt of that many tokens is "
                  "prefilled first, untimed (0: a one-token prompt); llama.cpp decodes at the same "
                  "depth (llama-bench -d, llama-batched-bench -npp), and the step's K and V reads "
                  "count in its bandwidth")
      ->check(int_in(0, 1 << 20))
      ->capture_default_str();
  cmd->add_option("--batch", st->batches, "requests per step; a comma list runs one row each")
      ->delimiter(',')
      ->check(int_in(1, kMaxRequests))
      ->capture_default_str();
  add_compare_flag(cmd, &st->compare, "the checkpoint", "llama-bench / llama-batched-bench",
                   "batch and steps (and, for llama.cpp, --context)");
  cmd->add_option("--capture", st->capture,
                  "capture the step program per step shape and replay it (on|off; a comma list "
                  "runs one row each, e.g. on,off)")
      ->delimiter(',')
      ->check(CLI::IsMember({"on", "off"}))
      ->capture_default_str();
  cmd->add_option("--warm-up-rows", st->warm_up_rows,
                  "unreported rows of the first batch and capture mode run first (0 or 1)")
      ->check(int_in(0, 1))
      ->capture_default_str();
  cmd->add_option("--repeat", st->repeat,
                  "run the --capture list this many times per batch, alternated in one process, "
                  "and print each mode's medians over its rows (a summary line per batch: step, "
                  "device step, turnaround, the fraction of the read probe and, with --compare "
                  "llama.cpp, run after each row, the ratio to it)")
      ->check(int_in(1, 64))
      ->capture_default_str();
  cmd->add_option("--max-captured-graphs", st->engine.max_captured_graphs,
                  "captured step graphs kept (least recently used go)")
      ->check(int_in(1, 1 << 16))
      ->capture_default_str();
  add_engine_flags(cmd, &st->engine, {.allow_unused_tensors = true});
  return run_if_parsed(cmd, st, run_bench_decode);
}

}  // namespace simpler::cli
