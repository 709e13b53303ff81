// The AVX-512 path of matmul_impl.h. This file alone is built with -mavx512f -mavx512bw
// -mavx512vl -mavx512dq: it includes no header with inline functions other than intrinsics and
// matmul_avx512_common.h (internal linkage, shared with the bf16 path), and everything but its
// entry points has internal linkage, so no AVX-512 code can be picked by the linker for another
// file's inline function.
#include <cstdint>

#include "llm/matmul_avx512_common.h"
#include "llm/matmul_impl.h"

namespace simpler::llm::matmul_detail {
namespace {

constexpr int kMaxRows = 6;  // rows of a register tile
constexpr int kMaxCols = 4;  // W rows (output features) of a register tile; 8 when one x row

template <WeightType WT>
struct WeightBits;
template <>
struct WeightBits<WeightType::kF32> {
  using T = float;
  static __m512 load(const T* p) { return _mm512_loadu_ps(p); }
  static __m512 load(const T* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
};
template <>
struct WeightBits<WeightType::kBF16> {
  using T = uint16_t;
  static __m512 widen(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static __m512 load(const T* p) {
    return widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static __m512 load(const T* p, __mmask16 m) { return widen(_mm256_maskz_loadu_epi16(m, p)); }
};
template <>
struct WeightBits<WeightType::kF16> {
  using T = uint16_t;
  static __m512 load(const T* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static __m512 load(const T* p, __mmask16 m) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
  }
};

// One R x C register tile: rows [0, R) of x against W rows [0, C).
template <WeightType WT, int R, int C>
void tile(const float* x, int64_t k, const typename WeightBits<WT>::T* w, float* y, int64_t ldy,
          bool accumulate) {
  __m512 acc[R][C];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  }
  int64_t kk = 0;
  for (; kk + 16 <= k; kk += 16) {
    __m512 wv[C];
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) wv[c] = WeightBits<WT>::load(w + c * k + kk);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_loadu_ps(x + r * k + kk);
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(xv, wv[c], acc[r][c]);
    }
  }
  if (kk < k) {
    const __mmask16 m = static_cast<__mmask16>((1u << (k - kk)) - 1);
    __m512 wv[C];
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) wv[c] = WeightBits<WT>::load(w + c * k + kk, m);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_maskz_loadu_ps(m, x + r * k + kk);
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(xv, wv[c], acc[r][c]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      const float s = reduce(acc[r][c]);
      float* out = y + r * ldy + c;
      *out = accumulate ? *out + s : s;
    }
  }
}

template <WeightType WT>
using TileFn = void (*)(const float*, int64_t, const typename WeightBits<WT>::T*, float*, int64_t,
                        bool);

template <WeightType WT, int R>
struct Row {
  static constexpr TileFn<WT> fns[kMaxCols] = {&tile<WT, R, 1>, &tile<WT, R, 2>, &tile<WT, R, 3>,
                                               &tile<WT, R, 4>};
};

template <WeightType WT>
TileFn<WT> tile_fn(int rows, int cols) {
  switch (rows) {
    case 1:
      return Row<WT, 1>::fns[cols - 1];
    case 2:
      return Row<WT, 2>::fns[cols - 1];
    case 3:
      return Row<WT, 3>::fns[cols - 1];
    case 4:
      return Row<WT, 4>::fns[cols - 1];
    case 5:
      return Row<WT, 5>::fns[cols - 1];
    default:
      return Row<WT, 6>::fns[cols - 1];
  }
}

template <WeightType WT>
void run(const Problem& p) {
  using T = typename WeightBits<WT>::T;
  const T* w = static_cast<const T*>(p.w);
  const int64_t chunk = chunk_rows(p.k * static_cast<int64_t>(sizeof(T)));
  for (int64_t j0 = 0; j0 < p.n; j0 += chunk) {
    const int64_t jn = p.n - j0 < chunk ? p.n - j0 : chunk;
    if (p.rows == 1) {
      // One x row (decode): a streaming matrix-vector product, 8 W rows at a time.
      int64_t j = 0;
      for (; j + 8 <= jn; j += 8) {
        tile<WT, 1, 8>(p.x, p.k, w + (j0 + j) * p.k, p.y + j0 + j, p.ldy, p.accumulate);
      }
      for (; j < jn; j += kMaxCols) {
        const int cols = static_cast<int>(jn - j < kMaxCols ? jn - j : kMaxCols);
        tile_fn<WT>(1, cols)(p.x, p.k, w + (j0 + j) * p.k, p.y + j0 + j, p.ldy, p.accumulate);
      }
      continue;
    }
    for (int64_t r0 = 0; r0 < p.rows; r0 += kMaxRows) {
      const int rows = static_cast<int>(p.rows - r0 < kMaxRows ? p.rows - r0 : kMaxRows);
      const float* x = p.x + r0 * p.k;
      float* y = p.y + r0 * p.ldy + j0;
      for (int64_t j = 0; j < jn; j += kMaxCols) {
        const int cols = static_cast<int>(jn - j < kMaxCols ? jn - j : kMaxCols);
        tile_fn<WT>(rows, cols)(x, p.k, w + (j0 + j) * p.k, y + j, p.ldy, p.accumulate);
      }
    }
  }
}

}  // namespace

float fma_probe_avx512(int64_t iters, float seed) {
  __m512 acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = _mm512_set1_ps(seed + i);
  const __m512 a = _mm512_set1_ps(0.999999f), b = _mm512_set1_ps(1e-7f);
  for (int64_t it = 0; it < iters; ++it) {
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i) acc[i] = _mm512_fmadd_ps(acc[i], a, b);
  }
  __m512 s = acc[0];
  for (int i = 1; i < 12; ++i) s = _mm512_add_ps(s, acc[i]);
  return reduce(s);
}

void run_avx512(const Problem& p) {
  switch (p.wt) {
    case WeightType::kF32:
      return run<WeightType::kF32>(p);
    case WeightType::kBF16:
      return run<WeightType::kBF16>(p);
    case WeightType::kF16:
      return run<WeightType::kF16>(p);
  }
}

}  // namespace simpler::llm::matmul_detail
