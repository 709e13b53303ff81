// `simpler make-model`, `simpler generate` and `simpler bench decode`.
#include <algorithm>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <limits>
#include <map>
#include <mutex>
#include <optional>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "cli/bench/bench_llamacpp.h"
#include "cli/bench/bench_probes.h"
#include "cli/commands.h"
#include "cli/engine_flags.h"
#include "nlohmann/json.hpp"
#include "simpler/base/clock.h"
#include "simpler/base/json.h"
#include "simpler/base/status.h"
#include "simpler/base/thread.h"
#include "simpler/hierarchy/l3_worker.h"
#include "simpler/llm/kv_cache.h"
#include "simpler/llm/llm_engine.h"
#include "simpler/llm/make_model.h"
#include "simpler/llm/model_config.h"
#include "simpler/llm/prompts_file.h"
#include "simpler/llm/tokenizer.h"

namespace simpler::cli {

namespace {

// Comma-separated integers (token ids, steps, positions), kept 64-bit: callers range-check
// them before narrowing.
absl::StatusOr<std::vector<int64_t>> parse_ids(const std::string& text, const std::string& what) {
  std::vector<int64_t> ids;
  for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    int64_t v;
    if (!absl::SimpleAtoi(part, &v)) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": '", std::string(part.substr(0, 40)), "' is not a 64-bit integer"));
    }
    ids.push_back(v);
  }
  return ids;
}

// `ids` narrowed to int32 after each was checked to fit `what`'s range [lo, hi].
absl::StatusOr<std::vector<int32_t>> narrow(const std::vector<int64_t>& ids,
                                            const std::string& what, int64_t lo, int64_t hi) {
  std::vector<int32_t> out;
  out.reserve(ids.size());
  for (int64_t v : ids) {
    if (v < lo || v > hi) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": ", v, " is outside [", lo, ", ", hi, "]"));
    }
    out.push_back(static_cast<int32_t>(v));
  }
  return out;
}

template <typename T>
std::set<T> to_set(const std::vector<int32_t>& v) {
  return std::set<T>(v.begin(), v.end());
}

// The prompts of a --prompts-file: one JSON object per non-blank line, {"prompt": "text"} (given
// to `encode`) or {"prompt_ids": [ids]}. Errors name file:line; ids stay 64-bit.
absl::StatusOr<std::vector<std::vector<int64_t>>> read_prompts_file(
    const std::string& path,
    const std::function<absl::StatusOr<std::vector<int64_t>>(const std::string&)>& encode) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--prompts-file '", path, "' is a directory, not a file of JSON lines"));
  }
  std::ifstream in(path);
  if (!in) {
    return absl::NotFoundError(absl::StrCat("cannot open --prompts-file '", path, "'"));
  }
  std::vector<std::vector<int64_t>> prompts;
  std::string line;
  int lineno = 0;
  while (std::getline(in, line)) {
    ++lineno;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = absl::StrCat(path, ":", lineno);
    if (prompts.size() >= static_cast<size_t>(kMaxRequests)) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": more than ", kMaxRequests, " prompts (the bound of requests per command)"));
    }
    SIMPLER_ASSIGN_OR_RETURN(std::optional<llm::PromptSpec> spec,
                             llm::parse_prompts_line(line, where));
    if (!spec.has_value()) continue;
    if (const auto* text = std::get_if<std::string>(&*spec)) {
      auto encoded = encode(*text);
      if (!encoded.ok()) return base::annotate(encoded.status(), where + ": ");
      prompts.push_back(*std::move(encoded));
    } else {
      prompts.push_back(std::get<std::vector<int64_t>>(*std::move(spec)));
    }
  }
  if (prompts.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("--prompts-file '", path, "' holds no prompts"));
  }
  return prompts;
}

}  // namespace

Runner add_make_model_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("make-model",
                                 "write a Qwen3 model directory with random weights (HF layout)");
  struct State {
    std::string preset = "tiny";
    uint64_t seed = 0;
    std::string dtype = "bf16";
    std::string out;
    std::string tokenizer_dir;
    int shards = 1;
    int64_t vocab = 0, layers = 0, hidden = 0;
    bool untied = false;
  };
  auto st = std::make_shared<State>();
  cmd->add_option("--preset", st->preset, "tiny | qwen3-0.6b")
      ->check(CLI::IsMember({"tiny", "qwen3-0.6b"}));
  cmd->add_option("--seed", st->seed, "random seed");
  cmd->add_option("--dtype", st->dtype, "bf16 | f32")->check(CLI::IsMember({"bf16", "f32"}));
  cmd->add_option("--out", st->out, "output directory")->required();
  cmd->add_option("--tokenizer-dir", st->tokenizer_dir,
                  "directory with tokenizer.json (default: the npm-installed Qwen3 files)");
  cmd->add_option("--shards", st->shards, "safetensors shards (> 1 writes an index)")
      ->check(int_in(1, kMaxShards));
  auto* vocab = cmd->add_option("--vocab-size", st->vocab, "override the vocabulary size (tests)")
                    ->check(int_in(1, std::numeric_limits<int32_t>::max()));
  auto* layers = cmd->add_option("--layers", st->layers, "override the number of layers")
                     ->check(int_in(1, kMaxLayers));
  auto* hidden = cmd->add_option("--hidden-size", st->hidden, "override the hidden size")
                     ->check(int_in(1, kMaxHiddenSize));
  cmd->add_flag("--untied", st->untied, "write a separate lm_head.weight");
  return [cmd, st, vocab, layers, hidden]() -> int {
    if (!cmd->parsed()) return -1;
    llm::MakeModelOptions o;
    o.preset = st->preset;
    o.seed = st->seed;
    o.dtype = st->dtype == "f32" ? task::DataType::kFloat32 : task::DataType::kBFloat16;
    o.out_dir = st->out;
    o.shards = st->shards;
    if (vocab->count() > 0) o.overrides.vocab_size = st->vocab;
    if (layers->count() > 0) o.overrides.num_hidden_layers = st->layers;
    if (hidden->count() > 0) o.overrides.hidden_size = st->hidden;
    if (st->untied) o.overrides.tie_word_embeddings = false;
    if (st->tokenizer_dir.empty()) {
      auto dir = llm::default_tokenizer_dir();
      if (!dir.ok()) return fail("make-model", dir.status());
      o.tokenizer_dir = *dir;
    } else {
      o.tokenizer_dir = st->tokenizer_dir;
    }
    const int64_t t0 = base::now_ns();
    absl::Status s = llm::make_model(o);
    if (!s.ok()) return fail("make-model", s);
    std::cerr << "simpler make-model: wrote " << st->preset << " (" << st->dtype << ", seed "
              << st->seed << ") to " << st->out << " in " << (base::now_ns() - t0) / 1e9 << " s\n";
    return 0;
  };
}

namespace {

// One choice's collected output.
struct ChoiceResult {
  std::vector<int32_t> tokens;
  std::string text;
  std::string finish_reason;
  absl::Status error;
  std::vector<int32_t> pages;
  std::vector<int64_t> page_steps;
  int64_t last_step = 0;
  std::map<int64_t, std::vector<float>> logits;
  std::map<int64_t, llm::Qwen3ModelRunner::Kv> kv;
  int64_t arrival_ns = 0, first_token_ns = 0, finished_ns = 0;
  std::vector<int64_t> token_times_ns;
  bool done = false;
};

// Requests run through an LlmEngine: results[i] holds request i's choices.
// Collects every event through callbacks (so no request's queue can fill up
// while another is read) and reports progress once a second on stderr.
struct RequestRun {
  std::vector<std::vector<ChoiceResult>> results;
  int64_t start_ns = 0, end_ns = 0;
  int64_t all_first_token_ns = 0;  // when every served choice had its first token
};

// Request r goes to engines[r % engines.size()] (data parallel: one engine per chip).
RequestRun run_requests(const std::vector<llm::LlmEngine*>& engines,
                        std::vector<llm::RequestSpec> specs, const char* command, bool progress) {
  RequestRun run;
  run.results.resize(specs.size());
  struct Shared {
    std::mutex mu;
    std::condition_variable cv;
    int64_t open = 0;
    int64_t tokens = 0;
  };
  auto shared = std::make_shared<Shared>();
  run.start_ns = base::now_ns();
  for (size_t r = 0; r < specs.size(); ++r) {
    run.results[r].resize(specs[r].n);
    std::vector<ChoiceResult>* choices = &run.results[r];
    specs[r].on_output = [shared, choices](const llm::RequestOutput& out) {
      std::lock_guard<std::mutex> l(shared->mu);
      ChoiceResult& c = (*choices)[out.index];
      c.tokens.insert(c.tokens.end(), out.token_ids.begin(), out.token_ids.end());
      c.token_times_ns.insert(c.token_times_ns.end(), out.token_times_ns.begin(),
                              out.token_times_ns.end());
      c.text += out.text;
      shared->tokens += static_cast<int64_t>(out.token_ids.size());
      for (auto& [k, v] : out.logits) c.logits[k] = v;
      for (auto& [k, v] : out.kv) c.kv[k] = v;
      if (out.finished()) {
        c.finish_reason = llm::finish_reason_name(out.finish);
        c.error = out.error;
        c.pages = out.pages;
        c.page_steps = out.page_steps;
        c.last_step = out.last_step;
        c.arrival_ns = out.arrival_ns;
        c.first_token_ns = out.first_token_ns;
        c.finished_ns = out.finished_ns;
        c.done = true;
        --shared->open;
        shared->cv.notify_all();
      }
    };
    const int32_t n = specs[r].n;
    {
      std::lock_guard<std::mutex> l(shared->mu);
      shared->open += n;
    }
    absl::StatusOr<llm::RequestId> id =
        engines[r % engines.size()]->add_request(std::move(specs[r]));
    if (!id.ok()) {
      std::lock_guard<std::mutex> l(shared->mu);
      shared->open -= n;
      for (ChoiceResult& c : run.results[r]) {
        c.finish_reason = "error";
        c.error = id.status();
        c.done = true;
      }
    }
  }
  std::unique_lock<std::mutex> l(shared->mu);
  int64_t last_report = base::now_ns();
  while (shared->open > 0) {
    shared->cv.wait_for(l, std::chrono::milliseconds(200));
    if (progress && base::now_ns() - last_report > 1'000'000'000) {
      last_report = base::now_ns();
      std::cerr << "simpler " << command << ": " << shared->tokens << " tokens generated, "
                << shared->open << " request(s) still open\n";
    }
  }
  run.end_ns = base::now_ns();
  for (const auto& rs : run.results) {
    for (const ChoiceResult& c : rs) {
      if (c.first_token_ns != 0)
        run.all_first_token_ns = std::max(run.all_first_token_ns, c.first_token_ns);
    }
  }
  if (run.all_first_token_ns == 0) run.all_first_token_ns = run.end_ns;
  return run;
}

// Mean effective depth and most steps in flight over an engine's step records.
struct DepthStats {
  double effective_depth = 0;
  int64_t max_steps_in_flight = 0;
  int64_t steps = 0;
};
DepthStats depth_stats(const std::vector<llm::StepRecord>& records) {
  DepthStats d;
  int64_t sum = 0;
  for (const llm::StepRecord& r : records) {
    sum += r.effective_depth;
    d.max_steps_in_flight = std::max(d.max_steps_in_flight, r.in_flight_at_submit);
  }
  d.steps = static_cast<int64_t>(records.size());
  d.effective_depth = records.empty() ? 0 : static_cast<double>(sum) / records.size();
  return d;
}

}  // namespace

Runner add_generate_command(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "generate", "generate from prompts with a Qwen3 model (continuous batching, LlmEngine)");
  struct State {
    std::string model, prompt, prompt_ids, prompts_file;
    bool chat = false, ignore_eos = false;
    int32_t max_new_tokens = 32;
    int32_t requests = 1;
    float temperature = 0.0f, top_p = 1.0f, min_p = 0.0f;
    int32_t top_k = 0;
    uint64_t seed = 0;
    std::vector<std::string> stop;
    std::string dump_logits_steps, dump_kv_positions;
    int32_t chips = 1;
    std::string child_mode = "process";
    EngineFlags engine;
  };
  auto st = std::make_shared<State>();
  st->engine.max_num_seqs = 0;  // all requests
  cmd->add_option("--model", st->model, "model directory (Hugging Face layout)")->required();
  cmd->add_option("--chips", st->chips,
                  "data parallel over this many sim chips: every chip loads the model, requests "
                  "are dealt out in turn, one engine per chip (an L3 worker's children)")
      ->check(int_in(1, 16));
  cmd->add_option("--child-mode", st->child_mode,
                  "with --chips > 1: process (forked children behind shared-memory mailboxes) or "
                  "thread (children in this process)")
      ->check(CLI::IsMember({"thread", "process"}));
  auto* p1 = cmd->add_option("--prompt", st->prompt, "prompt text");
  auto* p2 = cmd->add_option("--prompt-ids", st->prompt_ids, "prompt token ids, e.g. 1,2,3");
  auto* p3 = cmd->add_option("--prompts-file", st->prompts_file,
                             "JSON lines, each {\"prompt\": ...} or {\"prompt_ids\": [...]}");
  p1->excludes(p2, p3);
  p2->excludes(p3);
  cmd->add_flag("--chat", st->chat, "wrap text prompts in the Qwen3 chat template");
  cmd->add_option("--max-new-tokens", st->max_new_tokens,
                  "tokens to generate per request (prompt + this <= max_position_embeddings)")
      ->check(int_in(1, std::numeric_limits<int32_t>::max()));
  cmd->add_option("--requests,-n", st->requests,
                  "choices of the one prompt (OpenAI n: clone requests, each its own RNG stream)")
      ->check(int_in(1, kMaxRequests));
  cmd->add_option("--temperature", st->temperature, "sampling temperature (0 = greedy)")
      ->check(CLI::Range(0.0f, 100.0f));
  cmd->add_option("--top-p", st->top_p, "nucleus sampling mass in (0, 1]");
  cmd->add_option("--top-k", st->top_k, "keep the k most likely tokens (0 = off)")
      ->check(int_in(-1, std::numeric_limits<int32_t>::max()));
  cmd->add_option("--min-p", st->min_p, "drop tokens below min-p times the top probability");
  auto* seed_opt = cmd->add_option(
      "--seed", st->seed, "sampling seed for every request (default: a distinct one each)");
  cmd->add_option("--stop", st->stop, "stop string (repeatable; not part of the output)");
  cmd->add_flag("--ignore-eos", st->ignore_eos, "do not stop at the model's EOS ids");
  cmd->add_option("--dump-logits-steps", st->dump_logits_steps,
                  "with --json: include logits at these decode steps (0 = first token)");
  cmd->add_option("--dump-kv-positions", st->dump_kv_positions,
                  "with --json: include K/V read back from the page pool at these positions");
  add_engine_flags(
      cmd, &st->engine,
      {.max_num_seqs =
           "requests running at once, rows sampled per step (0 = all requests, at most 256)",
       .max_num_batched_tokens = true,
       .page_size = true,
       .num_pages = "KV cache pages (0 = sized from the requests)",
       .allow_unused_tensors = true,
       .host_sampling = true});
  return [cmd, st, p1, p2, p3, seed_opt]() -> int {
    if (!cmd->parsed()) return -1;
    if (p1->count() + p2->count() + p3->count() == 0) {
      return fail("generate", absl::InvalidArgumentError(
                                  "one of --prompt, --prompt-ids or --prompts-file is required"));
    }
    // Tokenizer: from the model directory; required for text prompts and stop strings.
    std::optional<llm::Tokenizer> tok;
    absl::Status tok_status;
    {
      auto t = llm::Tokenizer::load(st->model);
      if (t.ok()) {
        tok.emplace(std::move(*t));
      } else {
        tok_status = t.status();
      }
    }
    auto encode = [&](const std::string& text) -> absl::StatusOr<std::vector<int64_t>> {
      if (!tok) return tok_status;
      auto ids = tok->try_encode(st->chat ? llm::Tokenizer::wrap_chat(text) : text);
      if (!ids.ok()) return ids.status();
      return std::vector<int64_t>(ids->begin(), ids->end());
    };
    // The distinct prompts, 64-bit until checked against the model; each has `clones` choices.
    std::vector<std::vector<int64_t>> unique;
    int32_t clones = 1;
    if (p1->count() > 0) {
      auto ids = encode(st->prompt);
      if (!ids.ok()) return fail("generate", ids.status());
      unique.push_back(*std::move(ids));
      clones = st->requests;
    } else if (p2->count() > 0) {
      auto ids = parse_ids(st->prompt_ids, "--prompt-ids");
      if (!ids.ok()) return fail("generate", ids.status());
      unique.push_back(*std::move(ids));
      clones = st->requests;
    } else {
      auto prompts_file = read_prompts_file(st->prompts_file, encode);
      if (!prompts_file.ok()) return fail("generate", prompts_file.status());
      unique = *std::move(prompts_file);
    }
    // Validate every request against the model before anything is sized for it.
    auto config = llm::ModelConfig::load(st->model);
    if (!config.ok()) return fail("generate", config.status());
    for (size_t r = 0; r < unique.size(); ++r) {
      absl::Status s = config->check_request(unique[r], st->max_new_tokens);
      if (!s.ok()) return fail("generate", base::annotate(s, absl::StrCat("request ", r, ": ")));
    }
    if (!st->stop.empty() && !tok) {
      return fail("generate", base::annotate(tok_status, "--stop needs the model's tokenizer: "));
    }
    if (!tok) {
      std::cerr << "simpler generate: no tokenizer (" << tok_status.message()
                << "); output text is omitted\n";
    }
    std::vector<int32_t> logit_steps_v, kv_pos_v;
    {
      auto a = parse_ids(st->dump_logits_steps, "--dump-logits-steps");
      auto b = parse_ids(st->dump_kv_positions, "--dump-kv-positions");
      if (!a.ok()) return fail("generate", a.status());
      if (!b.ok()) return fail("generate", b.status());
      auto na = narrow(*a, "--dump-logits-steps", 0, std::numeric_limits<int32_t>::max());
      auto nb = narrow(*b, "--dump-kv-positions", 0, std::numeric_limits<int32_t>::max());
      if (!na.ok()) return fail("generate", na.status());
      if (!nb.ok()) return fail("generate", nb.status());
      logit_steps_v = *na;
      kv_pos_v = *nb;
    }
    const int64_t total_choices = static_cast<int64_t>(unique.size()) * clones;
    const int32_t chips = st->chips;
    if (chips > 1 && !kv_pos_v.empty()) {
      return fail("generate", absl::InvalidArgumentError(
                                  "--dump-kv-positions reads the KV pool back, and with --chips > "
                                  "1 it lives in a child's device memory"));
    }
    // Request r runs on chip r % chips (all its choices together); every chip gets the limits
    // and the pool of the busiest one.
    std::vector<int64_t> chip_choices(chips, 0), chip_pages(chips, 0);
    for (size_t r = 0; r < unique.size(); ++r) {
      chip_choices[r % chips] += clones;
      chip_pages[r % chips] +=
          clones * llm::pages_needed(static_cast<int64_t>(unique[r].size()) + st->max_new_tokens,
                                     st->engine.page_size);
    }
    const int64_t busiest = *std::max_element(chip_choices.begin(), chip_choices.end());

    base::TraceRecorder trace;
    auto options = engine_options(
        st->engine,
        {.requests = busiest, .pages = *std::max_element(chip_pages.begin(), chip_pages.end())},
        &trace);
    if (!options.ok()) return fail("generate", options.status());
    llm::EngineOptions eo = *std::move(options);
    eo.max_waiting = static_cast<int32_t>(std::max<int64_t>(total_choices, 1));
    eo.tokenizer = tok ? &*tok : nullptr;
    eo.record_steps = true;
    const int32_t pages = eo.runner.num_pages;
    if (st->engine.host_sampling && st->engine.common.launch_depth > 1) {
      std::cerr << "simpler generate: host sampling needs each step's logits on the host first; "
                   "falling back to serial launch (effective depth 1, requested "
                << st->engine.common.launch_depth << ")\n";
    }
    const int64_t t0 = base::now_ns();
    // One chip: an engine over its own worker. Several: an L3 worker whose children each load
    // the model (forked first, while this process is single-threaded), one engine per child.
    std::unique_ptr<hierarchy::L3Worker> l3;
    std::vector<std::unique_ptr<llm::LlmEngine>> engines;
    if (chips == 1) {
      auto engine = llm::LlmEngine::create(st->model, eo);
      if (!engine.ok()) {
        return fail_with_trace("generate", engine.status(), trace, st->engine.common.trace_path);
      }
      engines.push_back(std::move(*engine));
    } else {
      hierarchy::L3Options lo;
      lo.device_ids.clear();
      for (int32_t c = 0; c < chips; ++c) lo.device_ids.push_back(c);
      lo.child_mode = *hierarchy::parse_child_mode(st->child_mode);
      lo.child = eo.runner.worker;
      // Every engine keeps up to launch_depth steps in flight.
      lo.launch_depth = std::min(16, chips * std::max(1, st->engine.common.launch_depth));
      // Each step stages its host tensors (and its logits when read back) in the shared heap;
      // reserved lazily, so the bound costs nothing until used.
      const bool logits_back = st->engine.host_sampling || !logit_steps_v.empty();
      lo.host_heap_bytes =
          (64ull << 20) + (logits_back ? static_cast<uint64_t>(lo.launch_depth + chips) *
                                             eo.runner.max_num_seqs * config->vocab_size * 4
                                       : 0);
      l3 = std::make_unique<hierarchy::L3Worker>(lo);
      auto dp = llm::Qwen3DataParallel::prepare(*l3, st->model, eo.runner);
      if (!dp.ok()) return fail("generate", dp.status());
      if (absl::Status s = l3->init(); !s.ok()) return fail("generate", s);
      std::string children;
      for (const std::string& c : l3->describe_children()) {
        absl::StrAppend(&children, children.empty() ? "" : ", ", c);
      }
      std::cerr << "simpler generate: children: " << children << "\n";
      for (int32_t c = 0; c < chips; ++c) {
        auto runner = (*dp)->runner(c);
        auto engine = runner.ok()
                          ? llm::LlmEngine::create(std::move(*runner), eo)
                          : absl::StatusOr<std::unique_ptr<llm::LlmEngine>>(runner.status());
        if (!engine.ok()) {
          engines.clear();
          (void)l3->close();
          return fail_with_trace("generate", engine.status(), trace, st->engine.common.trace_path);
        }
        engines.push_back(std::move(*engine));
      }
    }
    const double load_s = (base::now_ns() - t0) / 1e9;
    std::cerr << "simpler generate: " << (chips == 1 ? "loaded " : "started ") << st->model
              << " in " << load_s << " s"
              << (chips == 1 ? std::string()
                             : absl::StrCat(" on ", chips, " chips (", st->child_mode,
                                            " children, each loading the model itself)"))
              << "; " << total_choices << " request(s), " << pages << " KV pages of "
              << eo.runner.page_size << " tokens" << (chips == 1 ? "" : " per chip")
              << ", launch depth " << st->engine.common.launch_depth << ", max_num_seqs "
              << eo.runner.max_num_seqs << ", max_num_batched_tokens "
              << eo.runner.max_num_batched_tokens << "\n";

    std::vector<llm::RequestSpec> specs;
    std::vector<std::vector<int32_t>> prompts;
    for (const auto& ids : unique) {
      llm::RequestSpec spec;
      spec.prompt_ids.assign(ids.begin(), ids.end());  // in [0, vocab_size): checked above
      prompts.push_back(spec.prompt_ids);
      spec.max_tokens = st->max_new_tokens;
      spec.n = clones;
      spec.sampling.temperature = st->temperature;
      spec.sampling.top_p = st->top_p;
      spec.sampling.top_k = st->top_k;
      spec.sampling.min_p = st->min_p;
      if (seed_opt->count() > 0) spec.sampling.seed = st->seed;
      spec.sampling.ignore_eos = st->ignore_eos;
      spec.sampling.stop = st->stop;
      spec.logits_tokens = to_set<int64_t>(logit_steps_v);
      spec.kv_positions = to_set<int64_t>(kv_pos_v);
      specs.push_back(std::move(spec));
    }
    std::vector<llm::LlmEngine*> engine_ptrs;
    for (auto& e : engines) engine_ptrs.push_back(e.get());
    RequestRun run = run_requests(engine_ptrs, std::move(specs), "generate", true);
    int64_t generated = 0, preemptions = 0;
    std::vector<llm::StepRecord> records;
    for (auto& e : engines) {
      const llm::EngineMetrics m = e->metrics();
      generated += m.generation_tokens_total;
      preemptions += m.preemptions_total;
      for (const llm::StepRecord& r : e->step_records()) records.push_back(r);
    }
    const DepthStats depth = depth_stats(records);
    absl::Status closed;
    for (auto& e : engines) {
      absl::Status s = e->shutdown(base::Deadline::poll());
      if (closed.ok()) closed = s;
    }
    engines.clear();
    if (l3) {
      absl::Status s = l3->close();
      if (closed.ok()) closed = s;
    }
    // Per choice, in request order.
    struct Item {
      const std::vector<int32_t>* prompt;
      ChoiceResult* c;
      int32_t chip;
    };
    std::vector<Item> items;
    for (size_t r = 0; r < run.results.size(); ++r) {
      for (ChoiceResult& c : run.results[r]) {
        items.push_back({&prompts[r], &c, static_cast<int32_t>(r % chips)});
      }
    }
    const double total_ms = (run.end_ns - run.start_ns) / 1e6;
    const double prefill_ms = (run.all_first_token_ns - run.start_ns) / 1e6;
    const double decode_ms = (run.end_ns - run.all_first_token_ns) / 1e6;
    const double tok_s = total_ms > 0 ? generated / (total_ms / 1e3) : 0;
    int64_t prompt_tokens = 0;
    for (const Item& it : items) prompt_tokens += static_cast<int64_t>(it.prompt->size());
    std::cerr << "simpler generate: " << depth.steps << " steps, " << prompt_tokens << " prompt + "
              << generated << " generated tokens in " << total_ms << " ms (prefill " << prefill_ms
              << " ms, decode " << decode_ms << " ms, " << tok_s
              << " generated tokens/s; launch depth " << st->engine.common.launch_depth
              << ", effective " << depth.effective_depth << ", up to " << depth.max_steps_in_flight
              << " steps in flight"
              << (st->engine.host_sampling ? ", serial launch for host sampling" : "") << "; "
              << preemptions << " preemptions)\n";

    if (st->engine.common.json) {
      nlohmann::json reqs = nlohmann::json::array();
      for (const Item& it : items) {
        const ChoiceResult& r = *it.c;
        nlohmann::json j = {{"prompt_ids", *it.prompt},         {"tokens", r.tokens},
                            {"finish_reason", r.finish_reason}, {"pages", r.pages},
                            {"page_steps", r.page_steps},       {"last_step", r.last_step}};
        j["text"] = tok ? nlohmann::json(r.text) : nlohmann::json(nullptr);
        j["chip"] = it.chip;
        if (!r.error.ok()) j["error"] = std::string(r.error.message());
        if (!r.logits.empty()) {
          nlohmann::json lg = nlohmann::json::object();
          for (const auto& [s, v] : r.logits) lg[std::to_string(s)] = v;
          j["logits"] = lg;
        }
        if (!r.kv.empty()) {
          nlohmann::json kv = nlohmann::json::object();
          for (const auto& [p, v] : r.kv) kv[std::to_string(p)] = {{"k", v.k}, {"v", v.v}};
          j["kv"] = kv;
        }
        reqs.push_back(std::move(j));
      }
      nlohmann::json out = {
          {"model", st->model},
          {"requests", reqs},
          {"timing",
           {{"load_s", load_s},
            {"total_ms", total_ms},
            {"prefill_ms", prefill_ms},
            {"decode_ms", decode_ms},
            {"steps", depth.steps},
            {"prompt_tokens", prompt_tokens},
            {"generated_tokens", generated},
            {"generated_tokens_per_s", tok_s}}},
          {"launch_depth", st->engine.common.launch_depth},
          {"effective_depth", depth.effective_depth},
          {"max_steps_in_flight", depth.max_steps_in_flight},
          {"serial_launch", st->engine.host_sampling},
          {"host_sampling", st->engine.host_sampling},
          {"preemptions", preemptions},
          {"chips", chips},
          {"child_mode", chips > 1 ? nlohmann::json(st->child_mode) : nlohmann::json(nullptr)},
          {"max_num_seqs", eo.runner.max_num_seqs},
          {"max_num_batched_tokens", eo.runner.max_num_batched_tokens},
          {"kernel_isa", llm::name_of(llm::resolve_kernel_isa(st->engine.common.kernel_isa()))},
          {"precision", llm::name_of(llm::effective_precision(st->engine.common.kernel_isa(),
                                                              st->engine.common.precision()))}};
      std::string dumped = base::dump_replacing(out);
      std::printf("%s\n", dumped.c_str());
    } else {
      for (size_t i = 0; i < items.size(); ++i) {
        const ChoiceResult& r = *items[i].c;
        if (items.size() > 1) std::printf("--- request %zu (%s)\n", i, r.finish_reason.c_str());
        if (!r.error.ok()) {
          std::printf("error: %s\n", std::string(r.error.message()).c_str());
        } else if (tok) {
          std::printf("%s\n", r.text.c_str());
        } else {
          for (size_t k = 0; k < r.tokens.size(); ++k)
            std::printf("%s%d", k ? "," : "", r.tokens[k]);
          std::printf("\n");
        }
      }
    }
    // Every request's result is printed first; a refused or failed request
    // makes the call fail, its error the last line on stderr.
    int failed = 0;
    for (const Item& it : items) failed += it.c->error.ok() ? 0 : 1;
    if (!closed.ok() && failed == 0) {
      return fail_with_trace("generate", closed, trace, st->engine.common.trace_path);
    }
    if (!write_trace(trace, st->engine.common.trace_path)) return 1;
    for (size_t i = 0; i < items.size(); ++i) {
      if (items[i].c->error.ok()) continue;
      std::cerr << "simpler generate: request " << i << " failed: " << items[i].c->error << "\n";
    }
    return failed > 0 ? 1 : 0;
  };
}

namespace {

// Multiply-accumulates of the weight matrices per decode row (the projections and the LM head;
// the attention over a short context is negligible): a step of B rows is 2·B·this FLOPs.
int64_t matrix_macs_per_row(const llm::ModelConfig& c) {
  const int64_t h = c.hidden_size, q = c.num_attention_heads * c.head_dim,
                kv = c.num_key_value_heads * c.head_dim;
  return c.num_hidden_layers * (q * h + 2 * kv * h + h * q + 3 * c.intermediate_size * h) +
         c.vocab_size * h;
}

}  // namespace

int run_bench_load(const std::string& model, const EngineFlags& flags) {
  const CommonOptions& common = flags.common;
  base::TraceRecorder trace;
  std::vector<std::string> files;
  uint64_t checkpoint_bytes = 0;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(model, ec)) {
    if (e.path().extension() == ".safetensors") {
      files.push_back(e.path().string());
      checkpoint_bytes += e.file_size(ec);
    }
  }
  if (files.empty()) {
    return fail("bench load", absl::NotFoundError(absl::StrCat("no .safetensors file in ", model)));
  }
  // Reading the files (into one reused 64 MiB buffer), best of 3; the first pass also puts
  // them in the page cache, so both figures are of cached files.
  std::vector<char> buf(64 << 20);
  double read_s = 1e30;
  for (int pass = 0; pass < 3; ++pass) {
    const int64_t t0 = base::now_ns();
    for (const std::string& f : files) {
      std::ifstream in(f, std::ios::binary);
      while (in.read(buf.data(), static_cast<std::streamsize>(buf.size())) || in.gcount() > 0) {
      }
    }
    read_s = std::min(read_s, (base::now_ns() - t0) / 1e9);
  }
  buf = std::vector<char>();
  // Loading: the engine created (weights in device memory, scratch and a small KV pool), best
  // of 3.
  double load_s = 1e30;
  for (int pass = 0; pass < 3; ++pass) {
    EngineFlags row = flags;
    row.max_num_seqs = 1;
    row.max_num_batched_tokens = 16;
    row.num_pages = 16;
    absl::StatusOr<llm::EngineOptions> eo = engine_options(row, {}, &trace);
    if (!eo.ok()) return fail("bench load", eo.status());
    const int64_t t0 = base::now_ns();
    auto engine = llm::LlmEngine::create(model, *eo);
    const double s = (base::now_ns() - t0) / 1e9;
    if (!engine.ok()) {
      return fail_with_trace("bench load", engine.status(), trace, common.trace_path);
    }
    load_s = std::min(load_s, s);
    (void)(*engine)->shutdown(base::Deadline::poll());
  }
  const uint64_t hwm = peak_resident_bytes();
  nlohmann::json out = {
      {"model", model},   {"checkpoint_bytes", checkpoint_bytes}, {"load_s", load_s},
      {"read_s", read_s}, {"load_over_read", load_s / read_s},    {"vm_hwm_bytes", hwm}};
  if (common.json) {
    std::printf("%s\n", base::dump_replacing(out).c_str());
  } else {
    std::printf(
        "load: %.1f MB checkpoint loaded in %.3f s = %.2fx the %.3f s it takes to read the "
        "files (page cache warm, best of 3); peak resident %.1f MB = %.2fx the checkpoint\n",
        checkpoint_bytes / 1e6, load_s, load_s / read_s, read_s, hwm / 1e6,
        static_cast<double>(hwm) / checkpoint_bytes);
  }
  return write_trace(trace, common.trace_path) ? 0 : 1;
}

int run_bench_prefill(const std::string& model, const EngineFlags& flags,
                      const std::vector<int>& prompt_lens, const std::string& compare) {
  const CommonOptions& common = flags.common;
  const bool compare_torch = compare == "torch";
  base::TraceRecorder trace;
  auto config = llm::ModelConfig::load(model);
  if (!config.ok()) return fail("bench prefill", config.status());
  for (int len : prompt_lens) {
    if (absl::Status s = config->check_request(std::vector<int64_t>(len, 0), 1); !s.ok()) {
      return fail("bench prefill", base::annotate(s, "--prompt-lens: "));
    }
  }
  // The compute limit, in the same process just before: every hardware thread's FMA chains on
  // the fastest target this CPU has (whatever target the kernels run), and the figure on paper.
  const llm::KernelIsa isa = llm::resolve_kernel_isa(common.kernel_isa());
  const llm::KernelIsa peak_isa = llm::resolve_kernel_isa(llm::KernelIsa::kAuto);
  const double peak = llm::measure_f32_fma_peak(peak_isa);
  const TheoreticalPeak paper = theoretical_f32_fma_peak();
  const int threads = common.cores > 0 ? common.cores : base::hardware_threads();
  std::optional<LlamaCppPeer> peer;
  if (compare == "llama.cpp") {
    absl::StatusOr<LlamaCppPeer> p = LlamaCppPeer::prepare(model, common.kernel_isa());
    if (!p.ok()) return fail("bench prefill", p.status());
    peer.emplace(std::move(*p));
  }
  const bool peak_low = paper.flop_per_s > 0 && peak < paper.flop_per_s / 2;
  if (peak_low) {
    std::fprintf(stderr,
                 "bench prefill: the measured f32 FMA peak %.1f GFLOP/s is below half the "
                 "theoretical %.1f GFLOP/s (%s): the CPUs are shared, throttled or slower than "
                 "their clock says\n",
                 peak / 1e9, paper.flop_per_s / 1e9, paper.formula.c_str());
  }
  const int64_t lm_macs = config->vocab_size * config->hidden_size;
  const int64_t layer_macs = matrix_macs_per_row(*config) - lm_macs;
  for (int len : prompt_lens) {
    EngineFlags row = flags;
    row.max_num_seqs = 1;
    row.max_num_batched_tokens = std::max(512, len);
    row.num_pages = static_cast<int32_t>(llm::pages_needed(len + 1, row.page_size));
    absl::StatusOr<llm::EngineOptions> eo = engine_options(row, {}, &trace);
    if (!eo.ok()) return fail("bench prefill", eo.status());
    auto engine = llm::LlmEngine::create(model, *eo);
    if (!engine.ok()) {
      return fail_with_trace("bench prefill", engine.status(), trace, common.trace_path);
    }
    // Best of 3 prompts (distinct ids, so nothing is reused between them).
    double best_ms = 1e30;
    for (int rep = 0; rep < 3; ++rep) {
      llm::RequestSpec spec;
      for (int i = 0; i < len; ++i) {
        spec.prompt_ids.push_back(static_cast<int32_t>((100 + 7 * i + rep) % config->vocab_size));
      }
      spec.max_tokens = 1;
      spec.sampling.temperature = 0;
      spec.sampling.ignore_eos = true;
      std::vector<llm::RequestSpec> specs;
      specs.push_back(std::move(spec));
      RequestRun run = run_requests({engine->get()}, std::move(specs), "bench prefill", false);
      for (const ChoiceResult& c : run.results[0]) {
        if (!c.error.ok()) {
          return fail_with_trace("bench prefill", c.error, trace, common.trace_path);
        }
      }
      best_ms = std::min(best_ms, (run.all_first_token_ns - run.start_ns) / 1e6);
    }
    absl::Status closed = (*engine)->shutdown(base::Deadline::poll());
    if (!closed.ok()) return fail_with_trace("bench prefill", closed, trace, common.trace_path);
    engine->reset();
    // Every prompt position goes through the layers; the LM head runs for the last one only.
    const double flop = 2.0 * (static_cast<double>(len) * layer_macs + lm_macs);
    const double gflops = flop / (best_ms / 1e3) / 1e9;
    const llm::Precision precision =
        llm::effective_precision(common.kernel_isa(), common.precision());
    const bool bf16 = precision == llm::Precision::kBf16;
    nlohmann::json out = {{"model", model},
                          {"prompt_len", len},
                          {"kernel_isa", llm::name_of(isa)},
                          {"precision", llm::name_of(precision)},
                          {"ttft_ms", best_ms},
                          {"tokens_per_s", len / (best_ms / 1e3)},
                          {"gflop_per_s", gflops},
                          {"peak_gflop_per_s", peak / 1e9},
                          {"peak_isa", llm::name_of(peak_isa)},
                          {"theoretical_peak_gflop_per_s", paper.flop_per_s / 1e9},
                          {"theoretical_peak", paper.formula},
                          {"peak_below_half_theoretical", peak_low},
                          {"fraction_of_peak", gflops * 1e9 / peak}};
    if (bf16) {
      // The bf16 GEMM library on the same shapes: one layer's projections with the prompt's
      // rows (every layer has the same shapes), every hardware thread.
      const int64_t h = config->hidden_size, I = config->intermediate_size,
                    q = config->num_attention_heads * config->head_dim,
                    kv = config->num_key_value_heads * config->head_dim;
      std::string impl;
      auto lib = bf16_gemm_library_flops(
          len, {{q, h}, {kv, h}, {kv, h}, {h, q}, {I, h}, {I, h}, {h, I}}, 0, &impl);
      if (!lib.ok()) return fail("bench prefill", lib.status());
      out["library"] = absl::StrCat("oneDNN ", impl);
      out["library_gflop_per_s"] = *lib / 1e9;
      out["fraction_of_library"] = gflops * 1e9 / *lib;
    }
    if (compare_torch) {
      auto peer =
          run_torch_peer(model, {"--prompt-len", std::to_string(len)}, base::hardware_threads());
      if (!peer.ok()) return fail("bench prefill", peer.status());
      const double torch_ms = (*peer)["ttft_ms"].get<double>();
      out["torch_ttft_ms"] = torch_ms;
      out["speedup_vs_torch"] = torch_ms / best_ms;
    }
    if (peer) {
      absl::StatusOr<double> theirs = peer->prefill_tokens_per_s(len, threads);
      if (!theirs.ok()) return fail("bench prefill", theirs.status());
      out["llamacpp_tokens_per_s"] = *theirs;
      out["over_llamacpp"] = len / (best_ms / 1e3) / *theirs;
      out["llamacpp_cpu_variant"] = peer->cpu_variant();
    }
    if (common.json) {
      std::printf("%s\n", base::dump_replacing(out).c_str());
    } else {
      std::printf(
          "prefill: %d-token prompt on %s: time to first token %.1f ms (%.1f tokens/s), %.1f "
          "GFLOP/s = %.1f%% of the measured f32 FMA peak %.1f GFLOP/s (%s, every hardware "
          "thread; on paper %.1f GFLOP/s = %s)\n",
          len, llm::name_of(isa), best_ms, len / (best_ms / 1e3), gflops, 100 * gflops * 1e9 / peak,
          peak / 1e9, llm::name_of(peak_isa), paper.flop_per_s / 1e9, paper.formula.c_str());
      if (bf16) {
        std::printf(
            "  precision bf16: %.1f%% of the bf16 GEMM library on the same shapes (%s, every "
            "hardware thread: %.1f GFLOP/s)\n",
            100 * out["fraction_of_library"].get<double>(),
            out["library"].get<std::string>().c_str(), out["library_gflop_per_s"].get<double>());
      }
      if (compare_torch) {
        std::printf("  PyTorch eager (f32, %d threads): %.1f ms; simpler is %.2fx faster\n",
                    base::hardware_threads(), out["torch_ttft_ms"].get<double>(),
                    out["speedup_vs_torch"].get<double>());
      }
      if (peer) {
        std::printf(
            "  llama.cpp (ggml CPU variant %s, %d threads): %.1f tokens/s; simpler / "
            "llama.cpp = %.2f\n",
            peer->cpu_variant().c_str(), threads, out["llamacpp_tokens_per_s"].get<double>(),
            out["over_llamacpp"].get<double>());
      }
    }
  }
  return write_trace(trace, common.trace_path) ? 0 : 1;
}

int run_bench_decode(const std::string& model, const EngineFlags& flags, int steps,
                     const std::vector<int>& batches, const std::string& compare) {
  const CommonOptions& common = flags.common;
  const bool compare_torch = compare == "torch";
  base::TraceRecorder trace;
  // The steps must fit the model's positions before the KV pool is sized for them.
  auto config = llm::ModelConfig::load(model);
  if (!config.ok()) return fail("bench decode", config.status());
  const std::vector<int64_t> prompt = {1};
  if (absl::Status s = config->check_request(prompt, steps); !s.ok()) {
    return fail("bench decode", base::annotate(s, "--steps: "));
  }
  // The peer's threads are ours (the sim device's cores: --cores, 0 = every hardware thread).
  const int threads = common.cores > 0 ? common.cores : base::hardware_threads();
  std::optional<LlamaCppPeer> peer;
  if (compare == "llama.cpp") {
    absl::StatusOr<LlamaCppPeer> p = LlamaCppPeer::prepare(model, common.kernel_isa());
    if (!p.ok()) return fail("bench decode", p.status());
    peer.emplace(std::move(*p));
  }
  double read_bw = 0;  // measured once, before the first engine, sized like its weights
  for (int batch : batches) {
    EngineFlags row = flags;
    row.max_num_seqs = batch;
    row.max_num_batched_tokens = std::max(batch, 16);
    row.num_pages = static_cast<int32_t>(batch * llm::pages_needed(1 + steps, row.page_size));
    absl::StatusOr<llm::EngineOptions> eo = engine_options(row, {}, &trace);
    if (!eo.ok()) return fail("bench decode", eo.status());
    eo->record_steps = true;
    eo->max_waiting = batch;
    if (read_bw == 0) {
      // The weights' size in the checkpoint's dtype: what a step reads.
      uint64_t bytes = 0;
      std::error_code ec;
      for (const auto& e : std::filesystem::directory_iterator(model, ec)) {
        if (e.path().extension() == ".safetensors") bytes += e.file_size(ec);
      }
      read_bw = read_bandwidth_bytes_per_s(std::max<uint64_t>(bytes, 64ull << 20));
    }
    auto engine = llm::LlmEngine::create(model, *eo);
    if (!engine.ok()) {
      return fail_with_trace("bench decode", engine.status(), trace, common.trace_path);
    }
    llm::RequestSpec spec;
    spec.prompt_ids = {1};
    spec.max_tokens = steps;
    spec.n = batch;
    spec.sampling.temperature = 0;
    spec.sampling.ignore_eos = true;
    std::vector<llm::RequestSpec> specs;
    specs.push_back(std::move(spec));
    RequestRun run = run_requests({engine->get()}, std::move(specs), "bench decode", false);
    const std::vector<llm::StepRecord> records = (*engine)->step_records();
    const uint64_t wbytes = (*engine)->weight_bytes_per_step();
    absl::Status closed = (*engine)->shutdown(base::Deadline::poll());
    for (const ChoiceResult& c : run.results[0]) {
      if (!c.error.ok()) return fail_with_trace("bench decode", c.error, trace, common.trace_path);
    }
    if (!closed.ok()) return fail_with_trace("bench decode", closed, trace, common.trace_path);
    engine->reset();
    // Steady state: the decode steps (every step after the first, which
    // prefilled the one-token prompts). Wall time per step from their span
    // (steps overlap at depth >= 2); device time per step as their median.
    std::vector<double> device_us;
    for (size_t i = 1; i < records.size(); ++i) {
      device_us.push_back((records[i].device_end_ns - records[i].device_start_ns) / 1e3);
    }
    if (device_us.empty()) device_us.push_back(0);
    std::sort(device_us.begin(), device_us.end());
    const int64_t decode_steps = std::max<int64_t>(1, static_cast<int64_t>(records.size()) - 1);
    const double decode_ms =
        records.size() > 1 ? (records.back().retire_ns - records.front().retire_ns) / 1e6 : 0;
    const double step_ms = decode_ms / decode_steps;
    const double dev_ms = device_us[device_us.size() / 2] / 1e3;
    const double tok_s = decode_ms > 0 ? batch * decode_steps / (decode_ms / 1e3) : 0;
    const double weight_bw = dev_ms > 0 ? wbytes / (dev_ms / 1e3) : 0;
    const double gflops =
        dev_ms > 0 ? 2.0 * batch * matrix_macs_per_row(*config) / (dev_ms / 1e3) / 1e9 : 0;
    const DepthStats depth = depth_stats(records);
    nlohmann::json out = {
        {"model", model},
        {"batch", batch},
        {"steps", steps},
        {"launch_depth", common.launch_depth},
        {"kernel_isa", llm::name_of(llm::resolve_kernel_isa(common.kernel_isa()))},
        {"precision",
         llm::name_of(llm::effective_precision(common.kernel_isa(), common.precision()))},
        {"step_ms", step_ms},
        {"device_step_ms_p50", dev_ms},
        {"effective_depth", depth.effective_depth},
        {"tokens_per_s", tok_s},
        {"weight_bytes_per_step", wbytes},
        {"weight_gb_per_s", weight_bw / 1e9},
        {"read_gb_per_s", read_bw / 1e9},
        {"fraction_of_read_bandwidth", weight_bw / read_bw},
        {"gflop_per_s", gflops}};
    if (compare_torch) {
      auto peer = run_torch_peer(
          model, {"--batch", std::to_string(batch), "--steps", std::to_string(steps - 1)},
          base::hardware_threads());
      if (!peer.ok()) return fail("bench decode", peer.status());
      const double torch_ms = (*peer)["decode_step_ms"].get<double>();
      out["torch_step_ms"] = torch_ms;
      out["speedup_vs_torch"] = torch_ms / step_ms;
    }
    if (peer) {
      absl::StatusOr<double> theirs =
          peer->decode_tokens_per_s(batch, static_cast<int>(decode_steps), threads);
      if (!theirs.ok()) return fail("bench decode", theirs.status());
      out["llamacpp_tokens_per_s"] = *theirs;
      out["over_llamacpp"] = tok_s / *theirs;
      out["llamacpp_cpu_variant"] = peer->cpu_variant();
    }
    if (common.json) {
      std::printf("%s\n", base::dump_replacing(out).c_str());
    } else {
      std::printf(
          "decode: batch %d on %s, depth %d (effective %.2f): step %.3f ms (device %.3f ms), "
          "%.1f tokens/s, %.1f GFLOP/s; weights %.1f MB/step read at %.2f GB/s = %.1f%% of the "
          "read-bandwidth probe's %.2f GB/s\n",
          batch, llm::name_of(llm::resolve_kernel_isa(common.kernel_isa())), common.launch_depth,
          depth.effective_depth, step_ms, dev_ms, tok_s, gflops, wbytes / 1e6, weight_bw / 1e9,
          100 * weight_bw / read_bw, read_bw / 1e9);
      if (compare_torch) {
        std::printf(
            "  PyTorch eager (f32, %d threads): %.3f ms per step; simpler is %.2fx faster\n",
            base::hardware_threads(), out["torch_step_ms"].get<double>(),
            out["speedup_vs_torch"].get<double>());
      }
      if (peer) {
        std::printf(
            "  llama.cpp (ggml CPU variant %s, %d threads): %.1f tokens/s; simpler / "
            "llama.cpp = %.2f\n",
            peer->cpu_variant().c_str(), threads, out["llamacpp_tokens_per_s"].get<double>(),
            out["over_llamacpp"].get<double>());
      }
    }
  }
  return write_trace(trace, common.trace_path) ? 0 : 1;
}

}  // namespace simpler::cli
