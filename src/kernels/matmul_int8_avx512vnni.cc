// The AVX-512 VNNI target of the int8-activation matmul (matmul_int8.h, matmul_int8_x86.h):
// vpdpbusd on 256-bit vectors (EVEX, AVX512_VL), and for Q8_0 over several x rows a 512-bit kernel
// (below). Built with -mavx2 -mfma -mf16c -mavx512f -mavx512bw -mavx512vl -mavx512vnni; runs only
// where avx512vnni_available().

#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels/avx512_intrinsics.h"
#include "kernels/matmul_int8.h"
#include "kernels/matmul_int8_x86.h"

namespace simpler::llm::matmul_detail {
namespace {

struct Avx512VnniDot {
  static __m256i dot(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_epi32(acc, u, s); }
  static __m256i madd(__m256i acc, __m256i a, __m256i b) { return _mm256_dpwssd_epi32(acc, a, b); }
};

// v[0..3] of 16 i32 (v[i]: block 2i in lanes 0-7, block 2i + 1 in lanes 8-15) summed per block,
// block b's sum in lane b.
inline __m256i reduce_pairs(const __m512i* v) {
  const __m512i a0 =
      _mm512_add_epi32(_mm512_unpacklo_epi32(v[0], v[1]), _mm512_unpackhi_epi32(v[0], v[1]));
  const __m512i a1 =
      _mm512_add_epi32(_mm512_unpacklo_epi32(v[2], v[3]), _mm512_unpackhi_epi32(v[2], v[3]));
  // Per 128-bit lane L: [v0, v1, v2, v3 summed over L]: L0 and L1 blocks 0, 2, 4, 6; L2 and L3
  // blocks 1, 3, 5, 7.
  const __m512i b = _mm512_add_epi32(_mm512_unpacklo_epi64(a0, a1), _mm512_unpackhi_epi64(a0, a1));
  const __m512i c = _mm512_add_epi32(b, _mm512_shuffle_i32x4(b, b, _MM_SHUFFLE(2, 3, 0, 1)));
  const __m512i order = _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 0, 0, 0, 0, 0, 0, 0, 0);
  return _mm512_castsi512_si256(_mm512_permutexvar_epi32(order, c));
}

// Q8_0 against several x rows: x's q taken unsigned (q + 128, once per call) against the signed
// weights, each W block's 128·Σw subtracted through the accumulator's start (computed once per W
// row): the same exact block sums as |w| against x's q with w's sign, without the two vpsignb per
// block and x row. vpdpbusd never saturates: its four products per lane are at most 4·255·128.
// W's blocks are copied without their scales into a padded row (zeros past the last block, where
// x is 128: sums 0), then 8 blocks a step as 4 zmm, and matmul_int8.h's combine on ymm lanes.
void rows_q8_0_wide(const Problem& p, const QuantizedX& x) {
  const int64_t blocks = p.k / kQ8_0BlockWeights, groups = (blocks + 7) / 8;
  const int64_t padded = 256 * groups;
  std::vector<uint8_t> xu(static_cast<size_t>(p.rows * padded), 0x80);
  for (int64_t r = 0; r < p.rows; ++r) {
    for (int64_t i = 0; i < p.k; i += 32) {
      const __m256i q = load32(x.q.data() + r * p.k + i);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(&xu[r * padded + i]),
                          _mm256_xor_si256(q, _mm256_set1_epi8(static_cast<char>(0x80))));
    }
  }
  std::vector<uint8_t> wp(static_cast<size_t>(padded), 0);
  std::vector<int32_t> start(static_cast<size_t>(8 * blocks + 64), 0);  // per block pair: 16 i32
  std::vector<float> dw(static_cast<size_t>(8 * groups), 0.f);
  const auto* w = static_cast<const uint8_t*>(p.w);
  const __m512i k128 = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t j = 0; j < p.n; ++j) {
    const uint8_t* wr = w + j * blocks * kQ8_0BlockBytes;
    for (int64_t b = 0; b < blocks; ++b) {
      dw[b] = half_at(wr + b * kQ8_0BlockBytes);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(&wp[32 * b]),
                          load32(wr + b * kQ8_0BlockBytes + 2));
    }
    if (j + 1 < p.n) {  // the next W row arrives while this one meets the x rows
      for (int64_t at = 0; at < blocks * kQ8_0BlockBytes; at += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(wr + blocks * kQ8_0BlockBytes + at),
                     _MM_HINT_T0);
      }
    }
    for (int64_t i = 0; i < 4 * groups; ++i) {  // block pairs, the padding's included (0)
      const __m512i wv = _mm512_loadu_si512(&wp[64 * i]);
      const __m512i c = _mm512_dpbusd_epi32(_mm512_setzero_si512(), k128, wv);
      _mm512_storeu_si512(&start[16 * i], _mm512_sub_epi32(_mm512_setzero_si512(), c));
    }
    for (int64_t r = 0; r < p.rows; ++r) {
      const uint8_t* xr = &xu[r * padded];
      const float* xd = x.d.data() + r * x.d_stride;
      __m256 acc = _mm256_setzero_ps();
      for (int64_t g = 0; g < groups; ++g) {
        __m512i v[4];
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i) {
          const int64_t at = 256 * g + 64 * i;
          v[i] = _mm512_dpbusd_epi32(_mm512_loadu_si512(&start[at / 4]),
                                     _mm512_loadu_si512(xr + at), _mm512_loadu_si512(&wp[at]));
        }
        acc = combine_step(acc, _mm256_loadu_ps(&dw[8 * g]), _mm256_loadu_ps(xd + 8 * g),
                           reduce_pairs(v));
      }
      store_y(p, r, j, tree8(acc));
    }
  }
}

void rows_avx512vnni(const Problem& p, const QuantizedX& x) {
  if (p.wt == WeightType::kQ8_0 && p.rows >= 2) return rows_q8_0_wide(p, x);
  rows_x86<Avx512VnniDot>(p, x);
}

}  // namespace

Int8Dots int8_dots_avx512vnni() {
  Int8Dots d = x86_dots<Avx512VnniDot>();
  d.rows = &rows_avx512vnni;
  return d;
}

}  // namespace simpler::llm::matmul_detail
