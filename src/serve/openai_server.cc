#include "simpler/serve/openai_server.h"

#include <chrono>
#include <mutex>
#include <thread>

#include "absl/strings/str_cat.h"
#include "serve/routes.h"
#include "serve/server_context.h"
#include "serve/transport.h"

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

absl::StatusOr<int> OpenAiServer::bind() { return impl_->transport.bind(); }

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

std::string base_url(const std::string& host, int port) {
  const bool bracket = host.find(':') != std::string::npos && host.front() != '[';
  return absl::StrCat("http://", bracket ? "[" : "", host, bracket ? "]" : "", ":", port, "/v1");
}

}  // namespace simpler::serve
