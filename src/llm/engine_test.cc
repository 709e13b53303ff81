#include "simpler/llm/engine.h"

#include <filesystem>
#include <random>

#include "gtest/gtest.h"
#include "simpler/base/log.h"
#include "simpler/llm/make_model.h"
#include "spdlog/sinks/ringbuffer_sink.h"

namespace simpler::llm {
namespace {

bool contains(const absl::Status& s, const std::string& needle) {
  return std::string(s.message()).find(needle) != std::string::npos;
}

// A small model (vocab 512) written once per test binary.
class EngineTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::string((std::filesystem::temp_directory_path() /
                            ("simpler_engine_test_" + std::to_string(::getpid())))
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

  std::unique_ptr<Qwen3Engine> engine(
      int depth, int batch, int pages, int page_size = 4,
      task::GraphPlacement placement = task::GraphPlacement::kDevice) {
    EngineOptions eo;
    eo.worker.num_cores = 2;
    eo.worker.launch_depth = depth;
    eo.worker.placement = placement;
    eo.worker.faults.emplace();
    eo.page_size = page_size;
    auto e = Qwen3Engine::create(*dir_, eo, batch, pages);
    EXPECT_TRUE(e.ok()) << e.status();
    return std::move(e).value();
  }

  static std::vector<std::vector<int32_t>> prompts() {
    return {{1, 2, 3}, {7}, {10, 11, 12, 13, 14, 15, 16, 17, 18}, {400, 5}};
  }

  static std::string* dir_;
};
std::string* EngineTest::dir_ = nullptr;

TEST_F(EngineTest, TokensAreIdenticalAtEveryDepthAndWithHostSampling) {
  GenerateOptions go;
  go.max_new_tokens = 12;
  std::vector<std::vector<int32_t>> baseline;
  for (int depth : {1, 2, 4}) {
    for (bool host : {false, true}) {
      auto e = engine(depth, 4, Qwen3Engine::pages_for(prompts(), 12, 4));
      go.host_sampling = host;
      auto r = e->generate(prompts(), go);
      ASSERT_TRUE(r.ok()) << r.status();
      std::vector<std::vector<int32_t>> tokens;
      for (const auto& q : r->requests) {
        EXPECT_EQ(q.tokens.size(), 12u);
        EXPECT_EQ(q.finish_reason, "length");
        tokens.push_back(q.tokens);
      }
      if (baseline.empty()) baseline = tokens;
      EXPECT_EQ(tokens, baseline) << "depth " << depth << " host sampling " << host;
      EXPECT_LE(r->stats.effective_depth, host ? 1.0 : depth);
      // Device-side token feedback enqueues up to `depth` steps before the
      // host reads the first one back; host sampling launches serially.
      EXPECT_EQ(r->stats.max_steps_in_flight, host ? 1 : depth) << "depth " << depth;
      EXPECT_EQ(r->stats.serial_launch, host);
      ASSERT_TRUE(e->close().ok());
    }
  }
}

TEST_F(EngineTest, HostBuiltGraphsGiveTheSameTokensAndLogits) {
  // Both graph placements: orchestration on the device, or on the host at
  // prepare with the device executing the graph image.
  GenerateOptions go;
  go.max_new_tokens = 6;
  go.logits_steps = {0, 5};
  std::vector<GenerateResult> results;
  for (auto placement : {task::GraphPlacement::kDevice, task::GraphPlacement::kHost}) {
    auto e = engine(2, 4, Qwen3Engine::pages_for(prompts(), 6, 4), 4, placement);
    auto r = e->generate(prompts(), go);
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_TRUE(e->close().ok());
    results.push_back(std::move(*r));
  }
  ASSERT_EQ(results[0].requests.size(), results[1].requests.size());
  for (size_t i = 0; i < results[0].requests.size(); ++i) {
    EXPECT_EQ(results[0].requests[i].tokens, results[1].requests[i].tokens) << "request " << i;
    EXPECT_EQ(results[0].requests[i].logits, results[1].requests[i].logits) << "request " << i;
  }
}

TEST_F(EngineTest, HostSamplingFallsBackToSerialLaunchAndSaysSo) {
  // The sink is added before the engine's threads exist and removed after
  // they are joined (spdlog's sink list is not thread-safe); the level is
  // raised to warn for the test whatever SIMPLER_LOG_LEVEL says.
  auto sink = std::make_shared<spdlog::sinks::ringbuffer_sink_mt>(16);
  const spdlog::level::level_enum level = base::logger().level();
  base::logger().set_level(spdlog::level::warn);
  base::logger().sinks().push_back(sink);
  GenerateOptions go;
  go.max_new_tokens = 3;
  go.host_sampling = true;
  auto e = engine(2, 4, Qwen3Engine::pages_for(prompts(), 3, 4));
  auto r = e->generate(prompts(), go);
  const absl::Status closed = e->close();
  e.reset();
  base::logger().sinks().pop_back();
  base::logger().set_level(level);
  ASSERT_TRUE(closed.ok()) << closed;
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->stats.serial_launch);
  EXPECT_EQ(r->stats.max_steps_in_flight, 1);
  EXPECT_EQ(r->stats.requested_depth, 2);
  bool warned = false;
  for (const std::string& line : sink->last_formatted()) {
    warned =
        warned || line.find("falling back to serial launch (effective depth 1, requested 2)") !=
                      std::string::npos;
  }
  EXPECT_TRUE(warned) << "no serial-launch warning was logged";
}

TEST_F(EngineTest, CloneRequestsNeverSharePagesOrResults) {
  // Clones are live for exactly the same steps: their pages must be disjoint.
  std::vector<std::vector<int32_t>> clones(8, std::vector<int32_t>{5, 6, 7, 8, 9});
  auto e = engine(2, 8, Qwen3Engine::pages_for(clones, 10, 4));
  GenerateOptions go;
  go.max_new_tokens = 10;
  go.kv_positions = {0, 13};
  auto r = e->generate(clones, go);
  ASSERT_TRUE(r.ok()) << r.status();
  std::set<int32_t> seen;
  for (const auto& q : r->requests) {
    EXPECT_EQ(q.pages.size(), 4u);  // ceil((5 + 10 - 1) / 4) positions' pages
    for (int32_t p : q.pages) EXPECT_TRUE(seen.insert(p).second) << "page " << p << " shared";
    EXPECT_EQ(q.tokens, r->requests[0].tokens);
    // Each clone's own pages hold the same K/V.
    ASSERT_EQ(q.kv.size(), 2u);
    EXPECT_EQ(q.kv.at(13).k, r->requests[0].kv.at(13).k);
  }
}

TEST_F(EngineTest, StopIdFoundLateIsHonouredAndExtraTokensDiscarded) {
  GenerateOptions go;
  go.max_new_tokens = 12;
  std::vector<std::vector<int32_t>> one = {{1, 2, 3}, {7}};
  auto e1 = engine(1, 2, Qwen3Engine::pages_for(one, 12, 4));
  auto full = e1->generate(one, go);
  ASSERT_TRUE(full.ok());
  // Make request 0's 5th token a stop id.
  const int32_t stop = full->requests[0].tokens[4];
  go.stop_ids = {stop};
  for (int depth : {1, 4}) {
    auto e = engine(depth, 2, Qwen3Engine::pages_for(one, 12, 4));
    auto r = e->generate(one, go);
    ASSERT_TRUE(r.ok()) << r.status();
    const auto& t0 = r->requests[0].tokens;
    // Stops at the first occurrence of the stop id, which is kept.
    auto first = std::find(full->requests[0].tokens.begin(), full->requests[0].tokens.end(), stop);
    std::vector<int32_t> expect(full->requests[0].tokens.begin(), first + 1);
    EXPECT_EQ(t0, expect) << "depth " << depth;
    EXPECT_EQ(r->requests[0].finish_reason, "stop");
  }
}

TEST_F(EngineTest, BadRequestsAreRefusedWithTheReason) {
  auto e = engine(1, 2, 8);
  GenerateOptions go;
  go.max_new_tokens = 4;
  EXPECT_TRUE(contains(e->generate({{}}, go).status(), "request 0 has an empty prompt"));
  EXPECT_TRUE(contains(e->generate({{1, 512}}, go).status(),
                       "token id 512 outside the vocabulary [0, 512)"));
  EXPECT_TRUE(contains(e->generate({{1}, {2}, {3}}, go).status(), "3 requests exceed max_batch 2"));
  go.max_new_tokens = 0;
  EXPECT_TRUE(contains(e->generate({{1}}, go).status(), "max_new_tokens must be >= 1"));
  go.max_new_tokens = 5000;
  EXPECT_TRUE(contains(e->generate({{1}}, go).status(), "exceeds max_position_embeddings"));
  // Requests that can never fit the pool alone are refused, each naming its
  // need and the pool; the call itself succeeds.
  go.max_new_tokens = 40;
  auto never = e->generate({{1, 2}, {3, 4}}, go);
  ASSERT_TRUE(never.ok()) << never.status();
  for (const RequestResult& r : never->requests) {
    EXPECT_EQ(r.status.code(), absl::StatusCode::kResourceExhausted) << r.status;
    EXPECT_TRUE(contains(r.status, "needs 11 pages of 4 tokens, and the pool holds 8 pages"))
        << r.status;
    EXPECT_EQ(r.finish_reason, "error");
    EXPECT_TRUE(r.tokens.empty());
  }
  // One that fits is served beside one that never can (41 + 3 tokens: 11 pages).
  {
    GenerateOptions g = go;
    g.max_new_tokens = 3;
    auto mixed = e->generate({std::vector<int32_t>(41, 7), {1, 2}}, g);
    ASSERT_TRUE(mixed.ok()) << mixed.status();
    EXPECT_EQ(mixed->requests[0].status.code(), absl::StatusCode::kResourceExhausted);
    EXPECT_TRUE(mixed->requests[1].status.ok());
    EXPECT_EQ(mixed->requests[1].tokens.size(), 3u);
  }
  // Requests that fit alone but exhaust the pool together.
  go.max_new_tokens = 18;
  auto small = e->generate({{1, 2}, {3, 4}}, go);
  EXPECT_EQ(small.status().code(), absl::StatusCode::kResourceExhausted) << small.status();
  // The engine still works afterwards.
  go.max_new_tokens = 3;
  EXPECT_TRUE(e->generate({{1, 2}}, go).ok());
}

TEST_F(EngineTest, MissingModelNamesTheFile) {
  EngineOptions eo;
  eo.worker.faults.emplace();
  auto e = Qwen3Engine::create("/nonexistent-model", eo, 1, 1);
  ASSERT_FALSE(e.ok());
  EXPECT_TRUE(contains(e.status(), "/nonexistent-model")) << e.status();
}

TEST_F(EngineTest, KernelFaultFailsTheStepWithAttribution) {
  for (int depth : {1, 2, 4}) {
    EngineOptions eo;
    eo.worker.num_cores = 2;
    eo.worker.launch_depth = depth;
    eo.worker.faults = *device::FaultPlan::parse("run=2:task=5:kind=kernel_error");
    auto e = Qwen3Engine::create(*dir_, eo, 1, 4);
    ASSERT_TRUE(e.ok());
    GenerateOptions go;
    go.max_new_tokens = 6;
    auto r = (*e)->generate({{1, 2}}, go);
    ASSERT_FALSE(r.ok());
    EXPECT_TRUE(contains(r.status(), "run 2 task 5")) << r.status();
    // Steps behind the failed one were drained before generate returned; the
    // engine (lane not poisoned by a kernel error) still works.
    auto again = (*e)->generate({{1, 2}}, go);
    EXPECT_TRUE(again.ok()) << again.status();
  }
}

TEST_F(EngineTest, TheDecodeProgramsBuffersAreBoundAndCannotBeFreedUnderIt) {
  auto e = engine(2, 2, 8);
  const std::vector<worker::DeviceBuffer> bound = e->bound_buffers();
  ASSERT_GE(bound.size(), 5u);
  for (const worker::DeviceBuffer& b : bound) {
    absl::Status s = e->worker().free(b);
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    EXPECT_TRUE(contains(s, "is bound to callable 'qwen3_decode'")) << s;
  }
  GenerateOptions go;
  go.max_new_tokens = 3;
  EXPECT_TRUE(e->generate({{1, 2}}, go).ok());  // nothing was freed
}

}  // namespace
}  // namespace simpler::llm
