// Grammar-constrained sampling through LlmEngine on the tiny preset (random weights, the real
// Qwen3 vocabulary): outputs are gibberish but must parse and validate against their schema.
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "base/sanitizers.h"
#include "engine/engine_test_util.h"
#include "gmock/gmock.h"
#include "grammar/json_schema_test_util.h"
#include "gtest/gtest.h"
#include "simpler/engine/llm_engine.h"
#include "simpler/grammar/gbnf.h"
#include "simpler/grammar/json_schema.h"
#include "simpler/grammar/regex.h"

namespace simpler::llm {
namespace {

using grammar::testing::ojson;

class StructuredOutputTest : public TinyTextModelTest<StructuredOutputTest> {
 public:
  static constexpr const char* kDirPrefix = "simpler_structured_output_test_";

 protected:
  static std::unique_ptr<LlmEngine> engine(int depth, bool with_tokenizer = true) {
    EngineOptions eo = small_engine_options(depth, 256, 64, 8, 16);
    if (with_tokenizer) eo.tokenizer = tokenizer_;
    return create_test_engine(*dir_, eo);
  }
  struct Out {
    std::vector<int32_t> tokens;
    std::string text;
    std::vector<TokenLogprob> logprobs;
    OutputFinish finish = OutputFinish::kNone;
    absl::Status error;
  };
  static Out drain(LlmEngine& e, RequestId id) {
    Out o;
    while (true) {
      auto out = e.next_output(id, base::Deadline::after(std::chrono::seconds(120)));
      EXPECT_TRUE(out.ok()) << out.status();
      if (!out.ok()) return o;
      o.tokens.insert(o.tokens.end(), out->token_ids.begin(), out->token_ids.end());
      o.text += out->text;
      o.logprobs.insert(o.logprobs.end(), out->logprobs.begin(), out->logprobs.end());
      if (out->finished()) {
        o.finish = out->finish;
        o.error = out->error;
        return o;
      }
    }
  }
  static RequestSpec spec(std::shared_ptr<const grammar::Grammar> g, std::optional<uint64_t> seed,
                          int64_t max_tokens) {
    RequestSpec s;
    s.prompt_ids = tokenizer_->encode("Reply in JSON:");
    s.max_tokens = max_tokens;
    s.sampling.temperature = seed.has_value() ? 1.0f : 0.0f;
    s.sampling.seed = seed;
    s.sampling.grammar = std::move(g);
    return s;
  }
  // Every token keeps the output a valid prefix (checked by advancing a fresh parser by each
  // token's bytes); a stop id only ends a complete output, and its text is not output (the
  // output text is the sentence, EOS's "<|endoftext|>" not appended). Returns the output's bytes.
  static std::string check_tokens(const std::shared_ptr<const grammar::Grammar>& g, const Out& o) {
    grammar::GrammarMatcher m(g);
    std::string bytes;
    for (size_t i = 0; i < o.tokens.size(); ++i) {
      const int32_t t = o.tokens[i];
      const std::string b = tokenizer_->decode_bytes(std::span<const int32_t>(&t, 1), true);
      if (b.empty()) {
        EXPECT_EQ(i + 1, o.tokens.size()) << "a special token before the end";
        EXPECT_TRUE(m.complete()) << "a stop id before the output was complete: " << bytes;
        break;
      }
      EXPECT_TRUE(m.advance(b)) << "token " << t << " ('" << b << "') after '" << bytes << "'";
      bytes += b;
    }
    if (o.finish == OutputFinish::kStop) {
      EXPECT_TRUE(m.complete()) << bytes;
      EXPECT_EQ(o.text, bytes);
    }
    return bytes;
  }
};

TEST_F(StructuredOutputTest, ConstrainedGreedyAndSeededOutputsParseAndValidate) {
  auto e = engine(2);
  const std::vector<std::string> schemas = {
      R"({"type":"object","properties":{"name":{"type":"string","enum":["ada","bob"]},
          "age":{"type":"integer"},"ok":{"type":"boolean"}},"required":["name","ok"],
          "additionalProperties":false})",
      R"({"type":"array","items":{"anyOf":[{"type":"null"},{"const":"x"}]},"minItems":2,
          "maxItems":4})",
      R"({"enum":["red","green",{"k":[1,2]}]})",
  };
  int complete = 0;
  for (const std::string& text : schemas) {
    const auto g = grammar::compile_json_schema(text).value();
    const ojson schema = ojson::parse(text);
    for (std::optional<uint64_t> seed :
         {std::optional<uint64_t>(), std::optional<uint64_t>(7), std::optional<uint64_t>(8)}) {
      const Out o = drain(*e, e->add_request(spec(g, seed, 48)).value());
      ASSERT_TRUE(o.finish == OutputFinish::kStop || o.finish == OutputFinish::kLength) << o.error;
      const std::string bytes = check_tokens(g, o);
      if (o.finish != OutputFinish::kStop) continue;
      ++complete;
      ojson value;
      ASSERT_NO_THROW(value = grammar::testing::parse_output(bytes)) << bytes;
      EXPECT_TRUE(grammar::testing::validate(value, schema, schema)) << bytes;
    }
  }
  EXPECT_GE(complete, 6) << "most short-language outputs finish within 48 tokens";
}

// Seeded constrained requests are batch-invariant (alone at depth 1 or beside others at depth 2)
// and do not change the tokens of unconstrained requests running beside them.
TEST_F(StructuredOutputTest, SeededConstrainedTokensAreBatchInvariantAndNeighboursUnchanged) {
  const auto g = grammar::json_object_grammar();
  RequestSpec plain;
  plain.prompt_ids = tokenizer_->encode("Once upon a time");
  plain.max_tokens = 24;
  plain.sampling.seed = 3;
  plain.sampling.ignore_eos = true;
  std::vector<int32_t> solo_c, solo_p;
  {
    auto e = engine(1);
    solo_c = drain(*e, e->add_request(spec(g, 11, 24)).value()).tokens;
    solo_p = drain(*e, e->add_request(plain).value()).tokens;
  }
  auto e = engine(2);
  std::vector<RequestId> ids;
  for (int i = 0; i < 3; ++i) {
    ids.push_back(e->add_request(spec(g, 11, 24)).value());
    ids.push_back(e->add_request(plain).value());
  }
  for (size_t i = 0; i < ids.size(); ++i) {
    const Out o = drain(*e, ids[i]);
    EXPECT_EQ(o.tokens, i % 2 == 0 ? solo_c : solo_p) << "request " << i;
  }
  const EngineMetrics m = e->metrics();
  EXPECT_GT(m.grammar_mask_time_s.count, 0);
  RecordProperty("mask_ms_mean", std::to_string(1e3 * m.grammar_mask_time_s.sum /
                                                std::max<int64_t>(1, m.grammar_mask_time_s.count)));
}

// Host sampling (RunnerOptions::host_sampling) applies the same mask with the same math: the
// same seeded constrained tokens as the device sampler.
TEST_F(StructuredOutputTest, HostSamplingGivesTheDeviceSamplersConstrainedTokens) {
  const auto g = grammar::json_object_grammar();
  std::vector<int32_t> device;
  {
    auto e = engine(2);
    device = drain(*e, e->add_request(spec(g, 21, 20)).value()).tokens;
  }
  EngineOptions eo = small_engine_options(1, 256, 64, 8, 16);
  eo.runner.host_sampling = true;
  eo.tokenizer = tokenizer_;
  auto e = create_test_engine(*dir_, eo);
  const Out host = drain(*e, e->add_request(spec(g, 21, 20)).value());
  EXPECT_EQ(host.tokens, device);
  check_tokens(g, host);
}

TEST_F(StructuredOutputTest, AGrammarNeedsATokenizer) {
  auto e = engine(1, /*with_tokenizer=*/false);
  auto id = e->add_request(spec(grammar::json_object_grammar(), std::nullopt, 4));
  ASSERT_FALSE(id.ok());
  EXPECT_EQ(id.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(id.status().message(),
            "a grammar (structured output) needs a tokenizer; the engine was created without one");
}

// A choice whose output is complete and cannot continue stops there, without waiting for EOS.
TEST_F(StructuredOutputTest, AFinishedChoiceStopsAtOnce) {
  auto e = engine(2);
  const auto g = grammar::choice_grammar({"yes", "no"}).value();
  const Out o = drain(*e, e->add_request(spec(g, 5, 30)).value());
  EXPECT_EQ(o.finish, OutputFinish::kStop);
  const std::string text = check_tokens(g, o);
  EXPECT_THAT(text, ::testing::AnyOf("yes", "no"));
}

// Under a grammar the alternatives of logprobs are tokens the mask allows, each with a finite
// logprob (a masked token has none, and -inf is no JSON number), at most as many as asked.
TEST_F(StructuredOutputTest, LogprobAlternativesAreOnlyTokensTheMaskAllows) {
  auto e = engine(2);
  const auto g = grammar::choice_grammar({"yes", "no", "maybe"}).value();
  RequestSpec s = spec(g, std::nullopt, 30);
  s.sampling.logprobs = 5;
  const Out o = drain(*e, e->add_request(s).value());
  EXPECT_EQ(o.finish, OutputFinish::kStop);
  check_tokens(g, o);
  ASSERT_EQ(o.logprobs.size(), o.tokens.size());
  size_t fewer = 0;
  for (size_t i = 0; i < o.logprobs.size(); ++i) {
    EXPECT_TRUE(std::isfinite(o.logprobs[i].logprob));
    EXPECT_LE(o.logprobs[i].top.size(), 5u);
    EXPECT_FALSE(o.logprobs[i].top.empty());
    fewer += o.logprobs[i].top.size() < 5 ? 1 : 0;
    for (const auto& [id, lp] : o.logprobs[i].top) {
      EXPECT_TRUE(std::isfinite(lp)) << "token " << id << " at " << i;
    }
  }
  EXPECT_GT(fewer, 0u) << "a three-way choice leaves fewer than 5 tokens somewhere";
}

// PCRE2's verdict on `text` matching `pattern` in full.
bool pcre2_full_match(const std::string& pattern, const std::string& text) {
  int code = 0;
  PCRE2_SIZE offset = 0;
  pcre2_code* re =
      pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                    PCRE2_UTF | PCRE2_ANCHORED | PCRE2_ENDANCHORED | PCRE2_DOLLAR_ENDONLY, &code,
                    &offset, nullptr);
  EXPECT_NE(re, nullptr) << pattern;
  if (re == nullptr) return false;
  pcre2_match_data* md = pcre2_match_data_create(4, nullptr);
  const int rc =
      pcre2_match(re, reinterpret_cast<PCRE2_SPTR>(text.data()), text.size(), 0, 0, md, nullptr);
  pcre2_match_data_free(md);
  pcre2_code_free(re);
  return rc >= 0;
}

// Regex-constrained outputs (greedy and seeded) keep a valid prefix at every token, and every
// finished one matches its pattern in full by PCRE2; a pattern whose sentence cannot continue
// stops there, one that can continue ends at EOS only when complete.
TEST_F(StructuredOutputTest, RegexOutputsMatchTheirPatternByPcre2) {
  auto e = engine(2);
  const std::vector<std::string> patterns = {R"(\w+@\w+\.com)",
                                             R"(\(\d{3}\) \d{3}-\d{4})",
                                             "(yes|no)[.!]",
                                             "[A-Z][a-z]{1,8}( [A-Z][a-z]{1,8}){0,2}",
                                             "-?(0|[1-9]\\d{0,5})(\\.\\d{1,3})?",
                                             "\u00e9t\u00e9|caf\u00e9|\u4e2d+"};
  int finished = 0;
  for (const std::string& p : patterns) {
    const auto g = grammar::compile_regex(p).value();
    for (std::optional<uint64_t> seed : {std::optional<uint64_t>(), std::optional<uint64_t>(3)}) {
      const Out o = drain(*e, e->add_request(spec(g, seed, 24)).value());
      ASSERT_TRUE(o.finish == OutputFinish::kStop || o.finish == OutputFinish::kLength) << o.error;
      const std::string bytes = check_tokens(g, o);
      if (o.finish != OutputFinish::kStop) continue;
      ++finished;
      EXPECT_TRUE(pcre2_full_match(p, bytes)) << "/" << p << "/ -> '" << bytes << "'";
    }
  }
  EXPECT_GE(finished, 6);
}

// A GBNF grammar (llama.cpp's notation) constrains the output the same way.
TEST_F(StructuredOutputTest, GbnfOutputsAreSentencesOfTheirGrammar) {
  auto e = engine(2);
  const auto g = grammar::compile_gbnf(
                     "root ::= \"(\" pair (\", \" pair){0,2} \")\"\n"
                     "pair ::= [a-z]{1,4} \"=\" [0-9]{1,3}\n")
                     .value();
  for (std::optional<uint64_t> seed : {std::optional<uint64_t>(), std::optional<uint64_t>(9)}) {
    const Out o = drain(*e, e->add_request(spec(g, seed, 40)).value());
    ASSERT_TRUE(o.finish == OutputFinish::kStop || o.finish == OutputFinish::kLength) << o.error;
    const std::string bytes = check_tokens(g, o);
    if (o.finish == OutputFinish::kStop) {
      EXPECT_TRUE(
          pcre2_full_match(R"(\([a-z]{1,4}=[0-9]{1,3}(, [a-z]{1,4}=[0-9]{1,3}){0,2}\))", bytes))
          << bytes;
    }
  }
}

// Random schemas x seeds: every output that finished validates against its schema, every token
// of every output kept it a valid prefix.
TEST_F(StructuredOutputTest, RandomSchemasAndSeedsOnlyEverProduceValidOutputs) {
  auto e = engine(2);
  const int kSchemas = SIMPLER_SANITIZED ? 40 : 200;  // the sanitizers run the model 10x slower
  int finished = 0;
  std::vector<std::pair<RequestId, ojson>> running;
  std::vector<std::shared_ptr<const grammar::Grammar>> grammars;
  auto finish_all = [&] {
    for (size_t i = 0; i < running.size(); ++i) {
      const Out o = drain(*e, running[i].first);
      ASSERT_TRUE(o.finish == OutputFinish::kStop || o.finish == OutputFinish::kLength) << o.error;
      const std::string bytes = check_tokens(grammars[i], o);
      if (o.finish != OutputFinish::kStop) continue;
      ++finished;
      ojson value;
      ASSERT_NO_THROW(value = grammar::testing::parse_output(bytes)) << bytes;
      EXPECT_TRUE(grammar::testing::validate(value, running[i].second, running[i].second))
          << bytes << "\nschema " << running[i].second.dump();
    }
    running.clear();
    grammars.clear();
  };
  for (int i = 0; i < kSchemas; ++i) {
    std::mt19937_64 rng(77 + i);
    ojson defs = ojson::object();
    ojson schema = grammar::testing::random_schema(rng, 2, defs);
    if (!defs.empty()) schema["$defs"] = defs;
    auto g = grammar::compile_json_schema(schema.dump());
    if (!g.ok()) continue;  // an empty language (grammar_test pins those)
    grammars.push_back(*g);
    running.emplace_back(e->add_request(spec(*g, rng(), 24)).value(), schema);
    if (running.size() == 8) finish_all();
  }
  finish_all();
  EXPECT_GT(finished, 0);
}

}  // namespace
}  // namespace simpler::llm
