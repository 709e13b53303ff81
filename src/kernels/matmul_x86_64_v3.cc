// The x86-64-v3 path of matmul_impl.h (AVX2 + FMA + F16C, every x86 server and client CPU since
// Haswell and Zen): matmul_tile.h with each 16-lane chunk as two 8-lane ymm parts (lanes 0-7 and
// 8-15 of the numerics contract), so the fixed tree's first step is the sum of the two parts and
// the results are bitwise those of the other paths. This file alone is built with -mavx2 -mfma
// -mf16c; it includes no header with inline functions other than intrinsics, <cstring> and
// matmul_tile.h (internal linkage), and everything but its entry points has internal linkage, so
// no AVX2 code can be picked by the linker for another file's inline function.
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "kernels/matmul_impl.h"
#include "kernels/matmul_tile.h"

namespace simpler::llm::matmul_detail {
namespace {

struct X86_64V3 : PartsOf<8>, HalfWidthWeights<X86_64V3> {
  using P = __m256;
  static_assert(sizeof(P) == kPartLanes * sizeof(float));
  // 16 ymm registers: a 4 x 3 tile holds 12 accumulators (one part at a time, tile_rows), its 3
  // W parts and an x part, where 3 x 2 with both parts live loads more per FMA (docs/design/
  // kernel_targets.md, "Several rows"). One x row streams 8 W rows at a time (16 accumulators,
  // the rest spilled: memory-bound anyway, and faster than 4 rows: docs/benchmarks-history.md).
  static constexpr int kMaxRows = 4;
  static constexpr int kMaxCols = 3;
  static constexpr int kDecodeCols = 8;

  static P zero() { return _mm256_setzero_ps(); }
  static P load(const float* p) { return _mm256_loadu_ps(p); }
  static P load_tail(const float* p, int n) {
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(n), lanes));
  }
  static __m128i load_h(const uint16_t* p) {
    return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  }
  template <WeightType WT>
  static P widen(__m128i h) {
    if constexpr (WT == WeightType::kBF16) {
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    } else {
      return _mm256_cvtph_ps(h);
    }
  }
  // Q8_0: 8 int8 sign-extended to i32, converted (exact), times the block's scale (exact: 8-bit q
  // times an 11-bit f16 significand fits f32's 24).
  static P load_q8_0(const uint8_t* block, int first) {
    uint16_t d_bits;
    std::memcpy(&d_bits, block, sizeof(d_bits));
    const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + 2 + first));
    return _mm256_mul_ps(_mm256_set1_ps(_cvtsh_ss(d_bits)),
                         _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)));
  }
  // Q4_0: 8 nibbles (the low ones of qs[first..] for first < 16, else the high ones of
  // qs[first - 16..]) zero-extended to i32, less 8, converted and scaled (all exact).
  static P load_q4_0(const uint8_t* block, int first) {
    uint16_t d_bits;
    std::memcpy(&d_bits, block, sizeof(d_bits));
    __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + 2 + first % 16));
    if (first >= 16) q = _mm_srli_epi16(q, 4);
    q = _mm_and_si128(q, _mm_set1_epi8(15));
    const __m256i v = _mm256_sub_epi32(_mm256_cvtepu8_epi32(q), _mm256_set1_epi32(8));
    return _mm256_mul_ps(_mm256_set1_ps(_cvtsh_ss(d_bits)), _mm256_cvtepi32_ps(v));
  }
  // Q4_K: 8 nibbles zero-extended to i32 and converted, times a (exact), less m (one rounding).
  static P load_q4_k(const uint8_t* qs, bool high, float a, float m) {
    __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs));
    if (high) q = _mm_srli_epi16(q, 4);
    q = _mm_and_si128(q, _mm_set1_epi8(15));
    const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q));
    return _mm256_sub_ps(_mm256_mul_ps(_mm256_set1_ps(a), f), _mm256_set1_ps(m));
  }
  // Q6_K: 8 low nibbles or'ed with 2 high bits each (bytes, so the 16-bit shifts never carry a
  // set bit across a byte after the masks), less 32, converted and scaled (exact).
  static P load_q6_k(const uint8_t* ql, bool high, const uint8_t* qh, int shift, float s) {
    __m128i lo = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(ql));
    if (high) lo = _mm_srli_epi16(lo, 4);
    lo = _mm_and_si128(lo, _mm_set1_epi8(15));
    __m128i hi = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qh));
    hi = _mm_and_si128(_mm_srl_epi16(hi, _mm_cvtsi32_si128(shift)), _mm_set1_epi8(3));
    const __m128i q = _mm_or_si128(lo, _mm_slli_epi16(hi, 4));
    const __m256i v = _mm256_sub_epi32(_mm256_cvtepu8_epi32(q), _mm256_set1_epi32(32));
    return _mm256_mul_ps(_mm256_set1_ps(s), _mm256_cvtepi32_ps(v));
  }
  static P fmadd(P a, P b, P c) { return _mm256_fmadd_ps(a, b, c); }
  // s8 = lanes 0-7 + lanes 8-15, s4[i] = s8[i] + s8[i+4], s2[i] = s4[i] + s4[i+2], s2[0] + s2[1].
  static float reduce(const P* parts) {
    const __m256 s8 = _mm256_add_ps(parts[0], parts[1]);
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
  }
};

}  // namespace

void run_x86_64_v3(const Problem& p) { run_on<X86_64V3>(p); }

float fma_probe_x86_64_v3(int64_t iters, float seed) { return fma_probe<X86_64V3>(iters, seed); }

}  // namespace simpler::llm::matmul_detail
