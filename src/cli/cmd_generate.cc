// `simpler generate`: prompts through LlmEngines (continuous batching), one per sim chip, every
// request's result printed.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <limits>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "cli/commands.h"
#include "cli/engine_flags.h"
#include "cli/prompts_file.h"
#include "cli/request_run.h"
#include "nlohmann/json.hpp"
#include "simpler/base/clock.h"
#include "simpler/base/json.h"
#include "simpler/base/status.h"
#include "simpler/engine/data_parallel.h"
#include "simpler/engine/kv_pages.h"
#include "simpler/engine/llm_engine.h"
#include "simpler/engine/model_files.h"
#include "simpler/hierarchy/l3_worker.h"
#include "simpler/model/model_config.h"
#include "simpler/tokenizer/tokenizer.h"

namespace simpler::cli {

namespace {

// Comma-separated integers (token ids, steps, positions), kept 64-bit: callers range-check
// them before narrowing. An empty (or all-blank) `text` is no integers; an empty item between
// commas ("1,,2", "1,2,") is refused.
absl::StatusOr<std::vector<int64_t>> parse_ids(const std::string& text, const std::string& what) {
  std::vector<int64_t> ids;
  if (absl::StripAsciiWhitespace(text).empty()) return ids;
  int64_t index = 0;
  for (absl::string_view part : absl::StrSplit(text, ',')) {
    const absl::string_view item = absl::StripAsciiWhitespace(part);
    if (item.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": item ", index, " of '", text.substr(0, 60), "' is empty (expected an integer)"));
    }
    int64_t v;
    if (!absl::SimpleAtoi(item, &v)) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": '", std::string(item.substr(0, 40)), "' is not a 64-bit integer"));
    }
    ids.push_back(v);
    ++index;
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

// The prompts of a --prompts-file: one JSON object per non-blank line, {"prompt": "text"} (given
// to `encode`) or {"prompt_ids": [ids]}, each with its "file:line" in `where`. Errors name
// file:line; ids stay 64-bit.
absl::StatusOr<std::vector<std::vector<int64_t>>> read_prompts_file(
    const std::string& path,
    const std::function<absl::StatusOr<std::vector<int64_t>>(const std::string&)>& encode,
    std::vector<std::string>* where_of) {
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
    where_of->push_back(where);
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

constexpr const char* kGenerateCommand = "generate";

// The values of `generate`'s flags. Owned by the command's runner; thread-compatible.
struct GenerateFlags {
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
  // Which of the optional flags were given (their CLI11 counts, set when the command runs).
  bool has_prompt = false, has_prompt_ids = false, has_prompts_file = false, has_seed = false;
};

// The model's tokenizer where its directory or GGUF file has one (text prompts and stop strings
// need it).
struct MaybeTokenizer {
  std::optional<llm::Tokenizer> tok;
  absl::Status status;  // why there is none
  // With --chat: the model's chat template (load_model_chat_template), as serve renders chats.
  std::optional<llm::ChatTemplate> chat;
};

MaybeTokenizer load_tokenizer(const std::string& model) {
  MaybeTokenizer t;
  auto loaded = llm::load_model_tokenizer(model);
  if (loaded.ok()) {
    t.tok.emplace(std::move(*loaded));
  } else {
    t.status = loaded.status();
  }
  return t;
}

// The requests of one call, checked against the model: the distinct prompts (each with `clones`
// choices) and the positions to dump. A prompts-file request the model refuses is kept with its
// refusal: it is reported failed and not run.
struct Requests {
  llm::ModelConfig config;
  std::vector<std::vector<int64_t>> unique;  // 64-bit until checked against the model
  std::vector<std::string> where;            // per prompt: its "file:line", or empty
  std::vector<absl::Status> refused;         // per prompt: OK, or why the model refuses it
  int32_t clones = 1;
  std::vector<int32_t> logit_steps, kv_positions;
  int64_t total_choices() const { return static_cast<int64_t>(unique.size()) * clones; }
  bool runs(size_t r) const { return refused[r].ok(); }
};

// The distinct prompts of --prompt, --prompt-ids or --prompts-file, into `req`.
absl::Status read_prompts(const GenerateFlags& st, const MaybeTokenizer& tok, Requests* req) {
  auto encode = [&](const std::string& text) -> absl::StatusOr<std::vector<int64_t>> {
    if (!tok.tok) return tok.status;
    std::string prompt = text;
    if (st.chat) {
      llm::ChatMessage turn;
      turn.role = "user";
      turn.content = text;
      SIMPLER_ASSIGN_OR_RETURN(prompt, tok.chat->render({turn}));
    }
    auto ids = tok.tok->try_encode(prompt);
    if (!ids.ok()) return ids.status();
    return std::vector<int64_t>(ids->begin(), ids->end());
  };
  if (st.has_prompt) {
    SIMPLER_ASSIGN_OR_RETURN(std::vector<int64_t> ids, encode(st.prompt));
    req->unique.push_back(std::move(ids));
    req->clones = st.requests;
  } else if (st.has_prompt_ids) {
    SIMPLER_ASSIGN_OR_RETURN(std::vector<int64_t> ids, parse_ids(st.prompt_ids, "--prompt-ids"));
    req->unique.push_back(std::move(ids));
    req->clones = st.requests;
  } else {
    SIMPLER_ASSIGN_OR_RETURN(req->unique, read_prompts_file(st.prompts_file, encode, &req->where));
  }
  req->where.resize(req->unique.size());
  return absl::OkStatus();
}

// --dump-logits-steps and --dump-kv-positions, into `req`.
absl::Status read_dump_positions(const GenerateFlags& st, Requests* req) {
  auto a = parse_ids(st.dump_logits_steps, "--dump-logits-steps");
  auto b = parse_ids(st.dump_kv_positions, "--dump-kv-positions");
  SIMPLER_RETURN_IF_ERROR(a.status());
  SIMPLER_RETURN_IF_ERROR(b.status());
  constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();
  // A step at or past --max-new-tokens is never run (a request that stops early skips the later
  // ones too; those are absent from its output).
  for (int64_t step : *a) {
    if (step >= st.max_new_tokens) {
      return absl::InvalidArgumentError(
          absl::StrCat("--dump-logits-steps: step ", step, " is never run: --max-new-tokens ",
                       st.max_new_tokens, " runs steps 0 to ", st.max_new_tokens - 1));
    }
  }
  auto na = narrow(*a, "--dump-logits-steps", 0, kInt32Max);
  auto nb = narrow(*b, "--dump-kv-positions", 0, kInt32Max);
  SIMPLER_RETURN_IF_ERROR(na.status());
  SIMPLER_RETURN_IF_ERROR(nb.status());
  req->logit_steps = *std::move(na);
  req->kv_positions = *std::move(nb);
  return absl::OkStatus();
}

// The call's requests, every one validated against the model before anything is sized for it,
// and the model's tokenizer into `tok`. Text prompts (--prompt, or a prompts file's lines) need
// the tokenizer first; --prompt-ids are checked against config.json before it loads, so that a
// refused call does not wait for the tokenizer (11 MB of JSON for Qwen3, most of such a call).
// Says on stderr when output text is omitted for want of a tokenizer.
absl::StatusOr<Requests> read_requests(const GenerateFlags& st, MaybeTokenizer* tok_out) {
  Requests req;
  MaybeTokenizer& tok = *tok_out;
  if (st.chips > 1 && !st.engine.common.trace_path.empty()) {
    // The runs are the children's (their own processes or workers): this process's recorder
    // would write a trace of no span.
    return absl::InvalidArgumentError(
        "--trace records this process's device, and with --chips > 1 the steps run on the "
        "children's: run it with --chips 1");
  }
  if (!st.has_prompt_ids) tok = load_tokenizer(st.model);
  if (st.chat && !st.has_prompt_ids) {
    // The model's own template, refused as serve refuses it (a GGUF file's that differs from the
    // one rendered natively), so that both commands give the same prompt or the same refusal.
    absl::StatusOr<llm::ChatTemplate> chat = llm::load_model_chat_template(st.model);
    if (!chat.ok()) return base::annotate(chat.status(), "--chat: ");
    tok.chat.emplace(*std::move(chat));
  }
  SIMPLER_RETURN_IF_ERROR(read_prompts(st, tok, &req));
  SIMPLER_ASSIGN_OR_RETURN(req.config, llm::ModelConfig::load(st.model));
  // A refused --prompt / --prompt-ids fails the call; a refused prompts-file line fails its
  // request only (unless it refuses them all).
  int64_t running = 0;
  for (size_t r = 0; r < req.unique.size(); ++r) {
    absl::Status s = req.config.check_request(req.unique[r], st.max_new_tokens);
    if (!s.ok() && req.where[r].empty()) {
      return base::annotate(s, absl::StrCat("request ", r, ": "));
    }
    req.refused.push_back(
        s.ok() ? s : base::annotate(s, absl::StrCat(req.where[r], ": ")));  // file:line names it
    running += s.ok() ? 1 : 0;
  }
  if (running == 0) return req.refused.front();
  if (st.has_prompt_ids) tok = load_tokenizer(st.model);
  if (!st.stop.empty() && !tok.tok) {
    return base::annotate(tok.status, "--stop needs the model's tokenizer: ");
  }
  if (!tok.tok) {
    std::cerr << "simpler generate: no tokenizer (" << tok.status.message()
              << "); output text is omitted\n";
  }
  SIMPLER_RETURN_IF_ERROR(read_dump_positions(st, &req));
  if (st.chips > 1 && !req.kv_positions.empty()) {
    return absl::InvalidArgumentError(
        "--dump-kv-positions reads the KV pool back, and with --chips > 1 it lives in a child's "
        "device memory: run it with --chips 1");
  }
  return req;
}

// The engine options: request r runs on chip r % chips (all its choices together); every chip
// gets the limits and the pool of the busiest one.
absl::StatusOr<llm::EngineOptions> generate_engine_options(const GenerateFlags& st,
                                                           const Requests& req,
                                                           const MaybeTokenizer& tok,
                                                           base::TraceRecorder* trace) {
  std::vector<int64_t> chip_choices(st.chips, 0), chip_pages(st.chips, 0);
  int64_t k = 0;  // the index among the requests that run
  for (size_t r = 0; r < req.unique.size(); ++r) {
    if (!req.runs(r)) continue;
    const int64_t chip = k++ % st.chips;
    chip_choices[chip] += req.clones;
    chip_pages[chip] += req.clones * llm::pages_needed(static_cast<int64_t>(req.unique[r].size()) +
                                                           st.max_new_tokens,
                                                       st.engine.page_size);
  }
  EngineLoad load;
  load.requests = *std::max_element(chip_choices.begin(), chip_choices.end());
  load.together = req.clones;
  load.pages = *std::max_element(chip_pages.begin(), chip_pages.end());
  SIMPLER_ASSIGN_OR_RETURN(llm::EngineOptions eo, engine_options(st.engine, load, trace));
  eo.max_waiting = static_cast<int32_t>(std::max<int64_t>(req.total_choices(), 1));
  eo.tokenizer = tok.tok ? &*tok.tok : nullptr;
  eo.record_steps = true;
  return eo;
}

// The engines of one call: one over its own worker, or one per child of an L3 worker (then the
// engines go before the worker). Owner-thread only.
struct Engines {
  std::unique_ptr<hierarchy::L3Worker> l3;
  std::vector<std::unique_ptr<llm::LlmEngine>> engines;
};

// The engines of --chips > 1: an L3 worker whose children each load the model (forked first,
// while this process is single-threaded), one engine per child. 0 when they started, else the
// exit code after printing the error.
int start_chip_engines(const GenerateFlags& st, const llm::EngineOptions& eo, const Requests& req,
                       const base::TraceRecorder& trace, Engines* out) {
  const int32_t chips = st.chips;
  hierarchy::L3Options lo;
  lo.device_ids.clear();
  for (int32_t c = 0; c < chips; ++c) lo.device_ids.push_back(c);
  lo.child_mode = *hierarchy::parse_child_mode(st.child_mode);
  lo.child = eo.runner.worker;
  // Every engine keeps up to launch_depth steps in flight.
  lo.launch_depth = std::min(16, chips * std::max(1, st.engine.common.launch_depth));
  // Each step stages its host tensors (and its logits when read back) in the shared heap;
  // reserved lazily, so the bound costs nothing until used.
  const bool logits_back = st.engine.host_sampling || !req.logit_steps.empty();
  lo.host_heap_bytes =
      (64ull << 20) + (logits_back ? static_cast<uint64_t>(lo.launch_depth + chips) *
                                         eo.runner.max_num_seqs * req.config.vocab_size * 4
                                   : 0);
  out->l3 = std::make_unique<hierarchy::L3Worker>(lo);
  auto dp = llm::LlmDataParallel::prepare(*out->l3, st.model, eo.runner);
  if (!dp.ok()) return fail(kGenerateCommand, dp.status());
  if (absl::Status s = out->l3->init(); !s.ok()) return fail(kGenerateCommand, s);
  std::string children;
  for (const std::string& c : out->l3->describe_children()) {
    absl::StrAppend(&children, children.empty() ? "" : ", ", c);
  }
  std::cerr << "simpler generate: children: " << children << "\n";
  for (int32_t c = 0; c < chips; ++c) {
    auto engine = (*dp)->create_engine(c, eo);
    if (!engine.ok()) {
      out->engines.clear();
      (void)out->l3->close();
      return fail_with_trace(kGenerateCommand, engine.status(), trace, st.engine.common.trace_path);
    }
    out->engines.push_back(std::move(*engine));
  }
  return 0;
}

// One chip: an engine over its own worker. Several: start_chip_engines. 0 when they started,
// else the exit code after printing the error.
int start_engines(const GenerateFlags& st, const llm::EngineOptions& eo, const Requests& req,
                  const base::TraceRecorder& trace, Engines* out) {
  if (st.chips > 1) return start_chip_engines(st, eo, req, trace, out);
  auto engine = llm::LlmEngine::create(st.model, eo);
  if (!engine.ok()) {
    return fail_with_trace(kGenerateCommand, engine.status(), trace, st.engine.common.trace_path);
  }
  out->engines.push_back(std::move(*engine));
  return 0;
}

void print_started(const GenerateFlags& st, const llm::EngineOptions& eo, const Requests& req,
                   double load_s) {
  const bool one = st.chips == 1;
  std::cerr << "simpler generate: " << (one ? "loaded " : "started ") << st.model << " in "
            << load_s << " s"
            << (one ? std::string()
                    : absl::StrCat(" on ", st.chips, " chips (", st.child_mode,
                                   " children, each loading the model itself)"))
            << "; " << req.total_choices() << " request(s), " << eo.runner.num_pages
            << " KV pages of " << eo.runner.page_size << " tokens" << (one ? "" : " per chip")
            << ", launch depth " << st.engine.common.launch_depth << ", max_num_seqs "
            << eo.runner.max_num_seqs << ", max_num_batched_tokens "
            << eo.runner.max_num_batched_tokens << "; the sim device, kernels "
            << llm::name_of(llm::resolve_kernel_isa(eo.runner.kernel_isa)) << " at precision "
            << llm::name_of(llm::effective_precision(eo.runner.kernel_isa, eo.runner.precision))
            << "\n";
}

// One spec per distinct prompt that runs, in order.
std::vector<llm::RequestSpec> request_specs(const GenerateFlags& st, const Requests& req) {
  std::vector<llm::RequestSpec> specs;
  for (size_t r = 0; r < req.unique.size(); ++r) {
    if (!req.runs(r)) continue;
    const std::vector<int64_t>& ids = req.unique[r];
    llm::RequestSpec spec;
    spec.prompt_ids.assign(ids.begin(), ids.end());  // in [0, vocab_size): checked above
    spec.max_tokens = st.max_new_tokens;
    spec.n = req.clones;
    spec.sampling.temperature = st.temperature;
    spec.sampling.top_p = st.top_p;
    spec.sampling.top_k = st.top_k;
    spec.sampling.min_p = st.min_p;
    if (st.has_seed) spec.sampling.seed = st.seed;
    spec.sampling.ignore_eos = st.ignore_eos;
    spec.sampling.stop = st.stop;
    // Always: the --json report names every choice's pages.
    auto hooks = std::make_shared<llm::RequestHooks>();
    hooks->logits_tokens = std::set<int64_t>(req.logit_steps.begin(), req.logit_steps.end());
    hooks->kv_positions = std::set<int64_t>(req.kv_positions.begin(), req.kv_positions.end());
    spec.hooks = std::move(hooks);
    specs.push_back(std::move(spec));
  }
  return specs;
}

// The results of the requests that did not run: every choice failed with its refusal (empty for
// a request that ran).
std::vector<std::vector<ChoiceResult>> refused_results(const Requests& req) {
  std::vector<std::vector<ChoiceResult>> out(req.unique.size());
  for (size_t r = 0; r < req.unique.size(); ++r) {
    if (req.runs(r)) continue;
    out[r].resize(req.clones);
    for (ChoiceResult& c : out[r]) {
      c.finish_reason = "error";
      c.error = req.refused[r];
      c.done = true;
    }
  }
  return out;
}

// What the engines did, read before they shut down, and how the shutdown went.
struct EngineTotals {
  int64_t generated = 0, preemptions = 0;
  DepthStats depth;
  absl::Status closed;  // the first shutdown error
};

// Reads the engines' totals, then shuts every engine down and closes the L3 worker.
EngineTotals close_engines(Engines* e) {
  EngineTotals t;
  std::vector<llm::StepRecord> records;
  for (auto& engine : e->engines) {
    const llm::EngineMetrics m = engine->metrics();
    t.generated += m.generation_tokens_total;
    t.preemptions += m.preemptions_total;
    for (const llm::StepRecord& r : engine->step_records()) records.push_back(r);
  }
  t.depth = depth_stats(records);
  for (auto& engine : e->engines) {
    absl::Status s = engine->shutdown(base::Deadline::poll());
    if (t.closed.ok()) t.closed = s;
  }
  e->engines.clear();
  if (e->l3) {
    absl::Status s = e->l3->close();
    if (t.closed.ok()) t.closed = s;
  }
  return t;
}

// Everything `generate` prints: per choice in request order, and the call's totals.
struct Report {
  struct Item {
    const std::vector<int64_t>* prompt;
    const ChoiceResult* c;
    int32_t chip;  // -1: a refused request, run on none
  };
  std::vector<Item> items;
  EngineTotals totals;
  double load_s = 0, total_ms = 0, prefill_ms = 0, decode_ms = 0, tokens_per_s = 0;
  int64_t prompt_tokens = 0;
  int64_t cached_tokens = 0;  // of prompt_tokens, served by the prefix cache
  bool has_text = false;      // a tokenizer decoded the tokens
};

// `run` holds the results of the requests that ran; `refused` those of the others, one per
// choice, in request order.
Report make_report(const RequestRun& run, const std::vector<std::vector<ChoiceResult>>& refused,
                   const Requests& req, int32_t chips, EngineTotals totals, double load_s,
                   bool has_text) {
  Report rep;
  size_t ran = 0;
  for (size_t r = 0; r < req.unique.size(); ++r) {
    const std::vector<ChoiceResult>& choices = req.runs(r) ? run.results[ran] : refused[r];
    const int32_t chip = req.runs(r) ? static_cast<int32_t>(ran % chips) : -1;
    ran += req.runs(r) ? 1 : 0;
    for (const ChoiceResult& c : choices) rep.items.push_back({&req.unique[r], &c, chip});
  }
  rep.totals = std::move(totals);
  rep.load_s = load_s;
  rep.total_ms = (run.end_ns - run.start_ns) / 1e6;
  rep.prefill_ms = (run.all_first_token_ns - run.start_ns) / 1e6;
  rep.decode_ms = (run.end_ns - run.all_first_token_ns) / 1e6;
  rep.tokens_per_s = rep.total_ms > 0 ? rep.totals.generated / (rep.total_ms / 1e3) : 0;
  for (const Report::Item& it : rep.items) {
    if (it.chip >= 0) rep.prompt_tokens += static_cast<int64_t>(it.prompt->size());
    if (it.chip >= 0) rep.cached_tokens += it.c->cached_tokens;
  }
  rep.has_text = has_text;
  return rep;
}

void print_summary(const GenerateFlags& st, const Report& rep) {
  const DepthStats& depth = rep.totals.depth;
  std::cerr << "simpler generate: " << depth.steps << " steps, " << rep.prompt_tokens
            << " prompt + " << rep.totals.generated << " generated tokens in " << rep.total_ms
            << " ms (prefill " << rep.prefill_ms << " ms, decode " << rep.decode_ms << " ms, "
            << rep.tokens_per_s << " generated tokens/s; launch depth "
            << st.engine.common.launch_depth << ", effective " << depth.effective_depth
            << ", up to " << depth.max_steps_in_flight << " steps in flight"
            << (st.engine.host_sampling ? ", serial launch for host sampling" : "") << "; "
            << rep.totals.preemptions << " preemptions)\n";
}

nlohmann::json choice_json(const Report::Item& it, bool has_text) {
  const ChoiceResult& r = *it.c;
  nlohmann::json j = {{"prompt_ids", *it.prompt},         {"tokens", r.tokens},
                      {"finish_reason", r.finish_reason}, {"pages", r.pages},
                      {"page_steps", r.page_steps},       {"last_step", r.last_step},
                      {"cached_tokens", r.cached_tokens}};
  j["text"] = has_text ? nlohmann::json(r.text) : nlohmann::json(nullptr);
  j["chip"] = it.chip >= 0 ? nlohmann::json(it.chip) : nlohmann::json(nullptr);
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
  return j;
}

void print_json(const GenerateFlags& st, const llm::EngineOptions& eo, const Report& rep) {
  nlohmann::json reqs = nlohmann::json::array();
  for (const Report::Item& it : rep.items) reqs.push_back(choice_json(it, rep.has_text));
  const CommonOptions& common = st.engine.common;
  const bool host_sampling = st.engine.host_sampling;
  nlohmann::json out = {
      {"model", st.model},
      {"requests", reqs},
      {"timing",
       {{"load_s", rep.load_s},
        {"total_ms", rep.total_ms},
        {"prefill_ms", rep.prefill_ms},
        {"decode_ms", rep.decode_ms},
        {"steps", rep.totals.depth.steps},
        {"prompt_tokens", rep.prompt_tokens},
        {"cached_prompt_tokens", rep.cached_tokens},
        {"generated_tokens", rep.totals.generated},
        {"generated_tokens_per_s", rep.tokens_per_s}}},
      {"launch_depth", common.launch_depth},
      {"effective_depth", rep.totals.depth.effective_depth},
      {"max_steps_in_flight", rep.totals.depth.max_steps_in_flight},
      {"serial_launch", host_sampling},
      {"host_sampling", host_sampling},
      {"preemptions", rep.totals.preemptions},
      {"prefix_caching", st.engine.enable_prefix_caching},
      {"chips", st.chips},
      {"child_mode", st.chips > 1 ? nlohmann::json(st.child_mode) : nlohmann::json(nullptr)},
      {"max_num_seqs", eo.runner.max_num_seqs},
      {"max_num_batched_tokens", eo.runner.max_num_batched_tokens},
      {"kernel_isa", llm::name_of(llm::resolve_kernel_isa(common.kernel_isa()))},
      {"precision",
       llm::name_of(llm::effective_precision(common.kernel_isa(), common.precision()))}};
  std::string dumped = base::dump_replacing(out);
  std::printf("%s\n", dumped.c_str());
}

// Every request's result; a failed one's error is not repeated here: exit_code prints it, once,
// on stderr.
void print_text(const Report& rep) {
  for (size_t i = 0; i < rep.items.size(); ++i) {
    const ChoiceResult& r = *rep.items[i].c;
    if (rep.items.size() > 1) std::printf("--- request %zu (%s)\n", i, r.finish_reason.c_str());
    if (!r.error.ok()) continue;
    if (rep.has_text) {
      std::printf("%s\n", r.text.c_str());
    } else {
      for (size_t k = 0; k < r.tokens.size(); ++k) std::printf("%s%d", k ? "," : "", r.tokens[k]);
      std::printf("\n");
    }
  }
}

// Every request's result is printed first; a refused or failed request makes the call fail,
// its error printed once, on stderr (the last line: the last failed request's).
int exit_code(const GenerateFlags& st, const Report& rep, const base::TraceRecorder& trace) {
  int failed = 0;
  for (const Report::Item& it : rep.items) failed += it.c->error.ok() ? 0 : 1;
  if (!rep.totals.closed.ok() && failed == 0) {
    return fail_with_trace(kGenerateCommand, rep.totals.closed, trace, st.engine.common.trace_path);
  }
  if (!write_trace(trace, st.engine.common.trace_path)) return 1;
  for (size_t i = 0; i < rep.items.size(); ++i) {
    if (rep.items[i].c->error.ok()) continue;
    std::cerr << "simpler generate: request " << i << " failed: " << rep.items[i].c->error.message()
              << "\n";
  }
  return failed > 0 ? 1 : 0;
}

int run_generate(const GenerateFlags& st) {
  if (!st.has_prompt && !st.has_prompt_ids && !st.has_prompts_file) {
    return fail(
        kGenerateCommand,
        absl::InvalidArgumentError("one of --prompt, --prompt-ids or --prompts-file is required"));
  }
  MaybeTokenizer tok;
  absl::StatusOr<Requests> req = read_requests(st, &tok);
  if (!req.ok()) return fail(kGenerateCommand, req.status());
  base::TraceRecorder trace;
  absl::StatusOr<llm::EngineOptions> eo = generate_engine_options(st, *req, tok, &trace);
  if (!eo.ok()) return fail(kGenerateCommand, eo.status());
  if (st.engine.host_sampling && st.engine.common.launch_depth > 1) {
    std::cerr << "simpler generate: host sampling needs each step's logits on the host first; "
                 "falling back to serial launch (effective depth 1, requested "
              << st.engine.common.launch_depth << ")\n";
  }
  const int64_t t0 = base::now_ns();
  Engines engines;
  if (int rc = start_engines(st, *eo, *req, trace, &engines); rc != 0) return rc;
  const double load_s = (base::now_ns() - t0) / 1e9;
  print_started(st, *eo, *req, load_s);

  std::vector<llm::LlmEngine*> engine_ptrs;
  for (auto& e : engines.engines) engine_ptrs.push_back(e.get());
  RequestRun run = run_requests(engine_ptrs, request_specs(st, *req), kGenerateCommand, true);
  EngineTotals totals = close_engines(&engines);
  const std::vector<std::vector<ChoiceResult>> refused = refused_results(*req);
  const Report rep =
      make_report(run, refused, *req, st.chips, std::move(totals), load_s, tok.tok.has_value());
  print_summary(st, rep);
  if (st.engine.common.json) {
    print_json(st, *eo, rep);
  } else {
    print_text(rep);
  }
  return exit_code(st, rep, trace);
}

// The sampling flags, each bounded by the flag parser as SamplingParams::validate bounds it, so
// that a bad value is refused before the model loads.
void add_sampling_flags(CLI::App* cmd, GenerateFlags* st) {
  cmd->add_option("--temperature", st->temperature, "sampling temperature (0 = greedy)")
      ->check(number_in(0, 100))
      ->capture_default_str();
  cmd->add_option("--top-p", st->top_p, "nucleus sampling mass (1 = off)")
      ->check(number_in(0, 1, /*lo_open=*/true))
      ->capture_default_str();
  cmd->add_option("--top-k", st->top_k, "keep the k most likely tokens (0 and -1 = off)")
      ->check(int_in(-1, std::numeric_limits<int32_t>::max()))
      ->capture_default_str();
  cmd->add_option("--min-p", st->min_p,
                  "drop tokens below min-p times the top probability (0 = off)")
      ->check(number_in(0, 1))
      ->capture_default_str();
  cmd->add_option("--seed", st->seed,
                  "sampling seed for every request (default: a distinct one each)")
      ->check(uint64_in());
}

}  // namespace

Runner add_generate_command(CLI::App& app) {
  auto st = std::make_shared<GenerateFlags>();
  st->engine.max_num_seqs = 0;  // all requests
  auto* cmd = add_model_command(
      &app, "generate", "generate from prompts with a Qwen3 model (continuous batching, LlmEngine)",
      &st->model, "model directory (Hugging Face layout) or .gguf file");
  cmd->add_option("--chips", st->chips,
                  "data parallel over this many sim chips: every chip loads the model, requests "
                  "are dealt out in turn, one engine per chip (an L3 worker's children)")
      ->check(int_in(1, 16))
      ->capture_default_str();
  cmd->add_option("--child-mode", st->child_mode,
                  "with --chips > 1: process (forked children behind shared-memory mailboxes) or "
                  "thread (children in this process)")
      ->check(CLI::IsMember({"thread", "process"}))
      ->capture_default_str();
  auto* p1 = cmd->add_option("--prompt", st->prompt, "prompt text");
  auto* p2 = cmd->add_option("--prompt-ids", st->prompt_ids, "prompt token ids, e.g. 1,2,3");
  auto* p3 = cmd->add_option("--prompts-file", st->prompts_file,
                             "JSON lines, each {\"prompt\": ...} or {\"prompt_ids\": [...]}");
  p1->excludes(p2, p3);
  p2->excludes(p3);
  cmd->add_flag("--chat", st->chat,
                "wrap each text prompt as one user turn in the model's chat template (its "
                "tokenizer_config.json's or GGUF file's; refused when that is not Qwen3's, which "
                "is rendered natively, as serve refuses chat completions then)");
  cmd->add_option("--max-new-tokens", st->max_new_tokens,
                  "tokens to generate per request (prompt + this <= max_position_embeddings)")
      ->check(int_in(1, std::numeric_limits<int32_t>::max()))
      ->capture_default_str();
  cmd->add_option("--requests,-n", st->requests,
                  "choices of the one prompt (OpenAI n: clone requests, each its own RNG stream)")
      ->check(int_in(1, kMaxRequests))
      ->capture_default_str();
  add_sampling_flags(cmd, st.get());
  cmd->add_option("--stop", st->stop, "stop string (repeatable; not part of the output)")
      ->check(CLI::Validator(
          [](std::string& s) { return s.empty() ? std::string("an empty stop string") : ""; },
          "TEXT"));
  cmd->add_flag("--ignore-eos", st->ignore_eos, "do not stop at the model's EOS ids");
  cmd->add_option("--dump-logits-steps", st->dump_logits_steps,
                  "with --json: include logits at these decode steps (0 = first token; each "
                  "below --max-new-tokens; a request that stops before one has none there)");
  cmd->add_option("--dump-kv-positions", st->dump_kv_positions,
                  "with --json: include K/V read back from the page pool at these positions");
  add_engine_flags(
      cmd, &st->engine,
      {.max_num_seqs =
           "requests running at once, rows sampled per step (0 = all requests, at most 256 "
           "unless -n asks for more choices of a prompt, which run at once)",
       .max_num_batched_tokens = true,
       .page_size = true,
       .num_pages = "KV cache pages (0 = sized from the requests)",
       .allow_unused_tensors = true,
       .host_sampling = true,
       .prefix_caching = true,
       .capture = true});
  const CLI::Option* seed_opt = cmd->get_option("--seed");
  return [cmd, st, p1, p2, p3, seed_opt]() -> int {
    if (!cmd->parsed()) return -1;
    st->has_prompt = p1->count() > 0;
    st->has_prompt_ids = p2->count() > 0;
    st->has_prompts_file = p3->count() > 0;
    st->has_seed = seed_opt->count() > 0;
    return run_generate(*st);
  };
}

}  // namespace simpler::cli
