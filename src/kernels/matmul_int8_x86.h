// Internal to the x86 int8-activation targets (matmul_int8_avx2.cc, matmul_int8_avxvnni.cc,
// matmul_int8_avx512vnni.cc): the integer sums of matmul_int8.h on 256-bit vectors, one source
// over a `Dot` type whose `static __m256i dot(__m256i acc, __m256i u, __m256i s)` adds to each
// i32 lane of acc the four products of its bytes, u unsigned by s signed: vpmaddubsw then
// vpmaddwd on AVX2 (the i16 pair sums cannot saturate: every u <= 128 and |s| <= 127 here, since
// the signed side is x's q times a sign, and x's q lies in [-127, 127]), vpdpbusd with VNNI; and
// `static __m256i madd(__m256i acc, __m256i a, __m256i b)` adds to each i32 lane of acc the two
// products of its i16 pairs (vpmaddwd then vpaddd, or vpdpwssd); `kUnsignedFullRange`: whether
// dot takes u over all of 0..255 against any signed s without saturating (vpdpbusd: true;
// vpmaddubsw's i16 pair sums: false). A signed weight w enters as |w| (unsigned) against x's q
// with w's sign (vpsignb), as in ggml's x86 code. The repacked Q4_K / Q6_K tiles (rows_tiles)
// and Q8_0 tiles (rows_q8_0_tiles) are one source over a vector class: Ymm<Dot> here, 512-bit
// vectors in matmul_int8_avx512vnni.cc. Include it only from those files,
// after <immintrin.h>; everything has internal linkage.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kernels/matmul_impl.h"
#include "kernels/matmul_int8.h"
#include "simpler/base/cpu.h"

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

// ---- Whole products (Int8Dots::rows): W row by row, each against every x row while it is in L1;
// per block (Q8_0 / Q4_0) or super-block (Q4_K / Q6_K) the exact integer sum, then
// matmul_int8.h's combine with lane l = b mod 8 as ymm lane l, 8 blocks a step: dw·dx, times
// f32(S), added (vcvtph2ps and vcvtdq2ps round as the scalar conversions do). A last partial
// group of 8 has zero scales and sums past the row: its lanes add (+0·+0)·+0 = +0, and a lane sum
// is never -0, so that changes nothing. Built with -ffp-contract=off: no multiply and add fused.

// The vectors v[0], v[stride], .., v[7·stride] of 8 i32 each summed, v[i·stride]'s sum in lane i.
inline __m256i reduce8(const __m256i* v, int64_t stride = 1) {
  __m256i a[4], b[2];
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {  // per 128-bit half: [v2i: 0+2, v2i+1: 0+2, v2i: 1+3, v2i+1: 1+3]
    const __m256i e = v[2 * i * stride], o = v[(2 * i + 1) * stride];
    a[i] = _mm256_add_epi32(_mm256_unpacklo_epi32(e, o), _mm256_unpackhi_epi32(e, o));
  }
#pragma GCC unroll 2
  for (int i = 0; i < 2; ++i) {  // per half: the 4 sums of that half of v4i .. v4i+3
    b[i] = _mm256_add_epi32(_mm256_unpacklo_epi64(a[2 * i], a[2 * i + 1]),
                            _mm256_unpackhi_epi64(a[2 * i], a[2 * i + 1]));
  }
  return _mm256_add_epi32(_mm256_permute2x128_si256(b[0], b[1], 0x20),
                          _mm256_permute2x128_si256(b[0], b[1], 0x31));
}

// matmul_int8.h's tree of the 8 lanes.
inline float tree8(__m256 acc) {
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

// acc + (a·b)·f32(s) lane by lane: two roundings, then the add's.
inline __m256 combine_step(__m256 acc, __m256 a, __m256 b, __m256i s) {
  return _mm256_add_ps(acc, _mm256_mul_ps(_mm256_mul_ps(a, b), _mm256_cvtepi32_ps(s)));
}

// matmul_int8.h's tree of 8 lanes l[0..7], for the 8 vector lanes (W rows) at once.
inline __m256 tree8_lanes(const __m256* l) {
  __m256 s4[4];
  for (int i = 0; i < 4; ++i) s4[i] = _mm256_add_ps(l[i], l[i + 4]);
  return _mm256_add_ps(_mm256_add_ps(s4[0], s4[2]), _mm256_add_ps(s4[1], s4[3]));
}

// y[0, lanes) = v (or y + v).
inline void store_lanes(float* y, __m256 v, int64_t lanes, bool accumulate) {
  const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(lanes)),
                                          _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  if (accumulate) v = _mm256_add_ps(_mm256_maskload_ps(y, mask), v);
  _mm256_maskstore_ps(y, mask, v);
}

// A buffer of at least n T's of this thread, kept from call to call (Tag, a type named for the
// buffer's use, tells buffers apart: two live buffers never share a Tag): a block that computes
// its rows in several claims (row_claims.h) calls a kernel once per claim, and allocating its
// scratch each time cost a few percent of a 64-row claim. Its contents are whatever the
// thread's last call left: a kernel writes what it reads.
template <class T, class Tag>
T* thread_scratch(size_t n) {
  thread_local std::vector<T> buffer;
  if (buffer.size() < n) buffer.resize(n);
  return buffer.data();
}

// W (`w`, `size` bytes) is read row after row: before the row at byte `at` (`row_bytes` long)
// the bytes one row long that lie `ahead` bytes further on (up to W's end) are prefetched, so
// that many bytes of W are in flight ahead of the kernel (the scalar scale loads at a row's start
// otherwise wait for memory). kPrefetchBytesQ6K: Q6_K's one-row kernel, whose rows stream faster
// than the others' (the kernel alone from memory, 16 KiB against 4 KiB: 0.85x).
constexpr int64_t kPrefetchBytes = 4096, kPrefetchBytesQ6K = 16384;
inline void prefetch_ahead(const uint8_t* w, int64_t at, int64_t row_bytes, int64_t size,
                           int64_t ahead = kPrefetchBytes) {
  const int64_t to = at + ahead + row_bytes < size ? at + ahead + row_bytes : size;
  for (int64_t i = at + ahead; i < to; i += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(w + i), _MM_HINT_T0);
  }
}

inline void store_y(const Problem& p, int64_t r, int64_t j, float s) {
  float* out = p.y + r * p.ldy + j;
  *out = p.accumulate ? *out + s : s;
}

// A binary16 scale at `p` as f32 (exact).
inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof(h));
  return _cvtsh_ss(h);
}

// Blocks [8g, 8g + n) of a Q8_0 / Q4_0 row against x's q: the 8 block sums (zero past n).
template <class Dot, bool kQ4, bool kFull>
inline __m256i block_sums8(const uint8_t* w, const int8_t* xq, int n) {
  constexpr int64_t kBytes = kQ4 ? kQ4_0BlockBytes : kQ8_0BlockBytes;
  __m256i v[8];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {
    if (!kFull && i >= n) {
      v[i] = _mm256_setzero_si256();
      continue;
    }
    const uint8_t* q = w + i * kBytes + 2;
    const __m256i wv = kQ4 ? q4_0_weights(q) : load32(q);
    v[i] = signed_dot<Dot>(wv, load32(xq + 32 * i));
  }
  return reduce8(v);
}

// Q8_0 / Q4_0: dw of a W row once (zeros past the row), then each x row.
template <class Dot, bool kQ4>
void rows_blocks(const Problem& p, const QuantizedX& x) {
  constexpr int64_t kBytes = kQ4 ? kQ4_0BlockBytes : kQ8_0BlockBytes;
  const int64_t blocks = p.k / kQ8_0BlockWeights, full = blocks / 8;
  const int tail = static_cast<int>(blocks % 8);
  float* dw = thread_scratch<float, struct RowsBlocksScales>(static_cast<size_t>(x.d_stride));
  std::fill(dw + blocks, dw + x.d_stride, 0.f);  // the padding lanes' scales
  const auto* w = static_cast<const uint8_t*>(p.w);
  for (int64_t j = 0; j < p.n; ++j) {
    const uint8_t* wr = w + j * blocks * kBytes;
    prefetch_ahead(w, j * blocks * kBytes, blocks * kBytes, prefetch_bytes(p, blocks * kBytes));
    for (int64_t b = 0; b < blocks; ++b) dw[b] = half_at(wr + b * kBytes);
    for (int64_t r = 0; r < p.rows; ++r) {
      const int8_t* xq = x.q.data() + r * p.k;
      const float* xd = x.d.data() + r * x.d_stride;
      __m256 acc = _mm256_setzero_ps();
      for (int64_t g = 0; g < full; ++g) {
        const __m256i s = block_sums8<Dot, kQ4, true>(wr + 8 * g * kBytes, xq + 256 * g, 8);
        acc = combine_step(acc, _mm256_loadu_ps(&dw[8 * g]), _mm256_loadu_ps(xd + 8 * g), s);
      }
      if (tail != 0) {
        const __m256i s =
            block_sums8<Dot, kQ4, false>(wr + 8 * full * kBytes, xq + 256 * full, tail);
        acc = combine_step(acc, _mm256_loadu_ps(&dw[8 * full]), _mm256_loadu_ps(xd + 8 * full), s);
      }
      store_y(p, r, j, tree8(acc));
    }
  }
}

// Q4_K's packed 6-bit scales and mins (get_scale_min_k4) as 16 i16: sc_0..7, then m_0..7. As
// little-endian words A, B, C of bytes 0-3, 4-7, 8-11: sc_0..3 = A & 63 bytewise, m_0..3 = B & 63,
// sc_4..7 = (C & 15) | (A >> 6) << 4 and m_4..7 = (C >> 4 & 15) | (B >> 6) << 4.
// In vectors (a third of the scalar version's instructions): the 16 bytes from s (the 12 scale
// bytes, then 4 of qs, unused) as dwords A, B, C, _;
// [A, C, B, C] shifted right by [0, 0, 0, 4] and masked by [63, 15, 63, 15] bytewise, or'ed with
// [A, A, B, B] >> 6, masked by [0, 3, 0, 3] and shifted left by 4: [sc_0..3, sc_4..7, m_0..3,
// m_4..7], widened.
inline __m256i q4_k_scales_mins(const uint8_t* s) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));
  const __m128i k6 = _mm_set1_epi8(63), k4 = _mm_set1_epi8(15), k2 = _mm_set1_epi8(3);
  const __m128i x =
      _mm_srlv_epi32(_mm_shuffle_epi32(v, _MM_SHUFFLE(2, 1, 2, 0)), _mm_setr_epi32(0, 0, 0, 4));
  const __m128i lo = _mm_and_si128(x, _mm_unpacklo_epi32(k6, k4));
  const __m128i y = _mm_srli_epi32(_mm_shuffle_epi32(v, _MM_SHUFFLE(1, 1, 0, 0)), 6);
  const __m128i hi =
      _mm_slli_epi32(_mm_and_si128(y, _mm_unpacklo_epi32(_mm_setzero_si128(), k2)), 4);
  return _mm256_cvtepu8_epi16(_mm_or_si128(lo, hi));
}

// The 16-byte heads of 2 super-blocks (dwords d | dmin << 16, A, B, C per 128-bit lane) decoded
// per lane into the bytes sc_0..7, m_0..7 (q4_k_scales_mins before its widening).
inline __m256i q4_k_heads2(__m256i h) {
  const __m256i k6 = _mm256_set1_epi8(63), k4 = _mm256_set1_epi8(15), k2 = _mm256_set1_epi8(3);
  const __m256i x = _mm256_srlv_epi32(_mm256_shuffle_epi32(h, _MM_SHUFFLE(3, 2, 3, 1)),
                                      _mm256_setr_epi32(0, 0, 0, 4, 0, 0, 0, 4));  // A C B C
  const __m256i lo = _mm256_and_si256(x, _mm256_unpacklo_epi32(k6, k4));
  const __m256i y = _mm256_srli_epi32(_mm256_shuffle_epi32(h, _MM_SHUFFLE(2, 2, 1, 1)), 6);
  const __m256i hi =
      _mm256_slli_epi32(_mm256_and_si256(y, _mm256_unpacklo_epi32(_mm256_setzero_si256(), k2)), 4);
  return _mm256_or_si256(lo, hi);
}

inline __m256i load2x16(const uint8_t* a, const uint8_t* b) {
  return _mm256_inserti128_si256(
      _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a))),
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)), 1);
}

// The widened scale and mins bytes (q4_k_scales_mins) of the super-block at blk (N = 1) or of it
// and the next (N = 2: both heads decoded at once by q4_k_heads2) in sm[0, N).
template <int N>
__attribute__((always_inline)) inline void q4_k_scales_mins_n(const uint8_t* blk, __m256i* sm) {
  static_assert(N == 1 || N == 2);
  if constexpr (N == 2) {
    const __m256i e = q4_k_heads2(load2x16(blk, blk + kQ4_KBlockBytes));
    sm[0] = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(e));
    sm[1] = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(e, 1));
  } else {
    sm[0] = q4_k_scales_mins(blk + 4);
  }
}

// i16 lane j of the low 128 bits of v in all 16 lanes.
template <int J>
inline __m256i broadcast_i16(__m256i low) {
  return _mm256_shuffle_epi8(low,
                             _mm256_set1_epi16(static_cast<int16_t>((2 * J + 1) << 8 | 2 * J)));
}

// Up to 4 x rows at once against one W row (the super-block kernels below): row i's q at
// q + i·k, its group sums at bsums + i·(k / 16). A super-block's integer sum for row i is left as
// a vector of 8 i32 whose total is the sum, in slot sv[i][b mod 8] (Q4_K's mins sum in
// mv[i][b mod 8]); every 8 super-blocks the 8 slots of a row are reduced at once (reduce8) into
// its sums s[i·stride + b] (and m[i·stride + b]), one horizontal pass per 8 super-blocks.
struct XTile {
  const int8_t* q;
  const int16_t* bsums;
  int64_t k;
  int32_t* s;
  int32_t* m;
  int64_t stride;
};

// rows_super_one's Q4_K (one x row) with a kernel class's S: the super-blocks at blk and
// blk + 144 (N = 2: their x q at xq, xq + 256, their pair sums at pairs, pairs + 16; both heads
// decoded at once) or at blk alone (N = 1). Per super-block i, S's vector by
// `dot(blk_i, sm_i, xq_i)` (K::q4_k_one_s; sm_i: its widened scale and mins bytes) into s[i], and
// M's as Σ m_j·P_j by one vpmaddwd of sm_i against x's pair sums (q4_k_mins_pairs16: zero against
// the scales) into m[i]: the same exact M as the group sums' vpmaddwd against the mins spread to
// pairs, in one instruction where that took five.
template <int N, class Dot>
__attribute__((always_inline)) inline void q4_k_one_n(const uint8_t* blk, const int8_t* xq,
                                                      const int16_t* pairs, __m256i* s, __m256i* m,
                                                      Dot&& dot) {
  __m256i sm[2];
  q4_k_scales_mins_n<N>(blk, sm);
#pragma GCC unroll 2
  for (int i = 0; i < N; ++i) {
    s[i] = dot(blk + i * kQ4_KBlockBytes, sm[i], xq + 256 * i);
    m[i] = _mm256_madd_epi16(sm[i], load32(pairs + 16 * i));
  }
}

// Q4_K's S of a super-block against R x rows (row i's q at xq + i·k), its scales sc_0..7 in both
// 128-bit halves of sc: acc[i] a vector of 8 i32 whose total is row i's S.
template <class Dot, int R>
__attribute__((always_inline)) inline void q4_k_dots(const uint8_t* blk, __m256i sc,
                                                     const int8_t* xq, int64_t k, __m256i* acc) {
  const __m256i m4 = _mm256_set1_epi8(15);
  const uint8_t* qs = blk + 16;
  for (int i = 0; i < R; ++i) acc[i] = _mm256_setzero_si256();
  const auto step = [&](auto c) {
    constexpr int kC = decltype(c)::value;
    const __m256i q = load32(qs + 32 * kC);
    const __m256i lo = _mm256_and_si256(q, m4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
    const __m256i sc_lo = broadcast_i16<2 * kC>(sc), sc_hi = broadcast_i16<2 * kC + 1>(sc);
#pragma GCC unroll 4
    for (int i = 0; i < R; ++i) {  // unrolled: acc stays in registers
      const int8_t* x = xq + i * k + 64 * kC;
      acc[i] = Dot::madd(acc[i], _mm256_maddubs_epi16(lo, load32(x)), sc_lo);
      acc[i] = Dot::madd(acc[i], _mm256_maddubs_epi16(hi, load32(x + 32)), sc_hi);
    }
  };
  step(std::integral_constant<int, 0>{});
  step(std::integral_constant<int, 1>{});
  step(std::integral_constant<int, 2>{});
  step(std::integral_constant<int, 3>{});
}

// Q4_K super-block b against R x rows: S = Σ_j sc_j·Σ q·x (vpmaddubsw's i16 pair sums are at
// most 2·15·127, no saturation) and M = Σ_j m_j·(bsums 2j + 2j + 1) (lane j: m_j against the
// pair of group sums, each at most 16·127). The nibbles and the scales are unpacked once for the
// R rows.
template <class Dot, int R>
inline void q4_k_super(const uint8_t* blk, const XTile& t, int64_t b, __m256i (*sv)[8],
                       __m256i (*mv)[8]) {
  const __m256i sm = q4_k_scales_mins(blk + 4);
  __m256i acc[R];
  q4_k_dots<Dot, R>(blk, _mm256_permute2x128_si256(sm, sm, 0x00), t.q + 256 * b, t.k, acc);
  // m_0..7 as i32 lanes holding (m_j, m_j), against the group sums' pairs.
  const __m256i mins = _mm256_cvtepu16_epi32(_mm256_extracti128_si256(sm, 1));
  const __m256i mins2 = _mm256_or_si256(mins, _mm256_slli_epi32(mins, 16));
  for (int i = 0; i < R; ++i) {
    sv[i][b % 8] = acc[i];
    mv[i][b % 8] =
        Dot::madd(_mm256_setzero_si256(), load32(t.bsums + i * (t.k / 16) + 16 * b), mins2);
  }
}

// Q6_K super-block b against R x rows: S = Σ_g sc_g·Σ q·x - 32·Σ_g sc_g·bsum_g, q the unsigned
// 6-bit value (vpmaddubsw's pair sums at most 2·63·127, no saturation). Run (h, c), 32 weights,
// is groups 8h + 2c (its first 16) and 8h + 2c + 1: their scales in the two 128-bit halves, each
// an i16 spread by one vpshufb of the half's 8 scales (sch[h], in both halves).
template <class Dot, int R>
__attribute__((always_inline)) inline void q6_k_super(const uint8_t* blk, const XTile& t, int64_t b,
                                                      __m256i (*sv)[8], __m256i (*)[8]) {
  const __m256i sc =
      _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192)));
  const __m256i sch[2] = {_mm256_permute2x128_si256(sc, sc, 0x00),
                          _mm256_permute2x128_si256(sc, sc, 0x11)};
  const __m256i m4 = _mm256_set1_epi8(15), m30 = _mm256_set1_epi8(0x30);
  __m256i acc[R];
  for (int i = 0; i < R; ++i) {
    const __m256i bs = load32(t.bsums + i * (t.k / 16) + 16 * b);
    acc[i] =
        _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(_mm256_madd_epi16(bs, sc), 5));
  }
  const auto half = [&](auto h) {
    constexpr int kH = decltype(h)::value;
    const __m256i ql0 = load32(blk + 64 * kH), ql1 = load32(blk + 64 * kH + 32);
    const __m256i qh = load32(blk + 128 + 32 * kH);
    const __m256i low[4] = {_mm256_and_si256(ql0, m4), _mm256_and_si256(ql1, m4),
                            _mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4),
                            _mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4)};
    // bits 2c, 2c + 1 of qh as bits 4-5 of each byte: shifted in 16-bit lanes, masked bytewise
    // (a bit shifted across a byte never lands on 0x30)
    const __m256i top[4] = {_mm256_and_si256(_mm256_slli_epi16(qh, 4), m30),
                            _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30),
                            _mm256_and_si256(qh, m30),
                            _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30)};
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      // i16 2c of sch[h] in the low half, 2c + 1 in the high half: groups 8h + 2c and + 1
      const __m256i scales = _mm256_shuffle_epi8(
          sch[kH],
          _mm256_set_m128i(_mm_set1_epi16(static_cast<int16_t>((4 * c + 3) << 8 | (4 * c + 2))),
                           _mm_set1_epi16(static_cast<int16_t>((4 * c + 1) << 8 | 4 * c))));
      const __m256i q = _mm256_or_si256(low[c], top[c]);
#pragma GCC unroll 4
      for (int i = 0; i < R; ++i) {  // unrolled: acc stays in registers
        const int8_t* xq = t.q + i * t.k + 256 * b + 128 * kH + 32 * c;
        acc[i] = Dot::madd(acc[i], _mm256_maddubs_epi16(q, load32(xq)), scales);
      }
    }
  };
  half(std::integral_constant<int, 0>{});
  half(std::integral_constant<int, 1>{});
  for (int i = 0; i < R; ++i) sv[i][b % 8] = acc[i];
}

// The 256-bit super-block kernels above as a kernel class of rows_super and rows_super_one:
// static members q4_k<R> and q6_k<R> with q4_k_super's signature, and q4_k_one_s (one x row's S
// of a super-block, for q4_k_one_n), over x's q as it is (a 512-bit class may take it permuted:
// `xq`).
template <class Dot>
struct SuperKernels256 {
  template <int R>
  static void q4_k(const uint8_t* blk, const XTile& t, int64_t b, __m256i (*sv)[8],
                   __m256i (*mv)[8]) {
    q4_k_super<Dot, R>(blk, t, b, sv, mv);
  }
  // rows_super_one's Q4_K S (q4_k_one_n), by q4_k_dots.
  __attribute__((always_inline)) static __m256i q4_k_one_s(const uint8_t* blk, __m256i sm,
                                                           const int8_t* xq) {
    __m256i acc;
    q4_k_dots<Dot, 1>(blk, _mm256_permute2x128_si256(sm, sm, 0x00), xq, 0, &acc);
    return acc;
  }
  template <int R>
  __attribute__((always_inline)) static void q6_k(const uint8_t* blk, const XTile& t, int64_t b,
                                                  __m256i (*sv)[8], __m256i (*mv)[8]) {
    q6_k_super<Dot, R>(blk, t, b, sv, mv);
  }
};

// One W row's super-blocks against R x rows (each row's sums into t), 8 super-blocks a group:
// the slots of a last partial group past the row are zero.
template <class K, WeightType WT, int R>
void super_tile(const uint8_t* wr, int64_t supers, const XTile& t) {
  constexpr bool kQ4 = WT == WeightType::kQ4_K;
  constexpr int64_t kBytes = kQ4 ? kQ4_KBlockBytes : kQ6_KBlockBytes;
  __m256i sv[R][8], mv[R][8];
  for (int64_t g0 = 0; g0 < supers; g0 += 8) {
    const int64_t end = supers - g0 < 8 ? supers : g0 + 8;
    for (int64_t b = g0; b < end; ++b) {
      if constexpr (kQ4) {
        K::template q4_k<R>(wr + b * kBytes, t, b, sv, mv);
      } else {
        K::template q6_k<R>(wr + b * kBytes, t, b, sv, mv);
      }
    }
    for (int i = 0; i < R; ++i) {
      for (int64_t b = end; b < g0 + 8; ++b) sv[i][b % 8] = mv[i][b % 8] = _mm256_setzero_si256();
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(t.s + i * t.stride + g0), reduce8(sv[i]));
      if constexpr (kQ4) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(t.m + i * t.stride + g0), reduce8(mv[i]));
      }
    }
  }
}

// Row i's combine (matmul_int8.h) of its sums s[i·stride..], m[i·stride..] with the W row's
// scales d, dmin (zeros past the row) and x's dx.
template <bool kQ4>
inline float combine_super(const float* dx, const float* d, const float* dmin, const int32_t* s,
                           const int32_t* m, int64_t stride) {
  __m256 acc = _mm256_setzero_ps(), accm = _mm256_setzero_ps();
  for (int64_t g = 0; g < stride; g += 8) {
    const __m256 x = _mm256_loadu_ps(dx + g);
    acc = combine_step(acc, x, _mm256_loadu_ps(d + g), load32(s + g));
    if (kQ4) accm = combine_step(accm, x, _mm256_loadu_ps(dmin + g), load32(m + g));
  }
  return kQ4 ? tree8(acc) - tree8(accm) : tree8(acc);
}

// Q4_K / Q6_K with kernel class K: the W row's f32 scales once (zeros up to the padded count),
// x rows 4 at a time (their q from xq, x.q or its permutation for K), then each row's combine.
template <class K, WeightType WT>
void rows_super(const Problem& p, const QuantizedX& x, const int8_t* xq) {
  constexpr bool kQ4 = WT == WeightType::kQ4_K;
  constexpr int64_t kBytes = kQ4 ? kQ4_KBlockBytes : kQ6_KBlockBytes;
  const int64_t supers = p.k / kSuperBlockWeights, stride = x.d_stride;
  std::vector<float> d(stride, 0.f), dmin(stride, 0.f);
  std::vector<int32_t> s(static_cast<size_t>(4 * stride), 0), m(s);
  const auto* w = static_cast<const uint8_t*>(p.w);
  for (int64_t j = 0; j < p.n; ++j) {
    const uint8_t* wr = w + j * supers * kBytes;
    prefetch_ahead(w, j * supers * kBytes, supers * kBytes, prefetch_bytes(p, supers * kBytes));
    for (int64_t b = 0; b < supers; ++b) {
      d[b] = half_at(wr + b * kBytes + (kQ4 ? 0 : 208));
      if (kQ4) dmin[b] = half_at(wr + b * kBytes + 2);
    }
    for (int64_t r0 = 0; r0 < p.rows; r0 += 4) {
      const XTile t{xq + r0 * p.k, x.bsums.data() + r0 * (p.k / 16), p.k, s.data(), m.data(),
                    stride};
      const int64_t n = p.rows - r0 < 4 ? p.rows - r0 : 4;
      if (n == 4) super_tile<K, WT, 4>(wr, supers, t);
      if (n == 3) super_tile<K, WT, 3>(wr, supers, t);
      if (n == 2) super_tile<K, WT, 2>(wr, supers, t);
      if (n == 1) super_tile<K, WT, 1>(wr, supers, t);
      for (int64_t i = 0; i < n; ++i) {
        const float y = combine_super<kQ4>(x.d.data() + (r0 + i) * stride, d.data(), dmin.data(),
                                           &s[i * stride], &m[i * stride], stride);
        store_y(p, r0 + i, j, y);
      }
    }
  }
}

// ---- Q4_K / Q6_K against one x row (a decode step of batch 1) on every x86 target: W rows 8 at
// a time, vector lane r W row r in the sums and in the combine. Each W row is read front to back,
// its super-blocks through K's kernel (Q4_K: q4_k_one_n with K::q4_k_one_s, two super-blocks a
// call; Q6_K: q6_k<1>), super-block b's vector (8 i32 whose total is S_b) into the row's slot b;
// then the 8 rows' slots of each super-block are reduced together (reduce8 across the rows), so
// lane r holds row r's S_b (and M_b), and the combine runs on the 8 rows at once: lane l = b mod 8
// of every row in acc[l], t_b = (dx_b·d_b)·f32(S_b) added in increasing b, the shared tree
// (combine_tile's order, matmul_int8.h's roundings). The rows' binary16 d (and dmin) are kept as
// they are and converted 8 rows at once there. So a W row costs its super-blocks' kernel alone: no
// reduce8 of a half-filled group of 8 (K 1024 is 4 super-blocks), no combine, tree and scalar store
// of its own, which made K 1024 cost twice K 3072 per byte. A loop over the super-blocks across 8
// rows at once (8 streams through W) was faster from L2 but slower from memory: its zmm version on
// Zen 5, its ymm one at half the pace on Intel (docs/design/quantized_matmul.md); a decode reads W
// from memory. 8 binary16 values at h as f32 (exact).
inline __m256 halves8(const uint16_t* h) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h)));
}

struct Slots8 {
  __m256i v[8];
};

// x's Q8_K group-sum pairs P_j = bsum_2j + bsum_2j+1 of every super-block for a Q4_K mins sum by
// one vpmaddwd against q4_k_scales_mins' widened bytes (q4_k_one_n): per super-block 16 i16, zero
// in lanes 0-7 (the scales') and P_0..7 in lanes 8-15 (the mins'), each at most 32·127.
inline const int16_t* q4_k_mins_pairs16(const QuantizedX& x, int64_t supers) {
  int16_t* out = thread_scratch<int16_t, struct Q4KMinsPairs16>(static_cast<size_t>(16 * supers));
  for (int64_t b = 0; b < supers; ++b) {
    for (int j = 0; j < 8; ++j) {
      out[16 * b + j] = 0;
      out[16 * b + 8 + j] =
          static_cast<int16_t>(x.bsums[16 * b + 2 * j] + x.bsums[16 * b + 2 * j + 1]);
    }
  }
  return out;
}

template <class K, WeightType WT>
void rows_super_one(const Problem& p, const QuantizedX& x, const int8_t* xq) {
  constexpr bool kQ4 = WT == WeightType::kQ4_K;
  constexpr int64_t kBytes = kQ4 ? kQ4_KBlockBytes : kQ6_KBlockBytes;
  const int64_t supers = p.k / kSuperBlockWeights, row_bytes = supers * kBytes;
  const int64_t groups = (supers + 7) / 8, size = prefetch_bytes(p, row_bytes);
  const XTile t{xq, x.bsums.data(), p.k, nullptr, nullptr, 0};
  const int16_t* pairs = kQ4 ? q4_k_mins_pairs16(x, supers) : nullptr;
  // the slots: row r's super-block b in group r·groups + b / 8, slot b mod 8 (so row r's are the
  // vectors [r·8·groups, +supers)); the scales [super-block][row] as the binary16 of the W rows,
  // converted 8 rows at once in the combine
  Slots8* sg = thread_scratch<Slots8, struct SuperOneSlots>(static_cast<size_t>(16 * groups));
  Slots8* mg = sg + 8 * groups;
  const __m256i* sv = sg->v;
  const __m256i* mv = mg->v;
  uint16_t* d = thread_scratch<uint16_t, struct SuperOneScales>(static_cast<size_t>(16 * supers));
  uint16_t* dmin = d + 8 * supers;
  const auto* w = static_cast<const uint8_t*>(p.w);
  for (int64_t j0 = 0; j0 < p.n; j0 += 8) {
    const int64_t lanes = p.n - j0 < 8 ? p.n - j0 : 8;
    for (int64_t r = 0; r < 8; ++r) {
      Slots8* sr = &sg[r * groups];
      Slots8* mr = &mg[r * groups];
      if (r >= lanes) {  // a short last group: its rows past n are zero
        for (int64_t b = 0; b < supers; ++b) {
          sr[b / 8].v[b % 8] = mr[b / 8].v[b % 8] = _mm256_setzero_si256();
          d[8 * b + r] = dmin[8 * b + r] = 0;
        }
        continue;
      }
      const int64_t at = (j0 + r) * row_bytes;
      prefetch_ahead(w, at, row_bytes, size, kQ4 ? kPrefetchBytes : kPrefetchBytesQ6K);
      for (int64_t b = 0; b < supers; ++b) {
        const uint8_t* blk = w + at + b * kBytes;
        std::memcpy(&d[8 * b + r], blk + (kQ4 ? 0 : 208), sizeof(uint16_t));
        if constexpr (kQ4) std::memcpy(&dmin[8 * b + r], blk + 2, sizeof(uint16_t));
      }
      if constexpr (kQ4) {  // super-blocks b and b + 1 (in one group: b is even) at once
        for (int64_t b = 0; b < supers; b += 2) {
          const uint8_t* blk = w + at + b * kBytes;
          __m256i* s = &sr[b / 8].v[b % 8];
          __m256i* m = &mr[b / 8].v[b % 8];
          if (b + 1 < supers) {
            q4_k_one_n<2>(blk, xq + 256 * b, pairs + 16 * b, s, m, K::q4_k_one_s);
          } else {  // an odd count's last
            q4_k_one_n<1>(blk, xq + 256 * b, pairs + 16 * b, s, m, K::q4_k_one_s);
          }
        }
      } else {
        for (int64_t b = 0; b < supers; ++b) {  // writes slot b mod 8 of its group
          K::template q6_k<1>(w + at + b * kBytes, t, b, &sr[b / 8].v, &mr[b / 8].v);
        }
      }
    }
    __m256 acc[8], accm[8];
#pragma GCC unroll 8
    for (int l = 0; l < 8; ++l) acc[l] = accm[l] = _mm256_setzero_ps();
    for (int64_t b = 0; b < supers; ++b) {
      const __m256 dx = _mm256_set1_ps(x.d[b]);
      acc[b % 8] = combine_step(acc[b % 8], dx, halves8(&d[8 * b]), reduce8(sv + b, 8 * groups));
      if (kQ4) {
        accm[b % 8] =
            combine_step(accm[b % 8], dx, halves8(&dmin[8 * b]), reduce8(mv + b, 8 * groups));
      }
    }
    __m256 out = tree8_lanes(acc);
    if (kQ4) out = _mm256_sub_ps(out, tree8_lanes(accm));
    store_lanes(p.y + j0, out, lanes, p.accumulate);
  }
}

// ---- Q4_K and Q6_K over several x rows (rows_tiles): W taken V::kLanes rows at a time (8 on
// ymm, 16 on zmm), repacked once per call into a buffer that stays in L2 so that vector lane r is
// W row r. A sub-block's 32 weights (Q4_K) or a group's 16 (Q6_K) then meet x by 8 or 4 V::dot
// (the unsigned 4 or 6-bit values of dword t of each W row against x's dword t, broadcast), whose
// lanes hold that sub-block's or group's whole integer sum for each row, and its scale is applied
// once by one vpmulld: with vpdpbusd one instruction per 4 products a lane, where the per-row
// super-block kernels take two (vpmaddubsw, then a multiply-add with per-pair scales). The integer
// sums are the same exact values (a lane's sub-block sum is at most 32·15·127 and Σ_j sc_j·S_j at
// most 8·63·60960; a group's at most 16·63·127 and Σ_g sc_g·S_g at most 16·128·128016), and the
// combine runs on the W rows' lanes in the shared order (matmul_int8.h), so the results are
// bitwise the shared path's. V: the vector class (Ymm<Dot> below, or the AVX-512 target's Zmm):
// integer vector I, float vector F, kLanes, the operations the code below names, and kMinRowsQ4K,
// kMinRowsQ6K, kMinRowsQ8_0: from how many x rows on each type takes the tiles (rows_q8_0_tiles
// for Q8_0; the repack costs one or a few x rows' dots; below those counts the per-row kernels
// measured as fast or faster: matmul_benchmark at 2, 4, 8 and 16 rows,
// docs/design/quantized_matmul.md). Over interleaved rows Q4_K and Q6_K take the tiles from 4 x
// rows (rows_interleaved), Q8_0 on zmm never (rows_q8_0_interleaved at every count), on ymm from
// kMinRowsQ8_0.

// 256-bit vectors over a Dot of this header.
template <class Dot>
struct Ymm {
  using I = __m256i;
  using F = __m256;
  static constexpr int kLanes = 8;
  static constexpr int64_t kMinRowsQ4K = 4, kMinRowsQ6K = 8, kMinRowsQ8_0 = 4;
  // Whether the Q8_0 tiles hold W signed (|w| against x with w's sign: Dot cannot take the
  // unsigned w + 128 over all of 0..255) rather than w + 128 (rows_q8_0_tiles).
  static constexpr bool kQ8_0Signed = !Dot::kUnsignedFullRange;
  // Whether dot takes unsigned bytes over all of 0..255 (else they must stay below 128).
  static constexpr bool kUnsignedFullRange = Dot::kUnsignedFullRange;
  // Whether the interleaved kernels apply a run's scale by vpmaddwd against its i16 pairs — once
  // on several dots' i16 pair sums (pairs, add16: the tiles, Tile::kDotsPerI16Sum dots a sum, and
  // the fused Q4_K kernel's 8), or in each dot (dot_scaled: the fused Q6_K kernel) — rather than
  // by vpmulld on the run's i32 sum (VNNI's dot is one instruction).
  static constexpr bool kScaledDot = !Dot::kUnsignedFullRange;
  // acc + Σ over each i32 lane's two i16 pair sums of u·s (unsigned by signed bytes, pair sums
  // that do not saturate) times the lane's scale pair sc16.
  static I dot_scaled(I acc, I u, I s, I sc16) {
    return Dot::madd(acc, _mm256_maddubs_epi16(u, s), sc16);
  }
  // The i16 pair sums of u·s (unsigned by signed bytes; they must not saturate), and i16 sums of
  // them (they must not overflow): kScaledDot's runs add several dots' pairs before one vpmaddwd
  // against the scale, the same exact integers.
  static I pairs(I u, I s) { return _mm256_maddubs_epi16(u, s); }
  static I add16(I a, I b) { return _mm256_add_epi16(a, b); }
  static I zero() { return _mm256_setzero_si256(); }
  static I load(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
  static void store(void* p, I v) { _mm256_storeu_si256(static_cast<__m256i*>(p), v); }
  static I set1(int32_t v) { return _mm256_set1_epi32(v); }
  static I and_(I a, I b) { return _mm256_and_si256(a, b); }
  static I or_(I a, I b) { return _mm256_or_si256(a, b); }
  static I xor_(I a, I b) { return _mm256_xor_si256(a, b); }
  // (a & 0x0f) | b in every byte.
  static I low_nibbles_or(I a, I b) { return or_(and_(a, set1(0x0f0f0f0f)), b); }
  static I srli(I a, int n) { return _mm256_srli_epi32(a, n); }
  static I slli(I a, int n) { return _mm256_slli_epi32(a, n); }
  static I srai(I a, int n) { return _mm256_srai_epi32(a, n); }
  static I srai16(I a, int n) { return _mm256_srai_epi16(a, n); }
  // Each i32 lane's bytes rearranged within the lane (vpshufb): byte i of the result is byte
  // (pattern >> 8i) & 3 of the lane, or 0 where that pattern byte is kZeroByte (dword_bytes).
  static I bytes_in_dwords(I v, uint32_t pattern) {
    const I lane_at = _mm256_setr_epi8(0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12, 0, 0, 0,
                                       0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12);
    return _mm256_shuffle_epi8(
        v, _mm256_add_epi8(_mm256_set1_epi32(static_cast<int32_t>(pattern)), lane_at));
  }
  static I add(I a, I b) { return _mm256_add_epi32(a, b); }
  static I sub(I a, I b) { return _mm256_sub_epi32(a, b); }
  static I mullo(I a, I b) { return _mm256_mullo_epi32(a, b); }
  static I dot(I acc, I u, I s) { return Dot::dot(acc, u, s); }
  static I madd(I acc, I a, I b) { return Dot::madd(acc, a, b); }
  static I gather(I rows, const uint8_t* at) {
    return _mm256_i32gather_epi32(reinterpret_cast<const int*>(at), rows, 1);
  }
  // kLanes binary16 at p as f32.
  static F halves(const void* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(static_cast<const __m128i*>(p)));
  }
  // The binary16 in each lane's low 16 bits as f32.
  static F half_lo(I v) {
    const I m = and_(v, set1(0xffff));
    return _mm256_cvtph_ps(
        _mm_packus_epi32(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1)));
  }
  static F fzero() { return _mm256_setzero_ps(); }
  static F fset1(float v) { return _mm256_set1_ps(v); }
  static F fadd(F a, F b) { return _mm256_add_ps(a, b); }
  static F fsub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F fmul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F cvt(I v) { return _mm256_cvtepi32_ps(v); }
  // y[0, lanes) = v (or y + v).
  static void store_rows(float* y, F v, int64_t lanes, bool accumulate) {
    const I mask = _mm256_cmpgt_epi32(set1(static_cast<int32_t>(lanes)),
                                      _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    if (accumulate) v = _mm256_add_ps(_mm256_maskload_ps(y, mask), v);
    _mm256_maskstore_ps(y, mask, v);
  }
};

template <class V>
inline typename V::I broadcast_i32(const void* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return V::set1(v);
}

// A pattern of V::bytes_in_dwords: result byte i of every i32 lane is byte b_i (0..3) of the
// lane, or zero where b_i is kZeroByte. One vpshufb where the shifts, masks and ors that pick a
// byte and pair it took two to seven instructions each (the heads of the kernels under 4 x rows
// decode 12 to 24 of them a super-block).
constexpr uint32_t kZeroByte = 0x80;
constexpr uint32_t dword_bytes(uint32_t b0, uint32_t b1, uint32_t b2, uint32_t b3) {
  return b0 | b1 << 8 | b2 << 16 | b3 << 24;
}

// Unsigned byte j of every i32 lane as an i32 (0..255).
template <class V>
inline typename V::I byte_of(typename V::I v, uint32_t j) {
  return V::bytes_in_dwords(v, dword_bytes(j, kZeroByte, kZeroByte, kZeroByte));
}

// Unsigned bytes j and k of every i32 lane as an i16 pair (byte j | byte k << 16).
template <class V>
inline typename V::I byte_pair(typename V::I v, uint32_t j, uint32_t k) {
  return V::bytes_in_dwords(v, dword_bytes(j, kZeroByte, k, kZeroByte));
}

// Signed (int8) bytes j and k of every i32 lane as an i16 pair, each sign-extended.
template <class V>
inline typename V::I signed_byte_pair(typename V::I v, uint32_t j, uint32_t k) {
  return V::srai16(V::bytes_in_dwords(v, dword_bytes(kZeroByte, j, kZeroByte, k)), 8);
}

// Lane r: the offset of W row min(r, rows - 1) (`row_bytes` apart): a short tile's last lanes
// repeat its last row, whose results are not stored.
template <class V>
inline typename V::I tile_rows(int64_t row_bytes, int64_t rows) {
  alignas(64) int32_t at[V::kLanes];
  for (int r = 0; r < V::kLanes; ++r) {
    at[r] = static_cast<int32_t>((r < rows ? r : rows - 1) * row_bytes);
  }
  return V::load(at);
}

// Where a tile's repack reads W's super-blocks, lane r W row r: dword(at) is bytes [at, at + 4) of
// each row's super-block, q6_k_d() Q6_K's d (its bytes 208-209) as f32. GatherRows: the rows
// row_bytes apart (the plain layout; `rows` their offsets, tile_rows), by gathers; InterleavedRows:
// 16 rows interleaved (task::DataType::kQ4_K_R16, kQ6_K_R16; Q8_0's: repack_q8_0_interleaved), by
// loads of the chunks.
template <class V>
struct GatherRows {
  const uint8_t* blk;  // the first row's super-block
  typename V::I rows;
  typename V::I dword(int at) const { return V::gather(rows, blk + at); }
  typename V::F q6_k_d() const { return V::half_lo(V::srli(V::gather(rows, blk + 206), 16)); }
};

// A group of interleaved rows is one zmm's lanes, its chunks 64 bytes (the kernels' offsets).
constexpr int64_t kGroupRows = task::kInterleavedRows;
static_assert(kGroupRows == 16, "the interleaved kernels take a group's chunk as 16 dwords");

template <class V>
struct InterleavedRows {
  const uint8_t* chunks;  // the super-block column's first chunk, at the tile's first lane
  const uint8_t* tail;    // its last bytes (Q6_K's d) of the tile's first lane
  typename V::I dword(int at) const { return V::load(chunks + 16 * at); }
  typename V::F q6_k_d() const { return V::halves(tail); }
};

// A Q4_K super-block's head (Src: GatherRows or InterleavedRows), lane r W row r: sc[j] sub-block
// j's scale as the dots take it (run_dot: an i32, or where V::kScaledDot the i16 pair (sc, sc)
// that vpmaddwd meets), mins[q] the mins (m_2q, m_2q+1) as i16 pairs, d and dmin as f32; the
// packed 6-bit fields decoded as q4_k_scales_mins does, lane by lane.
template <class V, class Src>
inline void q4_k_head(const Src& src, typename V::I* sc, typename V::I* mins, typename V::F& d,
                      typename V::F& dmin) {
  using I = typename V::I;
  const I dd = src.dword(0);  // d | dmin << 16
  d = V::half_lo(dd);
  dmin = V::half_lo(V::srli(dd, 16));
  const I a = src.dword(4), b = src.dword(8), c = src.dword(12);
  const I k6 = V::set1(0x3f3f3f3f), k4 = V::set1(0x0f0f0f0f), k2 = V::set1(0x03030303);
  const I sc03 = V::and_(a, k6), m03 = V::and_(b, k6);
  const I sc47 = V::or_(V::and_(c, k4), V::slli(V::and_(V::srli(a, 6), k2), 4));
  const I m47 = V::or_(V::and_(V::srli(c, 4), k4), V::slli(V::and_(V::srli(b, 6), k2), 4));
  for (uint32_t j = 0; j < 4; ++j) {
    sc[j] = V::kScaledDot ? byte_pair<V>(sc03, j, j) : byte_of<V>(sc03, j);
    sc[j + 4] = V::kScaledDot ? byte_pair<V>(sc47, j, j) : byte_of<V>(sc47, j);
  }
  for (uint32_t q = 0; q < 2; ++q) {
    mins[q] = byte_pair<V>(m03, 2 * q, 2 * q + 1);
    mins[q + 2] = byte_pair<V>(m47, 2 * q, 2 * q + 1);
  }
}

// M of one x row: Σ_j m_j·(its group sums 2j, 2j + 1), from q4_k_head's mins and x's aux.
template <class V>
inline typename V::I q4_k_mins_sum(const typename V::I* mins, const int32_t* aux) {
  typename V::I m = V::madd(V::zero(), mins[0], broadcast_i32<V>(aux));
#pragma GCC unroll 3
  for (int q = 1; q < 4; ++q) m = V::madd(m, mins[q], broadcast_i32<V>(aux + q));
  return m;
}

// Q6_K group 4q + i's int8 scale as the dots take it (run_dot: an i32, sign-extended, or where
// V::kScaledDot the i16 pair (sc, sc)), from s4 = dword q of the scales.
template <class V>
inline typename V::I q6_k_scale(typename V::I s4, uint32_t i) {
  if constexpr (V::kScaledDot) return signed_byte_pair<V>(s4, i, i);
  return V::srai(V::slli(s4, static_cast<int>(24 - 8 * i)), 24);
}

// A Q6_K super-block's scales as i16 pairs, lane r W row r: pairs[p] = (sc_2p, sc_2p+1).
template <class V, class Src>
inline void q6_k_pairs(const Src& src, typename V::I* pairs) {
  for (int q = 0; q < 4; ++q) {
    const typename V::I s4 = src.dword(192 + 4 * q);
    pairs[2 * q] = signed_byte_pair<V>(s4, 0, 1);
    pairs[2 * q + 1] = signed_byte_pair<V>(s4, 2, 3);
  }
}

// A Q6_K super-block's head, lane r W row r: sc[g] group g's scale as q6_k_scale gives it, pairs
// as q6_k_pairs, d as f32.
template <class V, class Src>
inline void q6_k_head(const Src& src, typename V::I* sc, typename V::I* pairs, typename V::F& d) {
  for (int q = 0; q < 4; ++q) {
    const typename V::I s4 = src.dword(192 + 4 * q);
    for (uint32_t i = 0; i < 4; ++i) sc[4 * q + i] = q6_k_scale<V>(s4, i);
  }
  q6_k_pairs<V>(src, pairs);
  d = src.q6_k_d();
}

// The 6-bit values of Q6_K weights 128h + 32c + 4t .. + 3 for c = 0..3 (w[c]), lane r W row r,
// from ql0 = dword 16h + t of ql, ql1 = dword 16h + 8 + t and qh = dword 8h + t of qh: the low
// (c < 2) or high nibble of ql_(c & 1) with bits 2c, 2c + 1 of qh at bits 4-5.
template <class V>
inline void q6_k_values(typename V::I ql0, typename V::I ql1, typename V::I qh, typename V::I* w) {
  const typename V::I k30 = V::set1(0x30303030);
  w[0] = V::low_nibbles_or(ql0, V::and_(V::slli(qh, 4), k30));
  w[1] = V::low_nibbles_or(ql1, V::and_(V::slli(qh, 2), k30));
  w[2] = V::low_nibbles_or(V::srli(ql0, 4), V::and_(qh, k30));
  w[3] = V::low_nibbles_or(V::srli(ql1, 4), V::and_(V::srli(qh, 2), k30));
}

// Q6_K's - 32 of every q for one x row: 32·Σ_g sc_g·(x's group sum g), to subtract.
template <class V>
inline typename V::I q6_k_offset(const typename V::I* pairs, const int32_t* aux) {
  typename V::I m = V::madd(V::zero(), pairs[0], broadcast_i32<V>(aux));
#pragma GCC unroll 7
  for (int q = 1; q < 8; ++q) m = V::madd(m, pairs[q], broadcast_i32<V>(aux + q));
  return V::slli(m, 5);
}

// What every super-block of a repacked tile holds (Q4KTile, Q6KTile), vector lane r W row r: w[v]
// the weights 4v..4v+3 as unsigned bytes, sc[run] each run's scale (a Q4_K sub-block's, a Q6_K
// group's) as i32 (where V::kScaledDot, as the i16 pair (scale, scale) that vpmaddwd meets: the
// heads decode them so, once at the repack rather than in every tile_dots call over the tile), d
// (and Q4_K's dmin) as f32; kAux i32 of x per row and super-block (tile_aux), kMins whether the
// tile has mins (M) to subtract.
template <class V, int64_t Bytes, int Runs, int Aux, bool Mins>
struct TileBlock {
  using I = typename V::I;
  static constexpr bool kMins = Mins;
  static constexpr int64_t kBytes = Bytes;
  static constexpr int kRuns = Runs, kAux = Aux;
  I w[64];
  I sc[Runs];
  typename V::F d, dmin;
};

// One Q4_K super-block of a tile, lane r W row r: w[8j + t] the weights 4t..4t+3 of sub-block j
// as unsigned bytes, sc[j] the sub-block scales as i32 (paired where V::kScaledDot: TileBlock),
// mins[q] the mins (m_2q, m_2q+1) as i16 pairs, d and dmin as f32. aux: per x row and
// super-block 4 i32, x's group sums as the pairs the mins meet (tile_aux).
template <class V>
struct Q4KTile : TileBlock<V, kQ4_KBlockBytes, 8, 4, true> {
  using I = typename V::I;
  using Base = TileBlock<V, kQ4_KBlockBytes, 8, 4, true>;
  using Base::w, Base::sc, Base::d, Base::dmin;
  // Weights 0..15: a run's 8 dots' vpmaddubsw pair sums add up in i16 (at most 8·2·15·127;
  // tile_dots, kScaledDot).
  static constexpr int kDotsPerI16Sum = 8;
  I mins[4];

  template <class Src>
  void repack_scales(const Src& src) {
    q4_k_head<V>(src, sc, mins, d, dmin);
  }

  template <class Src>
  void repack(const Src& src) {
    const I k4 = V::set1(0x0f0f0f0f);
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {  // qs[32c, +32): sub-block 2c low nibbles, 2c + 1 high
#pragma GCC unroll 8
      for (int t = 0; t < 8; ++t) {
        const I g = src.dword(16 + 32 * c + 4 * t);
        w[16 * c + t] = V::and_(g, k4);
        w[16 * c + 8 + t] = V::and_(V::srli(g, 4), k4);
      }
    }
    repack_scales(src);
  }

  // M of one x row: Σ_j m_j·(its group sums 2j, 2j + 1).
  I mins_sum(const int32_t* aux) const { return q4_k_mins_sum<V>(mins, aux); }
};

// One Q6_K super-block of a tile: w[v] the unsigned 6-bit values of weights 4v..4v+3, sc[g] the
// group scales as i32 (paired where V::kScaledDot: TileBlock), pairs[p] (sc_2p, sc_2p+1) as i16
// pairs, d as f32. aux: x's 16 group sums (i16) per x row and super-block.
template <class V>
struct Q6KTile : TileBlock<V, kQ6_KBlockBytes, 16, 8, false> {
  using I = typename V::I;
  using Base = TileBlock<V, kQ6_KBlockBytes, 16, 8, false>;
  using Base::w, Base::sc, Base::d, Base::dmin;
  // Weights 0..63: two dots' pair sums add up in i16 (2·2·63·127 = 32,004), four would not.
  static constexpr int kDotsPerI16Sum = 2;
  I pairs[8];

  // Weight 128h + 32c + l: the low (c < 2) or high nibble of ql[64h + 32(c & 1) + l] with bits
  // 2c, 2c + 1 of qh[32h + l] above it.
  template <class Src>
  void repack(const Src& src) {
    repack_weights(src);
    repack_scales(src);
  }

  template <class Src>
  void repack_weights(const Src& src) {
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
#pragma GCC unroll 8
      for (int t = 0; t < 8; ++t) {
        I v[4];
        q6_k_values<V>(src.dword(64 * h + 4 * t), src.dword(64 * h + 32 + 4 * t),
                       src.dword(128 + 32 * h + 4 * t), v);
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c) w[32 * h + 8 * c + t] = v[c];
      }
    }
  }

  template <class Src>
  void repack_scales(const Src& src) {
    q6_k_head<V>(src, sc, pairs, d);
    dmin = V::fzero();
  }

  // The - 32 of every q: 32·Σ_g sc_g·(x's group sum g), to subtract.
  I offset(const int32_t* aux) const { return q6_k_offset<V>(pairs, aux); }
};

// in[r] (8 vectors of 8 dwords) transposed: out[t] lane r = dword t of in[r]. Two levels of
// unpacks within 128-bit lanes, then one of lane swaps.
inline void transpose8(const __m256i* in, __m256i* out) {
  __m256i a[8], b[8];
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    a[2 * i] = _mm256_unpacklo_epi32(in[2 * i], in[2 * i + 1]);
    a[2 * i + 1] = _mm256_unpackhi_epi32(in[2 * i], in[2 * i + 1]);
  }
#pragma GCC unroll 2
  for (int g = 0; g < 2; ++g) {  // b[4g + c]: dwords 4L + c of rows 4g..4g + 3 in lane L
    const __m256i* t = a + 4 * g;
    b[4 * g] = _mm256_unpacklo_epi64(t[0], t[2]);
    b[4 * g + 1] = _mm256_unpackhi_epi64(t[0], t[2]);
    b[4 * g + 2] = _mm256_unpacklo_epi64(t[1], t[3]);
    b[4 * g + 3] = _mm256_unpackhi_epi64(t[1], t[3]);
  }
#pragma GCC unroll 4
  for (int c = 0; c < 4; ++c) {
    out[c] = _mm256_permute2x128_si256(b[c], b[4 + c], 0x20);
    out[4 + c] = _mm256_permute2x128_si256(b[c], b[4 + c], 0x31);
  }
}

// The tiles on ymm without the gathers of their weights: each of the 8 rows' super-block decoded
// in vectors (Q4_K: qs[32c, +32), sub-blocks 2c and 2c + 1; Q6_K: weights 32u..32u + 31 as
// dots_q6_k decodes them), then transposed over the rows into the gathers' layout (lane r W row
// r); the scales and d still by gathers.
template <class Dot>
void repack_tile(Q4KTile<Ymm<Dot>>& t, const uint8_t* blk, __m256i rows, int64_t row_bytes,
                 int64_t lanes) {
  const __m256i m4 = _mm256_set1_epi8(15);
  for (int c = 0; c < 4; ++c) {
    __m256i lo[8], hi[8];
    for (int r = 0; r < 8; ++r) {
      const __m256i q = load32(blk + (r < lanes ? r : lanes - 1) * row_bytes + 16 + 32 * c);
      lo[r] = _mm256_and_si256(q, m4);
      hi[r] = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
    }
    transpose8(lo, t.w + 16 * c);
    transpose8(hi, t.w + 16 * c + 8);
  }
  t.repack_scales(GatherRows<Ymm<Dot>>{blk, rows});
}

template <class Dot>
void repack_tile(Q6KTile<Ymm<Dot>>& t, const uint8_t* blk, __m256i rows, int64_t row_bytes,
                 int64_t lanes) {
  for (int h = 0; h < 2; ++h) {
    __m256i v[4][8];
    for (int r = 0; r < 8; ++r) {
      const uint8_t* b = blk + (r < lanes ? r : lanes - 1) * row_bytes;
      __m256i w[4];
      q6_k_values<Ymm<Dot>>(load32(b + 64 * h), load32(b + 64 * h + 32), load32(b + 128 + 32 * h),
                            w);
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) v[c][r] = w[c];
    }
    for (int c = 0; c < 4; ++c) transpose8(v[c], t.w + 8 * (4 * h + c));
  }
  t.repack_scales(GatherRows<Ymm<Dot>>{blk, rows});
}

// R x rows (row i's q at xq + i·k, its aux at aux + i·kAux·supers) against a repacked tile: row
// i's S (and Q4_K's M) of super-block b, one lane per W row, at s (m) + kLanes·(i·supers + b). A
// run (a sub-block or group) is 64 / kRuns dwords, its scale sc[run] (an i16 pair where
// V::kScaledDot).
template <class V, class Tile, int R>
void tile_dots(const Tile* tile, int64_t supers, const int8_t* xq, int64_t k, const int32_t* aux,
               int32_t* s, int32_t* m) {
  using I = typename V::I;
  constexpr int kDwords = 64 / Tile::kRuns;
  for (int64_t b = 0; b < supers; ++b) {
    const Tile& o = tile[b];
    const int8_t* xb = xq + 256 * b;
    I sum[R];
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) sum[i] = V::zero();
    for (int run = 0; run < Tile::kRuns; ++run) {
      if constexpr (V::kScaledDot) {
        // AVX2's dots: Tile::kDotsPerI16Sum dots' vpmaddubsw pair sums added in i16 (they fit),
        // each such sum scaled by one vpmaddwd against the run's scale pairs (sc, paired at the
        // repack): the same exact integers as a vpmulld on the run's sum, in fewer instructions.
        constexpr int kSum = Tile::kDotsPerI16Sum;
        static_assert(kDwords % kSum == 0);
        const I sc16 = o.sc[run];
        I a[R];
#pragma GCC unroll 8
        for (int t = 0; t < kDwords; ++t) {
          const I wv = o.w[kDwords * run + t];
#pragma GCC unroll 8
          for (int i = 0; i < R; ++i) {
            const I p = V::pairs(wv, broadcast_i32<V>(xb + i * k + 4 * (kDwords * run + t)));
            a[i] = t % kSum == 0 ? p : V::add16(a[i], p);
            if (t % kSum == kSum - 1) sum[i] = V::madd(sum[i], a[i], sc16);
          }
        }
      } else {
        I a[R];
#pragma GCC unroll 8
        for (int i = 0; i < R; ++i) a[i] = V::zero();
#pragma GCC unroll 8
        for (int t = 0; t < kDwords; ++t) {
          const I wv = o.w[kDwords * run + t];
#pragma GCC unroll 8
          for (int i = 0; i < R; ++i) {
            a[i] = V::dot(a[i], wv, broadcast_i32<V>(xb + i * k + 4 * (kDwords * run + t)));
          }
        }
#pragma GCC unroll 8
        for (int i = 0; i < R; ++i) sum[i] = V::add(sum[i], V::mullo(a[i], o.sc[run]));
      }
    }
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      const int32_t* ai = aux + (i * supers + b) * Tile::kAux;
      if constexpr (Tile::kMins) {
        V::store(m + V::kLanes * (i * supers + b), o.mins_sum(ai));
      } else {
        sum[i] = V::sub(sum[i], o.offset(ai));
      }
      V::store(s + V::kLanes * (i * supers + b), sum[i]);
    }
  }
}

// matmul_int8.h's tree of 8 lanes, for kLanes W rows at once.
template <class V>
inline typename V::F tree8_rows(const typename V::F* l) {
  typename V::F s4[4];
  for (int i = 0; i < 4; ++i) s4[i] = V::fadd(l[i], l[i + 4]);
  return V::fadd(V::fadd(s4[0], s4[2]), V::fadd(s4[1], s4[3]));
}

// One x row's combine (matmul_int8.h) over kLanes W rows, super-block b's d and dmin
// scales(b, &d, &dmin): the `lanes` W rows' y stored at `y`.
template <class V, bool kMins, class Scales>
void combine_lanes(int64_t supers, const float* dx, Scales scales, const int32_t* s,
                   const int32_t* m, float* y, int64_t lanes, bool accumulate) {
  using F = typename V::F;
  F acc[8], accm[8];
#pragma GCC unroll 8
  for (int l = 0; l < 8; ++l) acc[l] = accm[l] = V::fzero();
  for (int64_t b0 = 0; b0 < supers; b0 += 8) {
#pragma GCC unroll 8
    for (int l = 0; l < 8; ++l) {  // lane l: super-block b0 + l
      const int64_t b = b0 + l;
      if (b >= supers) break;
      F d, dmin;
      scales(b, &d, &dmin);
      const F x = V::fset1(dx[b]);
      const F t = V::fmul(V::fmul(x, d), V::cvt(V::load(s + V::kLanes * b)));
      acc[l] = V::fadd(acc[l], t);
      if constexpr (kMins) {
        const F u = V::fmul(V::fmul(x, dmin), V::cvt(V::load(m + V::kLanes * b)));
        accm[l] = V::fadd(accm[l], u);
      }
    }
  }
  F out = tree8_rows<V>(acc);
  if constexpr (kMins) out = V::fsub(out, tree8_rows<V>(accm));
  V::store_rows(y, out, lanes, accumulate);
}

template <class V, class Tile>
void combine_tile(const Tile* tile, int64_t supers, const float* dx, const int32_t* s,
                  const int32_t* m, float* y, int64_t lanes, bool accumulate) {
  using F = typename V::F;
  combine_lanes<V, Tile::kMins>(
      supers, dx,
      [tile](int64_t b, F* d, F* dmin) {
        *d = tile[b].d;
        *dmin = tile[b].dmin;
      },
      s, m, y, lanes, accumulate);
}

// x's Q8_K group sums per row and super-block, as Tile's aux: Q6_K's 16 i16 as they are; Q4_K's
// 4 i32, q holding (bsum_4q + bsum_4q+1) | (bsum_4q+2 + bsum_4q+3) << 16 (each at most 32·127).
template <class Tile>
void tile_aux(const QuantizedX& x, int64_t rows, int64_t supers, int32_t* out) {
  const auto count = static_cast<size_t>(rows * supers * Tile::kAux);
  if constexpr (Tile::kMins) {
    for (size_t g = 0; g < count; ++g) {
      const int16_t* bs = x.bsums.data() + 4 * g;
      const auto lo = static_cast<uint16_t>(bs[0] + bs[1]);
      const auto hi = static_cast<uint16_t>(bs[2] + bs[3]);
      out[g] = static_cast<int32_t>(static_cast<uint32_t>(lo) | static_cast<uint32_t>(hi) << 16);
    }
  } else {
    std::memcpy(out, x.bsums.data(), count * sizeof(int32_t));
  }
}

// A tile's scratch for one call (thread_scratch: a claim allocates nothing): the repacked
// super-blocks, x's aux, the sums of 8 x rows. Every part is written before it is read.
template <class Tile>
struct TileScratch {
  Tile* tile;
  int32_t *aux, *s, *m;
};

// R x rows from r0 against the tile at W rows [j0, j0 + lanes): dots, then each row's combine.
template <class V, class Tile, int R>
void tile_rows_of(const Problem& p, const QuantizedX& x, const TileScratch<Tile>& t, int64_t r0,
                  int64_t j0, int64_t lanes) {
  const int64_t supers = p.k / kSuperBlockWeights;
  tile_dots<V, Tile, R>(t.tile, supers, x.q.data() + r0 * p.k, p.k,
                        t.aux + r0 * supers * Tile::kAux, t.s, t.m);
  for (int64_t i = 0; i < R; ++i) {
    combine_tile<V>(t.tile, supers, x.d.data() + (r0 + i) * x.d_stride,
                    t.s + V::kLanes * i * supers, t.m + V::kLanes * i * supers,
                    p.y + (r0 + i) * p.ldy + j0, lanes, p.accumulate);
  }
}

// Where prefetch_span brings lines: __builtin_prefetch's locality (3: prefetcht0, into L1; 2:
// prefetcht1, into L2), which GCC and clang both take as a constant (_mm_prefetch's hint is an
// enum in GCC's headers and an int in clang's).
constexpr int kIntoL1 = 3, kIntoL2 = 2;

// Prefetches into kLevel (kIntoL1, kIntoL2) the lines of W rows [row, row + rows) (`row_bytes`
// each, w at row 0) that lie below byte `end` (prefetch_bytes).
template <int kLevel>
inline void prefetch_span(const uint8_t* w, int64_t row, int64_t rows, int64_t row_bytes,
                          int64_t end) {
  for (int64_t at = row * row_bytes; at < (row + rows) * row_bytes && at < end; at += 64) {
    __builtin_prefetch(w + at, 0, kLevel);
  }
}

// x rows [0, rows) in runs of 8, 4, 2 or 1: f.template operator()<R>(r0) for each.
template <class F>
void by_row_runs(int64_t rows, F&& f) {
  for (int64_t r0 = 0; r0 < rows;) {
    const int64_t left = rows - r0;
    if (left >= 8) {
      f.template operator()<8>(r0);
    } else if (left >= 4) {
      f.template operator()<4>(r0);
    } else if (left >= 2) {
      f.template operator()<2>(r0);
    } else {
      f.template operator()<1>(r0);
    }
    r0 += left >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
  }
}

// Every x row of p against the tile at W rows [j0, j0 + lanes), 8 x rows at a time.
template <class V, class Tile>
void tile_all_rows(const Problem& p, const QuantizedX& x, const TileScratch<Tile>& t, int64_t j0,
                   int64_t lanes) {
  by_row_runs(p.rows, [&]<int R>(int64_t r0) { tile_rows_of<V, Tile, R>(p, x, t, r0, j0, lanes); });
}

// A call's TileScratch, x's aux written.
template <class Tile, class V>
TileScratch<Tile> tile_scratch(const Problem& p, const QuantizedX& x, int64_t supers) {
  const auto sums = static_cast<size_t>(8 * V::kLanes * supers);
  int32_t* ints = thread_scratch<int32_t, struct TilesInts>(
      static_cast<size_t>(p.rows * supers * Tile::kAux) + 2 * sums);
  const TileScratch<Tile> t{thread_scratch<Tile, struct TilesTiles>(static_cast<size_t>(supers)),
                            ints, ints + p.rows * supers * Tile::kAux,
                            ints + p.rows * supers * Tile::kAux + sums};
  tile_aux<Tile>(x, p.rows, supers, t.aux);
  return t;
}

template <class V, template <class> class TileOf>
void rows_tiles(const Problem& p, const QuantizedX& x) {
  using Tile = TileOf<V>;
  const int64_t supers = p.k / kSuperBlockWeights, row_bytes = supers * Tile::kBytes;
  const auto* w = static_cast<const uint8_t*>(p.w);
  const TileScratch<Tile> t = tile_scratch<Tile, V>(p, x, supers);
  for (int64_t j0 = 0; j0 < p.n; j0 += V::kLanes) {
    const int64_t lanes = p.n - j0 < V::kLanes ? p.n - j0 : V::kLanes;
    const typename V::I rows = tile_rows<V>(row_bytes, lanes);
    // the next tile's rows arrive while this one meets the x rows
    prefetch_span<kIntoL1>(w, j0 + V::kLanes, V::kLanes, row_bytes, prefetch_bytes(p, row_bytes));
    for (int64_t b = 0; b < supers; ++b) {
      repack_tile(t.tile[b], w + j0 * row_bytes + b * Tile::kBytes, rows, row_bytes, lanes);
    }
    tile_all_rows<V>(p, x, t, j0, lanes);
  }
}

// rows_tiles over W rows interleaved 16 at a time (Problem::interleaved; task::DataType's
// kQ4_K_R16 / kQ6_K_R16 layout): a tile's super-block is loaded from the group's chunks, one
// vector a dword of every row (on ymm, a group is two tiles: lanes 0-7 and 8-15 of each chunk), so
// the repack is a load and the nibbles' masks a vector, cheap enough for 4 x rows
// (rows_interleaved; fewer take rows_interleaved_few). The same tiles and combine as rows_tiles, so
// the same bits.
template <class V, template <class> class TileOf>
void rows_tiles_interleaved(const Problem& p, const QuantizedX& x) {
  using Tile = TileOf<V>;
  constexpr int64_t kChunks = Tile::kBytes / 4, kTail = Tile::kBytes % 4;
  const int64_t supers = p.k / kSuperBlockWeights, group_bytes = kGroupRows * supers * Tile::kBytes;
  const auto* w = static_cast<const uint8_t*>(p.w);
  const TileScratch<Tile> t = tile_scratch<Tile, V>(p, x, supers);
  const int64_t row_bytes = supers * Tile::kBytes, end = prefetch_bytes(p, row_bytes);
  for (int64_t j0 = 0; j0 < p.n; j0 += V::kLanes) {
    const uint8_t* g = w + j0 / kGroupRows * group_bytes;
    const int64_t lane0 = j0 % kGroupRows;
    if (lane0 == 0) {  // the next group arrives while this one meets the x rows
      prefetch_span<kIntoL1>(w, j0 + kGroupRows, kGroupRows, row_bytes, end);
    }
    for (int64_t b = 0; b < supers; ++b) {
      t.tile[b].repack(
          InterleavedRows<V>{g + 64 * kChunks * b + 4 * lane0,
                             g + 64 * kChunks * supers + 16 * kTail * b + kTail * lane0});
    }
    tile_all_rows<V>(p, x, t, j0, V::kLanes);
  }
}

// ---- Fewer than 4 x rows over interleaved W (rows_interleaved_few): the tiles' sums without the
// tile. A W vector (dword t of every row of a group, lane r W row r) is loaded from the group's
// chunk, its 4- or 6-bit values formed in registers and met at once by each x row's broadcast
// dword; a run's sum then takes its scale as in tile_dots (one vpmulld on VNNI targets, vpmaddwd
// against its i16 pairs on AVX2: Ymm::kScaledDot), so S (and M) are the same exact integers and
// the combine the same (combine_lanes): the same bits. Where dot takes
// unsigned bytes over all of 0..255 (VNNI), Q4_K's high nibbles go in as they lie (16·q, masked
// by 0xf0) and the run's sum is shifted down by 4 (exact: |16·Σ q·x| <= 16·32·15·127 < 2^31).

// How far ahead of its reads an interleaved kernel under 4 x rows (rows_interleaved_few,
// rows_q8_0_interleaved) prefetches W: a line per chunk read (Q6_K: every line of the column, in
// memory order); on ymm, where a line holds two parts, part 0 requests it for both. As the read
// probe does (bench_probes.cc), but further, for the kernel's work between lines; each line
// requested twice, kInterleavedPrefetchBytes and kInterleavedRefetchBytes ahead
// (docs/design/quantized_matmul.md, "Each line prefetched twice"). kLocality is where the lines
// go, __builtin_prefetch's locality: Q4_K and Q6_K into L1 (kIntoL1, prefetcht0), Q8_0 into L2
// (kQ8_0ChunkLocality, 1: prefetcht2), and none on AMD family 1Ah, Zen 5's (rows_q8_0_interleaved);
// why: docs/design/quantized_matmul.md, "Into L1 on Zen 5". The addresses are formed as integers:
// they may lie past W's end (a prefetch there does nothing).
constexpr int64_t kInterleavedPrefetchBytes = 16384;
constexpr int64_t kInterleavedRefetchBytes = 10240;
constexpr int kQ8_0ChunkLocality = 1;
template <int kLocality>
inline void prefetch_chunk(const uint8_t* at) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(at);
  __builtin_prefetch(reinterpret_cast<const char*>(a + kInterleavedPrefetchBytes), 0, kLocality);
  __builtin_prefetch(reinterpret_cast<const char*>(a + kInterleavedRefetchBytes), 0, kLocality);
}

// One dot of a run: acc + w·x's 4 products a lane (V::dot), or with kScaledDot those products'
// pair sums times the run's scale pairs sc16 (V::dot_scaled).
template <class V>
inline typename V::I run_dot(typename V::I acc, typename V::I w, typename V::I x,
                             typename V::I sc16) {
  if constexpr (V::kScaledDot) {
    return V::dot_scaled(acc, w, x, sc16);
  } else {
    (void)sc16;
    return V::dot(acc, w, x);
  }
}

// A group's lanes are kHalves vectors (lanes kLanes·half..: two on ymm, one on zmm): the fused
// kernels take a super-block column's halves one after the other (q4_k_interleaved_dots with VNNI
// dots under 3 x rows and q8_0_dots under 4: both halves of each line at once, kTogether), so that
// the group's 64-byte chunks are read in order, each line's halves together. Taking one half over
// every super-block and then the other read each line twice, half of it each time, and was slower
// from memory than the plain layout (docs/design/quantized_matmul.md, "The 256-bit targets").
template <class V>
constexpr int64_t kHalves = kGroupRows / V::kLanes;

// Where part `part` (kHalves) of block b of x row i (of R) keeps its sums: vectors of kLanes.
template <class V, int R>
constexpr int64_t few_at(int64_t part, int64_t i, int64_t blocks, int64_t b) {
  return V::kLanes * ((part * R + i) * blocks + b);
}

// The dots of sub-blocks 2c (low nibbles: lo) and 2c + 1 (high: hi) of T parts (src[p]) of a
// Q4_K column against R x rows (row i's q of sub-block 2c at xb + i·k): where V::kScaledDot, the
// 8 dots' i16 pair sums, else the i32 dots (the high nibbles as 16·q where kUnsignedFullRange).
// The line of each chunk read prefetched where `prefetch` (the parts of a line share it).
template <class V, int R, int64_t T>
inline void q4_k_run_dots(const InterleavedRows<V>* src, bool prefetch, int c, const int8_t* xb,
                          int64_t k, typename V::I (&lo)[T][R], typename V::I (&hi)[T][R]) {
  using I = typename V::I;
  const I k4 = V::set1(0x0f0f0f0f), kf0 = V::set1(static_cast<int32_t>(0xf0f0f0f0u));
#pragma GCC unroll 2
  for (int p = 0; p < T; ++p) {
#pragma GCC unroll 4
    for (int i = 0; i < R; ++i) lo[p][i] = hi[p][i] = V::zero();
  }
#pragma GCC unroll 8
  for (int t = 0; t < 8; ++t) {
    const int at = 16 + 32 * c + 4 * t;
    if (prefetch) prefetch_chunk<kIntoL1>(src[0].chunks + 16 * at);
    I wl[T], wh[T];
#pragma GCC unroll 2
    for (int p = 0; p < T; ++p) {
      const I q = src[p].dword(at);
      wl[p] = V::and_(q, k4);
      wh[p] = V::kUnsignedFullRange ? V::and_(q, kf0) : V::and_(V::srli(q, 4), k4);
    }
#pragma GCC unroll 4
    for (int i = 0; i < R; ++i) {
      const I xl = broadcast_i32<V>(xb + i * k + 4 * t),
              xh = broadcast_i32<V>(xb + i * k + 32 + 4 * t);
#pragma GCC unroll 2
      for (int p = 0; p < T; ++p) {
        if constexpr (V::kScaledDot) {
          lo[p][i] = V::add16(lo[p][i], V::pairs(wl[p], xl));
          hi[p][i] = V::add16(hi[p][i], V::pairs(wh[p], xh));
        } else {
          lo[p][i] = V::dot(lo[p][i], wl[p], xl);
          hi[p][i] = V::dot(hi[p][i], wh[p], xh);
        }
      }
    }
  }
}

// R x rows (row i's q at xq + i·k, aux at aux + 4·(i·supers + b)) against the Q4_K group at g:
// S and M of super-block b, lanes of part h, at s, m + few_at(h, i, supers, b), d and dmin at
// d[h·supers + b], dmin[h·supers + b]. With VNNI dots under 3 x rows the parts of a line (two on
// ymm) go together, as in q8_0_dots: x's dwords broadcast once for both, each part's sums in its
// own accumulators (the same exact integers per part); AVX2's dots (kScaledDot) take one part
// at a time (docs/design/quantized_matmul.md, "Q4_K's parts of a line together on VNNI").
template <class V, int R>
void q4_k_interleaved_dots(const uint8_t* g, int64_t supers, const int8_t* xq, int64_t k,
                           const int32_t* aux, int32_t* s, int32_t* m, typename V::F* d,
                           typename V::F* dmin) {
  using I = typename V::I;
  constexpr int64_t kTogether = R <= 2 && !V::kScaledDot ? kHalves<V> : 1;
  // kScaledDot: a run's 8 dots' i16 pair sums stay within i16 (Q4KTile's kDotsPerI16Sum)
  static_assert(Q4KTile<V>::kDotsPerI16Sum >= 8);
  for (int64_t bp = 0; bp < supers * kHalves<V>; bp += kTogether) {
    const int64_t b = bp / kHalves<V>, part0 = bp % kHalves<V>;
    const uint8_t* column = g + 64 * (kQ4_KBlockBytes / 4) * b;
    InterleavedRows<V> src[kTogether];
    I sc[kTogether][8], mins[kTogether][4], sum[kTogether][R];
#pragma GCC unroll 2
    for (int p = 0; p < kTogether; ++p) {
      const int64_t part = part0 + p;
      src[p] = InterleavedRows<V>{column + 4 * V::kLanes * part, nullptr};
      q4_k_head<V>(src[p], sc[p], mins[p], d[part * supers + b], dmin[part * supers + b]);
#pragma GCC unroll 4
      for (int i = 0; i < R; ++i) sum[p][i] = V::zero();
    }
#pragma GCC unroll 1
    for (int c = 0; c < 4; ++c) {  // qs[32c, +32): sub-block 2c low nibbles, 2c + 1 high
      // kScaledDot: lo and hi hold the run's i16 pair sums, scaled once by the scales' i16
      // pairs; else the i32 dots, scaled by vpmulld.
      I lo[kTogether][R], hi[kTogether][R];
      q4_k_run_dots<V, R, kTogether>(src, part0 == 0, c, xq + 256 * b + 64 * c, k, lo, hi);
#pragma GCC unroll 2
      for (int p = 0; p < kTogether; ++p) {
#pragma GCC unroll 4
        for (int i = 0; i < R; ++i) {
          if constexpr (V::kScaledDot) {
            sum[p][i] =
                V::madd(V::madd(sum[p][i], lo[p][i], sc[p][2 * c]), hi[p][i], sc[p][2 * c + 1]);
          } else {
            if constexpr (V::kUnsignedFullRange) hi[p][i] = V::srai(hi[p][i], 4);
            sum[p][i] = V::add(sum[p][i], V::add(V::mullo(lo[p][i], sc[p][2 * c]),
                                                 V::mullo(hi[p][i], sc[p][2 * c + 1])));
          }
        }
      }
    }
#pragma GCC unroll 2
    for (int p = 0; p < kTogether; ++p) {
#pragma GCC unroll 4
      for (int i = 0; i < R; ++i) {
        const int64_t at = few_at<V, R>(part0 + p, i, supers, b);
        V::store(s + at, sum[p][i]);
        V::store(m + at, q4_k_mins_sum<V>(mins[p], aux + 4 * (i * supers + b)));
      }
    }
  }
}

// The same for a Q6_K group: weight 128h + 32c + l of a row is the low (c < 2) or high nibble
// of ql[64h + 32(c & 1) + l] with bits 2c, 2c + 1 of qh[32h + l] above it; x's aux 8 i32 (16
// group sums) per row and super-block; S less the - 32's offset; no M.
template <class V, int R>
void q6_k_interleaved_dots(const uint8_t* g, int64_t supers, const int8_t* xq, int64_t k,
                           const int32_t* aux, int32_t* s, typename V::F* d) {
  using I = typename V::I;
  constexpr int64_t kChunks = kQ6_KBlockBytes / 4;
  static_assert(kChunks == 3 * 16 + 4);  // the prefetch's 16 steps of 3, and 4 scale chunks
  for (int64_t bp = 0; bp < supers * kHalves<V>; ++bp) {
    const int64_t b = bp / kHalves<V>, part = bp % kHalves<V>, lane0 = V::kLanes * part;
    const InterleavedRows<V> src{g + 64 * kChunks * b + 4 * lane0,
                                 g + 64 * kChunks * supers + 2 * (16 * b + lane0)};
    I sum[R];
    d[part * supers + b] = src.q6_k_d();
#pragma GCC unroll 4
    for (int i = 0; i < R; ++i) sum[i] = V::zero();
#pragma GCC unroll 1
    for (int h = 0; h < 2; ++h) {
#pragma GCC unroll 2
      for (int half = 0; half < 2; ++half) {  // dwords 4·half..4·half + 3 of each 32 weights
        // group 8h + 2c + half's scale: byte (2c + half) mod 4 of dword 2h + c / 2 of scales
        const I s4[2] = {src.dword(192 + 8 * h), src.dword(196 + 8 * h)};
        I sc[4];
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c) sc[c] = q6_k_scale<V>(s4[c / 2], (2 * c + half) % 4);
        I acc[4][R];  // c: weights 128h + 32c + [16·half, +16), group 8h + 2c + half
#pragma GCC unroll 4
        for (int i = 0; i < R; ++i) acc[0][i] = acc[1][i] = acc[2][i] = acc[3][i] = V::zero();
#pragma GCC unroll 4
        for (int tt = 0; tt < 4; ++tt) {
          const int t = 4 * half + tt;
          const int at0 = 64 * h + 4 * t, at1 = at0 + 32, ath = 128 + 32 * h + 4 * t;
          const I ql0 = src.dword(at0), ql1 = src.dword(at1), qh = src.dword(ath);
          // Every line of the group through prefetch_chunk once: the column's 52 chunks 3 a step
          // in memory order (the 4 scale chunks early, in the first 4 steps) and, on even
          // columns, the line holding their d (every line of d holds one even column's); not each
          // chunk's line beside its read (ql's two streams and qh's would be three prefetch
          // streams a core, the scale chunks and d never prefetched).
          const int step = 8 * h + t;
          if (part == 0) {  // the parts of a line (two on ymm) share its prefetch
            prefetch_chunk<kIntoL1>(src.chunks + 64 * (3 * step));
            prefetch_chunk<kIntoL1>(src.chunks + 64 * (3 * step + 1));
            prefetch_chunk<kIntoL1>(src.chunks + 64 * (3 * step + 2));
            if (step < 4) prefetch_chunk<kIntoL1>(src.chunks + 64 * (kChunks - 4 + step));
            if (step == 4 && b % 2 == 0) prefetch_chunk<kIntoL1>(src.tail);
          }
          I w[4];
          q6_k_values<V>(ql0, ql1, qh, w);
#pragma GCC unroll 4
          for (int c = 0; c < 4; ++c) {
#pragma GCC unroll 4
            for (int i = 0; i < R; ++i) {
              const I xv = broadcast_i32<V>(xq + i * k + 256 * b + 128 * h + 32 * c + 4 * t);
              acc[c][i] = run_dot<V>(acc[c][i], w[c], xv, sc[c]);
            }
          }
        }
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c) {
#pragma GCC unroll 4
          for (int i = 0; i < R; ++i) {
            sum[i] = V::add(sum[i], V::kScaledDot ? acc[c][i] : V::mullo(acc[c][i], sc[c]));
          }
        }
      }
    }
    I pairs[8];
    q6_k_pairs<V>(src, pairs);
#pragma GCC unroll 4
    for (int i = 0; i < R; ++i) {
      V::store(s + few_at<V, R>(part, i, supers, b),
               V::sub(sum[i], q6_k_offset<V>(pairs, aux + 8 * (i * supers + b))));
    }
  }
}

// p's R (= p.rows) x rows against the group at g (W rows j0..j0 + 15): sums, then each half's
// and row's combine.
template <class V, WeightType WT, int R>
void interleaved_few_of(const Problem& p, const QuantizedX& x, const uint8_t* g, const int32_t* aux,
                        int32_t* s, int32_t* m, typename V::F* d, typename V::F* dmin, int64_t j0) {
  using F = typename V::F;
  const int64_t supers = p.k / kSuperBlockWeights;
  if constexpr (WT == WeightType::kQ4_K) {
    q4_k_interleaved_dots<V, R>(g, supers, x.q.data(), p.k, aux, s, m, d, dmin);
  } else {
    q6_k_interleaved_dots<V, R>(g, supers, x.q.data(), p.k, aux, s, d);
  }
  for (int64_t part = 0; part < kHalves<V>; ++part) {
    const F* dh = d + part * supers;
    const F* dminh = dmin + part * supers;
    for (int64_t i = 0; i < R; ++i) {
      const int64_t at = few_at<V, R>(part, i, supers, 0);
      combine_lanes<V, WT == WeightType::kQ4_K>(
          supers, x.d.data() + i * x.d_stride,
          [dh, dminh](int64_t b, F* db, F* dminb) {
            *db = dh[b];
            *dminb = dminh[b];
          },
          s + at, m + at, p.y + i * p.ldy + j0 + V::kLanes * part, V::kLanes, p.accumulate);
    }
  }
}

template <class V, WeightType WT>
void rows_interleaved_few(const Problem& p, const QuantizedX& x) {
  using F = typename V::F;
  using Tile = std::conditional_t<WT == WeightType::kQ4_K, Q4KTile<V>, Q6KTile<V>>;
  const int64_t supers = p.k / kSuperBlockWeights, group_bytes = kGroupRows * supers * Tile::kBytes;
  const auto* w = static_cast<const uint8_t*>(p.w);
  int32_t* ints = thread_scratch<int32_t, struct InterleavedFewInts>(
      static_cast<size_t>(p.rows * supers * (Tile::kAux + 2 * kGroupRows)));
  int32_t* s = ints + p.rows * supers * Tile::kAux;
  int32_t* m = s + p.rows * supers * kGroupRows;
  F* d =
      thread_scratch<F, struct InterleavedFewScales>(static_cast<size_t>(2 * kHalves<V> * supers));
  F* dmin = d + kHalves<V> * supers;
  tile_aux<Tile>(x, p.rows, supers, ints);
  for (int64_t j0 = 0; j0 < p.n; j0 += kGroupRows) {
    const uint8_t* g = w + j0 / kGroupRows * group_bytes;
    if (p.rows == 1) {
      interleaved_few_of<V, WT, 1>(p, x, g, ints, s, m, d, dmin, j0);
    } else if (p.rows == 2) {
      interleaved_few_of<V, WT, 2>(p, x, g, ints, s, m, d, dmin, j0);
    } else {
      interleaved_few_of<V, WT, 3>(p, x, g, ints, s, m, d, dmin, j0);
    }
  }
}

template <class V>
void rows_q8_0_interleaved(const Problem& p, const QuantizedX& x);

// Interleaved W (Problem::interleaved): Q4_K and Q6_K under 4 x rows by rows_interleaved_few,
// more by the tiles; Q8_0 by rows_q8_0_interleaved.
template <class V>
void rows_interleaved(const Problem& p, const QuantizedX& x) {
  if (p.wt == WeightType::kQ8_0) return rows_q8_0_interleaved<V>(p, x);
  if (p.wt == WeightType::kQ4_K) {
    if (p.rows < 4) return rows_interleaved_few<V, WeightType::kQ4_K>(p, x);
    return rows_tiles_interleaved<V, Q4KTile>(p, x);
  }
  if (p.rows < 4) return rows_interleaved_few<V, WeightType::kQ6_K>(p, x);
  return rows_tiles_interleaved<V, Q6KTile>(p, x);
}

// ---- Q8_0 over several x rows: repacked tiles (rows_q8_0_tiles), as rows_tiles: W taken
// V::kLanes rows at a time and repacked once per call into a buffer that stays in L2, vector lane
// r W row r: per block, w[t] dword t (weights 4t..4t + 3) of every row's block as unsigned bytes
// (q + 128: the sign bit flipped) and d the rows' scales as f32. An x row's dword t (its signed q)
// is broadcast against w[t] by one V::dot, so after a block's 8 each lane holds Σ (w + 128)·x for
// its row, and the block's -128·Σx (one i32 per x row and block, the same for every lane, once per
// call) as the accumulator's start leaves the exact block sum S_b: one instruction per 4 products
// a lane, x rows 8 at a time sharing each loaded W vector. Where V::dot cannot take its unsigned
// side over all of 0..255 without saturating (AVX2's vpmaddubsw, whose i16 pair sums would reach
// 2·255·127: kQ8_0Signed), the tiles hold W signed and the dots take |w| against x with w's sign.
// The combine runs on the W rows' lanes in the shared order (q8_0_combine_lanes).
// -128·Σ q over each of `blocks` blocks of 32 of x's q: a block sum's start when the weights are
// taken unsigned (w + 128) against x's q.
inline void q8_0_x_starts(const int8_t* q, int64_t blocks, int32_t* out) {
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  for (int64_t b = 0; b < blocks; ++b) {  // Σ (q + 128) by vpsadbw, four u64 of 8 bytes each
    const __m256i s =
        _mm256_sad_epu8(_mm256_xor_si256(load32(q + 32 * b), flip), _mm256_setzero_si256());
    const __m128i h = _mm_add_epi64(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    const int64_t total = _mm_cvtsi128_si64(h) + _mm_extract_epi64(h, 1);
    out[b] = -128 * static_cast<int32_t>(total - 32 * 128);
  }
}

template <class V>
struct Q80Tile {
  typename V::I w[8];
  typename V::F d;
};

// The tile's blocks from W at `w` (its first row; rows row_bytes apart, lanes past `lanes`
// repeating the last row) on ymm: each block's 32 bytes of the 8 rows, transposed (transpose8);
// the scales by one gather a block. The AVX-512 target overloads it for Zmm.
template <class Dot>
void repack_q8_0(Q80Tile<Ymm<Dot>>* tile, const uint8_t* w, int64_t row_bytes, int64_t lanes,
                 int64_t blocks) {
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(Ymm<Dot>::kQ8_0Signed ? 0 : 0x80));
  const __m256i rows = tile_rows<Ymm<Dot>>(row_bytes, lanes);
  for (int64_t b = 0; b < blocks; ++b) {
    __m256i in[8];
#pragma GCC unroll 8
    for (int r = 0; r < 8; ++r) {
      const uint8_t* q = w + (r < lanes ? r : lanes - 1) * row_bytes + b * kQ8_0BlockBytes + 2;
      in[r] = _mm256_xor_si256(load32(q), flip);
    }
    transpose8(in, tile[b].w);
    tile[b].d = Ymm<Dot>::half_lo(Ymm<Dot>::gather(rows, w + b * kQ8_0BlockBytes));
  }
}

// Where the Q8_0 dots read W, vector lane r W row r: Q8_0TileSrc a repacked tile (its vectors
// already q + 128, or q itself where kQ8_0Signed); Q8_0ChunkSrc W rows interleaved 16 at a time
// (task::DataType::kQ8_0_R16: in a group, block column b is 8 chunks of 64 bytes at 512·b, chunk
// t holding dword t, weights 4t..4t + 3, of every row's q; the rows' d follow the group's chunks,
// column b's 32 bytes at 512·blocks + 32·b), a chunk's kLanes rows one load, flipped on the way.
// kParts vectors take a block column's rows (Q8_0ChunkSrc on ymm: two halves of a group).
template <class V>
struct Q8_0TileSrc {
  static constexpr int64_t kParts = 1;
  const Q80Tile<V>* tile;
  typename V::I w(int64_t b, int64_t, int t) const { return tile[b].w[t]; }
  typename V::F d(int64_t b, int64_t) const { return tile[b].d; }
  void prefetch(int64_t, int64_t, int) const {}
};

// kPrefetch: whether its dots under 4 x rows prefetch the lines ahead of them
// (rows_q8_0_interleaved).
template <class V, bool kPrefetch = true>
struct Q8_0ChunkSrc {
  static constexpr int64_t kParts = kHalves<V>;
  const uint8_t* g;  // the group
  int64_t blocks;
  const uint8_t* chunk(int64_t b, int64_t part, int t) const {
    return g + 512 * b + 64 * t + 4 * V::kLanes * part;
  }
  typename V::I w(int64_t b, int64_t part, int t) const {
    const typename V::I q = V::load(chunk(b, part, t));
    if constexpr (V::kQ8_0Signed) return q;
    return V::xor_(q, V::set1(static_cast<int32_t>(0x80808080u)));
  }
  typename V::F d(int64_t b, int64_t part) const {
    return V::halves(g + 512 * blocks + 32 * b + 2 * V::kLanes * part);
  }
  // The line kInterleavedPrefetchBytes and kInterleavedRefetchBytes ahead of chunk (b, part, t)
  // into L2 (prefetch_chunk at kQ8_0ChunkLocality; the parts of a line share it); nothing unless
  // kPrefetch.
  void prefetch(int64_t b, int64_t part, int t) const {
    if constexpr (kPrefetch) prefetch_chunk<kQ8_0ChunkLocality>(chunk(b, part, t));
  }
};

// acc + the 4 products a lane of W's bytes w and x's broadcast dword xv: where kQ8_0Signed
// (AVX2's vpmaddubsw would saturate on w + 128) |w| against x with w's sign, else V::dot on w +
// 128.
template <class V>
inline typename V::I q8_0_dot(typename V::I acc, typename V::I w, typename V::I xv) {
  if constexpr (V::kQ8_0Signed) {
    return V::dot(acc, _mm256_sign_epi8(w, w), _mm256_sign_epi8(xv, w));
  } else {
    return V::dot(acc, w, xv);
  }
}

// R x rows (row i's q at xq + i·k, its blocks' -128·Σx at xc + i·blocks: q8_0_starts) against W
// read through src: row i's S_b of part `part`, one lane per W row, at s + few_at(part, i, blocks,
// b). An x row's dword t is broadcast against W's vector t by one q8_0_dot, so after a block's 8
// each lane holds Σ (w + 128)·x for its row from -128·Σx (or Σ w·x from 0 where kQ8_0Signed): the
// exact block sum S_b. Under 4 x rows the parts of a line (two on ymm) go together: one
// prefetch_chunk for the line's parts, x's dword broadcast once for both, each part's sum in its
// own accumulator (docs/design/quantized_matmul.md, "The halves of a line together"); the prefetch
// is decided at compile time (a run-time flag slowed the loop).
template <class V, int R, class Src>
void q8_0_dots(const Src& src, int64_t blocks, const int8_t* xq, int64_t k, const int32_t* xc,
               int32_t* s) {
  using I = typename V::I;
  // 3 rows too: q8_0_interleaved_groups takes them in one pass
  constexpr int64_t kTogether = R <= 3 ? Src::kParts : 1;
  for (int64_t bp = 0; bp < blocks * Src::kParts; bp += kTogether) {
    const int64_t b = bp / Src::kParts, part0 = bp % Src::kParts;
    const int8_t* xb = xq + 32 * b;
    I a[kTogether][R];
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
#pragma GCC unroll 2
      for (int p = 0; p < kTogether; ++p) a[p][i] = V::set1(xc[i * blocks + b]);
    }
#pragma GCC unroll 8
    for (int t = 0; t < 8; ++t) {
      if constexpr (R <= 3) src.prefetch(b, part0, t);
      I w[kTogether];
#pragma GCC unroll 2
      for (int p = 0; p < kTogether; ++p) w[p] = src.w(b, part0 + p, t);
#pragma GCC unroll 8
      for (int i = 0; i < R; ++i) {
        const I xv = broadcast_i32<V>(xb + i * k + 4 * t);
#pragma GCC unroll 2
        for (int p = 0; p < kTogether; ++p) a[p][i] = q8_0_dot<V>(a[p][i], w[p], xv);
      }
    }
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
#pragma GCC unroll 2
      for (int p = 0; p < kTogether; ++p) {
        V::store(s + few_at<V, R>(part0 + p, i, blocks, b), a[p][i]);
      }
    }
  }
}

// One x row's Q8_0 combine on the W rows' lanes: block b's S_b at s + kLanes·b, the rows' scales
// d_of(b) (f32); the `lanes` W rows' y stored at `y`. Lane l = b mod 8 of every row in acc[l],
// adding (dw_b·dx_b)·f32(S_b) in increasing b, then the tree across the 8: the shared order
// (matmul_int8.h), bitwise rows_blocks' y.
template <class V, class Scales>
void q8_0_combine_lanes(Scales d_of, int64_t blocks, const float* dx, const int32_t* s, float* y,
                        int64_t lanes, bool accumulate) {
  using F = typename V::F;
  F acc[8];
#pragma GCC unroll 8
  for (int l = 0; l < 8; ++l) acc[l] = V::fzero();
  for (int64_t b0 = 0; b0 < blocks; b0 += 8) {
#pragma GCC unroll 8
    for (int l = 0; l < 8; ++l) {  // lane l: block b0 + l
      const int64_t b = b0 + l;
      if (b >= blocks) break;
      const F t = V::fmul(V::fmul(d_of(b), V::fset1(dx[b])), V::cvt(V::load(s + V::kLanes * b)));
      acc[l] = V::fadd(acc[l], t);
    }
  }
  V::store_rows(y, tree8_rows<V>(acc), lanes, accumulate);
}

// R x rows from r0 against the W rows src reads (from j0; `lanes` of each part stored): dots, then
// each part's and row's combine.
template <class V, int R, class Src>
void q8_0_rows_of(const Problem& p, const QuantizedX& x, const Src& src, const int32_t* xc,
                  int32_t* s, int64_t r0, int64_t j0, int64_t lanes) {
  const int64_t blocks = p.k / kQ8_0BlockWeights;
  q8_0_dots<V, R>(src, blocks, x.q.data() + r0 * p.k, p.k, xc + r0 * blocks, s);
  for (int64_t part = 0; part < Src::kParts; ++part) {
    for (int64_t i = 0; i < R; ++i) {
      q8_0_combine_lanes<V>([&src, part](int64_t b) { return src.d(b, part); }, blocks,
                            x.d.data() + (r0 + i) * x.d_stride,
                            s + few_at<V, R>(part, i, blocks, 0),
                            p.y + (r0 + i) * p.ldy + j0 + V::kLanes * part, lanes, p.accumulate);
    }
  }
}

// Every x row's -128·Σ q over each of `blocks` blocks (q8_0_x_starts), or 0 where kQ8_0Signed,
// at xc + row·blocks.
template <class V>
void q8_0_starts(const QuantizedX& x, int64_t rows, int64_t blocks, int32_t* xc) {
  if constexpr (V::kQ8_0Signed) {
    std::fill(xc, xc + rows * blocks, 0);
  } else {
    q8_0_x_starts(x.q.data(), rows * blocks, xc);
  }
}

// The tile's blocks from W rows interleaved 16 at a time (Q8_0ChunkSrc), lanes from lane0: loads
// of the chunks instead of rows and transposes.
template <class V>
void repack_q8_0_interleaved(Q80Tile<V>* tile, const Q8_0ChunkSrc<V>& src, int64_t lane0) {
  const int64_t part = lane0 / V::kLanes;
  for (int64_t b = 0; b < src.blocks; ++b) {
#pragma GCC unroll 8
    for (int t = 0; t < 8; ++t) tile[b].w[t] = src.w(b, part, t);
    tile[b].d = src.d(b, part);
  }
}

// kInterleaved: W rows interleaved 16 at a time (task::DataType::kQ8_0_R16), each tile's rows
// repacked by repack_q8_0_interleaved, and the next group prefetched into L2 at a group's start
// (its first tile's repack reads every line of it; into L1, as the plain tiles take their next
// rows, measured slower: docs/design/quantized_matmul.md, "Q8_0 rows interleaved").
template <class V, bool kInterleaved = false>
void rows_q8_0_tiles(const Problem& p, const QuantizedX& x) {
  const int64_t blocks = p.k / kQ8_0BlockWeights, row_bytes = blocks * kQ8_0BlockBytes;
  const auto* w = static_cast<const uint8_t*>(p.w);
  Q80Tile<V>* tile = thread_scratch<Q80Tile<V>, struct Q8_0Tiles>(static_cast<size_t>(blocks));
  int32_t* s = thread_scratch<int32_t, struct Q8_0TilesInts>(
      static_cast<size_t>((8 * V::kLanes + p.rows) * blocks));
  int32_t* xc = s + 8 * V::kLanes * blocks;
  q8_0_starts<V>(x, p.rows, blocks, xc);
  const int64_t end = prefetch_bytes(p, row_bytes);
  for (int64_t j0 = 0; j0 < p.n; j0 += V::kLanes) {
    const int64_t lanes = p.n - j0 < V::kLanes ? p.n - j0 : V::kLanes;
    if constexpr (kInterleaved) {
      const uint8_t* g = w + j0 / kGroupRows * kGroupRows * row_bytes;
      if (j0 % kGroupRows == 0) {
        prefetch_span<kIntoL2>(w, j0 + kGroupRows, kGroupRows, row_bytes, end);
      }
      repack_q8_0_interleaved(tile, Q8_0ChunkSrc<V>{g, blocks}, j0 % kGroupRows);
    } else {  // the next tile's rows arrive while this one meets the x rows
      prefetch_span<kIntoL1>(w, j0 + V::kLanes, V::kLanes, row_bytes, end);
      repack_q8_0(tile, w + j0 * row_bytes, row_bytes, lanes, blocks);
    }
    by_row_runs(p.rows, [&]<int R>(int64_t r0) {
      q8_0_rows_of<V, R>(p, x, Q8_0TileSrc<V>{tile}, xc, s, r0, j0, lanes);
    });
  }
}

// The groups of 16 W rows of rows_q8_0_interleaved: 3 x rows in one pass (each line read once
// for the three: a 2-row and a 1-row pass took 9-11% longer in a batch-3 Q8_0 decode step on Zen
// 5), other counts as by_row_runs takes them, through Q8_0ChunkSrc<V, true>; or, without line
// prefetches (Q8_0ChunkSrc<V, false>), 1 or 2 x rows.
template <class V, bool kPrefetch>
void q8_0_interleaved_groups(const Problem& p, const QuantizedX& x, const int32_t* xc, int32_t* s) {
  const int64_t blocks = p.k / kQ8_0BlockWeights, row_bytes = blocks * kQ8_0BlockBytes;
  const auto* w = static_cast<const uint8_t*>(p.w);
  const int64_t end = prefetch_bytes(p, row_bytes);
  for (int64_t j0 = 0; j0 < p.n; j0 += kGroupRows) {
    const Q8_0ChunkSrc<V, kPrefetch> src{w + j0 * row_bytes, blocks};
    if (p.rows == 1) {
      q8_0_rows_of<V, 1>(p, x, src, xc, s, 0, j0, V::kLanes);
    } else if (p.rows == 2) {
      q8_0_rows_of<V, 2>(p, x, src, xc, s, 0, j0, V::kLanes);
    } else if constexpr (kPrefetch) {  // without: 1 or 2 x rows only (rows_q8_0_interleaved)
      prefetch_span<kIntoL1>(w, j0 + kGroupRows, kGroupRows, row_bytes, end);
      if (p.rows == 3) {
        q8_0_rows_of<V, 3>(p, x, src, xc, s, 0, j0, V::kLanes);
      } else {
        by_row_runs(p.rows, [&]<int R>(int64_t r0) {
          q8_0_rows_of<V, R>(p, x, src, xc, s, r0, j0, V::kLanes);
        });
      }
    }
  }
}

// ---- Q8_0 over interleaved W (task::DataType::kQ8_0_R16, Q8_0ChunkSrc): the tiles' dots and
// combine (q8_0_dots, q8_0_combine_lanes) straight from the group's chunks, no repack: the block
// sums are the same exact integers, the y the same bits. 3 x rows at once, other counts 8, 4, 2 or
// 1 at a time, a group at a time (it stays in L1 or L2 across them); on ymm a line's two parts
// together under 4 x rows (q8_0_dots). Under 4 x rows a line is requested into L2 twice, 16 and 10
// KiB ahead of its reads (prefetch_chunk), except at 1 and 2 on AMD family 1Ah
// (base::amd_cpu_family: none there), from 3 on the next group into L1 at a group's start. On ymm
// from 4 x rows on the tiles over the same rows (rows_q8_0_tiles<V, true>): the loop here measured
// slower there at 16 and 64 x rows, the tiles as fast as over plain rows
// (docs/design/quantized_matmul.md, "Q8_0 rows interleaved").
template <class V>
void rows_q8_0_interleaved(const Problem& p, const QuantizedX& x) {
  if constexpr (kHalves < V >> 1) {
    if (p.rows >= V::kMinRowsQ8_0) return rows_q8_0_tiles<V, true>(p, x);
  }
  const int64_t blocks = p.k / kQ8_0BlockWeights;
  int32_t* s = thread_scratch<int32_t, struct Q8_0InterleavedInts>(
      static_cast<size_t>((8 * kGroupRows + p.rows) * blocks));
  int32_t* xc = s + 8 * kGroupRows * blocks;
  q8_0_starts<V>(x, p.rows, blocks, xc);
  if (p.rows <= 2 && base::amd_cpu_family() == 0x1a) {
    return q8_0_interleaved_groups<V, false>(p, x, xc, s);
  }
  q8_0_interleaved_groups<V, true>(p, x, xc, s);
}

template <class Dot>
void rows_x86(const Problem& p, const QuantizedX& x) {
  if (p.interleaved) return rows_interleaved<Ymm<Dot>>(p, x);
  switch (p.wt) {
    case WeightType::kQ8_0:
      if (p.rows >= Ymm<Dot>::kMinRowsQ8_0) return rows_q8_0_tiles<Ymm<Dot>>(p, x);
      return rows_blocks<Dot, false>(p, x);
    case WeightType::kQ4_0:
      return rows_blocks<Dot, true>(p, x);
    case WeightType::kQ4_K:
      if (p.rows >= Ymm<Dot>::kMinRowsQ4K) return rows_tiles<Ymm<Dot>, Q4KTile>(p, x);
      if (p.rows == 1)
        return rows_super_one<SuperKernels256<Dot>, WeightType::kQ4_K>(p, x, x.q.data());
      return rows_super<SuperKernels256<Dot>, WeightType::kQ4_K>(p, x, x.q.data());
    case WeightType::kQ6_K:
      if (p.rows >= Ymm<Dot>::kMinRowsQ6K) return rows_tiles<Ymm<Dot>, Q6KTile>(p, x);
      if (p.rows == 1)
        return rows_super_one<SuperKernels256<Dot>, WeightType::kQ6_K>(p, x, x.q.data());
      return rows_super<SuperKernels256<Dot>, WeightType::kQ6_K>(p, x, x.q.data());
    default:
      return;
  }
}

// ---- The quantizers of x (matmul_int8.h), 8 lanes at a time, bitwise the shared ones: max of
// |x| (exact), vcvtps2ph's round to nearest even (as the shared float_to_half), the same division,
// x·id rounded once and converted by vcvtps2dq in the default rounding mode (nearest, ties to
// even, as nearest_q). A block whose largest |x| is below 2^-100 or not finite, where id or x·id
// could leave the range nearest_q handles alike, takes the shared scalar code.

inline bool vector_safe(float amax) { return amax >= 0x1p-100f && amax <= 0x1p100f; }

inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}

// 32 floats times `scale`, rounded to nearest even, as 32 int8 (every value within ±127.x here).
inline void round_store32(const float* x, __m256 scale, int8_t* q) {
  __m256i v[4];
  for (int i = 0; i < 4; ++i)
    v[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * i), scale));
  const __m256i p16 =
      _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_permutevar8x32_epi32(p16, order));
}

// max |x| over the `vectors` * 8 floats from `xb` (exact: max is order-free).
inline float abs_max(const float* xb, int vectors) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 m = _mm256_and_ps(_mm256_loadu_ps(xb), abs_mask);
  for (int i = 1; i < vectors; ++i)
    m = _mm256_max_ps(m, _mm256_and_ps(_mm256_loadu_ps(xb + 8 * i), abs_mask));
  return hmax8(m);
}

void quantize_q8_0_x86(const float* x, int64_t k, int8_t* q, float* d) {
  for (int64_t b = 0; b < k / kQ8_0BlockWeights; ++b) {
    const float* xb = x + 32 * b;
    const float amax = abs_max(xb, 4);
    if (!vector_safe(amax)) {
      quantize_x_q8_0(xb, kQ8_0BlockWeights, q + 32 * b, d + b);
      continue;
    }
    d[b] = _cvtsh_ss(_cvtss_sh(amax / 127.f, _MM_FROUND_TO_NEAREST_INT));
    round_store32(xb, _mm256_set1_ps(127.f / amax), q + 32 * b);
  }
}

void quantize_q8_k_x86(const float* x, int64_t k, int8_t* q, float* d, int16_t* bsums) {
  for (int64_t b = 0; b < k / kSuperBlockWeights; ++b) {
    const float* xb = x + 256 * b;
    const float amax = abs_max(xb, 32);
    if (!vector_safe(amax)) {
      quantize_x_q8_k(xb, kSuperBlockWeights, q + 256 * b, d + b, bsums + 16 * b);
      continue;
    }
    const __m256 target = _mm256_set1_ps(amax);
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    float max = 0;  // the first x of largest magnitude, its sign kept
    for (int i = 0; i < 32; ++i) {
      const __m256 v = _mm256_loadu_ps(xb + 8 * i);
      const int hit =
          _mm256_movemask_ps(_mm256_cmp_ps(_mm256_and_ps(v, abs_mask), target, _CMP_EQ_OQ));
      if (hit != 0) {
        max = xb[8 * i + __builtin_ctz(static_cast<unsigned>(hit))];
        break;
      }
    }
    const float iscale = -127.f / max;
    int8_t* qb = q + 256 * b;
    for (int c = 0; c < 8; ++c) round_store32(xb + 32 * c, _mm256_set1_ps(iscale), qb + 32 * c);
    q8_k_bsums(qb, bsums + 16 * b);
    d[b] = 1 / iscale;
  }
}

template <class Dot>
Int8Dots x86_dots() {
  Int8Dots d{&dots_q8_0<Dot>, &dots_q4_0<Dot>,    &dots_q4_k<Dot>,   &dots_q6_k<Dot>,
             &rows_x86<Dot>,  &quantize_q8_0_x86, &quantize_q8_k_x86};
  d.interleaved = true;
  return d;
}

}  // namespace
}  // namespace simpler::llm::matmul_detail
