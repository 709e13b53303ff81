// OpenAiServer: the OpenAI-compatible HTTP front door of an LlmEngine (cpp-httplib 0.11, HTTP/1.1
// with keep-alive). Serving thread model (CONVENTIONS.md): HTTP threads only parse, validate,
// tokenize (or render the chat template) and format; the engine loop owns everything else; a
// request's events reach its HTTP thread through the engine's per-request queue.
//
// Endpoints: POST /v1/completions, POST /v1/chat/completions (streamed as server-sent events or
// not; with tools, Qwen3's <tool_call> blocks in the output come back as message.tool_calls, or
// as tool_calls deltas, and finish_reason "tool_calls"), GET /v1/models, GET /health (200 while
// the engine is healthy, 503 with the cause), GET /metrics (Prometheus text), POST /tokenize,
// POST /detokenize. Errors are OpenAI's error
// object with 400 / 401 / 404 / 405 / 411 / 413 / 415 / 429 / 500 / 501 / 503 (openai_protocol.h).
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
#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "simpler/base/clock.h"
#include "simpler/engine/llm_engine.h"
#include "simpler/serve/openai_protocol.h"
#include "simpler/tokenizer/chat_template.h"
#include "simpler/tokenizer/tokenizer.h"

namespace simpler::serve {

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8000;                  // 0: any free port (bind() returns it)
  std::string served_model_name;    // the `model` requests name and /v1/models lists
  std::string api_key;              // empty: no authentication
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
  // naming the address when it cannot bind. Returns the bound port.
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

}  // namespace simpler::serve
