#include "serve/cors.h"

#include <algorithm>

#include "serve/http_errors.h"

namespace simpler::serve {

bool origin_allowed(const std::vector<std::string>& allowed, const std::string& origin) {
  if (origin.empty()) return false;
  return std::any_of(allowed.begin(), allowed.end(),
                     [&](const std::string& a) { return a == "*" || a == origin; });
}

bool is_preflight(const httplib::Request& req) {
  return req.method == "OPTIONS" && req.has_header("Origin") &&
         req.has_header("Access-Control-Request-Method");
}

bool apply_cors(const std::vector<std::string>& allowed, const httplib::Request& req,
                httplib::Response& res) {
  const std::string origin = req.get_header_value("Origin");
  const bool ok = origin_allowed(allowed, origin);
  if (ok) {
    const bool any = std::find(allowed.begin(), allowed.end(), "*") != allowed.end();
    res.set_header("Access-Control-Allow-Origin", any ? "*" : origin);
    if (!any) res.set_header("Vary", "Origin");
    res.set_header("Access-Control-Expose-Headers", "X-Request-Id, Retry-After");
  }
  if (!is_preflight(req)) return false;
  if (!ok) {
    send_error(res,
               api_error(403, "CORS: the origin '" + origin.substr(0, 100) + "' is not allowed",
                         "invalid_request_error", "cors_origin_not_allowed"));
    return true;
  }
  res.status = 204;
  res.set_header("Access-Control-Allow-Methods", "GET, POST, OPTIONS");
  res.set_header("Access-Control-Allow-Headers", "Authorization, Content-Type, X-Request-Id");
  res.set_header("Access-Control-Max-Age", "600");
  return true;
}

}  // namespace simpler::serve
