// The bf16-activation path of matmul_impl.h (RunnerOptions::precision kBf16): x rows rounded to
// bf16 (round to nearest even) once per call, then AVX512_BF16 dot products (vdpbf16ps) against
// bf16 weights with f32 accumulation. This file alone is built with -mavx512bf16 (plus the flags
// of matmul_avx512.cc); everything but its two entry points has internal linkage.
//
// Numerics: each y element is 16 lane sums, lane l accumulating, for every 32-wide chunk of k,
// the pair x[2l]·W[2l] + x[2l+1]·W[2l+1] of that chunk (vdpbf16ps: each product of two bf16 is
// exact in f32; denormal inputs and outputs flush to zero), reduced by the fixed tree of
// matmul_impl.h. A row's result depends on nothing but its own x and W (batch-invariant); it
// differs from the exact path by the rounding of x to bf16 (relative 2^-9 per element).
#include <cstdint>
#include <vector>

#include "kernels/matmul_avx512_common.h"
#include "kernels/matmul_impl.h"

namespace simpler::llm::matmul_detail {
namespace {

constexpr int kRowsPerTile = 4;
constexpr int kColsPerTile = 4;

// x row (f32, k) -> bf16 (RNE) into `out`, zero-padded to `kp` (a multiple of 32).
void to_bf16(const float* x, int64_t k, int64_t kp, uint16_t* out) {
  for (int64_t kk = 0; kk < kp; kk += 32) {
    const int64_t left = k - kk;
    const __mmask16 lo_m = left >= 16 ? __mmask16(0xffff)
                           : left > 0 ? __mmask16((1u << left) - 1)
                                      : __mmask16(0);
    const __mmask16 hi_m = left >= 32  ? __mmask16(0xffff)
                           : left > 16 ? __mmask16((1u << (left - 16)) - 1)
                                       : __mmask16(0);
    const __m512 lo = _mm512_maskz_loadu_ps(lo_m, x + kk);
    const __m512 hi = _mm512_maskz_loadu_ps(hi_m, x + kk + 16);
    const __m512bh packed = _mm512_cvtne2ps_pbh(hi, lo);
    _mm512_storeu_si512(reinterpret_cast<void*>(out + kk),
                        reinterpret_cast<const __m512i&>(packed));
  }
}

inline __m512bh load_bh(const uint16_t* p) {
  const __m512i v = _mm512_loadu_si512(reinterpret_cast<const void*>(p));
  return reinterpret_cast<const __m512bh&>(v);
}
inline __m512bh load_bh(const uint16_t* p, __mmask32 m) {
  const __m512i v = _mm512_maskz_loadu_epi16(m, p);
  return reinterpret_cast<const __m512bh&>(v);
}

// R rows of bf16 x (row stride kp, zero-padded) against C bf16 W rows (row stride k).
template <int R, int C>
void tile(const uint16_t* xb, int64_t kp, const uint16_t* w, int64_t k, float* y, int64_t ldy,
          bool accumulate) {
  __m512 acc[R][C];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  }
  // One 32-wide step of k from kk; the last one masks the W rows' end (x is zero-padded to kp).
  auto step = [&](int64_t kk, __mmask32 m) __attribute__((always_inline)) {
    __m512bh wv[C];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) wv[c] = load_bh(w + c * k + kk, m);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = load_bh(xb + r * kp + kk);
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv, wv[c]);
    }
  };
  int64_t kk = 0;
  for (; kk + 32 <= k; kk += 32) step(kk, ~__mmask32{0});
  if (kk < k) step(kk, static_cast<__mmask32>((uint64_t{1} << (k - kk)) - 1));
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      const float s = reduce(acc[r][c]);
      float* out = y + r * ldy + c;
      *out = accumulate ? *out + s : s;
    }
  }
}

using TileFn = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, float*, int64_t, bool);

template <int R>
struct Row {
  static constexpr TileFn fns[kColsPerTile] = {&tile<R, 1>, &tile<R, 2>, &tile<R, 3>, &tile<R, 4>};
};

TileFn tile_fn(int rows, int cols) {
  switch (rows) {
    case 1:
      return Row<1>::fns[cols - 1];
    case 2:
      return Row<2>::fns[cols - 1];
    case 3:
      return Row<3>::fns[cols - 1];
    default:
      return Row<4>::fns[cols - 1];
  }
}

}  // namespace

bool avx512_bf16_available() { return avx512_available() && __builtin_cpu_supports("avx512bf16"); }

void run_avx512_bf16(const Problem& p) {
  const int64_t kp = (p.k + 31) / 32 * 32;
  // This call's x rows in bf16 (a core thread's own buffer, reused across calls).
  thread_local std::vector<uint16_t> xb;
  xb.resize(static_cast<size_t>(p.rows * kp));
  for (int64_t r = 0; r < p.rows; ++r) to_bf16(p.x + r * p.k, p.k, kp, xb.data() + r * kp);
  const auto* w = static_cast<const uint16_t*>(p.w);
  const int64_t chunk = chunk_rows(p.k * 2, 8);  // W rows kept in L2 across the row groups
  for (int64_t j0 = 0; j0 < p.n; j0 += chunk) {
    const int64_t jn = p.n - j0 < chunk ? p.n - j0 : chunk;
    for (int64_t r0 = 0; r0 < p.rows; r0 += kRowsPerTile) {
      const int rows = static_cast<int>(p.rows - r0 < kRowsPerTile ? p.rows - r0 : kRowsPerTile);
      for (int64_t j = 0; j < jn; j += kColsPerTile) {
        const int cols = static_cast<int>(jn - j < kColsPerTile ? jn - j : kColsPerTile);
        tile_fn(rows, cols)(xb.data() + r0 * kp, kp, w + (j0 + j) * p.k, p.k,
                            p.y + r0 * p.ldy + j0 + j, p.ldy, p.accumulate);
      }
    }
  }
}

}  // namespace simpler::llm::matmul_detail
