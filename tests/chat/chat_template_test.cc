// Qwen3's chat template rendered natively against transformers' rendering of the same template
// (tests/chat/render_reference.py: python3-jinja2 in transformers' environment), byte for byte.
#include "simpler/tokenizer/chat_template.h"

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "base/test_temp_dir.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "simpler/base/file.h"

namespace simpler::llm {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using ojson = nlohmann::ordered_json;

std::string read(const fs::path& p) {
  return base::read_regular_file(p.string()).value_or("(unreadable: " + p.string() + ")");
}

struct Case {
  std::vector<ChatMessage> messages;
  ChatRenderOptions options;
};

ChatMessage msg(std::string role, std::string content) {
  return ChatMessage{std::move(role), std::move(content), std::nullopt, {}};
}

ChatMessage calls(std::string content, std::vector<ChatToolCall> tool_calls) {
  ChatMessage m = msg("assistant", std::move(content));
  m.tool_calls = std::move(tool_calls);
  return m;
}

std::vector<Case> cases() {
  std::vector<Case> c;
  auto add = [&](std::vector<ChatMessage> m, bool gen = true, std::optional<bool> think = {}) {
    c.push_back(Case{std::move(m), ChatRenderOptions{gen, think, {}}});
  };
  add({msg("user", "Hello")});
  add({msg("user", "Hello")}, true, false);
  add({msg("user", "Hello")}, true, true);
  add({msg("user", "Hello")}, false);
  add({msg("system", "You are terse."), msg("user", "Hi")});
  add({msg("system", "You are terse."), msg("user", "Hi")}, true, false);
  add({msg("user", "2+2?"), msg("assistant", "4"), msg("user", "and 3+3?")});
  // Earlier assistant turns lose their think block; the one after the last query keeps it.
  add({msg("user", "q1"), msg("assistant", "<think>\nreason 1\n</think>\n\nanswer 1"),
       msg("user", "q2")});
  add({msg("user", "q1"), msg("assistant", "<think>\nreason 1\n</think>\n\nanswer 1"),
       msg("user", "q2"), msg("assistant", "<think>\nreason 2\n</think>\n\nanswer 2")},
      false);
  add({msg("user", "q1"), msg("assistant", "<think>r</think>a")}, false);
  add({msg("user", "q1"), msg("assistant", "no think block at all")}, false);
  add({msg("user", "q1"), msg("assistant", "\n\n<think>\n\nx\n\n</think>\n\n\ny\n")}, false);
  add({msg("user", "q1"), msg("assistant", "a</think>b</think>c")}, false);
  add({msg("user", "q1"), msg("assistant", "<think>a<think>b</think>c")}, false);
  {
    ChatMessage a = msg("assistant", "final answer");
    a.reasoning_content = "\nstep by step\n";
    add({msg("user", "q"), a}, false);
    ChatMessage e = msg("assistant", "final answer");
    e.reasoning_content = "";
    add({msg("user", "q"), e, msg("user", "again")});
  }
  // A user turn that is a tool-response wrapper does not count as the last query.
  add({msg("user", "q1"), msg("assistant", "<think>t</think>a1"),
       msg("user", "<tool_response>\n42\n</tool_response>"),
       msg("assistant", "<think>t2</think>a2")},
      false);
  // Multi-turn with a later system message, rendered in place.
  add({msg("system", "S1"), msg("user", "u1"), msg("assistant", "a1"), msg("system", "S2"),
       msg("user", "u2")});
  add({msg("assistant", "I start"), msg("user", "u")});
  // Non-ASCII text, newlines and template-looking text are copied as they are.
  add({msg("system", "Réponds en français. 日本語も可。"), msg("user", "Ça va ? 🦊\n\tTabs.")});
  add({msg("user", "{{ not a template }} {% raw %}"), msg("assistant", "<|im_end|> literal")}, true,
      false);
  add({msg("user", ""), msg("assistant", ""), msg("user", "")});
  add({msg("system", "s"), msg("user", "a"), msg("assistant", "<think>\n\n</think>\n\nb"),
       msg("user", "c"), msg("assistant", "<think>deep</think>d"), msg("user", "e")},
      true, true);
  add({msg("user", "long " + std::string(3000, 'x'))}, true, false);
  return c;
}

// A conversation as the reference renders it: OpenAI's message shapes (tool calls with an id
// and type "function" around name and arguments, tool messages with a tool_call_id).
ojson case_json(const Case& c) {
  ojson messages = ojson::array();
  for (const ChatMessage& m : c.messages) {
    ojson jm = {{"role", m.role}, {"content", m.content}};
    if (m.reasoning_content) jm["reasoning_content"] = *m.reasoning_content;
    if (m.role == "tool") jm["tool_call_id"] = "call_0";
    if (!m.tool_calls.empty()) {
      ojson tc = ojson::array();
      for (size_t k = 0; k < m.tool_calls.size(); ++k) {
        tc.push_back(
            {{"id", "call_" + std::to_string(k)},
             {"type", "function"},
             {"function",
              {{"name", m.tool_calls[k].name}, {"arguments", m.tool_calls[k].arguments}}}});
      }
      jm["tool_calls"] = tc;
    }
    messages.push_back(jm);
  }
  ojson jc = {{"messages", messages}, {"add_generation_prompt", c.options.add_generation_prompt}};
  if (c.options.enable_thinking) jc["enable_thinking"] = *c.options.enable_thinking;
  if (!c.options.tools.empty()) jc["tools"] = c.options.tools;
  return jc;
}

// Renders every case natively and with the reference; expects them byte for byte equal.
void expect_rendered_as_transformers_does(const std::vector<Case>& all, const char* dir_name) {
  const fs::path dir = simpler::testing::test_dir(dir_name);
  ojson in = ojson::array();
  for (const Case& c : all) in.push_back(case_json(c));
  const fs::path cases_path = dir / "cases.json", out_path = dir / "out.json",
                 log = dir / "render.log";
  std::ofstream(cases_path) << in.dump();
  const std::string config = (fs::path(SIMPLER_TOKENIZER_DIR) / "tokenizer_config.json").string();
  const std::string command = std::string("'") + SIMPLER_PYTHON3 + "' '" + SIMPLER_CHAT_REFERENCE +
                              "' '" + config + "' '" + cases_path.string() + "' > '" +
                              out_path.string() + "' 2> '" + log.string() + "'";
  ASSERT_EQ(std::system(command.c_str()), 0) << command << "\n" << read(log);
  const json out = json::parse(read(out_path));
  ASSERT_EQ(out.size(), all.size());
  auto t = ChatTemplate::load(SIMPLER_TOKENIZER_DIR);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->name(), "qwen3");
  for (size_t i = 0; i < all.size(); ++i) {
    auto got = t->render(all[i].messages, all[i].options);
    ASSERT_TRUE(got.ok()) << "case " << i << ": " << got.status();
    EXPECT_EQ(*got, out[i].get<std::string>()) << "case " << i << ": " << in[i].dump();
  }
}

TEST(ChatTemplate, Qwen3RenderingIsByteIdenticalToTransformers) {
  const std::vector<Case> all = cases();
  ASSERT_GE(all.size(), 20u);
  expect_rendered_as_transformers_does(all, "simpler_chat_template_test");
}

ojson weather_tool() {
  return ojson::parse(R"({"type": "function", "function": {"name": "get_weather",
      "description": "The weather in a city", "parameters": {"type": "object",
      "properties": {"city": {"type": "string"}, "unit": {"type": "string",
      "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}})");
}

// Keys out of alphabetical order, floats at Python's repr boundaries, integers past int64,
// non-ASCII text, quotes, backslashes and control characters.
ojson odd_tool() {
  return ojson::parse(R"({"function": {"parameters": {"type": "object", "properties": {
      "z": {"type": "number", "minimum": 0.5, "maximum": 1e15, "multipleOf": 1e-05,
            "default": 1e16, "exclusiveMinimum": 0.0001, "examples": [1e-4, 123456789.125,
            1.5e-7, -0.0, 100.0, 2.5e300, 0.1, 1e22]},
      "a": {"type": "integer", "enum": [-1, 0, 18446744073709551615, 9223372036854775807,
            -9223372036854775808]},
      "m": {"type": "array", "items": {}, "default": [], "x": null, "b": true, "c": false}},
      "required": ["z", "a"]}, "name": "odd_one",
      "description": "Ünïcode 日本語 🦊 \"quoted\" \\ back\n\t\u0001 ctrl \u007f \/ slash"},
      "type": "function"})");
}

ChatToolCall call(std::string name, const char* arguments) {
  return ChatToolCall{std::move(name), ojson::parse(arguments)};
}

std::vector<Case> tool_cases() {
  std::vector<Case> c;
  auto add = [&](std::vector<ChatMessage> m, std::vector<ojson> tools, bool gen = true,
                 std::optional<bool> think = {}) {
    c.push_back(Case{std::move(m), ChatRenderOptions{gen, think, std::move(tools)}});
  };
  const ojson w = weather_tool(), odd = odd_tool();
  const ojson bare = ojson::parse(R"({"type": "function", "function": {"name": "now"}})");
  add({msg("user", "Weather in Paris?")}, {w});
  add({msg("system", "You are terse."), msg("user", "Weather in Paris?")}, {w, bare}, true, false);
  add({msg("user", "x")}, {odd, w, bare});
  // A call with empty content, its response, the next generation.
  add({msg("system", "S"), msg("user", "Paris?"),
       calls("", {call("get_weather", R"({"city": "Paris", "unit": "celsius"})")}),
       msg("tool", "{\"temp\": 21}")},
      {w});
  // Content before two calls, two responses merged into one user turn, the final answer.
  add({msg("user", "Paris and Rome?"),
       calls("Let me check.", {call("get_weather", R"({"city": "Paris"})"),
                               call("get_weather", R"({"unit": "fahrenheit", "city": "Rome"})")}),
       msg("tool", "21"), msg("tool", "25"), msg("assistant", "Paris 21, Rome 25.")},
      {w}, false);
  // Arguments given as a JSON string are copied as they are; nested values, non-ASCII.
  add({msg("user", "q"),
       calls("", {ChatToolCall{"get_weather", ojson("{\"city\":\"Zürich\" }")},
                  ChatToolCall{"get_weather", ojson("not json at all")},
                  call("odd_one", R"({"a": [1, 2.5, {"k": null}], "z": 1e16, "s": "日本 \"q\""})"),
                  call("now", "{}")})},
      {w, odd, bare}, false);
  // Think blocks around calls in a multi-step turn (tool responses are not queries).
  add({msg("user", "q1"),
       calls("<think>\nneed weather\n</think>\n\n", {call("get_weather", R"({"city": "Oslo"})")}),
       msg("tool", "-3"), calls("<think>ok</think>It is -3.", {})},
      {w}, false);
  {
    ChatMessage r = calls("", {call("now", "{}")});
    r.reasoning_content = "\nthinking\n";
    add({msg("user", "time?"), r, msg("tool", "12:00")}, {bare}, true, false);
    ChatMessage nl = calls("\n", {call("now", "{}")});
    add({msg("user", "time?"), nl, msg("tool", "12:00")}, {bare});
  }
  // A tool message first, a later system message, a user turn that is a response wrapper.
  add({msg("tool", "orphan"), msg("user", "u"), msg("system", "later"),
       msg("user", "<tool_response>\nx\n</tool_response>")},
      {w});
  // Tool messages and calls without tools in the request (the template's branch without tools).
  add({msg("user", "q"), calls("c", {call("f", R"({"x": 1})")}), msg("tool", "r")}, {});
  add({msg("system", "Réponds en français."), msg("user", "Ça va ? 🦊")}, {w}, true, true);
  return c;
}

TEST(ChatTemplate, Qwen3ToolRenderingIsByteIdenticalToTransformers) {
  const std::vector<Case> all = tool_cases();
  ASSERT_GE(all.size(), 12u);
  expect_rendered_as_transformers_does(all, "simpler_chat_template_tools_test");
}

TEST(ChatTemplate, PythonJsonDumpsMatchesPythonsJsonModule) {
  // Values from Python 3's json.dumps(v, ensure_ascii=False).
  EXPECT_EQ(python_json_dumps(ojson::parse(R"({"b": 1, "a": [true, null, "x"]})")),
            R"({"b": 1, "a": [true, null, "x"]})");
  EXPECT_EQ(python_json_dumps(ojson::parse("[1e15, 1e16, 1e-4, 1e-5, 0.1, 100.0, -0.0, 1.5e300]")),
            "[1000000000000000.0, 1e+16, 0.0001, 1e-05, 0.1, 100.0, -0.0, 1.5e+300]");
  EXPECT_EQ(python_json_dumps(ojson::parse(R"(["\u0001\n\"\\ é"])")), R"(["\u0001\n\"\\ é"])");
  EXPECT_EQ(python_json_dumps(ojson(std::nan(""))), "NaN");
  EXPECT_EQ(python_json_dumps(ojson(-HUGE_VAL)), "-Infinity");
  EXPECT_EQ(python_json_dumps(ojson::object()), "{}");
  EXPECT_EQ(python_json_dumps(ojson::array()), "[]");
}

TEST(ChatTemplate, AnUnknownTemplateIsRefusedNamingItsHash) {
  auto t = ChatTemplate::from_text("{{ messages[0].content }}");
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_NE(std::string(t.status().message()).find(sha256_hex("{{ messages[0].content }}")),
            std::string::npos)
      << t.status();
  EXPECT_NE(std::string(t.status().message()).find("is not one simpler renders"), std::string::npos)
      << t.status();
  // sha256 of "abc" (FIPS 180-2 test vector).
  EXPECT_EQ(sha256_hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
}

TEST(ChatTemplate, BadConversationsAreRefusedNamingTheMessage) {
  auto t = ChatTemplate::from_text("x");
  ASSERT_FALSE(t.ok());  // "x" is not a known template
  auto q = ChatTemplate::load(SIMPLER_TOKENIZER_DIR);
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_EQ(q->render({}).status().code(), absl::StatusCode::kInvalidArgument);
  auto bad_role = q->render({msg("user", "a"), msg("function", "b")});
  EXPECT_EQ(bad_role.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(bad_role.status().message()).find("messages[1].role 'function'"),
            std::string::npos)
      << bad_role.status();
  ChatMessage user_calls = msg("user", "a");
  user_calls.tool_calls.push_back(ChatToolCall{"f", ojson::object()});
  auto calls_on_user = q->render({user_calls});
  EXPECT_EQ(calls_on_user.status().message(),
            "messages[0].tool_calls is only allowed on assistant messages");
  ChatMessage u = msg("user", "a");
  u.reasoning_content = "r";
  auto r = q->render({u});
  EXPECT_NE(std::string(r.status().message()).find("messages[0].reasoning_content"),
            std::string::npos)
      << r.status();
  EXPECT_EQ(ChatTemplate::load("/nonexistent-dir").status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace simpler::llm
