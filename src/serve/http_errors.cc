#include "serve/http_errors.h"

#include <string>

#include "simpler/serve/openai_server.h"

namespace simpler::serve {

void send_error(httplib::Response& res, const ApiError& e) {
  res.status = e.http_status;
  if (e.http_status == 429 && !res.has_header("Retry-After")) {
    res.set_header("Retry-After", std::to_string(kRetryAfterSeconds));
  }
  res.set_content(e.to_json(), "application/json");
}

ApiError api_error(int status, std::string message, std::string type, std::string code) {
  ApiError e;
  e.http_status = status;
  e.message = std::move(message);
  e.type = std::move(type);
  e.code = std::move(code);
  return e;
}

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

}  // namespace simpler::serve
