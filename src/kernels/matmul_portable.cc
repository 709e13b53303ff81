// The portable path of matmul_impl.h (matmul_tile.h on GCC/Clang vector extensions, 4 x 4 lanes,
// any CPU) and the CPU checks for the other paths. Built for the baseline target: where that
// target has no fused multiply-add instruction (baseline x86-64), each lane's fused multiply-add
// is computed exactly without libm (fma_exact), so the results are bitwise those of the
// hardware-FMA paths.
#include <bit>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__x86_64__)
#include <cpuid.h>
#include <emmintrin.h>  // SSE2: part of the x86-64 baseline
#endif

#include "Eigen/Core"
#include "kernels/fma_exact.h"
#include "kernels/matmul_impl.h"
#include "kernels/matmul_tile.h"

namespace simpler::llm::matmul_detail {
namespace {

using F4 = float __attribute__((vector_size(16)));
using F2 = float __attribute__((vector_size(8)));
using D2 = double __attribute__((vector_size(16)));
using I2 = int64_t __attribute__((vector_size(16)));
using U16x4 = uint16_t __attribute__((vector_size(8)));
using U32x4 = uint32_t __attribute__((vector_size(16)));

// a·b + c per lane with one rounding: the baseline's FMA instruction where it has one
// (aarch64); else fma_exact.h's method in double (a·b is exact there, the sum rounded to odd,
// then to float), on x86-64 with SSE2 intrinsics (the baseline's: GCC lowered the same code on
// vector extensions partly to scalar moves, 2x slower). The round-to-odd value is the sum
// truncated toward zero with its last bit set, when inexact.
#if defined(__FP_FAST_FMAF)
__attribute__((always_inline)) inline F4 fma_exact4(F4 a, F4 b, F4 c) {
  F4 r;
  for (int l = 0; l < 4; ++l) r[l] = __builtin_fmaf(a[l], b[l], c[l]);
  return r;
}
#elif defined(__SSE2__)
__attribute__((always_inline)) inline __m128d sum_to_odd(__m128d p, __m128d cd) {
  const __m128d s = _mm_add_pd(p, cd);
  const __m128d bb = _mm_sub_pd(s, p);
  const __m128d err = _mm_add_pd(_mm_sub_pd(p, _mm_sub_pd(s, bb)), _mm_sub_pd(cd, bb));
  const __m128d zero = _mm_setzero_pd();
  const __m128d abs_s = _mm_andnot_pd(_mm_set1_pd(-0.0), s);
  const __m128d inexact = _mm_and_pd(_mm_cmpneq_pd(err, zero),  // and s finite
                                     _mm_cmple_pd(abs_s, _mm_set1_pd(1.7976931348623157e308)));
  const __m128d toward_zero = _mm_xor_pd(_mm_cmpgt_pd(err, zero), _mm_cmpgt_pd(s, zero));
  const __m128i one = _mm_set1_epi64x(1);
  const __m128i dec = _mm_and_si128(_mm_castpd_si128(_mm_and_pd(inexact, toward_zero)), one);
  const __m128i odd = _mm_and_si128(_mm_castpd_si128(inexact), one);
  return _mm_castsi128_pd(_mm_or_si128(_mm_sub_epi64(_mm_castpd_si128(s), dec), odd));
}
__attribute__((always_inline)) inline F4 fma_exact4(F4 a, F4 b, F4 c) {
  const __m128 av = reinterpret_cast<__m128&>(a), bv = reinterpret_cast<__m128&>(b),
               cv = reinterpret_cast<__m128&>(c);
  const __m128d lo = sum_to_odd(_mm_mul_pd(_mm_cvtps_pd(av), _mm_cvtps_pd(bv)), _mm_cvtps_pd(cv));
  const __m128d hi = sum_to_odd(
      _mm_mul_pd(_mm_cvtps_pd(_mm_movehl_ps(av, av)), _mm_cvtps_pd(_mm_movehl_ps(bv, bv))),
      _mm_cvtps_pd(_mm_movehl_ps(cv, cv)));
  const __m128 r = _mm_movelh_ps(_mm_cvtpd_ps(lo), _mm_cvtpd_ps(hi));
  return reinterpret_cast<const F4&>(r);
}
#else
// The same on the compiler's vector extensions, for a baseline with neither.
__attribute__((always_inline)) inline D2 sum_to_odd(D2 p, D2 cd) {
  const D2 s = p + cd;
  const D2 bb = s - p;
  const D2 err = (p - (s - bb)) + (cd - bb);
  constexpr double kMax = std::numeric_limits<double>::max();
  const I2 inexact = ((err < 0.0) | (err > 0.0)) & (s <= kMax) & (s >= -kMax);  // and s finite
  const I2 toward_zero = (err > 0.0) ^ (s > 0.0);  // the exact value lies inside |s|
  I2 bits;
  std::memcpy(&bits, &s, sizeof(bits));
  bits = (bits - (inexact & toward_zero & 1)) | (inexact & 1);
  D2 rounded;
  std::memcpy(&rounded, &bits, sizeof(rounded));
  return rounded;
}
__attribute__((always_inline)) inline F4 fma_exact4(F4 a, F4 b, F4 c) {
  const auto lo = [](F4 v) {
    return __builtin_convertvector(__builtin_shufflevector(v, v, 0, 1), D2);
  };
  const auto hi = [](F4 v) {
    return __builtin_convertvector(__builtin_shufflevector(v, v, 2, 3), D2);
  };
  const F2 rlo = __builtin_convertvector(sum_to_odd(lo(a) * lo(b), lo(c)), F2);
  const F2 rhi = __builtin_convertvector(sum_to_odd(hi(a) * hi(b), hi(c)), F2);
  return __builtin_shufflevector(rlo, rhi, 0, 1, 2, 3);
}
#endif

struct Portable {
  using P = F4;
  static constexpr int kParts = 4;
  static constexpr int kPartLanes = 4;
  static constexpr int kMaxRows = 2;
  static constexpr int kMaxCols = 2;
  static constexpr int kDecodeCols = 2;

  static P zero() { return P{}; }
  static P load(const float* p) {
    P v;
    std::memcpy(&v, p, sizeof(v));
    return v;
  }
  static P load_tail(const float* p, int n) {
    P v{};
    std::memcpy(&v, p, static_cast<size_t>(n) * sizeof(float));
    return v;
  }
  template <WeightType WT>
  static P widen(const uint16_t* h, int n) {
    P v{};
    for (int l = 0; l < n; ++l) {
      if constexpr (WT == WeightType::kBF16) {
        v[l] = std::bit_cast<float>(static_cast<uint32_t>(h[l]) << 16);  // bf16: the high half
      } else {
        v[l] = static_cast<float>(Eigen::numext::bit_cast<Eigen::half>(h[l]));  // exact
      }
    }
    return v;
  }
  template <WeightType WT>
  static P load_w(const WeightT<WT>* p) {
    if constexpr (WT == WeightType::kBF16) {
      // bf16 is the high half of an f32: 4 of them widened at once (zero-extend, shift).
      U16x4 h;
      std::memcpy(&h, p, sizeof(h));
      const U32x4 bits = __builtin_convertvector(h, U32x4) << 16;
      P v;
      std::memcpy(&v, &bits, sizeof(v));
      return v;
    } else if constexpr (WT == WeightType::kF32) {
      return load(p);
    } else {
      return widen<WT>(p, kPartLanes);
    }
  }
  template <WeightType WT>
  static P load_w_tail(const WeightT<WT>* p, int n) {
    if constexpr (WT == WeightType::kF32) {
      return load_tail(p, n);
    } else {
      return widen<WT>(p, n);
    }
  }
  static P fmadd(P a, P b, P c) { return fma_exact4(a, b, c); }
  // Lane l is lane l % 4 of part l / 4: s8 = (parts 0 + 2, parts 1 + 3), s4 = s8's halves added,
  // s2[i] = s4[i] + s4[i+2], s2[0] + s2[1].
  static float reduce(const P* parts) {
    const P s8lo = parts[0] + parts[2];
    const P s8hi = parts[1] + parts[3];
    const P s4 = s8lo + s8hi;
    return (s4[0] + s4[2]) + (s4[1] + s4[3]);
  }
};

}  // namespace

float fma_exact(float a, float b, float c) {
  const F4 r = fma_exact4(F4{a, 0, 0, 0}, F4{b, 0, 0, 0}, F4{c, 0, 0, 0});
  return r[0];
}

float fma_exact_attention(float a, float b, float c) { return fma_exact_scalar(a, b, c); }

int64_t chunk_rows(int64_t row_bytes, int64_t multiple) {
  constexpr int64_t kChunkBytes = 256 * 1024;
  const int64_t chunk = kChunkBytes / (row_bytes > 0 ? row_bytes : 1);
  return chunk < multiple ? multiple : chunk - chunk % multiple;
}

void run_portable(const Problem& p) { run_on<Portable>(p); }

float fma_probe_portable(int64_t iters, float seed) { return fma_probe<Portable>(iters, seed); }

bool x86_64_v3_available() {
#if defined(__x86_64__)
  static const bool available = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    const bool f16c = __get_cpuid(1, &a, &b, &c, &d) != 0 && (c & bit_F16C) != 0;
    return f16c && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }();
  return available;
#else
  return false;
#endif
}

bool avx512_available() {
#if defined(__x86_64__)
  static const bool available =
      __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  return available;
#else
  return false;
#endif
}

}  // namespace simpler::llm::matmul_detail
