#include "simpler/serve/openai_server.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <httplib.h>
#include <netinet/in.h>
#include <openssl/crypto.h>
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
#include <random>
#include <thread>
#include <unordered_map>

#include "absl/strings/str_cat.h"
#include "simpler/base/json.h"
#include "simpler/base/log.h"
#include "simpler/base/sync.h"
#include "simpler/engine/kv_pages.h"

namespace simpler::serve {

using json = nlohmann::json;

namespace {

// Set on the thread that answers a connection the pool had no room for.
thread_local bool tl_overloaded = false;

// cpp-httplib's TaskQueue with a bounded queue: `threads` workers; a connection that finds
// `max_queued` connections waiting beyond the idle workers goes to one refusal thread, which
// answers its requests with 503 at once (tl_overloaded); when even that one's queue is full the
// connection is answered on the listener thread itself (once its request is read: a slowloris
// client there stalls accepting; see the header).
class BoundedPool : public httplib::TaskQueue {
 public:
  BoundedPool(size_t threads, size_t max_queued) : max_queued_(max_queued) {
    for (size_t i = 0; i < threads; ++i) workers_.emplace_back([this] { work(jobs_, false); });
    workers_.emplace_back([this] { work(refusals_, true); });
  }
  ~BoundedPool() override = default;

  void enqueue(std::function<void()> fn) override {
    {
      std::unique_lock<std::mutex> l(mu_);
      // Idle workers take a connection at once: only the ones beyond them wait in the queue.
      if (jobs_.size() < max_queued_ + idle_) {
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
        if (!refusal) ++idle_;
        cv_.wait(l, [&] { return !q.empty() || shutdown_; });
        if (!refusal) --idle_;
        if (q.empty()) return;
        fn = std::move(q.front());
        q.pop_front();
      }
      fn();
    }
  }

  const size_t max_queued_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> jobs_, refusals_;
  size_t idle_ = 0;  // workers waiting for a connection
  bool shutdown_ = false;
  std::vector<std::thread> workers_;
};

void send_error(httplib::Response& res, const ApiError& e) {
  res.status = e.http_status;
  res.set_content(e.to_json(), "application/json");
}

ApiError api_error(int status, std::string message, std::string type, std::string code = {}) {
  ApiError e;
  e.http_status = status;
  e.message = std::move(message);
  e.type = std::move(type);
  e.code = std::move(code);
  return e;
}

// An engine refusal or failure as an HTTP error.
ApiError from_status(const absl::Status& s) {
  switch (s.code()) {
    case absl::StatusCode::kInvalidArgument:
      return bad_request(std::string(s.message()));
    case absl::StatusCode::kResourceExhausted:
      return api_error(429, std::string(s.message()), "rate_limit_error", "queue_full");
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kUnavailable:
      return api_error(503, std::string(s.message()), "service_unavailable");
    default:
      return api_error(500, std::string(s.message()), "server_error");
  }
}

std::string random_id(const char* prefix) {
  static std::atomic<uint64_t> counter{0};
  thread_local std::mt19937_64 rng(std::random_device{}());
  return absl::StrCat(prefix, "-", absl::Hex(rng(), absl::kZeroPad16),
                      absl::Hex(counter.fetch_add(1), absl::kZeroPad4));
}

int64_t unix_seconds() {
  return std::chrono::duration_cast<std::chrono::seconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

const char* finish_name(llm::OutputFinish f) { return llm::finish_reason_name(f); }

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

// Finds the request's connection once (lazily: only requests that wait look for it) and tells
// whether its client went away.
struct ClientWatch {
  int port = 0;
  std::string addr;
  int peer_port = -1;
  int fd = -2;  // -2: not looked up yet; -1: not found
  bool gone() {
    if (fd == -2) fd = find_connection(port, addr, peer_port);
    return peer_gone(fd);
  }
};

}  // namespace

struct OpenAiServer::Impl {
  llm::LlmEngine* engine;
  const llm::Tokenizer* tokenizer;
  absl::StatusOr<llm::ChatTemplate> chat;
  ServerOptions options;
  httplib::Server http;
  std::atomic<bool> shutting_down{false};
  std::atomic<bool> serving{false};  // serve() is running (set before it checks shutting_down)
  std::atomic<int64_t> open_responses{0};  // content providers not yet released
  int listen_fd = -1;                      // the listening socket (set while binding)
  std::once_flag shutdown_once;
  absl::Status shutdown_status;
  int bound_port = 0;

  Impl(llm::LlmEngine* e, const llm::Tokenizer* t, absl::StatusOr<llm::ChatTemplate> c,
       ServerOptions o)
      : engine(e), tokenizer(t), chat(std::move(c)), options(std::move(o)) {}

  // The read guard (ServerOptions::request_read_timeout_s): per connection (by peer), whether a
  // handler is running for it and since when it has been without one.
  struct Connection {
    bool busy = false;
    int64_t idle_since_ns = 0;
    int64_t seen_walk = 0;
  };
  base::Mutex guard_mu;
  base::CondVar guard_cv;
  std::unordered_map<std::string, Connection> connections SIMPLER_GUARDED_BY(guard_mu);
  int64_t walks SIMPLER_GUARDED_BY(guard_mu) = 0;
  bool guard_stop SIMPLER_GUARDED_BY(guard_mu) = false;
  void mark_busy(const httplib::Request& req, bool busy);
  void guard_loop();

  bool authorized(const httplib::Request& req, httplib::Response& res) const;
  void routes();
  void handle_generate(const httplib::Request& req, httplib::Response& res, bool chat_endpoint);
  std::string token_text(int32_t id) const { return tokenizer->decode(std::vector<int32_t>{id}); }
};

bool OpenAiServer::Impl::authorized(const httplib::Request& req, httplib::Response& res) const {
  if (options.api_key.empty()) return true;
  const std::string header = req.get_header_value("Authorization");
  const std::string want = "Bearer " + options.api_key;
  // Constant time in the key's length (CRYPTO_memcmp), whatever the header holds.
  const bool ok =
      header.size() == want.size() && CRYPTO_memcmp(header.data(), want.data(), want.size()) == 0;
  if (!ok) {
    send_error(res, api_error(401,
                              header.empty() ? "missing API key: send 'Authorization: Bearer KEY'"
                                             : "invalid API key",
                              "authentication_error", "invalid_api_key"));
  }
  return ok;
}

void OpenAiServer::Impl::mark_busy(const httplib::Request& req, bool busy) {
  base::MutexLock l(guard_mu);
  Connection& c = connections[peer_key(req)];
  c.busy = busy;
  c.idle_since_ns = base::now_ns();
  c.seen_walk = walks;
}

// Every poll period: the server's connections without a running handler for longer than the
// timeout (headers or body still arriving, or idle) are shut down; cpp-httplib's worker then
// sees the connection end and closes it. Entries of connections gone for two walks are dropped.
void OpenAiServer::Impl::guard_loop() {
  const auto timeout_ns = static_cast<int64_t>(options.request_read_timeout_s * 1e9);
  const auto period =
      std::chrono::nanoseconds(std::clamp<int64_t>(timeout_ns / 4, 10'000'000, 500'000'000));
  base::MutexLock l(guard_mu);
  while (!guard_stop) {
    guard_cv.wait_until(l, std::chrono::steady_clock::now() + period);
    if (guard_stop) break;
    const int64_t walk = ++walks;
    std::vector<std::pair<int, std::string>> cut;
    l.unlock();
    std::vector<std::pair<int, std::string>> seen;
    for_each_connection(bound_port, [&](int fd) {
      std::string peer = peer_of(fd);
      if (!peer.empty()) seen.emplace_back(fd, std::move(peer));
      return true;
    });
    l.lock();
    const int64_t now = base::now_ns();
    for (auto& [fd, peer] : seen) {
      auto [it, fresh] = connections.try_emplace(peer);
      Connection& c = it->second;
      if (fresh) c.idle_since_ns = now;
      c.seen_walk = walk;
      if (!c.busy && now - c.idle_since_ns > timeout_ns) cut.emplace_back(fd, peer);
    }
    for (auto it = connections.begin(); it != connections.end();) {
      if (it->second.seen_walk < walk - 1) {
        it = connections.erase(it);
      } else {
        ++it;
      }
    }
    for (auto& [fd, peer] : cut) {
      connections.erase(peer);
      // Only if the fd still belongs to that peer. The raw system call: the fd is the worker's,
      // which closes it when the connection ends (ThreadSanitizer's interceptor would count the
      // shutdown as a use racing that close).
      if (peer_of(fd) != peer) continue;
      ::syscall(SYS_shutdown, fd, SHUT_RDWR);
      SIMPLER_LOG_WARN("closed the connection from {}: no complete request within {} s", peer,
                       options.request_read_timeout_s);
    }
  }
}

namespace {

// One request's response state, shared by the handler and its content provider.
struct Exchange {
  llm::LlmEngine* engine = nullptr;
  llm::RequestId id = 0;
  bool chat = false;
  bool stream = false;
  bool include_usage = false;
  bool echo = false;
  std::optional<int32_t> logprobs;
  std::string response_id, model, prompt_text, request_id;
  int64_t created = 0;
  int64_t prompt_tokens = 0;
  int32_t n = 1;
  // Per choice.
  std::vector<std::string> text;
  std::vector<int64_t> completion_tokens;
  std::vector<std::string> finish;
  std::vector<json> logprob_content;  // chat: list; completions: {tokens, token_logprobs, ...}
  std::vector<bool> started;          // chat stream: the role chunk went out
  int32_t open = 0;
  std::deque<llm::RequestOutput> pending;  // events read before the provider ran
  bool done_written = false;
  bool failed_in_stream = false;
  int64_t start_ns = 0, first_token_ns = 0;
  std::function<std::string(int32_t)> token_text;
  ClientWatch client;  // the request's connection (a client that left aborts the request)
};

json logprob_entry_chat(const Exchange& x, int32_t id, const llm::TokenLogprob& lp) {
  auto bytes = [](const std::string& s) {
    json b = json::array();
    for (unsigned char c : s) b.push_back(static_cast<int>(c));
    return b;
  };
  const std::string t = x.token_text(id);
  json top = json::array();
  for (const auto& [tid, l] : lp.top) {
    const std::string tt = x.token_text(tid);
    top.push_back({{"token", tt}, {"logprob", l}, {"bytes", bytes(tt)}});
  }
  return {{"token", t}, {"logprob", lp.logprob}, {"bytes", bytes(t)}, {"top_logprobs", top}};
}

// Folds an event into the choice's state; returns the stream chunk(s) for it ("" when not
// streaming or nothing to send).
std::string apply_event(Exchange& x, const llm::RequestOutput& out) {
  const int32_t i = out.index;
  if (x.first_token_ns == 0 && !out.token_ids.empty()) x.first_token_ns = base::now_ns();
  x.text[i] += out.text;
  json lp_delta = nullptr;
  if (x.logprobs.has_value() && !out.logprobs.empty()) {
    if (x.chat) {
      json content = json::array();
      for (size_t k = 0; k < out.token_ids.size() && k < out.logprobs.size(); ++k) {
        content.push_back(logprob_entry_chat(x, out.token_ids[k], out.logprobs[k]));
        x.logprob_content[i]["content"].push_back(content.back());
      }
      lp_delta = {{"content", content}};
    } else {
      json d = {{"tokens", json::array()},
                {"token_logprobs", json::array()},
                {"top_logprobs", json::array()},
                {"text_offset", json::array()}};
      for (size_t k = 0; k < out.token_ids.size() && k < out.logprobs.size(); ++k) {
        json top = json::object();
        for (const auto& [tid, l] : out.logprobs[k].top) top[x.token_text(tid)] = l;
        d["tokens"].push_back(x.token_text(out.token_ids[k]));
        d["token_logprobs"].push_back(out.logprobs[k].logprob);
        d["top_logprobs"].push_back(top);
        d["text_offset"].push_back(0);
      }
      for (const char* key : {"tokens", "token_logprobs", "top_logprobs", "text_offset"}) {
        for (const json& v : d[key]) x.logprob_content[i][key].push_back(v);
      }
      lp_delta = d;
    }
  }
  if (out.finished()) {
    x.completion_tokens[i] = out.completion_tokens;
    x.finish[i] = finish_name(out.finish);
    --x.open;
  }
  if (!x.stream) return "";
  std::string chunks;
  auto emit = [&](json choice) {
    json c = {{"id", x.response_id},
              {"object", x.chat ? "chat.completion.chunk" : "text_completion"},
              {"created", x.created},
              {"model", x.model},
              {"choices", json::array({std::move(choice)})}};
    chunks += "data: " + base::dump_replacing(c) + "\n\n";
  };
  if (x.chat && !x.started[i]) {
    x.started[i] = true;
    emit({{"index", i},
          {"delta", {{"role", "assistant"}, {"content", ""}}},
          {"logprobs", nullptr},
          {"finish_reason", nullptr}});
  }
  if (!out.text.empty() || !lp_delta.is_null()) {
    if (x.chat) {
      emit({{"index", i},
            {"delta", {{"content", out.text}}},
            {"logprobs", lp_delta},
            {"finish_reason", nullptr}});
    } else {
      emit({{"index", i}, {"text", out.text}, {"logprobs", lp_delta}, {"finish_reason", nullptr}});
    }
  }
  if (out.finished()) {
    if (out.finish == llm::OutputFinish::kError) {
      x.failed_in_stream = true;
      ApiError e = api_error(500, std::string(out.error.message()), "server_error");
      chunks += "data: " + e.to_json() + "\n\n";
    }
    if (x.chat) {
      emit({{"index", i},
            {"delta", json::object()},
            {"logprobs", nullptr},
            {"finish_reason", x.finish[i]}});
    } else {
      emit({{"index", i}, {"text", ""}, {"logprobs", nullptr}, {"finish_reason", x.finish[i]}});
    }
  }
  return chunks;
}

json usage(const Exchange& x) {
  int64_t completion = 0;
  for (int64_t c : x.completion_tokens) completion += c;
  return {{"prompt_tokens", x.prompt_tokens},
          {"completion_tokens", completion},
          {"total_tokens", x.prompt_tokens + completion}};
}

std::string final_body(const Exchange& x) {
  json choices = json::array();
  for (int32_t i = 0; i < x.n; ++i) {
    json lp = x.logprobs.has_value() ? x.logprob_content[i] : json(nullptr);
    if (x.chat) {
      choices.push_back({{"index", i},
                         {"message", {{"role", "assistant"}, {"content", x.text[i]}}},
                         {"logprobs", lp},
                         {"finish_reason", x.finish[i]}});
    } else {
      choices.push_back({{"index", i},
                         {"text", (x.echo ? x.prompt_text : std::string()) + x.text[i]},
                         {"logprobs", lp},
                         {"finish_reason", x.finish[i]}});
    }
  }
  json body = {{"id", x.response_id},  {"object", x.chat ? "chat.completion" : "text_completion"},
               {"created", x.created}, {"model", x.model},
               {"choices", choices},   {"usage", usage(x)}};
  return base::dump_replacing(body);
}

}  // namespace

void OpenAiServer::Impl::handle_generate(const httplib::Request& req, httplib::Response& res,
                                         bool chat_endpoint) {
  const int64_t start_ns = base::now_ns();
  std::string request_id = req.get_header_value("X-Request-Id");
  if (request_id.empty() || request_id.size() > 128) request_id = random_id("req");
  res.set_header("X-Request-Id", request_id);
  auto fail = [&](const ApiError& e) {
    send_error(res, e);
    SIMPLER_LOG_INFO("request {}: {} {} ({})", request_id, e.http_status, req.path,
                     e.message.substr(0, 200));
  };
  if (!authorized(req, res)) return;
  if (shutting_down.load()) {
    return fail(api_error(503, "the server is shutting down", "service_unavailable"));
  }
  if (tl_overloaded) {
    res.set_header("Connection", "close");
    return fail(api_error(503, "the server is at its connection limit; retry later",
                          "service_unavailable", "overloaded"));
  }
  auto parsed = parse_request(req.body, chat_endpoint, options.limits);
  if (auto* e = std::get_if<ApiError>(&parsed)) return fail(*e);
  ParsedRequest& p = std::get<ParsedRequest>(parsed);
  if (!p.model.empty() && p.model != options.served_model_name) {
    return fail(api_error(
        404,
        absl::StrCat("the model '", p.model.substr(0, 100),
                     "' does not exist; this server serves '", options.served_model_name, "'"),
        "invalid_request_error", "model_not_found"));
  }
  const llm::Qwen3Dims& dims = engine->dims();
  std::vector<int32_t> ids;
  std::string prompt_text;
  if (chat_endpoint) {
    if (!chat.ok()) {
      return fail(bad_request(
          absl::StrCat("chat is unavailable for this model: ", chat.status().message())));
    }
    auto rendered = chat->render(p.messages, p.chat_options);
    if (!rendered.ok())
      return fail(bad_request(std::string(rendered.status().message()), "messages"));
    auto encoded = tokenizer->try_encode(*rendered);
    if (!encoded.ok())
      return fail(bad_request(std::string(encoded.status().message()), "messages"));
    ids = *std::move(encoded);
  } else if (auto* text = std::get_if<std::string>(&p.prompt)) {
    auto encoded = tokenizer->try_encode(*text);
    if (!encoded.ok()) return fail(bad_request(std::string(encoded.status().message()), "prompt"));
    ids = *std::move(encoded);
    prompt_text = *text;
  } else {
    for (int64_t id : std::get<std::vector<int64_t>>(p.prompt)) {
      if (id >= dims.vocab_size) {
        return fail(
            bad_request(absl::StrCat("prompt token id ", id, " is outside the vocabulary [0, ",
                                     dims.vocab_size, ")"),
                        "prompt"));
      }
      ids.push_back(static_cast<int32_t>(id));
    }
    if (p.echo) prompt_text = tokenizer->decode(ids);
  }
  if (ids.empty())
    return fail(bad_request("the prompt is empty", chat_endpoint ? "messages" : "prompt"));
  const int64_t plen = static_cast<int64_t>(ids.size());
  const int64_t context = engine->config().max_position_embeddings;
  const llm::RunnerOptions& ro = engine->options().runner;
  const int64_t pool_tokens = static_cast<int64_t>(ro.num_pages) * ro.page_size;
  int64_t max_tokens = 0;
  if (p.max_tokens.has_value()) {
    max_tokens = *p.max_tokens;
    if (plen + max_tokens > context) {
      return fail(
          bad_request(absl::StrCat("this model's maximum context length is ", context,
                                   " tokens; the prompt has ", plen, " tokens and max_tokens is ",
                                   max_tokens, " (", plen + max_tokens, " in all)"),
                      chat_endpoint ? "messages" : "prompt"));
    }
  } else {
    // As vLLM: up to the context length minus the prompt, bounded by what the KV pool holds.
    max_tokens = std::min(context - plen, pool_tokens - plen + 1);
    if (max_tokens < 1) {
      return fail(bad_request(
          absl::StrCat("the prompt has ", plen, " tokens; the model's context holds ", context,
                       " and the KV cache ", pool_tokens, ": no room for one new token"),
          chat_endpoint ? "messages" : "prompt"));
    }
  }
  auto x = std::make_shared<Exchange>();
  x->engine = engine;
  x->chat = chat_endpoint;
  x->stream = p.stream;
  x->include_usage = p.include_usage;
  x->echo = p.echo && !chat_endpoint;
  x->logprobs = p.logprobs;
  x->response_id = random_id(chat_endpoint ? "chatcmpl" : "cmpl");
  x->model = options.served_model_name;
  x->prompt_text = prompt_text;
  x->request_id = request_id;
  x->created = unix_seconds();
  x->prompt_tokens = plen;
  x->n = p.n;
  x->text.assign(p.n, "");
  x->completion_tokens.assign(p.n, 0);
  x->finish.assign(p.n, "");
  x->logprob_content.assign(p.n, chat_endpoint ? json{{"content", json::array()}}
                                               : json{{"tokens", json::array()},
                                                      {"token_logprobs", json::array()},
                                                      {"top_logprobs", json::array()},
                                                      {"text_offset", json::array()}});
  x->started.assign(p.n, false);
  x->open = p.n;
  x->start_ns = start_ns;
  const llm::Tokenizer* tok = tokenizer;
  x->token_text = [tok](int32_t id) { return tok->decode(std::vector<int32_t>{id}); };
  x->client.port = bound_port;
  x->client.addr = req.remote_addr;
  x->client.peer_port = req.remote_port;

  llm::RequestSpec spec;
  spec.prompt_ids = std::move(ids);
  spec.max_tokens = max_tokens;
  spec.n = p.n;
  spec.sampling = p.sampling;
  spec.caller_id = request_id;
  absl::StatusOr<llm::RequestId> id = engine->add_request(std::move(spec));
  if (!id.ok()) return fail(from_status(id.status()));
  x->id = *id;

  // The first event decides the status: a request that fails before any output gets its error
  // as an HTTP error, not as a 200 stream.
  while (true) {
    auto out = engine->next_output(x->id, base::Deadline::after(std::chrono::milliseconds(100)));
    if (out.ok()) {
      x->pending.push_back(*std::move(out));
      break;
    }
    if (out.status().code() != absl::StatusCode::kDeadlineExceeded) {
      return fail(api_error(500, std::string(out.status().message()), "server_error"));
    }
    // Still queued: a client that left aborts its request now instead of when it runs.
    if (x->client.gone()) {
      (void)engine->abort(x->id);
      while (engine->next_output(x->id, base::Deadline::after(std::chrono::seconds(5))).ok()) {
      }
      return fail(
          api_error(499, "the client closed the connection while queued", "invalid_request_error"));
    }
  }
  const llm::RequestOutput& first = x->pending.front();
  if (first.finished() && first.token_ids.empty() && x->n == 1 &&
      (first.finish == llm::OutputFinish::kError || first.finish == llm::OutputFinish::kAbort)) {
    const absl::Status why =
        first.error.ok() ? absl::CancelledError("the request was aborted") : first.error;
    return fail(first.finish == llm::OutputFinish::kAbort
                    ? api_error(503, std::string(why.message()), "service_unavailable")
                    : api_error(500, std::string(why.message()), "server_error"));
  }
  if (x->stream && x->echo) {
    // The prompt goes out first (as every choice's first text).
  }
  auto provider = [x](size_t /*offset*/, httplib::DataSink& sink) -> bool {
    while (true) {
      // The client went away (a write failed, or it closed the connection): the releaser aborts.
      if (!sink.is_writable() || x->client.gone()) return false;
      if (x->pending.empty()) {
        if (x->open == 0) {
          if (x->stream) {
            std::string tail;
            if (x->include_usage) {
              json u = {{"id", x->response_id},
                        {"object", x->chat ? "chat.completion.chunk" : "text_completion"},
                        {"created", x->created},
                        {"model", x->model},
                        {"choices", json::array()},
                        {"usage", usage(*x)}};
              tail += "data: " + base::dump_replacing(u) + "\n\n";
            }
            tail += "data: [DONE]\n\n";
            if (!sink.write(tail.data(), tail.size())) return false;
          } else {
            const std::string body = final_body(*x);
            if (!sink.write(body.data(), body.size())) return false;
          }
          x->done_written = true;
          sink.done();
          return true;
        }
        auto out =
            x->engine->next_output(x->id, base::Deadline::after(std::chrono::milliseconds(100)));
        if (!out.ok()) {
          if (out.status().code() == absl::StatusCode::kDeadlineExceeded) {
            if (x->stream) return true;  // come back (the sink's liveness is checked first)
            continue;
          }
          return false;
        }
        x->pending.push_back(*std::move(out));
      }
      std::string chunk;
      while (!x->pending.empty()) {
        chunk += apply_event(*x, x->pending.front());
        x->pending.pop_front();
      }
      if (x->stream && !chunk.empty()) {
        if (!sink.write(chunk.data(), chunk.size())) return false;
        return true;
      }
    }
  };
  open_responses.fetch_add(1);
  auto releaser = [this, x, request_id](bool success) {
    if (!success || !x->done_written) {
      (void)x->engine->abort(x->id);  // NOT_FOUND when it already finished
      // Drain the queue so the request's delivery is released.
      while (true) {
        auto out = x->engine->next_output(x->id, base::Deadline::after(std::chrono::seconds(5)));
        if (!out.ok()) break;
      }
    }
    int64_t completion = 0;
    for (int64_t c : x->completion_tokens) completion += c;
    SIMPLER_LOG_INFO(
        "request {}: {} {} prompt {} completion {} tokens, TTFT {:.1f} ms, total {:.1f} ms",
        request_id, success && x->done_written ? "200" : "200 (client gone)",
        x->chat ? "chat" : "completion", x->prompt_tokens, completion,
        x->first_token_ns ? (x->first_token_ns - x->start_ns) / 1e6 : 0.0,
        (base::now_ns() - x->start_ns) / 1e6);
    open_responses.fetch_sub(1);
  };
  res.set_header("Cache-Control", "no-cache");
  if (x->stream) {
    res.set_chunked_content_provider("text/event-stream", provider, releaser);
  } else {
    res.set_chunked_content_provider("application/json", provider, releaser);
  }
}

void OpenAiServer::Impl::routes() {
  http.set_payload_max_length(options.max_body_bytes);
  // SO_REUSEADDR only: cpp-httplib's default adds SO_REUSEPORT, which would let a second server
  // bind the same port and steal half its connections. The socket is kept to raise the listen
  // backlog after binding (Debian's libcpp-httplib listens with a backlog of 5: a burst of
  // connections would overflow it).
  http.set_socket_options([this](int sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
    listen_fd = sock;
  });
  // cpp-httplib 0.11 bounds only a Content-Length body by the payload limit, and only after
  // reading (and discarding) all of it: a chunked body, or one without a length (read to the
  // end of the connection), would be read whole into memory. Both are refused before their body
  // is read: 411 without a Content-Length, 413 with one past the limit. The client is told to
  // close the connection (what is left of the body would be read as the next request).
  http.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
    const bool has_body = req.method == "POST" || req.method == "PUT" || req.method == "PATCH" ||
                          req.method == "DELETE" || req.method == "PRI";
    if (!has_body) return httplib::Server::HandlerResponse::Unhandled;
    if (req.has_header("Content-Length") && !req.has_header("Transfer-Encoding")) {
      const std::string len = req.get_header_value("Content-Length");
      uint64_t n = 0;
      const bool parsed = !len.empty() && len.size() <= 19 &&
                          len.find_first_not_of("0123456789") == std::string::npos;
      if (parsed) n = std::stoull(len);
      if (parsed && n <= options.max_body_bytes) return httplib::Server::HandlerResponse::Unhandled;
      send_error(
          res,
          parsed ? api_error(413,
                             absl::StrCat("the request body is too large: ", len,
                                          " bytes, the limit is ", options.max_body_bytes),
                             "invalid_request_error", "payload_too_large")
                 : api_error(400, absl::StrCat("invalid Content-Length '", len.substr(0, 40), "'"),
                             "invalid_request_error"));
    } else {
      send_error(res, api_error(411,
                                "send the request body with a Content-Length (chunked transfer "
                                "encoding is not accepted)",
                                "invalid_request_error", "length_required"));
    }
    res.set_header("Connection", "close");
    discard_pending_input(find_connection(bound_port, req.remote_addr, req.remote_port));
    return httplib::Server::HandlerResponse::Handled;
  });
  // The read guard learns which connections have a handler running: from the handler's start
  // (the request's headers and body are in) to the end of its response (the logger runs once
  // the response is written, or failed to be).
  const auto busy = [this](httplib::Server::Handler h) {
    return [this, h = std::move(h)](const httplib::Request& req, httplib::Response& res) {
      mark_busy(req, true);
      h(req, res);
    };
  };
  http.set_logger(
      [this](const httplib::Request& req, const httplib::Response&) { mark_busy(req, false); });
  http.set_keep_alive_max_count(1000);
  http.set_keep_alive_timeout(5);
  const size_t threads = static_cast<size_t>(options.max_concurrent_requests) + 8;
  const size_t queued = static_cast<size_t>(options.max_queued_connections);
  http.new_task_queue = [threads, queued] { return new BoundedPool(threads, queued); };
  http.Post("/v1/completions", busy([this](const httplib::Request& req, httplib::Response& res) {
              handle_generate(req, res, false);
            }));
  http.Post("/v1/chat/completions",
            busy([this](const httplib::Request& req, httplib::Response& res) {
              handle_generate(req, res, true);
            }));
  http.Get("/v1/models", busy([this](const httplib::Request& req, httplib::Response& res) {
             if (!authorized(req, res)) return;
             json m = {{"id", options.served_model_name},
                       {"object", "model"},
                       {"created", unix_seconds()},
                       {"owned_by", "simpler"},
                       {"max_model_len", engine->config().max_position_embeddings}};
             res.set_content(
                 base::dump_replacing(json{{"object", "list"}, {"data", json::array({m})}}),
                 "application/json");
           }));
  http.Get("/health", busy([this](const httplib::Request&, httplib::Response& res) {
             const absl::Status h = engine->health();
             if (!h.ok() || shutting_down.load()) {
               send_error(res,
                          api_error(503,
                                    h.ok() ? "the server is shutting down"
                                           : absl::StrCat("the engine is unhealthy: ", h.message()),
                                    "service_unavailable"));
               return;
             }
             res.status = 200;
             res.set_content("", "text/plain");
           }));
  http.Get("/metrics", busy([this](const httplib::Request&, httplib::Response& res) {
             res.set_content(prometheus_text(engine->metrics(), options.served_model_name),
                             "text/plain; version=0.0.4");
           }));
  http.Post("/tokenize", busy([this](const httplib::Request& req, httplib::Response& res) {
              if (!authorized(req, res)) return;
              auto parsed = parse_tokenize(req.body, options.limits);
              if (auto* e = std::get_if<ApiError>(&parsed)) return send_error(res, *e);
              const TokenizeRequest& t = std::get<TokenizeRequest>(parsed);
              std::string text;
              if (t.prompt.has_value()) {
                text = *t.prompt;
              } else {
                if (!chat.ok()) {
                  return send_error(res,
                                    bad_request(absl::StrCat("chat is unavailable for this model: ",
                                                             chat.status().message())));
                }
                auto rendered = chat->render(t.messages, t.chat_options);
                if (!rendered.ok()) {
                  return send_error(
                      res, bad_request(std::string(rendered.status().message()), "messages"));
                }
                text = *rendered;
              }
              auto ids = tokenizer->try_encode(text);
              if (!ids.ok())
                return send_error(res, bad_request(std::string(ids.status().message())));
              json body = {{"tokens", *ids},
                           {"count", ids->size()},
                           {"max_model_len", engine->config().max_position_embeddings}};
              res.set_content(base::dump_replacing(body), "application/json");
            }));
  http.Post("/detokenize", busy([this](const httplib::Request& req, httplib::Response& res) {
              if (!authorized(req, res)) return;
              auto parsed = parse_detokenize(req.body, options.limits);
              if (auto* e = std::get_if<ApiError>(&parsed)) return send_error(res, *e);
              std::vector<int32_t> ids;
              for (int64_t id : std::get<std::vector<int64_t>>(parsed)) {
                if (id >= engine->dims().vocab_size) {
                  return send_error(res, bad_request(absl::StrCat("token id ", id,
                                                                  " is outside the vocabulary [0, ",
                                                                  engine->dims().vocab_size, ")"),
                                                     "tokens"));
                }
                ids.push_back(static_cast<int32_t>(id));
              }
              res.set_content(base::dump_replacing(json{{"prompt", tokenizer->decode(ids)}}),
                              "application/json");
            }));
  // Unknown routes (404) and known routes with another method (405), as error objects.
  http.set_error_handler([](const httplib::Request& req, httplib::Response& res) {
    static const char* kRoutes[] = {
        "/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics",
        "/tokenize",       "/detokenize"};
    if (!res.body.empty()) return;  // a handler's own error object
    bool known = false;
    for (const char* r : kRoutes) known = known || req.path == r;
    if (res.status == 404 && known) res.status = 405;
    if (res.status == 413) {
      send_error(res, api_error(413, "the request body is too large", "invalid_request_error"));
      return;
    }
    if (res.status == 404) {
      send_error(res,
                 api_error(404, absl::StrCat("no route ", req.method, " ", req.path.substr(0, 100)),
                           "invalid_request_error", "not_found"));
    } else if (res.status == 405) {
      send_error(
          res, api_error(405, absl::StrCat("method ", req.method, " is not allowed on ", req.path),
                         "invalid_request_error", "method_not_allowed"));
    } else if (res.body.empty()) {
      send_error(res,
                 api_error(res.status, absl::StrCat("HTTP ", res.status), "invalid_request_error"));
    }
  });
  http.set_exception_handler(
      [](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
        std::string what = "unknown exception";
        try {
          if (ep) std::rethrow_exception(ep);
        } catch (const std::exception& e) {
          what = e.what();
        } catch (...) {
        }
        send_error(res, api_error(500, "internal error: " + what, "server_error"));
      });
}

OpenAiServer::OpenAiServer(llm::LlmEngine* engine, const llm::Tokenizer* tokenizer,
                           absl::StatusOr<llm::ChatTemplate> chat, ServerOptions options)
    : impl_(std::make_unique<Impl>(engine, tokenizer, std::move(chat), std::move(options))) {
  impl_->routes();
}

OpenAiServer::~OpenAiServer() { (void)shutdown(base::Deadline::poll()); }

absl::StatusOr<int> OpenAiServer::bind() {
  Impl& im = *impl_;
  const double t = im.options.request_read_timeout_s;
  if (!std::isfinite(t) || t < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("request_read_timeout_s must be finite and >= 0, got ", t));
  }
  if (im.options.max_concurrent_requests < 1 || im.options.max_queued_connections < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_concurrent_requests must be >= 1 and max_queued_connections >= 0, got ",
        im.options.max_concurrent_requests, " and ", im.options.max_queued_connections));
  }
  if (im.options.port == 0) {
    const int port = im.http.bind_to_any_port(im.options.host);
    if (port <= 0) {
      return absl::UnavailableError(absl::StrCat("cannot bind ", im.options.host, " (any port)"));
    }
    im.bound_port = port;
  } else {
    if (!im.http.bind_to_port(im.options.host, im.options.port)) {
      return absl::UnavailableError(absl::StrCat("cannot bind ", im.options.host, ":",
                                                 im.options.port,
                                                 " (in use, or not an address "
                                                 "of this machine)"));
    }
    im.bound_port = im.options.port;
  }
  if (im.listen_fd >= 0) ::listen(im.listen_fd, SOMAXCONN);
  return im.bound_port;
}

absl::Status OpenAiServer::serve() {
  Impl& im = *impl_;
  // serving before shutting_down is read; shutdown() sets shutting_down before it reads serving
  // (both sequentially consistent): either serve() sees the shutdown and returns, or shutdown()
  // sees serve() and stops the listener once it runs.
  im.serving.store(true);
  std::thread guard;
  if (im.options.request_read_timeout_s > 0) guard = std::thread([&im] { im.guard_loop(); });
  bool ok = true;
  if (!im.shutting_down.load()) ok = im.http.listen_after_bind();
  if (guard.joinable()) {
    {
      base::MutexLock l(im.guard_mu);
      im.guard_stop = true;
    }
    im.guard_cv.notify_all();
    guard.join();
  }
  im.serving.store(false);
  if (!ok && !im.shutting_down.load()) {
    return absl::InternalError("the HTTP listener stopped unexpectedly");
  }
  return absl::OkStatus();
}

absl::Status OpenAiServer::shutdown(base::Deadline drain) {
  Impl& im = *impl_;
  std::call_once(im.shutdown_once, [&] {
    im.shutting_down.store(true);
    // Running requests finish until the deadline, then are aborted: their providers see the
    // final events and end their streams with [DONE]; then the listener stops.
    im.shutdown_status = im.engine->shutdown(drain);
    // Every request has its final event now; wait (bounded) for the responses to write them
    // and [DONE] before the listener stops and cuts what is still open.
    const int64_t t0 = base::now_ns();
    while (im.open_responses.load() > 0 && base::now_ns() - t0 < 5'000'000'000) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    // Stop the listener (once it runs: serve() may be about to start it), then cut the
    // connections still open: a client trickling its headers or idling on keep-alive would
    // otherwise hold a pool thread, and serve() waits for every one.
    bool stopped = false;
    const int64_t t1 = base::now_ns();
    while (im.serving.load() && base::now_ns() - t1 < 10'000'000'000) {
      if (!stopped && im.http.is_running()) {
        im.http.stop();
        stopped = true;
      }
      if (stopped && im.bound_port > 0) {
        for_each_connection(im.bound_port, [](int fd) {
          // The raw system call: the fd is the worker's, which closes it when the connection
          // ends (an fd reused meanwhile with this local port is another connection to cut).
          ::syscall(SYS_shutdown, fd, SHUT_RDWR);
          return true;
        });
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    if (!stopped && im.http.is_running()) im.http.stop();
  });
  return im.shutdown_status;
}

}  // namespace simpler::serve
