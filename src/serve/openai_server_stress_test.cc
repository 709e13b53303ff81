// OpenAiServer under attack, on a loopback port with the tiny preset: slowloris clients,
// unfinished bodies, idle keep-alive connections beyond the pool, clients leaving while queued
// or mid-stream, unread streams, shutdown under load, malformed HTTP, API-key edge cases and
// big /tokenize and /detokenize inputs. Raw POSIX sockets for what cpp-httplib's client will
// not send.
#include <arpa/inet.h>
#include <httplib.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <future>
#include <limits>
#include <map>
#include <thread>

#include "absl/strings/str_cat.h"
#include "base/sanitizers.h"
#include "base/test_wait.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "serve/server_test_fixture.h"
#include "simpler/model/make_model.h"
#include "simpler/serve/openai_server.h"

namespace simpler::serve {
namespace {

using json = nlohmann::json;
using std::chrono::milliseconds;

double seconds_since(int64_t t0) { return (base::now_ns() - t0) / 1e9; }

// A raw loopback connection.
int connect_raw(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

bool send_all(int fd, const std::string& s) {
  size_t at = 0;
  while (at < s.size()) {
    const ssize_t n = ::send(fd, s.data() + at, s.size() - at, MSG_NOSIGNAL);
    if (n <= 0) return false;
    at += static_cast<size_t>(n);
  }
  return true;
}

// Reads until the peer closes, `stop_at` appears, or `timeout_ms` passes. `closed` tells which.
std::string read_raw(int fd, int timeout_ms, bool* closed = nullptr,
                     const std::string& stop_at = {}) {
  std::string out;
  const int64_t t0 = base::now_ns();
  if (closed != nullptr) *closed = false;
  while (true) {
    const int left = timeout_ms - static_cast<int>((base::now_ns() - t0) / 1'000'000);
    if (left <= 0) break;
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, left) <= 0) break;
    char buf[65536];
    const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) {
      if (closed != nullptr) *closed = true;
      break;
    }
    out.append(buf, static_cast<size_t>(n));
    if (!stop_at.empty() && out.find(stop_at) != std::string::npos) break;
  }
  return out;
}

// A slowloris client: sends `head`, then 'a's, a byte every `period_ms`, until `stop` or the
// server closes the connection. Returns whether the server closed it.
bool trickle_headers(int port, const std::string& head, int period_ms,
                     const std::atomic<bool>& stop, std::atomic<int>* sent = nullptr) {
  const int fd = connect_raw(port);
  EXPECT_GE(fd, 0);
  if (fd < 0) return false;
  bool closed = false;
  for (size_t k = 0; !stop.load() && !closed; ++k) {
    if (!send_all(fd, std::string(1, k < head.size() ? head[k] : 'a'))) {
      closed = true;
      break;
    }
    if (sent != nullptr) ++*sent;
    // A closed connection shows as end of stream (or a reset) on the next read.
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, period_ms) > 0) {
      char c;
      if (::recv(fd, &c, 1, MSG_DONTWAIT) <= 0) closed = true;
    }
  }
  ::close(fd);
  return closed;
}

// A connection whose request body never finishes (10 of its 100 bytes sent).
int unfinished_body(int port) {
  const int fd = connect_raw(port);
  EXPECT_TRUE(send_all(fd,
                       "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n"
                       "{\"prompt\":"));
  return fd;
}

const char kSlowCompletion[] = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ";

int status_of(const std::string& raw) {
  if (raw.rfind("HTTP/1.1 ", 0) != 0 || raw.size() < 12) return -1;
  return std::atoi(raw.substr(9, 3).c_str());
}

std::string raw_post(const std::string& path, const std::string& body,
                     const std::string& extra_headers = {}) {
  return "POST " + path + " HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" +
         extra_headers + "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
}

class StressTest : public ServerFixture {
 protected:
  static void SetUpTestSuite() { make_checkpoint("simpler_serve_stress_test"); }
  static bool ends_with_done(const std::string& raw) {
    return raw.size() >= 14 && raw.compare(raw.size() - 14, 14, "data: [DONE]\n\n") == 0;
  }
  // Waits (up to `s` seconds) for the engine to be idle with every page free.
  llm::EngineMetrics wait_idle(double s = 10) {
    llm::EngineMetrics m;
    (void)simpler::testing::eventually(
        [&] {
          m = engine_->metrics();
          return m.requests_running == 0 && m.requests_waiting == 0 &&
                 m.kv_pages.free == m.kv_pages_total;
        },
        milliseconds(static_cast<int64_t>(s * 1000)));
    return m;
  }
  bool serve_returned_within(double s) {
    return served_.wait_for(std::chrono::milliseconds(static_cast<int64_t>(s * 1000))) ==
           std::future_status::ready;
  }
  static std::string long_stream_body(const std::string& prompt, int max_tokens) {
    return json{
        {"prompt", prompt}, {"max_tokens", max_tokens}, {"ignore_eos", true}, {"stream", true}}
        .dump();
  }
};

// Slowloris clients (headers a byte at a time) and bodies that never finish hold a thread
// each; fewer of them than the pool must not delay anybody, and an unfinished body is dropped
// after the read timeout instead of holding its thread for ever.
TEST_F(StressTest, SlowlorisAndUnfinishedBodiesDoNotStarveOthers) {
  ServerOptions so;
  so.max_concurrent_requests = 2;  // 10 threads
  start(so);
  std::atomic<bool> stop{false};
  std::atomic<int> sent[4] = {0, 0, 0, 0};  // bytes each trickling client sent
  std::vector<std::thread> trickle;
  for (int i = 0; i < 4; ++i) {
    trickle.emplace_back(
        [&, i] { (void)trickle_headers(port_, kSlowCompletion, 300, stop, &sent[i]); });
  }
  std::vector<int> unfinished;
  for (int i = 0; i < 4; ++i) unfinished.push_back(unfinished_body(port_));
  // Every slow client is trickling (its second byte went out: it has held its connection for a
  // pacing period).
  ASSERT_TRUE(simpler::testing::eventually([&] {
    for (const auto& n : sent) {
      if (n.load() < 2) return false;
    }
    return true;
  }));
  // A starved request would wait for the read timeout (30 s) to free a thread; 10 s tells that
  // apart from a slow machine (3.3 s once under ThreadSanitizer with two builds beside it).
  for (int i = 0; i < 3; ++i) {
    const int64_t t0 = base::now_ns();
    auto r = post("/v1/completions", R"({"prompt":"hello","max_tokens":4})");
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 200) << r->body;
    EXPECT_LT(seconds_since(t0), 10.0);
  }
  // The unfinished bodies are dropped (answered or closed) within the read timeout.
  for (int fd : unfinished) {
    bool closed = false;
    const std::string raw = read_raw(fd, 8000, &closed);
    EXPECT_TRUE(closed || status_of(raw) >= 400) << raw;
    ::close(fd);
  }
  stop = true;
  for (auto& t : trickle) t.join();
  EXPECT_EQ(engine_->metrics().requests_waiting, 0);
}

// The read guard: connections that trickle their headers, leave their body unfinished or send
// nothing are closed once request_read_timeout_s passes without a complete request, while a
// stream that runs far longer than the timeout is untouched and keep-alive requests go on.
TEST_F(StressTest, ConnectionsWithoutACompleteRequestAreClosedAfterTheReadTimeout) {
  ServerOptions so;
  so.request_read_timeout_s = 0.6;
  start(so);
  std::atomic<bool> stop{false};
  std::atomic<int> cut{0};
  std::vector<std::thread> trickle;
  for (int i = 0; i < 3; ++i) {
    trickle.emplace_back([&] {
      if (trickle_headers(port_, kSlowCompletion, 100, stop)) ++cut;
    });
  }
  std::vector<int> quiet;  // two unfinished bodies and one connection that sends nothing
  for (int i = 0; i < 2; ++i) quiet.push_back(unfinished_body(port_));
  quiet.push_back(connect_raw(port_));
  // A stream read for 3 timeouts (and more), then left by the client.
  std::atomic<bool> left_by_us{false};
  int chunks = 0;
  std::thread streamer([&] {
    auto c = client();
    httplib::Request req = json_post("/v1/completions", long_stream_body("long", 1000));
    const int64_t t0 = base::now_ns();
    req.content_receiver = [&](const char*, size_t, uint64_t, uint64_t) {
      // Read on past 3 timeouts and at least two chunks (the first can come late on a starved
      // machine): the server must not have cut the stream by then.
      if (++chunks < 2 || seconds_since(t0) < 3 * so.request_read_timeout_s + 0.5) return true;
      left_by_us = true;
      return false;
    };
    (void)c.send(req);
  });
  // Keep-alive requests spaced below the timeout keep working on one connection.
  auto keep = client();
  keep.set_keep_alive(true);
  for (int i = 0; i < 5; ++i) {
    auto r = keep.Get("/health");
    ASSERT_TRUE(r) << i;
    EXPECT_EQ(r->status, 200);
    // The spacing is what is under test: real time below the read timeout between requests.
    std::this_thread::sleep_for(milliseconds(200));
  }
  for (int fd : quiet) {
    bool closed = false;
    const std::string raw = read_raw(fd, 20000, &closed);
    EXPECT_TRUE(closed) << "a connection without a complete request stayed open: " << raw;
    ::close(fd);
  }
  EXPECT_TRUE(simpler::testing::eventually([&] { return cut.load() >= 3; }, milliseconds(20000)));
  EXPECT_EQ(cut.load(), 3) << "trickling clients were not cut";
  stop = true;
  for (auto& t : trickle) t.join();
  streamer.join();
  EXPECT_TRUE(left_by_us.load()) << "the long stream was cut after " << chunks << " chunks";
  EXPECT_GT(chunks, 1);
  EXPECT_EQ(wait_idle().requests_running, 0);
}

// Options out of range are refused by bind(), naming them.
TEST_F(StressTest, BindRefusesOptionsOutOfRange) {
  llm::EngineOptions eo;
  eo.runner.worker.num_cores = 1;
  eo.runner.num_pages = 64;
  eo.tokenizer = tokenizer_;
  engine_ = llm::LlmEngine::create(*dir_, eo).value();
  for (double t : {std::nan(""), -1.0, std::numeric_limits<double>::infinity()}) {
    ServerOptions so;
    so.port = 0;
    so.request_read_timeout_s = t;
    OpenAiServer server(engine_.get(), tokenizer_, llm::ChatTemplate::load(*dir_), so);
    auto port = server.bind();
    ASSERT_FALSE(port.ok()) << t;
    EXPECT_EQ(port.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(port.status().message().find("request_read_timeout_s"), std::string::npos);
  }
  ServerOptions so;
  so.port = 0;
  so.max_concurrent_requests = 0;
  OpenAiServer server(engine_.get(), tokenizer_, llm::ChatTemplate::load(*dir_), so);
  auto port = server.bind();
  ASSERT_FALSE(port.ok());
  EXPECT_NE(port.status().message().find("max_concurrent_requests"), std::string::npos);
}

// A client that keeps trickling header bytes must not keep the server from stopping: serve()
// returns within a bounded time after shutdown().
TEST_F(StressTest, ShutdownIsBoundedWithASlowlorisConnected) {
  start();
  std::atomic<bool> stop{false};
  std::atomic<int> sent{0};
  std::thread trickle([&] {
    (void)trickle_headers(port_, "GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ", 200, stop, &sent);
  });
  ASSERT_TRUE(simpler::testing::eventually([&] { return sent.load() >= 3; }));  // it trickles
  const int64_t t0 = base::now_ns();
  EXPECT_TRUE(server_->shutdown(base::Deadline::after(milliseconds(100))).ok());
  EXPECT_TRUE(serve_returned_within(8.0)) << "serve() still running after shutdown()";
  EXPECT_LT(seconds_since(t0), 9.0);
  stop = true;
  trickle.join();
}

// Idle connections beyond the pool and its queue: the next one is answered 503 at once (not
// left waiting), and when the idle ones go, requests are served again.
TEST_F(StressTest, IdleConnectionsBeyondThePoolAreRefusedQuickly) {
  ServerOptions so;
  so.max_concurrent_requests = 1;  // 9 threads
  so.max_queued_connections = 2;
  start(so);
  std::vector<int> idle;
  for (int i = 0; i < 9 + 2; ++i) {
    idle.push_back(connect_raw(port_));
    ASSERT_GE(idle.back(), 0);
  }
  const int64_t t0 = base::now_ns();
  auto r = post("/v1/completions", R"({"prompt":"x","max_tokens":2})");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 503) << r->body;
  EXPECT_LT(seconds_since(t0), 5.0);  // at once, not after the 30 s read timeout; a slow machine
  for (int fd : idle) ::close(fd);
  int status = -1;
  EXPECT_TRUE(simpler::testing::eventually(
      [&] {
        auto ok = post("/v1/completions", R"({"prompt":"x","max_tokens":2})");
        status = ok ? ok->status : -1;
        return status == 200;
      },
      milliseconds(8000)));
  EXPECT_EQ(status, 200);
}

// Clients that send a request and leave while it waits in the engine's queue (before its first
// event): the request is aborted promptly instead of waiting its turn, running to its first
// token and holding an HTTP thread all that time.
TEST_F(StressTest, AClientLeavingWhileQueuedAbortsItsRequest) {
  start({}, 256, /*seqs=*/1);
  std::atomic<bool> leave{false};
  std::string long_raw;
  std::thread runner([&] {
    auto c = client();
    httplib::Request req = json_post("/v1/completions", long_stream_body("occupy", 3000));
    req.content_receiver = [&](const char* d, size_t n, uint64_t, uint64_t) {
      long_raw.append(d, n);
      return !leave.load();
    };
    c.send(req);
  });
  EXPECT_TRUE(
      simpler::testing::eventually([&] { return engine_->metrics().requests_running >= 1; }));
  constexpr int kQueued = 4;
  std::vector<int> fds;
  for (int i = 0; i < kQueued; ++i) {
    fds.push_back(connect_raw(port_));
    ASSERT_TRUE(send_all(
        fds.back(), raw_post("/v1/completions", i % 2 == 0 ? R"({"prompt":"q","max_tokens":50})"
                                                           : long_stream_body("q", 50))));
  }
  EXPECT_TRUE(simpler::testing::eventually(
      [&] { return engine_->metrics().requests_waiting >= kQueued; }, milliseconds(5000)));
  ASSERT_EQ(engine_->metrics().requests_waiting, kQueued);
  for (int fd : fds) ::close(fd);
  EXPECT_TRUE(simpler::testing::eventually([&] { return engine_->metrics().requests_waiting == 0; },
                                           milliseconds(3000)));
  EXPECT_EQ(engine_->metrics().requests_waiting, 0)
      << "requests of clients that left still wait in the engine";
  EXPECT_EQ(engine_->metrics().requests_finished_abort, kQueued);
  EXPECT_EQ(engine_->metrics().requests_running, 1);  // the long one goes on
  leave = true;
  runner.join();
  const llm::EngineMetrics m = wait_idle();
  EXPECT_EQ(m.requests_running, 0);
  EXPECT_EQ(m.kv_pages.free, m.kv_pages_total);
}

// A storm of clients leaving mid-stream at random points next to streams that complete: the
// complete ones are intact, the others are aborted, nothing leaks.
TEST_F(StressTest, DisconnectStormLeavesOtherStreamsIntactAndNothingRunning) {
  start({}, 256, 8, 256);
  constexpr int kClients = 30;
  std::vector<std::thread> threads;
  std::atomic<int> completed{0}, left{0};  // left: choices of the clients that leave
  for (int i = 0; i < kClients; ++i) {
    threads.emplace_back([&, i] {
      const bool leaves = i % 3 != 0;
      int status = 0;
      const std::string raw =
          stream("/v1/chat/completions",
                 json{{"messages", {{{"role", "user"}, {"content", "hi " + std::to_string(i)}}}},
                      {"max_tokens", leaves ? 1000 : 12},
                      {"ignore_eos", true},
                      {"n", 1 + i % 2},
                      {"stream", true}}
                     .dump(),
                 &status, leaves ? 1 + i % 4 : 0);
      if (leaves) {
        left += 1 + i % 2;  // finished_abort counts choices
        return;
      }
      EXPECT_EQ(status, 200);
      const auto evs = events(raw);
      ASSERT_FALSE(evs.empty());
      EXPECT_EQ(evs.back(), "[DONE]");
      int finals = 0;
      for (size_t k = 0; k + 1 < evs.size(); ++k) {
        const json c = json::parse(evs[k], nullptr, false);
        ASSERT_FALSE(c.is_discarded()) << evs[k];
        if (!c["choices"][0]["finish_reason"].is_null()) {
          ++finals;
          EXPECT_EQ(c["choices"][0]["finish_reason"], "length");
        }
      }
      EXPECT_EQ(finals, 1 + i % 2);
      ++completed;
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(completed.load(), kClients / 3);
  const llm::EngineMetrics m = wait_idle();
  EXPECT_EQ(m.requests_running, 0);
  EXPECT_EQ(m.requests_waiting, 0);
  EXPECT_EQ(m.kv_pages.free, m.kv_pages_total);
  EXPECT_EQ(m.requests_finished_abort, left.load());
}

// n up to max_num_seqs streams every choice to its end; beyond it is a 400, never a 500.
TEST_F(StressTest, LargeNStreamsEveryChoiceOrIsA400) {
  start({}, 256, /*seqs=*/8);
  int status = 0;
  const std::string raw = stream("/v1/completions",
                                 json{{"prompt", "many"},
                                      {"max_tokens", 20},
                                      {"ignore_eos", true},
                                      {"n", 8},
                                      {"stream", true},
                                      {"stream_options", {{"include_usage", true}}}}
                                     .dump(),
                                 &status);
  EXPECT_EQ(status, 200);
  const auto evs = events(raw);
  ASSERT_GE(evs.size(), 2u);
  EXPECT_EQ(evs.back(), "[DONE]");
  std::map<int, int> finals;
  std::map<int, std::string> text;
  for (size_t k = 0; k + 2 < evs.size(); ++k) {
    const json c = json::parse(evs[k]);
    const int idx = c["choices"][0]["index"];
    text[idx] += c["choices"][0]["text"].get<std::string>();
    if (!c["choices"][0]["finish_reason"].is_null()) ++finals[idx];
  }
  EXPECT_EQ(finals.size(), 8u);
  for (const auto& [i, f] : finals) EXPECT_EQ(f, 1) << "choice " << i;
  EXPECT_EQ(json::parse(evs[evs.size() - 2])["usage"]["completion_tokens"], 8 * 20);
  for (int n : {9, 256, 257, 100000}) {
    auto r = post("/v1/completions",
                  json{{"prompt", "many"}, {"max_tokens", 2}, {"n", n}, {"stream", true}}.dump());
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 400) << "n " << n << ": " << r->body;
  }
  EXPECT_EQ(wait_idle().requests_running, 0);
}

// A client that asks for a huge stream and never reads holds only its own request: others
// are served meanwhile; when it closes the connection its request is aborted at once; and
// shutdown with another unread stream connected stays bounded.
TEST_F(StressTest, AnUnreadHugeStreamDoesNotBlockOthersAndEndsWithItsClient) {
  start();
  auto unread_client = [&](int max_tokens, bool stream) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    int small = 2048;
    ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &small, sizeof(small));
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port_));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
    const std::string body =
        stream ? long_stream_body("never read", max_tokens)
               : json{{"prompt", "never read"}, {"max_tokens", max_tokens}, {"ignore_eos", true}}
                     .dump();
    EXPECT_TRUE(send_all(fd, raw_post("/v1/completions", body)));
    return fd;
  };
  // The unread client's request runs and has made `tokens` tokens since this was called.
  auto generating_unread = [&](int64_t tokens) {
    const int64_t before = engine_->metrics().generation_tokens_total;
    return simpler::testing::eventually([&] {
      const llm::EngineMetrics m = engine_->metrics();
      return m.requests_running == 1 && m.generation_tokens_total >= before + tokens;
    });
  };
  for (bool streamed : {true, false}) {
    const int fd = unread_client(4000, streamed);
    ASSERT_TRUE(generating_unread(64));
    const int64_t t0 = base::now_ns();
    auto r = post("/v1/completions", R"({"prompt":"meanwhile","max_tokens":4})");
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 200);
    // Blocked behind the unread stream it would wait until that client goes (never, here);
    // 10 s allows a slow machine (ThreadSanitizer with builds beside it).
    EXPECT_LT(seconds_since(t0), 10.0);
    EXPECT_EQ(engine_->metrics().requests_running, 1);
    ::close(fd);
    const llm::EngineMetrics m = wait_idle(3);
    EXPECT_EQ(m.requests_running, 0) << "the request of a client that left still runs ("
                                     << (streamed ? "streamed" : "not streamed") << ")";
    EXPECT_EQ(m.kv_pages.free, m.kv_pages_total);
  }
  const int fd = unread_client(4000, true);
  ASSERT_TRUE(generating_unread(64));
  const int64_t t1 = base::now_ns();
  EXPECT_TRUE(server_->shutdown(base::Deadline::after(milliseconds(100))).ok());
  EXPECT_TRUE(serve_returned_within(8.0));
  EXPECT_LT(seconds_since(t1), 9.0);
  ::close(fd);
}

// shutdown() from two threads while streams run and new requests keep arriving: bounded, every
// stream that started ends with [DONE], new requests get 503 (or find nobody listening), never
// a 500 or a hang.
TEST_F(StressTest, ConcurrentShutdownUnderLoadIsBoundedAndClean) {
  start();
  constexpr int kStreams = 6;
  std::vector<std::string> raws(kStreams);
  std::vector<int> statuses(kStreams, 0);
  std::atomic<int> started{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < kStreams; ++i) {
    threads.emplace_back([&, i] {
      raws[i] = stream("/v1/completions", long_stream_body("s" + std::to_string(i), 3000),
                       &statuses[i], 0, &started);
    });
  }
  std::atomic<bool> stop{false};
  std::atomic<int> bad{0}, refused{0};
  std::vector<std::string> bad_bodies;
  std::mutex mu;
  std::vector<std::thread> hammers;
  for (int h = 0; h < 3; ++h) {
    hammers.emplace_back([&, h] {
      while (!stop.load()) {
        auto c = client();
        c.set_connection_timeout(1, 0);
        c.set_read_timeout(15, 0);
        auto r = h == 2
                     ? c.Get("/health")
                     : c.Post("/v1/completions",
                              json{{"prompt", "h"}, {"max_tokens", 3}, {"stream", h == 1}}.dump(),
                              "application/json");
        if (!r) continue;
        if (r->status == 503) {
          ++refused;
        } else if (r->status != 200) {
          ++bad;
          std::lock_guard<std::mutex> l(mu);
          bad_bodies.push_back(std::to_string(r->status) + " " + r->body);
        }
      }
    });
  }
  // Every stream has started (a slow build takes a while to admit them) before the shutdown
  // (a request still queued then is refused 503 instead).
  EXPECT_TRUE(simpler::testing::eventually([&] { return started.load() >= kStreams; },
                                           milliseconds(60000)));
  // ... and the streams run: each has made a few tokens.
  const int64_t before = engine_->metrics().generation_tokens_total;
  EXPECT_TRUE(simpler::testing::eventually(
      [&] { return engine_->metrics().generation_tokens_total >= before + 8 * kStreams; }));
  const int64_t t0 = base::now_ns();
  auto a = std::async(std::launch::async,
                      [&] { return server_->shutdown(base::Deadline::after(milliseconds(200))); });
  auto b = std::async(std::launch::async,
                      [&] { return server_->shutdown(base::Deadline::after(milliseconds(200))); });
  EXPECT_EQ(a.wait_for(std::chrono::seconds(12)), std::future_status::ready);
  EXPECT_EQ(b.wait_for(std::chrono::seconds(12)), std::future_status::ready);
  EXPECT_TRUE(a.get().ok());
  EXPECT_TRUE(b.get().ok());
  EXPECT_TRUE(serve_returned_within(8.0));
  EXPECT_LT(seconds_since(t0), 14.0);
  stop = true;
  for (auto& t : hammers) t.join();
  for (auto& t : threads) t.join();
  EXPECT_EQ(bad.load(), 0) << (bad_bodies.empty() ? "" : bad_bodies[0]);
  for (int i = 0; i < kStreams; ++i) {
    EXPECT_EQ(statuses[i], 200);
    EXPECT_TRUE(ends_with_done(raws[i]))
        << raws[i].substr(raws[i].size() > 300 ? raws[i].size() - 300 : 0);
    const auto evs = events(raws[i]);
    if (evs.size() >= 2) {
      EXPECT_EQ(json::parse(evs[evs.size() - 2])["choices"][0]["finish_reason"], "abort");
    }
  }
  // After shutdown: nobody listens; a request fails at once rather than hanging.
  auto c = client();
  c.set_connection_timeout(1, 0);
  EXPECT_FALSE(c.Get("/health"));
}

// Malformed HTTP on raw sockets, next to a good stream: each gets a 4xx (or a close) without
// hanging, the stream is untouched, the server stays healthy.
TEST_F(StressTest, MalformedHttpGets4xxAndDoesNotDisturbOthers) {
  ServerOptions so;
  so.max_body_bytes = 4096;
  start(so);
  int stream_status = 0;
  std::string stream_raw;
  std::thread streamer([&] {
    stream_raw = stream("/v1/completions", long_stream_body("steady", 120), &stream_status);
  });
  const std::string ok_body = R"({"prompt":"x","max_tokens":2})";
  struct Case {
    std::string name, bytes;
    int want;  // exact status; 0: any 4xx or a close
  };
  std::string big_chunked =
      "POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n";
  for (int i = 0; i < 64; ++i) big_chunked += "400\r\n" + std::string(0x400, ' ') + "\r\n";
  big_chunked += "0\r\n\r\n";
  const std::vector<Case> cases = {
      {"garbage request line", "GARBAGE\r\n\r\n", 400},
      {"content-length not a number",
       "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n" + ok_body, 400},
      {"negative content-length",
       "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n" + ok_body, 400},
      {"overflowing content-length",
       "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: "
       "99999999999999999999999\r\n\r\n" +
           ok_body,
       400},
      {"content-length past the limit, body not sent",
       "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000000\r\n\r\n", 413},
      {"chunked body",
       "POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" +
           absl::StrCat(absl::Hex(ok_body.size())) + "\r\n" + ok_body + "\r\n0\r\n\r\n",
       200},
      {"no content-length", "POST /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n" + ok_body, 411},
      {"bad chunk size",
       "POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: "
       "chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
       400},
      {"chunked body past the limit", big_chunked, 413},
      {"chunked and content-length",
       "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
       "Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
       400},
      {"gzip transfer encoding",
       "POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n", 501},
      {"chunked body to no route",
       "POST /v1/nope HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0"
       "\r\n\r\n",
       404},
      {"POST without a body on a GET route", "POST /v1/models HTTP/1.1\r\nHost: x\r\n\r\n", 405},
      {"DELETE without a body on no route", "DELETE /nope HTTP/1.1\r\nHost: x\r\n\r\n", 404},
      {"header without a colon",
       "POST /v1/completions HTTP/1.1\r\nHost: x\r\nNoColonHere\r\nContent-Length: 2\r\n\r\n{}", 0},
      {"HTTP/0.9", "GET /health\r\n\r\n", 0},
      {"huge header",
       "GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + std::string(20000, 'a') + "\r\n\r\n", 0},
  };
  for (const Case& c : cases) {
    const int fd = connect_raw(port_);
    ASSERT_GE(fd, 0);
    send_all(fd, c.bytes);
    bool closed = false;
    const int64_t t0 = base::now_ns();
    const std::string raw = read_raw(fd, 7000, &closed, "\r\n\r\n");
    ::close(fd);
    const int st = status_of(raw);
    if (st > 0) {  // every answer has a request id, even one refused before routing
      EXPECT_NE(raw.find("\r\nX-Request-Id: req-"), std::string::npos) << c.name << ": " << raw;
    }
    if (c.want != 0) {
      EXPECT_EQ(st, c.want) << c.name << ": " << raw.substr(0, 300);
    } else {
      EXPECT_TRUE((st >= 400 && st < 500) || (raw.empty() && closed))
          << c.name << ": " << raw.substr(0, 300);
    }
    EXPECT_LT(seconds_since(t0), 6.5) << c.name;
  }
  streamer.join();
  EXPECT_EQ(stream_status, 200);
  EXPECT_TRUE(ends_with_done(stream_raw));
  auto h = client().Get("/health");
  ASSERT_TRUE(h);
  EXPECT_EQ(h->status, 200);
  EXPECT_EQ(wait_idle().requests_running, 0);
}

TEST_F(StressTest, ApiKeyEdgeCases) {
  ServerOptions so;
  so.api_key = "sekrit";
  start(so);
  auto code = [&](const std::string& method, const std::string& path, const std::string& body,
                  const std::string& headers) {
    const int fd = connect_raw(port_);
    std::string req = method + " " + path + " HTTP/1.1\r\nHost: x\r\n" + headers;
    if (method == "POST") {
      req += "Content-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) +
             "\r\n";
    }
    req += "\r\n" + body;
    send_all(fd, req);
    const std::string raw = read_raw(fd, 5000, nullptr, "\r\n\r\n");
    ::close(fd);
    return status_of(raw);
  };
  const std::string tok = R"({"prompt":"hi"})";
  const std::string detok = R"({"tokens":[1,2]})";
  const std::string comp = R"({"prompt":"x","max_tokens":1})";
  for (const std::string& h :
       {std::string(), std::string("Authorization: Bearer\r\n"),
        std::string("Authorization: Bearer \r\n"), std::string("Authorization: bearer sekrit\r\n"),
        std::string("Authorization: Bearer sekri\r\n"),
        std::string("Authorization: Bearer sekritt\r\n"),
        std::string("Authorization: Basic c2Vrcml0\r\n"),
        std::string("Authorization: Bearer  sekrit\r\n"),
        std::string("Authorization: Bearer wrong\r\nAuthorization: Bearer sekrit\r\n"),
        std::string("Authorization: Bearer sek\0rit\r\n", 31)}) {
    // 401; a NUL in the header may instead be refused as a malformed request (400).
    auto denied = [&](int st) {
      return st == 401 || (h.find('\0') != std::string::npos && st == 400);
    };
    EXPECT_TRUE(denied(code("POST", "/v1/completions", comp, h))) << h;
    EXPECT_TRUE(denied(code("POST", "/v1/chat/completions", "{}", h))) << h;
    EXPECT_TRUE(denied(code("POST", "/tokenize", tok, h))) << h;
    EXPECT_TRUE(denied(code("POST", "/detokenize", detok, h))) << h;
    EXPECT_TRUE(denied(code("GET", "/v1/models", "", h))) << h;
  }
  const std::string good = "Authorization: Bearer sekrit\r\n";
  EXPECT_EQ(code("POST", "/v1/completions", comp, good), 200);
  EXPECT_EQ(code("POST", "/tokenize", tok, good), 200);
  EXPECT_EQ(code("POST", "/detokenize", detok, good), 200);
  EXPECT_EQ(code("GET", "/v1/models", "", good), 200);
  EXPECT_EQ(code("POST", "/v1/completions", comp, "authorization: Bearer sekrit\r\n"), 200);
}

// /tokenize and /detokenize near the body limit: answered in bounded time with the right
// counts; ids out of range are 400s.
TEST_F(StressTest, TokenizeAndDetokenizeBigInputs) {
  start();
  // Bodies just under the 1 MiB limit; a sanitizer's 5x slower tokenizer gets a quarter of that.
  constexpr size_t kBig = SIMPLER_SANITIZED ? 225'000 : 900'000;
  std::string text;
  while (text.size() < kBig) text += "The quick brown fox jumps over the lazy dog. ";
  auto r = post("/tokenize", json{{"prompt", text}}.dump());
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body.substr(0, 300);
  const json j = json::parse(r->body);
  EXPECT_EQ(j["count"], tokenizer_->encode(text).size());
  // One long run without spaces, and lots of special-token text.
  for (const std::string& s : {std::string(kBig, 'a'), std::string(kBig, ' ')}) {
    r = post("/tokenize", json{{"prompt", s}}.dump());
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 200) << r->body.substr(0, 300);
  }
  std::vector<int64_t> ids;
  for (int i = 0; i < 120'000; ++i) ids.push_back(i % 150'000);
  r = post("/detokenize", json{{"tokens", ids}}.dump());
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200) << r->body.substr(0, 300);
  for (const std::string& bad :
       {std::string(R"({"tokens":[-1]})"), std::string(R"({"tokens":[2147483648]})"),
        std::string(R"({"tokens":[1e300]})"), std::string(R"({"tokens":[1.5]})"),
        std::string(R"({"tokens":[99999999999999999999999]})"), std::string(R"({"tokens":"1"})"),
        std::string(R"({"tokens":[151936000]})")}) {
    r = post("/detokenize", bad);
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 400) << bad << ": " << r->body;
  }
  r = post("/v1/completions", R"({"prompt":[-1],"max_tokens":1})");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 400) << r->body;
  r = post("/v1/completions", json{{"prompt", std::string(2'000'000, 'a')}}.dump());
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 413);
}

// shutdown() before serve() started: serve() returns at once instead of listening for ever
// (cpp-httplib's stop() does nothing while its listener is not running yet).
TEST_F(StressTest, ShutdownBeforeServeStartsMakesServeReturnAtOnce) {
  llm::EngineOptions eo;
  eo.runner.worker.num_cores = 1;
  eo.runner.worker.faults.emplace();
  eo.runner.num_pages = 64;
  eo.tokenizer = tokenizer_;
  engine_ = llm::LlmEngine::create(*dir_, eo).value();
  ServerOptions so;
  so.port = 0;
  so.served_model_name = "tiny";
  server_ =
      std::make_unique<OpenAiServer>(engine_.get(), tokenizer_, llm::ChatTemplate::load(*dir_), so);
  ASSERT_TRUE(server_->bind().ok());
  EXPECT_TRUE(server_->shutdown(base::Deadline::poll()).ok());
  served_ = std::async(std::launch::async, [this] { return server_->serve(); });
  EXPECT_TRUE(serve_returned_within(3.0)) << "serve() listens after shutdown()";
}

}  // namespace
}  // namespace simpler::serve
