// LlmEngine and Qwen3ModelRunner on the sim device with a small generated model.
#include <filesystem>
#include <random>
#include <thread>

#include "gtest/gtest.h"
#include "simpler/llm/llm_engine.h"
#include "simpler/llm/make_model.h"

namespace simpler::llm {
namespace {

bool contains(const absl::Status& s, const std::string& needle) {
  return std::string(s.message()).find(needle) != std::string::npos;
}

// A small model (vocab 512) written once per test binary.
class LlmEngineTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::string((std::filesystem::temp_directory_path() /
                            ("simpler_llm_engine_test_" + std::to_string(::getpid())))
                               .string());
    MakeModelOptions o;
    o.preset = "tiny";
    o.seed = 3;
    o.dtype = task::DataType::kFloat32;
    o.out_dir = *dir_;
    o.overrides.vocab_size = 512;
    o.overrides.hidden_size = 64;
    o.overrides.intermediate_size = 128;
    o.overrides.head_dim = 32;
    o.overrides.num_attention_heads = 4;
    o.overrides.num_key_value_heads = 1;
    ASSERT_TRUE(make_model(o).ok());
  }
  static void TearDownTestSuite() {
    std::filesystem::remove_all(*dir_);
    delete dir_;
  }

  static EngineOptions options(int depth, int pages = 256, int budget = 64, int seqs = 16,
                               int page_size = 4) {
    EngineOptions eo;
    eo.runner.worker.num_cores = 2;
    eo.runner.worker.launch_depth = depth;
    eo.runner.worker.faults.emplace();
    eo.runner.page_size = page_size;
    eo.runner.num_pages = pages;
    eo.runner.max_num_batched_tokens = budget;
    eo.runner.max_num_seqs = seqs;
    return eo;
  }

  static std::unique_ptr<LlmEngine> engine(const EngineOptions& eo) {
    auto e = LlmEngine::create(*dir_, eo);
    EXPECT_TRUE(e.ok()) << e.status();
    return e.ok() ? std::move(e).value() : nullptr;
  }

  struct Done {
    std::vector<int32_t> tokens;
    OutputFinish finish = OutputFinish::kNone;
    absl::Status error;
    int64_t completion_tokens = 0;
    std::vector<int32_t> pages;
  };
  // Reads every event of a one-choice request until its final one.
  static Done drain(LlmEngine& e, RequestId id, double timeout_s = 60) {
    Done d;
    while (true) {
      auto out = e.next_output(id, base::Deadline::after(std::chrono::milliseconds(
                                       static_cast<int64_t>(timeout_s * 1000))));
      if (!out.ok()) {
        ADD_FAILURE() << "request " << id << ": " << out.status();
        return d;
      }
      d.tokens.insert(d.tokens.end(), out->token_ids.begin(), out->token_ids.end());
      if (out->finished()) {
        d.finish = out->finish;
        d.error = out->error;
        d.completion_tokens = out->completion_tokens;
        d.pages = out->pages;
        return d;
      }
    }
  }

  static RequestSpec greedy(std::vector<int32_t> prompt, int64_t max_tokens) {
    RequestSpec s;
    s.prompt_ids = std::move(prompt);
    s.max_tokens = max_tokens;
    s.sampling.temperature = 0;
    s.sampling.ignore_eos = true;
    return s;
  }

  static std::vector<std::vector<int32_t>> prompts() {
    return {{1, 2, 3}, {7}, {10, 11, 12, 13, 14, 15, 16, 17, 18}, {400, 5}};
  }

  // Greedy tokens of every prompt, run alone at depth 1 with budget 1 (one
  // position per step: the plainest schedule).
  static std::vector<std::vector<int32_t>> solo_tokens(
      const std::vector<std::vector<int32_t>>& ps, int64_t max_tokens) {
    std::vector<std::vector<int32_t>> out;
    auto e = engine(options(1, 256, 1, 1));
    for (const auto& p : ps) {
      auto id = e->add_request(greedy(p, max_tokens));
      EXPECT_TRUE(id.ok()) << id.status();
      Done d = drain(*e, *id);
      EXPECT_EQ(d.finish, OutputFinish::kLength);
      out.push_back(d.tokens);
    }
    EXPECT_TRUE(e->shutdown().ok());
    return out;
  }

  static std::string* dir_;
};
std::string* LlmEngineTest::dir_ = nullptr;

TEST_F(LlmEngineTest, TokensAreIdenticalAtEveryDepthBudgetAndWithHostSampling) {
  const auto ps = prompts();
  const auto solo = solo_tokens(ps, 8);
  struct Config {
    int depth, budget;
    bool host;
  };
  for (const Config c : {Config{1, 64, false}, Config{2, 7, false}, Config{3, 64, false},
                         Config{2, 16, true}}) {
    SCOPED_TRACE(testing::Message() << "depth " << c.depth << " budget " << c.budget << " host "
                                    << c.host);
    EngineOptions eo = options(c.depth, 256, c.budget, std::min(16, c.budget));
    eo.runner.host_sampling = c.host;
    auto e = engine(eo);
    std::vector<RequestId> ids;
    for (const auto& p : ps) ids.push_back(e->add_request(greedy(p, 8)).value());
    for (size_t i = 0; i < ids.size(); ++i) {
      Done d = drain(*e, ids[i]);
      EXPECT_EQ(d.finish, OutputFinish::kLength);
      EXPECT_EQ(d.tokens, solo[i]) << "prompt " << i;
    }
    EXPECT_TRUE(e->shutdown().ok());
  }
}

}  // namespace
}  // namespace simpler::llm
