// OpenAiServer: the OpenAI-compatible HTTP front door of an LlmEngine (cpp-httplib 0.11, HTTP/1.1
// with keep-alive). Serving thread model (CONVENTIONS.md): HTTP threads only parse, validate,
// tokenize (or render the chat template) and format; the engine loop owns everything else; a
// request's events reach its HTTP thread through the engine's per-request queue.
//
// Endpoints: POST /v1/completions, POST /v1/chat/completions (streamed as server-sent events or
// not; with tools, Qwen3's <tool_call> blocks in the output come back as message.tool_calls, or
// as tool_calls deltas, and finish_reason "tool_calls"), GET /v1/models, GET /health (200 while
// the engine is healthy, 503 with the cause), GET /metrics (Prometheus text), POST /tokenize,
// POST /detokenize, GET /v1/models/{id} (the served model's object, 404 model_not_found for
// another id). Errors are OpenAI's error object with 400 / 401 / 403 / 404 / 405 / 411 / 413 /
// 415 / 429 / 500 / 501 / 503 (openai_protocol.h); a 429 (the waiting queue is full) carries
// `Retry-After: 1` (see kRetryAfterSeconds).
//
// Every response carries X-Request-Id: the client's own when it sent one of 1 to 128 printable
// ASCII characters (0x21-0x7E), else a new "req-" and 20 hex digits (also the engine's caller id
// and the access log's). CORS (allowed_origins): a request whose Origin is allowed gets
// Access-Control-Allow-Origin (the origin itself and `Vary: Origin`, or `*` when any origin is
// allowed) and Access-Control-Expose-Headers (X-Request-Id, Retry-After); a preflight (OPTIONS with
// Origin and Access-Control-Request-Method, on any path, no API key needed) from an allowed
// origin is answered 204 with Access-Control-Allow-Methods (GET, POST, OPTIONS),
// Access-Control-Allow-Headers (Authorization, Content-Type, X-Request-Id) and
// Access-Control-Max-Age (600); a preflight from another origin (or with no allowed origins)
// gets 403 (an error object, code "cors_origin_not_allowed") and no CORS headers; a request from
// another origin gets no CORS headers (the browser withholds the response). Access log
// (access_log): one info line per response once it is written (a stream at its end):
//   METHOD PATH STATUS prompt_tokens=P completion_tokens=C ms=T request_id=ID
// with `-` for counts that are not known (every endpoint but the completions), T the
// milliseconds from the request's headers to the response's end, and the method and path
// (at most 100 bytes) with other than printable ASCII as '?'. A response whose client left
// before it was whole (a stream cut mid-way, a request still queued: 499) ends the line with
// " client_disconnected"; its C counts the tokens generated for it until then (streamed: those
// sent, or being sent, to the client).
// A body is judged by its headers before any of it is read (cpp-httplib 0.11 would read a chunked
// or unsized body whole, past max_body_bytes, and an oversized one whole before refusing it): a
// request without a body (neither Content-Length nor Transfer-Encoding) gets 404 / 405 where
// nothing is routed and 411 on a POST route; a body sent with a Content-Length or chunked is
// read by its POST route up to max_body_bytes (413 past it, 400 for malformed chunks or a
// Content-Length that is not a decimal number, 400 for both headers at once, 501 for a
// Transfer-Encoding other than chunked, 415 for a multipart body); each refusal of a body closes
// the connection.
//
// Threads: cpp-httplib's pool has max_concurrent_requests + 8 threads (an idle keep-alive
// connection holds one) behind a queue of at most max_queued_connections beyond the idle
// workers; a connection past that is answered 503 by a refusal thread (or, when its queue is
// full too, on the listener thread), once its request is read. cpp-httplib 0.11 has only a
// per-receive timeout, so a client trickling its request bytes would hold the thread reading it
// (slowloris) for ever: a guard thread walks the server's connections (Linux /proc/self/fd) and
// shuts down those without a complete request within request_read_timeout_s. A response body
// (streamed or not) is written by a chunked content provider that blocks on the request's output
// queue for at most 100 ms at a time and checks that the client is still there: a client that goes
// away aborts its request (the engine fences its pages behind the run that last used them). A
// client that closes its connection while its request still waits for its first event (queued in
// the engine) aborts it too: the handler finds its connection (/proc/self/fd, by peer address) and
// polls it for a hang-up.
//
// Shutdown (shutdown()): new requests get 503; running ones finish until the drain deadline;
// the rest are aborted (their streams end with finish_reason "abort" and [DONE]); then the
// engine shuts down, and only then the HTTP server stops (Server::stop cuts open streams); then
// the connections still open (idle keep-alive, a client trickling its headers) are shut down
// so that serve() returns (shutdown() waits for it, at most 10 s).
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "simpler/base/clock.h"
#include "simpler/engine/llm_engine.h"
#include "simpler/serve/openai_protocol.h"
#include "simpler/tokenizer/chat_template.h"
#include "simpler/tokenizer/tokenizer.h"
#include "spdlog/logger.h"

namespace simpler::serve {

// The Retry-After of a 429 (the engine's waiting queue is full): one second, the shortest
// whole wait the header can say. A full queue empties as fast as requests finish (each
// generates for well under a second to seconds), so the shortest wait is the one most likely to
// find room; clients (the OpenAI SDKs) back off further on repeated 429s.
inline constexpr int kRetryAfterSeconds = 1;

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8000;                // 0: any free port (bind() returns it)
  std::string served_model_name;  // the `model` requests name and /v1/models lists
  // The checkpoint's tensor count per dtype (ModelWeights::dtype_counts, e.g. {"q8_0": 196,
  // "f32": 113}): /v1/models' "weight_types" for the model; omitted when empty.
  std::map<std::string, int64_t> weight_types;
  std::string api_key;  // empty: no authentication
  // CORS: the origins allowed ("scheme://host[:port]", compared exactly), or "*" among them
  // for any. Empty: no CORS headers on any response.
  std::vector<std::string> allowed_origins;
  // Where the access log goes (one info line per response, see the header comment); null:
  // none. stderr_access_log() is the one `simpler serve` uses.
  std::shared_ptr<spdlog::logger> access_log;
  size_t max_body_bytes = 1 << 20;  // 413 past it
  int32_t max_concurrent_requests = 64;
  int32_t max_queued_connections = 64;
  // Slowloris guard: a connection must deliver a complete request (headers and body) within
  // this many seconds of being accepted or of its previous response's end, or it is closed
  // (checked every min(timeout / 4, 0.5 s)). A running request (a stream of any length) is not
  // limited. 0 disables the guard; must be finite and >= 0.
  double request_read_timeout_s = 30;
  RequestLimits limits;
};

// Owns the HTTP server; borrows the engine and tokenizer, which must outlive it. bind() and
// serve() are called once, by one thread; shutdown() is thread-safe and idempotent.
class OpenAiServer {
 public:
  // `chat` is the model's template, or why chat is unavailable (then /v1/chat/completions and
  // /tokenize with messages answer 400 with that reason).
  OpenAiServer(llm::LlmEngine* engine, const llm::Tokenizer* tokenizer,
               absl::StatusOr<llm::ChatTemplate> chat, ServerOptions options);
  ~OpenAiServer();
  OpenAiServer(const OpenAiServer&) = delete;
  OpenAiServer& operator=(const OpenAiServer&) = delete;

  // Binds host:port. INVALID_ARGUMENT for an option out of range (naming it); UNAVAILABLE
  // naming the address when it cannot bind. Returns the bound port. Logs a warning (the
  // process's logger, simpler/base/log.h) when the host is not a loopback address and there is
  // no API key: anyone who can reach the address can use the model.
  absl::StatusOr<int> bind();
  // Serves until shutdown(); returns OK then (INTERNAL when the listener failed).
  absl::Status serve();
  // See the header comment. Returns the engine's shutdown status.
  absl::Status shutdown(base::Deadline drain);

 private:
  struct Impl;  // openai_server.cc
  std::unique_ptr<Impl> impl_;
};

// The base URL clients use for a server bound to `host` and `port`: "http://HOST:PORT/v1", an
// IPv6 address in brackets ("http://[::1]:8000/v1", RFC 3986); a host already in brackets is
// kept as it is. Thread-safe (pure).
std::string base_url(const std::string& host, int port);

// Whether `host` names only this machine: "localhost", an IPv4 address in 127.0.0.0/8, "::1"
// (bracketed or not) or an IPv4-mapped loopback address. Thread-safe (pure).
bool is_loopback_host(const std::string& host);

// The process-wide access logger `simpler serve` uses: "simpler.access", info level, on stderr
// with the process logger's pattern. Thread-safe.
std::shared_ptr<spdlog::logger> stderr_access_log();

}  // namespace simpler::serve
