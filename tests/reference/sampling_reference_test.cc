// The sampler's math against `qwen3_ref.py sample` (numpy, float64, vLLM's formulas written
// independently): penalized logits, the greedy pick, raw logprobs with the top alternatives,
// and the final sampling distribution after temperature, min_p, top-k and top-p.
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "base/test_temp_dir.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "simpler/kernels/sampling.h"

namespace simpler::llm {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

using simpler::testing::read_file;

struct Case {
  std::vector<float> logits;
  std::vector<int32_t> prompt_ids, output_ids;
  SamplingParams params;
};

json params_json(const SamplingParams& p) {
  json stops = json::array();
  for (int32_t id : p.stop_ids) {
    if (id >= 0) stops.push_back(id);
  }
  return {{"temperature", p.temperature},
          {"top_p", p.top_p},
          {"top_k", p.top_k},
          {"min_p", p.min_p},
          {"presence_penalty", p.presence_penalty},
          {"frequency_penalty", p.frequency_penalty},
          {"repetition_penalty", p.repetition_penalty},
          {"logprobs", p.logprobs},
          {"min_tokens", p.min_tokens},
          {"stop_ids", stops}};
}

std::vector<Case> make_cases() {
  constexpr int64_t kV = 97;
  std::mt19937 rng(2026);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::uniform_int_distribution<int32_t> token(0, kV - 1);
  auto logits = [&] {
    std::vector<float> l(kV);
    for (float& x : l) x = normal(rng);
    return l;
  };
  auto ids = [&](int n) {
    std::vector<int32_t> v(n);
    for (int32_t& x : v) x = token(rng);
    return v;
  };
  std::vector<Case> cases;
  auto add = [&](SamplingParams p) { cases.push_back({logits(), ids(12), ids(20), p}); };
  SamplingParams p;
  p.logprobs = 5;
  add(p);  // plain: temperature 1, no filters
  p.repetition_penalty = 1.3f;
  p.frequency_penalty = 0.4f;
  p.presence_penalty = -0.7f;
  add(p);  // every penalty, negative presence
  p.temperature = 0.6f;
  p.top_k = 12;
  p.top_p = 0.85f;
  p.min_p = 0.03f;
  p.logprobs = 3;
  add(p);  // penalties and every filter
  p = SamplingParams{};
  p.repetition_penalty = 0.7f;  // < 1 rewards repeats
  p.frequency_penalty = -1.5f;
  p.temperature = 1.4f;
  p.top_p = 0.5f;
  p.logprobs = 1;
  add(p);
  p = SamplingParams{};
  p.temperature = 0.0f;  // greedy with penalties and a masked stop id
  p.repetition_penalty = 2.0f;
  p.presence_penalty = 2.0f;
  p.min_tokens = 25;
  p.stop_ids[0] = 5;
  p.stop_ids[1] = 17;
  p.logprobs = 5;
  add(p);
  return cases;
}

TEST(SamplingReference, PenaltiesLogprobsAndDistributionsMatchTheNumpyReference) {
  const fs::path dir = simpler::testing::test_dir("simpler_sampling_reference_test");
  const std::vector<Case> cases = make_cases();
  json in = {{"cases", json::array()}};
  for (const Case& c : cases) {
    in["cases"].push_back({{"logits", c.logits},
                           {"prompt_ids", c.prompt_ids},
                           {"output_ids", c.output_ids},
                           {"params", params_json(c.params)}});
  }
  const fs::path cases_path = dir / "cases.json", out_path = dir / "out.json",
                 log = dir / "sample.log";
  std::ofstream(cases_path) << in.dump();
  const std::string command = std::string("'") + SIMPLER_PYTHON3 + "' '" + SIMPLER_QWEN3_REF +
                              "' sample --cases '" + cases_path.string() + "' --out '" +
                              out_path.string() + "' > '" + log.string() + "' 2>&1";
  ASSERT_EQ(std::system(command.c_str()), 0) << command << "\n" << read_file(log);
  const json out = json::parse(read_file(out_path));
  ASSERT_EQ(out["results"].size(), cases.size());

  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE(::testing::Message() << "case " << i << ": " << params_json(cases[i].params));
    const Case& c = cases[i];
    const json& ref = out["results"][i];
    const int64_t v = static_cast<int64_t>(c.logits.size());
    ASSERT_TRUE(c.params.validate(v).ok());
    // The device state the token_counts kernel builds from the committed tokens.
    std::vector<int32_t> counts(v, 0);
    for (int32_t t : c.prompt_ids) counts[t] |= 1;
    for (int32_t t : c.output_ids) counts[t] += 2;
    const int64_t generated = static_cast<int64_t>(c.output_ids.size());

    std::vector<float> pen = c.logits;
    apply_penalties(c.params, counts.data(), generated, pen.data(), v);
    std::vector<double> ref_pen;  // null is a masked (-inf) logit
    for (const json& x : ref["penalized"]) {
      ref_pen.push_back(x.is_null() ? -std::numeric_limits<double>::infinity() : x.get<double>());
    }
    ASSERT_EQ(static_cast<int64_t>(ref_pen.size()), v);
    for (int64_t t = 0; t < v; ++t) {
      if (std::isinf(ref_pen[t])) {
        EXPECT_EQ(pen[t], ref_pen[t]) << "token " << t;
      } else {
        EXPECT_NEAR(pen[t], ref_pen[t], 1e-5 * (1 + std::abs(ref_pen[t]))) << "token " << t;
      }
    }

    const SampleResult r =
        sample_row(c.params, SampleRowInfo{0, 40, 0, static_cast<int32_t>(generated)},
                   c.logits.data(), counts.data(), v);
    const std::vector<double> raw = ref["raw_logprobs"].get<std::vector<double>>();
    EXPECT_NEAR(r.logprob, raw[r.id], 1e-5);
    const std::vector<int32_t> top = ref["top_ids"].get<std::vector<int32_t>>();
    const std::vector<double> top_lp = ref["top_logprobs"].get<std::vector<double>>();
    ASSERT_EQ(static_cast<int>(top.size()), c.params.logprobs);
    for (int j = 0; j < kMaxLogprobs; ++j) {
      if (j < c.params.logprobs) {
        EXPECT_EQ(r.top_ids[j], top[j]) << "alternative " << j;
        EXPECT_NEAR(r.top_logprobs[j], top_lp[j], 1e-5) << "alternative " << j;
      } else {
        EXPECT_EQ(r.top_ids[j], -1);
      }
    }

    if (ref["probs"].is_null()) {
      EXPECT_EQ(r.id, ref["greedy"].get<int32_t>());
      continue;
    }
    std::vector<double> w(v);
    sampling_weights(c.params, pen.data(), v, w.data());
    double total = 0;
    for (double x : w) total += x;
    const std::vector<double> probs = ref["probs"].get<std::vector<double>>();
    for (int64_t t = 0; t < v; ++t) {
      EXPECT_NEAR(w[t] / total, probs[t], 1e-5) << "token " << t;
      EXPECT_EQ(w[t] > 0, probs[t] > 0) << "support differs at token " << t;
    }
    EXPECT_GT(probs[r.id], 0.0) << "sampled token " << r.id << " is outside the support";
  }
}

}  // namespace
}  // namespace simpler::llm
