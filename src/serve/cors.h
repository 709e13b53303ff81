// CORS for the server (ServerOptions::allowed_origins; the contract is in openai_server.h's
// header comment): the headers a response to an allowed origin carries and the answer to a
// preflight. Thread-safe (pure).
#pragma once

#include <httplib.h>

#include <string>
#include <vector>

namespace simpler::serve {

// Whether `origin` is allowed: listed exactly, or "*" listed. An empty origin never is.
bool origin_allowed(const std::vector<std::string>& allowed, const std::string& origin);

// Whether the request is a CORS preflight: OPTIONS with Origin and
// Access-Control-Request-Method.
bool is_preflight(const httplib::Request& req);

// Adds the CORS headers of a response to `req` when its Origin is allowed (none otherwise);
// a preflight's answer (204 from an allowed origin, else 403) when it is one. Returns whether
// the request is answered (a preflight).
bool apply_cors(const std::vector<std::string>& allowed, const httplib::Request& req,
                httplib::Response& res);

}  // namespace simpler::serve
