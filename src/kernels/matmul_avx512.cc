// The AVX-512 path of matmul_impl.h: matmul_tile.h on 16-lane zmm registers, one part per 16
// lanes, tails by masked loads. This file alone is built with -mavx512f -mavx512bw -mavx512vl
// -mavx512dq: it includes no header with inline functions other than intrinsics,
// matmul_avx512_common.h and matmul_tile.h (internal linkage), and everything but its entry
// points has internal linkage, so no AVX-512 code can be picked by the linker for another file's
// inline function.
#include <cstdint>
#include <cstring>

#include "kernels/matmul_avx512_common.h"
#include "kernels/matmul_impl.h"
#include "kernels/matmul_tile.h"

namespace simpler::llm::matmul_detail {
namespace {

struct Avx512 : PartsOf<16> {
  using P = __m512;
  static_assert(sizeof(P) == kPartLanes * sizeof(float));
  // 24 accumulators of the 32 zmm registers; one x row streams 8 W rows at a time.
  static constexpr int kMaxRows = 6;
  static constexpr int kMaxCols = 4;
  static constexpr int kDecodeCols = 8;

  static P zero() { return _mm512_setzero_ps(); }
  static __mmask16 mask(int n) { return static_cast<__mmask16>((1u << n) - 1); }
  static P load(const float* p) { return _mm512_loadu_ps(p); }
  static P load_tail(const float* p, int n) { return _mm512_maskz_loadu_ps(mask(n), p); }
  static P widen_bf16(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  template <WeightType WT>
  static P load_w(const WeightT<WT>* p) {
    if constexpr (WT == WeightType::kF32) {
      return _mm512_loadu_ps(p);
    } else {
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
      if constexpr (WT == WeightType::kBF16) return widen_bf16(h);
      return _mm512_cvtph_ps(h);
    }
  }
  template <WeightType WT>
  static P load_w_tail(const WeightT<WT>* p, int n) {
    if constexpr (WT == WeightType::kF32) {
      return _mm512_maskz_loadu_ps(mask(n), p);
    } else {
      const __m256i h = _mm256_maskz_loadu_epi16(mask(n), p);
      if constexpr (WT == WeightType::kBF16) return widen_bf16(h);
      return _mm512_cvtph_ps(h);
    }
  }
  // Q8_0: 16 int8 sign-extended to i32, converted (exact), times the block's scale (exact).
  static P load_q8_0(const uint8_t* block, int first) {
    uint16_t d_bits;
    std::memcpy(&d_bits, block, sizeof(d_bits));
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 2 + first));
    const __m512 d = _mm512_cvtph_ps(_mm256_set1_epi16(static_cast<int16_t>(d_bits)));
    return _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)));
  }
  // Q4_0: 16 nibbles (the low ones of qs for first 0, the high ones for 16) zero-extended to i32,
  // less 8, converted and scaled (all exact).
  static P load_q4_0(const uint8_t* block, int first) {
    uint16_t d_bits;
    std::memcpy(&d_bits, block, sizeof(d_bits));
    __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 2));
    if (first >= 16) q = _mm_srli_epi16(q, 4);
    q = _mm_and_si128(q, _mm_set1_epi8(15));
    const __m512i v = _mm512_sub_epi32(_mm512_cvtepu8_epi32(q), _mm512_set1_epi32(8));
    const __m512 d = _mm512_cvtph_ps(_mm256_set1_epi16(static_cast<int16_t>(d_bits)));
    return _mm512_mul_ps(d, _mm512_cvtepi32_ps(v));
  }
  // Q4_K: 16 nibbles zero-extended to i32 and converted, times a (exact), less m (one rounding).
  static P load_q4_k(const uint8_t* qs, bool high, float a, float m) {
    __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
    if (high) q = _mm_srli_epi16(q, 4);
    q = _mm_and_si128(q, _mm_set1_epi8(15));
    const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q));
    return _mm512_sub_ps(_mm512_mul_ps(_mm512_set1_ps(a), f), _mm512_set1_ps(m));
  }
  // Q6_K: 16 low nibbles or'ed with 2 high bits each, less 32, converted and scaled (exact).
  static P load_q6_k(const uint8_t* ql, bool high, const uint8_t* qh, int shift, float s) {
    __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(ql));
    if (high) lo = _mm_srli_epi16(lo, 4);
    lo = _mm_and_si128(lo, _mm_set1_epi8(15));
    __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qh));
    hi = _mm_and_si128(_mm_srl_epi16(hi, _mm_cvtsi32_si128(shift)), _mm_set1_epi8(3));
    const __m128i q = _mm_or_si128(lo, _mm_slli_epi16(hi, 4));
    const __m512i v = _mm512_sub_epi32(_mm512_cvtepu8_epi32(q), _mm512_set1_epi32(32));
    return _mm512_mul_ps(_mm512_set1_ps(s), _mm512_cvtepi32_ps(v));
  }
  static P fmadd(P a, P b, P c) { return _mm512_fmadd_ps(a, b, c); }
  static float reduce(const P* parts) { return matmul_detail::reduce(parts[0]); }
};

}  // namespace

void run_avx512(const Problem& p) { run_on<Avx512>(p); }

float fma_probe_avx512(int64_t iters, float seed) { return fma_probe<Avx512>(iters, seed); }

}  // namespace simpler::llm::matmul_detail
