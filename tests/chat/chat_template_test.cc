// Qwen3's chat template rendered natively against transformers' rendering of the same template
// (tests/chat/render_reference.py: python3-jinja2 in transformers' environment), byte for byte.
#include "simpler/tokenizer/chat_template.h"

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

std::string read(const fs::path& p) {
  return base::read_regular_file(p.string()).value_or("(unreadable: " + p.string() + ")");
}

struct Case {
  std::vector<ChatMessage> messages;
  ChatRenderOptions options;
};

ChatMessage msg(std::string role, std::string content) {
  return ChatMessage{std::move(role), std::move(content), std::nullopt};
}

std::vector<Case> cases() {
  std::vector<Case> c;
  auto add = [&](std::vector<ChatMessage> m, bool gen = true, std::optional<bool> think = {}) {
    c.push_back(Case{std::move(m), ChatRenderOptions{gen, think}});
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

TEST(ChatTemplate, Qwen3RenderingIsByteIdenticalToTransformers) {
  const fs::path dir = simpler::testing::test_dir("simpler_chat_template_test");
  const std::vector<Case> all = cases();
  ASSERT_GE(all.size(), 20u);
  json in = json::array();
  for (const Case& c : all) {
    json messages = json::array();
    for (const ChatMessage& m : c.messages) {
      json jm = {{"role", m.role}, {"content", m.content}};
      if (m.reasoning_content) jm["reasoning_content"] = *m.reasoning_content;
      messages.push_back(jm);
    }
    json jc = {{"messages", messages}, {"add_generation_prompt", c.options.add_generation_prompt}};
    if (c.options.enable_thinking) jc["enable_thinking"] = *c.options.enable_thinking;
    in.push_back(jc);
  }
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

TEST(ChatTemplate, AnUnknownTemplateIsRefusedNamingItsHash) {
  auto t = ChatTemplate::from_text("{{ messages[0].content }}");
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_NE(std::string(t.status().message()).find(sha256_hex("{{ messages[0].content }}")),
            std::string::npos)
      << t.status();
  EXPECT_NE(std::string(t.status().message()).find("completions still work"), std::string::npos);
  // sha256 of "abc" (FIPS 180-2 test vector).
  EXPECT_EQ(sha256_hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
}

TEST(ChatTemplate, BadConversationsAreRefusedNamingTheMessage) {
  auto t = ChatTemplate::from_text("x");
  ASSERT_FALSE(t.ok());  // "x" is not a known template
  auto q = ChatTemplate::load(SIMPLER_TOKENIZER_DIR);
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_EQ(q->render({}).status().code(), absl::StatusCode::kInvalidArgument);
  auto tool = q->render({msg("user", "a"), msg("tool", "b")});
  EXPECT_EQ(tool.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(tool.status().message()).find("messages[1].role 'tool'"), std::string::npos)
      << tool.status();
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
