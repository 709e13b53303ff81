#include "simpler/serve/openai_server.h"

#include <arpa/inet.h>
#include <netinet/in.h>

#include <chrono>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "serve/routes.h"
#include "serve/server_context.h"
#include "serve/transport.h"
#include "simpler/base/log.h"
#include "spdlog/sinks/stdout_color_sinks.h"

namespace simpler::serve {

// The server's parts: the HTTP server, its connection handling (transport.h) and what the
// route handlers share (server_context.h). Lives as long as the OpenAiServer.
// The HTTP server is destroyed first: its handlers refer to the transport and the context.
struct OpenAiServer::Impl {
  ServerContext ctx;
  Transport transport;
  httplib::Server http;
  std::once_flag shutdown_once;
  absl::Status shutdown_status;

  Impl(llm::LlmEngine* e, const llm::Tokenizer* t, absl::StatusOr<llm::ChatTemplate> c,
       ServerOptions o)
      : ctx(e, t, std::move(c), std::move(o), &transport), transport(&http, &ctx.options) {}
};

OpenAiServer::OpenAiServer(llm::LlmEngine* engine, const llm::Tokenizer* tokenizer,
                           absl::StatusOr<llm::ChatTemplate> chat, ServerOptions options)
    : impl_(std::make_unique<Impl>(engine, tokenizer, std::move(chat), std::move(options))) {
  impl_->transport.install();
  install_routes(impl_->http, impl_->ctx, impl_->transport);
}

OpenAiServer::~OpenAiServer() { (void)shutdown(base::Deadline::poll()); }

absl::StatusOr<int> OpenAiServer::bind() {
  absl::StatusOr<int> port = impl_->transport.bind();
  if (!port.ok()) return port;
  if (std::optional<std::string> w = exposure_warning(impl_->ctx.options, *port)) {
    SIMPLER_LOG_WARN("{}", *w);
  }
  return port;
}

absl::Status OpenAiServer::serve() {
  Impl& im = *impl_;
  if (!im.transport.listen(im.ctx.shutting_down) && !im.ctx.shutting_down.load()) {
    return absl::InternalError("the HTTP listener stopped unexpectedly");
  }
  return absl::OkStatus();
}

absl::Status OpenAiServer::shutdown(base::Deadline drain) {
  Impl& im = *impl_;
  std::call_once(im.shutdown_once, [&] {
    im.ctx.shutting_down.store(true);
    // Running requests finish until the deadline, then are aborted: their providers see the
    // final events and end their streams with [DONE]; then the listener stops.
    im.shutdown_status = im.ctx.engine->shutdown(drain);
    // Every request has its final event now; wait (bounded) for the responses to write them
    // and [DONE] before the listener stops and cuts what is still open.
    const int64_t t0 = base::now_ns();
    while (im.ctx.open_responses.load() > 0 && base::now_ns() - t0 < 5'000'000'000) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    im.transport.stop();
  });
  return im.shutdown_status;
}

bool is_loopback_host(const std::string& host) {
  if (absl::AsciiStrToLower(host) == "localhost") return true;
  std::string h = host;
  if (h.size() >= 2 && h.front() == '[' && h.back() == ']') h = h.substr(1, h.size() - 2);
  in_addr v4{};
  if (::inet_pton(AF_INET, h.c_str(), &v4) == 1) return (ntohl(v4.s_addr) >> 24) == 127;
  in6_addr v6{};
  if (::inet_pton(AF_INET6, h.c_str(), &v6) != 1) return false;
  if (IN6_IS_ADDR_LOOPBACK(&v6)) return true;
  return IN6_IS_ADDR_V4MAPPED(&v6) && v6.s6_addr[12] == 127;
}

std::shared_ptr<spdlog::logger> stderr_access_log() {
  static std::shared_ptr<spdlog::logger> instance = [] {
    auto l = spdlog::stderr_color_mt("simpler.access");
    l->set_level(spdlog::level::info);
    l->set_pattern("[%H:%M:%S.%e] [%^%l%$] %v");
    return l;
  }();
  return instance;
}

std::string base_url(const std::string& host, int port) {
  const bool bracket = host.find(':') != std::string::npos && host.front() != '[';
  return absl::StrCat("http://", bracket ? "[" : "", host, bracket ? "]" : "", ":", port, "/v1");
}

}  // namespace simpler::serve
