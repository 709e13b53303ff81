// The server's routes: a flat table of method + path (or path prefix) -> handler (the completion
// endpoints in completions.h, the others in routes.cc), and the error objects for unknown routes
// (404), known routes with another method (405), refused bodies and handler exceptions (500).
#pragma once

#include <httplib.h>

#include "serve/server_context.h"
#include "serve/transport.h"

namespace simpler::serve {

// Registers every route on `http`, each watched by `transport`'s read guard, the error and
// exception handlers, and the hooks every request goes through (access_log.h, cors.h): its
// X-Request-Id and CORS headers before routing (a preflight answered there), its access log
// line once its response is written. `ctx` and `transport` must outlive the server. Called once,
// before bind.
void install_routes(httplib::Server& http, ServerContext& ctx, Transport& transport);

}  // namespace simpler::serve
