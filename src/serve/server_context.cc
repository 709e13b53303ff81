#include "serve/server_context.h"

#include <openssl/crypto.h>

#include <chrono>
#include <random>

#include "absl/strings/str_cat.h"

namespace simpler::serve {

bool ServerContext::authorized(const httplib::Request& req, httplib::Response& res) const {
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

namespace {

// 16 random hex digits and 4 of a process-wide counter.
std::string unique_hex() {
  static std::atomic<uint64_t> counter{0};
  thread_local std::mt19937_64 rng(std::random_device{}());
  return absl::StrCat(absl::Hex(rng(), absl::kZeroPad16),
                      absl::Hex(counter.fetch_add(1), absl::kZeroPad4));
}

}  // namespace

std::optional<std::string> exposure_warning(const ServerOptions& options, int port) {
  if (!options.api_key.empty() || is_loopback_host(options.host)) return std::nullopt;
  return absl::StrCat("serving on ", base_url(options.host, port),
                      " without an API key: anyone who can reach it can use the model (set "
                      "--api-key or SIMPLER_API_KEY)");
}

std::string random_id(const char* prefix) { return absl::StrCat(prefix, "-", unique_hex()); }

std::string tool_call_id() { return "call_" + unique_hex(); }

int64_t unix_seconds() {
  return std::chrono::duration_cast<std::chrono::seconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

std::optional<ApiError> unknown_model(const ServerContext& ctx, const std::string& model) {
  if (model.empty() || model == ctx.options.served_model_name) return std::nullopt;
  return api_error(
      404,
      absl::StrCat("the model '", model.substr(0, 100), "' does not exist; this server serves '",
                   ctx.options.served_model_name, "'"),
      "invalid_request_error", "model_not_found");
}

std::variant<std::string, ApiError> render_chat(const ServerContext& ctx,
                                                const std::vector<llm::ChatMessage>& messages,
                                                const llm::ChatRenderOptions& options) {
  if (!ctx.chat.ok()) {
    return bad_request(absl::StrCat("chat is unavailable for this model (completions still work): ",
                                    ctx.chat.status().message()));
  }
  absl::StatusOr<std::string> rendered = ctx.chat->render(messages, options);
  if (!rendered.ok()) return bad_request(std::string(rendered.status().message()), "messages");
  return *std::move(rendered);
}

std::variant<std::vector<int32_t>, ApiError> vocabulary_ids(const ServerContext& ctx,
                                                            const std::vector<int64_t>& ids,
                                                            const char* what, const char* param) {
  const int64_t vocab = ctx.engine->dims().vocab_size;
  std::vector<int32_t> out;
  out.reserve(ids.size());
  for (int64_t id : ids) {
    if (id >= vocab) {
      return bad_request(absl::StrCat(what, " ", id, " is outside the vocabulary [0, ", vocab, ")"),
                         param);
    }
    out.push_back(static_cast<int32_t>(id));
  }
  return out;
}

}  // namespace simpler::serve
