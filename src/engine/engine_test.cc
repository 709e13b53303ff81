// LlmEngine and Qwen3ModelRunner on the sim device with a small generated model.
#include <algorithm>
#include <bit>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "base/sanitizers.h"
#include "base/test_status.h"
#include "base/test_wait.h"
#include "engine/engine_test_hooks.h"
#include "engine/engine_test_util.h"
#include "engine/model_runner.h"
#include "engine/reference_model_test_util.h"
#include "gtest/gtest.h"
#include "hierarchy/endpoint.h"
#include "simpler/device/fault_plan.h"
#include "simpler/engine/data_parallel.h"
#include "simpler/engine/llm_engine.h"
#include "simpler/hierarchy/l3_worker.h"
#include "simpler/model/make_model.h"
#include "simpler/model/qwen3_program.h"
#include "simpler/tokenizer/tokenizer.h"

namespace simpler::llm {
namespace {

// Sanitizer builds run 5-20x slower: the heaviest tests shrink there.
constexpr bool kSanitized = SIMPLER_SANITIZED;

using simpler::testing::contains;

// A small model (vocab 512) written once per test binary.
class LlmEngineTest : public ::testing::Test {
 public:  // the helpers below serve free functions of this file too
  static void SetUpTestSuite() {
    dir_ = new std::string(test_model_dir("simpler_llm_engine_test_"));
    ASSERT_TRUE(make_model(small_test_model_options(*dir_, 3)).ok());
  }
  static void TearDownTestSuite() {
    std::filesystem::remove_all(*dir_);
    delete dir_;
  }

  static EngineOptions options(int depth, int pages = 256, int budget = 64, int seqs = 16,
                               int page_size = 4) {
    return small_engine_options(depth, pages, budget, seqs, page_size);
  }

  static std::unique_ptr<LlmEngine> engine(const EngineOptions& eo) {
    return create_test_engine(*dir_, eo);
  }
  // options(), capturing the step program when `capture` (RunnerOptions::capture).
  static EngineOptions captured(EngineOptions eo, bool capture) {
    eo.runner.capture = capture;
    return eo;
  }
  // With capture on, steps were captured and (where `shapes_repeat`: the test's steps are sure
  // to repeat a shape) replayed; with it off, nothing was captured.
  static void expect_replays(const LlmEngine& e, bool capture, bool shapes_repeat = true) {
    const worker::CaptureStats s = EngineTestAccess::capture_stats(e);
    if (capture) {
      EXPECT_GT(s.captures, 0u);
      if (shapes_repeat) {
        EXPECT_GT(s.replays, 0u);
      }
    } else {
      EXPECT_EQ(s.captures + s.replays, 0u);
    }
  }

  // Writes a bf16 variant of the test model (seed `seed`; hidden and intermediate sizes as
  // given, the test model's when 0) beside it in `<dir>_<suffix>`, and returns that folder.
  static void make_bf16_model(const std::string& suffix, uint64_t seed, std::string* out,
                              int64_t hidden = 0, int64_t intermediate = 0) {
    *out = *dir_ + "_" + suffix;
    MakeModelOptions mo = small_test_model_options(*out, seed);
    mo.dtype = task::DataType::kBFloat16;
    if (hidden != 0) mo.overrides.hidden_size = hidden;
    if (intermediate != 0) mo.overrides.intermediate_size = intermediate;
    ASSERT_TRUE(make_model(mo).ok());
  }

  struct Done {
    std::vector<int32_t> tokens;
    OutputFinish finish = OutputFinish::kNone;
    absl::Status error;
    int64_t completion_tokens = 0;
    int64_t cached_tokens = 0;
    std::vector<int32_t> pages;
    std::map<int64_t, std::vector<float>> logits;  // RequestHooks::logits_tokens hits
  };
  // Reads every event of a one-choice request until its final one.
  static Done drain(LlmEngine& e, RequestId id, double timeout_s = 60) {
    Done d;
    while (true) {
      auto out = e.next_output(
          id,
          base::Deadline::after(std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000))));
      if (!out.ok()) {
        ADD_FAILURE() << "request " << id << ": " << out.status();
        return d;
      }
      d.tokens.insert(d.tokens.end(), out->token_ids.begin(), out->token_ids.end());
      for (auto& [k, v] : hooks_of(*out).logits) d.logits[k] = v;
      if (out->finished()) {
        d.finish = out->finish;
        d.error = out->error;
        d.completion_tokens = out->completion_tokens;
        d.cached_tokens = out->cached_tokens;
        d.pages = hooks_of(*out).pages;
        return d;
      }
    }
  }

  // Asks for the raw logits of these output tokens (RequestHooks::logits_tokens).
  static void ask_logits(RequestSpec& s, std::set<int64_t> tokens) {
    auto hooks = std::make_shared<RequestHooks>();
    hooks->logits_tokens = std::move(tokens);
    s.hooks = std::move(hooks);
  }

  static std::vector<std::vector<int32_t>> prompts() {
    return {{1, 2, 3}, {7}, {10, 11, 12, 13, 14, 15, 16, 17, 18}, {400, 5}};
  }

  // Greedy tokens of every prompt, run alone at depth 1 with budget 1 (one
  // position per step: the plainest schedule).
  static std::vector<std::vector<int32_t>> solo_tokens(const std::vector<std::vector<int32_t>>& ps,
                                                       int64_t max_tokens) {
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
    bool capture = false;
  };
  for (const Config c :
       {Config{1, 64, false}, Config{2, 7, false}, Config{3, 64, false}, Config{2, 16, true},
        Config{1, 64, false, true}, Config{2, 7, false, true}, Config{2, 16, true, true}}) {
    SCOPED_TRACE(::testing::Message() << "depth " << c.depth << " budget " << c.budget << " host "
                                      << c.host << " capture " << c.capture);
    EngineOptions eo = options(c.depth, 256, c.budget, std::min(16, c.budget));
    eo.runner.host_sampling = c.host;
    eo.runner.capture = c.capture;
    auto e = engine(eo);
    std::vector<RequestId> ids;
    for (const auto& p : ps) ids.push_back(e->add_request(greedy(p, 8)).value());
    for (size_t i = 0; i < ids.size(); ++i) {
      Done d = drain(*e, ids[i]);
      EXPECT_EQ(d.finish, OutputFinish::kLength);
      EXPECT_EQ(d.tokens, solo[i]) << "prompt " << i;
    }
    expect_replays(*e, c.capture);
    EXPECT_TRUE(e->shutdown().ok());
  }
}

// 32 distinct prompts of 1-300 tokens arriving at random moments while steps
// run: every request's tokens equal its solo run, at depth 1 and 2 and budgets
// 1, 7 and 64 (the solo runs match the float64 reference: e2e writer_* scenarios).
TEST_F(LlmEngineTest, RequestsArrivingWhileStepsRunGetTheirSoloTokens) {
  // At budget 1 every prompt token is a step of its own: 16 prompts of up to 160 tokens are
  // ~1,300 steps per depth, enough for arrivals to land in every phase of a step.
  const auto ps = kSanitized ? random_prompts(10, 100, 7) : random_prompts(16, 160, 7);
  const auto solo = solo_tokens(ps, 6);
  for (int depth : {1, 2}) {
    for (int budget : {1, 7, 64}) {
      // Captured at one depth each: a budget's step shapes are the same at both.
      const bool capture = (depth == 2) == (budget != 7);
      SCOPED_TRACE(::testing::Message()
                   << "depth " << depth << " budget " << budget << " capture " << capture);
      auto e = engine(captured(options(depth, 1024, budget, std::min(16, budget)), capture));
      std::mt19937 rng(depth * 100 + budget);
      std::vector<RequestId> ids;
      for (const auto& p : ps) {
        ids.push_back(e->add_request(greedy(p, 6)).value());
        simpler::testing::spin_for(  // jitter: the arrival falls somewhere in a step
            std::chrono::microseconds(std::uniform_int_distribution<int>(0, 3000)(rng)));
      }
      for (size_t i = 0; i < ids.size(); ++i) {
        Done d = drain(*e, ids[i]);
        EXPECT_EQ(d.finish, OutputFinish::kLength) << "prompt " << i;
        EXPECT_EQ(d.tokens, solo[i]) << "prompt " << i << " of " << ps[i].size() << " tokens";
      }
      // Arrivals at random moments make budget 7's and 64's chunk lengths, so their step shapes,
      // a matter of timing: only budget 1's steps (one token of one row) surely repeat.
      expect_replays(*e, capture, /*shapes_repeat=*/budget == 1);
      EXPECT_TRUE(e->shutdown().ok());
    }
  }
}

// A pool too small for every request at once: preemption by recompute leaves
// every request's tokens unchanged.
TEST_F(LlmEngineTest, PreemptionByRecomputeLeavesTokensUnchanged) {
  const auto ps = random_prompts(12, 40, 11);
  const auto solo = solo_tokens(ps, 24);
  for (int depth : {1, 2}) {
    const bool capture = depth == 2;
    SCOPED_TRACE(::testing::Message() << "depth " << depth << " capture " << capture);
    // Pages of 4 tokens; a request needs up to 16; 24 pages hold ~2 at a time.
    auto e = engine(captured(options(depth, 24, 32, 8), capture));
    EngineTestAccess::set_check_invariants(*e, true);
    std::vector<RequestId> ids;
    for (const auto& p : ps) ids.push_back(e->add_request(greedy(p, 24)).value());
    for (size_t i = 0; i < ids.size(); ++i) {
      Done d = drain(*e, ids[i]);
      EXPECT_EQ(d.finish, OutputFinish::kLength) << "prompt " << i;
      EXPECT_EQ(d.tokens, solo[i]) << "prompt " << i;
    }
    const EngineMetrics m = e->metrics();
    EXPECT_GT(m.preemptions_total, 0);
    expect_replays(*e, capture);
    EXPECT_TRUE(EngineTestAccess::invariant_violation(*e).ok())
        << EngineTestAccess::invariant_violation(*e);
    EXPECT_TRUE(e->shutdown().ok());
    const EngineMetrics after = e->metrics();
    EXPECT_EQ(after.kv_pages.free, after.kv_pages_total) << "pages leaked";
  }
}

TEST_F(LlmEngineTest, RandomAbortsLeaveTheOtherRequestsUnchanged) {
  const auto ps = random_prompts(16, 30, 13);
  const auto solo = solo_tokens(ps, 12);
  for (bool capture : {false, true}) {
    SCOPED_TRACE(::testing::Message() << "capture " << capture);
    auto e = engine(captured(options(2, 64, 16, 8), capture));
    std::vector<RequestId> ids;
    for (const auto& p : ps) ids.push_back(e->add_request(greedy(p, 12)).value());
    std::set<size_t> aborted = {1, 4, 5, 9, 14};
    for (size_t i : aborted) {
      simpler::testing::spin_for(std::chrono::milliseconds(1));  // jitter: aborts land mid-decode
      absl::Status s = e->abort(ids[i]);
      EXPECT_TRUE(s.ok() || s.code() == absl::StatusCode::kNotFound) << s;
    }
    for (size_t i = 0; i < ids.size(); ++i) {
      Done d = drain(*e, ids[i]);
      if (aborted.count(i)) {
        // Aborted, or finished before the abort landed: a prefix of its solo tokens either way.
        EXPECT_TRUE(d.finish == OutputFinish::kAbort || d.finish == OutputFinish::kLength);
        EXPECT_EQ(d.tokens,
                  std::vector<int32_t>(solo[i].begin(), solo[i].begin() + d.tokens.size()));
      } else {
        EXPECT_EQ(d.finish, OutputFinish::kLength) << "prompt " << i;
        EXPECT_EQ(d.tokens, solo[i]) << "prompt " << i;
      }
    }
    // After the final event: NOT_FOUND, nothing changes.
    EXPECT_EQ(e->abort(ids[0]).code(), absl::StatusCode::kNotFound);
    EXPECT_EQ(e->abort(987654).code(), absl::StatusCode::kNotFound);
    expect_replays(*e, capture);
    EXPECT_TRUE(e->shutdown().ok());
  }
}

TEST_F(LlmEngineTest, AbortOfAQueuedRequestEndsItWithoutRunning) {
  // One running request at a time. a needs 3,000 steps (hundreds of ms even on the fastest
  // kernels), so it still holds the one slot when b's abort arrives and when its own does: with
  // 200 tokens it sometimes finished first (its abort then NOT_FOUND) once steps got faster.
  auto e = engine(options(1, 800, 8, 1));
  auto a = e->add_request(greedy({1, 2, 3}, 3000)).value();
  auto b = e->add_request(greedy({4, 5}, 4)).value();  // waits behind a
  ASSERT_TRUE(e->abort(b).ok());
  Done db = drain(*e, b);
  EXPECT_EQ(db.finish, OutputFinish::kAbort);
  EXPECT_TRUE(db.tokens.empty());
  ASSERT_TRUE(e->abort(a).ok());
  EXPECT_EQ(drain(*e, a).finish, OutputFinish::kAbort);
  EXPECT_TRUE(e->shutdown().ok());
}

// greedy()'s request of 12 tokens, sampled instead (temperature 0.9, top_k 50, top_p 0.95) with
// RNG seed `seed`.
RequestSpec seeded(std::vector<int32_t> prompt, uint64_t seed) {
  RequestSpec s = greedy(std::move(prompt), 12);
  s.sampling.temperature = 0.9f;
  s.sampling.top_k = 50;
  s.sampling.top_p = 0.95f;
  s.sampling.frequency_penalty = 0.3f;
  s.sampling.seed = seed;
  return s;
}

// The message of add_request's InvalidArgument refusal of `s`; what it answered instead where
// it did not refuse it so.
std::string refusal(LlmEngine& e, const RequestSpec& s) {
  const absl::Status st = e.add_request(s).status();
  return st.code() == absl::StatusCode::kInvalidArgument
             ? std::string(st.message())
             : absl::StrCat("not refused as invalid: ", st.ToString());
}

// A seeded request's tokens are the same alone, in a batch of 16 distinct
// requests, at depth 1, 2 and 4, and after a forced preemption.
TEST_F(LlmEngineTest, ASeededRequestsTokensDoNotDependOnTheBatchDepthOrPreemption) {
  const std::vector<int32_t> prompt = {3, 1, 4, 1, 5, 9, 2, 6};
  std::vector<int32_t> alone;
  {
    auto e = engine(options(1));
    alone = drain(*e, e->add_request(seeded(prompt, 42)).value()).tokens;
    ASSERT_EQ(alone.size(), 12u);
    EXPECT_TRUE(e->shutdown().ok());
  }
  const auto others = random_prompts(15, 20, 17);
  for (int depth : {1, 2, 4}) {
    for (bool small_pool : {false, true}) {
      // Captured with the small pool (preemption) at depth 1 and 4, the large one at depth 2.
      const bool capture = small_pool == (depth != 2);
      SCOPED_TRACE(::testing::Message()
                   << "depth " << depth << " small pool " << small_pool << " capture " << capture);
      auto e = engine(captured(small_pool ? options(depth, 16, 32, 16) : options(depth), capture));
      std::vector<RequestId> ids;
      for (size_t i = 0; i < others.size(); ++i) {
        if (i == 7) ids.insert(ids.begin(), e->add_request(seeded(prompt, 42)).value());
        ids.push_back(e->add_request(seeded(others[i], 1000 + i)).value());
      }
      EXPECT_EQ(drain(*e, ids[0]).tokens, alone);
      for (size_t i = 1; i < ids.size(); ++i) drain(*e, ids[i]);
      if (small_pool) {
        EXPECT_GT(e->metrics().preemptions_total, 0);
      }
      expect_replays(*e, capture);
      EXPECT_TRUE(e->shutdown().ok());
    }
  }
}

// Captured decode steps run padded to their bucket (1, 2, 4, 8, 16, 32 rows): a batch that grows
// from 1 to 32 requests and shrinks back to 1 captures one graph per bucket, not one per size,
// and every request's tokens are its solo tokens.
TEST_F(LlmEngineTest, BatchesOfOneToThirtyTwoRowsCaptureAtMostSixGraphs) {
  constexpr int kRequests = 32;
  const int64_t max_tokens = kSanitized ? 72 : 100;
  std::vector<std::vector<int32_t>> ps;
  for (int k = 0; k < kRequests; ++k) ps.push_back({static_cast<int32_t>(3 * k + 1)});
  const auto solo = solo_tokens(ps, max_tokens);
  // One page per request (128 tokens): the block tables' width stays 1, so only the row count
  // chooses the graph.
  auto e = engine(captured(options(1, 40, 64, kRequests, 128), true));
  std::vector<RequestId> ids;
  std::vector<std::vector<int32_t>> first(kRequests);
  for (int k = 0; k < kRequests; ++k) {
    // Each request arrives once the one before it has its first token: the batch grows one row at
    // a time, and as they all ask the same number of tokens, it shrinks one row at a time.
    ids.push_back(e->add_request(greedy(ps[k], max_tokens)).value());
    auto out = e->next_output(ids.back(), base::Deadline::after(std::chrono::seconds(60)));
    ASSERT_TRUE(out.ok()) << out.status();
    first[k] = out->token_ids;
    ASSERT_FALSE(out->finished());
  }
  for (int k = 0; k < kRequests; ++k) {
    Done d = drain(*e, ids[k]);
    first[k].insert(first[k].end(), d.tokens.begin(), d.tokens.end());
    EXPECT_EQ(d.finish, OutputFinish::kLength) << "request " << k;
    EXPECT_EQ(first[k], solo[k]) << "request " << k;
  }
  const worker::CaptureStats s = EngineTestAccess::capture_stats(*e);
  EXPECT_LE(s.captures, 6u);
  EXPECT_LE(s.graphs, 6);
  EXPECT_EQ(s.evictions, 0u);
  // The last request's steps after its first (no arrival commits counts in them) were captured.
  EXPECT_GE(s.captures + s.replays, static_cast<uint64_t>(max_tokens - 1));
  EXPECT_GT(s.replays, 0u);
  EXPECT_TRUE(e->shutdown().ok());
}

// The padded rows of a captured step, against the same steps uncaptured: the real rows' samples
// and raw logits are bit-identical (a padded row's output reaches no real row), and every KV slot
// of the pool holds the same K and V (a padded row writes no KV page, a real request's or other).
TEST_F(LlmEngineTest, PaddedRowsOfACapturedStepTouchNoRealRowOrKvPage) {
  RunnerOptions ro = options(1, 8, 16, 8).runner;  // 8 pages of 4 tokens
  std::unique_ptr<Qwen3ModelRunner> runners[2];
  for (bool capture : {false, true}) {
    ro.capture = capture;
    auto r = Qwen3ModelRunner::create(*dir_, ro);
    ASSERT_TRUE(r.ok()) << r.status();
    runners[capture] = std::move(r).value();
  }
  constexpr int kRows = 3;
  std::vector<int32_t> tokens[2][kRows];
  SamplingParams params[kRows];
  for (int r = 0; r < kRows; ++r) {
    params[r].temperature = 0.8f;
    params[r].seed = 7 + r;
    for (bool capture : {false, true}) tokens[capture][r] = {10 + r, 20 + r, 30 + r};
  }
  // Step 0: each request's prompt (3 positions in page r; uncaptured either way: it commits the
  // prompt's token counts). Step 1: one decode row each (position 3, page r): 3 rows padded to 4.
  // Step 2: rows 0 and 1 only (position 4, page 3 + r): 2 rows, no padding.
  for (int step = 0; step < 3; ++step) {
    const int rows = step == 2 ? 2 : kRows;
    std::vector<int32_t> samples[2];
    std::vector<std::vector<float>> logits[2];
    for (bool capture : {false, true}) {
      StepPlan plan;
      plan.step_id = step;
      std::vector<RowInput> inputs;
      for (int r = 0; r < rows; ++r) {
        StepRow row;
        row.request_id = r + 1;
        row.start = step == 0 ? 0 : 2 + step;
        row.len = step == 0 ? 3 : 1;
        row.prefill = step == 0;
        row.logits = true;
        row.block_table = step < 2 ? std::vector<int32_t>{r} : std::vector<int32_t>{r, 3 + r};
        for (int64_t k = 0; k < row.len; ++k) {
          const int64_t pos = row.start + k;
          row.slots.push_back(row.block_table[pos / 4] * 4 + static_cast<int32_t>(pos % 4));
        }
        row.state_slot = r;
        row.fresh_state = step == 0;
        plan.rows.push_back(row);
        RowInput in;
        in.tokens = &tokens[capture][r];
        in.prompt_len = 3;
        in.params = &params[r];
        in.want_logits = true;
        inputs.push_back(in);
      }
      auto st = runners[capture]->submit(plan, inputs);
      ASSERT_TRUE(st.ok()) << st.status();
      ASSERT_TRUE((*st)->handle().wait().ok());
      auto out = runners[capture]->collect(**st);
      ASSERT_TRUE(out.ok()) << out.status();
      ASSERT_EQ(out->size(), static_cast<size_t>(rows)) << "capture " << capture;
      for (int r = 0; r < rows; ++r) {
        EXPECT_EQ((*out)[r].row, static_cast<size_t>(r));
        samples[capture].push_back((*out)[r].sample.id);
        logits[capture].push_back((*out)[r].logits);
        tokens[capture][r].push_back((*out)[r].sample.id);
      }
    }
    SCOPED_TRACE(::testing::Message() << "step " << step);
    EXPECT_EQ(samples[1], samples[0]);
    EXPECT_EQ(logits[1], logits[0]);
  }
  const worker::CaptureStats cs = runners[1]->worker()->capture_stats();
  EXPECT_EQ(cs.captures, 2u);  // steps 1 (4 rows) and 2 (2 rows)
  EXPECT_EQ(runners[0]->worker()->capture_stats().captures, 0u);
  for (int32_t slot = 0; slot < 8 * 4; ++slot) {
    auto a = runners[0]->read_kv(slot), b = runners[1]->read_kv(slot);
    ASSERT_TRUE(a.ok() && b.ok()) << a.status() << b.status();
    EXPECT_EQ(b->k, a->k) << "slot " << slot;
    EXPECT_EQ(b->v, a->v) << "slot " << slot;
  }
}

// A captured prefill chunk of 33 positions runs as 64 (the next power of two) within a budget of
// 128, and as the budget itself, 48, below that power; its sample and raw logits are the
// uncaptured chunk's.
TEST_F(LlmEngineTest, ACapturedPrefillChunkPadsToTheNextPowerOfTwoOrItsBudget) {
  std::vector<int32_t> tokens(37);  // the prompt
  for (int32_t k = 0; k < 37; ++k) tokens[k] = (7 * k + 3) % 512;
  SamplingParams params;
  params.temperature = 0;
  struct Case {
    bool capture;
    int budget;
    int64_t run;  // positions the chunk runs
  };
  std::vector<int32_t> samples;
  std::vector<std::vector<float>> logits;
  for (const Case c : {Case{false, 128, 33}, Case{true, 128, 64}, Case{true, 48, 48}}) {
    SCOPED_TRACE(::testing::Message() << "capture " << c.capture << " budget " << c.budget);
    RunnerOptions ro = options(1, 16, c.budget, 4).runner;
    ro.capture = c.capture;
    auto runner = Qwen3ModelRunner::create(*dir_, ro);
    ASSERT_TRUE(runner.ok()) << runner.status();
    // Step 0 prefills [0, 4) (uncaptured: it commits the prompt's counts); step 1 [4, 37).
    for (int step = 0; step < 2; ++step) {
      StepPlan plan;
      plan.step_id = step;
      StepRow row;
      row.request_id = 1;
      row.start = step == 0 ? 0 : 4;
      row.len = step == 0 ? 4 : 33;
      row.prefill = true;
      row.logits = step == 1;
      for (int32_t b = 0; b < 10; ++b) row.block_table.push_back(b);
      for (int64_t k = 0; k < row.len; ++k) row.slots.push_back(row.start + k);
      row.state_slot = 0;
      row.fresh_state = step == 0;
      plan.rows.push_back(row);
      RowInput in;
      in.tokens = &tokens;
      in.prompt_len = 37;
      in.params = &params;
      in.want_logits = true;
      auto st = (*runner)->submit(plan, std::span<const RowInput>(&in, 1));
      ASSERT_TRUE(st.ok()) << st.status();
      EXPECT_EQ((*st)->num_tokens(), step == 0 ? 4 : c.run);
      const absl::Status ran = (*st)->handle().wait();
      ASSERT_TRUE(ran.ok()) << ran;
      auto out = (*runner)->collect(**st);
      ASSERT_TRUE(out.ok()) << out.status();
      ASSERT_EQ(out->size(), step == 0 ? 0u : 1u);
      if (step == 1) {
        samples.push_back((*out)[0].sample.id);
        logits.push_back((*out)[0].logits);
      }
    }
  }
  ASSERT_EQ(samples.size(), 3u);
  EXPECT_EQ(samples[1], samples[0]);
  EXPECT_EQ(samples[2], samples[0]);
  EXPECT_EQ(logits[1], logits[0]);
  EXPECT_EQ(logits[2], logits[0]);
}

// ---- prefix caching (docs/design/prefix_cache.md) ----

struct Conversations {
  std::vector<std::vector<int32_t>> tokens;  // per (conversation, turn), in that order
  std::vector<int64_t> cached;               // cached_tokens of each
  EngineMetrics metrics;
};

// Three conversations of three turns that start with one shared 9-token system prompt; each
// turn's prompt is the previous turn's prompt and answer plus 3 new tokens. Conversation 2
// samples with a seed, the others greedily. The turns of the three conversations run together.
Conversations run_conversations(LlmEngine& e) {
  Conversations c;
  const std::vector<int32_t> system = {5, 6, 7, 8, 9, 10, 11, 12, 13};
  std::vector<std::vector<int32_t>> prompt(3, system);
  for (int turn = 0; turn < 3; ++turn) {
    std::vector<RequestId> ids;
    for (int conv = 0; conv < 3; ++conv) {
      for (int k = 0; k < 3; ++k) prompt[conv].push_back(100 + 10 * conv + turn * 3 + k);
      RequestSpec spec = conv == 2 ? seeded(prompt[conv], 77) : greedy(prompt[conv], 6);
      spec.max_tokens = 6;
      ids.push_back(e.add_request(spec).value());
    }
    for (int conv = 0; conv < 3; ++conv) {
      LlmEngineTest::Done d = LlmEngineTest::drain(e, ids[conv]);
      EXPECT_EQ(d.finish, OutputFinish::kLength) << "conversation " << conv << " turn " << turn;
      prompt[conv].insert(prompt[conv].end(), d.tokens.begin(), d.tokens.end());
      c.tokens.push_back(d.tokens);
      c.cached.push_back(d.cached_tokens);
    }
  }
  c.metrics = e.metrics();
  return c;
}

// Every token is the cache-off run's, greedy and seeded, at launch depth 1, 2 and 4, and with a
// pool small enough to preempt; later turns take their prefix from the cache.
TEST_F(LlmEngineTest, PrefixCachingLeavesMultiTurnTokensUnchangedAtEveryDepth) {
  Conversations off;
  {
    EngineOptions eo = options(1);
    eo.enable_prefix_caching = false;
    auto e = engine(eo);
    off = run_conversations(*e);
    EXPECT_TRUE(e->shutdown().ok());
  }
  for (int64_t cached : off.cached) EXPECT_EQ(cached, 0);
  EXPECT_EQ(off.metrics.prefix_cache_queries_total, 0);
  struct Config {
    int depth, pages;
  };
  for (const Config cfg : {Config{1, 256}, Config{2, 256}, Config{4, 256}, Config{2, 24}}) {
    SCOPED_TRACE(::testing::Message() << "depth " << cfg.depth << " pages " << cfg.pages);
    auto e = engine(options(cfg.depth, cfg.pages, 16, 4));
    EngineTestAccess::set_check_invariants(*e, true);
    const Conversations on = run_conversations(*e);
    EXPECT_EQ(on.tokens, off.tokens);
    // Turn 1 of conversations 1 and 2 finds at least the system prompt's 2 full pages; every
    // later turn at least its previous prompt's full pages.
    EXPECT_GE(on.cached[1], 8);
    EXPECT_GE(on.cached[2], 8);
    for (size_t i = 3; i < on.cached.size(); ++i) EXPECT_GE(on.cached[i], 12) << "turn " << i / 3;
    EXPECT_GT(on.metrics.prefix_cache_hits_total, 0);
    EXPECT_LT(on.metrics.prefix_cache_hits_total, on.metrics.prefix_cache_queries_total);
    EXPECT_TRUE(EngineTestAccess::invariant_violation(*e).ok())
        << EngineTestAccess::invariant_violation(*e);
    EXPECT_TRUE(e->shutdown().ok());
    const EngineMetrics after = e->metrics();
    EXPECT_EQ(after.kv_pages.free, after.kv_pages_total) << "pages leaked";
    EXPECT_GT(after.kv_pages_cached, 0);
  }
}

// n seeded choices of one prompt: the choices after the first map its full prompt pages
// (3 pages of 4 of the 13-token prompt each) and keep their own tokens.
TEST_F(LlmEngineTest, ChoicesOfOnePromptShareItsFullPagesAndKeepTheirTokens) {
  const std::vector<int32_t> prompt = {9, 8, 7, 6, 5, 4, 3, 2, 1, 2, 3, 4, 5};
  auto run = [&](bool caching) {
    EngineOptions eo = options(2);
    eo.enable_prefix_caching = caching;
    auto e = engine(eo);
    RequestSpec s = seeded(prompt, 5);
    s.n = 4;
    const RequestId id = e->add_request(s).value();
    std::vector<std::vector<int32_t>> tokens(4);
    std::vector<int64_t> cached(4);
    int finals = 0;
    while (finals < 4) {
      auto out = e->next_output(id, base::Deadline::after(std::chrono::seconds(60)));
      if (!out.ok()) {
        ADD_FAILURE() << out.status();
        break;
      }
      tokens[out->index].insert(tokens[out->index].end(), out->token_ids.begin(),
                                out->token_ids.end());
      if (out->finished()) cached[out->index] = out->cached_tokens;
      finals += out->finished() ? 1 : 0;
    }
    const EngineMetrics m = e->metrics();
    EXPECT_TRUE(e->shutdown().ok());
    return std::make_tuple(tokens, cached, m.prefix_cache_hits_total);
  };
  const auto [off_tokens, off_cached, off_hits] = run(false);
  const auto [on_tokens, on_cached, on_hits] = run(true);
  EXPECT_EQ(on_tokens, off_tokens);
  EXPECT_EQ(off_hits, 0);
  EXPECT_EQ(on_hits, 3 * 12);
  EXPECT_EQ(std::count(on_cached.begin(), on_cached.end(), 12), 3);
}

// A kernel error mid-prefill (a recoverable failure): the failed step's pages never serve a later
// request, which computes its prompt again and gets the tokens of a cache-off run.
TEST_F(LlmEngineTest, AFailedStepsPagesNeverServeALaterRequest) {
  const std::vector<int32_t> prompt = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11};
  std::vector<int32_t> want;
  {
    EngineOptions eo = options(1);
    eo.enable_prefix_caching = false;
    auto e = engine(eo);
    want = drain(*e, e->add_request(greedy(prompt, 5)).value()).tokens;
    EXPECT_TRUE(e->shutdown().ok());
  }
  EngineOptions eo = options(2, 256, 4, 4);  // budget 4: the prompt's prefill takes 3 steps
  eo.runner.worker.faults = device::FaultPlan::parse("run=1:task=2:kind=kernel_error").value();
  auto e = engine(eo);
  const Done failed = drain(*e, e->add_request(greedy(prompt, 5)).value());
  EXPECT_EQ(failed.finish, OutputFinish::kError);
  const Done again = drain(*e, e->add_request(greedy(prompt, 5)).value());
  EXPECT_EQ(again.finish, OutputFinish::kLength);
  EXPECT_EQ(again.tokens, want);
  EXPECT_LE(again.cached_tokens, 4) << "only run 0's page was proven";
  EXPECT_TRUE(e->shutdown().ok());
  EXPECT_EQ(e->metrics().kv_pages.free, e->metrics().kv_pages_total);
}

// reset_prefix_cache drops the cache: the next identical prompt is computed in full.
TEST_F(LlmEngineTest, ResetPrefixCacheMakesTheNextPromptComputeInFull) {
  auto e = engine(options(1));
  const std::vector<int32_t> prompt = {4, 4, 4, 4, 5, 5, 5, 5, 6};
  const Done first = drain(*e, e->add_request(greedy(prompt, 3)).value());
  const Done second = drain(*e, e->add_request(greedy(prompt, 3)).value());
  EXPECT_EQ(second.cached_tokens, 8);
  EXPECT_EQ(second.tokens, first.tokens);
  ASSERT_TRUE(e->reset_prefix_cache().ok());
  const Done third = drain(*e, e->add_request(greedy(prompt, 3)).value());
  EXPECT_EQ(third.cached_tokens, 0);
  EXPECT_EQ(third.tokens, first.tokens);
  EXPECT_TRUE(e->shutdown().ok());
  const absl::Status late = e->reset_prefix_cache();
  EXPECT_EQ(late.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(contains(late, "after shutdown began")) << late;
}

// Only ThreadSanitizer's runtime runs a thread of its own in this binary; elsewhere the process
// children must run.
#if SIMPLER_TSAN
#define ADD_FAILURE_IF_NOT_TSAN() (void)0
#else
#define ADD_FAILURE_IF_NOT_TSAN() \
  ADD_FAILURE() << hierarchy::process_thread_count() << " threads: process mode not tested"
#endif

// Data parallel over an L3 worker's two children (Qwen3DataParallel): each child loads the
// model in its setup (in its own process in process mode), one engine per child, requests split
// between them. Every request's tokens — greedy and seeded sampling — are those of one engine
// on one chip.
TEST_F(LlmEngineTest, DataParallelOverTwoL3ChildrenGivesEveryRequestItsSingleChipTokens) {
  std::vector<RequestSpec> specs;
  for (const auto& p : prompts()) specs.push_back(greedy(p, 8));
  const auto more = random_prompts(6, 20, 23);
  for (size_t i = 0; i < more.size(); ++i) specs.push_back(seeded(more[i], 500 + i));
  const EngineOptions eo = options(2, 128, 32, 8);
  std::vector<std::vector<int32_t>> single;
  {
    auto e = engine(eo);
    std::vector<RequestId> ids;
    for (const RequestSpec& s : specs) ids.push_back(e->add_request(s).value());
    for (RequestId id : ids) single.push_back(drain(*e, id).tokens);
    EXPECT_TRUE(e->shutdown().ok());
  }
  for (hierarchy::ChildMode mode :
       {hierarchy::ChildMode::kThread, hierarchy::ChildMode::kProcess}) {
    SCOPED_TRACE(hierarchy::name_of(mode));
    if (mode == hierarchy::ChildMode::kProcess && hierarchy::process_thread_count() != 1) {
      ADD_FAILURE_IF_NOT_TSAN();
      continue;  // ThreadSanitizer's own thread: nothing can be forked here
    }
    hierarchy::L3Options lo;
    lo.device_ids = {0, 1};
    lo.child_mode = mode;
    lo.child = eo.runner.worker;
    lo.launch_depth = 4;  // two engines, two steps in flight each
    lo.host_heap_bytes = 16 << 20;
    hierarchy::L3Worker l3(lo);
    auto dp = Qwen3DataParallel::prepare(l3, *dir_, eo.runner);
    ASSERT_TRUE(dp.ok()) << dp.status();
    EXPECT_EQ((*dp)->runner(0).status().code(), absl::StatusCode::kFailedPrecondition);
    ASSERT_TRUE(l3.init().ok());
    EXPECT_EQ((*dp)->runner(2).status().code(), absl::StatusCode::kInvalidArgument);
    std::vector<std::unique_ptr<LlmEngine>> engines;
    for (int32_t c = 0; c < 2; ++c) {
      auto r = (*dp)->runner(c);
      ASSERT_TRUE(r.ok()) << r.status();
      EXPECT_EQ((*r)->worker(), nullptr);
      EXPECT_EQ((*r)->read_kv(0).status().code(), absl::StatusCode::kFailedPrecondition);
      auto e = EngineTestAccess::create(std::move(*r), eo);
      ASSERT_TRUE(e.ok()) << e.status();
      engines.push_back(std::move(*e));
    }
    std::vector<RequestId> ids;
    for (size_t i = 0; i < specs.size(); ++i) {
      ids.push_back(engines[i % 2]->add_request(specs[i]).value());
    }
    for (size_t i = 0; i < specs.size(); ++i) {
      Done d = drain(*engines[i % 2], ids[i]);
      EXPECT_TRUE(d.error.ok()) << d.error;
      EXPECT_EQ(d.tokens, single[i]) << "request " << i << " on chip " << i % 2;
    }
    for (auto& e : engines) EXPECT_TRUE(e->shutdown().ok());
    EXPECT_GE(l3.next_level_dispatched(), 2u);
    EXPECT_TRUE(l3.close().ok());
  }
}

// Capture on where it cannot run (runners on L3 children) falls back to uncaptured steps instead
// of failing: prepare succeeds and says why, the runners' options say capture is off, and the
// tokens are a single chip's uncaptured tokens.
TEST_F(LlmEngineTest, CaptureOnOverL3ChildrenRunsUncapturedAndSaysWhy) {
  const std::vector<RequestSpec> specs = {greedy(prompts()[0], 6), seeded(prompts()[1], 77)};
  const EngineOptions eo = captured(options(2, 128, 32, 8), true);
  std::vector<std::vector<int32_t>> single;
  {
    auto e = engine(captured(eo, false));
    for (const RequestSpec& s : specs)
      single.push_back(drain(*e, e->add_request(s).value()).tokens);
    EXPECT_TRUE(e->shutdown().ok());
  }
  hierarchy::L3Options lo;
  lo.device_ids = {0};
  lo.child_mode = hierarchy::ChildMode::kThread;
  lo.child = eo.runner.worker;
  lo.host_heap_bytes = 16 << 20;
  hierarchy::L3Worker l3(lo);
  auto dp = LlmDataParallel::prepare(l3, *dir_, eo.runner);
  ASSERT_TRUE(dp.ok()) << dp.status();
  EXPECT_NE((*dp)->capture_off_reason().find("L3 mailbox"), std::string::npos)
      << (*dp)->capture_off_reason();
  ASSERT_TRUE(l3.init().ok());
  auto e = (*dp)->create_engine(0, eo);
  ASSERT_TRUE(e.ok()) << e.status();
  for (size_t i = 0; i < specs.size(); ++i) {
    Done d = drain(**e, (*e)->add_request(specs[i]).value());
    EXPECT_TRUE(d.error.ok()) << d.error;
    EXPECT_EQ(d.tokens, single[i]) << "request " << i;
  }
  EXPECT_TRUE((*e)->shutdown().ok());
  EXPECT_TRUE(l3.close().ok());
  // Without capture asked for there is nothing to say.
  hierarchy::L3Worker plain(lo);
  auto off = LlmDataParallel::prepare(plain, *dir_, captured(eo, false).runner);
  ASSERT_TRUE(off.ok()) << off.status();
  EXPECT_TRUE((*off)->capture_off_reason().empty());
}

// A child that cannot load the model (here: the checkpoint vanished after the parent checked
// it) fails init naming the child in thread mode; in process mode every step on it fails
// naming the child and the file, and the engine's requests end with that error.
TEST_F(LlmEngineTest, DataParallelChildThatCannotLoadTheModelIsNamed) {
  const std::string copy = *dir_ + "_dp_copy";
  for (hierarchy::ChildMode mode :
       {hierarchy::ChildMode::kThread, hierarchy::ChildMode::kProcess}) {
    SCOPED_TRACE(hierarchy::name_of(mode));
    if (mode == hierarchy::ChildMode::kProcess && hierarchy::process_thread_count() != 1) {
      ADD_FAILURE_IF_NOT_TSAN();
      continue;
    }
    std::filesystem::remove_all(copy);
    std::filesystem::copy(*dir_, copy);
    const EngineOptions eo = options(1);
    hierarchy::L3Options lo;
    lo.child_mode = mode;
    lo.child = eo.runner.worker;
    lo.host_heap_bytes = 4 << 20;
    hierarchy::L3Worker l3(lo);
    auto dp = Qwen3DataParallel::prepare(l3, copy, eo.runner);
    ASSERT_TRUE(dp.ok()) << dp.status();
    std::filesystem::remove(std::filesystem::path(copy) / "model.safetensors");
    absl::Status init = l3.init();
    if (mode == hierarchy::ChildMode::kThread) {
      EXPECT_TRUE(contains(init, "L3 init, child 0: setup: ")) << init;
      EXPECT_TRUE(contains(init, "model.safetensors")) << init;
      continue;
    }
    ASSERT_TRUE(init.ok()) << init;
    auto e = EngineTestAccess::create((*dp)->runner(1).value(), eo);
    ASSERT_TRUE(e.ok()) << e.status();
    Done d = drain(**e, (*e)->add_request(greedy({1, 2}, 4)).value());
    EXPECT_EQ(d.finish, OutputFinish::kError);
    EXPECT_TRUE(contains(d.error, "child 1 (process")) << d.error;
    EXPECT_TRUE(contains(d.error, "could not start its worker: setup: ")) << d.error;
    EXPECT_TRUE(contains(d.error, "model.safetensors")) << d.error;
    (void)(*e)->shutdown();
    (void)l3.close();
  }
  std::filesystem::remove_all(copy);
}

TEST_F(LlmEngineTest, ChoicesOfOneRequestAreDistinctStreamsUnlessGreedy) {
  auto e = engine(options(2));
  RequestSpec s = seeded({1, 2, 3}, 0);
  s.sampling.seed.reset();
  s.sampling.temperature = 1.5f;
  s.sampling.top_k = 0;
  s.sampling.top_p = 1.0f;
  s.n = 4;
  const RequestId id = e->add_request(s).value();
  std::vector<std::vector<int32_t>> tokens(4);
  int finals = 0;
  while (finals < 4) {
    auto out = e->next_output(id, base::Deadline::after(std::chrono::seconds(60)));
    ASSERT_TRUE(out.ok()) << out.status();
    ASSERT_LT(out->index, 4);
    tokens[out->index].insert(tokens[out->index].end(), out->token_ids.begin(),
                              out->token_ids.end());
    finals += out->finished() ? 1 : 0;
  }
  std::set<std::vector<int32_t>> distinct(tokens.begin(), tokens.end());
  EXPECT_EQ(distinct.size(), 4u) << "clones shared an RNG stream";
  EXPECT_EQ(e->next_output(id, base::Deadline::poll()).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_TRUE(e->shutdown().ok());
}

// Logprobs are of the raw logits: log_softmax of the logits the step computed, with up to 20
// top alternatives (OpenAI's and vLLM's bound; more are refused, see
// LogprobCountsOutOfRangeOrPromptLogprobsWithOneSequenceAStepAreRefused).
TEST_F(LlmEngineTest, LogprobsAreLogSoftmaxOfTheRawLogitsWithUpToTwentyAlternatives) {
  auto e = engine(options(2));
  RequestSpec s = seeded({5, 6, 7}, 9);
  s.sampling.logprobs = 20;
  s.sampling.repetition_penalty = 1.3f;
  s.max_tokens = 3;
  ask_logits(s, {0, 1, 2});
  const RequestId id = e->add_request(s).value();
  std::vector<int32_t> toks;
  std::vector<TokenLogprob> lps;
  std::map<int64_t, std::vector<float>> logits;
  while (true) {
    auto out = e->next_output(id, base::Deadline::after(std::chrono::seconds(60)));
    ASSERT_TRUE(out.ok()) << out.status();
    toks.insert(toks.end(), out->token_ids.begin(), out->token_ids.end());
    lps.insert(lps.end(), out->logprobs.begin(), out->logprobs.end());
    for (auto& [k, v] : hooks_of(*out).logits) logits[k] = v;
    if (out->finished()) break;
  }
  ASSERT_EQ(toks.size(), 3u);
  ASSERT_EQ(lps.size(), 3u);
  ASSERT_EQ(logits.size(), 3u);
  for (int k = 0; k < 3; ++k) {
    const std::vector<float>& l = logits[k];
    double mx = *std::max_element(l.begin(), l.end()), sum = 0;
    for (float v : l) sum += std::exp(static_cast<double>(v) - mx);
    const double lse = mx + std::log(sum);
    EXPECT_NEAR(lps[k].logprob, l[toks[k]] - lse, 1e-4) << "token " << k;
    ASSERT_EQ(lps[k].top.size(), 20u);
    std::vector<float> sorted = l;
    std::sort(sorted.begin(), sorted.end(), std::greater<float>());
    for (size_t j = 0; j < 20; ++j) {
      EXPECT_EQ(l[lps[k].top[j].first], sorted[j]) << "token " << k << ", alternative " << j;
      EXPECT_NEAR(lps[k].top[j].second, sorted[j] - lse, 1e-4);
    }
  }
  EXPECT_TRUE(e->shutdown().ok());
}

// Every event of a one-choice request until its final one, in order.
std::vector<RequestOutput> all_outputs(LlmEngine& e, RequestId id) {
  std::vector<RequestOutput> outs;
  while (true) {
    auto out = e.next_output(id, base::Deadline::after(std::chrono::seconds(60)));
    if (!out.ok()) {
      ADD_FAILURE() << "request " << id << ": " << out.status();
      return outs;
    }
    outs.push_back(*std::move(out));
    if (outs.back().finished()) return outs;
  }
}

// The prompt logprobs of a choice's events: on the event with its first token, and only there.
std::vector<std::optional<TokenLogprob>> prompt_logprobs_of(
    const std::vector<RequestOutput>& outs) {
  std::vector<std::optional<TokenLogprob>> got;
  bool seen_token = false;
  for (const RequestOutput& o : outs) {
    if (!o.prompt_logprobs.empty()) {
      EXPECT_TRUE(got.empty()) << "prompt logprobs sent twice";
      EXPECT_FALSE(seen_token) << "prompt logprobs after the first token";
      EXPECT_FALSE(o.token_ids.empty()) << "prompt logprobs without the first token";
      got = o.prompt_logprobs;
    }
    seen_token = seen_token || !o.token_ids.empty();
  }
  return got;
}

// Prompt token p (p >= 1) is scored under the logits of position p - 1: its logprob and its top
// alternatives match log_softmax of the float64 reference's logits there (the f32 path within
// 1e-3), whether the prompt is one chunk, chunks of 2 positions with logits beside a neighbour
// that decodes, or host sampling; the neighbour's tokens are its solo tokens.
TEST_F(LlmEngineTest, PromptLogprobsAreLogSoftmaxOfTheFloat64ReferenceAtEveryPosition) {
  auto ref = testing::ReferenceModel::load(*dir_);
  ASSERT_TRUE(ref.ok()) << ref.status();
  const std::vector<int32_t> prompt = {3, 141, 59, 26, 5, 358, 97, 93, 238, 46, 264, 33, 8};
  const std::vector<std::vector<double>> want = ref->logits(prompt);
  const std::vector<int32_t> neighbour = prompts()[2];
  const std::vector<int32_t> neighbour_solo = solo_tokens({neighbour}, 6)[0];
  struct Config {
    int depth, budget, seqs;
    bool host;
  };
  for (const Config c : {Config{1, 64, 16, false}, Config{2, 4, 3, false}, Config{3, 64, 3, false},
                         Config{2, 16, 4, true}}) {
    SCOPED_TRACE(::testing::Message() << "depth " << c.depth << " budget " << c.budget << " seqs "
                                      << c.seqs << " host " << c.host);
    EngineOptions eo = options(c.depth, 256, c.budget, c.seqs);
    eo.runner.host_sampling = c.host;
    auto e = engine(eo);
    const RequestId nb = e->add_request(greedy(neighbour, 6)).value();
    RequestSpec s = greedy(prompt, 3);
    s.sampling.logprobs = 0;
    s.sampling.prompt_logprobs = 5;
    const RequestId id = e->add_request(s).value();
    const std::vector<RequestOutput> outs = all_outputs(*e, id);
    EXPECT_EQ(drain(*e, nb).tokens, neighbour_solo);
    const std::vector<std::optional<TokenLogprob>> got = prompt_logprobs_of(outs);
    ASSERT_EQ(got.size(), prompt.size());
    EXPECT_FALSE(got[0].has_value());
    for (size_t p = 1; p < prompt.size(); ++p) {
      ASSERT_TRUE(got[p].has_value()) << "position " << p;
      const std::vector<double>& l = want[p - 1];
      EXPECT_NEAR(got[p]->logprob, testing::ReferenceModel::logprob(l, prompt[p]), 1e-3)
          << "position " << p;
      std::vector<double> sorted;
      for (int32_t t = 0; t < static_cast<int32_t>(l.size()); ++t) {
        sorted.push_back(testing::ReferenceModel::logprob(l, t));
      }
      std::sort(sorted.begin(), sorted.end(), std::greater<double>());
      ASSERT_EQ(got[p]->top.size(), 5u) << "position " << p;
      for (size_t j = 0; j < 5; ++j) {
        const auto [tid, lp] = got[p]->top[j];
        EXPECT_NEAR(lp, testing::ReferenceModel::logprob(l, tid), 1e-3) << p << ", " << j;
        EXPECT_NEAR(lp, sorted[j], 1e-3) << "position " << p << ", alternative " << j;
      }
    }
    // The first output token's logprob (the sampler's) under the last prompt position's logits.
    ASSERT_FALSE(outs.empty());
    ASSERT_FALSE(outs[0].token_ids.empty());
    EXPECT_NEAR(outs[0].logprobs[0].logprob,
                testing::ReferenceModel::logprob(want.back(), outs[0].token_ids[0]), 1e-3);
    EXPECT_TRUE(e->shutdown().ok());
  }
}

// A pool that holds about two requests at a time preempts them, before and after their first
// tokens: each still gets its prompt logprobs once, equal to its solo run's. A prompt whose pages
// are in the prefix cache is computed in full for them (no hit), and requests without prompt
// logprobs keep their hits.
TEST_F(LlmEngineTest, PromptLogprobsGoOutOnceThroughPreemptionAndTakeNoPrefixCacheHits) {
  const auto ps = random_prompts(8, 40, 17);
  auto with_prompt_logprobs = [](const std::vector<int32_t>& p) {
    RequestSpec s = greedy(p, 24);
    s.sampling.prompt_logprobs = 2;
    return s;
  };
  std::vector<std::vector<std::optional<TokenLogprob>>> solo;
  {
    auto e = engine(options(1, 256, 64, 16));
    for (const auto& p : ps) {
      solo.push_back(
          prompt_logprobs_of(all_outputs(*e, e->add_request(with_prompt_logprobs(p)).value())));
    }
    EXPECT_TRUE(e->shutdown().ok());
  }
  auto e = engine(options(2, 24, 32, 8));
  EngineTestAccess::set_check_invariants(*e, true);
  std::vector<RequestId> ids;
  for (const auto& p : ps) ids.push_back(e->add_request(with_prompt_logprobs(p)).value());
  for (size_t i = 0; i < ids.size(); ++i) {
    const auto got = prompt_logprobs_of(all_outputs(*e, ids[i]));
    ASSERT_EQ(got.size(), ps[i].size()) << "prompt " << i;
    for (size_t p = 0; p < got.size(); ++p) {
      ASSERT_EQ(got[p].has_value(), p > 0) << "prompt " << i << " position " << p;
      if (p == 0) continue;
      EXPECT_NEAR(got[p]->logprob, solo[i][p]->logprob, 1e-5) << "prompt " << i << " at " << p;
      ASSERT_EQ(got[p]->top.size(), 2u);
      EXPECT_EQ(got[p]->top[0].first, solo[i][p]->top[0].first) << "prompt " << i << " at " << p;
    }
  }
  EXPECT_GT(e->metrics().preemptions_total, 0);
  EXPECT_TRUE(EngineTestAccess::invariant_violation(*e).ok())
      << EngineTestAccess::invariant_violation(*e);
  // The prefix cache: the same 20-token prompt three times, the second with prompt logprobs.
  std::vector<int32_t> prompt(20);
  for (int32_t k = 0; k < 20; ++k) prompt[k] = 30 + 7 * k;
  EXPECT_EQ(drain(*e, e->add_request(greedy(prompt, 2)).value()).finish, OutputFinish::kLength);
  const RequestId id = e->add_request(with_prompt_logprobs(prompt)).value();
  const std::vector<RequestOutput> outs = all_outputs(*e, id);
  ASSERT_FALSE(outs.empty());
  EXPECT_EQ(outs.back().cached_tokens, 0);
  const auto got = prompt_logprobs_of(outs);
  ASSERT_EQ(got.size(), prompt.size());
  for (size_t p = 1; p < got.size(); ++p) EXPECT_TRUE(got[p].has_value()) << p;
  EXPECT_GT(drain(*e, e->add_request(greedy(prompt, 2)).value()).cached_tokens, 0);
  EXPECT_TRUE(e->shutdown().ok());
}

// A count of top alternatives (logprobs, prompt_logprobs) is absent or in [0, 20]; prompt
// logprobs need a second row in a step.
TEST_F(LlmEngineTest, LogprobCountsOutOfRangeOrPromptLogprobsWithOneSequenceAStepAreRefused) {
  auto e = engine(options(1));
  const struct {
    std::optional<int32_t> RequestSampling::*count;
    int32_t value;
    const char* message;
  } cases[] = {
      {&RequestSampling::logprobs, 21, "logprobs must be in [0, 20] (or absent), got 21"},
      {&RequestSampling::logprobs, -1, "logprobs must be in [0, 20] (or absent), got -1"},
      {&RequestSampling::prompt_logprobs, 21,
       "prompt_logprobs must be in [0, 20] (or absent), got 21"},
      {&RequestSampling::prompt_logprobs, -1,
       "prompt_logprobs must be in [0, 20] (or absent), got -1"},
  };
  for (const auto& c : cases) {
    RequestSpec s = greedy({1, 2, 3}, 2);
    s.sampling.*c.count = c.value;
    EXPECT_EQ(refusal(*e, s), c.message);
  }
  EXPECT_TRUE(e->shutdown().ok());
  RequestSpec s = greedy({1, 2, 3}, 2);
  auto one = engine(options(1, 256, 64, 1));
  s.sampling.prompt_logprobs = 0;
  EXPECT_EQ(refusal(*one, s),
            "prompt_logprobs need max_num_seqs >= 2 (a prompt position's logits take a row of the "
            "step besides its own), got 1");
  EXPECT_TRUE(one->shutdown().ok());
}

// A request's logits are bitwise the same alone and in steps of 3, 16 and 17 rows, on a bf16
// and an f32 checkpoint, with either matmul ISA: nothing it computes depends on its batch. Across
// the two ISAs they are bitwise the same when both are fused (kernel_isa_fused); a portable path
// that multiplies then adds (x86-64) stays within relative L2 1e-4 of the fused logits.
TEST_F(LlmEngineTest, ARequestsLogitsAreBitwiseTheSameAloneAndInBatchesOf3And16And17) {
  std::string bf16_dir;
  ASSERT_NO_FATAL_FAILURE(make_bf16_model("bf16", 3, &bf16_dir));
  for (const std::string& model : {*dir_, bf16_dir}) {
    std::vector<float> fused_want;  // auto's, alone
    for (KernelIsa isa : {KernelIsa::kAuto, KernelIsa::kPortable}) {
      std::vector<float> want;
      if (kernel_isa_fused(isa)) want = fused_want;
      for (int batch : {1, 3, 16, 17}) {
        EngineOptions eo = options(1, 4096, 64, 17);
        eo.runner.kernel_isa = isa;
        eo.record_steps = true;
        auto created = LlmEngine::create(model, eo);
        ASSERT_TRUE(created.ok()) << created.status();
        LlmEngine& e = **created;
        RequestSpec target = greedy({3, 1, 4, 1, 5}, 3);
        ask_logits(target, {0, 1, 2});
        std::vector<RequestId> others;
        // The others first, so that the target joins steps that already hold them; 900 tokens
        // (the pool holds 16 of them), so that none ends before the last is added unless this
        // thread stalls for hundreds of steps, then aborted. An abort that finds one finished is
        // NotFound (the widest step below still says whether they shared steps); an accepted one
        // ends it at the loop's next step.
        for (int i = 1; i < batch; ++i) {
          others.push_back(
              e.add_request(
                   greedy({static_cast<int32_t>(20 + i), static_cast<int32_t>(7 * i)}, 900))
                  .value());
        }
        const RequestId id = e.add_request(target).value();
        std::map<int64_t, std::vector<float>> logits;
        while (true) {
          auto out = e.next_output(id, base::Deadline::after(std::chrono::seconds(60)));
          ASSERT_TRUE(out.ok()) << out.status();
          for (auto& [k, v] : hooks_of(*out).logits) logits[k] = v;
          if (out->finished()) break;
        }
        for (RequestId o : others) {
          const absl::Status aborted = e.abort(o);
          if (aborted.ok()) {
            EXPECT_EQ(drain(e, o).finish, OutputFinish::kAbort) << "request " << o;
          } else {
            EXPECT_EQ(aborted,
                      absl::NotFoundError(absl::StrCat("abort of request ", o,
                                                       ", which is unknown or already finished")));
            drain(e, o);
          }
        }
        int64_t widest = 0;
        for (const StepRecord& r : e.step_records()) widest = std::max(widest, r.logit_rows);
        EXPECT_TRUE(e.shutdown().ok());
        if (!kSanitized) {
          EXPECT_GE(widest, std::min(batch, 17)) << "the requests never shared a step";
        }
        ASSERT_EQ(logits.size(), 3u);
        std::vector<float> got;
        for (auto& [k, v] : logits) got.insert(got.end(), v.begin(), v.end());
        if (want.empty()) {
          if (!fused_want.empty()) {  // the unfused portable path against auto's logits
            double diff = 0, norm = 0;
            for (size_t i = 0; i < got.size(); ++i) {
              diff += (double(got[i]) - fused_want[i]) * (double(got[i]) - fused_want[i]);
              norm += double(fused_want[i]) * fused_want[i];
            }
            EXPECT_LE(std::sqrt(diff / norm), 1e-4) << model << " isa " << name_of(isa);
          }
          want = got;
          if (fused_want.empty()) fused_want = got;
          continue;
        }
        ASSERT_EQ(got.size(), want.size());
        for (size_t i = 0; i < got.size(); ++i) {
          ASSERT_EQ(std::bit_cast<uint32_t>(got[i]), std::bit_cast<uint32_t>(want[i]))
              << model << " isa " << name_of(isa) << " batch " << batch << " logit " << i;
        }
      }
    }
  }
  std::filesystem::remove_all(bf16_dir);
}

// A bf16 checkpoint stays bf16 on the device: the device's own accounting holds the checkpoint's
// tensor bytes (norm vectors widened to f32) + scratch + KV pool + the step buffers, within 5%,
// and no f32 copy of the matrices.
// precision bf16 against the exact path on a bf16 checkpoint: the logits of every step whose
// context both paths share (same prompt, same tokens so far) stay within the path's stated
// tolerance, relative L2 ≤ 2e-2 (docs/benchmarks.md has the measured value); tokens are compared
// and their agreement reported, not required identical.
TEST_F(LlmEngineTest, Bf16PrecisionLogitsStayWithinItsToleranceOfTheExactPath) {
  if (!bf16_precision_available()) {
    GTEST_SKIP() << "this CPU has no AVX512_BF16: precision bf16 runs the exact path here";
  }
  std::string bf16_dir;
  ASSERT_NO_FATAL_FAILURE(make_bf16_model("bf16_precision", 6, &bf16_dir, 128, 384));
  const auto ps = random_prompts(6, 40, 99);
  constexpr int64_t kTokens = 8;
  std::vector<Done> runs[2];
  for (Precision precision : {Precision::kExact, Precision::kBf16}) {
    EngineOptions eo = options(2, 256, 64, 8);
    eo.runner.precision = precision;
    auto e = LlmEngine::create(bf16_dir, eo);
    ASSERT_TRUE(e.ok()) << e.status();
    EXPECT_EQ((*e)->options().runner.precision, precision);
    std::vector<RequestId> ids;
    for (const auto& p : ps) {
      RequestSpec spec = greedy(p, kTokens);
      std::set<int64_t> all;
      for (int64_t t = 0; t < kTokens; ++t) all.insert(t);
      ask_logits(spec, all);
      ids.push_back((*e)->add_request(spec).value());
    }
    for (RequestId id : ids) runs[precision == Precision::kBf16].push_back(drain(**e, id));
    EXPECT_TRUE((*e)->shutdown().ok());
  }
  double worst = 0;
  int64_t compared = 0, agreeing = 0, total = 0;
  for (size_t r = 0; r < ps.size(); ++r) {
    const Done& exact = runs[0][r];
    const Done& fast = runs[1][r];
    ASSERT_EQ(exact.tokens.size(), static_cast<size_t>(kTokens));
    ASSERT_EQ(fast.tokens.size(), static_cast<size_t>(kTokens));
    for (int64_t t = 0; t < kTokens; ++t) {
      ++total;
      agreeing += exact.tokens[t] == fast.tokens[t] ? 1 : 0;
      // Step t's logits are comparable while the tokens before it agree.
      if (t > 0 && !std::equal(exact.tokens.begin(), exact.tokens.begin() + t, fast.tokens.begin()))
        continue;
      const std::vector<float>& a = exact.logits.at(t);
      const std::vector<float>& b = fast.logits.at(t);
      ASSERT_EQ(a.size(), b.size());
      double num = 0, den = 0;
      for (size_t i = 0; i < a.size(); ++i) {
        num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
        den += double(a[i]) * a[i];
      }
      worst = std::max(worst, std::sqrt(num / den));
      ++compared;
    }
  }
  EXPECT_GE(compared, static_cast<int64_t>(ps.size()));  // at least every first step
  EXPECT_LE(worst, 2e-2) << "precision bf16: logits relative L2 against the exact path";
  EXPECT_GT(worst, 0.0) << "precision bf16 gave the exact path's logits: not running?";
  RecordProperty("bf16_logits_rel_l2_max", std::to_string(worst));
  RecordProperty("bf16_token_agreement", std::to_string(double(agreeing) / total));
  std::printf(
      "precision bf16: logits relative L2 <= %.3g over %lld steps; tokens agree %lld/%lld\n", worst,
      static_cast<long long>(compared), static_cast<long long>(agreeing),
      static_cast<long long>(total));
  std::filesystem::remove_all(bf16_dir);
}

// precision bf16 where it cannot run (here: the portable ISA, on every machine) falls back to
// the exact path, and the runner says which ran; tokens are then the exact path's.
TEST_F(LlmEngineTest, Bf16PrecisionFallsBackToExactWhereItCannotRun) {
  EXPECT_EQ(effective_precision(KernelIsa::kPortable, Precision::kBf16), Precision::kExact);
  EXPECT_EQ(effective_precision(KernelIsa::kAuto, Precision::kExact), Precision::kExact);
  EXPECT_EQ(effective_precision(KernelIsa::kAuto, Precision::kBf16),
            bf16_precision_available() ? Precision::kBf16 : Precision::kExact);
  RunnerOptions ro = options(1).runner;
  ro.kernel_isa = KernelIsa::kPortable;
  ro.precision = Precision::kBf16;
  auto r = Qwen3ModelRunner::create(*dir_, ro);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ((*r)->options().precision, Precision::kExact);
}

TEST_F(LlmEngineTest, ABf16CheckpointIsHeldInBf16WithoutAnF32Copy) {
  std::string bf16_dir;
  ASSERT_NO_FATAL_FAILURE(make_bf16_model("bf16_memory", 4, &bf16_dir, 256, 768));
  RunnerOptions ro;
  ro.worker.num_cores = 1;
  ro.num_pages = 32;
  ro.page_size = 16;
  ro.max_num_seqs = 4;
  ro.max_num_batched_tokens = 64;
  auto runner = Qwen3ModelRunner::create(bf16_dir, ro);
  ASSERT_TRUE(runner.ok()) << runner.status();
  const ModelConfig c = ModelConfig::load(bf16_dir).value();
  const Qwen3Dims d = Qwen3Dims::from_config(c);
  const int64_t h = d.hidden_size, q = d.q_size(), kv = d.kv_size(), L = d.num_hidden_layers;
  const int64_t matrices =
      L * (q * h + 2 * kv * h + h * q + 3 * d.intermediate_size * h) + d.vocab_size * h;
  const int64_t vectors = L * (2 * h + 2 * d.head_dim) + h;
  const uint64_t tensors = 2 * matrices + 4 * vectors;
  const uint64_t scratch = qwen3_scratch_bytes(d, 64, 4).value();
  const uint64_t kv_pool = qwen3_kv_pool_bytes(d, 32, 16).value();
  const uint64_t step_buffers = 64 * 4 + 2 * 4 * 4 + 4ull * d.vocab_size * 4;
  const uint64_t allocated = (*runner)->worker()->device().allocated_bytes();
  EXPECT_GE(allocated, tensors + scratch + kv_pool);
  EXPECT_LE(allocated, 1.05 * tensors + scratch + kv_pool + step_buffers)
      << "tensors " << tensors << " scratch " << scratch << " kv " << kv_pool;
  EXPECT_LT(allocated, tensors + 2 * matrices) << "an f32 copy of the matrices is resident";
  runner->reset();
  std::filesystem::remove_all(bf16_dir);
}

TEST_F(LlmEngineTest, MaxTokensForDefaultsLikeVllmAndRefusesWithTheNumbers) {
  auto e = engine(options(1, 8, 16, 4));  // a pool of 8 pages of 4 tokens: 32 tokens
  const int64_t context = e->config().max_position_embeddings;
  auto refused = [&](int64_t plen, std::optional<int64_t> mt, const std::string& needle) {
    auto r = e->max_tokens_for(plen, mt);
    ASSERT_FALSE(r.ok()) << needle;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
    EXPECT_TRUE(contains(r.status(), needle)) << r.status() << " lacks " << needle;
  };
  EXPECT_EQ(e->max_tokens_for(3, std::nullopt).value(), 30);  // pool tokens - prompt + 1
  EXPECT_EQ(e->max_tokens_for(32, std::nullopt).value(), 1);
  EXPECT_EQ(e->max_tokens_for(3, 29).value(), 29);
  refused(0, std::nullopt, "the prompt is empty");
  refused(33, std::nullopt,
          "the prompt has 33 tokens; the model's context holds " + std::to_string(context) +
              " and the KV cache 32: no room");
  refused(3, 0, "max_tokens must be >= 1, got 0");
  refused(3, context,
          "this model's maximum context length is " + std::to_string(context) +
              " tokens; the prompt has 3 tokens and max_tokens is " + std::to_string(context));
  refused(3, std::numeric_limits<int64_t>::max(), "which exceeds max_position_embeddings");
  refused(3, 31, "needs 9 pages of 4 tokens, and the pool holds 8 pages");
  EXPECT_EQ(e->metrics().requests_refused, 0);
  EXPECT_TRUE(e->shutdown().ok());
}

TEST_F(LlmEngineTest, BadRequestsAreRefusedNamingTheFieldAndNumbers) {
  EngineOptions eo = options(1, 8, 16, 4);
  eo.max_waiting = 3;
  auto e = engine(eo);
  auto refused = [&](RequestSpec s, absl::StatusCode code, const std::string& needle) {
    auto r = e->add_request(std::move(s));
    ASSERT_FALSE(r.ok()) << needle;
    EXPECT_EQ(r.status().code(), code) << r.status();
    EXPECT_TRUE(contains(r.status(), needle)) << r.status() << " lacks " << needle;
  };
  using C = absl::StatusCode;
  refused(greedy({}, 4), C::kInvalidArgument, "the prompt is empty");
  refused(greedy({1, 512}, 4), C::kInvalidArgument,
          "prompt_ids[1] = 512 is outside the vocabulary");
  refused(greedy({1}, 0), C::kInvalidArgument, "max_tokens must be >= 1, got 0");
  refused(greedy({1, 2}, 1 << 20), C::kInvalidArgument, "exceeds max_position_embeddings");
  refused(greedy(std::vector<int32_t>(30, 1), 10), C::kInvalidArgument,
          "needs 10 pages of 4 tokens, and the pool holds 8 pages");
  RequestSpec n0 = greedy({1}, 2);
  n0.n = 5;
  refused(n0, C::kInvalidArgument, "n must be in [1, max_num_seqs 4], got 5");
  RequestSpec t = greedy({1}, 2);
  t.sampling.temperature = std::nanf("");
  refused(t, C::kInvalidArgument, "temperature");
  RequestSpec tp = greedy({1}, 2);
  tp.sampling.top_p = 0;
  refused(tp, C::kInvalidArgument, "top_p");
  RequestSpec st = greedy({1}, 2);
  st.sampling.stop = {"x"};
  refused(st, C::kInvalidArgument, "stop strings need a tokenizer");
  RequestSpec ids = greedy({1}, 2);
  ids.sampling.stop_token_ids = {600};
  refused(ids, C::kInvalidArgument, "stop_token_ids entry 600");
  // A full waiting queue refuses with RESOURCE_EXHAUSTED; nothing else is harmed.
  std::vector<RequestId> ok;
  auto first = e->add_request(greedy({1, 2, 3}, 30));
  ASSERT_TRUE(first.ok());
  absl::Status full;
  for (int i = 0; i < 20 && full.ok(); ++i) {
    auto r = e->add_request(greedy({4, 5}, 30));
    if (r.ok()) {
      ok.push_back(*r);
    } else {
      full = r.status();
    }
  }
  EXPECT_EQ(full.code(), C::kResourceExhausted) << full;
  EXPECT_TRUE(contains(full, "max_waiting 3")) << full;
  EXPECT_EQ(drain(*e, *first).finish, OutputFinish::kLength);
  for (RequestId id : ok) EXPECT_EQ(drain(*e, id).finish, OutputFinish::kLength);
  EXPECT_GE(e->metrics().requests_refused, 11);
  EXPECT_TRUE(e->shutdown().ok());
  auto after = e->add_request(greedy({1}, 1));
  EXPECT_EQ(after.status().code(), C::kFailedPrecondition) << after.status();
}

// A consumer that falls behind by max_buffered_outputs gets its request
// aborted with a reason saying so; the loop and other requests go on.
TEST_F(LlmEngineTest, ASlowConsumerGetsItsRequestAbortedNotTheLoopBlocked) {
  EngineOptions eo = options(2);
  eo.max_buffered_outputs = 4;
  auto e = engine(eo);
  const RequestId slow = e->add_request(greedy({1, 2}, 100)).value();
  // The other request's consumer is a callback (the output thread hands it every event: it
  // cannot fall behind however loaded the machine is); it finishes normally.
  struct Fast {
    std::mutex mu;
    std::condition_variable cv;
    std::vector<int32_t> tokens;
    OutputFinish finish = OutputFinish::kNone;
  };
  auto fast = std::make_shared<Fast>();
  RequestSpec fs = greedy({3, 4}, 20);
  fs.on_output = [fast](const RequestOutput& out) {
    std::lock_guard<std::mutex> l(fast->mu);
    fast->tokens.insert(fast->tokens.end(), out.token_ids.begin(), out.token_ids.end());
    if (out.finished()) {
      fast->finish = out.finish;
      fast->cv.notify_all();
    }
  };
  ASSERT_TRUE(e->add_request(std::move(fs)).ok());
  {
    std::unique_lock<std::mutex> l(fast->mu);
    ASSERT_TRUE(fast->cv.wait_for(l, std::chrono::seconds(60),
                                  [&] { return fast->finish != OutputFinish::kNone; }));
    EXPECT_EQ(fast->finish, OutputFinish::kLength);
    EXPECT_EQ(fast->tokens.size(), 20u);
  }
  Done ds = drain(*e, slow);
  EXPECT_EQ(ds.finish, OutputFinish::kAbort);
  EXPECT_TRUE(contains(ds.error, "consumer fell behind")) << ds.error;
  EXPECT_LT(ds.tokens.size(), 100u);
  EXPECT_TRUE(e->shutdown().ok());
}

// Shutdown lets running requests finish until the deadline, then aborts the rest.
TEST_F(LlmEngineTest, ShutdownDrainsUntilTheDeadlineThenAborts) {
  // b and c need 3,000 steps each (hundreds of ms even on the fastest kernels), so the 20 ms
  // drain deadline that starts once a finished always hits them mid-way.
  auto e = engine(options(2, 1600, 16, 3));
  const RequestId a = e->add_request(greedy({1, 2, 3}, 5)).value();
  const RequestId b = e->add_request(greedy({4}, 3000)).value();
  const RequestId c = e->add_request(greedy({5}, 3000)).value();
  std::thread reader([&] {
    EXPECT_EQ(drain(*e, b).finish, OutputFinish::kAbort);
    EXPECT_EQ(drain(*e, c).finish, OutputFinish::kAbort);
  });
  EXPECT_EQ(drain(*e, a).finish, OutputFinish::kLength);
  const int64_t t0 = base::now_ns();
  EXPECT_TRUE(e->shutdown(base::Deadline::after(std::chrono::milliseconds(20))).ok());
  EXPECT_LT((base::now_ns() - t0) / 1e9, 10.0);
  reader.join();
}

// Faults injected into a chosen step (the run ids of a fresh engine are its
// step numbers - 1).
TEST_F(LlmEngineTest, AKernelErrorFailsTheRequestsOfItsStepAndTheRestGoOn) {
  EngineOptions eo = options(2, 256, 64, 8);
  eo.runner.worker.faults = device::FaultPlan::parse("run=3:task=2:kind=kernel_error").value();
  auto e = engine(eo);
  const RequestId a = e->add_request(greedy({1, 2, 3}, 10)).value();
  Done da = drain(*e, a);  // runs 0..: step 4 (run 3) is one of its decode steps
  EXPECT_EQ(da.finish, OutputFinish::kError);
  EXPECT_TRUE(contains(da.error, "run 3")) << da.error;
  EXPECT_TRUE(contains(da.error, "kernel reported failure")) << da.error;
  EXPECT_TRUE(e->health().ok());
  // The engine goes on: later requests are served.
  const RequestId b = e->add_request(greedy({4, 5}, 6)).value();
  Done db = drain(*e, b);
  EXPECT_EQ(db.finish, OutputFinish::kLength);
  EXPECT_EQ(db.tokens.size(), 6u);
  const EngineMetrics m = e->metrics();
  EXPECT_EQ(m.requests_finished_error, 1);
  EXPECT_TRUE(e->shutdown().ok());
  EXPECT_EQ(e->metrics().kv_pages.free, e->metrics().kv_pages_total);
}

TEST_F(LlmEngineTest, ADeviceFaultFailsEveryRequestAndMakesTheEngineUnhealthy) {
  EngineOptions eo = options(2, 256, 64, 2);
  eo.runner.worker.faults = device::FaultPlan::parse("run=2:task=1:kind=device_fault").value();
  auto e = engine(eo);
  std::vector<RequestId> ids;
  for (int i = 0; i < 4; ++i) ids.push_back(e->add_request(greedy({1, 2, i}, 50)).value());
  for (RequestId id : ids) {
    Done d = drain(*e, id);
    EXPECT_EQ(d.finish, OutputFinish::kError);
    EXPECT_TRUE(contains(d.error, "run 2")) << d.error;
    EXPECT_TRUE(contains(d.error, "device fault")) << d.error;
  }
  EXPECT_FALSE(e->health().ok());
  auto refused = e->add_request(greedy({1}, 2));
  EXPECT_FALSE(refused.ok());
  EXPECT_TRUE(contains(refused.status(), "device fault")) << refused.status();
  const EngineMetrics m = e->metrics();
  EXPECT_FALSE(m.healthy);
  EXPECT_EQ(m.kv_pages.total(), m.kv_pages_total);
  const int64_t t0 = base::now_ns();
  absl::Status s = e->shutdown();
  EXPECT_FALSE(s.ok());
  EXPECT_TRUE(contains(s, "device fault")) << s;
  EXPECT_LT((base::now_ns() - t0) / 1e9, 10.0);
}

// 2,000 requests with random sampling parameters, lengths and aborts against
// a pool that forces preemption, at depth 2: every request ends with one
// final event, the page states sum to the pool at every step, live requests'
// pages never alias (check_invariants each step), no page leaks.
TEST_F(LlmEngineTest, RandomizedRequestsKeepEveryPageInvariant) {
  const int kRequests = kSanitized ? 300 : 2000;
  auto e = engine(options(2, 40, 64, 16));
  EngineTestAccess::set_check_invariants(*e, true);
  std::mt19937 rng(5);
  std::vector<RequestId> ids;
  std::vector<int64_t> max_tokens;
  int64_t finished = 0;
  std::map<OutputFinish, int64_t> reasons;
  auto drain_one = [&](size_t i) {
    Done d = drain(*e, ids[i]);
    ++finished;
    ++reasons[d.finish];
    EXPECT_NE(d.finish, OutputFinish::kNone);
    EXPECT_LE(static_cast<int64_t>(d.tokens.size()), max_tokens[i]);
    if (d.finish == OutputFinish::kLength) {
      EXPECT_EQ(static_cast<int64_t>(d.tokens.size()), max_tokens[i]);
    }
    EXPECT_NE(d.finish, OutputFinish::kError) << d.error;
  };
  size_t drained = 0;
  for (int i = 0; i < kRequests; ++i) {
    RequestSpec s;
    s.prompt_ids.resize(std::uniform_int_distribution<int>(1, 32)(rng));
    for (int32_t& t : s.prompt_ids) t = std::uniform_int_distribution<int32_t>(0, 511)(rng);
    s.max_tokens = std::uniform_int_distribution<int>(1, 16)(rng);
    s.sampling.temperature = std::uniform_int_distribution<int>(0, 1)(rng) ? 0.0f : 0.8f;
    s.sampling.top_k = std::uniform_int_distribution<int>(0, 20)(rng);
    s.sampling.presence_penalty = 0.5f;
    s.sampling.stop_token_ids = {std::uniform_int_distribution<int32_t>(0, 511)(rng)};
    if (i % 3 == 0) s.sampling.seed = static_cast<uint64_t>(i);
    const int64_t mt = s.max_tokens;
    const RequestSpec s_copy = s;
    auto id = e->add_request(std::move(s));
    while (!id.ok() && id.status().code() == absl::StatusCode::kResourceExhausted) {
      drain_one(drained++);  // the waiting queue is full: consume first
      ASSERT_LE(drained, ids.size()) << "the queue is full with nothing to drain";
      id = e->add_request(RequestSpec(s_copy));
    }
    ASSERT_TRUE(id.ok()) << id.status();
    ids.push_back(*id);
    max_tokens.push_back(mt);
    if (std::uniform_int_distribution<int>(0, 9)(rng) == 0) {
      absl::Status a =
          e->abort(ids[std::uniform_int_distribution<size_t>(drained, ids.size() - 1)(rng)]);
      EXPECT_TRUE(a.ok() || a.code() == absl::StatusCode::kNotFound) << a;
    }
    if (ids.size() - drained > 200) drain_one(drained++);
  }
  while (drained < ids.size()) drain_one(drained++);
  EXPECT_EQ(finished, kRequests);
  EXPECT_GT(reasons[OutputFinish::kAbort], 0);
  EXPECT_TRUE(EngineTestAccess::invariant_violation(*e).ok())
      << EngineTestAccess::invariant_violation(*e);
  EXPECT_GT(e->metrics().preemptions_total, 0);
  EXPECT_TRUE(e->shutdown().ok());
  const EngineMetrics m = e->metrics();
  EXPECT_EQ(m.kv_pages.free, m.kv_pages_total) << "pages leaked";
  EXPECT_EQ(m.requests_finished_stop + m.requests_finished_length + m.requests_finished_abort +
                m.requests_finished_error,
            kRequests);
}

// A kernel error in a step holding a prefill chunk of a long prompt (mid-prefill)
// fails that request; a request decoding beside it in the same step fails too
// (it had a row), and a request arriving later is served.
TEST_F(LlmEngineTest, AFaultMidPrefillFailsTheRowsOfThatStepOnly) {
  EngineOptions eo = options(2, 256, 16, 4);
  // Run 2 = step 3: the 100-token prompt is in its third 16-token chunk.
  eo.runner.worker.faults = device::FaultPlan::parse("run=2:task=4:kind=kernel_error").value();
  auto e = engine(eo);
  const RequestId longp = e->add_request(greedy(std::vector<int32_t>(100, 9), 4)).value();
  Done d = drain(*e, longp);
  EXPECT_EQ(d.finish, OutputFinish::kError);
  EXPECT_TRUE(d.tokens.empty());
  EXPECT_TRUE(contains(d.error, "run 2 task 4")) << d.error;
  const RequestId next = e->add_request(greedy(std::vector<int32_t>(40, 9), 4)).value();
  EXPECT_EQ(drain(*e, next).finish, OutputFinish::kLength);
  EXPECT_TRUE(e->health().ok());
  EXPECT_TRUE(e->shutdown().ok());
  EXPECT_EQ(e->metrics().kv_pages.free, e->metrics().kv_pages_total);
}

// The metrics snapshot: counters, page states summing to the pool, and
// histograms with vLLM's buckets filled by what ran.
TEST_F(LlmEngineTest, MetricsCountRequestsTokensPagesAndLatencies) {
  auto e = engine(options(2, 128, 32, 8));
  std::vector<RequestId> ids;
  for (int i = 0; i < 6; ++i) ids.push_back(e->add_request(greedy({1, 2, 3, i}, 5)).value());
  const RequestId aborted = e->add_request(greedy({7}, 300)).value();
  for (RequestId id : ids) drain(*e, id);
  ASSERT_TRUE(e->abort(aborted).ok());
  drain(*e, aborted);
  const EngineMetrics m = e->metrics();
  EXPECT_TRUE(m.healthy);
  EXPECT_EQ(m.requests_finished_length, 6);
  EXPECT_EQ(m.requests_finished_abort, 1);
  EXPECT_EQ(m.requests_running + m.requests_waiting, 0);
  EXPECT_EQ(m.kv_pages.total(), 128);
  EXPECT_EQ(m.kv_pages_total, 128);
  EXPECT_GE(m.prompt_tokens_total, 6 * 4 + 1);
  EXPECT_GE(m.generation_tokens_total, 6 * 5 + 1);
  EXPECT_EQ(m.time_to_first_token_s.count, 7);
  EXPECT_EQ(m.time_to_first_token_s.bounds, ttft_buckets_s());
  EXPECT_GE(m.inter_token_latency_s.count, 6 * 4);
  EXPECT_EQ(m.e2e_request_latency_s.count, 7);
  EXPECT_EQ(m.request_queue_time_s.count, 7);
  EXPECT_TRUE(e->shutdown().ok());
  // Steps are counted at submit, timed at retire: equal once every step retired.
  const EngineMetrics after = e->metrics();
  EXPECT_GT(after.steps_total, 0);
  EXPECT_EQ(after.step_time_s.count, after.steps_total);
  EXPECT_EQ(after.rows_per_step.count, after.steps_total);
  EXPECT_EQ(after.rows_per_step.bounds, build_1_2_5_buckets(8));
  int64_t in_buckets = 0;
  for (int64_t c : after.tokens_per_step.counts) in_buckets += c;
  EXPECT_EQ(in_buckets, after.tokens_per_step.count);
}

TEST(Histogram, BucketsAreLessOrEqualBoundsWithAnInfBucket) {
  Histogram h = Histogram::with_bounds({1, 2, 5});
  for (double v : {0.5, 1.0, 1.5, 5.0, 7.0}) h.observe(v);
  EXPECT_EQ(h.counts, (std::vector<int64_t>{2, 1, 1, 1}));
  EXPECT_EQ(h.count, 5);
  EXPECT_DOUBLE_EQ(h.sum, 15.0);
  EXPECT_DOUBLE_EQ(h.quantile_bound(0.5), 2.0);
  EXPECT_DOUBLE_EQ(h.quantile_bound(1.0), 5.0);
  EXPECT_EQ(build_1_2_5_buckets(100), (std::vector<double>{1, 2, 5, 10, 20, 50, 100}));
}

// Text: the tiny preset (the real Qwen3 vocabulary and tokenizer).
class LlmEngineTextTest : public TinyTextModelTest<LlmEngineTextTest> {
 public:
  static constexpr const char* kDirPrefix = "simpler_llm_engine_text_";

 protected:
  static std::unique_ptr<LlmEngine> engine(int depth) {
    EngineOptions eo = small_engine_options(depth, 64, 64, 4, 16);
    eo.tokenizer = tokenizer_;
    return create_test_engine(*dir_, eo);
  }
  struct Text {
    std::vector<int32_t> tokens;
    std::vector<std::string> deltas;
    OutputFinish finish = OutputFinish::kNone;
    int64_t completion_tokens = 0;
    std::string text() const {
      std::string t;
      for (const std::string& d : deltas) t += d;
      return t;
    }
  };
  static Text run(LlmEngine& e, RequestSpec spec) {
    Text t;
    const RequestId id = e.add_request(std::move(spec)).value();
    while (true) {
      auto out = e.next_output(id, base::Deadline::after(std::chrono::seconds(60)));
      EXPECT_TRUE(out.ok()) << out.status();
      if (!out.ok()) return t;
      t.tokens.insert(t.tokens.end(), out->token_ids.begin(), out->token_ids.end());
      t.deltas.push_back(out->text);
      if (out->finished()) {
        t.finish = out->finish;
        t.completion_tokens = out->completion_tokens;
        return t;
      }
    }
  }
  // Greedy decoding of `prompt`'s text for max_tokens tokens, EOS ignored.
  static RequestSpec greedy(const char* prompt, int64_t max_tokens) {
    RequestSpec spec;
    spec.prompt_ids = tokenizer_->encode(prompt);
    spec.max_tokens = max_tokens;
    spec.sampling.temperature = 0;
    spec.sampling.ignore_eos = true;
    return spec;
  }
  static bool valid_utf8(const std::string& s) {
    size_t i = 0;
    while (i < s.size()) {
      const unsigned char c = static_cast<unsigned char>(s[i]);
      const size_t n = c < 0x80         ? 1
                       : (c >> 5) == 6  ? 2
                       : (c >> 4) == 14 ? 3
                       : (c >> 3) == 30 ? 4
                                        : 0;
      if (n == 0 || i + n > s.size()) return false;
      for (size_t k = 1; k < n; ++k) {
        if ((static_cast<unsigned char>(s[i + k]) >> 6) != 2) return false;
      }
      i += n;
    }
    return true;
  }
  static size_t char_len(const std::string& s, size_t at) {
    const unsigned char c = static_cast<unsigned char>(s[at]);
    return c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : 4;
  }
};

// Deltas never split a UTF-8 character and add up to decode(all ids); a stop
// string spanning a token boundary cuts the text right before it, and no
// streamed delta ever held a prefix of it.
TEST_F(LlmEngineTextTest, DeltasAddUpToTheDecodedTextAndStopStringsSpanTokens) {
  auto e = engine(2);
  const RequestSpec spec = greedy("Once upon a time", 40);
  const Text base = run(*e, spec);
  ASSERT_EQ(base.tokens.size(), 40u);
  const std::string full = tokenizer_->decode(base.tokens);
  EXPECT_EQ(base.text(), full);
  for (const std::string& d : base.deltas)
    EXPECT_TRUE(valid_utf8(d)) << "a delta split a character";
  // A stop string made of the last character of token k's text and the first
  // of token k+1's, whose first occurrence is exactly there.
  bool tested = false;
  for (size_t k = 2; k + 2 < base.tokens.size() && !tested; ++k) {
    const std::string upto =
        tokenizer_->decode(std::span<const int32_t>(base.tokens.data(), k + 1));
    const std::string upto_next =
        tokenizer_->decode(std::span<const int32_t>(base.tokens.data(), k + 2));
    if (upto.empty() || upto.size() >= upto_next.size() ||
        full.compare(0, upto_next.size(), upto_next) != 0 || !valid_utf8(upto) ||
        !valid_utf8(upto_next)) {
      continue;
    }
    size_t last = upto.size() - 1;
    while (last > 0 && (static_cast<unsigned char>(upto[last]) >> 6) == 2) --last;
    const std::string stop =
        upto.substr(last) + upto_next.substr(upto.size(), char_len(upto_next, upto.size()));
    if (full.find(stop) != last || stop.find('\xef') != std::string::npos) continue;
    tested = true;
    RequestSpec with_stop = spec;
    with_stop.sampling.stop = {"never-in-this-text-\xe2\x82\xac", stop};
    const Text t = run(*e, with_stop);
    EXPECT_EQ(t.finish, OutputFinish::kStop);
    EXPECT_EQ(t.text(), full.substr(0, last)) << "stop " << stop;
    EXPECT_EQ(t.completion_tokens, static_cast<int64_t>(k + 2));
    std::string streamed;
    for (const std::string& d : t.deltas) {
      streamed += d;
      EXPECT_EQ(streamed.find(stop.substr(0, 1), last), std::string::npos)
          << "a delta released the start of the stop string";
    }
  }
  EXPECT_TRUE(tested) << "no token boundary fit a stop-string probe in: " << full;
  EXPECT_TRUE(e->shutdown().ok());
}

// A choice that ends on a stop id (one of stop_token_ids here; the model's EOS alike) outputs
// the id, counted in completion_tokens, but not its text (vLLM's include_stop_str_in_output
// false): the text is the decode of the tokens before it. A stop id under min_tokens is no stop,
// and its text stays.
TEST_F(LlmEngineTextTest, AStopIdEndsTheChoiceWithItsIdButNotItsText) {
  auto e = engine(2);
  const RequestSpec spec = greedy("Once upon a time", 12);
  const Text base = run(*e, spec);
  ASSERT_EQ(base.tokens.size(), 12u);
  const int32_t stop = base.tokens[3];
  const size_t first = static_cast<size_t>(std::find(base.tokens.begin(), base.tokens.end(), stop) -
                                           base.tokens.begin());
  RequestSpec with_stop = spec;
  with_stop.sampling.stop_token_ids = {stop};
  const Text t = run(*e, with_stop);
  EXPECT_EQ(t.finish, OutputFinish::kStop);
  EXPECT_EQ(t.tokens, std::vector<int32_t>(base.tokens.begin(), base.tokens.begin() + first + 1));
  EXPECT_EQ(t.completion_tokens, static_cast<int64_t>(first + 1));
  EXPECT_EQ(t.text(), tokenizer_->decode(std::span<const int32_t>(base.tokens.data(), first)));
  EXPECT_NE(t.text(), tokenizer_->decode(t.tokens)) << "the stop id's text is not empty";
  with_stop.sampling.min_tokens = static_cast<int32_t>(first + 1);
  const Text later = run(*e, with_stop);
  ASSERT_GT(later.tokens.size(), first + 1);
  EXPECT_NE(later.tokens[first], stop) << "sampled under min_tokens";
  const size_t kept = later.tokens.size() - (later.finish == OutputFinish::kStop ? 1 : 0);
  EXPECT_EQ(later.text(), tokenizer_->decode(std::span<const int32_t>(later.tokens.data(), kept)));
  EXPECT_TRUE(e->shutdown().ok());
}

}  // namespace
}  // namespace simpler::llm
