// POST /v1/completions and POST /v1/chat/completions: a request admitted (shutdown, the
// connection limit, the body parsed, the model named), its prompt tokenized and checked against
// the request limits, added to the engine, answered by its first event (an error before any
// output is an HTTP error), then written by a chunked content provider (server-sent events or
// one JSON body) that blocks on the request's output queue at most 100 ms at a time and aborts
// the request when its client goes away.
#pragma once

#include <httplib.h>

#include "serve/server_context.h"

namespace simpler::serve {

// Answers one completion request; `chat_endpoint` selects /v1/chat/completions. Runs on an
// HTTP thread; the response's content provider and releaser run on it afterwards.
void handle_generate(ServerContext& ctx, const httplib::Request& req, httplib::Response& res,
                     bool chat_endpoint);

}  // namespace simpler::serve
