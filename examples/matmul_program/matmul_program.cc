// Example program library: C = A · B + bias, tiled over cores, built as a
// separate shared object and run with `simpler run libsimpler_example_matmul.so`.
//
// Kernels: `matmul_rows` computes a block of C's rows with Eigen; `add_bias`
// adds a bias row vector to a block of rows (INOUT), so the runtime infers a
// RAW dependency between the two per block. The self-check's reference is
// computed here with a plain double-precision loop.
#include <algorithm>
#include <random>

#include "Eigen/Core"
#include "simpler/base/status.h"
#include "simpler/task/program_abi.h"

namespace {

using simpler::task::ArgDirection;
using simpler::task::KernelContext;
using simpler::task::TaskArgs;

// Rows [begin, end) of `rows` split evenly over block_dim blocks.
void block_rows(int64_t rows, const KernelContext& ctx, int64_t* begin, int64_t* end) {
  const int64_t per = (rows + ctx.block_dim - 1) / ctx.block_dim;
  *begin = std::min(rows, per * ctx.block_idx);
  *end = std::min(rows, *begin + per);
}

// args: 0 A f32 [M,K] IN, 1 B f32 [K,N] IN, 2 C f32 [M,N] OUT.
absl::Status matmul_rows(const KernelContext& ctx) {
  const auto& a = ctx.tensor(0);
  const auto& b = ctx.tensor(1);
  const auto& c = ctx.tensor(2);
  const int64_t m = a.shape[0], k = a.shape[1], n = b.shape[1];
  if (b.shape[0] != k || c.shape[0] != m || c.shape[1] != n) {
    return absl::InvalidArgumentError("matmul_rows: shape mismatch");
  }
  int64_t r0, r1;
  block_rows(m, ctx, &r0, &r1);
  if (r0 >= r1) return absl::OkStatus();
  using Mat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  Eigen::Map<const Mat> A(a.data<float>() + r0 * k, r1 - r0, k);
  Eigen::Map<const Mat> B(b.data<float>(), k, n);
  Eigen::Map<Mat> C(c.data<float>() + r0 * n, r1 - r0, n);
  C.noalias() = A * B;
  return absl::OkStatus();
}

// args: 0 C f32 [M,N] INOUT, 1 bias f32 [N] IN.
absl::Status add_bias(const KernelContext& ctx) {
  const auto& c = ctx.tensor(0);
  const float* bias = ctx.tensor(1).data<float>();
  const int64_t m = c.shape[0], n = c.shape[1];
  int64_t r0, r1;
  block_rows(m, ctx, &r0, &r1);
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t j = 0; j < n; ++j) c.data<float>()[r * n + j] += bias[j];
  }
  return absl::OkStatus();
}

// Run args: 0 A [M,K] IN, 1 B [K,N] IN, 2 bias [N] IN, 3 C [M,N] OUT.
absl::Status orchestrate(simpler::task::OrchestrationContext& ctx, const TaskArgs& args) {
  const int32_t blocks =
      std::max<int32_t>(1, std::min<int64_t>(ctx.num_cores(), args.tensor(0).shape[0]));
  TaskArgs mm;
  mm.add_tensor(args.tensor(0), ArgDirection::kIn)
      .add_tensor(args.tensor(1), ArgDirection::kIn)
      .add_tensor(args.tensor(3), ArgDirection::kOut);
  SIMPLER_RETURN_IF_ERROR(ctx.submit(0, mm, blocks));
  TaskArgs bias;
  bias.add_tensor(args.tensor(3), ArgDirection::kInOut)
      .add_tensor(args.tensor(2), ArgDirection::kIn);
  return ctx.submit(1, bias, blocks);
}

simpler::task::SelfCheck make_check(int64_t m, int64_t k, int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> a(m * k), b(k * n), bias(n), c(m * n);
  for (auto& v : a) v = u(rng);
  for (auto& v : b) v = u(rng);
  for (auto& v : bias) v = u(rng);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double acc = bias[j];
      for (int64_t p = 0; p < k; ++p) acc += static_cast<double>(a[i * k + p]) * b[p * n + j];
      c[i * n + j] = static_cast<float>(acc);
    }
  }
  using K = simpler::task::SelfCheckArg::Kind;
  simpler::task::SelfCheck chk;
  chk.name = "matmul_bias_" + std::to_string(m) + "x" + std::to_string(k) + "x" + std::to_string(n);
  chk.callable = "matmul_bias";
  chk.args = {{K::kInput, {m, k}, a, 0},
              {K::kInput, {k, n}, b, 0},
              {K::kInput, {n}, bias, 0},
              {K::kOutput, {m, n}, c, 0}};
  chk.tolerance = 1e-3;
  return chk;
}

int register_program(simpler::task::ProgramRegistry* registry) {
  registry->add_callable(simpler::task::ChipCallable{
      "matmul_bias", orchestrate, {{"matmul_rows", matmul_rows}, {"add_bias", add_bias}}});
  registry->add_self_check(make_check(64, 48, 32, 1));
  registry->add_self_check(make_check(257, 129, 65, 2));
  return 0;
}

}  // namespace

SIMPLER_PROGRAM_ENTRY("example_matmul", register_program)
