#include "serve/completions.h"

#include <algorithm>
#include <chrono>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "serve/access_log.h"
#include "serve/http_errors.h"
#include "serve/tool_calls.h"
#include "simpler/base/clock.h"
#include "simpler/base/json.h"
#include "simpler/base/log.h"

namespace simpler::serve {

using json = nlohmann::json;

namespace {

// One request's response state, shared by the handler and its content provider (which run on
// the same HTTP thread, one after the other).
struct Exchange {
  llm::LlmEngine* engine = nullptr;
  const llm::Tokenizer* tokenizer = nullptr;
  llm::RequestId id = 0;
  bool chat = false;
  bool stream = false;
  bool include_usage = false;
  bool echo = false;
  std::optional<int32_t> logprobs;
  std::string response_id, model, prompt_text, request_id;
  std::vector<int32_t> prompt_ids;  // echo with logprobs: the tokens its prompt logprobs score
  int64_t created = 0;
  int64_t prompt_tokens = 0;
  int64_t cached_tokens = 0;  // choice 0's prompt tokens served by the prefix cache
  int32_t n = 1;
  // Per choice.
  std::vector<std::string> text;
  // The tokens folded into the response so far (streamed: sent, or being sent); the engine's
  // count once the choice finished.
  std::vector<int64_t> completion_tokens;
  std::vector<std::string> finish;
  std::vector<json> logprob_content;  // chat: list; completions: {tokens, token_logprobs, ...}
  // Completions' logprobs: the text_offset of the choice's next token, in characters (Unicode
  // code points) into the choice's returned text (the echoed prompt first).
  std::vector<int64_t> text_offset;
  std::vector<bool> started;  // stream: the role chunk (chat) or the echoed prompt went out
  // Chat with tools to call (ToolCallPolicy::parses): what the output may call and, streamed,
  // each choice's parser (borrowing `tool_calls`; the Exchange never moves).
  ToolCallPolicy tool_calls;
  std::vector<ToolCallParser> tool_parsers;
  int32_t open = 0;
  std::deque<llm::RequestOutput> pending;  // events read before the provider ran
  bool done_written = false;
  bool client_left = false;  // the response was cut short by its client (write_response)
  int64_t start_ns = 0, first_token_ns = 0;
  ClientWatch client;  // the request's connection (a client that left aborts the request)

  std::string token_text(int32_t t) const { return tokenizer->decode(std::vector<int32_t>{t}); }
};

// ---- Response shapes ----

// One server-sent event.
std::string sse(const std::string& payload) { return "data: " + payload + "\n\n"; }

// A response or stream chunk around `choices` (usage, when there is one, is added after).
json envelope(const Exchange& x, const char* object, json choices) {
  return {{"id", x.response_id},
          {"object", object},
          {"created", x.created},
          {"model", x.model},
          {"choices", std::move(choices)}};
}

const char* chunk_object(const Exchange& x) {
  return x.chat ? "chat.completion.chunk" : "text_completion";
}

// One choice: `key` is chat's "delta" or "message", or the completion's "text".
json choice(int32_t index, const char* key, json value, json logprobs, json finish_reason) {
  return {{"index", index},
          {key, std::move(value)},
          {"logprobs", std::move(logprobs)},
          {"finish_reason", std::move(finish_reason)}};
}

// One choice of a stream chunk: chat's delta `chat_delta` or the completion's `text`.
std::string stream_chunk(const Exchange& x, int32_t i, json chat_delta, const std::string& text,
                         json logprobs, json finish_reason) {
  json c = x.chat ? choice(i, "delta", std::move(chat_delta), std::move(logprobs),
                           std::move(finish_reason))
                  : choice(i, "text", text, std::move(logprobs), std::move(finish_reason));
  return sse(base::dump_replacing(envelope(x, chunk_object(x), json::array({std::move(c)}))));
}

// A choice's logprobs before any token: chat's {content: []}, the completion's parallel lists.
json empty_logprobs(bool chat) {
  if (chat) return {{"content", json::array()}};
  return {{"tokens", json::array()},
          {"token_logprobs", json::array()},
          {"top_logprobs", json::array()},
          {"text_offset", json::array()}};
}

int64_t completion_tokens(const Exchange& x) {
  int64_t completion = 0;
  for (int64_t c : x.completion_tokens) completion += c;
  return completion;
}

json usage(const Exchange& x) {
  const int64_t completion = completion_tokens(x);
  return {{"prompt_tokens", x.prompt_tokens},
          {"completion_tokens", completion},
          {"total_tokens", x.prompt_tokens + completion},
          {"prompt_tokens_details", {{"cached_tokens", x.cached_tokens}}}};
}

// ---- Folding events ----

// The characters (Unicode code points) of UTF-8 text: its bytes that start one.
int64_t utf8_chars(const std::string& s) {
  return std::count_if(s.begin(), s.end(),
                       [](char c) { return (static_cast<unsigned char>(c) & 0xC0) != 0x80; });
}

json logprob_entry_chat(const Exchange& x, int32_t id, const llm::TokenLogprob& lp) {
  auto bytes = [](const std::string& s) {
    json b = json::array();
    for (unsigned char c : s) b.push_back(static_cast<int>(c));
    return b;
  };
  const std::string t = x.token_text(id);
  json top = json::array();
  for (const auto& [tid, l] : lp.top) {
    const std::string tt = x.token_text(tid);
    top.push_back({{"token", tt}, {"logprob", l}, {"bytes", bytes(tt)}});
  }
  return {{"token", t}, {"logprob", lp.logprob}, {"bytes", bytes(t)}, {"top_logprobs", top}};
}

// A completion's logprobs entry for one token: its text, logprob (null: none, as the prompt's
// first token) and top alternatives, at character offset `offset`; advances `offset` by the
// token's characters. The alternatives hold the token itself too, so up to `logprobs` + 1 of
// them (OpenAI's legacy completions: "the API will always return the logprob of the sampled
// token"; vLLM does the same for prompt tokens).
void push_completion_logprob(const Exchange& x, json& d, int32_t id,
                             const std::optional<llm::TokenLogprob>& lp, int64_t& offset) {
  const std::string token = x.token_text(id);
  d["tokens"].push_back(token);
  if (lp.has_value()) {
    json top = json::object();
    for (const auto& [tid, l] : lp->top) top[x.token_text(tid)] = l;
    if (!top.contains(token)) top[token] = lp->logprob;
    d["token_logprobs"].push_back(lp->logprob);
    d["top_logprobs"].push_back(std::move(top));
  } else {
    d["token_logprobs"].push_back(nullptr);
    d["top_logprobs"].push_back(nullptr);
  }
  d["text_offset"].push_back(offset);
  offset += utf8_chars(token);
}

void append_completion_logprobs(json& all, const json& d) {
  for (const char* key : {"tokens", "token_logprobs", "top_logprobs", "text_offset"}) {
    for (const json& v : d[key]) all[key].push_back(v);
  }
}

// An echoed prompt's logprobs (vLLM's: the first token null), at offsets from 0 into the echoed
// prompt, appended to the choice's (before any output token's); returns them as the echo
// chunk's logprobs.
json fold_prompt_logprobs(Exchange& x, const llm::RequestOutput& out) {
  json d = empty_logprobs(false);
  int64_t offset = 0;
  const size_t count = std::min(out.prompt_logprobs.size(), x.prompt_ids.size());
  for (size_t k = 0; k < count; ++k) {
    push_completion_logprob(x, d, x.prompt_ids[k], out.prompt_logprobs[k], offset);
  }
  append_completion_logprobs(x.logprob_content[out.index], d);
  return d;
}

// The event's logprobs, appended to its choice's; returns them as the stream's delta.
json fold_logprobs(Exchange& x, const llm::RequestOutput& out) {
  json& all = x.logprob_content[out.index];
  const size_t count = std::min(out.token_ids.size(), out.logprobs.size());
  if (x.chat) {
    json content = json::array();
    for (size_t k = 0; k < count; ++k) {
      content.push_back(logprob_entry_chat(x, out.token_ids[k], out.logprobs[k]));
      all["content"].push_back(content.back());
    }
    return {{"content", content}};
  }
  json d = empty_logprobs(false);
  for (size_t k = 0; k < count; ++k) {
    push_completion_logprob(x, d, out.token_ids[k], out.logprobs[k], x.text_offset[out.index]);
  }
  append_completion_logprobs(all, d);
  return d;
}

// A streamed chat choice read for tool calls: the event's deltas (tool_stream_deltas), its
// logprobs on the first; the finish reason "tool_calls" once it made a call.
std::string tool_call_chunks(Exchange& x, const llm::RequestOutput& out, json lp_delta) {
  const int32_t i = out.index;
  ToolCallParser& parser = x.tool_parsers[i];
  std::vector<json> deltas =
      tool_stream_deltas(parser, out.text, out.finished(), !lp_delta.is_null(), tool_call_id);
  if (out.finished()) x.finish[i] = tool_finish_reason(parser.calls() > 0, x.finish[i]);
  std::string chunks;
  for (size_t k = 0; k < deltas.size(); ++k) {
    chunks +=
        stream_chunk(x, i, std::move(deltas[k]), "", k == 0 ? lp_delta : json(nullptr), nullptr);
  }
  return chunks;
}

// Folds an event into the choice's state; returns the stream chunk(s) for it ("" when not
// streaming or nothing to send).
std::string apply_event(Exchange& x, const llm::RequestOutput& out) {
  const int32_t i = out.index;
  if (x.first_token_ns == 0 && !out.token_ids.empty()) x.first_token_ns = base::now_ns();
  x.text[i] += out.text;
  x.completion_tokens[i] += static_cast<int64_t>(out.token_ids.size());
  json prompt_lp = nullptr, lp_delta = nullptr;
  if (x.echo && x.logprobs.has_value() && !out.prompt_logprobs.empty()) {
    prompt_lp = fold_prompt_logprobs(x, out);  // first: the echoed prompt precedes the output
  }
  if (x.logprobs.has_value() && !out.logprobs.empty()) lp_delta = fold_logprobs(x, out);
  if (out.finished()) {
    x.completion_tokens[i] = out.completion_tokens;
    if (i == 0) x.cached_tokens = out.cached_tokens;
    x.finish[i] = llm::finish_reason_name(out.finish);
    --x.open;
  }
  if (!x.stream) return "";
  std::string chunks;
  if (x.chat && !x.started[i]) {
    x.started[i] = true;
    chunks += stream_chunk(x, i, {{"role", "assistant"}, {"content", ""}}, "", nullptr, nullptr);
  } else if (x.echo && !x.started[i]) {
    x.started[i] = true;  // the echoed prompt goes first, in a chunk of its own
    chunks += stream_chunk(x, i, nullptr, x.prompt_text, std::move(prompt_lp), nullptr);
  }
  if (!x.tool_parsers.empty()) {
    chunks += tool_call_chunks(x, out, std::move(lp_delta));
  } else if (!out.text.empty() || !lp_delta.is_null()) {
    chunks += stream_chunk(x, i, {{"content", out.text}}, out.text, lp_delta, nullptr);
  }
  if (out.finished()) {
    if (out.finish == llm::OutputFinish::kError) {
      chunks += sse(api_error(500, std::string(out.error.message()), "server_error").to_json());
    }
    chunks += stream_chunk(x, i, json::object(), "", nullptr, x.finish[i]);
  }
  return chunks;
}

// What follows the last event: the stream's usage chunk (when asked) and [DONE], or the whole
// JSON body.
std::string final_text(const Exchange& x) {
  if (x.stream) {
    std::string tail;
    if (x.include_usage) {
      json u = envelope(x, chunk_object(x), json::array());
      u["usage"] = usage(x);
      tail += sse(base::dump_replacing(u));
    }
    return tail + sse("[DONE]");
  }
  json choices = json::array();
  for (int32_t i = 0; i < x.n; ++i) {
    json lp = x.logprobs.has_value() ? x.logprob_content[i] : json(nullptr);
    if (x.chat && x.tool_calls.parses()) {
      const ToolCallPiece whole = parse_tool_calls(x.text[i], x.tool_calls);
      choices.push_back(choice(i, "message", chat_message_json(whole, tool_call_id), lp,
                               tool_finish_reason(!whole.calls.empty(), x.finish[i])));
    } else if (x.chat) {
      choices.push_back(
          choice(i, "message", {{"role", "assistant"}, {"content", x.text[i]}}, lp, x.finish[i]));
    } else {
      choices.push_back(
          choice(i, "text", (x.echo ? x.prompt_text : std::string()) + x.text[i], lp, x.finish[i]));
    }
  }
  json body = envelope(x, x.chat ? "chat.completion" : "text_completion", std::move(choices));
  body["usage"] = usage(x);
  return base::dump_replacing(body);
}

// Reads (and drops) a request's remaining events until its queue is released.
void drain_outputs(llm::LlmEngine* engine, llm::RequestId id) {
  while (engine->next_output(id, base::Deadline::after(std::chrono::seconds(5))).ok()) {
  }
}

// ---- The steps of handle_generate ----

// Admission: 503 while shutting down or on a connection past the pool (which then closes), the
// body parsed and validated, 404 for a model this server does not serve.
std::variant<ParsedRequest, ApiError> admit(const ServerContext& ctx, const httplib::Request& req,
                                            httplib::Response& res, bool chat_endpoint) {
  if (ctx.shutting_down.load()) {
    return api_error(503, "the server is shutting down", "service_unavailable");
  }
  if (connection_overloaded()) {
    res.set_header("Connection", "close");
    return api_error(503, "the server is at its connection limit; retry later",
                     "service_unavailable", "overloaded");
  }
  auto parsed = parse_request(req.body, chat_endpoint, ctx.options.limits);
  if (auto* p = std::get_if<ParsedRequest>(&parsed)) {
    if (std::optional<ApiError> e = unknown_model(ctx, p->model)) return *std::move(e);
  }
  return parsed;
}

// A request's prompt as token ids, and as text where the response may echo it.
struct Prompt {
  std::vector<int32_t> ids;
  std::string text;
};

std::variant<Prompt, ApiError> tokenize_prompt(const ServerContext& ctx, const ParsedRequest& p) {
  Prompt out;
  if (p.chat) {
    auto rendered = render_chat(ctx, p.messages, p.chat_options);
    if (auto* e = std::get_if<ApiError>(&rendered)) return *e;
    auto encoded = ctx.tokenizer->try_encode(std::get<std::string>(rendered));
    if (!encoded.ok()) return bad_request(std::string(encoded.status().message()), "messages");
    out.ids = *std::move(encoded);
  } else if (auto* text = std::get_if<std::string>(&p.prompt)) {
    auto encoded = ctx.tokenizer->try_encode(*text);
    if (!encoded.ok()) return bad_request(std::string(encoded.status().message()), "prompt");
    out.ids = *std::move(encoded);
    out.text = *text;
  } else {
    auto ids =
        vocabulary_ids(ctx, std::get<std::vector<int64_t>>(p.prompt), "prompt token id", "prompt");
    if (auto* e = std::get_if<ApiError>(&ids)) return *e;
    out.ids = std::get<std::vector<int32_t>>(std::move(ids));
    if (p.echo) out.text = ctx.tokenizer->decode(out.ids);
  }
  return out;
}

// The request limits (LlmEngine::max_tokens_for): the max_tokens to run with, or 400 naming
// the prompt ("messages" for chat).
std::variant<int64_t, ApiError> check_request_limits(const ServerContext& ctx,
                                                     const ParsedRequest& p, int64_t plen) {
  absl::StatusOr<int64_t> max_tokens = ctx.engine->max_tokens_for(plen, p.max_tokens);
  if (!max_tokens.ok()) {
    return bad_request(std::string(max_tokens.status().message()), p.chat ? "messages" : "prompt");
  }
  return *max_tokens;
}

std::shared_ptr<Exchange> new_exchange(const ServerContext& ctx, const httplib::Request& req,
                                       const ParsedRequest& p, Prompt& prompt,
                                       const std::string& request_id, int64_t start_ns) {
  auto x = std::make_shared<Exchange>();
  x->engine = ctx.engine;
  x->tokenizer = ctx.tokenizer;
  x->chat = p.chat;
  x->stream = p.stream;
  x->include_usage = p.include_usage;
  x->echo = p.echo && !p.chat;
  x->logprobs = p.logprobs;
  x->response_id = random_id(p.chat ? "chatcmpl" : "cmpl");
  x->model = ctx.options.served_model_name;
  x->prompt_text = std::move(prompt.text);
  x->request_id = request_id;
  x->created = unix_seconds();
  x->prompt_tokens = static_cast<int64_t>(prompt.ids.size());
  if (x->echo && x->logprobs.has_value()) x->prompt_ids = prompt.ids;
  x->n = p.n;
  x->text.assign(p.n, "");
  x->completion_tokens.assign(p.n, 0);
  x->finish.assign(p.n, "");
  x->logprob_content.assign(p.n, empty_logprobs(p.chat));
  x->text_offset.assign(p.n, x->echo ? utf8_chars(x->prompt_text) : 0);
  x->started.assign(p.n, false);
  x->tool_calls = p.tool_calls;
  if (p.chat && p.stream && x->tool_calls.parses()) {
    x->tool_parsers.assign(p.n, ToolCallParser(&x->tool_calls));
  }
  x->open = p.n;
  x->start_ns = start_ns;
  x->client = ctx.transport->watch(req);
  return x;
}

llm::RequestSpec request_spec(const ParsedRequest& p, std::vector<int32_t> ids, int64_t max_tokens,
                              const std::string& request_id) {
  llm::RequestSpec spec;
  spec.prompt_ids = std::move(ids);
  spec.max_tokens = max_tokens;
  spec.n = p.n;
  spec.sampling = p.sampling;
  // vLLM's echo with logprobs: the echoed prompt's tokens get logprobs too.
  if (p.echo && !p.chat && p.logprobs.has_value()) spec.sampling.prompt_logprobs = p.logprobs;
  spec.caller_id = request_id;
  return spec;
}

// The first event decides the status: a request that fails before any output gets its error
// as an HTTP error, not as a 200 stream. A client that leaves while its request is still queued
// aborts it then instead of when it runs (499).
std::optional<ApiError> first_event(Exchange& x) {
  while (true) {
    auto out = x.engine->next_output(x.id, base::Deadline::after(std::chrono::milliseconds(100)));
    if (out.ok()) {
      x.pending.push_back(*std::move(out));
      break;
    }
    if (out.status().code() != absl::StatusCode::kDeadlineExceeded) {
      return api_error(500, std::string(out.status().message()), "server_error");
    }
    if (x.client.gone()) {
      AccessRecord::note_client_disconnected();
      (void)x.engine->abort(x.id);
      drain_outputs(x.engine, x.id);
      return api_error(499, "the client closed the connection while queued",
                       "invalid_request_error");
    }
  }
  const llm::RequestOutput& first = x.pending.front();
  if (first.finished() && first.token_ids.empty() && x.n == 1 &&
      (first.finish == llm::OutputFinish::kError || first.finish == llm::OutputFinish::kAbort)) {
    const absl::Status why =
        first.error.ok() ? absl::CancelledError("the request was aborted") : first.error;
    return first.finish == llm::OutputFinish::kAbort
               ? api_error(503, std::string(why.message()), "service_unavailable")
               : api_error(500, std::string(why.message()), "server_error");
  }
  return std::nullopt;
}

// Marks the response as cut short by its client; false, for write_response to return.
bool client_left(Exchange& x) {
  x.client_left = true;
  return false;
}

// The stream writer (the content provider): folds the request's events and writes their chunks
// (a stream) or, after the last, the body. Returns false when the client went away (a write
// failed, or it closed the connection: `client_left` is set) or the request's events could not
// be read: the releaser aborts the request.
bool write_response(Exchange& x, httplib::DataSink& sink) {
  while (true) {
    if (!sink.is_writable() || x.client.gone()) return client_left(x);
    if (x.pending.empty()) {
      if (x.open == 0) {
        const std::string tail = final_text(x);
        if (!sink.write(tail.data(), tail.size())) return client_left(x);
        x.done_written = true;
        sink.done();
        return true;
      }
      auto out = x.engine->next_output(x.id, base::Deadline::after(std::chrono::milliseconds(100)));
      if (!out.ok()) {
        if (out.status().code() == absl::StatusCode::kDeadlineExceeded) {
          if (x.stream) return true;  // come back (the sink's liveness is checked first)
          continue;
        }
        return false;
      }
      x.pending.push_back(*std::move(out));
    }
    std::string chunk;
    while (!x.pending.empty()) {
      chunk += apply_event(x, x.pending.front());
      x.pending.pop_front();
    }
    if (x.stream && !chunk.empty()) {
      return sink.write(chunk.data(), chunk.size()) || client_left(x);
    }
  }
}

// The content provider's releaser: a response not written to its end aborts its request (and
// drains its queue so that its delivery is released); logs the request.
void release_response(ServerContext& ctx, Exchange& x, bool success) {
  if (!success || !x.done_written) {
    (void)x.engine->abort(x.id);  // NOT_FOUND when it already finished
    drain_outputs(x.engine, x.id);
  }
  SIMPLER_LOG_INFO(
      "request {}: {} {} prompt {} completion {} tokens, TTFT {:.1f} ms, total {:.1f} ms",
      x.request_id, success && x.done_written ? "200" : "200 (client gone)",
      x.chat ? "chat" : "completion", x.prompt_tokens, completion_tokens(x),
      x.first_token_ns ? (x.first_token_ns - x.start_ns) / 1e6 : 0.0,
      (base::now_ns() - x.start_ns) / 1e6);
  ctx.open_responses.fetch_sub(1);
}

void start_response(ServerContext& ctx, httplib::Response& res, std::shared_ptr<Exchange> x) {
  ctx.open_responses.fetch_add(1);
  res.set_header("Cache-Control", "no-cache");
  const char* type = x->stream ? "text/event-stream" : "application/json";
  res.set_chunked_content_provider(
      type,
      [x](size_t /*offset*/, httplib::DataSink& sink) {
        const bool ok = write_response(*x, sink);
        AccessRecord::note_tokens(x->prompt_tokens, completion_tokens(*x));
        if (x->client_left) AccessRecord::note_client_disconnected();
        return ok;
      },
      [&ctx, x](bool success) { release_response(ctx, *x, success); });
}

}  // namespace

void handle_generate(ServerContext& ctx, const httplib::Request& req, httplib::Response& res,
                     bool chat_endpoint) {
  const int64_t start_ns = base::now_ns();
  const std::string request_id = res.get_header_value("X-Request-Id");  // set before routing
  auto fail = [&](const ApiError& e) {
    send_error(res, e);
    SIMPLER_LOG_INFO("request {}: {} {} ({})", request_id, e.http_status, req.path,
                     e.message.substr(0, 200));
  };
  if (!ctx.authorized(req, res)) return;
  auto admitted = admit(ctx, req, res, chat_endpoint);
  if (auto* e = std::get_if<ApiError>(&admitted)) return fail(*e);
  const ParsedRequest& p = std::get<ParsedRequest>(admitted);
  auto prompt = tokenize_prompt(ctx, p);
  if (auto* e = std::get_if<ApiError>(&prompt)) return fail(*e);
  Prompt& pr = std::get<Prompt>(prompt);
  AccessRecord::note_tokens(static_cast<int64_t>(pr.ids.size()), 0);
  auto max_tokens = check_request_limits(ctx, p, static_cast<int64_t>(pr.ids.size()));
  if (auto* e = std::get_if<ApiError>(&max_tokens)) return fail(*e);
  std::shared_ptr<Exchange> x = new_exchange(ctx, req, p, pr, request_id, start_ns);
  absl::StatusOr<llm::RequestId> id = ctx.engine->add_request(
      request_spec(p, std::move(pr.ids), std::get<int64_t>(max_tokens), request_id));
  if (!id.ok()) return fail(from_status(id.status()));
  x->id = *id;
  if (std::optional<ApiError> e = first_event(*x)) return fail(*e);
  start_response(ctx, res, std::move(x));
}

}  // namespace simpler::serve
