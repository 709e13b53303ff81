// Internal to the llm kernels: the matmul inner loops, y[r, j] (+)= Σ_k x[r, k]·W[j, k], with f32
// activations and accumulation over f32, bf16 or f16 weights (widened to f32 in registers) or Q8_0,
// Q4_0, Q4_K or Q6_K weights (dequantized to f32 in registers, the same f32 value on every path,
// so the contract below holds for the dequantized values; docs/design/quantized_matmul.md).
//
// Numerics, the same in every path and for every blocking: each y element is 16 lane sums,
// lane l accumulating x[r, k]·W[j, k] for k ≡ l (mod 16) in increasing k with a fused
// multiply-add (lanes past K add 0·0), reduced by the fixed tree
// s8[i] = l[i] + l[i+8], s4[i] = s8[i] + s8[i+4], s2[i] = s4[i] + s4[i+2], s = s2[0] + s2[1];
// then y = s, or y = y + s when accumulating. So a row's result depends on nothing but its own
// x and W (batch-invariant), and every path (portable, x86-64-v3, AVX-512, NEON) gives the same
// bits: they are one source (matmul_tile.h) on per-target traits.
//
// One exception: the portable path built for a baseline without an FMA instruction (x86-64;
// portable_fused() false) rounds each lane's product, then its sum. It keeps the lanes, their
// order and the tree (so it stays batch-invariant), and its error is within the standard bound
// of such a sum (Higham, "Accuracy and Stability of Numerical Algorithms", 2nd ed., §3.1):
// |y - Σ x·w| <= γ(⌈K/16⌉ + 5) · Σ|x·w|, γ(n) = n·u / (1 - n·u), u = 2^-24; the fused paths'
// bound is γ(⌈K/16⌉ + 4). The two can differ by the sum of both.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "simpler/task/data_type.h"

namespace simpler::llm::matmul_detail {

enum class WeightType : uint8_t { kF32, kBF16, kF16, kQ8_0, kQ4_0, kQ4_K, kQ6_K };
// The WeightType of a W dtype: kF32 for kFloat32 and every dtype without its own (the callers
// check W's dtype first).
WeightType weight_type_of(task::DataType dtype);

// ggml's block_q8_0: 32 weights in 34 bytes, the scale d (IEEE binary16, little-endian) then 32
// int8 q; weight i of the block is d·q[i]. A Q8_0 W row is k / 32 blocks (k a multiple of 32).
inline constexpr int64_t kQ8_0BlockWeights = 32;
inline constexpr int64_t kQ8_0BlockBytes = 34;
// ggml's block_q4_0: 32 weights in 18 bytes, the scale d then 16 bytes qs; weight i < 16 is
// d·((qs[i] & 15) - 8), weight i + 16 is d·((qs[i] >> 4) - 8). Rows as Q8_0.
inline constexpr int64_t kQ4_0BlockBytes = 18;
// ggml's block_q4_K and block_q6_K (task::DataType::kQ4_K / kQ6_K: the layouts and formulas):
// super-blocks of 256 weights in 144 and 210 bytes. A row of them is k / 256 super-blocks (k a
// multiple of 256). The dequantized weight is exact for Q6_K and one rounding of an exact
// difference for Q4_K, the same on every path (docs/design/quantized_matmul.md).
inline constexpr int64_t kSuperBlockWeights = 256;
inline constexpr int64_t kQ4_KBlockBytes = 144;
inline constexpr int64_t kQ6_KBlockBytes = 210;

struct Problem {
  const float* x = nullptr;  // [rows, k], row stride k
  int64_t rows = 0;
  int64_t k = 0;
  const void* w = nullptr;  // [n, k] of `wt`, row stride k (Q8_0: k / 32 blocks of 34 bytes, ...)
  WeightType wt = WeightType::kF32;
  int64_t n = 0;
  float* y = nullptr;  // [rows, ldy]: columns [0, n) written
  int64_t ldy = 0;
  bool accumulate = false;
  // W rows from w a kernel may prefetch (read ahead of use, never compute): n, or more when W
  // goes on past p's rows (a block computing a matrix's rows in several claims: its next claim
  // is most often the rows right after these, which then start warm). 0 means n.
  int64_t prefetch_n = 0;
  // W's rows interleaved task::kInterleavedRows at a time (task::DataType::kQ4_K_R16, kQ6_K_R16,
  // kQ8_0_R16; wt is the plain kQ4_K, kQ6_K, kQ8_0): w at a group's first row, n a multiple of the
  // group. Only the kernels that say so read it (Int8Dots::interleaved); run_deinterleaved serves
  // every other.
  bool interleaved = false;
};

// The interleaved dtype of W rows of `wt` (Problem::interleaved): kQ4_K_R16, kQ6_K_R16 or
// kQ8_0_R16; kUInt8 (no interleaved form) for every other type.
inline task::DataType interleaved_dtype_of(WeightType wt) {
  switch (wt) {
    case WeightType::kQ4_K:
      return task::DataType::kQ4_K_R16;
    case WeightType::kQ6_K:
      return task::DataType::kQ6_K_R16;
    case WeightType::kQ8_0:
      return task::DataType::kQ8_0_R16;
    default:
      return task::DataType::kUInt8;
  }
}

// Runs p (interleaved) as plain problems, one group of task::kInterleavedRows rows at a time:
// each group's rows copied out of the interleaving into a per-thread buffer
// (task::deinterleave_rows), then `run` on a copy of p over them. For the paths that do not read
// interleaved rows (precision exact, the portable and NEON int8 paths); the rows' results are
// those of the plain tensor.
template <class Run>
void run_deinterleaved(const Problem& p, Run&& run) {
  constexpr int64_t kGroup = task::kInterleavedRows;
  const task::DataType dtype = interleaved_dtype_of(p.wt);
  const auto row_bytes = static_cast<int64_t>(task::bytes_of(dtype, static_cast<uint64_t>(p.k)));
  thread_local std::vector<uint8_t> plain;
  plain.resize(static_cast<size_t>(kGroup * row_bytes));
  for (int64_t j = 0; j < p.n; j += kGroup) {
    task::deinterleave_rows(dtype, static_cast<const uint8_t*>(p.w) + j * row_bytes, kGroup, p.k,
                            plain.data());
    Problem q = p;
    q.w = plain.data();
    q.n = kGroup;
    q.y = p.y + j;
    q.prefetch_n = 0;
    q.interleaved = false;
    run(q);
  }
}

// The bytes of W from w that p's kernel may prefetch (Problem::prefetch_n rows of `row_bytes`).
inline int64_t prefetch_bytes(const Problem& p, int64_t row_bytes) {
  return (p.prefetch_n > p.n ? p.prefetch_n : p.n) * row_bytes;
}

// W rows per chunk of a matmul path: as many rows of `row_bytes` as fit 256 KiB (kept in L2 while
// every row group of x uses them), a multiple of `multiple`, at least `multiple`. Built with the
// baseline flags (matmul_portable.cc), called once per call by every path.
int64_t chunk_rows(int64_t row_bytes, int64_t multiple);
// Bytes of L1 data cache that one block of k's x rows and one tile's W rows may fill (several x
// rows: matmul_tile.h's k_block): two thirds of this CPU's L1d as the C library reports it
// (sysconf(_SC_LEVEL1_DCACHE_SIZE), read once; counted as at most 64 KiB), and at least 24 KiB:
// 24 KiB on a 32 KiB L1d (or when none is reported), 32 KiB on a 48 KiB one (Zen 5, Sapphire
// Rapids), where AVX-512's 6 x 4 tile then takes K = 1024 in one block. Built with the baseline
// flags (matmul_portable.cc). Thread-safe.
int64_t l1_block_bytes();

// Vector extensions of the compiler on the baseline target; runs on any CPU. Never a libm call.
void run_portable(const Problem& p);
// Whether run_portable's lane steps are fused (the baseline has an FMA instruction: aarch64, or
// x86-64 built for FMA), so its results are bitwise the other paths'; else see the exception
// above.
bool portable_fused();
// a·b + c rounded once, as std::fma, with the attention tile's portable code (fma_exact.h),
// exposed for its test.
float fma_exact_attention(float a, float b, float c);
// Whether this CPU has AVX2, FMA and F16C (what run_x86_64_v3 uses).
bool x86_64_v3_available();
// AVX2 + FMA + F16C intrinsics (built with -mavx2 -mfma -mf16c); call only when
// x86_64_v3_available().
void run_x86_64_v3(const Problem& p);
// aarch64 NEON intrinsics (matmul_neon.cc, built only for aarch64, where it always runs).
bool neon_available();
void run_neon(const Problem& p);
float fma_probe_neon(int64_t iters, float seed);
// Whether this CPU has AVX-512 F, BW, VL and DQ (what run_avx512 uses).
bool avx512_available();
// AVX-512 intrinsics (built with -mavx512*); call only when avx512_available().
void run_avx512(const Problem& p);

// Whether this CPU also has AVX512_BF16 (what run_avx512_bf16 uses).
bool avx512_bf16_available();
// The bf16-activation path (precision bf16): x rounded to bf16, vdpbf16ps against bf16 W with
// f32 accumulation (its own numerics, documented in matmul_avx512_bf16.cc). Requires
// p.wt == kBF16; call only when avx512_bf16_available().
void run_avx512_bf16(const Problem& p);

// Batched rows of the bf16 path: at and above this many x rows, matmul with precision bf16 runs
// run_dnnl_bf16 (a GEMM); below it, run_avx512_bf16 (the weights streamed once per call).
// Chosen by measurement (docs/benchmarks-history.md, "oneDNN for bf16 batched rows"): one thread,
// one block's W slice of [1536, 1024] and [512, 3072]: ours is faster up to 12 rows, even at 12-16,
// oneDNN ahead above.
constexpr int64_t kDnnlMinRows = 16;
// The bf16 path through oneDNN (matmul_dnnl.cc): x rounded to bf16 (round to nearest even),
// oneDNN's bf16 GEMM (AMX where the CPU and kernel allow it, else AVX512_BF16) with f32
// accumulation in oneDNN's own order, on the calling thread only. Not batch-invariant (the
// blocking depends on the row count). Requires p.wt == kBF16. INTERNAL naming the shape and
// oneDNN's status when oneDNN refuses the problem.
absl::Status run_dnnl_bf16(const Problem& p);
// The oneDNN implementation the bf16 GEMM gets on this machine (oneDNN's own name, e.g.
// "brg:avx512_core_amx" or "brg:avx512_core_bf16"), for logs and benchmarks.
std::string dnnl_bf16_implementation();

// FMA throughput probes: `iters` rounds of 12·16 f32 fused multiply-adds (12·16·2 FLOPs each) on
// independent chains in registers; return a value derived from the result so the work stays.
// Each only where its path runs.
float fma_probe_avx512(int64_t iters, float seed);
float fma_probe_x86_64_v3(int64_t iters, float seed);
float fma_probe_portable(int64_t iters, float seed);

}  // namespace simpler::llm::matmul_detail
