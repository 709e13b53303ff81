// The matmul inner loops per ISA target (matmul_impl.h), outside the runtime:
//   Decode/<target>/threads:T — one x row against W [131072, 1024] bf16 (256 MiB, far past the last
//     level cache), the rows split between T threads: weight bytes/s (bytes_per_second), to hold
//     against the read-bandwidth probe of `simpler bench decode`;
//   Prefill/<target>/R/N/K — R x rows (64: a prefill tile; 16: a batch-16 decode step; 512: a
//     512-token prompt) against W [N, K] bf16 (N 3072, K 1024: Qwen3-0.6B's gate projection, in
//     the last level cache; 1536 x 1024 and 512 x 3072: one of two threads' share of the gate
//     and down projections at 512 tokens; 131072: 256 MiB, streamed from memory as a decode step
//     streams its weights), one thread: GFLOP/s (the counter), to hold against the FMA peak of
//     `simpler bench prefill`.
// Run: build/release/src/kernels/matmul_benchmark [--benchmark_filter=Decode]. Targets the CPU
// lacks are skipped with a message.
#include <benchmark/benchmark.h>

#include <array>
#include <cstdint>
#include <vector>

#include "kernels/matmul_impl.h"
#include "simpler/kernels/kernels.h"

namespace simpler::llm {
namespace {

using matmul_detail::Problem;
using matmul_detail::WeightType;

using RunFn = void (*)(const Problem&);

RunFn run_of(KernelIsa isa) {
  switch (isa) {
#if defined(__x86_64__)
    case KernelIsa::kAvx512:
      return &matmul_detail::run_avx512;
    case KernelIsa::kX86_64V3:
      return &matmul_detail::run_x86_64_v3;
#elif defined(__aarch64__)
    case KernelIsa::kNeon:
      return &matmul_detail::run_neon;
#endif
    default:
      return &matmul_detail::run_portable;
  }
}

std::vector<uint16_t> bf16_weights(int64_t n, int64_t k) {
  std::vector<uint16_t> w(static_cast<size_t>(n * k));
  for (size_t i = 0; i < w.size(); ++i) w[i] = static_cast<uint16_t>(0x3f80 + i % 61);
  return w;
}

void Decode(benchmark::State& state, KernelIsa isa) {
  if (!kernel_isa_available(isa)) {
    state.SkipWithError("this CPU lacks the target");
    return;
  }
  constexpr int64_t kN = 131072, kK = 1024;
  static const std::vector<uint16_t> w = bf16_weights(kN, kK);
  std::vector<float> x(kK, 0.5f), y(kN);
  const int64_t begin = kN * state.thread_index() / state.threads();
  const int64_t end = kN * (state.thread_index() + 1) / state.threads();
  Problem p;
  p.x = x.data();
  p.rows = 1;
  p.k = kK;
  p.w = w.data() + begin * kK;
  p.wt = WeightType::kBF16;
  p.n = end - begin;
  p.y = y.data() + begin;
  p.ldy = kN;
  const RunFn run = run_of(isa);
  for (auto _ : state) {
    run(p);
    benchmark::DoNotOptimize(y.data());
  }
  state.SetBytesProcessed(state.iterations() * p.n * kK * 2);
}

void Prefill(benchmark::State& state, KernelIsa isa) {
  if (!kernel_isa_available(isa)) {
    state.SkipWithError("this CPU lacks the target");
    return;
  }
  const int64_t kRows = state.range(0), kN = state.range(1), kK = state.range(2);
  const std::vector<uint16_t> w = bf16_weights(kN, kK);
  std::vector<float> x(kRows * kK, 0.25f), y(kRows * kN);
  Problem p;
  p.x = x.data();
  p.rows = kRows;
  p.k = kK;
  p.w = w.data();
  p.wt = WeightType::kBF16;
  p.n = kN;
  p.y = y.data();
  p.ldy = kN;
  const RunFn run = run_of(isa);
  for (auto _ : state) {
    run(p);
    benchmark::DoNotOptimize(y.data());
  }
  state.counters["GFLOP/s"] =
      benchmark::Counter(static_cast<double>(state.iterations()) * 2 * kRows * kN * kK / 1e9,
                         benchmark::Counter::kIsRate);
}

// The prefill shapes {rows, N, K}: a 64-row tile and a batch-16 step of [3072, 1024], the
// batch-16 LM head, and one thread's share of a 512-token prefill (gate/up, down).
void prefill_shapes(benchmark::internal::Benchmark* b) {
  for (const auto& [rows, n, k] : std::vector<std::array<int64_t, 3>>{{64, 3072, 1024},
                                                                      {16, 3072, 1024},
                                                                      {16, 131072, 1024},
                                                                      {512, 1536, 1024},
                                                                      {512, 512, 3072}}) {
    b->Args({rows, n, k});
  }
  b->UseRealTime();
}

BENCHMARK_CAPTURE(Decode, avx512, KernelIsa::kAvx512)->Threads(1)->Threads(2)->UseRealTime();
BENCHMARK_CAPTURE(Decode, x86_64_v3, KernelIsa::kX86_64V3)->Threads(1)->Threads(2)->UseRealTime();
BENCHMARK_CAPTURE(Decode, neon, KernelIsa::kNeon)->Threads(1)->Threads(2)->UseRealTime();
BENCHMARK_CAPTURE(Decode, portable, KernelIsa::kPortable)->Threads(1)->UseRealTime();
BENCHMARK_CAPTURE(Prefill, avx512, KernelIsa::kAvx512)->Apply(prefill_shapes);
BENCHMARK_CAPTURE(Prefill, x86_64_v3, KernelIsa::kX86_64V3)->Apply(prefill_shapes);
BENCHMARK_CAPTURE(Prefill, neon, KernelIsa::kNeon)->Apply(prefill_shapes);
BENCHMARK_CAPTURE(Prefill, portable, KernelIsa::kPortable)->Apply(prefill_shapes);

}  // namespace
}  // namespace simpler::llm
