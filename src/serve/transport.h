// The connection side of OpenAiServer on cpp-httplib 0.11: the bounded connection pool, the
// socket options and listen backlog, the body limits judged from a request's headers, the read
// guard (slowloris) and the client watch that tells a handler its client went away. The HTTP
// semantics of each part are in openai_server.h's header comment.
#pragma once

#include <httplib.h>

#include <atomic>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "simpler/serve/openai_server.h"

namespace simpler::serve {

// Whether the calling thread answers a connection the pool had no room for (its requests get
// 503 at once, and the connection is closed).
bool connection_overloaded();

// Finds a request's connection once (lazily: only requests that wait look for it, by peer
// address in /proc/self/fd) and tells whether its client closed it. Thread-compatible: one per
// request, used by its handler and then its content provider.
class ClientWatch {
 public:
  ClientWatch() = default;
  ClientWatch(int port, std::string peer_addr, int peer_port)
      : port_(port), addr_(std::move(peer_addr)), peer_port_(peer_port) {}
  bool gone();

 private:
  int port_ = 0;
  std::string addr_;
  int peer_port_ = -1;
  int fd_ = -2;  // -2: not looked up yet; -1: not found
};

class ReadGuard;

// Owns the connection handling of one httplib::Server, which it borrows with the options (both
// must outlive it). install() and bind() are called once, before listen(), by the thread that
// owns the server; listen() runs on one thread; stop() on another, once; watch() is
// thread-safe after bind().
class Transport {
 public:
  Transport(httplib::Server* http, const ServerOptions* options);
  ~Transport();
  Transport(const Transport&) = delete;
  Transport& operator=(const Transport&) = delete;

  // Socket options (SO_REUSEADDR only), the payload limit and the body-limit check before
  // routing (411 / 413 / 400, then the connection closes), keep-alive, the bounded pool and
  // the logger that tells the read guard a response ended.
  void install();
  // `h`, telling the read guard that its connection has a handler running.
  httplib::Server::Handler watched(httplib::Server::Handler h);
  // `h` as a POST route that reads its body first, sent with a Content-Length or chunked, at
  // most max_body_bytes (413 past it, 400 for malformed chunks; both close the connection),
  // and then runs watched(h) on the request with its body. The read guard limits the time the
  // body takes to arrive.
  httplib::Server::HandlerWithContentReader read_body(httplib::Server::Handler h);
  // Which method and path have a route (the check before routing answers 404 / 405 for the
  // others without reading a body). Called once, before bind().
  void set_routes(std::function<bool(const std::string& method, const std::string& path)> routed);
  // What every request goes through: `before` first in the pre-routing handler (it answers the
  // request when it returns true: nothing is routed then), `after` in cpp-httplib's logger,
  // once the response is written (or failed to be). Both run on the request's thread. Called
  // once, before bind().
  void set_request_hooks(
      std::function<bool(const httplib::Request&, httplib::Response&)> before,
      std::function<void(const httplib::Request&, const httplib::Response&)> after);
  // Checks the transport options (INVALID_ARGUMENT naming them), binds host:port (UNAVAILABLE
  // naming the address) and raises the listen backlog. Returns the bound port.
  absl::StatusOr<int> bind();
  // Runs the listener and the read guard until stop(); does not start the listener when
  // `shutting_down` is already set. Returns false when the listener failed.
  bool listen(const std::atomic<bool>& shutting_down);
  // Stops the listener (once it runs) and shuts down the connections still open, until
  // listen() returned or 10 s passed.
  void stop();
  // The client watch of a handler's request.
  ClientWatch watch(const httplib::Request& req) const;

 private:
  httplib::Server* const http_;
  const ServerOptions* const options_;
  std::unique_ptr<ReadGuard> guard_;
  std::function<bool(const std::string&, const std::string&)> routed_;       // set before bind()
  std::function<bool(const httplib::Request&, httplib::Response&)> before_;  // likewise
  std::function<void(const httplib::Request&, const httplib::Response&)> after_;  // likewise
  int listen_fd_ = -1;                // the listening socket (set while binding)
  int bound_port_ = 0;                // set by bind()
  std::atomic<bool> serving_{false};  // listen() is running (set before it checks shutting_down)
};

}  // namespace simpler::serve
