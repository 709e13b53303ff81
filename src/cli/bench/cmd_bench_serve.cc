// `simpler bench serve`: the OpenAI-compatible server under load, in the shape of vLLM's
// benchmark_serving. It starts `simpler serve`'s server in this process on a free
// loopback port (or drives --url), sends the workload of `bench throughput` (seeded input /
// output lengths and token ids, Poisson arrivals at --request-rate, at most --max-concurrency
// requests open) as streamed /v1/completions with its own HTTP client, and reads the SSE
// streams: TTFT is the first content chunk, inter-token latency the gaps between chunks. Then it
// runs the same workload offline through a fresh LlmEngine in the same process, for the ratio.
// The client's CPU seconds are reported: on 2 vCPUs the client competes with the server.
#include <httplib.h>
#include <sys/resource.h>

#include <atomic>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <mutex>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "cli/bench/bench_commands.h"
#include "cli/bench/bench_workload.h"
#include "cli/commands.h"
#include "cli/engine_flags.h"
#include "nlohmann/json.hpp"
#include "simpler/engine/model_files.h"
#include "simpler/serve/openai_server.h"
#include "simpler/tokenizer/chat_template.h"
#include "simpler/tokenizer/tokenizer.h"

namespace simpler::cli {

namespace {

using namespace bench;  // NOLINT: the shared workload helpers
using json = nlohmann::json;

constexpr const char* kBenchServeCommand = "bench serve";

struct ServeState {
  std::string model, url;
  WorkloadFlags workload;
  int32_t max_concurrency = 0;  // 0: num_prompts
  // --structured KIND FILE: every second request asks for this schema's, regex's or GBNF
  // grammar's output.
  std::vector<std::string> structured;
  int32_t structured_pairs = 1;  // --structured-pairs: mixed / constraint-free run pairs
  json constraint;               // the request fields that ask for it, made from the file
  EngineFlags engine;
};

// One streamed request as the client saw it.
struct ClientResult {
  bool ok = false;
  std::string error;
  int64_t sent_ns = 0, first_ns = 0, done_ns = 0;
  std::vector<int64_t> chunk_ns;  // arrival of each content chunk
  int64_t completion_tokens = 0;  // from the usage chunk
  int64_t cached_tokens = 0;      // usage.prompt_tokens_details.cached_tokens
  std::string text;               // the completion's text
  bool constrained = false;       // sent with the --structured constraint
};

double thread_cpu_s() {
  rusage u{};
  getrusage(RUSAGE_THREAD, &u);
  return u.ru_utime.tv_sec + u.ru_stime.tv_sec + (u.ru_utime.tv_usec + u.ru_stime.tv_usec) / 1e6;
}

// One streamed /v1/completions of `prompt` (token ids or text), with the fields of `constraint`
// (when not null) added to its body.
ClientResult send_one(const std::string& host, int port, const json& prompt, int64_t max_tokens,
                      const json* constraint = nullptr) {
  ClientResult r;
  r.constrained = constraint != nullptr;
  httplib::Client c(host, port);
  c.set_read_timeout(600, 0);
  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/completions";
  json body = {{"prompt", prompt}, {"max_tokens", max_tokens},
               {"temperature", 0}, {"ignore_eos", true},
               {"stream", true},   {"stream_options", {{"include_usage", true}}}};
  if (constraint != nullptr) body.update(*constraint);
  req.body = body.dump();
  req.set_header("Content-Type", "application/json");
  std::string buf;
  bool done = false;
  req.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
    const int64_t now = base::now_ns();
    buf.append(data, n);
    size_t end;
    while ((end = buf.find("\n\n")) != std::string::npos) {
      const std::string ev = buf.substr(0, end);
      buf.erase(0, end + 2);
      if (ev.rfind("data: ", 0) != 0) continue;
      const std::string payload = ev.substr(6);
      if (payload == "[DONE]") {
        done = true;
        continue;
      }
      const json j = json::parse(payload, nullptr, false);
      if (j.is_discarded()) continue;
      if (j.contains("error")) {
        r.error = j["error"].value("message", "error event");
        continue;
      }
      if (j.contains("usage") && j["usage"].is_object()) {
        const json& u = j["usage"];
        r.completion_tokens = u.value("completion_tokens", int64_t{0});
        if (u.contains("prompt_tokens_details") && u["prompt_tokens_details"].is_object()) {
          r.cached_tokens = u["prompt_tokens_details"].value("cached_tokens", int64_t{0});
        }
      }
      if (j.contains("choices") && !j["choices"].empty() &&
          !j["choices"][0].value("text", std::string()).empty()) {
        if (r.first_ns == 0) r.first_ns = now;
        r.chunk_ns.push_back(now);
        r.text += j["choices"][0]["text"].get<std::string>();
      }
    }
    return true;
  };
  r.sent_ns = base::now_ns();
  auto res = c.send(req);
  r.done_ns = base::now_ns();
  if (!res) {
    r.error = "no response: " + httplib::to_string(res.error());
  } else if (res->status != 200) {
    // A refusal's body is a JSON error object (not an event stream): its message says why.
    const std::string& raw = buf.empty() ? res->body : buf;
    const json j = json::parse(raw, nullptr, false);
    std::string why = raw.substr(0, 300);
    if (!j.is_discarded() && j.contains("error") && j["error"].is_object()) {
      why = j["error"].value("message", why);
    }
    r.error = absl::StrCat("HTTP ", res->status, why.empty() ? "" : ": ", why);
  } else if (!done) {
    r.error = "the stream ended without [DONE]";
  }
  r.ok = r.error.empty();
  return r;
}

// The server the clients drive: in this process on a free loopback port, or --url's. The
// members go in reverse order (the serving thread first). Owner-thread only.
struct Server {
  std::string host = "127.0.0.1";
  int port = 0;
  std::unique_ptr<llm::Tokenizer> tokenizer;
  std::unique_ptr<llm::LlmEngine> engine;
  std::unique_ptr<serve::OpenAiServer> server;
  std::thread serving;
};

// A server address: --url's host and port.
struct HostPort {
  std::string host;
  int port = 80;
};

// --url: http://HOST[:PORT][/] (or without the scheme; port 80 without one; an IPv6 HOST in
// brackets). INVALID_ARGUMENT naming what is wrong: another scheme (the client speaks plain
// HTTP), a path, an empty host, a port outside [1, 65535].
absl::StatusOr<HostPort> parse_url(const std::string& url) {
  std::string rest = url;
  if (const size_t scheme = rest.find("://"); scheme != std::string::npos) {
    if (!absl::EqualsIgnoreCase(rest.substr(0, scheme), "http")) {
      return absl::InvalidArgumentError(absl::StrCat(
          "'", url.substr(0, 80), "': only http:// is supported (the client speaks plain HTTP)"));
    }
    rest = rest.substr(scheme + 3);
  }
  if (!rest.empty() && rest.back() == '/') rest.pop_back();
  if (rest.find('/') != std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", url.substr(0, 80), "' has a path: give http://HOST:PORT"));
  }
  HostPort hp;
  size_t colon = rest.rfind(':');
  if (!rest.empty() && rest[0] == '[') {  // [IPv6]:PORT
    const size_t close = rest.find(']');
    if (close == std::string::npos) {
      return absl::InvalidArgumentError(absl::StrCat("'", url.substr(0, 80), "': no ']'"));
    }
    hp.host = rest.substr(1, close - 1);
    colon = close + 1 < rest.size() && rest[close + 1] == ':' ? close + 1 : std::string::npos;
    if (colon == std::string::npos && close + 1 != rest.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("'", url.substr(0, 80), "': expected ':PORT' after ']'"));
    }
  } else {
    if (colon != std::string::npos && rest.find(':') != colon) {
      return absl::InvalidArgumentError(absl::StrCat(
          "'", url.substr(0, 80), "': an IPv6 address goes in brackets: http://[ADDRESS]:PORT"));
    }
    hp.host = rest.substr(0, colon);
  }
  if (hp.host.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("'", url.substr(0, 80), "' names no host"));
  }
  if (colon != std::string::npos) {
    int port = 0;
    if (!absl::SimpleAtoi(rest.substr(colon + 1), &port) || port < 1 || port > 65535) {
      return absl::InvalidArgumentError(
          absl::StrCat("'", url.substr(0, 80), "': the port must be a number in [1, 65535]"));
    }
    hp.port = port;
  }
  return hp;
}

// Whether the server at --url answers GET /v1/models with 200, checked before the workload runs:
// UNAVAILABLE when nothing answers within 10 s, FAILED_PRECONDITION for another status.
absl::Status probe_url(const std::string& url) {
  SIMPLER_ASSIGN_OR_RETURN(HostPort hp, parse_url(url));
  httplib::Client c(hp.host, hp.port);
  c.set_connection_timeout(10, 0);
  c.set_read_timeout(10, 0);
  const httplib::Result res = c.Get("/v1/models");
  if (!res) {
    return absl::UnavailableError(absl::StrCat("--url ", url, ": no answer to GET /v1/models (",
                                               httplib::to_string(res.error()), ")"));
  }
  if (res->status != 200) {
    return absl::FailedPreconditionError(
        absl::StrCat("--url ", url, ": GET /v1/models answered HTTP ", res->status,
                     "; is it an OpenAI-compatible server?"));
  }
  return absl::OkStatus();
}

// Starts the server in this process (the engine of `eo` with the model's tokenizer), or takes
// --url's address (parse_url).
absl::Status start_server(const ServeState& st, const llm::EngineOptions& eo, Server* s) {
  if (!st.url.empty()) {
    SIMPLER_ASSIGN_OR_RETURN(HostPort hp, parse_url(st.url));
    s->host = hp.host;
    s->port = hp.port;
    return absl::OkStatus();
  }
  SIMPLER_ASSIGN_OR_RETURN(llm::Tokenizer tok, llm::load_model_tokenizer(st.model));
  s->tokenizer = std::make_unique<llm::Tokenizer>(std::move(tok));
  llm::EngineOptions so_engine = eo;
  so_engine.tokenizer = s->tokenizer.get();
  SIMPLER_ASSIGN_OR_RETURN(s->engine, llm::LlmEngine::create(st.model, so_engine));
  serve::ServerOptions so;
  so.port = 0;
  so.served_model_name = "bench";
  so.max_concurrent_requests = static_cast<int32_t>(std::min<int64_t>(
      st.max_concurrency > 0 ? st.max_concurrency : st.workload.num_prompts, 4096));
  s->server = std::make_unique<serve::OpenAiServer>(s->engine.get(), s->tokenizer.get(),
                                                    llm::load_model_chat_template(st.model), so);
  SIMPLER_ASSIGN_OR_RETURN(s->port, s->server->bind());
  s->serving = std::thread([server = s->server.get()] { (void)server->serve(); });
  return absl::OkStatus();
}

// Stops an in-process server; its engine's preemptions (0 for --url).
int64_t stop_server(Server* s) {
  if (!s->server) return 0;
  const int64_t preemptions = s->engine->metrics().preemptions_total;
  (void)s->server->shutdown(base::Deadline::poll());
  s->serving.join();
  s->server.reset();
  s->engine.reset();
  return preemptions;
}

// The client's run: every request of the workload as the client saw it.
struct ClientRun {
  std::vector<ClientResult> results;
  int64_t concurrency = 0;
  double client_cpu_s = 0;
  int64_t start_ns = 0, end_ns = 0;
};

// The client: at most max_concurrency requests open, each sent at its arrival time.
ClientRun run_clients(const ServeState& st, const Workload& w, const std::string& host, int port,
                      bool structured) {
  ClientRun run;
  const size_t n = w.prompts.size();
  run.concurrency = st.max_concurrency > 0 ? st.max_concurrency : st.workload.num_prompts;
  const int64_t concurrency = run.concurrency;
  std::vector<ClientResult>& results = run.results;
  results.resize(n);
  std::atomic<size_t> next{0};
  std::atomic<int64_t> finished{0};
  std::mutex cpu_mu;
  double& client_cpu_s = run.client_cpu_s;
  run.start_ns = base::now_ns();
  const int64_t start_ns = run.start_ns;
  std::vector<std::thread> clients;
  for (int64_t t = 0; t < std::min<int64_t>(concurrency, static_cast<int64_t>(n)); ++t) {
    clients.emplace_back([&] {
      for (size_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) {
        const int64_t at = start_ns + w.arrival_offsets_ns[i];
        while (base::now_ns() < at) {
          std::this_thread::sleep_for(std::chrono::nanoseconds(at - base::now_ns()));
        }
        const json* constraint = structured && i % 2 == 0 ? &st.constraint : nullptr;
        results[i] = send_one(host, port, json(w.prompts[i]), w.output_lens[i], constraint);
        finished.fetch_add(1);
      }
      const double cpu = thread_cpu_s();
      std::lock_guard<std::mutex> l(cpu_mu);
      client_cpu_s += cpu;
    });
  }
  int64_t last_report = base::now_ns();
  while (finished.load() < static_cast<int64_t>(n)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    if (base::now_ns() - last_report > 1'000'000'000) {
      last_report = base::now_ns();
      std::cerr << "simpler " << kBenchServeCommand << ": " << finished.load() << "/" << n
                << " requests finished\n";
    }
  }
  for (std::thread& t : clients) t.join();
  run.end_ns = start_ns;
  for (const ClientResult& r : results) run.end_ns = std::max(run.end_ns, r.done_ns);
  return run;
}

// Statistics of the served run.
struct ServedStats {
  std::vector<double> ttft, itl, tpot;
  int64_t tokens = 0, errors = 0;
  std::string first_error;
  double wall_s = 0;
  double tokens_per_s = 0;
};

ServedStats served_stats(const ClientRun& run) {
  ServedStats out;
  for (const ClientResult& r : run.results) {
    if (!r.ok) {
      ++out.errors;
      if (out.first_error.empty()) out.first_error = r.error;
      continue;
    }
    out.tokens += r.completion_tokens;
    if (r.first_ns) out.ttft.push_back((r.first_ns - r.sent_ns) / 1e6);
    for (size_t k = 1; k < r.chunk_ns.size(); ++k) {
      out.itl.push_back((r.chunk_ns[k] - r.chunk_ns[k - 1]) / 1e6);
    }
    if (r.completion_tokens > 1 && r.first_ns) {
      out.tpot.push_back((r.done_ns - r.first_ns) / 1e6 / (r.completion_tokens - 1));
    }
  }
  out.wall_s = (run.end_ns - run.start_ns) / 1e9;
  out.tokens_per_s = out.wall_s > 0 ? out.tokens / out.wall_s : 0;
  return out;
}

json served_json(const ServeState& st, const ClientRun& clients, const ServedStats& served,
                 const RunStats& o, double ratio, int64_t preemptions) {
  const double rate = st.workload.rate();
  const size_t n = clients.results.size();
  const std::vector<double>&ttft = served.ttft, &itl = served.itl, &tpot = served.tpot;
  const double wall_s = served.wall_s;
  const int64_t errors = served.errors;
  return {{"model", st.model},
          {"url", st.url.empty() ? json(nullptr) : json(st.url)},
          {"num_prompts", st.workload.num_prompts},
          {"request_rate", std::isfinite(rate) ? json(rate) : json(nullptr)},
          {"max_concurrency", clients.concurrency},
          {"max_num_seqs", st.engine.max_num_seqs},
          {"output_tokens_per_s", served.tokens_per_s},
          {"offline_output_tokens_per_s", o.output_tokens_per_s},
          {"served_over_offline", ratio},
          {"requests_per_s", wall_s > 0 ? (n - errors) / wall_s : 0},
          {"ttft_ms_mean", mean(ttft)},
          {"ttft_ms_p50", percentile(ttft, 0.5)},
          {"ttft_ms_p99", percentile(ttft, 0.99)},
          {"offline_ttft_ms_p50", percentile(o.ttft_ms, 0.5)},
          {"itl_ms_mean", mean(itl)},
          {"itl_ms_p50", percentile(itl, 0.5)},
          {"itl_ms_p99", percentile(itl, 0.99)},
          {"tpot_ms_p50", percentile(tpot, 0.5)},
          {"client_cpu_s", clients.client_cpu_s},
          {"wall_s", wall_s},
          {"preemptions", preemptions},
          {"errors", errors},
          {"kernel_isa", llm::name_of(llm::resolve_kernel_isa(st.engine.common.kernel_isa()))}};
}

// --structured: output tokens/s and inter-token latency of the constrained and unconstrained
// requests of the mixed run, the unconstrained latency of a run without the schema, and the
// engine's mask time per constrained row (bucket bounds: the histogram's 1-2-5 buckets).
json structured_json(const ClientRun& mixed, const llm::EngineMetrics& m, const ClientRun& plain) {
  std::vector<double> itl[2], plain_itl;
  int64_t tokens[2] = {0, 0};
  for (const ClientResult& r : mixed.results) {
    if (!r.ok) continue;
    tokens[r.constrained] += r.completion_tokens;
    for (size_t k = 1; k < r.chunk_ns.size(); ++k) {
      itl[r.constrained].push_back((r.chunk_ns[k] - r.chunk_ns[k - 1]) / 1e6);
    }
  }
  int64_t plain_tokens = 0;
  for (const ClientResult& r : plain.results) {
    plain_tokens += r.ok ? r.completion_tokens : 0;
    for (size_t k = 1; k < r.chunk_ns.size(); ++k) {
      plain_itl.push_back((r.chunk_ns[k] - r.chunk_ns[k - 1]) / 1e6);
    }
  }
  const double wall_s = (mixed.end_ns - mixed.start_ns) / 1e9;
  const double plain_wall_s = (plain.end_ns - plain.start_ns) / 1e9;
  const llm::Histogram& h = m.grammar_mask_time_s;
  return {
      {"constrained_output_tokens_per_s", wall_s > 0 ? tokens[1] / wall_s : 0},
      {"unconstrained_output_tokens_per_s", wall_s > 0 ? tokens[0] / wall_s : 0},
      {"constrained_itl_ms_p50", percentile(itl[1], 0.5)},
      {"constrained_itl_ms_p99", percentile(itl[1], 0.99)},
      {"unconstrained_itl_ms_p50", percentile(itl[0], 0.5)},
      {"unconstrained_itl_ms_p99", percentile(itl[0], 0.99)},
      {"without_schema_output_tokens_per_s", plain_wall_s > 0 ? plain_tokens / plain_wall_s : 0},
      {"without_schema_itl_ms_p50", percentile(plain_itl, 0.5)},
      {"without_schema_itl_ms_p99", percentile(plain_itl, 0.99)},
      {"mask_rows", h.count},
      {"mask_ms_mean", h.count > 0 ? 1e3 * h.sum / h.count : 0},
      {"mask_ms_p50_bucket", 1e3 * h.quantile_bound(0.5)},
      {"mask_ms_p99_bucket", 1e3 * h.quantile_bound(0.99)},
      {"step_ms_p50_bucket", 1e3 * m.step_time_s.quantile_bound(0.5)}};
}

// One run of the workload on a fresh server, with the schema on every second request or
// without it; `metrics` (when not null) gets the engine's metrics after the run.
absl::StatusOr<ClientRun> run_on_fresh_server(const ServeState& st, const llm::EngineOptions& eo,
                                              const Workload& w, bool structured,
                                              llm::EngineMetrics* metrics = nullptr) {
  Server server;
  SIMPLER_RETURN_IF_ERROR(start_server(st, eo, &server));
  ClientRun run = run_clients(st, w, server.host, server.port, structured);
  if (metrics != nullptr && server.engine) *metrics = server.engine->metrics();
  (void)stop_server(&server);
  return run;
}

// The served run with the schema on every second request (engine metrics kept) and the same
// workload without it, each on a fresh server, --structured-pairs times in alternating order (so
// a shared machine's drift falls on both sides): the first pair's figures, each pair's ratio of
// the unconstrained rows' ITL p50 to the constraint-free run's, and the median ratio. `mixed`
// gets the first mixed run (the report's served figures).
absl::StatusOr<json> run_structured(const ServeState& st, const llm::EngineOptions& eo,
                                    const Workload& w, ClientRun* mixed) {
  json first;
  std::vector<double> ratios;
  for (int32_t pair = 0; pair < st.structured_pairs; ++pair) {
    ClientRun runs[2];  // [0]: without the schema, [1]: mixed
    llm::EngineMetrics m;
    for (int k = 0; k < 2; ++k) {
      const bool structured = (k == 0) == (pair % 2 == 0);  // mixed first in even pairs
      auto run = run_on_fresh_server(st, eo, w, structured, structured ? &m : nullptr);
      if (!run.ok()) return run.status();
      runs[structured] = *std::move(run);
    }
    json j = structured_json(runs[1], m, runs[0]);
    const double plain = j["without_schema_itl_ms_p50"].get<double>();
    ratios.push_back(plain > 0 ? j["unconstrained_itl_ms_p50"].get<double>() / plain : 0);
    if (pair == 0) {
      first = std::move(j);
      *mixed = std::move(runs[1]);
    }
  }
  first["pairs"] = st.structured_pairs;
  first["unconstrained_over_without_itl_p50"] = ratios;
  first["unconstrained_over_without_itl_p50_median"] = percentile(ratios, 0.5);
  return first;
}

void print_text(const ClientRun& clients, const ServedStats& served, const RunStats& o,
                double ratio, const json& j) {
  std::printf(
      "served: %lld output tokens in %.2f s = %.1f tokens/s, %.2f requests/s; TTFT ms p50 %.2f "
      "p99 %.2f; ITL ms p50 %.2f p99 %.2f; TPOT ms p50 %.2f; client CPU %.2f s; %lld errors\n"
      "offline (same workload, same process): %.1f tokens/s, TTFT ms p50 %.2f\n"
      "output tokens/s, served / offline: %.3fx\n",
      static_cast<long long>(served.tokens), served.wall_s, served.tokens_per_s,
      j["requests_per_s"].get<double>(), percentile(served.ttft, 0.5),
      percentile(served.ttft, 0.99), percentile(served.itl, 0.5), percentile(served.itl, 0.99),
      percentile(served.tpot, 0.5), clients.client_cpu_s, static_cast<long long>(served.errors),
      o.output_tokens_per_s, percentile(o.ttft_ms, 0.5), ratio);
}

// --structured's figures (structured_json, run_structured) as text lines.
void print_structured_text(const json& s) {
  const auto d = [&s](const char* key) { return s[key].get<double>(); };
  std::string ratios;
  for (const json& r : s["unconstrained_over_without_itl_p50"]) {
    absl::StrAppend(&ratios, ratios.empty() ? "" : ", ", absl::StrFormat("%.2f", r.get<double>()));
  }
  std::printf(
      "structured (schema on every second request, first pair): constrained %.1f output "
      "tokens/s, ITL ms p50 %.2f p99 %.2f; unconstrained beside them %.1f tokens/s, ITL ms p50 "
      "%.2f p99 %.2f; the workload without the schema %.1f tokens/s, ITL ms p50 %.2f p99 %.2f\n"
      "structured: grammar mask %.3f ms mean over %lld rows (p50 <= %.3f ms, p99 <= %.3f ms; step "
      "p50 <= %.1f ms)\n"
      "structured: unconstrained ITL p50 / without the schema's, per pair: %s (median %.2f)\n",
      d("constrained_output_tokens_per_s"), d("constrained_itl_ms_p50"),
      d("constrained_itl_ms_p99"), d("unconstrained_output_tokens_per_s"),
      d("unconstrained_itl_ms_p50"), d("unconstrained_itl_ms_p99"),
      d("without_schema_output_tokens_per_s"), d("without_schema_itl_ms_p50"),
      d("without_schema_itl_ms_p99"), d("mask_ms_mean"),
      static_cast<long long>(s["mask_rows"].get<int64_t>()), d("mask_ms_p50_bucket"),
      d("mask_ms_p99_bucket"), d("step_ms_p50_bucket"), ratios.c_str(),
      d("unconstrained_over_without_itl_p50_median"));
}

// ---- --workload multi-turn ----------------------------------------------------------------

// Conversations as text: a shared system prompt and user messages of common English words (about
// one token each with Qwen3's tokenizer), seeded; each turn sends the conversation so far (every
// earlier message and answer) as a text prompt, as a completions client does.
struct TextConversations {
  std::string system;
  std::vector<std::vector<std::string>> user;     // [conversation][turn]
  std::vector<std::vector<int64_t>> output_lens;  // [conversation][turn]
};

TextConversations make_text_conversations(const WorkloadFlags& wf) {
  static constexpr const char* kWords[] = {
      "time",   "year",   "people",  "way",      "day",     "thing",   "life",  "world",
      "school", "state",  "family",  "group",    "country", "problem", "hand",  "place",
      "week",   "system", "program", "question", "work",    "number",  "night", "point",
      "home",   "water",  "room",    "area",     "money",   "story",   "month", "book"};
  SplitMix64 rng(wf.seed);
  auto words = [&](int64_t n) {
    std::string t;
    for (int64_t i = 0; i < n; ++i) {
      t += ' ';
      t += kWords[rng.uniform(0, std::size(kWords) - 1)];
    }
    return t;
  };
  TextConversations c;
  c.system = words(wf.system_prompt_len);
  const LenRange in = wf.input_lens(), out = wf.output_lens();
  c.user.resize(wf.num_prompts);
  c.output_lens.resize(wf.num_prompts);
  for (int64_t k = 0; k < wf.num_prompts; ++k) {
    for (int64_t t = 0; t < wf.turns; ++t) {
      c.user[k].push_back(words(rng.uniform(in.lo, in.hi)));
      c.output_lens[k].push_back(rng.uniform(out.lo, out.hi));
    }
  }
  return c;
}

// Every conversation on a client thread of its own, its turns one after another.
std::vector<std::vector<ClientResult>> run_conversations(const TextConversations& c,
                                                         const std::string& host, int port) {
  std::vector<std::vector<ClientResult>> results(c.user.size());
  std::vector<std::thread> clients;
  for (size_t k = 0; k < c.user.size(); ++k) {
    clients.emplace_back([&, k] {
      std::string prompt = c.system;
      for (size_t t = 0; t < c.user[k].size(); ++t) {
        prompt += c.user[k][t];
        results[k].push_back(send_one(host, port, json(prompt), c.output_lens[k][t]));
        if (!results[k].back().ok) return;
        prompt += results[k].back().text;
      }
    });
  }
  for (std::thread& t : clients) t.join();
  return results;
}

// Per turn: TTFT p50 / p99 (ms), prompt tokens the cache served; and the output tokens/s.
json multi_turn_served_json(const std::vector<std::vector<ClientResult>>& results, int64_t turns,
                            double wall_s, std::string* first_error) {
  json per_turn = json::array();
  int64_t tokens = 0;
  for (int64_t t = 0; t < turns; ++t) {
    std::vector<double> ttft;
    int64_t cached = 0;
    for (const auto& conv : results) {
      if (t >= static_cast<int64_t>(conv.size())) continue;
      const ClientResult& r = conv[t];
      if (!r.ok && first_error->empty()) *first_error = r.error;
      if (!r.ok) continue;
      if (r.first_ns) ttft.push_back((r.first_ns - r.sent_ns) / 1e6);
      cached += r.cached_tokens;
      tokens += r.completion_tokens;
    }
    per_turn.push_back({{"turn", t},
                        {"ttft_p50_ms", percentile(ttft, 0.5)},
                        {"ttft_p99_ms", percentile(ttft, 0.99)},
                        {"cached_tokens", cached}});
  }
  return {{"turns", per_turn},
          {"wall_s", wall_s},
          {"output_tokens_per_s", wall_s > 0 ? tokens / wall_s : 0.0}};
}

// The conversations through a server started here with prefix caching off, then on.
int run_bench_serve_multi_turn(const ServeState& st) {
  if (!st.url.empty()) {
    return fail(kBenchServeCommand,
                absl::InvalidArgumentError("--workload multi-turn starts its own servers (prefix "
                                           "caching off, then on); --url is not supported"));
  }
  const TextConversations c = make_text_conversations(st.workload);
  const int64_t longest =
      st.workload.system_prompt_len +
      st.workload.turns * (st.workload.input_lens().hi + st.workload.output_lens().hi);
  base::TraceRecorder trace;
  auto options = engine_options(st.engine, {.request_tokens = longest}, &trace);
  if (!options.ok()) return fail(kBenchServeCommand, options.status());
  llm::EngineOptions eo = *std::move(options);
  eo.max_waiting = static_cast<int32_t>(std::max<int64_t>(st.workload.num_prompts, 1));
  json out = {{"workload", "multi-turn"},
              {"conversations", st.workload.num_prompts},
              {"turns", st.workload.turns},
              {"system_prompt_words", st.workload.system_prompt_len}};
  for (bool caching : {false, true}) {
    eo.enable_prefix_caching = caching;
    Server server;
    if (absl::Status s = start_server(st, eo, &server); !s.ok()) return fail(kBenchServeCommand, s);
    // A warm-up request first, so the two servers do not differ by their first steps' costs.
    (void)send_one(server.host, server.port, json("warm up"), 1);
    const int64_t t0 = base::now_ns();
    const auto results = run_conversations(c, server.host, server.port);
    const double wall_s = (base::now_ns() - t0) / 1e9;
    stop_server(&server);
    std::string first_error;
    out[caching ? "prefix_caching_on" : "prefix_caching_off"] =
        multi_turn_served_json(results, st.workload.turns, wall_s, &first_error);
    if (!first_error.empty()) {
      return fail(kBenchServeCommand, absl::InternalError("a turn failed: " + first_error));
    }
  }
  if (st.engine.common.json) {
    print_json_line(out);
    return 0;
  }
  std::printf("multi-turn over HTTP: %lld conversations x %lld turns, system prompt %lld words\n",
              static_cast<long long>(st.workload.num_prompts),
              static_cast<long long>(st.workload.turns),
              static_cast<long long>(st.workload.system_prompt_len));
  std::printf("turn | TTFT p50 / p99 ms, cache off | cache on | prompt tokens cached (on)\n");
  const json &off = out["prefix_caching_off"], &on = out["prefix_caching_on"];
  for (int64_t t = 0; t < st.workload.turns; ++t) {
    std::printf(
        "%4lld | %8.1f / %8.1f | %8.1f / %8.1f | %lld\n", static_cast<long long>(t),
        off["turns"][t]["ttft_p50_ms"].get<double>(), off["turns"][t]["ttft_p99_ms"].get<double>(),
        on["turns"][t]["ttft_p50_ms"].get<double>(), on["turns"][t]["ttft_p99_ms"].get<double>(),
        static_cast<long long>(on["turns"][t]["cached_tokens"].get<int64_t>()));
  }
  std::printf("output tokens/s: cache off %.1f, cache on %.1f\n",
              off["output_tokens_per_s"].get<double>(), on["output_tokens_per_s"].get<double>());
  return 0;
}

// --structured KIND FILE: the request fields, into st->constraint: json-schema (response_format
// json_schema), regex (guided_regex: the file's text without its final newline) or gbnf
// (guided_grammar).
absl::Status load_structured(ServeState* st) {
  if (st->structured.empty()) return absl::OkStatus();
  const std::string& kind = st->structured[0];
  if (st->structured.size() != 2 || (kind != "json-schema" && kind != "regex" && kind != "gbnf")) {
    return absl::InvalidArgumentError(
        "--structured takes 'json-schema FILE', 'regex FILE' or "
        "'gbnf FILE'");
  }
  std::ifstream in(st->structured[1]);
  if (!in)
    return absl::NotFoundError(absl::StrCat("--structured: cannot read ", st->structured[1]));
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (kind == "regex") {
    if (!text.empty() && text.back() == '\n') text.pop_back();
    st->constraint = {{"guided_regex", text}};
    return absl::OkStatus();
  }
  if (kind == "gbnf") {
    st->constraint = {{"guided_grammar", text}};
    return absl::OkStatus();
  }
  const json schema = json::parse(text, nullptr, false);
  if (schema.is_discarded()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--structured: ", st->structured[1], " is not valid JSON"));
  }
  st->constraint = {
      {"response_format",
       {{"type", "json_schema"}, {"json_schema", {{"name", "bench"}, {"schema", schema}}}}}};
  return absl::OkStatus();
}

int run_bench_serve(const ServeState& flags) {
  if (flags.workload.kind == "multi-turn") return run_bench_serve_multi_turn(flags);
  ServeState st = flags;
  if (absl::Status s = load_structured(&st); !s.ok()) return fail(kBenchServeCommand, s);
  if (!st.url.empty()) {
    if (absl::Status s = probe_url(st.url); !s.ok()) return fail(kBenchServeCommand, s);
  }
  auto config = llm::ModelConfig::load(st.model);
  if (!config.ok()) return fail(kBenchServeCommand, config.status());
  auto workload = make_workload(*config, st.workload);
  if (!workload.ok()) return fail(kBenchServeCommand, workload.status());
  const Workload& w = *workload;

  base::TraceRecorder trace;
  auto options = engine_options(st.engine, {.request_tokens = w.longest}, &trace);
  if (!options.ok()) return fail(kBenchServeCommand, options.status());
  llm::EngineOptions eo = *std::move(options);
  eo.max_waiting = static_cast<int32_t>(std::max<int64_t>(st.workload.num_prompts, 1));
  eo.record_steps = false;

  json structured;
  ClientRun clients;
  int64_t preemptions = 0;
  if (!st.structured.empty()) {
    absl::StatusOr<json> s = run_structured(st, eo, w, &clients);
    if (!s.ok()) return fail(kBenchServeCommand, s.status());
    structured = *std::move(s);
  } else {
    Server server;
    if (absl::Status s = start_server(st, eo, &server); !s.ok()) {
      return fail(kBenchServeCommand, s);
    }
    clients = run_clients(st, w, server.host, server.port, /*structured=*/false);
    preemptions = stop_server(&server);
  }
  const ServedStats served = served_stats(clients);

  // Offline: the same workload through a fresh engine in this process.
  std::cerr << "simpler " << kBenchServeCommand << ": served run " << served.wall_s
            << " s; now the same workload offline\n";
  auto offline = run_workload(st.model, eo, w, /*static_batches=*/false, kBenchServeCommand);
  if (!offline.ok()) return fail(kBenchServeCommand, offline.status());
  const RunStats o = run_stats(*offline, w);
  const double ratio = o.output_tokens_per_s > 0 ? served.tokens_per_s / o.output_tokens_per_s : 0;
  json j = served_json(st, clients, served, o, ratio, preemptions);
  if (!structured.is_null()) j["structured"] = structured;
  if (st.engine.common.json) {
    print_json_line(j);
  } else {
    print_text(clients, served, o, ratio, j);
    if (!structured.is_null()) print_structured_text(structured);
  }
  if (served.errors > 0) {
    std::cerr << "simpler " << kBenchServeCommand << ": " << served.errors
              << " request(s) failed; the first: " << served.first_error << "\n";
    return 1;
  }
  return write_trace(trace, st.engine.common.trace_path) ? 0 : 1;
}

}  // namespace

Runner add_bench_serve_command(CLI::App* bench_cmd) {
  auto st = std::make_shared<ServeState>();
  auto* cmd = add_model_command(
      bench_cmd, "serve", "the OpenAI-compatible server under load, against the engine offline",
      &st->model, "model directory (with its tokenizer) or .gguf file");
  cmd->add_option("--url", st->url,
                  "drive a running server (http://HOST:PORT) instead of one started here; it "
                  "must answer GET /v1/models first")
      ->check(parse_check(parse_url, "URL"));
  add_workload_flags(cmd, &st->workload, "", /*multi_turn=*/true);
  cmd->add_option("--max-concurrency", st->max_concurrency,
                  "requests open at once (0 = all of them)")
      ->check(int_in(0, kMaxRequests))
      ->capture_default_str();
  cmd->add_option("--structured", st->structured,
                  "json-schema FILE | regex FILE | gbnf FILE: every second request asks for this "
                  "JSON Schema's (response_format), regex's (guided_regex) or GBNF grammar's "
                  "(guided_grammar) output; reports both kinds' tokens/s and latency, the mask "
                  "time, and a second run without the constraint")
      ->expected(2);
  cmd->add_option("--structured-pairs", st->structured_pairs,
                  "with --structured: run the mixed and the constraint-free workloads this many "
                  "times each, alternating which goes first, and report each pair's ratio of "
                  "unconstrained ITL p50 and their median")
      ->check(int_in(1, 100))
      ->capture_default_str();
  add_engine_flags(
      cmd, &st->engine,
      {.max_num_seqs = "the engine's running requests", .page_size = true, .prefix_caching = true});
  return run_if_parsed(cmd, st, run_bench_serve);
}

}  // namespace simpler::cli
