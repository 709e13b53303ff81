// Internal to the x86 int8-activation targets (matmul_int8_avx2.cc, matmul_int8_avxvnni.cc,
// matmul_int8_avx512vnni.cc): the integer sums of matmul_int8.h on 256-bit vectors, one source
// over a `Dot` type whose `static __m256i dot(__m256i acc, __m256i u, __m256i s)` adds to each
// i32 lane of acc the four products of its bytes, u unsigned by s signed: vpmaddubsw then
// vpmaddwd on AVX2 (the i16 pair sums cannot saturate: every u <= 128 and |s| <= 127 here, since
// the signed side is x's q times a sign, and x's q lies in [-127, 127]), vpdpbusd with VNNI. A
// signed weight w enters as |w| (unsigned) against x's q with w's sign (vpsignb), as in ggml's x86
// code. Include it only from those files, after <immintrin.h>; everything has internal linkage.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "kernels/matmul_impl.h"
#include "kernels/matmul_int8.h"

namespace simpler::llm::matmul_detail {
namespace {

inline __m256i load32(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }

// [Σa, Σb, Σc, Σd] of four vectors of 8 i32.
inline __m128i hsum4(__m256i a, __m256i b, __m256i c, __m256i d) {
  const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(a, b), _mm256_hadd_epi32(c, d));
  return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

// The dot of a signed weight vector with x's q.
template <class Dot>
inline __m256i signed_dot(__m256i w, __m256i x) {
  return Dot::dot(_mm256_setzero_si256(), _mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
}

// Q4_0's 16 bytes as 32 signed weights: low nibbles (weights 0-15), then high ones, less 8.
inline __m256i q4_0_weights(const uint8_t* qs) {
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i m = _mm_set1_epi8(15);
  const __m256i v = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m), _mm_and_si128(q, m));
  return _mm256_sub_epi8(v, _mm256_set1_epi8(8));
}

// Q8_0 and Q4_0: four blocks a step, their sums reduced together.
template <class Dot, bool kQ4>
void dots_blocks(const uint8_t* w, const int8_t* xq, int64_t blocks, int32_t* sums) {
  constexpr int64_t kBytes = kQ4 ? kQ4_0BlockBytes : kQ8_0BlockBytes;
  __m256i v[4];
  for (int64_t b0 = 0; b0 < blocks; b0 += 4) {
    const int n = blocks - b0 < 4 ? static_cast<int>(blocks - b0) : 4;
    for (int i = 0; i < 4; ++i) {
      if (i >= n) {
        v[i] = _mm256_setzero_si256();
        continue;
      }
      const uint8_t* q = w + (b0 + i) * kBytes + 2;
      const __m256i wv = kQ4 ? q4_0_weights(q) : load32(q);
      v[i] = signed_dot<Dot>(wv, load32(xq + (b0 + i) * 32));
    }
    alignas(16) int32_t s[4];
    _mm_store_si128(reinterpret_cast<__m128i*>(s), hsum4(v[0], v[1], v[2], v[3]));
    for (int i = 0; i < n; ++i) sums[b0 + i] = s[i];
  }
}

template <class Dot>
void dots_q8_0(const uint8_t* w, const int8_t* xq, int64_t blocks, int32_t* sums) {
  dots_blocks<Dot, false>(w, xq, blocks, sums);
}
template <class Dot>
void dots_q4_0(const uint8_t* w, const int8_t* xq, int64_t blocks, int32_t* sums) {
  dots_blocks<Dot, true>(w, xq, blocks, sums);
}

// Q4_K: per super-block, 4 runs of 32 bytes, low nibbles sub-block 2c, high ones 2c + 1
// (unsigned weights against x's q directly).
template <class Dot>
void dots_q4_k(const uint8_t* w, const int8_t* xq, int64_t supers, int32_t* sums) {
  const __m256i m = _mm256_set1_epi8(15);
  for (int64_t b = 0; b < supers; ++b) {
    const uint8_t* qs = w + b * kQ4_KBlockBytes + 16;
    const int8_t* x = xq + 256 * b;
    __m256i v[8];
    for (int c = 0; c < 4; ++c) {
      const __m256i q = load32(qs + 32 * c);
      v[2 * c] = Dot::dot(_mm256_setzero_si256(), _mm256_and_si256(q, m), load32(x + 64 * c));
      v[2 * c + 1] = Dot::dot(_mm256_setzero_si256(), _mm256_and_si256(_mm256_srli_epi16(q, 4), m),
                              load32(x + 64 * c + 32));
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(sums + 8 * b), hsum4(v[0], v[1], v[2], v[3]));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(sums + 8 * b + 4), hsum4(v[4], v[5], v[6], v[7]));
  }
}

// Q6_K: per half h of a super-block, 4 runs of 32 weights (c = 0..3: the low nibbles of ql[0, 32),
// of ql[32, 64), the high ones of each, or'ed with bits 2c, 2c + 1 of qh[0, 32)), less 32; each
// run's lanes 0-3 are group 8h + 2c, lanes 4-7 group 8h + 2c + 1.
template <class Dot>
void dots_q6_k(const uint8_t* w, const int8_t* xq, int64_t supers, int32_t* sums) {
  const __m256i m4 = _mm256_set1_epi8(15), m2 = _mm256_set1_epi8(3), k32 = _mm256_set1_epi8(32);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t b = 0; b < supers; ++b) {
    const uint8_t* blk = w + b * kQ6_KBlockBytes;
    for (int h = 0; h < 2; ++h) {
      const __m256i ql0 = load32(blk + 64 * h), ql1 = load32(blk + 64 * h + 32);
      const __m256i qh = load32(blk + 128 + 32 * h);
      const int8_t* x = xq + 256 * b + 128 * h;
      const __m256i lo[4] = {_mm256_and_si256(ql0, m4), _mm256_and_si256(ql1, m4),
                             _mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4),
                             _mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4)};
      __m256i v[4];
      for (int c = 0; c < 4; ++c) {
        const __m256i hi = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * c)), m2);
        const __m256i q = _mm256_sub_epi8(_mm256_or_si256(lo[c], _mm256_slli_epi16(hi, 4)), k32);
        v[c] = signed_dot<Dot>(q, load32(x + 32 * c));
      }
      const __m256i g =
          _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(sums + 16 * b + 8 * h),
                          _mm256_permutevar8x32_epi32(g, order));
    }
  }
}

// matmul_int8.h's Q8_0 / Q4_0 combine with lane l = b mod 8 as ymm lane l: dw·dx, times f32(S),
// added (vcvtph2ps and vcvtdq2ps round as the scalar conversions do); a last partial group of 8
// adds +0 to the lanes past the row (a lane sum is never -0, so that changes nothing); the
// tree as tree8. Built with -ffp-contract=off: no multiply and add fused.
inline float combine_blocks_x86(const uint8_t* w, int64_t block_bytes, int64_t blocks,
                                const int32_t* sums, const float* xd) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; b += 8) {
    const int n = blocks - b < 8 ? static_cast<int>(blocks - b) : 8;
    alignas(16) uint16_t h[8] = {};
    alignas(32) float x[8] = {};
    alignas(32) int32_t s[8] = {};
    for (int i = 0; i < n; ++i) {
      std::memcpy(&h[i], w + (b + i) * block_bytes, sizeof(uint16_t));
      x[i] = xd[b + i];
      s[i] = sums[b + i];
    }
    const __m256 dd = _mm256_mul_ps(_mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<__m128i*>(h))),
                                    _mm256_load_ps(x));
    const __m256 t =
        _mm256_mul_ps(dd, _mm256_cvtepi32_ps(_mm256_load_si256(reinterpret_cast<__m256i*>(s))));
    acc = _mm256_add_ps(acc, t);
  }
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

template <class Dot>
Int8Dots x86_dots() {
  return {&dots_q8_0<Dot>, &dots_q4_0<Dot>, &dots_q4_k<Dot>, &dots_q6_k<Dot>, &combine_blocks_x86};
}

}  // namespace
}  // namespace simpler::llm::matmul_detail
