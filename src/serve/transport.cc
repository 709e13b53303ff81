#include "serve/transport.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "serve/http_errors.h"
#include "simpler/base/clock.h"
#include "simpler/base/log.h"
#include "simpler/base/sync.h"

namespace simpler::serve {

namespace {

// Set on the thread that answers a connection the pool had no room for.
thread_local bool tl_overloaded = false;

// cpp-httplib's TaskQueue with a bounded queue: `threads` workers; a connection that finds
// `max_queued` connections waiting beyond the idle workers goes to one refusal thread, which
// answers its requests with 503 at once (tl_overloaded); when even that one's queue is full the
// connection is answered on the listener thread itself (once its request is read: a slowloris
// client there stalls accepting; see openai_server.h).
class BoundedPool : public httplib::TaskQueue {
 public:
  BoundedPool(size_t threads, size_t max_queued) : threads_(threads), max_queued_(max_queued) {
    for (size_t i = 0; i < threads; ++i) workers_.emplace_back([this] { work(jobs_, false); });
    workers_.emplace_back([this] { work(refusals_, true); });
  }
  ~BoundedPool() override = default;

  void enqueue(std::function<void()> fn) override {
    {
      std::unique_lock<std::mutex> l(mu_);
      // Idle workers take a connection at once: only the ones beyond them wait in the queue.
      // Counted as connections held (queued or being answered) against the pool's room, so a
      // burst that arrives before the workers first wait (a server just started) is queued for
      // them, not refused.
      if (jobs_.size() + busy_ < max_queued_ + threads_) {
        jobs_.push_back(std::move(fn));
        cv_.notify_all();
        return;
      }
      if (refusals_.size() < max_queued_) {
        refusals_.push_back(std::move(fn));
        cv_.notify_all();
        return;
      }
    }
    tl_overloaded = true;
    fn();
    tl_overloaded = false;
  }

  void shutdown() override {
    {
      std::unique_lock<std::mutex> l(mu_);
      shutdown_ = true;
    }
    cv_.notify_all();
    for (std::thread& t : workers_) t.join();
  }

 private:
  void work(std::deque<std::function<void()>>& q, bool refusal) {
    tl_overloaded = refusal;
    for (;;) {
      std::function<void()> fn;
      {
        std::unique_lock<std::mutex> l(mu_);
        cv_.wait(l, [&] { return !q.empty() || shutdown_; });
        if (q.empty()) return;
        fn = std::move(q.front());
        q.pop_front();
        if (!refusal) ++busy_;
      }
      fn();
      if (!refusal) {
        std::unique_lock<std::mutex> l(mu_);
        --busy_;
      }
    }
  }

  const size_t threads_;
  const size_t max_queued_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> jobs_, refusals_;
  size_t busy_ = 0;  // workers answering a connection
  bool shutdown_ = false;
  std::vector<std::thread> workers_;
};

// The local port of a socket, or -1.
int local_port(int fd) {
  sockaddr_storage a{};
  socklen_t len = sizeof(a);
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) return -1;
  if (a.ss_family == AF_INET) return ntohs(reinterpret_cast<sockaddr_in*>(&a)->sin_port);
  if (a.ss_family == AF_INET6) return ntohs(reinterpret_cast<sockaddr_in6*>(&a)->sin6_port);
  return -1;
}

// Calls fn(fd) for every accepted (non-listening) TCP socket of this process whose local port
// is `port`: the server's connections (cpp-httplib 0.11 does not expose them; clients of the
// same process have ephemeral local ports).
template <typename Fn>
void for_each_connection(int port, Fn fn) {
  DIR* d = ::opendir("/proc/self/fd");
  if (d == nullptr) return;
  const int dir_fd = ::dirfd(d);
  while (dirent* e = ::readdir(d)) {
    char* end = nullptr;
    const long fd = std::strtol(e->d_name, &end, 10);
    if (end == e->d_name || *end != '\0' || fd == dir_fd) continue;
    // getsockopt fails (ENOTSOCK) for what is not a socket. (No fstat: a concurrent close of
    // an fd this walk only inspects is harmless, and ThreadSanitizer would report fstat.)
    int listening = 0;
    socklen_t len = sizeof(listening);
    if (::getsockopt(static_cast<int>(fd), SOL_SOCKET, SO_ACCEPTCONN, &listening, &len) != 0 ||
        listening != 0) {
      continue;
    }
    if (local_port(static_cast<int>(fd)) != port) continue;
    if (!fn(static_cast<int>(fd))) break;
  }
  ::closedir(d);
}

// The peer of a socket as "address:port" (the form of cpp-httplib's remote_addr and
// remote_port), or "" when it has none.
std::string peer_of(int fd) {
  sockaddr_storage a{};
  socklen_t len = sizeof(a);
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) return {};
  char host[INET6_ADDRSTRLEN] = {};
  int p = -1;
  if (a.ss_family == AF_INET) {
    auto* in = reinterpret_cast<sockaddr_in*>(&a);
    ::inet_ntop(AF_INET, &in->sin_addr, host, sizeof(host));
    p = ntohs(in->sin_port);
  } else if (a.ss_family == AF_INET6) {
    auto* in6 = reinterpret_cast<sockaddr_in6*>(&a);
    ::inet_ntop(AF_INET6, &in6->sin6_addr, host, sizeof(host));
    p = ntohs(in6->sin6_port);
  } else {
    return {};
  }
  return absl::StrCat(std::string(host), ":", p);
}

std::string peer_key(const httplib::Request& req) {
  return absl::StrCat(req.remote_addr, ":", req.remote_port);
}

// The server's connection from this peer (the socket of the calling handler's request), or -1.
int find_connection(int port, const std::string& peer_addr, int peer_port) {
  const std::string want = absl::StrCat(peer_addr, ":", peer_port);
  int found = -1;
  for_each_connection(port, [&](int fd) {
    if (peer_of(fd) != want) return true;
    found = fd;
    return false;
  });
  return found;
}

// Whether the peer of a connection has closed it (or reset it).
bool peer_gone(int fd) {
  if (fd < 0) return false;
  pollfd p{fd, POLLRDHUP, 0};
  return ::poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0;
}

// Shuts a connection down with the raw system call: the fd is its worker's, which closes it
// when the connection ends (ThreadSanitizer's interceptor would count the shutdown as a use
// racing that close; an fd reused meanwhile with this local port is another connection to cut).
void shut_down_connection(int fd) { ::syscall(SYS_shutdown, fd, SHUT_RDWR); }

// Reads and drops what a client already sent on a connection that is about to be answered and
// closed, bounded (8 MiB, 0.5 s): closing a socket with unread data resets the connection,
// which could lose the answer on its way. (Shutting down the reading side instead would make
// cpp-httplib take the connection for gone and not answer.)
void discard_pending_input(int fd) {
  if (fd < 0) return;
  char scratch[16384];
  size_t drained = 0;
  const int64_t t0 = base::now_ns();
  pollfd p{fd, POLLIN, 0};
  while (drained < (8u << 20) && base::now_ns() - t0 < 500'000'000 && ::poll(&p, 1, 50) > 0) {
    const ssize_t n = ::recv(fd, scratch, sizeof(scratch), MSG_DONTWAIT);
    if (n <= 0) break;
    drained += static_cast<size_t>(n);
  }
}

ApiError too_large(const std::string& bytes, size_t max_body_bytes) {
  return api_error(413,
                   absl::StrCat("the request body is too large: ", bytes, " bytes, the limit is ",
                                max_body_bytes),
                   "invalid_request_error", "payload_too_large");
}

// How a request is answered before routing. Plain value.
struct BodyRefusal {
  int status = 0;                 // 404: nothing is routed there (the error handler answers)
  std::optional<ApiError> error;  // else this answer
  bool unread_body = false;       // body bytes may follow: close the connection after answering
};

// cpp-httplib 0.11 reads a request's body before routing when the method may carry one (POST,
// PUT, PATCH, DELETE, PRI): one without a length to the end of the connection, a chunked one
// whole into memory, and one with a Content-Length only after discarding it. So the headers are
// judged first, and a request is answered here unless a route reads its body (the POST routes
// read a Content-Length or chunked body bounded by max_body_bytes, Transport::read_body):
//   * neither Content-Length nor Transfer-Encoding: no body (RFC 9112 6.3); 404 / 405 when
//     nothing is routed there, else 411 (every POST route takes a JSON body);
//   * both: 400 (RFC 9112 6.1: a request smuggling vector); a Transfer-Encoding other than
//     chunked: 501;
//   * chunked: 404 / 405 when nothing is routed there, else the route reads it;
//   * Content-Length: 400 when it is not a decimal number, 413 past max_body_bytes;
//   * a multipart/form-data body on a route: 415.
std::optional<BodyRefusal> body_refusal(const httplib::Request& req, size_t max_body_bytes,
                                        bool routed) {
  const bool may_have_body = req.method == "POST" || req.method == "PUT" || req.method == "PATCH" ||
                             req.method == "DELETE" || req.method == "PRI";
  if (!may_have_body) return std::nullopt;
  const bool sized = req.has_header("Content-Length");
  const bool encoded = req.has_header("Transfer-Encoding");
  if (routed && req.is_multipart_form_data()) {  // the body reader takes a plain body only
    return BodyRefusal{.error = api_error(415, "the request body must be JSON, not multipart",
                                          "invalid_request_error"),
                       .unread_body = true};
  }
  if (sized && encoded) {
    return BodyRefusal{.error = api_error(400,
                                          "send either a Content-Length or a Transfer-Encoding, "
                                          "not both",
                                          "invalid_request_error"),
                       .unread_body = true};
  }
  if (encoded) {
    const std::string te = absl::AsciiStrToLower(req.get_header_value("Transfer-Encoding"));
    if (absl::StripAsciiWhitespace(te) != "chunked") {
      return BodyRefusal{.error = api_error(501,
                                            absl::StrCat("Transfer-Encoding '", te.substr(0, 40),
                                                         "' is not supported (chunked is)"),
                                            "invalid_request_error"),
                         .unread_body = true};
    }
    if (!routed) return BodyRefusal{.status = 404, .error = std::nullopt, .unread_body = true};
    return std::nullopt;
  }
  if (!sized) {
    if (!routed) return BodyRefusal{.status = 404, .error = std::nullopt, .unread_body = false};
    return BodyRefusal{.error = api_error(411,
                                          "this endpoint takes a JSON body: send it with a "
                                          "Content-Length or chunked",
                                          "invalid_request_error", "length_required"),
                       .unread_body = true};
  }
  const std::string len = req.get_header_value("Content-Length");
  const bool parsed =
      !len.empty() && len.size() <= 19 && len.find_first_not_of("0123456789") == std::string::npos;
  if (!parsed) {
    return BodyRefusal{
        .error = api_error(400, absl::StrCat("invalid Content-Length '", len.substr(0, 40), "'"),
                           "invalid_request_error"),
        .unread_body = true};
  }
  if (std::stoull(len) <= max_body_bytes) return std::nullopt;
  return BodyRefusal{.error = too_large(len, max_body_bytes), .unread_body = true};
}

}  // namespace

bool connection_overloaded() { return tl_overloaded; }

bool ClientWatch::gone() {
  if (fd_ == -2) fd_ = find_connection(port_, addr_, peer_port_);
  return peer_gone(fd_);
}

// The read guard (ServerOptions::request_read_timeout_s): per connection (by peer), whether a
// handler is running for it and since when it has been without one. Every poll period the
// server's connections without a running handler for longer than the timeout (headers or body
// still arriving, or idle) are shut down; cpp-httplib's worker then sees the connection end and
// closes it. Entries of connections gone for two walks are dropped. Thread-safe.
class ReadGuard {
 public:
  explicit ReadGuard(double timeout_s) : timeout_s_(timeout_s) {}

  void mark_busy(const std::string& peer, bool busy) {
    base::MutexLock l(mu_);
    Connection& c = connections_[peer];
    c.busy = busy;
    c.idle_since_ns = base::now_ns();
    c.seen_walk = walks_;
  }

  // Walks `port`'s connections every poll period until stop().
  void run(int port) {
    const auto timeout_ns = static_cast<int64_t>(timeout_s_ * 1e9);
    const auto period =
        std::chrono::nanoseconds(std::clamp<int64_t>(timeout_ns / 4, 10'000'000, 500'000'000));
    base::MutexLock l(mu_);
    while (!stop_) {
      cv_.wait_until(l, std::chrono::steady_clock::now() + period);
      if (stop_) break;
      const int64_t walk = ++walks_;
      l.unlock();
      std::vector<std::pair<int, std::string>> seen;
      for_each_connection(port, [&](int fd) {
        std::string peer = peer_of(fd);
        if (!peer.empty()) seen.emplace_back(fd, std::move(peer));
        return true;
      });
      l.lock();
      cut(overdue(seen, walk, timeout_ns));
    }
  }

  void stop() {
    {
      base::MutexLock l(mu_);
      stop_ = true;
    }
    cv_.notify_all();
  }

 private:
  struct Connection {
    bool busy = false;
    int64_t idle_since_ns = 0;
    int64_t seen_walk = 0;
  };

  // Records the connections `seen` by walk `walk`, drops those not seen for two walks, and
  // returns those without a running handler for longer than the timeout.
  std::vector<std::pair<int, std::string>> overdue(
      const std::vector<std::pair<int, std::string>>& seen, int64_t walk, int64_t timeout_ns)
      SIMPLER_REQUIRES(mu_) {
    std::vector<std::pair<int, std::string>> late;
    const int64_t now = base::now_ns();
    for (const auto& [fd, peer] : seen) {
      auto [it, fresh] = connections_.try_emplace(peer);
      Connection& c = it->second;
      if (fresh) c.idle_since_ns = now;
      c.seen_walk = walk;
      if (!c.busy && now - c.idle_since_ns > timeout_ns) late.emplace_back(fd, peer);
    }
    for (auto it = connections_.begin(); it != connections_.end();) {
      if (it->second.seen_walk < walk - 1) {
        it = connections_.erase(it);
      } else {
        ++it;
      }
    }
    return late;
  }

  void cut(const std::vector<std::pair<int, std::string>>& late) SIMPLER_REQUIRES(mu_) {
    for (const auto& [fd, peer] : late) {
      connections_.erase(peer);
      // Only if the fd still belongs to that peer.
      if (peer_of(fd) != peer) continue;
      shut_down_connection(fd);
      SIMPLER_LOG_WARN("closed the connection from {}: no complete request within {} s", peer,
                       timeout_s_);
    }
  }

  const double timeout_s_;
  base::Mutex mu_;
  base::CondVar cv_;
  std::unordered_map<std::string, Connection> connections_ SIMPLER_GUARDED_BY(mu_);
  int64_t walks_ SIMPLER_GUARDED_BY(mu_) = 0;
  bool stop_ SIMPLER_GUARDED_BY(mu_) = false;
};

Transport::Transport(httplib::Server* http, const ServerOptions* options)
    : http_(http),
      options_(options),
      guard_(std::make_unique<ReadGuard>(options->request_read_timeout_s)) {}

Transport::~Transport() = default;

void Transport::install() {
  http_->set_payload_max_length(options_->max_body_bytes);
  // SO_REUSEADDR only: cpp-httplib's default adds SO_REUSEPORT, which would let a second server
  // bind the same port and steal half its connections. The socket is kept to raise the listen
  // backlog after binding (Debian's libcpp-httplib listens with a backlog of 5: a burst of
  // connections would overflow it).
  http_->set_socket_options([this](int sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
    listen_fd_ = sock;
  });
  // A refused body is answered before it is read, and the client is told to close the
  // connection (what is left of the body would be read as the next request).
  http_->set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
    if (before_ && before_(req, res)) return httplib::Server::HandlerResponse::Handled;
    const bool routed = routed_ && routed_(req.method, req.path);
    std::optional<BodyRefusal> refusal = body_refusal(req, options_->max_body_bytes, routed);
    if (!refusal) return httplib::Server::HandlerResponse::Unhandled;
    if (refusal->error) {
      send_error(res, *refusal->error);
    } else {
      res.status = refusal->status;  // the error handler writes its object
    }
    if (refusal->unread_body) {
      res.set_header("Connection", "close");
      discard_pending_input(find_connection(bound_port_, req.remote_addr, req.remote_port));
    }
    return httplib::Server::HandlerResponse::Handled;
  });
  // The read guard learns which connections have a handler running: from the handler's start
  // (watched(): the request's headers and body are in) to the end of its response (the logger
  // runs once the response is written, or failed to be).
  http_->set_logger([this](const httplib::Request& req, const httplib::Response& res) {
    guard_->mark_busy(peer_key(req), false);
    if (after_) after_(req, res);
  });
  http_->set_keep_alive_max_count(1000);
  http_->set_keep_alive_timeout(5);
  const size_t threads = static_cast<size_t>(options_->max_concurrent_requests) + 8;
  const size_t queued = static_cast<size_t>(options_->max_queued_connections);
  http_->new_task_queue = [threads, queued] { return new BoundedPool(threads, queued); };
}

void Transport::set_routes(std::function<bool(const std::string&, const std::string&)> routed) {
  routed_ = std::move(routed);
}

void Transport::set_request_hooks(
    std::function<bool(const httplib::Request&, httplib::Response&)> before,
    std::function<void(const httplib::Request&, const httplib::Response&)> after) {
  before_ = std::move(before);
  after_ = std::move(after);
}

httplib::Server::HandlerWithContentReader Transport::read_body(httplib::Server::Handler h) {
  return [this, h = watched(std::move(h))](const httplib::Request& req, httplib::Response& res,
                                           const httplib::ContentReader& reader) {
    const size_t limit = options_->max_body_bytes;
    std::string body;
    bool over = false;
    const bool read = reader([&](const char* data, size_t n) {
      over = body.size() + n > limit;
      if (!over) body.append(data, n);
      return !over;
    });
    if (!read) {
      // What is left of the body would be read as the next request.
      res.set_header("Connection", "close");
      discard_pending_input(find_connection(bound_port_, req.remote_addr, req.remote_port));
      send_error(res, over ? too_large(absl::StrCat("more than ", limit), limit)
                           : api_error(400, "the request body could not be read (malformed chunks)",
                                       "invalid_request_error"));
      return;
    }
    httplib::Request with_body = req;
    with_body.body = std::move(body);
    h(with_body, res);
  };
}

httplib::Server::Handler Transport::watched(httplib::Server::Handler h) {
  return [this, h = std::move(h)](const httplib::Request& req, httplib::Response& res) {
    guard_->mark_busy(peer_key(req), true);
    h(req, res);
  };
}

absl::StatusOr<int> Transport::bind() {
  const ServerOptions& o = *options_;
  const double t = o.request_read_timeout_s;
  if (!std::isfinite(t) || t < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("request_read_timeout_s must be finite and >= 0, got ", t));
  }
  if (o.max_concurrent_requests < 1 || o.max_queued_connections < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_concurrent_requests must be >= 1 and max_queued_connections >= 0, got ",
                     o.max_concurrent_requests, " and ", o.max_queued_connections));
  }
  if (o.port == 0) {
    const int port = http_->bind_to_any_port(o.host);
    if (port <= 0)
      return absl::UnavailableError(absl::StrCat("cannot bind ", o.host, " (any port)"));
    bound_port_ = port;
  } else {
    if (!http_->bind_to_port(o.host, o.port)) {
      return absl::UnavailableError(absl::StrCat("cannot bind ", o.host, ":", o.port,
                                                 " (in use, or not an address of this machine)"));
    }
    bound_port_ = o.port;
  }
  if (listen_fd_ >= 0) ::listen(listen_fd_, SOMAXCONN);
  return bound_port_;
}

bool Transport::listen(const std::atomic<bool>& shutting_down) {
  // serving_ before shutting_down is read; OpenAiServer::shutdown sets shutting_down before
  // stop() reads serving_ (both sequentially consistent): either listen() sees the shutdown and
  // returns, or stop() sees listen() and stops the listener once it runs.
  serving_.store(true);
  std::thread guard;
  if (options_->request_read_timeout_s > 0) {
    guard = std::thread([this] { guard_->run(bound_port_); });
  }
  bool ok = true;
  if (!shutting_down.load()) ok = http_->listen_after_bind();
  if (guard.joinable()) {
    guard_->stop();
    guard.join();
  }
  serving_.store(false);
  return ok;
}

void Transport::stop() {
  // Stop the listener (once it runs: listen() may be about to start it), then cut the
  // connections still open: a client trickling its headers or idling on keep-alive would
  // otherwise hold a pool thread, and listen() waits for every one.
  bool stopped = false;
  const int64_t t0 = base::now_ns();
  while (serving_.load() && base::now_ns() - t0 < 10'000'000'000) {
    if (!stopped && http_->is_running()) {
      http_->stop();
      stopped = true;
    }
    if (stopped && bound_port_ > 0) {
      for_each_connection(bound_port_, [](int fd) {
        shut_down_connection(fd);
        return true;
      });
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (!stopped && http_->is_running()) http_->stop();
}

ClientWatch Transport::watch(const httplib::Request& req) const {
  return ClientWatch(bound_port_, req.remote_addr, req.remote_port);
}

}  // namespace simpler::serve
