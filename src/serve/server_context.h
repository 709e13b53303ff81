// What the server's route handlers share (routes.cc, completions.cc): the engine, tokenizer,
// chat template and options; authentication; response ids; the prompt helpers more than one
// endpoint uses.
#pragma once

#include <httplib.h>

#include <atomic>
#include <cstdint>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "serve/http_errors.h"
#include "serve/transport.h"
#include "simpler/engine/llm_engine.h"
#include "simpler/serve/openai_protocol.h"
#include "simpler/serve/openai_server.h"
#include "simpler/tokenizer/chat_template.h"
#include "simpler/tokenizer/tokenizer.h"

namespace simpler::serve {

// The state every handler reads. Owned by OpenAiServer::Impl, which lives as long as the HTTP
// server; borrows the engine and tokenizer. Thread-safe: only the atomics change after
// construction.
struct ServerContext {
  ServerContext(llm::LlmEngine* e, const llm::Tokenizer* t, absl::StatusOr<llm::ChatTemplate> c,
                ServerOptions o, const Transport* tr)
      : engine(e), tokenizer(t), chat(std::move(c)), options(std::move(o)), transport(tr) {}

  llm::LlmEngine* const engine;
  const llm::Tokenizer* const tokenizer;
  const absl::StatusOr<llm::ChatTemplate> chat;
  const ServerOptions options;
  const Transport* const transport;        // the connections (a request's client watch)
  std::atomic<bool> shutting_down{false};  // new requests get 503
  std::atomic<int64_t> open_responses{0};  // content providers not yet released

  // Whether the request carries the API key (always, without one); answers 401 when not.
  bool authorized(const httplib::Request& req, httplib::Response& res) const;
};

// The warning bind() logs for a server that anyone who can reach it may use: a host that is not
// a loopback address (is_loopback_host) and no API key; nullopt otherwise.
std::optional<std::string> exposure_warning(const ServerOptions& options, int port);

// A unique id: `prefix`-<16 random hex digits><4 hex digits of a process-wide counter>.
std::string random_id(const char* prefix);
// A tool call's id: "call_" and the same 20 hex digits (OpenAI's "call_..." shape).
std::string tool_call_id();
int64_t unix_seconds();

// 404 model_not_found when a request names a `model` (non-empty) other than the served one;
// nullopt when it names none or the served one.
std::optional<ApiError> unknown_model(const ServerContext& ctx, const std::string& model);

// The chat template applied to `messages`: 400 when the model has no template or it refuses
// them (param "messages").
std::variant<std::string, ApiError> render_chat(const ServerContext& ctx,
                                                const std::vector<llm::ChatMessage>& messages,
                                                const llm::ChatRenderOptions& options);

// Token ids checked against the vocabulary: 400 "<what> <id> is outside the vocabulary [0, V)"
// naming `param` for the first that is not in it.
std::variant<std::vector<int32_t>, ApiError> vocabulary_ids(const ServerContext& ctx,
                                                            const std::vector<int64_t>& ids,
                                                            const char* what, const char* param);

}  // namespace simpler::serve
