// OpenAiServer on a loopback port with the tiny preset (real Qwen3 tokenizer), driven by
// cpp-httplib's client: responses, SSE framing, errors, disconnects, concurrency and shutdown.
#include "simpler/serve/openai_server.h"

#include <httplib.h>

#include <atomic>
#include <filesystem>
#include <random>
#include <regex>
#include <set>
#include <thread>

#include "base/test_wait.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "serve/access_log.h"
#include "serve/server_context.h"
#include "serve/server_test_fixture.h"
#include "simpler/model/make_model.h"
#include "spdlog/sinks/ringbuffer_sink.h"
#include "spdlog/spdlog.h"

namespace simpler::serve {
namespace {

using json = nlohmann::json;

class ServerTest : public ServerFixture {
 protected:
  static void SetUpTestSuite() { make_checkpoint("simpler_serve_test"); }

  // Starts the server with its access log kept in the last `lines` lines of a ring buffer.
  void start_with_access_log(size_t lines) {
    access_sink_ = std::make_shared<spdlog::sinks::ringbuffer_sink_mt>(lines);
    access_sink_->set_pattern("%v");
    ServerOptions so;
    so.access_log = std::make_shared<spdlog::logger>("access_test", access_sink_);
    start(so);
  }
  // The access lines logged so far, without their line ends.
  std::vector<std::string> access_lines() const {
    std::vector<std::string> lines = access_sink_->last_formatted();
    for (std::string& l : lines) {
      while (!l.empty() && (l.back() == '\n' || l.back() == '\r')) l.pop_back();
    }
    return lines;
  }

  std::shared_ptr<spdlog::sinks::ringbuffer_sink_mt> access_sink_;
};

TEST(BaseUrlTest, NamesIpv6AddressesInBrackets) {
  EXPECT_EQ(base_url("127.0.0.1", 8000), "http://127.0.0.1:8000/v1");
  EXPECT_EQ(base_url("localhost", 80), "http://localhost:80/v1");
  EXPECT_EQ(base_url("::1", 8013), "http://[::1]:8013/v1");
  EXPECT_EQ(base_url("[::1]", 8013), "http://[::1]:8013/v1");
}

TEST_F(ServerTest, CompletionStreamedAndNotGiveTheSameTextWithCorrectFraming) {
  start();
  const std::string body = R"({"model":"tiny","prompt":"The quick brown fox","max_tokens":12,
                              "temperature":0,"ignore_eos":true)";
  auto res = post("/v1/completions", body + "}");
  ASSERT_TRUE(res);
  ASSERT_EQ(res->status, 200) << res->body;
  EXPECT_FALSE(res->get_header_value("X-Request-Id").empty());
  const json j = json::parse(res->body);
  EXPECT_EQ(j["object"], "text_completion");
  EXPECT_EQ(j["model"], "tiny");
  ASSERT_EQ(j["choices"].size(), 1u);
  EXPECT_EQ(j["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(j["usage"]["completion_tokens"], 12);
  EXPECT_EQ(j["usage"]["prompt_tokens"], tokenizer_->encode("The quick brown fox").size());
  const std::string text = j["choices"][0]["text"];

  int status = 0;
  const std::string raw =
      stream("/v1/completions", body + R"(,"stream":true,"stream_options":{"include_usage":true}})",
             &status);
  EXPECT_EQ(status, 200);
  const auto evs = events(raw);
  ASSERT_GE(evs.size(), 3u) << raw;
  EXPECT_EQ(evs.back(), "[DONE]");
  std::string streamed;
  std::string finish;
  for (size_t i = 0; i + 2 < evs.size(); ++i) {
    const json c = json::parse(evs[i]);
    EXPECT_EQ(c["object"], "text_completion");
    streamed += c["choices"][0]["text"].get<std::string>();
    if (!c["choices"][0]["finish_reason"].is_null()) finish = c["choices"][0]["finish_reason"];
  }
  EXPECT_EQ(streamed, text);
  EXPECT_EQ(finish, "length");
  const json usage = json::parse(evs[evs.size() - 2]);
  EXPECT_TRUE(usage["choices"].empty());
  EXPECT_EQ(usage["usage"]["completion_tokens"], 12);
  // Same tokens as the engine gives directly (token ids as the prompt, no echo).
  std::vector<int32_t> ids = tokenizer_->encode("The quick brown fox");
  auto res_ids = post(
      "/v1/completions",
      json{{"prompt", ids}, {"max_tokens", 12}, {"temperature", 0}, {"ignore_eos", true}}.dump());
  ASSERT_TRUE(res_ids);
  EXPECT_EQ(json::parse(res_ids->body)["choices"][0]["text"], text);
}

TEST_F(ServerTest, ChatStreamsARoleChunkThenDeltasPerChoice) {
  start();
  const std::string body =
      R"({"messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"Hi"}],
          "max_tokens":6,"temperature":0.9,"seed":7,"n":2,"stream":true,
          "chat_template_kwargs":{"enable_thinking":false}})";
  int status = 0;
  const auto evs = events(stream("/v1/chat/completions", body, &status));
  EXPECT_EQ(status, 200);
  ASSERT_FALSE(evs.empty());
  EXPECT_EQ(evs.back(), "[DONE]");
  std::map<int, std::string> text;
  std::map<int, int> roles, finals;
  for (size_t i = 0; i + 1 < evs.size(); ++i) {
    const json c = json::parse(evs[i]);
    EXPECT_EQ(c["object"], "chat.completion.chunk");
    const json& ch = c["choices"][0];
    const int idx = ch["index"];
    if (ch["delta"].contains("role")) ++roles[idx];
    if (ch["delta"].contains("content")) text[idx] += ch["delta"]["content"].get<std::string>();
    if (!ch["finish_reason"].is_null()) ++finals[idx];
  }
  EXPECT_EQ(roles, (std::map<int, int>{{0, 1}, {1, 1}}));
  EXPECT_EQ(finals, (std::map<int, int>{{0, 1}, {1, 1}}));
  // Non-streamed with the same seed: the same two texts.
  std::string plain = body;
  plain.replace(plain.find(R"("stream":true)"), 13, R"("stream":false)");
  const json j = post_ok("/v1/chat/completions", plain);
  ASSERT_FALSE(j.is_null());
  ASSERT_EQ(j["choices"].size(), 2u);
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(j["choices"][i]["message"]["role"], "assistant");
    EXPECT_EQ(j["choices"][i]["message"]["content"], text[i]) << "choice " << i;
  }
  // The prompt is the template's rendering.
  auto tok = post("/tokenize", R"({"messages":[{"role":"system","content":"Be brief."},
                                  {"role":"user","content":"Hi"}],
                                  "chat_template_kwargs":{"enable_thinking":false}})");
  ASSERT_TRUE(tok);
  ASSERT_EQ(tok->status, 200) << tok->body;
  EXPECT_EQ(json::parse(tok->body)["count"], j["usage"]["prompt_tokens"]);
  EXPECT_EQ(json::parse(tok->body)["tokens"],
            tokenizer_->encode("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_"
                               "end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"));
}

// A chat body with a tool, a finished round of tool calls and a new question.
json tool_chat_body() {
  return json::parse(R"({"model": "tiny", "max_tokens": 8, "temperature": 0, "ignore_eos": true,
      "n": 2, "chat_template_kwargs": {"enable_thinking": false},
      "tools": [{"type": "function", "function": {"name": "get_weather",
        "description": "Weather", "parameters": {"type": "object",
        "properties": {"city": {"type": "string"}}, "required": ["city"]}}}],
      "messages": [{"role": "user", "content": "Paris?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1",
          "type": "function", "function": {"name": "get_weather",
          "arguments": "{\"city\":\"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
        {"role": "user", "content": "And Rome?"}]})");
}

TEST_F(ServerTest, ChatWithToolsRendersThemAndStreamsWhatItReturnsWhole) {
  start();
  const json body = tool_chat_body();
  const json j = post_ok("/v1/chat/completions", body.dump());
  ASSERT_FALSE(j.is_null());
  // The prompt is the template's rendering with the tool and the tool round.
  llm::ChatRenderOptions options;
  options.enable_thinking = false;
  options.tools.push_back(nlohmann::ordered_json::parse(body["tools"][0].dump()));
  std::vector<llm::ChatMessage> messages(4);
  messages[0] = {"user", "Paris?", std::nullopt, {}};
  messages[1] = {"assistant",
                 "",
                 std::nullopt,
                 {llm::ChatToolCall{"get_weather", nlohmann::ordered_json{{"city", "Paris"}}}}};
  messages[2] = {"tool", "21 C", std::nullopt, {}};
  messages[3] = {"user", "And Rome?", std::nullopt, {}};
  const std::string prompt = llm::ChatTemplate::load(*dir_)->render(messages, options).value();
  // The body's keys went out sorted (nlohmann::json): the tool is rendered in that order.
  EXPECT_NE(prompt.find("<tools>\n{\"function\": {\"description\": \"Weather\", \"name\": "
                        "\"get_weather\", \"parameters\": {\"properties\": {\"city\": {\"type\": "
                        "\"string\"}}, \"required\": [\"city\"], \"type\": \"object\"}}, \"type\": "
                        "\"function\"}\n</tools>"),
            std::string::npos)
      << prompt;
  EXPECT_NE(prompt.find("{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}"),
            std::string::npos)
      << prompt;
  EXPECT_EQ(j["usage"]["prompt_tokens"], tokenizer_->encode(prompt).size());
  // The random model makes no valid call: plain content, its own finish reason.
  ASSERT_EQ(j["choices"].size(), 2u);
  for (const json& c : j["choices"]) {
    EXPECT_EQ(c["finish_reason"], "length");
    EXPECT_FALSE(c["message"].contains("tool_calls")) << c;
  }
  // Streamed: each choice's content deltas add up to its whole content.
  json streamed = body;
  streamed["stream"] = true;
  std::map<int, std::string> text;
  std::map<int, std::string> finish;
  for (const std::string& ev : events(stream("/v1/chat/completions", streamed.dump()))) {
    if (ev == "[DONE]") break;
    const json c = json::parse(ev)["choices"][0];
    EXPECT_FALSE(c["delta"].contains("tool_calls")) << c;
    if (c["delta"].contains("content")) text[c["index"]] += c["delta"]["content"];
    if (!c["finish_reason"].is_null()) finish[c["index"]] = c["finish_reason"];
  }
  for (int i = 0; i < 2; ++i) {
    const json& content = j["choices"][i]["message"]["content"];
    ASSERT_TRUE(content.is_string()) << j;
    EXPECT_FALSE(content.get<std::string>().empty());
    EXPECT_EQ(text[i], content.get<std::string>()) << "choice " << i;
    EXPECT_EQ(finish[i], "length");
  }
}

TEST_F(ServerTest, ToolChoiceNoneRequiredAndNamedAreAcceptedAndAnUnknownNameIs400) {
  start();
  json body = tool_chat_body();
  body["n"] = 1;
  for (const json& choice :
       {json("none"), json("required"),
        json::parse(R"({"type":"function","function":{"name":"get_weather"}})")}) {
    body["tool_choice"] = choice;
    auto res = post("/v1/chat/completions", body.dump());
    ASSERT_TRUE(res);
    EXPECT_EQ(res->status, 200) << choice << ": " << res->body;
  }
  body["tool_choice"] = json::parse(R"({"type":"function","function":{"name":"get_time"}})");
  auto res = post("/v1/chat/completions", body.dump());
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 400);
  const json e = json::parse(res->body)["error"];
  EXPECT_EQ(e["param"], "tool_choice");
  EXPECT_EQ(e["message"], "'tool_choice' names the function 'get_time', which is not in 'tools'");
}

// response_format json_schema on both routes: the content parses and has the schema's shape
// (random weights: gibberish values, but valid ones; a finite language, so it ends); streamed
// deltas add up to the same text.
TEST_F(ServerTest, ResponseFormatJsonSchemaGivesContentThatParsesOnBothRoutes) {
  start();
  const json format = json::parse(R"({"type":"json_schema","json_schema":{"name":"pick",
      "strict":true,"schema":{"type":"object","properties":{"color":{"enum":["red","blue"]},
      "n":{"type":"boolean"}},"required":["color"],"additionalProperties":false}}})");
  json chat = {{"messages", {{{"role", "user"}, {"content", "Pick a color"}}}},
               {"max_tokens", 40},
               {"temperature", 0},
               {"response_format", format}};
  const json c_response = post_ok("/v1/chat/completions", chat.dump());
  ASSERT_FALSE(c_response.is_null());
  const json c = c_response["choices"][0];
  ASSERT_EQ(c["finish_reason"], "stop") << c;  // a finite language: ends well within 40 tokens
  const json v = json::parse(c["message"]["content"].get<std::string>());
  EXPECT_TRUE(v["color"] == "red" || v["color"] == "blue") << v;
  for (const auto& [k, val] : v.items()) EXPECT_TRUE(k == "color" || k == "n") << v;
  chat["stream"] = true;
  std::string streamed;
  for (const std::string& ev : events(stream("/v1/chat/completions", chat.dump()))) {
    if (ev == "[DONE]") continue;
    const json d = json::parse(ev)["choices"][0]["delta"];
    if (d.contains("content")) streamed += d["content"].get<std::string>();
  }
  EXPECT_EQ(streamed, c["message"]["content"].get<std::string>());
  json completion = {
      {"prompt", "Pick a color:"}, {"max_tokens", 40}, {"seed", 4}, {"response_format", format}};
  const json cc_response = post_ok("/v1/completions", completion.dump());
  ASSERT_FALSE(cc_response.is_null());
  const json cc = cc_response["choices"][0];
  ASSERT_EQ(cc["finish_reason"], "stop") << cc;
  const json w = json::parse(cc["text"].get<std::string>());
  EXPECT_TRUE(w["color"] == "red" || w["color"] == "blue") << w;
}

// An output whose grammar is complete but could go on ("1" of "1" | "12") ends where the model
// samples EOS: the text is the sentence, without EOS's own text ("<|endoftext|>", or the chat's
// "<|im_end|>"), on both routes; the EOS token is counted. (This model's greedy choice after "1"
// is EOS on both routes: the text "1" and 2 completion tokens pin that path; "12" would end by
// the grammar, without EOS.) The alternatives of logprobs are tokens the grammar allows, each
// logprob a number, never null.
TEST_F(ServerTest, AConstrainedOutputEndedByEosHoldsNoSpecialTokenText) {
  start();
  const json completion = {{"prompt", "x"},
                           {"max_tokens", 12},
                           {"temperature", 0},
                           {"logprobs", 5},
                           {"guided_choice", {"1", "12"}}};
  const json cr = post_ok("/v1/completions", completion.dump());
  const json c = cr["choices"][0];
  EXPECT_EQ(c["finish_reason"], "stop") << c;
  EXPECT_EQ(c["text"], "1") << c;
  EXPECT_EQ(cr["usage"]["completion_tokens"], 2) << cr;
  EXPECT_EQ(c["logprobs"]["tokens"].back(), "<|endoftext|>") << c;
  for (const json& top : c["logprobs"]["top_logprobs"]) {
    EXPECT_LE(top.size(), 6u) << top;
    for (const auto& [token, lp] : top.items()) EXPECT_TRUE(lp.is_number()) << token << ": " << top;
  }
  const json chat = {{"messages", {{{"role", "user"}, {"content", "x"}}}},
                     {"max_tokens", 12},
                     {"temperature", 0},
                     {"logprobs", true},
                     {"top_logprobs", 5},
                     {"guided_choice", {"1", "12"}}};
  const json mr = post_ok("/v1/chat/completions", chat.dump());
  const json m = mr["choices"][0];
  EXPECT_EQ(m["finish_reason"], "stop") << m;
  EXPECT_EQ(m["message"]["content"], "1") << m;
  EXPECT_EQ(mr["usage"]["completion_tokens"], 2) << mr;
  for (const json& entry : m["logprobs"]["content"]) {
    for (const json& alt : entry["top_logprobs"]) EXPECT_TRUE(alt["logprob"].is_number()) << alt;
  }
}

// tool_choice named or "required" (one call): decoding is constrained, so even this model's
// random weights give a valid call of an allowed function, whose arguments match its schema.
TEST_F(ServerTest, RequiredAndNamedToolChoicesAlwaysGiveAValidCall) {
  start();
  json body = {{"messages", {{{"role", "user"}, {"content", "Pick"}}}},
               {"max_tokens", 60},
               {"temperature", 0},
               {"parallel_tool_calls", false},
               {"tools", json::parse(R"([{"type":"function","function":{"name":"pick",
                   "parameters":{"type":"object","properties":{"unit":{"enum":["c","f"]}},
                   "required":["unit"]}}},{"type":"function","function":{"name":"toss",
                   "parameters":{"type":"object","properties":{"heads":{"type":"boolean"}},
                   "required":["heads"]}}}])")}};
  for (const json& choice :
       {json("required"), json::parse(R"({"type":"function","function":{"name":"toss"}})")}) {
    body["tool_choice"] = choice;
    const json c_response = post_ok("/v1/chat/completions", body.dump());
    ASSERT_FALSE(c_response.is_null());
    const json c = c_response["choices"][0];
    EXPECT_EQ(c["finish_reason"], "tool_calls") << c;
    ASSERT_EQ(c["message"]["tool_calls"].size(), 1u) << c;
    const json fn = c["message"]["tool_calls"][0]["function"];
    const json args = json::parse(fn["arguments"].get<std::string>());
    if (choice.is_object()) {
      EXPECT_EQ(fn["name"], "toss") << c;
    }
    if (fn["name"] == "pick") {
      EXPECT_TRUE(args["unit"] == "c" || args["unit"] == "f") << args;
    } else {
      EXPECT_TRUE(args["heads"].is_boolean()) << args;
    }
  }
}

TEST_F(ServerTest, AnUnsupportedSchemaKeywordIs400NamingIt) {
  start();
  auto res = post("/v1/chat/completions", R"({"messages":[{"role":"user","content":"x"}],
      "response_format":{"type":"json_schema","json_schema":{"name":"a","schema":{
      "type":"object","properties":{"s":{"type":"string","format":"date"}}}}}})");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 400);
  const json e = json::parse(res->body)["error"];
  EXPECT_EQ(e["param"], "response_format");
  EXPECT_EQ(e["message"],
            "'response_format': unsupported JSON Schema keyword 'format' at #/properties/s");
}

// The characters (Unicode code points) of UTF-8 text.
int64_t chars_of(const std::string& s) {
  int64_t n = 0;
  for (unsigned char c : s) n += (c & 0xC0) != 0x80 ? 1 : 0;
  return n;
}

// Each token's text_offset is where its text starts in the returned text: the previous token's
// offset plus that token's length in characters, the first at `first`.
void expect_text_offsets(const json& logprobs, int64_t first) {
  const json& tokens = logprobs["tokens"];
  const json& offsets = logprobs["text_offset"];
  ASSERT_EQ(offsets.size(), tokens.size()) << logprobs;
  ASSERT_FALSE(tokens.empty());
  EXPECT_EQ(offsets[0], first) << logprobs;
  for (size_t k = 1; k < tokens.size(); ++k) {
    EXPECT_EQ(offsets[k].get<int64_t>(),
              offsets[k - 1].get<int64_t>() + chars_of(tokens[k - 1].get<std::string>()))
        << "token " << k << ": " << logprobs;
  }
}

TEST_F(ServerTest, TextOffsetsAreCharacterOffsetsIntoTheReturnedText) {
  start();
  const std::string prompt = "The quick brown fox";
  const json body = {{"model", "tiny"},  {"prompt", prompt},   {"max_tokens", 6},
                     {"temperature", 0}, {"ignore_eos", true}, {"logprobs", 1}};
  const json lp_response = post_ok("/v1/completions", body.dump());
  ASSERT_FALSE(lp_response.is_null());
  const json lp = lp_response["choices"][0]["logprobs"];
  expect_text_offsets(lp, 0);
  EXPECT_GT(lp["text_offset"].back().get<int64_t>(), 0) << "the tokens before the last are empty";
  // Echoed: the prompt's tokens come first, from offset 0, and the output's after them.
  json echoed = body;
  echoed["echo"] = true;
  const json echoed_lp_response = post_ok("/v1/completions", echoed.dump());
  ASSERT_FALSE(echoed_lp_response.is_null());
  const json echoed_lp = echoed_lp_response["choices"][0]["logprobs"];
  expect_text_offsets(echoed_lp, 0);
  const size_t prompt_tokens = tokenizer_->encode(prompt).size();
  ASSERT_EQ(echoed_lp["text_offset"].size(), prompt_tokens + 6);
  EXPECT_EQ(echoed_lp["text_offset"][prompt_tokens], chars_of(prompt));
  // Streamed: the same offsets, continued across chunks.
  json streamed = body;
  streamed["stream"] = true;
  json offsets = json::array();
  for (const std::string& ev : events(stream("/v1/completions", streamed.dump()))) {
    if (ev == "[DONE]") break;
    const json c = json::parse(ev)["choices"][0];
    if (c["logprobs"].is_null()) continue;
    for (const json& o : c["logprobs"]["text_offset"]) offsets.push_back(o);
  }
  EXPECT_EQ(offsets, lp["text_offset"]);
}

TEST_F(ServerTest, StreamedEchoSendsThePromptFirst) {
  start();
  const json body = {{"prompt", "The quick brown fox"},
                     {"max_tokens", 4},
                     {"temperature", 0},
                     {"ignore_eos", true},
                     {"echo", true}};
  const json whole_response = post_ok("/v1/completions", body.dump());
  ASSERT_FALSE(whole_response.is_null());
  const std::string whole = whole_response["choices"][0]["text"];
  ASSERT_EQ(whole.rfind("The quick brown fox", 0), 0u) << whole;
  json streamed = body;
  streamed["stream"] = true;
  const auto evs = events(stream("/v1/completions", streamed.dump()));
  ASSERT_GE(evs.size(), 2u);
  EXPECT_EQ(json::parse(evs[0])["choices"][0]["text"], "The quick brown fox");
  std::string text;
  for (const std::string& ev : evs) {
    if (ev != "[DONE]") text += json::parse(ev)["choices"][0]["text"].get<std::string>();
  }
  EXPECT_EQ(text, whole);
}

// The logprobs lists of a completion's stream chunks, put together.
json streamed_logprobs(const std::vector<std::string>& evs) {
  json all = {{"tokens", json::array()},
              {"token_logprobs", json::array()},
              {"top_logprobs", json::array()},
              {"text_offset", json::array()}};
  for (const std::string& ev : evs) {
    if (ev == "[DONE]") break;
    const json lp = json::parse(ev)["choices"][0]["logprobs"];
    if (lp.is_null()) continue;
    for (const char* key : {"tokens", "token_logprobs", "top_logprobs", "text_offset"}) {
      for (const json& v : lp[key]) all[key].push_back(v);
    }
  }
  return all;
}

// vLLM's echo with logprobs: the prompt's tokens lead the logprobs, the first with a null logprob
// and null top_logprobs, each other with its logprob and `logprobs` top alternatives plus itself
// (prompted in chunks: the prompt is longer than the 7 positions with logits a step of 8 rows
// holds); text_offsets run from 0 through the prompt into the output. Streamed, the echo chunk
// carries the prompt's logprobs, and the chunks' lists put together equal the whole response's.
TEST_F(ServerTest, EchoWithLogprobsScoresThePromptTokensAsVllmDoes) {
  start();
  const std::string prompt = "The quick brown fox jumps over the lazy dog, and then it naps";
  const std::vector<int32_t> ids = tokenizer_->encode(prompt);
  ASSERT_GT(ids.size(), 8u);
  const json body = {{"model", "tiny"},  {"prompt", prompt},   {"max_tokens", 4},
                     {"temperature", 0}, {"ignore_eos", true}, {"logprobs", 2},
                     {"echo", true}};
  const json choice_response = post_ok("/v1/completions", body.dump());
  ASSERT_FALSE(choice_response.is_null());
  const json choice = choice_response["choices"][0];
  const json lp = choice["logprobs"];
  ASSERT_EQ(lp["tokens"].size(), ids.size() + 4) << lp;
  ASSERT_EQ(lp["token_logprobs"].size(), ids.size() + 4);
  ASSERT_EQ(lp["top_logprobs"].size(), ids.size() + 4);
  for (size_t k = 0; k < ids.size(); ++k) {
    EXPECT_EQ(lp["tokens"][k], tokenizer_->decode(std::vector<int32_t>{ids[k]})) << k;
  }
  EXPECT_TRUE(lp["token_logprobs"][0].is_null()) << lp;
  EXPECT_TRUE(lp["top_logprobs"][0].is_null()) << lp;
  for (size_t k = 1; k < ids.size() + 4; ++k) {
    ASSERT_TRUE(lp["token_logprobs"][k].is_number()) << "token " << k << ": " << lp;
    EXPECT_LE(lp["token_logprobs"][k].get<double>(), 0.0);
    const json& top = lp["top_logprobs"][k];
    ASSERT_TRUE(top.is_object()) << "token " << k;
    EXPECT_GE(top.size(), 1u);
    EXPECT_LE(top.size(), 3u);  // the 2 alternatives asked, and the token itself when not one
    const std::string token = lp["tokens"][k].get<std::string>();
    ASSERT_TRUE(top.contains(token)) << "token " << k << ": " << top;
    EXPECT_EQ(top[token], lp["token_logprobs"][k]) << "token " << k;
    double best = -INFINITY;
    for (const auto& [text, l] : top.items()) best = std::max(best, l.get<double>());
    EXPECT_GE(best, lp["token_logprobs"][k].get<double>() - 1e-6) << "token " << k;
  }
  expect_text_offsets(lp, 0);
  EXPECT_EQ(lp["text_offset"][ids.size()], chars_of(prompt));
  EXPECT_EQ(choice["text"].get<std::string>().rfind(prompt, 0), 0u);

  json streamed = body;
  streamed["stream"] = true;
  const auto evs = events(stream("/v1/completions", streamed.dump()));
  ASSERT_GE(evs.size(), 2u);
  const json first = json::parse(evs[0])["choices"][0];
  EXPECT_EQ(first["text"], prompt);
  ASSERT_TRUE(first["logprobs"].is_object()) << evs[0];
  EXPECT_EQ(first["logprobs"]["tokens"].size(), ids.size()) << evs[0];
  EXPECT_EQ(streamed_logprobs(evs), lp);

  // Without echo, the logprobs are the output's only.
  json plain = body;
  plain.erase("echo");
  const json plain_lp_response = post_ok("/v1/completions", plain.dump());
  ASSERT_FALSE(plain_lp_response.is_null());
  const json plain_lp = plain_lp_response["choices"][0]["logprobs"];
  ASSERT_EQ(plain_lp["tokens"].size(), 4u);
  for (size_t k = 0; k < 4; ++k) {
    EXPECT_EQ(plain_lp["token_logprobs"][k], lp["token_logprobs"][ids.size() + k]) << k;
  }
}

TEST_F(ServerTest, EchoWithLogprobsOnAnEngineOfOneSequenceAStepIs400) {
  start({}, 256, /*seqs=*/1);
  const json body = {{"model", "tiny"},
                     {"prompt", "The quick brown fox"},
                     {"max_tokens", 2},
                     {"logprobs", 1},
                     {"echo", true}};
  auto res = post("/v1/completions", body.dump());
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 400) << res->body;
  EXPECT_EQ(json::parse(res->body)["error"]["message"],
            "prompt_logprobs need max_num_seqs >= 2 (a prompt position's logits take a row of the "
            "step besides its own), got 1");
}

TEST_F(ServerTest, CompletionsWithoutMaxTokensGenerateSixteenTokens) {
  start();
  const json j = post_ok("/v1/completions",
                         R"({"prompt":"The quick brown fox","temperature":0,"ignore_eos":true})");
  ASSERT_FALSE(j.is_null());
  EXPECT_EQ(j["usage"]["completion_tokens"], 16);
  EXPECT_EQ(j["choices"][0]["finish_reason"], "length");
}

// Prefix caching: a repeated prompt's usage names the prompt tokens its full KV pages served,
// /metrics counts the queries and hits, and POST /reset_prefix_cache drops the cache.
TEST_F(ServerTest, ARepeatedPromptReportsCachedTokensUntilTheCacheIsReset) {
  start();
  std::string prompt;
  for (int i = 0; i < 6; ++i) prompt += "The quick brown fox jumps over the lazy dog. ";
  const std::string body = json{{"prompt", prompt}, {"max_tokens", 2}, {"temperature", 0}}.dump();
  auto cached_tokens = [&]() -> int64_t {
    auto res = post("/v1/completions", body);
    if (!res || res->status != 200) {
      ADD_FAILURE() << (res ? res->body : "no response");
      return -1;
    }
    const json usage = json::parse(res->body)["usage"];
    EXPECT_GT(usage["prompt_tokens"].get<int64_t>(), 32) << usage;
    return usage["prompt_tokens_details"]["cached_tokens"].get<int64_t>();
  };
  EXPECT_EQ(cached_tokens(), 0);
  const int64_t hit = cached_tokens();
  EXPECT_GE(hit, 32);
  EXPECT_EQ(hit % 16, 0) << "whole pages of 16 tokens";
  auto metrics = client().Get("/metrics");
  ASSERT_TRUE(metrics);
  EXPECT_NE(metrics->body.find("simpler:prefix_cache_hits_total{model_name=\"tiny\"} " +
                               std::to_string(hit)),
            std::string::npos)
      << metrics->body.substr(0, 4000);
  EXPECT_NE(metrics->body.find("simpler:prefix_cache_queries_total"), std::string::npos);
  auto reset = post("/reset_prefix_cache", "");
  ASSERT_TRUE(reset);
  EXPECT_EQ(reset->status, 200) << reset->body;
  EXPECT_EQ(cached_tokens(), 0);
  auto get = client().Get("/reset_prefix_cache");
  ASSERT_TRUE(get);
  EXPECT_EQ(get->status, 405);
}

TEST_F(ServerTest, ChatGivesUpToTwentyTopLogprobsPerToken) {
  start();
  const json content_response =
      post_ok("/v1/chat/completions",
              R"({"messages":[{"role":"user","content":"Hi"}],"max_tokens":3,
                      "temperature":0,"ignore_eos":true,"logprobs":true,"top_logprobs":20})");
  ASSERT_FALSE(content_response.is_null());
  const json content = content_response["choices"][0]["logprobs"]["content"];
  ASSERT_EQ(content.size(), 3u) << content;
  for (const json& entry : content) EXPECT_EQ(entry["top_logprobs"].size(), 20u) << entry;
}

TEST_F(ServerTest, ErrorsAreOpenAiErrorObjectsWithTheirStatus) {
  ServerOptions so;
  so.api_key = "sekrit";
  so.max_body_bytes = 4096;
  start(so);
  const httplib::Headers auth = {{"Authorization", "Bearer sekrit"}};
  auto code = [](const httplib::Result& r) { return r ? r->status : -1; };
  auto error_of = [](const httplib::Result& r) {
    const json j = json::parse(r->body, nullptr, false);
    EXPECT_TRUE(!j.is_discarded() && j.contains("error")) << r->body;
    return j.is_discarded() ? json() : j["error"];
  };
  auto r = post("/v1/completions", R"({"prompt":"x"})");
  EXPECT_EQ(code(r), 401);
  EXPECT_EQ(error_of(r)["type"], "authentication_error");
  EXPECT_EQ(code(post("/v1/completions", R"({"prompt":"x"})", {{"Authorization", "Bearer no"}})),
            401);
  r = post("/v1/completions", R"({"prompt":"x","max_tokens":-1})", auth);
  EXPECT_EQ(code(r), 400);
  EXPECT_EQ(error_of(r)["param"], "max_tokens");
  r = post("/v1/completions", R"({"prompt":"x",)", auth);
  EXPECT_EQ(code(r), 400);
  r = post("/v1/completions", R"({"prompt":"x","temperature":-1})", auth);
  EXPECT_EQ(code(r), 400);
  EXPECT_NE(error_of(r)["message"].get<std::string>().find("temperature"), std::string::npos);
  r = post("/v1/completions", R"({"prompt":"x","model":"other"})", auth);
  EXPECT_EQ(code(r), 404);
  EXPECT_EQ(error_of(r)["code"], "model_not_found");
  r = post("/tokenize", R"({"prompt":"x","model":"other"})", auth);
  EXPECT_EQ(code(r), 404) << (r ? r->body : "no response");
  EXPECT_EQ(error_of(r)["code"], "model_not_found");
  EXPECT_EQ(code(post("/tokenize", R"({"prompt":"x","model":"tiny"})", auth)), 200);
  r = post("/detokenize", R"({"tokens":[1],"model":"other"})", auth);
  EXPECT_EQ(code(r), 404) << (r ? r->body : "no response");
  EXPECT_EQ(error_of(r)["code"], "model_not_found");
  EXPECT_EQ(code(post("/detokenize", R"({"tokens":[1],"model":"tiny"})", auth)), 200);
  r = post("/v1/completions", json{{"prompt", "x"}, {"max_tokens", 5000}}.dump(), auth);
  EXPECT_EQ(code(r), 400);
  EXPECT_NE(error_of(r)["message"].get<std::string>().find("maximum context length is 4096"),
            std::string::npos)
      << r->body;
  r = post("/v1/nope", "{}", auth);
  EXPECT_EQ(code(r), 404);
  auto c = client();
  r = c.Get("/v1/completions", auth);
  EXPECT_EQ(code(r), 405) << (r ? r->body : "no response");
  r = post("/v1/completions", std::string(5000, ' '), auth);
  EXPECT_EQ(code(r), 413);
  r = c.Get("/v1/models", auth);
  ASSERT_EQ(code(r), 200);
  EXPECT_EQ(json::parse(r->body)["data"][0]["id"], "tiny");
  EXPECT_EQ(code(c.Get("/health")), 200);
  // A good request still works next to all that.
  r = post("/v1/completions", R"({"prompt":"x","max_tokens":2})", auth);
  EXPECT_EQ(code(r), 200) << r->body;
}

TEST_F(ServerTest, AChunkedBodyIsReadUpToTheBodyLimit) {
  ServerOptions so;
  so.max_body_bytes = 4096;
  start(so);
  auto chunked = [&](const std::string& body) {
    auto c = client();
    return c.Post(
        "/v1/completions",
        [body](size_t, httplib::DataSink& sink) {
          for (size_t at = 0; at < body.size(); at += 1000) {
            sink.write(body.data() + at, std::min<size_t>(1000, body.size() - at));
          }
          sink.done();
          return true;
        },
        "application/json");
  };
  auto r = chunked(R"({"prompt":"The quick brown fox","max_tokens":2,"temperature":0})");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200) << r->body;
  EXPECT_EQ(json::parse(r->body)["usage"]["completion_tokens"], 2);
  r = chunked(R"({"prompt":")" + std::string(5000, 'a') + R"("})");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 413) << r->body;
  EXPECT_EQ(json::parse(r->body)["error"]["code"], "payload_too_large");
}

TEST(LoopbackHostTest, NamesOnlyThisMachine) {
  for (const char* h :
       {"127.0.0.1", "127.1.2.3", "localhost", "LocalHost", "::1", "[::1]", "::ffff:127.0.0.1"}) {
    EXPECT_TRUE(is_loopback_host(h)) << h;
  }
  for (const char* h : {"0.0.0.0", "::", "[::]", "192.168.1.10", "10.0.0.1", "128.0.0.1",
                        "example.com", "", "::ffff:10.0.0.1"}) {
    EXPECT_FALSE(is_loopback_host(h)) << h;
  }
}

TEST(ExposureWarningTest, WarnsOfANonLoopbackHostWithoutAnApiKeyOnly) {
  ServerOptions o;
  o.host = "0.0.0.0";
  EXPECT_EQ(exposure_warning(o, 8000).value_or(""),
            "serving on http://0.0.0.0:8000/v1 without an API key: anyone who can reach it can "
            "use the model (set --api-key or SIMPLER_API_KEY)");
  o.host = "::";
  EXPECT_NE(exposure_warning(o, 1).value_or("").find("http://[::]:1/v1"), std::string::npos);
  o.api_key = "k";
  EXPECT_FALSE(exposure_warning(o, 8000).has_value());
  o.api_key.clear();
  o.host = "127.0.0.1";
  EXPECT_FALSE(exposure_warning(o, 8000).has_value());
}

TEST(RequestIdTest, APrintableBoundedIdIsKeptAndAnyOtherReplaced) {
  EXPECT_EQ(request_id_for("my-id_1.2:3"), "my-id_1.2:3");
  EXPECT_EQ(request_id_for(std::string(128, 'a')), std::string(128, 'a'));
  const std::regex generated("req-[0-9a-f]{20}");
  for (const std::string& bad :
       {std::string(), std::string(129, 'a'), std::string("a b"), std::string("tab\there"),
        std::string("\x01x"), std::string("caf\xc3\xa9")}) {
    EXPECT_TRUE(std::regex_match(request_id_for(bad), generated)) << bad;
  }
  EXPECT_NE(request_id_for(""), request_id_for(""));
}

TEST(AccessLineTest, NamesMethodPathStatusTokensTimeAndId) {
  AccessRecord r{.begun = true, .start_ns = 1'000'000, .prompt_tokens = 5, .completion_tokens = 16};
  EXPECT_EQ(access_line("POST", "/v1/completions", 200, r, 13'345'678, "req-1"),
            "POST /v1/completions 200 prompt_tokens=5 completion_tokens=16 ms=12.3 "
            "request_id=req-1");
  r.client_disconnected = true;
  EXPECT_EQ(access_line("POST", "/v1/completions", 200, r, 13'345'678, "req-1"),
            "POST /v1/completions 200 prompt_tokens=5 completion_tokens=16 ms=12.3 "
            "request_id=req-1 client_disconnected");
  // Unknown counts are '-'; a line stays one line and bounded whatever the path holds.
  EXPECT_EQ(access_line("GET", "/a b\r\nc", 404, AccessRecord{}, 99, "x"),
            "GET /a?b??c 404 prompt_tokens=- completion_tokens=- ms=0.0 request_id=x");
  EXPECT_EQ(access_line("GET", std::string(300, 'p'), 404, AccessRecord{}, 0, "x"),
            "GET " + std::string(100, 'p') +
                " 404 prompt_tokens=- completion_tokens=- ms=0.0 request_id=x");
}

TEST_F(ServerTest, ModelByIdIsTheListEntryAndAnotherIdIs404) {
  ServerOptions so;
  so.served_model_name = "org/tiny";  // an id with a slash (Hugging Face names)
  start(so);
  auto c = client();
  auto list = c.Get("/v1/models");
  auto one = c.Get("/v1/models/org/tiny");
  ASSERT_TRUE(list && one);
  ASSERT_EQ(one->status, 200) << one->body;
  json entry = json::parse(list->body)["data"][0], got = json::parse(one->body);
  entry.erase("created");
  ASSERT_TRUE(got.contains("created"));
  got.erase("created");
  EXPECT_EQ(got, entry);
  for (const char* path : {"/v1/models/tiny", "/v1/models/org/tiny/x", "/v1/models/org%2Fother"}) {
    auto r = c.Get(path);
    ASSERT_TRUE(r) << path;
    EXPECT_EQ(r->status, 404) << path;
    const json e = json::parse(r->body)["error"];
    EXPECT_EQ(e["code"], "model_not_found") << path;
    EXPECT_EQ(e["type"], "invalid_request_error") << path;
  }
  auto post = c.Post("/v1/models/org/tiny", "{}", "application/json");
  ASSERT_TRUE(post);
  EXPECT_EQ(post->status, 405) << post->body;
}

TEST_F(ServerTest, EveryResponseCarriesTheRequestIdSentOrANewOne) {
  ServerOptions so;
  so.api_key = "k";
  start(so);
  const httplib::Headers auth = {{"Authorization", "Bearer k"}};
  const std::regex generated("req-[0-9a-f]{20}");
  auto c = client();
  auto with = [&](httplib::Headers h, const std::string& id) {
    h.emplace("X-Request-Id", id);
    return h;
  };
  const std::string body = R"({"prompt":"x","max_tokens":2})";
  // Kept: a plain response, an error before routing (411), a handler's errors (401, 400), 404.
  auto ok = c.Post("/v1/completions", with(auth, "id-ok"), body, "application/json");
  auto unauth = c.Post("/v1/completions", with({}, "id-401"), body, "application/json");
  auto bad = c.Post("/v1/completions", with(auth, "id-400"), "{", "application/json");
  auto nope = c.Get("/nope", with({}, "id-404"));
  ASSERT_TRUE(ok && unauth && bad && nope);
  EXPECT_EQ(ok->status, 200);
  EXPECT_EQ(ok->get_header_value("X-Request-Id"), "id-ok");
  EXPECT_EQ(unauth->status, 401);
  EXPECT_EQ(unauth->get_header_value("X-Request-Id"), "id-401");
  EXPECT_EQ(bad->status, 400);
  EXPECT_EQ(bad->get_header_value("X-Request-Id"), "id-400");
  EXPECT_EQ(nope->status, 404);
  EXPECT_EQ(nope->get_header_value("X-Request-Id"), "id-404");
  // A stream carries it too.
  httplib::Request sreq =
      json_post("/v1/completions", R"({"prompt":"x","max_tokens":3,"stream":true})");
  sreq.headers.emplace("Authorization", "Bearer k");
  sreq.headers.emplace("X-Request-Id", "id-stream");
  std::string raw;
  sreq.content_receiver = [&](const char* d, size_t n, uint64_t, uint64_t) {
    raw.append(d, n);
    return true;
  };
  auto streamed = c.send(sreq);
  ASSERT_TRUE(streamed);
  EXPECT_EQ(streamed->status, 200);
  EXPECT_EQ(streamed->get_header_value("X-Request-Id"), "id-stream");
  EXPECT_NE(raw.find("data: [DONE]"), std::string::npos);
  // Replaced: none, too long, not printable ASCII; each new one differs.
  std::set<std::string> ids;
  for (const std::string& sent : {std::string(), std::string(129, 'a'), std::string("a b c")}) {
    auto r = sent.empty() ? c.Get("/v1/models", auth) : c.Get("/v1/models", with(auth, sent));
    ASSERT_TRUE(r);
    const std::string id = r->get_header_value("X-Request-Id");
    EXPECT_TRUE(std::regex_match(id, generated)) << sent << " -> " << id;
    ids.insert(id);
  }
  EXPECT_EQ(ids.size(), 3u);
}

TEST_F(ServerTest, CorsAnswersAllowedOriginsOnlyAndTheirPreflights) {
  ServerOptions so;
  so.api_key = "k";
  so.allowed_origins = {"http://a.example", "http://b.example:8080"};
  start(so);
  auto c = client();
  const httplib::Headers auth = {{"Authorization", "Bearer k"}};
  auto get = [&](const std::string& origin, bool with_key) {
    httplib::Headers h = with_key ? auth : httplib::Headers{};
    if (!origin.empty()) h.emplace("Origin", origin);
    return c.Get("/v1/models", h);
  };
  for (bool with_key : {true, false}) {  // an error (401) carries them too
    auto r = get("http://b.example:8080", with_key);
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, with_key ? 200 : 401);
    EXPECT_EQ(r->get_header_value("Access-Control-Allow-Origin"), "http://b.example:8080");
    EXPECT_EQ(r->get_header_value("Vary"), "Origin");
    EXPECT_EQ(r->get_header_value("Access-Control-Expose-Headers"), "X-Request-Id, Retry-After");
  }
  for (const std::string origin : {"http://evil.example", "http://a.example:81", ""}) {
    auto r = get(origin, true);
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 200);
    EXPECT_FALSE(r->has_header("Access-Control-Allow-Origin")) << origin;
  }
  auto preflight = [&](const std::string& origin) {
    return c.Options("/v1/chat/completions",
                     {{"Origin", origin},
                      {"Access-Control-Request-Method", "POST"},
                      {"Access-Control-Request-Headers", "authorization, content-type"}});
  };
  auto yes = preflight("http://a.example");  // no API key needed
  ASSERT_TRUE(yes);
  EXPECT_EQ(yes->status, 204);
  EXPECT_EQ(yes->get_header_value("Access-Control-Allow-Origin"), "http://a.example");
  EXPECT_EQ(yes->get_header_value("Access-Control-Allow-Methods"), "GET, POST, OPTIONS");
  EXPECT_EQ(yes->get_header_value("Access-Control-Allow-Headers"),
            "Authorization, Content-Type, X-Request-Id");
  EXPECT_EQ(yes->get_header_value("Access-Control-Max-Age"), "600");
  auto no = preflight("http://evil.example");
  ASSERT_TRUE(no);
  EXPECT_EQ(no->status, 403);
  EXPECT_EQ(json::parse(no->body)["error"]["code"], "cors_origin_not_allowed");
  EXPECT_FALSE(no->has_header("Access-Control-Allow-Origin"));
  EXPECT_FALSE(no->has_header("Access-Control-Allow-Methods"));
  // OPTIONS that is not a preflight is not a method of the route.
  auto plain = c.Options("/v1/models");
  ASSERT_TRUE(plain);
  EXPECT_EQ(plain->status, 405);
}

TEST_F(ServerTest, CorsWithAWildcardAllowsAnyOriginAndWithoutOriginsNone) {
  ServerOptions so;
  so.allowed_origins = {"*"};
  start(so);
  auto r = client().Get("/v1/models", {{"Origin", "http://anything.example"}});
  ASSERT_TRUE(r);
  EXPECT_EQ(r->get_header_value("Access-Control-Allow-Origin"), "*");
  EXPECT_FALSE(r->has_header("Vary"));
  TearDown();
  start({});  // the default: no CORS at all
  auto c = client();
  auto plain = c.Get("/v1/models", {{"Origin", "http://anything.example"}});
  auto pre = c.Options("/v1/models", {{"Origin", "http://anything.example"},
                                      {"Access-Control-Request-Method", "GET"}});
  ASSERT_TRUE(plain && pre);
  EXPECT_FALSE(plain->has_header("Access-Control-Allow-Origin"));
  EXPECT_EQ(pre->status, 403);
  EXPECT_FALSE(pre->has_header("Access-Control-Allow-Origin"));
}

TEST_F(ServerTest, TheAccessLogHasOneLinePerResponseWithTokensTimeAndId) {
  start_with_access_log(64);
  // The logger runs once a response is written, after the client may have read it: each line is
  // awaited before the next request, whose line would otherwise come first.
  std::vector<std::string> lines;
  auto logged = [&](size_t n) {
    return simpler::testing::eventually(
        [&] {
          lines = access_lines();
          return lines.size() >= n;
        },
        std::chrono::seconds(10));
  };
  auto c = client();
  auto done = c.Post("/v1/completions", {{"X-Request-Id", "log-1"}},
                     R"({"prompt":"x","max_tokens":4,"ignore_eos":true})", "application/json");
  ASSERT_TRUE(done);
  EXPECT_EQ(done->status, 200);
  const int64_t prompt = json::parse(done->body)["usage"]["prompt_tokens"].get<int64_t>();
  ASSERT_TRUE(logged(1));
  const std::string streamed = stream(
      "/v1/chat/completions",
      R"({"messages":[{"role":"user","content":"Hi"}],"max_tokens":3,"ignore_eos":true,"stream":true})");
  EXPECT_NE(streamed.find("[DONE]"), std::string::npos);
  ASSERT_TRUE(logged(2));
  auto missing = c.Get("/v1/models/other", {{"X-Request-Id", "log-3"}});
  ASSERT_TRUE(missing);
  ASSERT_TRUE(logged(3));
  ASSERT_EQ(lines.size(), 3u);
  EXPECT_EQ(
      lines[0].substr(0, lines[0].find(" ms=")),
      "POST /v1/completions 200 prompt_tokens=" + std::to_string(prompt) + " completion_tokens=4");
  EXPECT_TRUE(std::regex_match(lines[0], std::regex(".* ms=[0-9]+\\.[0-9] request_id=log-1")))
      << lines[0];
  EXPECT_TRUE(std::regex_match(
      lines[1], std::regex("POST /v1/chat/completions 200 prompt_tokens=[1-9][0-9]* "
                           "completion_tokens=3 ms=[0-9]+\\.[0-9] request_id=req-[0-9a-f]{20}")))
      << lines[1];
  EXPECT_TRUE(std::regex_match(
      lines[2], std::regex("GET /v1/models/other 404 prompt_tokens=- completion_tokens=- "
                           "ms=[0-9]+\\.[0-9] request_id=log-3")))
      << lines[2];
}

// A client that leaves a stream mid-way: its access line counts the tokens sent until then (at
// least those the client read, fewer than asked) and says the client disconnected.
TEST_F(ServerTest, TheAccessLineOfAStreamCutByItsClientCountsTheTokensSent) {
  start_with_access_log(8);
  // logprobs: every chunk of output lists its tokens, so the client can count what it read.
  const std::string raw =
      stream("/v1/chat/completions",
             R"({"messages":[{"role":"user","content":"Hi"}],"max_tokens":400,"ignore_eos":true,)"
             R"("logprobs":true,"stream":true})",
             nullptr, /*leave_after=*/4);
  int64_t read = 0;
  for (const std::string& ev : events(raw.substr(0, raw.rfind("\n\n") + 2))) {
    const json chunk = json::parse(ev);
    const json& lp = chunk["choices"][0]["logprobs"];
    if (lp.is_object()) read += static_cast<int64_t>(lp["content"].size());
  }
  ASSERT_GT(read, 0) << raw;
  std::string line;
  ASSERT_TRUE(simpler::testing::eventually(
      [&] {
        const std::vector<std::string> lines = access_lines();
        if (!lines.empty()) line = lines.back();
        return !lines.empty();
      },
      std::chrono::seconds(10)))
      << "no access line";
  std::smatch m;
  ASSERT_TRUE(std::regex_match(
      line, m,
      std::regex(
          "POST /v1/chat/completions 200 prompt_tokens=[1-9][0-9]* completion_tokens=([0-9]+) "
          "ms=[0-9]+\\.[0-9] request_id=req-[0-9a-f]{20} client_disconnected")))
      << line;
  const int64_t sent = std::stoll(m[1].str());
  EXPECT_GE(sent, read) << line;
  EXPECT_LT(sent, 400) << line;
}

TEST_F(ServerTest, AFullWaitingQueueIs429) {
  start({}, /*max_waiting=*/1, /*seqs=*/1);
  // One running, one waiting: the third is refused. 100 tokens each hold the engine far longer
  // than the third request takes to arrive, and the two still finish within the client's read
  // timeout under ThreadSanitizer on a loaded machine (300 did not: 61 s).
  std::vector<std::thread> clients;
  std::atomic<int> ok{0};
  for (int i = 0; i < 2; ++i) {
    clients.emplace_back([&] {
      auto r = post("/v1/completions",
                    R"({"prompt":"x","max_tokens":100,"ignore_eos":true,"temperature":0})");
      if (r && r->status == 200) ++ok;
    });
    // Until the engine holds it (a fixed pause was too short under ThreadSanitizer on a loaded
    // machine: the second client arrived before the first was admitted).
    EXPECT_TRUE(simpler::testing::eventually(
        [&] {
          const llm::EngineMetrics m = engine_->metrics();
          return m.requests_running + m.requests_waiting >= i + 1;
        },
        std::chrono::seconds(20)));
  }
  auto r = post("/v1/completions", R"({"prompt":"y","max_tokens":2})");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 429) << r->body;
  EXPECT_EQ(json::parse(r->body)["error"]["type"], "rate_limit_error");
  EXPECT_EQ(r->get_header_value("Retry-After"), std::to_string(kRetryAfterSeconds));
  EXPECT_EQ(kRetryAfterSeconds, 1);
  for (auto& t : clients) t.join();
  EXPECT_EQ(ok.load(), 2);
}

// A client that goes away mid-stream aborts its request; the others complete; every page is
// free at the end and nothing is running.
TEST_F(ServerTest, ClientsDisconnectingMidStreamAbortTheirRequestsOnly) {
  start({}, 256, 8, 256);
  constexpr int kClients = 12;
  std::vector<std::thread> threads;
  std::atomic<int> completed{0}, cut{0};
  for (int i = 0; i < kClients; ++i) {
    threads.emplace_back([&, i] {
      const bool leave = i % 3 == 0;
      auto c = client();
      httplib::Request req =
          json_post("/v1/completions", json{{"prompt", "client " + std::to_string(i)},
                                            {"max_tokens", leave ? 400 : 16},
                                            {"ignore_eos", true},
                                            {"stream", true}}
                                           .dump());
      std::string raw;
      int chunks = 0;
      req.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
        raw.append(data, n);
        return !(leave && ++chunks >= 3);  // false: close the connection
      };
      auto res = c.send(req);
      if (leave) {
        ++cut;
      } else if (res && res->status == 200 && raw.size() > 13 &&
                 raw.compare(raw.size() - 14, 14, "data: [DONE]\n\n") == 0) {
        ++completed;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(completed.load(), kClients - kClients / 3);
  // The aborted requests leave within a few steps.
  llm::EngineMetrics m;
  EXPECT_TRUE(simpler::testing::eventually([&] {
    m = engine_->metrics();
    return m.requests_running == 0 && m.requests_waiting == 0 &&
           m.kv_pages.free == m.kv_pages_total;
  }));
  EXPECT_EQ(m.requests_running, 0);
  EXPECT_EQ(m.kv_pages.free, m.kv_pages_total);
  EXPECT_EQ(m.requests_finished_abort, kClients / 3);
  auto metrics = client().Get("/metrics");
  ASSERT_TRUE(metrics);
  EXPECT_NE(metrics->body.find("simpler:num_requests_running{model_name=\"tiny\"} 0"),
            std::string::npos);
}

// 16 concurrent greedy completions of distinct prompts: each gets exactly what it gets alone.
TEST_F(ServerTest, ConcurrentGreedyCompletionsEqualTheirSoloResults) {
  start();
  std::vector<std::string> prompts;
  for (int i = 0; i < 16; ++i) prompts.push_back("prompt number " + std::to_string(i * 7919));
  auto body = [](const std::string& p) {
    return json{{"prompt", p}, {"max_tokens", 8}, {"temperature", 0}, {"ignore_eos", true}}.dump();
  };
  std::vector<std::string> solo;
  for (const auto& p : prompts) {
    auto r = post("/v1/completions", body(p));
    ASSERT_TRUE(r && r->status == 200);
    solo.push_back(json::parse(r->body)["choices"][0]["text"]);
  }
  std::vector<std::string> together(prompts.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < prompts.size(); ++i) {
    threads.emplace_back([&, i] {
      auto r = post("/v1/completions", body(prompts[i]));
      if (r && r->status == 200) {
        together[i] = json::parse(r->body)["choices"][0]["text"];
      } else {
        together[i] = r ? "HTTP " + std::to_string(r->status) + " " + r->body
                        : "no response: " + httplib::to_string(r.error());
      }
    });
  }
  for (auto& t : threads) t.join();
  for (size_t i = 0; i < prompts.size(); ++i) {
    EXPECT_EQ(together[i], solo[i]) << "prompt " << i << ": " << prompts[i];
  }
}

// Shutdown with streams in flight: new requests get 503, the running streams end with
// finish_reason "abort" and [DONE] (drain deadline already passed), and the listener stops.
TEST_F(ServerTest, ShutdownEndsOpenStreamsCleanly) {
  start();
  std::vector<std::thread> threads;
  std::vector<std::string> raws(3);
  std::atomic<int> started{0};
  for (int i = 0; i < 3; ++i) {
    threads.emplace_back([&, i] {
      raws[i] = stream("/v1/completions",
                       json{{"prompt", "long " + std::to_string(i)},
                            {"max_tokens", 2000},
                            {"ignore_eos", true},
                            {"stream", true}}
                           .dump(),
                       nullptr, 0, &started);
    });
  }
  // Shut down once every stream has started (a request still queued when the server shuts
  // down gets a 503 instead, as documented: a slow sanitizer build admits them late).
  EXPECT_TRUE(
      simpler::testing::eventually([&] { return started.load() >= 3; }, std::chrono::seconds(60)));
  EXPECT_EQ(started.load(), 3);
  const int64_t t0 = base::now_ns();
  EXPECT_TRUE(server_->shutdown(base::Deadline::after(std::chrono::milliseconds(100))).ok());
  EXPECT_LT((base::now_ns() - t0) / 1e9, 10.0);
  for (auto& t : threads) t.join();
  for (const std::string& raw : raws) {
    const auto evs = events(raw);
    ASSERT_GE(evs.size(), 2u) << raw;
    EXPECT_EQ(evs.back(), "[DONE]");
    const json last = json::parse(evs[evs.size() - 2]);
    EXPECT_EQ(last["choices"][0]["finish_reason"], "abort") << raw.substr(raw.size() - 300);
  }
  EXPECT_TRUE(served_.get().ok());
  EXPECT_FALSE(post("/v1/completions", R"({"prompt":"x"})"));  // nobody listens any more
}

}  // namespace
}  // namespace simpler::serve
