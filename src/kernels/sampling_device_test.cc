// The sampling kernels as a program on the sim device (Worker, staged host tensors): each run
// commits the previous step's tokens with token_counts and samples the next ones; the tokens
// equal sample_row's on the host, step after step.
#include <cstring>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "simpler/kernels/sampling.h"
#include "simpler/simpler.h"

namespace simpler::llm {
namespace {

using task::ArgDirection;
using task::DataType;
using task::MemoryKind;
using task::Tensor;

template <typename T>
Tensor host(std::vector<T>& data, std::initializer_list<int64_t> shape) {
  DataType dtype = DataType::kInt32;
  if constexpr (std::is_same_v<T, float>) dtype = DataType::kFloat32;
  if constexpr (std::is_same_v<T, uint8_t>) dtype = DataType::kUInt8;
  return *Tensor::contiguous(reinterpret_cast<uintptr_t>(data.data()), shape, dtype,
                             MemoryKind::kHost);
}

// Args: 0 commit_ids, 1 commit_slots, 2 counts, 3 logits, 4 params, 5 rows, 6 out_ids,
// 7 out_logprobs, 8 top_ids, 9 top_logprobs.
absl::Status step_program(task::OrchestrationContext& ctx, const task::TaskArgs& a) {
  absl::Status s = ctx.submit(
      0, token_counts_args(a.tensor(0), a.tensor(1), a.tensor(2), TokenCountsMode::kGenerated));
  if (!s.ok()) return s;
  return ctx.submit(1,
                    sample_args(a.tensor(3), a.tensor(4), a.tensor(5), a.tensor(2), a.tensor(6),
                                a.tensor(7), a.tensor(8), a.tensor(9)),
                    2);
}

TEST(SamplingOnDevice, StepsCommitTokensAndSampleLikeTheHostMath) {
  constexpr int64_t kRows = 4, kV = 40, kSlots = 4;
  worker::WorkerOptions o;
  o.num_cores = 2;
  o.faults.emplace();  // no injected faults, whatever the environment says
  worker::Worker w(o);
  auto h = w.register_callable(task::ChipCallable{"sample_step", step_program, sampling_kernels()});
  ASSERT_TRUE(h.ok()) << h.status();
  ASSERT_TRUE(w.init().ok());

  std::vector<SamplingParams> params(kRows);
  params[0].temperature = 0.0f;  // greedy with a repetition penalty
  params[0].repetition_penalty = 1.5f;
  params[1].seed = 11;
  params[1].frequency_penalty = 1.0f;
  params[1].top_k = 8;
  params[2].seed = 11;  // same seed as row 1, another choice
  params[2].presence_penalty = 1.5f;
  params[2].top_p = 0.9f;
  params[3].seed = 99;
  params[3].min_p = 0.1f;
  params[3].min_tokens = 3;
  params[3].stop_ids[0] = 0;
  params[3].logprobs = 5;
  std::vector<uint8_t> param_bytes(kRows * sizeof(SamplingParams));
  std::memcpy(param_bytes.data(), params.data(), param_bytes.size());

  std::vector<int32_t> counts(kSlots * kV, 0), host_counts(kSlots * kV, 0);
  std::vector<int32_t> commit_ids(kRows, 0), commit_slots(kRows, -1);  // step 0 commits nothing
  std::vector<int32_t> rows(kRows * 4), ids(kRows), top_ids(kRows * kMaxLogprobs);
  std::vector<float> logits(kRows * kV), lp(kRows), top_lp(kRows * kMaxLogprobs);
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int32_t step = 0; step < 12; ++step) {
    for (float& x : logits) x = normal(rng);
    for (int64_t r = 0; r < kRows; ++r) {
      // Slots in reverse row order; choice 1 for row 2.
      const SampleRowInfo ri{static_cast<int32_t>(kSlots - 1 - r), 100 + step, r == 2 ? 1 : 0,
                             step};
      std::memcpy(&rows[r * 4], &ri, sizeof(ri));
    }
    task::TaskArgs args;
    args.add_tensor(host(commit_ids, {kRows}), ArgDirection::kIn)
        .add_tensor(host(commit_slots, {kRows}), ArgDirection::kIn)
        .add_tensor(host(counts, {kSlots, kV}), ArgDirection::kInOut)
        .add_tensor(host(logits, {kRows, kV}), ArgDirection::kIn)
        .add_tensor(host(param_bytes, {kRows, static_cast<int64_t>(sizeof(SamplingParams))}),
                    ArgDirection::kIn)
        .add_tensor(host(rows, {kRows, 4}), ArgDirection::kIn)
        .add_tensor(host(ids, {kRows}), ArgDirection::kOut)
        .add_tensor(host(lp, {kRows}), ArgDirection::kOut)
        .add_tensor(host(top_ids, {kRows, kMaxLogprobs}), ArgDirection::kOut)
        .add_tensor(host(top_lp, {kRows, kMaxLogprobs}), ArgDirection::kOut);
    ASSERT_TRUE(w.run(*h, args).ok()) << "step " << step;
    // The host mirror: commit, then sample with the same state.
    for (int64_t r = 0; r < kRows; ++r) {
      if (commit_slots[r] >= 0) host_counts[commit_slots[r] * kV + commit_ids[r]] += 2;
    }
    ASSERT_EQ(counts, host_counts) << "step " << step;
    for (int64_t r = 0; r < kRows; ++r) {
      const SampleRowInfo ri{rows[r * 4], rows[r * 4 + 1], rows[r * 4 + 2], rows[r * 4 + 3]};
      const SampleResult want =
          sample_row(params[r], ri, &logits[r * kV], &host_counts[ri.slot * kV], kV);
      EXPECT_EQ(ids[r], want.id) << "step " << step << " row " << r;
      EXPECT_EQ(lp[r], want.logprob) << "step " << step << " row " << r;
      for (int j = 0; j < kMaxLogprobs; ++j) {
        EXPECT_EQ(top_ids[r * kMaxLogprobs + j], want.top_ids[j]);
      }
      if (step < 3 && r == 3) {
        EXPECT_NE(ids[r], 0) << "stop id masked before min_tokens";
      }
      commit_ids[r] = ids[r];
      commit_slots[r] = ri.slot;
    }
  }
  EXPECT_TRUE(w.close().ok());
}

}  // namespace
}  // namespace simpler::llm
