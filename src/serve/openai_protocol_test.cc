// Request parsing and validation, error objects and the Prometheus text (no server).
#include "simpler/serve/openai_protocol.h"

#include <string>

#include "gtest/gtest.h"
#include "simpler/grammar/json_schema.h"

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
      {R"({"messages":[{"role":"function","content":"x"}]})", true, "messages", "not supported"},
      {R"({"messages":[{"role":"user"}]})", true, "messages", "content must be a string"},
      {R"({"messages":[{"role":"user","content":"x","tool_calls":[]}]})", true, "messages",
       "messages[0].tool_calls is only allowed on assistant messages"},
      {R"({"messages":[{"role":"user","content":[{"type":"image_url"}]}]})", true, "messages",
       "text part"},
      {R"({"messages":[{"role":"user","content":"x"}],"tools":[{"type":"function"}]})", true,
       "tools", "tools[0] must be {\"type\": \"function\", \"function\": {...}}"},
      {R"({"messages":[{"role":"user","content":"x"}],"response_format":{"type":"xml"}})", true,
       "response_format", "'response_format' must be {\"type\": \"text\"}"},
      {R"({"prompt":"x","response_format":{"type":"json_schema","json_schema":{"name":"a",
          "schema":{"type":"string","pattern":"^a+$"}}}})",
       false, "response_format",
       "'response_format': unsupported JSON Schema keyword 'pattern' at #"},
      {R"({"prompt":"x","response_format":{"type":"json_schema","json_schema":{"schema":{}}}})",
       false, "response_format", "needs 'json_schema': {\"name\""},
      {R"({"prompt":"x","response_format":{"type":"json_schema","json_schema":{"name":"a",
          "schema":{},"extra":1}}})",
       false, "response_format", "unknown field 'extra'"},
      {R"({"prompt":"x","guided_json":{"type":"object","properties":{"a":{"minLength":1}}}})",
       false, "guided_json",
       "'guided_json': unsupported JSON Schema keyword 'minLength' at #/properties/a"},
      {R"({"prompt":"x","guided_json":{"type":"array","minItems":2,"maxItems":1}})", false,
       "guided_json", "language is empty"},
      {R"({"prompt":"x","guided_choice":["a",1]})", false, "guided_choice", "array of strings"},
      {R"({"prompt":"x","guided_choice":[]})", false, "guided_choice", "at least one choice"},
      {R"({"prompt":"x","guided_choice":["a"],"guided_json":{}})", false, "guided_json",
       "at most one of"},
      {R"({"prompt":"x","guided_regex":"a(b"})", false, "guided_regex",
       "'guided_regex': invalid regular expression: missing closing parenthesis at byte offset 3"},
      {R"({"prompt":"x","guided_regex":"(a)\\1"})", false, "guided_regex",
       "'guided_regex': unsupported regular expression construct: backreference \\1 at byte "
       "offset 3"},
      {R"({"prompt":"x","guided_regex":["a"]})", false, "guided_regex",
       "'guided_regex' must be a string"},
      {R"({"prompt":"x","guided_grammar":"root ::= foo"})", false, "guided_grammar",
       "'guided_grammar': rule 'foo' is used at 1:10 but never defined"},
      {R"({"prompt":"x","grammar":"root ::= \"a"})", false, "grammar",
       "'grammar': unterminated string literal at 1:10"},
      {R"({"prompt":"x","grammar":"root ::= \"a\"","guided_regex":"a"})", false, "guided_regex",
       "at most one of"},
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

constexpr const char* kTwoTools =
    R"("tools":[{"type":"function","function":{"parameters":{"type":"object","properties":
        {"unit":{"enum":["c","f"]},"city":{"type":"string"}}},"name":"get_weather",
        "description":"Weather"}},{"function":{"name":"now"},"type":"function"}])";

std::string chat_with(const std::string& rest) {
  return std::string(R"({"messages":[{"role":"user","content":"x"}],)") + rest + "}";
}

TEST(ParseRequest, StructuredOutputsCompileToTheRequestsGrammar) {
  EXPECT_EQ(ok(chat_with(R"("response_format":{"type":"text"})"), true).sampling.grammar, nullptr);
  EXPECT_EQ(ok(chat_with(R"("response_format":{"type":"json_object"})"), true).sampling.grammar,
            grammar::json_object_grammar());
  const ParsedRequest p = ok(
      R"({"prompt":"x","response_format":{"type":"json_schema","json_schema":{"name":"n",
          "strict":true,"schema":{"type":"object","properties":{"b":{"type":"integer"},
          "a":{"type":"boolean"}},"required":["b","a"],"additionalProperties":false}}}})",
      false);
  ASSERT_NE(p.sampling.grammar, nullptr);
  grammar::GrammarMatcher m(p.sampling.grammar);
  EXPECT_TRUE(m.advance(R"({"b":1,"a":true})")) << "properties keep the schema's order";
  EXPECT_TRUE(m.complete());
  const ParsedRequest c = ok(R"({"prompt":"x","guided_choice":["yes","no"]})", false);
  ASSERT_NE(c.sampling.grammar, nullptr);
  grammar::GrammarMatcher cm(c.sampling.grammar);
  EXPECT_TRUE(cm.advance("no") && cm.complete());
  const ParsedRequest re = ok(R"({"prompt":"x","guided_regex":"\\d{3}-[a-z]+"})", false);
  ASSERT_NE(re.sampling.grammar, nullptr);
  grammar::GrammarMatcher rm(re.sampling.grammar);
  EXPECT_TRUE(rm.advance("123-abc") && rm.complete());
  for (const char* field : {"guided_grammar", "grammar"}) {
    const ParsedRequest gb = ok(
        chat_with(std::string("\"") + field + R"(":"root ::= (\"yes\" | \"no\") [.!]?\n")"), true);
    ASSERT_NE(gb.sampling.grammar, nullptr) << field;
    grammar::GrammarMatcher gm(gb.sampling.grammar);
    EXPECT_TRUE(gm.advance("no!") && gm.complete()) << field;
  }
  const ParsedRequest j = ok(R"({"prompt":"x","guided_json":"{\"type\":\"null\"}"})", false);
  ASSERT_NE(j.sampling.grammar, nullptr);
  grammar::GrammarMatcher jm(j.sampling.grammar);
  EXPECT_TRUE(jm.advance("null") && jm.complete());
}

TEST(ParseRequest, RequiredAndNamedToolChoicesConstrainTheOutputToValidCalls) {
  const ParsedRequest named =
      ok(chat_with(std::string(kTwoTools) +
                   R"(,"tool_choice":{"type":"function","function":{"name":"get_weather"}})"),
         true);
  ASSERT_NE(named.sampling.grammar, nullptr);
  auto accepts = [](const ParsedRequest& p, const std::string& text) {
    grammar::GrammarMatcher m(p.sampling.grammar);
    return m.advance(text) && m.complete();
  };
  const std::string weather =
      "<tool_call>\n{\"name\":\"get_weather\",\"arguments\":{\"unit\":\"c\",\"city\":\"Oslo\"}}"
      "\n</tool_call>";
  const std::string now = "<tool_call>\n{\"name\":\"now\",\"arguments\":{}}\n</tool_call>";
  EXPECT_TRUE(accepts(named, weather));
  EXPECT_FALSE(accepts(named, now)) << "only the named function";
  EXPECT_FALSE(accepts(named,
                       "<tool_call>\n{\"name\":\"get_weather\",\"arguments\":{\"unit\":\"k\"}}"
                       "\n</tool_call>"))
      << "arguments follow the parameters schema";
  EXPECT_FALSE(accepts(named, weather + "\n" + weather)) << "one call for a named function";
  const ParsedRequest required =
      ok(chat_with(std::string(kTwoTools) + R"(,"tool_choice":"required")"), true);
  ASSERT_NE(required.sampling.grammar, nullptr);
  EXPECT_TRUE(accepts(required, now));
  EXPECT_TRUE(accepts(required, weather + "\n" + now)) << "parallel calls";
  EXPECT_FALSE(accepts(required, "plain text"));
  const ParsedRequest single =
      ok(chat_with(std::string(kTwoTools) +
                   R"(,"tool_choice":"required","parallel_tool_calls":false)"),
         true);
  EXPECT_FALSE(accepts(single, weather + "\n" + now));
  EXPECT_EQ(
      ok(chat_with(std::string(kTwoTools) + R"(,"tool_choice":"auto")"), true).sampling.grammar,
      nullptr);
  const ApiError both =
      bad(chat_with(std::string(kTwoTools) +
                    R"(,"tool_choice":"required","response_format":{"type":"json_object"})"),
          true);
  EXPECT_EQ(both.param, "tool_choice");
  EXPECT_NE(both.message.find("cannot be combined"), std::string::npos) << both.message;
}

TEST(ParseRequest, ToolsKeepTheirKeyOrderAndToolChoiceIsAutoByDefault) {
  ParsedRequest p = ok(chat_with(kTwoTools), true);
  ASSERT_EQ(p.chat_options.tools.size(), 2u);
  EXPECT_EQ(p.chat_options.tools[0].dump(),
            R"({"type":"function","function":{"parameters":{"type":"object","properties":)"
            R"({"unit":{"enum":["c","f"]},"city":{"type":"string"}}},"name":"get_weather",)"
            R"("description":"Weather"}})");
  EXPECT_EQ(p.chat_options.tools[1].dump(), R"({"function":{"name":"now"},"type":"function"})");
  EXPECT_EQ(p.tool_calls.names, (std::vector<std::string>{"get_weather", "now"}));
  EXPECT_EQ(p.tool_calls.choice, ToolChoice::kAuto);
  EXPECT_TRUE(p.tool_calls.parallel);
  EXPECT_TRUE(p.tool_calls.parses());
  EXPECT_TRUE(p.tool_calls.allows("now"));
  EXPECT_FALSE(p.tool_calls.allows("get_time"));
  // "none": the tools are still rendered (vLLM's default), the output is not parsed.
  ParsedRequest none = ok(chat_with(std::string(kTwoTools) + R"(,"tool_choice":"none")"), true);
  EXPECT_EQ(none.tool_calls.choice, ToolChoice::kNone);
  EXPECT_EQ(none.chat_options.tools.size(), 2u);
  EXPECT_FALSE(none.tool_calls.parses());
  EXPECT_FALSE(none.tool_calls.allows("now"));
  ParsedRequest required = ok(chat_with(std::string(kTwoTools) +
                                        R"(,"tool_choice":"required","parallel_tool_calls":false)"),
                              true);
  EXPECT_EQ(required.tool_calls.choice, ToolChoice::kRequired);
  EXPECT_FALSE(required.tool_calls.parallel);
  ParsedRequest named =
      ok(chat_with(std::string(kTwoTools) +
                   R"(,"tool_choice":{"type":"function","function":{"name":"now"}})"),
         true);
  EXPECT_EQ(named.tool_calls.choice, ToolChoice::kFunction);
  EXPECT_EQ(named.tool_calls.function, "now");
  EXPECT_TRUE(named.tool_calls.allows("now"));
  EXPECT_FALSE(named.tool_calls.allows("get_weather"));
  // No tools: nothing to parse; "none" is allowed without tools, an empty list is no tools.
  EXPECT_FALSE(ok(chat_with(R"("tool_choice":"none")"), true).tool_calls.parses());
  EXPECT_EQ(ok(chat_with(R"("tools":[])"), true).tool_calls.choice, ToolChoice::kNone);
}

TEST(ParseRequest, ToolMessagesAndAssistantToolCalls) {
  ParsedRequest p = ok(
      R"({"messages":[{"role":"user","content":"Paris?"},
          {"role":"assistant","content":null,"tool_calls":[
            {"id":"call_1","type":"function","function":{"name":"get_weather",
             "arguments":"{\"z\": 1, \"city\": \"Paris\"}"}},
            {"id":"call_2","function":{"name":"now","arguments":""}},
            {"id":"call_3","type":"function","function":{"name":"now","arguments":"not json"}}]},
          {"role":"tool","tool_call_id":"call_1","content":"21"},
          {"role":"tool","tool_call_id":"call_2","content":[{"type":"text","text":"12:00"}]},
          {"role":"assistant","tool_calls":[]}]})",
      true);
  ASSERT_EQ(p.messages.size(), 5u);
  const llm::ChatMessage& a = p.messages[1];
  EXPECT_EQ(a.content, "");
  ASSERT_EQ(a.tool_calls.size(), 3u);
  EXPECT_EQ(a.tool_calls[0].name, "get_weather");
  EXPECT_EQ(a.tool_calls[0].arguments.dump(), R"({"z":1,"city":"Paris"})");  // parsed, in order
  EXPECT_EQ(a.tool_calls[1].arguments.dump(), "{}");
  EXPECT_EQ(a.tool_calls[2].arguments, "not json");  // kept as the string
  EXPECT_EQ(p.messages[2].role, "tool");
  EXPECT_EQ(p.messages[2].content, "21");
  EXPECT_EQ(p.messages[3].content, "12:00");
  EXPECT_TRUE(p.messages[4].tool_calls.empty());
}

TEST(ParseRequest, BadToolShapesGet400NamingTheField) {
  struct Case {
    std::string rest;
    const char* param;
    const char* message;
  };
  const std::string tools = kTwoTools;
  const Case cases[] = {
      {R"("tools":{})", "tools", "'tools' must be an array of at most 128 tools"},
      {R"("tools":[1])", "tools", "tools[0] must be an object"},
      {R"("tools":[{"type":"function","function":{"name":"f"},"x":1}])", "tools",
       "tools[0]: unrecognized field 'x'"},
      {R"("tools":[{"type":"code","function":{"name":"f"}}])", "tools",
       R"(tools[0] must be {"type": "function", "function": {...}})"},
      {R"("tools":[{"type":"function","function":{"name":"f","examples":[]}}])", "tools",
       "tools[0].function: unrecognized field 'examples'"},
      {R"("tools":[{"type":"function","function":{"name":"has space"}}])", "tools",
       "tools[0].function.name must be 1 to 64 letters, digits, '_' or '-'"},
      {R"("tools":[{"type":"function","function":{"description":"no name"}}])", "tools",
       "tools[0].function.name must be 1 to 64 letters, digits, '_' or '-'"},
      {R"("tools":[{"type":"function","function":{"name":")" + std::string(65, 'a') + R"("}}])",
       "tools", "tools[0].function.name must be 1 to 64 letters, digits, '_' or '-'"},
      {R"("tools":[{"type":"function","function":{"name":"f","parameters":[]}}])", "tools",
       "tools[0].function: description must be a string, parameters an object (a JSON Schema), "
       "strict a boolean"},
      {R"("tools":[{"type":"function","function":{"name":"f"}},{"type":"function","function":{"name":"f"}}])",
       "tools", "tools[1].function.name 'f' is given twice"},
      {tools + R"(,"tool_choice":"any")", "tool_choice",
       R"('tool_choice' must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}})"},
      {tools + R"(,"tool_choice":{"type":"function","function":{"name":"nope"}})", "tool_choice",
       "'tool_choice' names the function 'nope', which is not in 'tools'"},
      {tools + R"(,"tool_choice":{"type":"function","name":"now"})", "tool_choice",
       R"('tool_choice' must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}})"},
      {R"("tool_choice":"auto")", "tool_choice", "'tool_choice' other than \"none\" needs 'tools'"},
      {R"("tools":[],"tool_choice":"required")", "tool_choice",
       "'tool_choice' other than \"none\" needs 'tools'"},
      {tools + R"(,"parallel_tool_calls":"yes")", "parallel_tool_calls",
       "'parallel_tool_calls' must be a boolean, got a string"},
  };
  for (const Case& c : cases) {
    const ApiError e = bad(chat_with(c.rest), true);
    EXPECT_EQ(e.http_status, 400) << c.rest;
    EXPECT_EQ(e.param, c.param) << c.rest << " -> " << e.to_json();
    EXPECT_EQ(e.message, c.message) << c.rest;
  }
  const std::pair<const char*, const char*> messages[] = {
      {R"([{"role":"tool","content":"x"}])",
       "messages[0].tool_call_id must be a string on a tool message"},
      {R"([{"role":"user","content":"x","tool_call_id":"c"}])",
       "messages[0].tool_call_id is only allowed on tool messages"},
      {R"([{"role":"tool","tool_call_id":"c"}])",
       "messages[0].content must be a string or an array of text parts, got null"},
      {R"([{"role":"assistant","tool_calls":{}}])", "messages[0].tool_calls must be an array"},
      {R"([{"role":"assistant","tool_calls":[{"id":"c","function":{"name":"f","arguments":{}}}]}])",
       R"(messages[0].tool_calls[0] must be {"id": string, "type": "function", "function": {"name": string, "arguments": string}})"},
      {R"([{"role":"assistant","tool_calls":[{"function":{"name":"f","arguments":""}}]}])",
       R"(messages[0].tool_calls[0] must be {"id": string, "type": "function", "function": {"name": string, "arguments": string}})"},
      {R"([{"role":"assistant","tool_calls":[{"id":"c","function":{"name":"f","arguments":"","x":1}}]}])",
       "messages[0].tool_calls[0].function: unrecognized field 'x'"},
      {R"([{"role":"assistant","tool_calls":[7]}])", "messages[0].tool_calls[0] must be an object"},
      {R"([{"role":"user","content":"x","extra":1}])", "messages[0]: unrecognized field 'extra'"},
  };
  for (const auto& [m, message] : messages) {
    const ApiError e = bad(std::string(R"({"messages":)") + m + "}", true);
    EXPECT_EQ(e.param, "messages") << m;
    EXPECT_EQ(e.message, message) << m;
  }
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
  auto tools = parse_tokenize(chat_with(kTwoTools));
  ASSERT_TRUE(std::holds_alternative<TokenizeRequest>(tools));
  EXPECT_EQ(std::get<TokenizeRequest>(tools).chat_options.tools.size(), 2u);
  auto bad_tools = parse_tokenize(R"({"messages":[{"role":"user","content":"x"}],"tools":[1]})");
  ASSERT_TRUE(std::holds_alternative<ApiError>(bad_tools));
  EXPECT_EQ(std::get<ApiError>(bad_tools).message, "tools[0] must be an object");
  auto prompt_tools = parse_tokenize(R"({"prompt":"x","tools":[]})");
  ASSERT_TRUE(std::holds_alternative<ApiError>(prompt_tools));
  EXPECT_EQ(std::get<ApiError>(prompt_tools).message, "'tools' needs 'messages'");
  auto d = parse_detokenize(R"({"tokens":[5,6]})");
  ASSERT_TRUE(std::holds_alternative<DetokenizeRequest>(d));
  EXPECT_EQ(std::get<DetokenizeRequest>(d).tokens, (std::vector<int64_t>{5, 6}));
  EXPECT_EQ(std::get<DetokenizeRequest>(d).model, "");
  auto named = parse_detokenize(R"({"model":"m","tokens":[]})");
  ASSERT_TRUE(std::holds_alternative<DetokenizeRequest>(named));
  EXPECT_EQ(std::get<DetokenizeRequest>(named).model, "m");
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
