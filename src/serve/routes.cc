#include "serve/routes.h"

#include <exception>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "serve/access_log.h"
#include "serve/completions.h"
#include "serve/cors.h"
#include "serve/http_errors.h"
#include "simpler/base/clock.h"
#include "simpler/base/json.h"

namespace simpler::serve {

using json = nlohmann::json;

namespace {

void set_json(httplib::Response& res, const json& body) {
  res.set_content(base::dump_replacing(body), "application/json");
}

void handle_completions(ServerContext& ctx, const httplib::Request& req, httplib::Response& res) {
  handle_generate(ctx, req, res, /*chat_endpoint=*/false);
}

void handle_chat_completions(ServerContext& ctx, const httplib::Request& req,
                             httplib::Response& res) {
  handle_generate(ctx, req, res, /*chat_endpoint=*/true);
}

// The served model's object (an entry of /v1/models).
json model_object(const ServerContext& ctx) {
  json model = {{"id", ctx.options.served_model_name},
                {"object", "model"},
                {"created", unix_seconds()},
                {"owned_by", "simpler"},
                {"max_model_len", ctx.engine->config().max_position_embeddings}};
  if (!ctx.options.weight_types.empty()) model["weight_types"] = ctx.options.weight_types;
  return model;
}

void handle_models(ServerContext& ctx, const httplib::Request& req, httplib::Response& res) {
  if (!ctx.authorized(req, res)) return;
  set_json(res, json{{"object", "list"}, {"data", json::array({model_object(ctx)})}});
}

// GET /v1/models/{id}: the id is the rest of the path (it may hold slashes).
void handle_model(ServerContext& ctx, const httplib::Request& req, httplib::Response& res) {
  if (!ctx.authorized(req, res)) return;
  const std::string id = req.matches.size() > 1 ? std::string(req.matches[1]) : std::string();
  if (id != ctx.options.served_model_name) {  // the pattern makes it non-empty
    return send_error(res, unknown_model(ctx, id).value());
  }
  set_json(res, model_object(ctx));
}

void handle_health(ServerContext& ctx, const httplib::Request&, httplib::Response& res) {
  const absl::Status h = ctx.engine->health();
  if (!h.ok() || ctx.shutting_down.load()) {
    send_error(res, api_error(503,
                              h.ok() ? "the server is shutting down"
                                     : absl::StrCat("the engine is unhealthy: ", h.message()),
                              "service_unavailable"));
    return;
  }
  res.status = 200;
  res.set_content("", "text/plain");
}

void handle_metrics(ServerContext& ctx, const httplib::Request&, httplib::Response& res) {
  res.set_content(prometheus_text(ctx.engine->metrics(), ctx.options.served_model_name),
                  "text/plain; version=0.0.4");
}

// POST /reset_prefix_cache (vLLM's): drops the engine's prefix cache; 200 with an empty body.
void handle_reset_prefix_cache(ServerContext& ctx, const httplib::Request& req,
                               httplib::Response& res) {
  if (!ctx.authorized(req, res)) return;
  if (absl::Status s = ctx.engine->reset_prefix_cache(); !s.ok()) {
    return send_error(res, api_error(503, std::string(s.message()), "service_unavailable"));
  }
  res.status = 200;
  res.set_content("", "text/plain");
}

void handle_tokenize(ServerContext& ctx, const httplib::Request& req, httplib::Response& res) {
  if (!ctx.authorized(req, res)) return;
  auto parsed = parse_tokenize(req.body, ctx.options.limits);
  if (auto* e = std::get_if<ApiError>(&parsed)) return send_error(res, *e);
  const TokenizeRequest& t = std::get<TokenizeRequest>(parsed);
  if (std::optional<ApiError> e = unknown_model(ctx, t.model)) return send_error(res, *e);
  std::string text;
  if (t.prompt.has_value()) {
    text = *t.prompt;
  } else {
    auto rendered = render_chat(ctx, t.messages, t.chat_options);
    if (auto* e = std::get_if<ApiError>(&rendered)) return send_error(res, *e);
    text = std::get<std::string>(std::move(rendered));
  }
  auto ids = ctx.tokenizer->try_encode(text);
  if (!ids.ok()) return send_error(res, bad_request(std::string(ids.status().message())));
  set_json(res, {{"tokens", *ids},
                 {"count", ids->size()},
                 {"max_model_len", ctx.engine->config().max_position_embeddings}});
}

void handle_detokenize(ServerContext& ctx, const httplib::Request& req, httplib::Response& res) {
  if (!ctx.authorized(req, res)) return;
  auto parsed = parse_detokenize(req.body, ctx.options.limits);
  if (auto* e = std::get_if<ApiError>(&parsed)) return send_error(res, *e);
  const DetokenizeRequest& d = std::get<DetokenizeRequest>(parsed);
  if (std::optional<ApiError> e = unknown_model(ctx, d.model)) return send_error(res, *e);
  auto ids = vocabulary_ids(ctx, d.tokens, "token id", "tokens");
  if (auto* e = std::get_if<ApiError>(&ids)) return send_error(res, *e);
  set_json(res, json{{"prompt", ctx.tokenizer->decode(std::get<std::vector<int32_t>>(ids))}});
}

using RouteHandler = void (*)(ServerContext&, const httplib::Request&, httplib::Response&);

struct Route {
  const char* method;  // "GET" or "POST"
  const char* path;    // with `prefix`, what the path starts with (a non-empty rest follows)
  RouteHandler handler;
  bool prefix = false;
};

bool path_matches(const Route& r, const std::string& path) {
  if (!r.prefix) return path == r.path;
  const std::string_view p(r.path);
  return path.size() > p.size() && std::string_view(path).substr(0, p.size()) == p;
}

constexpr Route kRoutes[] = {
    {"POST", "/v1/completions", handle_completions},
    {"POST", "/v1/chat/completions", handle_chat_completions},
    {"GET", "/v1/models", handle_models},
    {"GET", "/v1/models/", handle_model, /*prefix=*/true},
    {"GET", "/health", handle_health},
    {"GET", "/metrics", handle_metrics},
    {"POST", "/tokenize", handle_tokenize},
    {"POST", "/detokenize", handle_detokenize},
    {"POST", "/reset_prefix_cache", handle_reset_prefix_cache},
};

// Unknown routes (404) and known routes with another method (405), as error objects; a status
// cpp-httplib set itself (413 for a body past the payload limit, ...) gets one too. A handler's
// own error object is left alone.
void handle_http_error(const httplib::Request& req, httplib::Response& res) {
  // A request refused before routing (a malformed request line) has no id yet.
  if (!res.has_header("X-Request-Id")) res.set_header("X-Request-Id", random_id("req"));
  if (!res.body.empty()) return;
  bool known = false;
  for (const Route& r : kRoutes) known = known || path_matches(r, req.path);
  if (res.status == 404 && known) res.status = 405;
  if (res.status == 413) {
    send_error(res, api_error(413, "the request body is too large", "invalid_request_error"));
  } else if (res.status == 404) {
    send_error(res,
               api_error(404, absl::StrCat("no route ", req.method, " ", req.path.substr(0, 100)),
                         "invalid_request_error", "not_found"));
  } else if (res.status == 405) {
    send_error(res,
               api_error(405, absl::StrCat("method ", req.method, " is not allowed on ", req.path),
                         "invalid_request_error", "method_not_allowed"));
  } else {
    send_error(res,
               api_error(res.status, absl::StrCat("HTTP ", res.status), "invalid_request_error"));
  }
}

void handle_exception(const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
  std::string what = "unknown exception";
  try {
    if (ep) std::rethrow_exception(ep);
  } catch (const std::exception& e) {
    what = e.what();
  } catch (...) {
  }
  send_error(res, api_error(500, "internal error: " + what, "server_error"));
}

}  // namespace

void install_routes(httplib::Server& http, ServerContext& ctx, Transport& transport) {
  for (const Route& r : kRoutes) {
    httplib::Server::Handler h = [&ctx, f = r.handler](const httplib::Request& req,
                                                       httplib::Response& res) {
      f(ctx, req, res);
    };
    const std::string pattern = r.prefix ? absl::StrCat(r.path, "(.+)") : std::string(r.path);
    if (std::string(r.method) == "GET") {
      http.Get(pattern, transport.watched(std::move(h)));
    } else {
      http.Post(pattern, transport.read_body(std::move(h)));
    }
  }
  transport.set_routes([](const std::string& method, const std::string& path) {
    for (const Route& r : kRoutes) {
      if (method == r.method && path_matches(r, path)) return true;
    }
    return false;
  });
  transport.set_request_hooks(
      [&ctx](const httplib::Request& req, httplib::Response& res) {
        AccessRecord::begin();
        res.set_header("X-Request-Id", request_id_for(req.get_header_value("X-Request-Id")));
        return apply_cors(ctx.options.allowed_origins, req, res);
      },
      [&ctx](const httplib::Request& req, const httplib::Response& res) {
        const AccessRecord record = AccessRecord::take();
        if (ctx.options.access_log == nullptr) return;
        ctx.options.access_log->info(access_line(req.method, req.path, res.status, record,
                                                 base::now_ns(),
                                                 res.get_header_value("X-Request-Id")));
      });
  http.set_error_handler(handle_http_error);
  http.set_exception_handler(handle_exception);
}

}  // namespace simpler::serve
