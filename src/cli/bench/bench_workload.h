// Benchmark workloads shared by `simpler bench throughput` and `bench serve` (and the synthetic
// prompts of `bench decode` and `bench prefill`): a seeded random workload (input / output lengths
// and token ids, Poisson arrivals) in the shape of vLLM's benchmarks, a run of it through a fresh
// LlmEngine (continuously or in static batches), and the latency statistics. Private to the CLI.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <iostream>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "cli/bench/bench_stats.h"
#include "cli/commands.h"
#include "simpler/base/clock.h"
#include "simpler/base/status.h"
#include "simpler/base/sync.h"
#include "simpler/base/thread_annotations.h"
#include "simpler/engine/kv_pages.h"
#include "simpler/engine/llm_engine.h"
#include "simpler/model/model_config.h"

namespace simpler::cli::bench {

// SplitMix64: the same numbers from the same seed with every standard library (the workload of a
// seed is part of a benchmark's record). Plain value; thread-compatible.
class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t seed) : state_(seed) {}
  uint64_t next() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  // Uniform in [lo, hi] (multiply-shift; the bias is below 2^-32 for spans under 2^32).
  int64_t uniform(int64_t lo, int64_t hi) {
    const uint64_t span = static_cast<uint64_t>(hi - lo) + 1;
    return lo + static_cast<int64_t>((static_cast<unsigned __int128>(next()) * span) >> 64);
  }
  // Uniform in [0, 1).
  double unit() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }

 private:
  uint64_t state_;
};

// A CLI11 check that refuses what `parse` refuses, with its message; `type_name` is how --help
// names the option's value (e.g. "A:B").
template <typename T>
CLI::Validator parse_check(absl::StatusOr<T> (*parse)(const std::string&), std::string type_name) {
  return CLI::Validator(
      [parse](std::string& text) -> std::string {
        absl::StatusOr<T> r = parse(text);
        return r.ok() ? std::string() : std::string(r.status().message());
      },
      std::move(type_name));
}

// An inclusive length range A:B with 1 <= A <= B <= int32 max.
struct LenRange {
  int64_t lo = 0, hi = 0;
};

// Parses "A:B"; the message does not name the flag (CLI11 puts it in front, callers annotate).
inline absl::StatusOr<LenRange> parse_len_range(const std::string& text) {
  std::vector<std::string> parts = absl::StrSplit(text, ':');
  constexpr int64_t kMax = std::numeric_limits<int32_t>::max();
  if (parts.size() != 2) {
    return absl::InvalidArgumentError(absl::StrCat(
        "'", text.substr(0, 40), "' is not a range A:B of token counts (e.g. 16:512)"));
  }
  LenRange r;
  if (!absl::SimpleAtoi(parts[0], &r.lo) || !absl::SimpleAtoi(parts[1], &r.hi)) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", text.substr(0, 40), "': A and B of A:B must be integers"));
  }
  if (r.lo < 1)
    return absl::InvalidArgumentError(absl::StrCat(text, ": A = ", r.lo, " is below 1"));
  if (r.hi > kMax) {
    return absl::InvalidArgumentError(
        absl::StrCat(text, ": B = ", r.hi, " is above the maximum of ", kMax));
  }
  if (r.lo > r.hi) {
    return absl::InvalidArgumentError(absl::StrCat(text, ": A = ", r.lo, " is above B = ", r.hi));
  }
  return r;
}

inline CLI::Validator len_range_check() { return parse_check(parse_len_range, "A:B"); }

// The lowest --request-rate: one request per 1000 s on average (below it a benchmark's arrivals
// would span days).
inline constexpr double kMinRequestRate = 1e-3;

// "inf" (all requests at once) or a finite rate >= kMinRequestRate, requests per second.
inline absl::StatusOr<double> parse_rate(const std::string& text) {
  if (text == "inf") return std::numeric_limits<double>::infinity();
  double v = 0;
  if (!absl::SimpleAtod(text, &v) || !std::isfinite(v) || !(v >= kMinRequestRate)) {
    return absl::InvalidArgumentError(absl::StrCat("'", text.substr(0, 40),
                                                   "' is neither inf nor a finite number of "
                                                   "requests/s of at least 0.001"));
  }
  return v;
}

inline CLI::Validator rate_check() { return parse_check(parse_rate, "RATE"); }

// The workload flags of `bench throughput` and `bench serve` as given, with vLLM's names and
// defaults. Plain value; thread-compatible.
struct WorkloadFlags {
  int64_t num_prompts = 200;
  std::string input_len_range = "16:512";
  std::string output_len_range = "16:256";
  std::string request_rate = "inf";
  uint64_t seed = 0;
  // --workload multi-turn (bench_multi_turn.h): --num-prompts conversations of --turns turns that
  // start with one --system-prompt-len system prompt; the length ranges are each user message's
  // and each answer's.
  std::string kind = "random";
  int64_t turns = 4;
  int64_t system_prompt_len = 256;

  // The parsed ranges and rate; the flags' checks (add_workload_flags) refused what does not
  // parse, so these hold values only.
  LenRange input_lens() const { return *parse_len_range(input_len_range); }
  LenRange output_lens() const { return *parse_len_range(output_len_range); }
  double rate() const { return *parse_rate(request_rate); }
};

// Adds --num-prompts, --input-len-range, --output-len-range, --request-rate and --seed to `cmd`,
// parsed into `*flags` (which must outlive the parse); `rate_note`, when not empty, ends the help
// of --request-rate (how the command uses the arrivals). With `multi_turn`, also --workload,
// --turns and --system-prompt-len.
inline void add_workload_flags(CLI::App* cmd, WorkloadFlags* flags, const std::string& rate_note,
                               bool multi_turn = false) {
  if (multi_turn) {
    cmd->add_option("--workload", flags->kind,
                    "random: independent requests; multi-turn: conversations sharing a system "
                    "prompt, run with prefix caching off and on (--num-prompts conversations; the "
                    "length ranges are each user message's and each answer's)")
        ->check(CLI::IsMember({"random", "multi-turn"}))
        ->capture_default_str();
    cmd->add_option("--turns", flags->turns, "multi-turn: turns per conversation")
        ->check(int_in(1, 1000))
        ->capture_default_str();
    cmd->add_option("--system-prompt-len", flags->system_prompt_len,
                    "multi-turn: tokens of the system prompt every conversation starts with "
                    "(bench serve: words of about one token each)")
        ->check(int_in(1, std::numeric_limits<int32_t>::max()))
        ->capture_default_str();
  }
  cmd->add_option("--num-prompts", flags->num_prompts, "requests in the workload")
      ->check(int_in(1, kMaxRequests))
      ->capture_default_str();
  cmd->add_option("--input-len-range", flags->input_len_range,
                  "prompt tokens per request, uniform in [A, B] (A:A for uniform requests)")
      ->check(len_range_check())
      ->capture_default_str();
  cmd->add_option("--output-len-range", flags->output_len_range,
                  "output tokens per request (ignore_eos, exactly this many), uniform in [A, B]")
      ->check(len_range_check())
      ->capture_default_str();
  cmd->add_option("--request-rate", flags->request_rate,
                  "arrivals, requests/s: inf = all at once, else Poisson (seeded from --seed)" +
                      (rate_note.empty() ? "" : "; " + rate_note))
      ->check(rate_check())
      ->capture_default_str();
  cmd->add_option("--seed", flags->seed, "workload seed: lengths, token ids and arrivals")
      ->check(uint64_in())
      ->capture_default_str();
}

struct Workload {
  std::vector<std::vector<int32_t>> prompts;
  std::vector<int64_t> output_lens;
  std::vector<int64_t> arrival_offsets_ns;  // from the first arrival; all 0 at rate inf
  int64_t input_tokens = 0, output_tokens = 0;
  int64_t longest = 0;  // most input + output tokens of one request
};

// A synthetic prompt of `len` token ids, (first + 7·i) mod vocab: ids spread over the
// vocabulary, and a prompt of another `first` shares no page with the last (bench decode and
// bench prefill).
inline std::vector<int32_t> synthetic_prompt(int64_t len, int64_t vocab, int64_t first) {
  std::vector<int32_t> ids(static_cast<size_t>(std::max<int64_t>(len, 0)));
  for (int64_t i = 0; i < len; ++i) {
    ids[static_cast<size_t>(i)] =
        static_cast<int32_t>((first + 7 * i) % std::max<int64_t>(vocab, 1));
  }
  return ids;
}

// The workload of `seed`, each request checked against the model's positions.
inline absl::StatusOr<Workload> make_workload(const llm::ModelConfig& config, int64_t num_prompts,
                                              LenRange in, LenRange out, double rate,
                                              uint64_t seed) {
  Workload w;
  SplitMix64 lengths(seed);
  SplitMix64 ids(seed ^ 0x5bd1e9955bd1e995ull);
  SplitMix64 arrivals(seed ^ 0x2545f4914f6cdd1dull);
  int64_t t_ns = 0;
  for (int64_t i = 0; i < num_prompts; ++i) {
    const int64_t in_len = lengths.uniform(in.lo, in.hi);
    const int64_t out_len = lengths.uniform(out.lo, out.hi);
    std::vector<int64_t> prompt(static_cast<size_t>(in_len));
    for (int64_t& id : prompt) id = ids.uniform(0, config.vocab_size - 1);
    if (absl::Status s = config.check_request(prompt, out_len); !s.ok()) {
      return base::annotate(
          s, absl::StrCat("prompt ", i, " (", in_len, " input + ", out_len,
                          " output tokens, drawn from --input-len-range ", in.lo, ":", in.hi,
                          " and --output-len-range ", out.lo, ":", out.hi, "): "));
    }
    w.prompts.emplace_back(prompt.begin(), prompt.end());  // ids < vocab_size fit int32
    w.output_lens.push_back(out_len);
    if (i > 0 && std::isfinite(rate)) {
      // Poisson arrivals: exponential gaps of mean 1/rate; the first request arrives at 0.
      t_ns += static_cast<int64_t>(-std::log(1.0 - arrivals.unit()) / rate * 1e9);
    }
    w.arrival_offsets_ns.push_back(t_ns);
    w.input_tokens += in_len;
    w.output_tokens += out_len;
    w.longest = std::max(w.longest, in_len + out_len);
  }
  return w;
}

// The workload `flags` ask for, each request checked against the model's positions.
inline absl::StatusOr<Workload> make_workload(const llm::ModelConfig& config,
                                              const WorkloadFlags& flags) {
  return make_workload(config, flags.num_prompts, flags.input_lens(), flags.output_lens(),
                       flags.rate(), flags.seed);
}

// What one request returned.
struct RequestResult {
  int64_t tokens = 0;
  std::vector<int64_t> token_times_ns;
  int64_t arrival_ns = 0, first_token_ns = 0, finished_ns = 0;
  int64_t received_ns = 0;  // when its final event reached the callback (or it was refused)
  llm::OutputFinish finish = llm::OutputFinish::kNone;
  absl::Status error;  // the refusal, or the final event's error
  bool done = false;
};

// Collects the events of one run's requests through callbacks and lets the caller's thread wait
// for a time or for a number of finished requests, printing progress at most once a second.
// Shared (shared_ptr) between the caller and the engine's output thread; thread-safe.
class Collector {
 public:
  Collector(size_t n, std::string command, std::string phase)
      : command_(std::move(command)), phase_(std::move(phase)), results_(n) {
    last_report_ns_ = base::now_ns();
  }

  static std::function<void(const llm::RequestOutput&)> callback(std::shared_ptr<Collector> c,
                                                                 size_t i) {
    return [c = std::move(c), i](const llm::RequestOutput& out) { c->on_output(i, out); };
  }

  void refused(size_t i, const absl::Status& status) {
    base::MutexLock l(mu_);
    RequestResult& r = results_[i];
    r.finish = llm::OutputFinish::kError;
    r.error = status;
    r.received_ns = base::now_ns();
    r.done = true;
    ++done_;
    cv_.notify_all();
  }

  // Waits until now_ns() >= until_ns (when until_ns > 0) or `done` requests finished.
  void wait(int64_t until_ns, int64_t done, int64_t submitted) {
    base::MutexLock l(mu_);
    while (done_ < done) {
      const int64_t now = base::now_ns();
      if (until_ns > 0 && now >= until_ns) return;
      if (now - last_report_ns_ >= 1'000'000'000) {
        last_report_ns_ = now;
        std::cerr << "simpler " << command_ << ": " << phase_ << ": " << done_ << "/"
                  << results_.size() << " requests finished, " << tokens_ << " output tokens, "
                  << (submitted - done_) << " in the engine\n";
      }
      int64_t wake = last_report_ns_ + 1'000'000'000;
      if (until_ns > 0) wake = std::min(wake, until_ns);
      cv_.wait_until(l, base::steady_time(wake));
    }
  }

  std::vector<RequestResult> take() {
    base::MutexLock l(mu_);
    return std::move(results_);
  }

 private:
  void on_output(size_t i, const llm::RequestOutput& out) {
    base::MutexLock l(mu_);
    RequestResult& r = results_[i];
    r.tokens += static_cast<int64_t>(out.token_ids.size());
    r.token_times_ns.insert(r.token_times_ns.end(), out.token_times_ns.begin(),
                            out.token_times_ns.end());
    tokens_ += static_cast<int64_t>(out.token_ids.size());
    if (!out.finished()) return;
    r.finish = out.finish;
    r.error = out.error;
    r.arrival_ns = out.arrival_ns;
    r.first_token_ns = out.first_token_ns;
    r.finished_ns = out.finished_ns;
    r.received_ns = base::now_ns();
    r.done = true;
    ++done_;
    cv_.notify_all();
  }

  const std::string command_;
  const std::string phase_;
  base::Mutex mu_;
  base::CondVar cv_;
  std::vector<RequestResult> results_ SIMPLER_GUARDED_BY(mu_);
  int64_t done_ SIMPLER_GUARDED_BY(mu_) = 0;
  int64_t tokens_ SIMPLER_GUARDED_BY(mu_) = 0;
  int64_t last_report_ns_ SIMPLER_GUARDED_BY(mu_) = 0;
};

struct RunResult {
  std::vector<RequestResult> requests;
  int64_t start_ns = 0, end_ns = 0;
  llm::EngineMetrics metrics;
  std::vector<llm::StepRecord> steps;
  absl::Status closed;  // the engine's shutdown
  double load_s = 0;
};

// Runs the workload on a fresh engine: continuously (arrivals per the workload) or in static
// batches of max_num_seqs. Errors: the engine's creation.
inline absl::StatusOr<RunResult> run_workload(const std::string& model,
                                              const llm::EngineOptions& eo, const Workload& w,
                                              bool static_batches, const std::string& command) {
  const char* phase = static_batches ? "static" : "continuous";
  const int64_t t_load = base::now_ns();
  SIMPLER_ASSIGN_OR_RETURN(std::unique_ptr<llm::LlmEngine> engine,
                           llm::LlmEngine::create(model, eo));
  RunResult run;
  run.load_s = (base::now_ns() - t_load) / 1e9;
  const size_t n = w.prompts.size();
  auto collector = std::make_shared<Collector>(n, command, phase);
  const int64_t batch = eo.runner.max_num_seqs;
  auto submit = [&](size_t i) {
    llm::RequestSpec spec;
    spec.prompt_ids = w.prompts[i];
    spec.max_tokens = w.output_lens[i];
    spec.sampling.temperature = 0;
    spec.sampling.ignore_eos = true;
    spec.on_output = Collector::callback(collector, i);
    absl::StatusOr<llm::RequestId> id = engine->add_request(std::move(spec));
    if (!id.ok()) collector->refused(i, id.status());
  };
  run.start_ns = base::now_ns();
  if (static_batches) {
    for (size_t b = 0; b < n; b += batch) {
      const size_t e = std::min(n, b + static_cast<size_t>(batch));
      for (size_t i = b; i < e; ++i) submit(i);
      collector->wait(0, static_cast<int64_t>(e), static_cast<int64_t>(e));
    }
  } else {
    for (size_t i = 0; i < n; ++i) {
      const int64_t at = run.start_ns + w.arrival_offsets_ns[i];
      if (base::now_ns() < at) collector->wait(at, static_cast<int64_t>(n), i);
      submit(i);
    }
    collector->wait(0, static_cast<int64_t>(n), static_cast<int64_t>(n));
  }
  run.requests = collector->take();
  run.end_ns = run.start_ns;
  for (const RequestResult& r : run.requests) run.end_ns = std::max(run.end_ns, r.received_ns);
  run.metrics = engine->metrics();
  run.steps = engine->step_records();
  run.closed = engine->shutdown(base::Deadline::poll());
  return run;
}

struct RunStats {
  double wall_s = 0;
  int64_t output_tokens = 0;
  int64_t completed = 0;      // finished by length or stop
  int64_t errors = 0;         // refused, failed or aborted
  int64_t short_outputs = 0;  // completed with fewer tokens than asked (ignore_eos: none expected)
  double output_tokens_per_s = 0, requests_per_s = 0;
  std::vector<double> ttft_ms, itl_ms, tpot_ms, e2e_ms;
  int64_t steps = 0;
  double mean_rows_per_step = 0;
  std::string first_error;
};

inline RunStats run_stats(const RunResult& run, const Workload& w) {
  RunStats s;
  s.wall_s = (run.end_ns - run.start_ns) / 1e9;
  for (size_t i = 0; i < run.requests.size(); ++i) {
    const RequestResult& r = run.requests[i];
    s.output_tokens += r.tokens;
    const bool ok = r.error.ok() && (r.finish == llm::OutputFinish::kLength ||
                                     r.finish == llm::OutputFinish::kStop);
    if (!ok) {
      if (s.errors++ == 0) {
        s.first_error =
            absl::StrCat("request ", i, " ended with ", llm::finish_reason_name(r.finish),
                         r.error.ok() ? "" : ": ", r.error.ToString());
      }
      continue;
    }
    ++s.completed;
    if (r.tokens != w.output_lens[i]) ++s.short_outputs;
    if (r.first_token_ns > 0 && r.arrival_ns > 0) {
      s.ttft_ms.push_back((r.first_token_ns - r.arrival_ns) / 1e6);
    }
    if (r.finished_ns > 0 && r.arrival_ns > 0)
      s.e2e_ms.push_back((r.finished_ns - r.arrival_ns) / 1e6);
    for (size_t k = 1; k < r.token_times_ns.size(); ++k) {
      s.itl_ms.push_back((r.token_times_ns[k] - r.token_times_ns[k - 1]) / 1e6);
    }
    if (r.tokens > 1 && r.first_token_ns > 0 && r.finished_ns > 0) {
      s.tpot_ms.push_back((r.finished_ns - r.first_token_ns) / 1e6 /
                          static_cast<double>(r.tokens - 1));
    }
  }
  if (s.wall_s > 0) {
    s.output_tokens_per_s = s.output_tokens / s.wall_s;
    s.requests_per_s = s.completed / s.wall_s;
  }
  s.steps = static_cast<int64_t>(run.steps.size());
  int64_t rows = 0;
  for (const llm::StepRecord& rec : run.steps) rows += rec.rows;
  s.mean_rows_per_step = s.steps > 0 ? static_cast<double>(rows) / s.steps : 0;
  return s;
}

}  // namespace simpler::cli::bench
