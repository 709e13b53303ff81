// The matmul inner loops per ISA target (matmul_impl.h), outside the runtime:
//   Decode/<target>/real_time/threads:T — one x row against W [131072, 1024] bf16 (256 MiB, far
//   past the last
//     level cache), the rows split between T threads: weight bytes/s (bytes_per_second), to hold
//     against the read-bandwidth probe of `simpler bench decode`;
//   Prefill/<target>/R/N/K/real_time — R x rows (64: a prefill tile; 16: a batch-16 decode step;
//   512: a
//     512-token prompt) against W [N, K] bf16 (N 3072, K 1024: Qwen3-0.6B's gate projection, in
//     the last level cache; 1536 x 1024 and 512 x 3072: one of two threads' share of the gate
//     and down projections at 512 tokens; 131072: 256 MiB, streamed from memory as a decode step
//     streams its weights), one thread: GFLOP/s (the counter), to hold against the FMA peak of
//     `simpler bench prefill`;
//   Int8/<weight type>_<integer-sum target>_<whole|shared>/R/N/K/real_time — precision int8
//     (matmul_int8.h) over a block-quantized W [N, K], R x rows (1 against N 131072: W of 75.5 MB
//     (Q4_K) to 142.6 MB (Q8_0), from memory where the last level cache is smaller (in an Emerald
//     Rapids VM's 260 MB L3); 1 against N 512 or [256, 3072]: a decode step's share of k_proj or
//     down_proj, in L2, the kernel's own pace; R 2 and 3 against N 512: a batch-2 or batch-3
//     step's share, in L2 (bytes per second of W, so against R 1 the cost of a row more);
//     R 2, 4, 8, 16, 64 against N 3072: batched steps of
//     the gate projection; 16 against N 32768: a larger one), one thread, with the target's
//     whole-product kernel (Int8Dots::rows) or the shared loop over its integer sums: the same
//     bits, the ratio of the two is the kernel's gain;
//   Int8Calls/<weight type>_<target>/S/real_time/threads:T — one x row against W [524288 / T,
//     1024] per thread (302 MB in all for Q4_K, 570 MB for Q8_0: from memory) walked in calls of S
//     rows, as a decode step's cores call the kernel;
//   ExactBlocks/<weight type>_<target>/R/N/K/real_time — precision exact over the same W and
//     shapes;
//   Attention/<target>/C/real_time/threads:T — a batch-1 decode step's paged attention over C
//     cached positions in Qwen3-0.6B's shape, 28 layers (470 MB of f32 K and V at C 2,048; 7 MB
//     at C 32, a short context, in the last level cache): bytes of K and V read per second, to
//     hold against the read probe. The pages lie in order (a decode's are scattered: the same
//     arithmetic, other access patterns for the hardware prefetchers). <target> x86_64_v3_dim96:
//     heads of 96 instead of 128 (no target tile takes them: the generic body, as NEON runs it).
// bytes_per_second ("G/s") is Google Benchmark's GiB/s (x 1.074 for the GB/s of `simpler bench
// decode` and its read probe). Debian's libbenchmark 1.7 was built without NDEBUG and says
// "Library was built as DEBUG"; that is the library's own build, not these loops'.
// Run: build/release/src/kernels/matmul_benchmark [--benchmark_filter=Decode]. Targets the CPU
// lacks are skipped with a message.
#include <benchmark/benchmark.h>
#include <sys/mman.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <new>
#include <string>
#include <vector>

#include "kernels/matmul_impl.h"
#include "kernels/matmul_int8.h"
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

// Random block bytes with every scale a small binary16 (no NaN or infinity).
std::vector<uint8_t> quantized_weights(WeightType wt, int64_t n, int64_t k) {
  const int64_t block = wt == WeightType::kQ8_0   ? matmul_detail::kQ8_0BlockBytes
                        : wt == WeightType::kQ4_K ? matmul_detail::kQ4_KBlockBytes
                                                  : matmul_detail::kQ6_KBlockBytes;
  const int64_t per = wt == WeightType::kQ8_0 ? 32 : matmul_detail::kSuperBlockWeights;
  std::vector<uint8_t> w(static_cast<size_t>(n * k / per * block));
  uint32_t state = 12345;
  for (uint8_t& b : w) {
    state = state * 1664525u + 1013904223u;
    b = static_cast<uint8_t>(state >> 24);
  }
  const int64_t at = wt == WeightType::kQ6_K ? 208 : 0;
  for (int64_t b = 0; b < n * k / per; ++b) {
    w[b * block + at] = 0x00;
    w[b * block + at + 1] = 0x20;
    if (wt == WeightType::kQ4_K) w[b * block + 3] = 0x1c;
  }
  return w;
}

matmul_detail::Int8Dots int8_target(const std::string& target) {
#if defined(__x86_64__)
  if (target == "avx512vnni") return matmul_detail::int8_dots_avx512vnni();
  if (target == "avxvnni") return matmul_detail::int8_dots_avxvnni();
  if (target == "avx2") return matmul_detail::int8_dots_avx2();
#elif defined(__aarch64__)
  if (target == "neon") return matmul_detail::int8_dots_neon();
#endif
  return matmul_detail::int8_dots_portable();
}

bool int8_target_available(const std::string& target) {
#if defined(__x86_64__)
  if (target == "avx512vnni") return matmul_detail::avx512vnni_available();
  if (target == "avxvnni") return matmul_detail::avxvnni_available();
  if (target == "avx2") return kernel_isa_available(KernelIsa::kX86_64V3);
#elif defined(__aarch64__)
  if (target == "neon") return kernel_isa_available(KernelIsa::kNeon);
#endif
  return target == "portable";
}

// An allocator of memory advised to use transparent huge pages, as the sim device's memory is
// (sim_device.cc): W streams from memory through the same TLB reach as in a decode step.
template <class T>
struct HugePages {
  using value_type = T;
  HugePages() = default;
  template <class U>
  explicit HugePages(const HugePages<U>& /*other*/) {}
  T* allocate(size_t n) {
    void* p =
        ::mmap(nullptr, n * sizeof(T), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    (void)::madvise(p, n * sizeof(T), MADV_HUGEPAGE);
    return static_cast<T*>(p);
  }
  void deallocate(T* p, size_t n) { ::munmap(p, n * sizeof(T)); }
  bool operator==(const HugePages& /*other*/) const { return true; }
};
using HugeBytes = std::vector<uint8_t, HugePages<uint8_t>>;

// A matmul over `rows` x rows of `k` against block-quantized W [n, k] of type `wt` (seeded
// weights, x in [-0.5, 0.5); with `interleaved` its rows interleaved 16 at a time,
// task::DataType::kQ4_K_R16, kQ6_K_R16 or kQ8_0_R16, n a multiple of 16), its Problem pointing
// into the vectors it owns.
struct QuantizedProblem {
  QuantizedProblem(WeightType wt, int64_t rows, int64_t n, int64_t k, bool interleaved = false)
      : w(weights(wt, n, k, interleaved)), x(rows * k), y(rows * n) {
    for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i % 97) / 97.f - 0.5f;
    p.x = x.data();
    p.rows = rows;
    p.k = k;
    p.w = w.data();
    p.wt = wt;
    p.n = n;
    p.y = y.data();
    p.ldy = n;
    p.interleaved = interleaved;
  }
  static HugeBytes weights(WeightType wt, int64_t n, int64_t k, bool interleaved) {
    const std::vector<uint8_t> w = quantized_weights(wt, n, k);
    HugeBytes out(w.size());
    if (!interleaved) {
      std::copy(w.begin(), w.end(), out.begin());
      return out;
    }
    task::interleave_rows(matmul_detail::interleaved_dtype_of(wt), w.data(), n, k, out.data());
    return out;
  }
  QuantizedProblem(const QuantizedProblem&) = delete;
  QuantizedProblem& operator=(const QuantizedProblem&) = delete;
  const HugeBytes w;
  std::vector<float> x, y;
  Problem p;
};

void Int8(benchmark::State& state, WeightType wt, const char* target, bool whole,
          bool interleaved = false) {
  if (!int8_target_available(target)) {
    state.SkipWithError("this CPU lacks the target");
    return;
  }
  QuantizedProblem q(wt, state.range(0), state.range(1), state.range(2), interleaved);
  matmul_detail::Int8Dots dots = int8_target(target);
  if (!whole) dots.rows = nullptr;
  for (auto _ : state) {
    matmul_detail::run_int8(q.p, dots);
    benchmark::DoNotOptimize(q.y.data());
  }
  state.SetBytesProcessed(state.iterations() * static_cast<int64_t>(q.w.size()));
}

void int8_shapes(benchmark::internal::Benchmark* b) {
  b->Args({1, 131072, 1024})
      ->Args({1, 512, 1024})
      ->Args({1, 256, 3072})
      ->Args({2, 512, 1024})
      ->Args({3, 512, 1024})
      ->Args({2, 3072, 1024})
      ->Args({4, 3072, 1024})
      ->Args({8, 3072, 1024})
      ->Args({16, 3072, 1024})
      ->Args({64, 3072, 1024})
      ->Args({16, 32768, 1024})
      ->UseRealTime();
}

// One x row against W [524288 / T, 1024] per thread (T threads, each its own W; 302 MB in all for
// Q4_K, 570 for Q8_0: past the 260 MB L3 of an Emerald Rapids VM, so streamed from memory), walked
// in calls of `slice` rows (state.range(0)) as a decode step calls it: 512 rows is
// one of two cores' share of a 1024-row projection, each call quantizing x and starting cold. The
// kernels' pace in a decode differs from one long call's (Int8/.../1/131072/1024): a loop that
// is fast there can be slow here, and this is the case that ranks them as the decode does.
void Int8Calls(benchmark::State& state, WeightType wt, const char* target,
               bool interleaved = false) {
  if (!int8_target_available(target)) {
    state.SkipWithError("this CPU lacks the target");
    return;
  }
  QuantizedProblem q(wt, 1, 524288 / state.threads(), 1024, interleaved);
  const matmul_detail::Int8Dots dots = int8_target(target);
  const int64_t slice = state.range(0), row_bytes = static_cast<int64_t>(q.w.size()) / q.p.n;
  for (auto _ : state) {
    for (int64_t j = 0; j < q.p.n; j += slice) {
      Problem p = q.p;
      p.w = q.w.data() + j * row_bytes;
      p.n = std::min(slice, q.p.n - j);
      p.y = q.y.data() + j;
      matmul_detail::run_int8(p, dots);
    }
    benchmark::DoNotOptimize(q.y.data());
  }
  state.SetBytesProcessed(state.iterations() * static_cast<int64_t>(q.w.size()));
}

void int8_call_shapes(benchmark::internal::Benchmark* b) {
  b->Arg(512)->Arg(1536)->Arg(131072)->Threads(1)->Threads(2)->UseRealTime();
}

// Precision exact over the same block-quantized W (dequantized in registers against f32 x): the
// other side of the per-weight-type default (kernels.h, Precision).
void ExactBlocks(benchmark::State& state, WeightType wt, KernelIsa isa) {
  if (!kernel_isa_available(isa)) {
    state.SkipWithError("this CPU lacks the target");
    return;
  }
  QuantizedProblem q(wt, state.range(0), state.range(1), state.range(2));
  const RunFn run = run_of(isa);
  for (auto _ : state) {
    run(q.p);
    benchmark::DoNotOptimize(q.y.data());
  }
  state.SetBytesProcessed(state.iterations() * static_cast<int64_t>(q.w.size()));
}

#define SIMPLER_INT8_BENCHMARKS(type, wt)                                                         \
  BENCHMARK_CAPTURE(Int8, type##_avx512vnni_whole, wt, "avx512vnni", true)->Apply(int8_shapes);   \
  BENCHMARK_CAPTURE(Int8, type##_avx512vnni_shared, wt, "avx512vnni", false)->Apply(int8_shapes); \
  BENCHMARK_CAPTURE(Int8, type##_avxvnni_whole, wt, "avxvnni", true)->Apply(int8_shapes);         \
  BENCHMARK_CAPTURE(Int8, type##_avx2_whole, wt, "avx2", true)->Apply(int8_shapes);               \
  BENCHMARK_CAPTURE(Int8Calls, type##_avx512vnni, wt, "avx512vnni")->Apply(int8_call_shapes);     \
  BENCHMARK_CAPTURE(Int8Calls, type##_avxvnni, wt, "avxvnni")->Apply(int8_call_shapes);           \
  BENCHMARK_CAPTURE(Int8Calls, type##_avx2, wt, "avx2")->Apply(int8_call_shapes);                 \
  BENCHMARK_CAPTURE(Int8, type##_neon_shared, wt, "neon", false)->Apply(int8_shapes);             \
  BENCHMARK_CAPTURE(ExactBlocks, type##_avx512, wt, KernelIsa::kAvx512)->Apply(int8_shapes);      \
  BENCHMARK_CAPTURE(ExactBlocks, type##_x86_64_v3, wt, KernelIsa::kX86_64V3)->Apply(int8_shapes); \
  BENCHMARK_CAPTURE(ExactBlocks, type##_neon, wt, KernelIsa::kNeon)->Apply(int8_shapes)
SIMPLER_INT8_BENCHMARKS(q8_0, WeightType::kQ8_0);
SIMPLER_INT8_BENCHMARKS(q4_k, WeightType::kQ4_K);
SIMPLER_INT8_BENCHMARKS(q6_k, WeightType::kQ6_K);

// The same W rows interleaved 16 at a time (task::DataType::kQ4_K_R16, kQ6_K_R16, kQ8_0_R16), as
// the model runner stores them for the x86 int8 targets.
#define SIMPLER_INT8_R16_BENCHMARKS(type, wt)                                                     \
  BENCHMARK_CAPTURE(Int8, type##_r16_avx512vnni_whole, wt, "avx512vnni", true, true)              \
      ->Apply(int8_shapes);                                                                       \
  BENCHMARK_CAPTURE(Int8, type##_r16_avxvnni_whole, wt, "avxvnni", true, true)                    \
      ->Apply(int8_shapes);                                                                       \
  BENCHMARK_CAPTURE(Int8, type##_r16_avx2_whole, wt, "avx2", true, true)->Apply(int8_shapes);     \
  BENCHMARK_CAPTURE(Int8Calls, type##_r16_avx512vnni, wt, "avx512vnni", true)                     \
      ->Apply(int8_call_shapes);                                                                  \
  BENCHMARK_CAPTURE(Int8Calls, type##_r16_avxvnni, wt, "avxvnni", true)->Apply(int8_call_shapes); \
  BENCHMARK_CAPTURE(Int8Calls, type##_r16_avx2, wt, "avx2", true)->Apply(int8_call_shapes)
SIMPLER_INT8_R16_BENCHMARKS(q4_k, WeightType::kQ4_K);
SIMPLER_INT8_R16_BENCHMARKS(q6_k, WeightType::kQ6_K);
SIMPLER_INT8_R16_BENCHMARKS(q8_0, WeightType::kQ8_0);

// One decode step's attention at batch 1 over a context of state.range(0) cached positions, in
// Qwen3-0.6B's shape (16 query heads, 8 kv heads of `dim` (128), 28 layers each with its own K and
// V pools of pages of 16 positions, the request's pages in order): the paged_attention kernel of
// `isa` on every layer, the layer's (kv head, row) pairs split between the threads as the blocks
// of a task with fixed shares. Bytes: the K and V rows read (at 2,048 positions and dim 128,
// 470 MB a step, past the last level cache).
void Attention(benchmark::State& state, KernelIsa isa, int64_t dim = 128) {
  if (!kernel_isa_available(isa)) {
    state.SkipWithError("this CPU lacks the target");
    return;
  }
  constexpr int64_t kHeads = 16, kKv = 8, kLayers = 28, kPage = 16;
  const int64_t context = state.range(0), pages = context / kPage;
  const int64_t pool = pages * kPage * kKv * dim;
  static std::vector<float> pools;  // K then V of each layer, shared by the threads
  if (state.thread_index() == 0) pools.assign(static_cast<size_t>(2 * kLayers * pool), 0.25f);
  std::vector<float> q(kHeads * dim, 0.5f), out(kHeads * dim);
  std::vector<int32_t> table(static_cast<size_t>(pages)), lens = {static_cast<int32_t>(context)};
  for (int64_t i = 0; i < pages; ++i) table[static_cast<size_t>(i)] = static_cast<int32_t>(i);
  const task::KernelFn fn = llm_kernels(isa)[static_cast<size_t>(KernelId::kPagedAttention)].fn;
  auto view = [](auto& v, std::initializer_list<int64_t> shape, task::DataType dt) {
    return task::Tensor::contiguous(reinterpret_cast<uintptr_t>(v.data()), shape, dt).value();
  };
  for (auto _ : state) {
    for (int64_t l = 0; l < kLayers; ++l) {
      float* k = pools.data() + 2 * l * pool;
      task::Tensor kt = task::Tensor::contiguous(reinterpret_cast<uintptr_t>(k),
                                                 {pages, kKv, kPage, dim}, task::DataType::kFloat32)
                            .value();
      task::Tensor vt = kt;
      vt.address += static_cast<uint64_t>(pool) * sizeof(float);
      const task::TaskArgs args = paged_attention_args(
          view(q, {1, kHeads, dim}, task::DataType::kFloat32), kt, vt,
          view(table, {1, pages}, task::DataType::kInt32), view(lens, {1}, task::DataType::kInt32),
          view(out, {1, kHeads * dim}, task::DataType::kFloat32),
          1.0f / std::sqrt(static_cast<float>(dim)));
      task::KernelContext ctx;
      ctx.args = args.args().data();
      ctx.num_args = static_cast<uint32_t>(args.size());
      ctx.block_idx = state.thread_index();
      ctx.block_dim = state.threads();
      if (!fn(ctx).ok()) state.SkipWithError("paged_attention failed");
    }
    benchmark::DoNotOptimize(out.data());
  }
  state.SetBytesProcessed(state.iterations() * kLayers * 2 * context * kKv * dim *
                          static_cast<int64_t>(sizeof(float)) / state.threads());
}

BENCHMARK_CAPTURE(Attention, avx512, KernelIsa::kAvx512)
    ->Arg(32)
    ->Arg(512)
    ->Arg(2048)
    ->Threads(1)
    ->Threads(2)
    ->UseRealTime();
BENCHMARK_CAPTURE(Attention, x86_64_v3, KernelIsa::kX86_64V3)
    ->Arg(32)
    ->Arg(2048)
    ->Threads(1)
    ->Threads(2)
    ->UseRealTime();
// The generic tile body (attend_tile_body), as NEON runs it: with fused multiply-adds where a head
// dim of 96 has no target tile of its own (x86-64-v3's tiles take 64 and 128), and on the baseline
// target (each fused multiply-add computed exactly in software: its cost, not the walk's).
BENCHMARK_CAPTURE(Attention, x86_64_v3_dim96, KernelIsa::kX86_64V3, 96)
    ->Arg(32)
    ->Arg(2048)
    ->Threads(1)
    ->UseRealTime();
BENCHMARK_CAPTURE(Attention, portable, KernelIsa::kPortable)->Arg(32)->Threads(1)->UseRealTime();
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
