// Shared by the server test binaries: a tiny-preset checkpoint (real Qwen3 tokenizer, hidden
// size 64) made once per suite, and an engine plus an OpenAiServer on a free loopback port per
// test, with cpp-httplib client helpers (plain POST, streamed POST with the raw SSE bytes, SSE
// framing).
#pragma once

#include <httplib.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "simpler/model/make_model.h"
#include "simpler/serve/openai_server.h"

namespace simpler::serve {

class ServerFixture : public ::testing::Test {
 protected:
  // `name` makes the suite's checkpoint directory unique among concurrent test binaries.
  static void make_checkpoint(const std::string& name) {
    dir_ = new std::string(
        (std::filesystem::temp_directory_path() / (name + "_" + std::to_string(::getpid())))
            .string());
    llm::MakeModelOptions o;
    o.preset = "tiny";
    o.seed = 21;
    o.out_dir = *dir_;
    o.tokenizer_dir = llm::default_tokenizer_dir().value();
    // Qwen3's vocabulary (the tokenizer's ids) with half the preset's width: the embeddings and
    // the LM head, 151936 rows, are most of the weights each test's engine uploads and of every
    // step's work (under the sanitizers, most of these suites' time).
    o.overrides.hidden_size = 64;
    o.overrides.head_dim = 32;
    ASSERT_TRUE(llm::make_model(o).ok());
    tokenizer_ = new llm::Tokenizer(llm::Tokenizer::load(*dir_).value());
  }
  static void TearDownTestSuite() {
    if (dir_ != nullptr) std::filesystem::remove_all(*dir_);
    delete tokenizer_;
    delete dir_;
    tokenizer_ = nullptr;
    dir_ = nullptr;
  }

  // Starts an engine (1 sim core, fault injection armed) and a server on a free loopback port;
  // serve() runs on its own thread and its status is `served_`.
  void start(ServerOptions so = {}, int32_t max_waiting = 256, int32_t seqs = 8,
             int32_t pages = 512) {
    llm::EngineOptions eo;
    eo.runner.worker.num_cores = 1;
    eo.runner.worker.faults.emplace();
    eo.runner.max_num_seqs = seqs;
    eo.runner.max_num_batched_tokens = 256;
    eo.runner.num_pages = pages;
    eo.max_waiting = max_waiting;
    eo.tokenizer = tokenizer_;
    engine_ = llm::LlmEngine::create(*dir_, eo).value();
    so.host = "127.0.0.1";
    so.port = 0;
    if (so.served_model_name.empty()) so.served_model_name = "tiny";
    server_ = std::make_unique<OpenAiServer>(engine_.get(), tokenizer_,
                                             llm::ChatTemplate::load(*dir_), so);
    port_ = server_->bind().value();
    served_ = std::async(std::launch::async, [this] { return server_->serve(); });
  }
  void TearDown() override {
    if (server_) (void)server_->shutdown(base::Deadline::poll());
    if (served_.valid()) {
      EXPECT_TRUE(served_.get().ok());
    }
    server_.reset();
    engine_.reset();
  }

  // A client whose reads wait up to 300 s: a queued stream's first bytes can take over a minute
  // on a starved 2-vCPU machine under TSan (30 streams, one sim core), and a hang is the test's
  // ctest TIMEOUT to catch, not a read that gives up and aborts the request.
  httplib::Client client() {
    httplib::Client c("127.0.0.1", port_);
    c.set_read_timeout(300, 0);
    return c;
  }
  httplib::Result post(const std::string& path, const std::string& body,
                       httplib::Headers headers = {}) {
    auto c = client();
    return c.Post(path.c_str(), headers, body, "application/json");
  }
  // The JSON body of a POST to `path` that must answer 200; null, failing the test, otherwise.
  nlohmann::json post_ok(const std::string& path, const std::string& body) {
    auto res = post(path, body);
    if (!res || res->status != 200) {
      ADD_FAILURE() << path << ": "
                    << (res ? std::to_string(res->status) + " " + res->body : "no response");
      return nullptr;
    }
    return nlohmann::json::parse(res->body);
  }
  // A POST of a JSON body, to send with a content receiver.
  static httplib::Request json_post(const std::string& path, std::string body) {
    httplib::Request req;
    req.method = "POST";
    req.path = path;
    req.body = std::move(body);
    req.set_header("Content-Type", "application/json");
    return req;
  }
  // A streamed POST: the raw SSE bytes. `leave_after` > 0: close after that many chunks.
  // `started`, when given, counts streams that received their first bytes.
  std::string stream(const std::string& path, const std::string& body, int* status = nullptr,
                     int leave_after = 0, std::atomic<int>* started = nullptr) {
    auto c = client();
    httplib::Request req = json_post(path, body);
    std::string raw;
    int chunks = 0;
    req.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
      if (raw.empty() && started != nullptr) started->fetch_add(1);
      raw.append(data, n);
      return !(leave_after > 0 && ++chunks >= leave_after);
    };
    auto res = c.send(req);
    if (status != nullptr) *status = res ? res->status : -1;
    return raw;
  }
  // The `data:` payloads of an SSE body; checks the framing on the way.
  static std::vector<std::string> events(const std::string& raw) {
    std::vector<std::string> out;
    size_t at = 0;
    while (at < raw.size()) {
      const size_t end = raw.find("\n\n", at);
      EXPECT_NE(end, std::string::npos) << "an event without its blank line: " << raw.substr(at);
      if (end == std::string::npos) break;
      const std::string ev = raw.substr(at, end - at);
      EXPECT_EQ(ev.rfind("data: ", 0), 0u) << ev;
      out.push_back(ev.substr(6));
      at = end + 2;
    }
    return out;
  }

  static inline std::string* dir_ = nullptr;
  static inline llm::Tokenizer* tokenizer_ = nullptr;
  std::unique_ptr<llm::LlmEngine> engine_;
  std::unique_ptr<OpenAiServer> server_;
  std::future<absl::Status> served_;
  int port_ = 0;
};

}  // namespace simpler::serve
