// `simpler make-model`, `simpler generate` and `simpler bench decode`.
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <limits>
#include <optional>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "cli/commands.h"
#include "nlohmann/json.hpp"
#include "simpler/base/clock.h"
#include "simpler/base/json.h"
#include "simpler/base/status.h"
#include "simpler/llm/engine.h"
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

Runner add_generate_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("generate", "greedy-decode prompts with a Qwen3 model");
  struct State {
    std::string model, prompt, prompt_ids, prompts_file;
    bool chat = false, ignore_eos = false, host_sampling = false, allow_unused_tensors = false;
    int32_t max_new_tokens = 32;
    int32_t requests = 1;
    int32_t page_size = 16;
    int32_t num_pages = 0;
    std::string dump_logits_steps, dump_kv_positions;
    CommonOptions common;
  };
  auto st = std::make_shared<State>();
  cmd->add_option("--model", st->model, "model directory (Hugging Face layout)")->required();
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
  cmd->add_option("--requests", st->requests, "clone requests of the one prompt")
      ->check(int_in(1, kMaxRequests));
  cmd->add_option("--page-size", st->page_size, "KV cache page size in tokens")
      ->check(int_in(1, kMaxPageSize));
  cmd->add_option("--num-pages", st->num_pages, "KV cache pages (0 = sized from the requests)")
      ->check(int_in(0, std::numeric_limits<int32_t>::max()));
  cmd->add_flag("--allow-unused-tensors", st->allow_unused_tensors,
                "accept a checkpoint holding tensors the config does not use (extra heads)");
  cmd->add_flag("--ignore-eos", st->ignore_eos, "do not stop at stop ids");
  cmd->add_flag("--host-sampling", st->host_sampling,
                "sample on the host from logits read back every step (falls back to serial "
                "launch: the next step needs the host's token first)");
  cmd->add_option("--dump-logits-steps", st->dump_logits_steps,
                  "with --json: include logits at these decode steps (0 = first token)");
  cmd->add_option("--dump-kv-positions", st->dump_kv_positions,
                  "with --json: include K/V read back from the page pool at these positions");
  st->common.add_to(cmd);
  return [cmd, st, p1, p2, p3]() -> int {
    if (!cmd->parsed()) return -1;
    if (p1->count() + p2->count() + p3->count() == 0) {
      return fail("generate", absl::InvalidArgumentError(
                                  "one of --prompt, --prompt-ids or --prompts-file is required"));
    }
    // Tokenizer: from the model directory; required only for text prompts.
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
    // The distinct prompts, 64-bit until checked against the model; each runs `clones` times.
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
    std::vector<std::vector<int32_t>> prompts;
    prompts.reserve(unique.size() * clones);
    for (const auto& ids : unique) {
      // In [0, vocab_size), and vocab_size fits int32 (checked by the config).
      std::vector<int32_t> narrow_ids(ids.begin(), ids.end());
      for (int32_t c = 0; c < clones; ++c) prompts.push_back(narrow_ids);
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

    base::TraceRecorder trace;
    llm::EngineOptions eo;
    eo.worker = st->common.worker_options(&trace);
    eo.page_size = st->page_size;
    eo.allow_unused_tensors = st->allow_unused_tensors;
    const int32_t pages =
        st->num_pages > 0 ? st->num_pages
                          : llm::Qwen3Engine::pages_for(prompts, st->max_new_tokens, st->page_size);
    const int64_t t0 = base::now_ns();
    auto engine =
        llm::Qwen3Engine::create(st->model, eo, static_cast<int32_t>(prompts.size()), pages);
    if (!engine.ok()) {
      return fail_with_trace("generate", engine.status(), trace, st->common.trace_path);
    }
    const double load_s = (base::now_ns() - t0) / 1e9;
    std::cerr << "simpler generate: loaded " << st->model << " in " << load_s << " s; "
              << prompts.size() << " request(s), " << pages << " KV pages of " << st->page_size
              << " tokens, launch depth " << st->common.launch_depth << "\n";

    llm::GenerateOptions go;
    go.max_new_tokens = st->max_new_tokens;
    if (!st->ignore_eos) {
      for (int64_t id : (*engine)->config().stop_ids())
        go.stop_ids.insert(static_cast<int32_t>(id));
    }
    go.host_sampling = st->host_sampling;
    go.logits_steps = to_set<int32_t>(logit_steps_v);
    go.kv_positions = to_set<int64_t>(kv_pos_v);
    int64_t last_report = base::now_ns();
    go.progress = [&](int64_t step, int64_t bound) {
      const int64_t now = base::now_ns();
      if (now - last_report > 1'000'000'000) {
        std::cerr << "simpler generate: step " << step << " of at most " << bound << "\n";
        last_report = now;
      }
    };
    auto res = (*engine)->generate(prompts, go);
    // On a failure the error is known: close at once (steps still in flight
    // are cancelled instead of waited out).
    absl::Status closed =
        (*engine)->close(res.ok() ? base::Deadline::forever() : base::Deadline::poll());
    if (!res.ok()) return fail_with_trace("generate", res.status(), trace, st->common.trace_path);
    if (!closed.ok()) return fail_with_trace("generate", closed, trace, st->common.trace_path);
    const auto& stats = res->stats;
    const double tok_s = stats.total_ms > 0 ? stats.generated_tokens / (stats.total_ms / 1e3) : 0;
    std::cerr << "simpler generate: " << stats.steps << " steps, " << stats.prompt_tokens
              << " prompt + " << stats.generated_tokens << " generated tokens in " << stats.total_ms
              << " ms (prefill " << stats.prefill_ms << " ms, decode " << stats.decode_ms << " ms, "
              << tok_s << " generated tokens/s; launch depth " << stats.requested_depth
              << ", effective " << stats.effective_depth << ", up to " << stats.max_steps_in_flight
              << " steps in flight"
              << (stats.serial_launch ? ", serial launch for host sampling" : "") << ")\n";

    if (st->common.json) {
      nlohmann::json reqs = nlohmann::json::array();
      for (const auto& r : res->requests) {
        nlohmann::json j = {{"prompt_ids", r.prompt_ids},
                            {"tokens", r.tokens},
                            {"finish_reason", r.finish_reason},
                            {"pages", r.pages}};
        j["text"] = tok ? nlohmann::json(tok->decode(r.tokens)) : nlohmann::json(nullptr);
        if (!r.status.ok()) j["error"] = std::string(r.status.message());
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
      nlohmann::json out = {{"model", st->model},
                            {"requests", reqs},
                            {"timing",
                             {{"load_s", load_s},
                              {"total_ms", stats.total_ms},
                              {"prefill_ms", stats.prefill_ms},
                              {"decode_ms", stats.decode_ms},
                              {"steps", stats.steps},
                              {"prompt_tokens", stats.prompt_tokens},
                              {"generated_tokens", stats.generated_tokens},
                              {"generated_tokens_per_s", tok_s}}},
                            {"launch_depth", st->common.launch_depth},
                            {"effective_depth", stats.effective_depth},
                            {"max_steps_in_flight", stats.max_steps_in_flight},
                            {"serial_launch", stats.serial_launch},
                            {"host_sampling", st->host_sampling}};
      std::string dumped = base::dump_replacing(out);
      std::printf("%s\n", dumped.c_str());
    } else {
      for (size_t i = 0; i < res->requests.size(); ++i) {
        const auto& r = res->requests[i];
        if (res->requests.size() > 1)
          std::printf("--- request %zu (%s)\n", i, r.finish_reason.c_str());
        if (!r.status.ok()) {
          std::printf("error: %s\n", std::string(r.status.message()).c_str());
        } else if (tok) {
          std::printf("%s\n", tok->decode(r.tokens).c_str());
        } else {
          for (size_t k = 0; k < r.tokens.size(); ++k)
            std::printf("%s%d", k ? "," : "", r.tokens[k]);
          std::printf("\n");
        }
      }
    }
    // Every request's result is printed first; a refused or failed request
    // makes the call fail.
    int failed = 0;
    for (size_t i = 0; i < res->requests.size(); ++i) {
      if (res->requests[i].status.ok()) continue;
      ++failed;
      std::cerr << "simpler generate: request " << i << " failed: " << res->requests[i].status
                << "\n";
    }
    if (!write_trace(trace, st->common.trace_path)) return 1;
    return failed > 0 ? 1 : 0;
  };
}

int run_bench_decode(const std::string& model, const CommonOptions& common, int steps, int batch,
                     bool allow_unused_tensors) {
  base::TraceRecorder trace;
  llm::EngineOptions eo;
  eo.worker = common.worker_options(&trace);
  eo.allow_unused_tensors = allow_unused_tensors;
  std::vector<std::vector<int32_t>> prompts(batch, std::vector<int32_t>{1});
  // The steps must fit the model's positions before the KV pool is sized for them.
  auto config = llm::ModelConfig::load(model);
  if (!config.ok()) return fail("bench decode", config.status());
  const std::vector<int64_t> prompt = {1};
  if (absl::Status s = config->check_request(prompt, steps); !s.ok()) {
    return fail("bench decode", base::annotate(s, "--steps: "));
  }
  const int32_t pages = llm::Qwen3Engine::pages_for(prompts, steps, eo.page_size);
  auto engine = llm::Qwen3Engine::create(model, eo, batch, pages);
  if (!engine.ok())
    return fail_with_trace("bench decode", engine.status(), trace, common.trace_path);
  llm::GenerateOptions go;
  go.max_new_tokens = steps;
  auto res = (*engine)->generate(prompts, go);
  absl::Status closed =
      (*engine)->close(res.ok() ? base::Deadline::forever() : base::Deadline::poll());
  if (!res.ok()) return fail_with_trace("bench decode", res.status(), trace, common.trace_path);
  if (!closed.ok()) return fail_with_trace("bench decode", closed, trace, common.trace_path);
  // memcpy bandwidth in this process, same run: copy a buffer the size of the weights (capped).
  const uint64_t wbytes = (*engine)->weight_bytes_per_step();
  const size_t bytes = static_cast<size_t>(std::min<uint64_t>(wbytes, 512ull << 20));
  std::vector<char> src(bytes, 1), dst(bytes, 0);
  double best_memcpy_s = 1e30;
  for (int i = 0; i < 5; ++i) {
    const int64_t t0 = base::now_ns();
    std::memcpy(dst.data(), src.data(), bytes);
    best_memcpy_s = std::min(best_memcpy_s, (base::now_ns() - t0) / 1e9);
  }
  const double memcpy_bw = bytes / best_memcpy_s;
  // Steady state: the decode phase (after every request's first token). Wall
  // time per step from the phase's duration (steps overlap at depth >= 2);
  // device time per step as the median over those steps.
  const auto& stats = res->stats;
  const int64_t decode_steps = std::max<int64_t>(1, steps - 1);
  std::vector<double> device_us(stats.device_step_us.end() - decode_steps,
                                stats.device_step_us.end());
  std::sort(device_us.begin(), device_us.end());
  const double step_ms = stats.decode_ms / decode_steps;
  const double dev_ms = device_us[device_us.size() / 2] / 1e3;
  const double tok_s = batch * decode_steps / (stats.decode_ms / 1e3);
  const double weight_bw = wbytes / (dev_ms / 1e3);
  nlohmann::json out = {{"model", model},
                        {"batch", batch},
                        {"steps", steps},
                        {"launch_depth", common.launch_depth},
                        {"step_ms", step_ms},
                        {"device_step_ms_p50", dev_ms},
                        {"effective_depth", stats.effective_depth},
                        {"tokens_per_s", tok_s},
                        {"weight_bytes_per_step", wbytes},
                        {"weight_gb_per_s", weight_bw / 1e9},
                        {"memcpy_gb_per_s", memcpy_bw / 1e9},
                        {"fraction_of_memcpy", weight_bw / memcpy_bw}};
  if (common.json) {
    std::printf("%s\n", base::dump_replacing(out).c_str());
  } else {
    std::printf(
        "decode: batch %d, depth %d (effective %.2f): step %.3f ms (device %.3f ms), %.1f "
        "tokens/s; weights %.1f MB/step streamed at %.2f GB/s = %.1f%% of memcpy %.2f GB/s\n",
        batch, common.launch_depth, stats.effective_depth, step_ms, dev_ms, tok_s, wbytes / 1e6,
        weight_bw / 1e9, 100 * weight_bw / memcpy_bw, memcpy_bw / 1e9);
  }
  return write_trace(trace, common.trace_path) ? 0 : 1;
}

}  // namespace simpler::cli
