// OpenAI error objects (openai_protocol.h) as HTTP responses. Thread-safe (pure).
#pragma once

#include <httplib.h>

#include <string>

#include "absl/status/status.h"
#include "simpler/serve/openai_protocol.h"

namespace simpler::serve {

// The error object as the response: its status and JSON body, and for a 429 Retry-After
// (kRetryAfterSeconds).
void send_error(httplib::Response& res, const ApiError& e);
ApiError api_error(int status, std::string message, std::string type, std::string code = {});
// An engine refusal or failure as an HTTP error: INVALID_ARGUMENT 400, RESOURCE_EXHAUSTED 429
// (queue_full), FAILED_PRECONDITION and UNAVAILABLE 503, anything else 500.
ApiError from_status(const absl::Status& s);

}  // namespace simpler::serve
