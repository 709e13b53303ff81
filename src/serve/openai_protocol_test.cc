// Request parsing and validation, error objects and the Prometheus text (no server).
#include "simpler/serve/openai_protocol.h"

#include <string>

#include "gtest/gtest.h"

namespace simpler::serve {
namespace {

ParsedRequest ok(std::string_view body, bool chat) {
  auto r = parse_request(body, chat);
  if (auto* e = std::get_if<ApiError>(&r)) {
    ADD_FAILURE() << body << " -> " << e->to_json();
    return {};
  }
  return std::get<ParsedRequest>(r);
}

ApiError bad(std::string_view body, bool chat) {
  auto r = parse_request(body, chat);
  if (!std::holds_alternative<ApiError>(r)) {
    ADD_FAILURE() << body << " was accepted";
    return {};
  }
  return std::get<ApiError>(r);
}

TEST(ParseRequest, CompletionFieldsAndVllmExtensions) {
  ParsedRequest p = ok(
      R"({"model":"m","prompt":"hi","max_tokens":7,"temperature":0.5,"top_p":0.9,"n":2,
          "seed":-3,"stop":["a","bc"],"presence_penalty":0.1,"frequency_penalty":-0.2,
          "logprobs":3,"echo":true,"stream":true,"stream_options":{"include_usage":true},
          "user":"u","top_k":5,"min_p":0.05,"repetition_penalty":1.1,"stop_token_ids":[1,2],
          "ignore_eos":true,"min_tokens":2})",
      false);
  EXPECT_EQ(p.model, "m");
  EXPECT_EQ(std::get<std::string>(p.prompt), "hi");
  EXPECT_EQ(p.max_tokens, 7);
  EXPECT_EQ(p.n, 2);
  EXPECT_TRUE(p.stream && p.include_usage && p.echo);
  EXPECT_EQ(p.logprobs, 3);
  EXPECT_EQ(p.sampling.logprobs, 3);
  EXPECT_FLOAT_EQ(p.sampling.temperature, 0.5f);
  EXPECT_EQ(p.sampling.seed, static_cast<uint64_t>(int64_t{-3}));
  EXPECT_EQ(p.sampling.stop, (std::vector<std::string>{"a", "bc"}));
  EXPECT_EQ(p.sampling.top_k, 5);
  EXPECT_EQ(p.sampling.stop_token_ids, (std::vector<int32_t>{1, 2}));
  EXPECT_TRUE(p.sampling.ignore_eos);
  EXPECT_EQ(p.sampling.min_tokens, 2);
  EXPECT_EQ(std::get<std::vector<int64_t>>(ok(R"({"prompt":[1,2,3]})", false).prompt),
            (std::vector<int64_t>{1, 2, 3}));
  EXPECT_EQ(std::get<std::string>(ok(R"({"prompt":["one"]})", false).prompt), "one");
  EXPECT_EQ(ok(R"({"prompt":"x","stop":"s"})", false).sampling.stop,
            (std::vector<std::string>{"s"}));
  EXPECT_FALSE(ok(R"({"prompt":"x"})", false).logprobs.has_value());
}

TEST(ParseRequest, CompletionsWithoutMaxTokensGetSixteenAndChatGetsNone) {
  EXPECT_EQ(ok(R"({"prompt":"x"})", false).max_tokens, 16);
  EXPECT_EQ(ok(R"({"prompt":"x","max_tokens":100})", false).max_tokens, 100);
  EXPECT_FALSE(ok(R"({"messages":[{"role":"user","content":"x"}]})", true).max_tokens.has_value());
}

TEST(ParseRequest, UpToTwentyTopLogprobsAreAccepted) {
  EXPECT_EQ(ok(R"({"prompt":"x","logprobs":20})", false).logprobs, 20);
  EXPECT_EQ(
      ok(R"({"messages":[{"role":"user","content":"x"}],"logprobs":true,"top_logprobs":20})", true)
          .logprobs,
      20);
  const ApiError completion = bad(R"({"prompt":"x","logprobs":21})", false);
  EXPECT_EQ(completion.param, "logprobs");
  EXPECT_NE(completion.message.find("outside [0, 20]"), std::string::npos) << completion.message;
  const ApiError chat = bad(
      R"({"messages":[{"role":"user","content":"x"}],"logprobs":true,"top_logprobs":21})", true);
  EXPECT_EQ(chat.param, "top_logprobs");
  EXPECT_NE(chat.message.find("outside [0, 20]"), std::string::npos) << chat.message;
}

TEST(ParseRequest, ChatMessagesTemplateKwargsAndLogprobs) {
  ParsedRequest p = ok(
      R"({"messages":[{"role":"system","content":"s"},{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]},
          {"role":"assistant","content":"x","reasoning_content":"r"}],
          "max_completion_tokens":9,"chat_template_kwargs":{"enable_thinking":false},
          "logprobs":true,"top_logprobs":2,"response_format":{"type":"text"},"tools":[]})",
      true);
  ASSERT_EQ(p.messages.size(), 3u);
  EXPECT_EQ(p.messages[1].content, "a\nb");
  EXPECT_EQ(p.messages[2].reasoning_content, "r");
  EXPECT_EQ(p.max_tokens, 9);
  EXPECT_EQ(p.chat_options.enable_thinking, false);
  EXPECT_EQ(p.logprobs, 2);
  EXPECT_EQ(ok(R"({"messages":[{"role":"user","content":"x"}],"max_tokens":4})", true).max_tokens,
            4);
  EXPECT_FALSE(ok(R"({"messages":[{"role":"user","content":"x"}],"logprobs":false})", true)
                   .logprobs.has_value());
}

TEST(ParseRequest, BadBodiesGet400NamingTheField) {
  struct Case {
    const char* body;
    bool chat;
    const char* param;
    const char* needle;
  };
  const Case cases[] = {
      {"{", false, "", "request body"},
      {"[1]", false, "", "must be a JSON object"},
      {"{\"prompt\":\"\xff\"}", false, "", "request body"},
      {R"({"prompt":"x","max_tokens":0})", false, "max_tokens", "outside [1"},
      {R"({"prompt":"x","max_tokens":1.5})", false, "max_tokens", "must be an integer"},
      {R"({"prompt":"x","max_tokens":"7"})", false, "max_tokens", "must be an integer"},
      {R"({"prompt":"x","max_tokens":1e300})", false, "max_tokens", "must be an integer"},
      {R"({"prompt":"x","n":0})", false, "n", "outside [1, 256]"},
      {R"({"prompt":"x","temperature":"hot"})", false, "temperature", "must be a number"},
      {R"({"prompt":"x","temperature":1e39})", false, "temperature", "finite"},
      {R"({"prompt":"x","stream":1})", false, "stream", "must be a boolean"},
      {R"({"prompt":"x","stop":[1]})", false, "stop", "must be a string"},
      {R"({"prompt":"x","stop":""})", false, "stop", "1 to 256 bytes"},
      {R"({"prompt":"x","logprobs":21})", false, "logprobs", "outside [0, 20]"},
      {R"({"prompt":"x","frobnicate":1})", false, "frobnicate", "unrecognized request argument"},
      {R"({"prompt":[-1]})", false, "prompt", "token id"},
      {R"({"prompt":[1, 4294967296]})", false, "prompt", "token id"},
      {R"({"prompt":{"a":1}})", false, "prompt", "must be a string or an array of token ids"},
      {R"({"prompt":["a","b"]})", false, "prompt", "batch of prompts is not supported"},
      {R"({})", false, "prompt", "'prompt' is required"},
      {R"({"prompt":"x","suffix":"y"})", false, "suffix", "not supported"},
      {R"({"prompt":"x","stream_options":{"x":1}})", false, "stream_options", "include_usage"},
      {R"({"messages":[]})", true, "messages", "non-empty array"},
      {R"({"messages":[{"role":"tool","content":"x"}]})", true, "messages", "not supported"},
      {R"({"messages":[{"role":"user"}]})", true, "messages", "content must be a string"},
      {R"({"messages":[{"role":"user","content":"x","tool_calls":[]}]})", true, "messages",
       "tool calls are not supported"},
      {R"({"messages":[{"role":"user","content":[{"type":"image_url"}]}]})", true, "messages",
       "text part"},
      {R"({"messages":[{"role":"user","content":"x"}],"tools":[{"type":"function"}]})", true,
       "tools", "not supported"},
      {R"({"messages":[{"role":"user","content":"x"}],"response_format":{"type":"json_object"}})",
       true, "response_format", "not supported"},
      {R"({"messages":[{"role":"user","content":"x"}],"top_logprobs":2})", true, "top_logprobs",
       "needs 'logprobs': true"},
      {R"({"messages":[{"role":"user","content":"x"}],"chat_template_kwargs":{"enable_thinking":1}})",
       true, "chat_template_kwargs", "boolean"},
      {R"({"messages":[{"role":"user","content":"x"}],"echo":true})", true, "echo",
       "unrecognized request argument"},
  };
  for (const Case& c : cases) {
    const ApiError e = bad(c.body, c.chat);
    EXPECT_EQ(e.http_status, 400) << c.body;
    EXPECT_EQ(e.type, "invalid_request_error") << c.body;
    EXPECT_EQ(e.param, c.param) << c.body << " -> " << e.to_json();
    EXPECT_NE(e.message.find(c.needle), std::string::npos) << c.body << " -> " << e.message;
  }
  // Nesting beyond the bound is refused without recursion trouble.
  std::string deep(100000, '[');
  EXPECT_EQ(bad(deep, false).http_status, 400);
}

TEST(ApiError, IsOpenAisErrorObject) {
  ApiError e = bad_request("m", "p");
  EXPECT_EQ(e.to_json(),
            R"({"error":{"code":null,"message":"m","param":"p","type":"invalid_request_error"}})");
}

TEST(TokenizeBodies, PromptOrMessagesAndTokenIds) {
  auto t = parse_tokenize(R"({"prompt":"hi","add_special_tokens":false})");
  ASSERT_TRUE(std::holds_alternative<TokenizeRequest>(t));
  EXPECT_EQ(std::get<TokenizeRequest>(t).prompt, "hi");
  auto m = parse_tokenize(
      R"({"messages":[{"role":"user","content":"x"}],"add_generation_prompt":false})");
  ASSERT_TRUE(std::holds_alternative<TokenizeRequest>(m));
  EXPECT_FALSE(std::get<TokenizeRequest>(m).chat_options.add_generation_prompt);
  EXPECT_TRUE(std::holds_alternative<ApiError>(parse_tokenize(R"({"prompt":"a","messages":[]})")));
  EXPECT_TRUE(std::holds_alternative<ApiError>(parse_tokenize(R"({"prompt":3})")));
  auto d = parse_detokenize(R"({"tokens":[5,6]})");
  ASSERT_TRUE(std::holds_alternative<std::vector<int64_t>>(d));
  EXPECT_EQ(std::get<std::vector<int64_t>>(d), (std::vector<int64_t>{5, 6}));
  EXPECT_TRUE(std::holds_alternative<ApiError>(parse_detokenize(R"({"tokens":["a"]})")));
}

TEST(PrometheusText, HistogramsAreCumulativeWithInfSumAndCount) {
  llm::EngineMetrics m;
  m.time_to_first_token_s = llm::Histogram::with_bounds({0.1, 1});
  m.time_to_first_token_s.observe(0.05);
  m.time_to_first_token_s.observe(0.5);
  m.time_to_first_token_s.observe(5);
  m.kv_pages.free = 3;
  m.kv_pages_total = 4;
  const std::string text = prometheus_text(m, "my\"model");
  EXPECT_NE(text.find("# TYPE simpler:time_to_first_token_seconds histogram"), std::string::npos);
  EXPECT_NE(
      text.find(R"(simpler:time_to_first_token_seconds_bucket{model_name="my\"model",le="0.1"} 1)"),
      std::string::npos)
      << text;
  EXPECT_NE(
      text.find(R"(simpler:time_to_first_token_seconds_bucket{model_name="my\"model",le="1"} 2)"),
      std::string::npos);
  EXPECT_NE(
      text.find(
          R"(simpler:time_to_first_token_seconds_bucket{model_name="my\"model",le="+Inf"} 3)"),
      std::string::npos);
  EXPECT_NE(text.find(R"(simpler:time_to_first_token_seconds_count{model_name="my\"model"} 3)"),
            std::string::npos);
  EXPECT_NE(text.find(R"(simpler:kv_cache_pages{model_name="my\"model",state="free"} 3)"),
            std::string::npos);
}

}  // namespace
}  // namespace simpler::serve
