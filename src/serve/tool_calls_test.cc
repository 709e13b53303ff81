// Qwen3's tool calls read from generated text, whole and streamed, and their response shapes.
#include "serve/tool_calls.h"

#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "simpler/tokenizer/detokenizer.h"
#include "simpler/tokenizer/tokenizer.h"

namespace simpler::serve {
namespace {

using json = nlohmann::json;

ToolCallPolicy policy(ToolChoice choice = ToolChoice::kAuto, std::string function = "") {
  ToolCallPolicy p;
  p.choice = choice;
  p.function = std::move(function);
  p.names = {"get_weather", "now"};
  return p;
}

std::string call(const std::string& body) { return "<tool_call>\n" + body + "\n</tool_call>"; }

const std::string kParis = R"({"name": "get_weather", "arguments": {"city": "Paris"}})";
const std::string kNow = R"({"name": "now", "arguments": {}})";

// The pieces of `text` fed in `cuts`' pieces, added up.
ToolCallPiece fed_in_pieces(const std::string& text, const std::vector<size_t>& cuts,
                            const ToolCallPolicy& p) {
  ToolCallParser parser(&p);
  ToolCallPiece all;
  size_t at = 0;
  for (size_t cut : cuts) {
    all.append(parser.feed(std::string_view(text).substr(at, cut - at)));
    at = cut;
  }
  all.append(parser.feed(std::string_view(text).substr(at)));
  all.append(parser.finish());
  return all;
}

void expect_same(const ToolCallPiece& got, const ToolCallPiece& want, const std::string& what) {
  EXPECT_EQ(got.content, want.content) << what;
  EXPECT_EQ(got.after, want.after) << what;
  ASSERT_EQ(got.calls.size(), want.calls.size()) << what;
  for (size_t k = 0; k < got.calls.size(); ++k) {
    EXPECT_EQ(got.calls[k].name, want.calls[k].name) << what;
    EXPECT_EQ(got.calls[k].arguments, want.calls[k].arguments) << what;
  }
}

TEST(ToolCalls, AValidCallBecomesAToolCallWithPythonStyleArguments) {
  const ToolCallPiece r = parse_tool_calls(
      call(R"({"name": "get_weather", "arguments": {"unit":"c","city":"Zürich","n":[1,2.50]}})"),
      policy());
  EXPECT_EQ(r.content, "");
  ASSERT_EQ(r.calls.size(), 1u);
  EXPECT_EQ(r.calls[0].name, "get_weather");
  EXPECT_EQ(r.calls[0].arguments, R"({"unit": "c", "city": "Zürich", "n": [1, 2.5]})");
}

TEST(ToolCalls, ContentBeforeTheFirstCallIsKeptWithoutTheWhitespaceBeforeIt) {
  const ToolCallPiece r =
      parse_tool_calls("Let me check.\n\n" + call(kParis) + "\n" + call(kNow) + "\n", policy());
  EXPECT_EQ(r.content, "Let me check.");
  ASSERT_EQ(r.calls.size(), 2u);
  EXPECT_EQ(r.calls[0].arguments, R"({"city": "Paris"})");
  EXPECT_EQ(r.calls[1].name, "now");
  EXPECT_EQ(r.calls[1].arguments, "{}");
  // Text between and after valid calls is dropped.
  const ToolCallPiece between =
      parse_tool_calls(call(kParis) + " and then " + call(kNow) + " done.", policy());
  EXPECT_EQ(between.content, "");
  EXPECT_EQ(between.calls.size(), 2u);
}

TEST(ToolCalls, AMalformedCallIsPlainContentNeverAToolCall) {
  const std::vector<std::string> bad = {
      call(R"({"name": "get_weather", "arguments": {"city": )"),  // bad JSON
      call(R"({"arguments": {}})"),                               // no name
      call(R"({"name": 7, "arguments": {}})"),                    // name not a string
      call(R"({"name": "get_time", "arguments": {}})"),           // not one of the tools
      call(R"({"name": "now", "arguments": "{}"})"),              // arguments not an object
      call(R"({"name": "now"})"),                                 // no arguments
      call(R"(["now", {}])"),                                     // not an object
      call(R"({"name": "now", "arguments": {}} trailing)"),       // garbage after it
      call(""),                                                   // empty
  };
  for (const std::string& text : bad) {
    for (const std::string& before : {std::string(), std::string("Sure: ")}) {
      const ToolCallPiece r = parse_tool_calls(before + text + " tail", policy());
      EXPECT_EQ(r.content, before + text + " tail");
      EXPECT_TRUE(r.calls.empty()) << text;
    }
  }
  // After a valid call, the first malformed one and the rest are content.
  const ToolCallPiece r = parse_tool_calls(
      call(kParis) + "\n" + call("{oops}") + "\n" + call(kNow) + " tail", policy());
  ASSERT_EQ(r.calls.size(), 1u);
  EXPECT_EQ(r.calls[0].name, "get_weather");
  EXPECT_EQ(r.content, "");
  EXPECT_EQ(r.after, call("{oops}") + "\n" + call(kNow) + " tail");
  // Content, a valid call, then a malformed one after whitespace: in the order generated.
  const ToolCallPiece ordered =
      parse_tool_calls("A " + call(kNow) + " " + call("{oops}") + " B", policy());
  EXPECT_EQ(ordered.content, "A");
  EXPECT_EQ(ordered.calls.size(), 1u);
  EXPECT_EQ(ordered.after, call("{oops}") + " B");
  EXPECT_EQ(ordered.text(), "A" + call("{oops}") + " B");
}

TEST(ToolCalls, ACallLeftOpenCountsOnlyWhenItIsComplete) {
  const ToolCallPiece open = parse_tool_calls("<tool_call>\n" + kNow + "\n", policy());
  ASSERT_EQ(open.calls.size(), 1u);
  EXPECT_EQ(open.content, "");
  const std::string cut = R"(<tool_call>{"name": "now", "argu)";
  const ToolCallPiece truncated = parse_tool_calls("Hm " + cut, policy());
  EXPECT_TRUE(truncated.calls.empty());
  EXPECT_EQ(truncated.content, "Hm " + cut);
  // Text that only starts like a tag is content, held back until decided.
  EXPECT_EQ(parse_tool_calls("a <tools> b <tool_cal", policy()).content, "a <tools> b <tool_cal");
}

TEST(ToolCalls, PolicyDecidesWhichCallsAreValid) {
  const std::string text = call(kParis) + call(kNow);
  // parallel_tool_calls false: only the first call.
  ToolCallPolicy single = policy();
  single.parallel = false;
  const ToolCallPiece one = parse_tool_calls(text, single);
  ASSERT_EQ(one.calls.size(), 1u);
  EXPECT_EQ(one.content, "");
  // A named function: a call of another is content.
  const ToolCallPiece named = parse_tool_calls(text, policy(ToolChoice::kFunction, "now"));
  EXPECT_TRUE(named.calls.empty());
  EXPECT_EQ(named.content, text);
  const ToolCallPiece named_ok =
      parse_tool_calls(call(kNow) + call(kParis), policy(ToolChoice::kFunction, "now"));
  ASSERT_EQ(named_ok.calls.size(), 1u);
  EXPECT_EQ(named_ok.text(), call(kParis));
  // "required" reads calls as "auto" does; without one the text is content.
  EXPECT_EQ(parse_tool_calls(text, policy(ToolChoice::kRequired)).calls.size(), 2u);
  EXPECT_EQ(parse_tool_calls("no call", policy(ToolChoice::kRequired)).content, "no call");
  // "none" allows no call.
  EXPECT_TRUE(parse_tool_calls(text, policy(ToolChoice::kNone)).calls.empty());
}

TEST(ToolCallParser, HoldsBackOnlyWhatMayStillOpenACall) {
  const ToolCallPolicy p = policy();
  ToolCallParser parser(&p);
  EXPECT_EQ(parser.feed("Hello world").content, "Hello world");
  EXPECT_EQ(parser.feed(", I will ").content, ", I will");  // " " could precede a call
  EXPECT_EQ(parser.feed("check <").content, " check");
  EXPECT_EQ(parser.feed("tool_").content, "");
  EXPECT_EQ(parser.feed("cal").content, "");
  ToolCallPiece opened = parser.feed("l>\n{\"name\": \"now\", ");
  EXPECT_EQ(opened.content, "");
  EXPECT_TRUE(opened.calls.empty());
  EXPECT_TRUE(parser.feed("\"arguments\": {}}\n</tool_").calls.empty());
  ToolCallPiece closed = parser.feed("call>");
  ASSERT_EQ(closed.calls.size(), 1u);
  EXPECT_EQ(closed.calls[0].name, "now");
  EXPECT_EQ(parser.calls(), 1);
  EXPECT_EQ(parser.feed("\n").content, "");
  ToolCallPiece rest = parser.finish();
  EXPECT_EQ(rest.content, "");
  EXPECT_TRUE(rest.calls.empty());
  // A held-back prefix that turns out not to be a tag is released.
  ToolCallParser other(&p);
  EXPECT_EQ(other.feed("x <tool").content, "x");
  EXPECT_EQ(other.feed("s> y").content, " <tools> y");
  EXPECT_EQ(other.finish().content, "");
}

TEST(ToolCallParser, EverySplitOfTheTextGivesTheWholeTextsReading) {
  const std::vector<std::string> texts = {
      "Let me check.\n\n" + call(kParis) + "\n" + call(kNow) + "\n",
      "<think>\nhmm <tool_ maybe\n</think>\n\n" + call(kParis),
      call(kParis) + " x " + call("{bad") + " tail <tool_call",
      "plain text with <tool_call but no call, and trailing space  ",
      "<tool_call>\n" + kNow,
      call(R"({"name": "get_weather", "arguments": {"s": "</tool_call>"}})"),
      "",
  };
  const ToolCallPolicy p = policy();
  std::mt19937 rng(7);
  for (const std::string& text : texts) {
    const ToolCallPiece whole = parse_tool_calls(text, p);
    std::vector<size_t> each;  // one byte at a time
    for (size_t i = 1; i < text.size(); ++i) each.push_back(i);
    expect_same(fed_in_pieces(text, each, p), whole, "byte by byte: " + text);
    for (size_t i = 0; i <= text.size(); ++i) {
      expect_same(fed_in_pieces(text, {i}, p), whole, "split at " + std::to_string(i));
    }
    for (int trial = 0; trial < 50 && !text.empty(); ++trial) {
      std::vector<size_t> cuts;
      for (size_t i = 1; i < text.size(); ++i) {
        if (rng() % 4 == 0) cuts.push_back(i);
      }
      expect_same(fed_in_pieces(text, cuts, p), whole, "random cuts: " + text);
    }
  }
}

TEST(ToolCallParser, QwenTokensFedOneAtATimeThroughTheDetokenizerGiveTheWholeReading) {
  const llm::Tokenizer tokenizer =
      llm::Tokenizer::load(llm::default_tokenizer_dir().value()).value();
  const std::string text = "<think>\nThe user wants weather.\n</think>\n\nI'll check both.\n" +
                           call(R"({"name": "get_weather", "arguments": {"city": "Zürich"}})") +
                           "\n" + call(kNow) + "<|im_end|>";
  const std::vector<int32_t> ids = tokenizer.encode(text);
  // The tags are single tokens of Qwen3's vocabulary (added tokens, not special).
  const std::vector<int32_t> open = tokenizer.encode("<tool_call>");
  ASSERT_EQ(open.size(), 1u);
  EXPECT_FALSE(tokenizer.is_special(open[0]));
  EXPECT_EQ(std::count(ids.begin(), ids.end(), open[0]), 2);
  const ToolCallPolicy p = policy();
  ToolCallParser parser(&p);
  llm::IncrementalDetokenizer detok(&tokenizer);
  ToolCallPiece streamed;
  std::vector<size_t> calls_after;  // calls known after each token
  for (int32_t id : ids) {
    streamed.append(parser.feed(detok.push(std::vector<int32_t>{id})));
    calls_after.push_back(static_cast<size_t>(parser.calls()));
  }
  streamed.append(parser.feed(detok.finish()));
  streamed.append(parser.finish());
  const ToolCallPiece whole = parse_tool_calls(tokenizer.decode(ids), p);
  expect_same(streamed, whole, text);
  EXPECT_EQ(whole.content, "<think>\nThe user wants weather.\n</think>\n\nI'll check both.");
  ASSERT_EQ(whole.calls.size(), 2u);
  EXPECT_EQ(whole.calls[0].arguments, R"({"city": "Zürich"})");
  // Each call is known as soon as its closing tag's token is read.
  const std::vector<int32_t> close = tokenizer.encode("</tool_call>");
  ASSERT_EQ(close.size(), 1u);
  const size_t first_close = std::find(ids.begin(), ids.end(), close[0]) - ids.begin();
  EXPECT_EQ(calls_after[first_close - 1], 0u);
  EXPECT_EQ(calls_after[first_close], 1u);
}

// What an OpenAI client makes of a choice's stream deltas: the message, its tool calls
// accumulated by index (the SDK's way: id, type and name from the first delta of an index,
// arguments appended).
json accumulate(const std::vector<json>& deltas) {
  json message = {{"role", "assistant"}, {"content", ""}};
  for (const json& d : deltas) {
    if (d.contains("content"))
      message["content"] = message["content"].get<std::string>() + d["content"].get<std::string>();
    if (!d.contains("tool_calls")) continue;
    for (const json& t : d["tool_calls"]) {
      const size_t index = t["index"];
      json& calls = message["tool_calls"];
      if (calls.size() <= index) {
        EXPECT_EQ(calls.size(), index) << "tool call indices go up by one";
        EXPECT_TRUE(t.contains("id") && t.contains("type") && t["function"].contains("name")) << t;
        calls.push_back({{"id", t["id"]},
                         {"type", t["type"]},
                         {"function", {{"name", t["function"]["name"]}, {"arguments", ""}}}});
      }
      calls[index]["function"]["arguments"] =
          calls[index]["function"]["arguments"].get<std::string>() +
          t["function"]["arguments"].get<std::string>();
    }
  }
  if (message["content"] == "") message["content"] = nullptr;
  return message;
}

TEST(ToolCallResponses, StreamDeltasAddUpToTheWholeMessageAtEverySplit) {
  const std::vector<std::string> texts = {
      "Checking.\n" + call(kParis) + "\n" + call(kNow),
      call(kNow) + " " + call("{oops}") + " B",
      "no calls at all <tool_",
  };
  const ToolCallPolicy p = policy();
  for (const std::string& text : texts) {
    int whole_ids = 0;
    const json whole = chat_message_json(parse_tool_calls(text, p),
                                         [&] { return "call_" + std::to_string(whole_ids++); });
    for (size_t step : {size_t{1}, size_t{3}, size_t{7}, text.size()}) {
      ToolCallParser parser(&p);
      int ids = 0;
      const ToolCallIds next = [&] { return "call_" + std::to_string(ids++); };
      std::vector<json> deltas;
      for (size_t at = 0; at < text.size(); at += step) {
        const bool last = at + step >= text.size();
        for (json& d : tool_stream_deltas(parser, std::string_view(text).substr(at, step), last,
                                          false, next)) {
          EXPECT_FALSE(d.contains("content") && d["content"] == "") << "an empty content delta";
          deltas.push_back(std::move(d));
        }
      }
      EXPECT_EQ(accumulate(deltas), whole) << text << " in steps of " << step;
    }
  }
  // Asked for (to carry logprobs), a content delta comes first even when the event has none.
  const ToolCallPolicy q = policy();
  ToolCallParser parser(&q);
  const std::vector<json> held =
      tool_stream_deltas(parser, "<tool_", false, true, [] { return "x"; });
  ASSERT_EQ(held.size(), 1u);
  EXPECT_EQ(held[0], json({{"content", ""}}));
  EXPECT_TRUE(tool_stream_deltas(parser, "call>", false, false, [] { return "x"; }).empty());
}

TEST(ToolCallResponses, MessageDeltasAndFinishReasonHaveOpenAisShapes) {
  int next = 0;
  const ToolCallIds ids = [&] { return "call_" + std::to_string(next++); };
  const ToolCallPiece whole = parse_tool_calls("Checking.\n" + call(kParis) + call(kNow), policy());
  EXPECT_EQ(chat_message_json(whole, ids),
            json::parse(R"({"role": "assistant", "content": "Checking.", "tool_calls": [
                {"id": "call_0", "type": "function",
                 "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}},
                {"id": "call_1", "type": "function",
                 "function": {"name": "now", "arguments": "{}"}}]})"));
  EXPECT_EQ(chat_message_json(parse_tool_calls(call(kNow), policy()), ids)["content"], nullptr);
  EXPECT_EQ(chat_message_json(parse_tool_calls("plain", policy()), ids),
            json::parse(R"({"role": "assistant", "content": "plain"})"));
  const std::vector<json> deltas = tool_call_deltas(whole.calls, 3, ids);
  ASSERT_EQ(deltas.size(), 4u);
  EXPECT_EQ(deltas[0], json::parse(R"({"tool_calls": [{"index": 3, "id": "call_3",
      "type": "function", "function": {"name": "get_weather", "arguments": ""}}]})"));
  EXPECT_EQ(deltas[1], json::parse(R"({"tool_calls": [{"index": 3,
      "function": {"arguments": "{\"city\": \"Paris\"}"}}]})"));
  EXPECT_EQ(deltas[2]["tool_calls"][0]["index"], 4);
  EXPECT_EQ(deltas[2]["tool_calls"][0]["function"]["name"], "now");
  EXPECT_EQ(tool_finish_reason(true, "stop"), "tool_calls");
  EXPECT_EQ(tool_finish_reason(true, "length"), "tool_calls");
  EXPECT_EQ(tool_finish_reason(true, "abort"), "abort");
  EXPECT_EQ(tool_finish_reason(false, "stop"), "stop");
}

}  // namespace
}  // namespace simpler::serve
