// `simpler serve`: the OpenAI-compatible server (src/serve) on an LlmEngine.
#include <pthread.h>
#include <signal.h>

#include <atomic>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <thread>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "cli/commands.h"
#include "cli/engine_flags.h"
#include "simpler/base/clock.h"
#include "simpler/engine/llm_engine.h"
#include "simpler/engine/model_files.h"
#include "simpler/model/safetensors.h"
#include "simpler/serve/openai_server.h"
#include "simpler/tokenizer/chat_template.h"
#include "simpler/tokenizer/tokenizer.h"

namespace simpler::cli {

namespace {

// The values of `serve`'s flags. Owned by the command's runner; thread-compatible.
struct ServeFlags {
  std::string model, host = "127.0.0.1", served_model_name, api_key;
  std::vector<std::string> allowed_origins;
  bool no_access_log = false;
  int32_t port = 8000;
  int64_t max_body_bytes = 1 << 20;
  int32_t max_concurrent_requests = 64;
  double drain_timeout_s = 30;
  double request_read_timeout_s = 30;
  EngineFlags engine;
};

int run_serve(const ServeFlags& st) {
  // SIGINT / SIGTERM go to one thread that waits for them (blocked everywhere else, before
  // any thread starts, so every thread inherits the mask).
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  auto tokenizer = llm::load_model_tokenizer(st.model);
  if (!tokenizer.ok()) return fail("serve", tokenizer.status());
  absl::StatusOr<llm::ChatTemplate> chat = llm::load_model_chat_template(st.model);
  if (!chat.ok()) {
    std::cerr << "simpler serve: chat completions unavailable (completions still work): "
              << chat.status().message() << "\n";
  }
  base::TraceRecorder trace;
  auto options = engine_options(st.engine, {.request_tokens = 2048}, &trace);
  if (!options.ok()) return fail("serve", options.status());
  llm::EngineOptions eo = *std::move(options);
  eo.tokenizer = &*tokenizer;
  const int64_t t0 = base::now_ns();
  auto engine = llm::LlmEngine::create(st.model, eo);
  if (!engine.ok()) return fail("serve", engine.status());
  serve::ServerOptions so;
  so.host = st.host;
  so.port = st.port;
  so.served_model_name =
      st.served_model_name.empty()
          ? std::filesystem::path(st.model).lexically_normal().filename().string()
          : st.served_model_name;
  if (so.served_model_name.empty()) so.served_model_name = st.model;
  if (auto weights = llm::ModelWeights::open(st.model); weights.ok()) {
    so.weight_types = weights->dtype_counts();
  }
  so.api_key = st.api_key;
  for (const std::string& o : st.allowed_origins) {  // "a, b" names "a" and "b"
    const absl::string_view origin = absl::StripAsciiWhitespace(o);
    if (!origin.empty()) so.allowed_origins.emplace_back(std::string(origin));
  }
  if (!st.no_access_log) so.access_log = serve::stderr_access_log();
  so.max_body_bytes = static_cast<size_t>(st.max_body_bytes);
  so.max_concurrent_requests = st.max_concurrent_requests;
  so.request_read_timeout_s = st.request_read_timeout_s;
  serve::OpenAiServer server(engine->get(), &*tokenizer, std::move(chat), so);
  auto port = server.bind();
  if (!port.ok()) {
    (void)(*engine)->shutdown(base::Deadline::poll());
    return fail("serve", port.status());
  }
  std::atomic<bool> stop_waiting{false};
  std::thread signal_thread([&server, &signals, &stop_waiting, drain = st.drain_timeout_s] {
    int sig = -1;
    const timespec slice{0, 100'000'000};
    while (!stop_waiting.load() && sig < 0) sig = sigtimedwait(&signals, nullptr, &slice);
    if (sig < 0) return;
    std::cerr << "simpler serve: " << (sig == SIGINT ? "SIGINT" : "SIGTERM")
              << ": draining for up to " << drain << " s\n";
    (void)server.shutdown(
        base::Deadline::after(std::chrono::nanoseconds(static_cast<int64_t>(drain * 1e9))));
  });
  std::printf("simpler serve: ready on %s (model '%s', loaded in %.2f s)\n",
              serve::base_url(st.host, *port).c_str(), so.served_model_name.c_str(),
              (base::now_ns() - t0) / 1e9);
  std::fflush(stdout);
  absl::Status served = server.serve();
  // serve() returns once the listener stopped: after a signal's shutdown, or on its own
  // failure (then shut down here and wake the signal thread).
  absl::Status closed = server.shutdown(base::Deadline::poll());
  stop_waiting.store(true);
  signal_thread.join();
  if (!served.ok()) return fail("serve", served);
  if (!closed.ok()) return fail("serve", closed);
  std::cerr << "simpler serve: stopped\n";
  return 0;
}

}  // namespace

Runner add_serve_command(CLI::App& app) {
  auto st = std::make_shared<ServeFlags>();
  auto* cmd = add_model_command(
      &app, "serve", "serve a Qwen3 model over an OpenAI-compatible HTTP API", &st->model,
      "model directory (Hugging Face layout, with tokenizer) or .gguf file");
  cmd->add_option("--host", st->host, "address to bind (loopback by default)")
      ->capture_default_str();
  cmd->add_option("--port", st->port, "port (0 = any free port)")
      ->check(int_in(0, 65535))
      ->capture_default_str();
  cmd->add_option("--served-model-name", st->served_model_name,
                  "the model name clients send (default: the model directory's or GGUF file's "
                  "name, e.g. qwen3-0.6b or q4_k_m.gguf)");
  cmd->add_option("--api-key", st->api_key,
                  "require 'Authorization: Bearer KEY' (or set SIMPLER_API_KEY, which keeps the "
                  "key out of the process list; the flag wins)")
      ->envname("SIMPLER_API_KEY");
  cmd->add_option("--allowed-origins", st->allowed_origins,
                  "CORS: origins browsers may call from, comma-separated ('*': any; default: "
                  "none, no CORS headers)")
      ->delimiter(',');
  cmd->add_flag("--no-access-log", st->no_access_log, "do not log one line per request on stderr");
  cmd->add_option("--max-body-bytes", st->max_body_bytes, "largest request body (413 past it)")
      ->check(int_in(1024, int64_t{1} << 30))
      ->capture_default_str();
  cmd->add_option("--max-concurrent-requests", st->max_concurrent_requests,
                  "HTTP requests in progress at once (the pool has 8 more threads)")
      ->check(int_in(1, kMaxRequests))
      ->capture_default_str();
  cmd->add_option("--drain-timeout", st->drain_timeout_s,
                  "on SIGINT / SIGTERM, seconds running requests may take to finish")
      ->check(number_in(0, kMaxTimeoutS))
      ->capture_default_str();
  cmd->add_option("--request-read-timeout", st->request_read_timeout_s,
                  "seconds a connection has to send a complete request (headers and body) before "
                  "it is closed; 0 = no limit")
      ->check(number_in(0, kMaxTimeoutS))
      ->capture_default_str();
  add_engine_flags(cmd, &st->engine,
                   {.max_num_seqs = "requests running at once",
                    .max_num_batched_tokens = true,
                    .page_size = true,
                    .num_pages = "KV cache pages (0 = max-num-seqs requests of 2048 tokens)",
                    .max_waiting = true,
                    .allow_unused_tensors = true,
                    .prefix_caching = true,
                    .capture = true,
                    .json = false});
  return run_if_parsed(cmd, st, run_serve);
}

}  // namespace simpler::cli
