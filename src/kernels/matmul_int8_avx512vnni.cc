// The AVX-512 VNNI target of the int8-activation matmul (matmul_int8.h, matmul_int8_x86.h):
// vpdpbusd on 256-bit vectors (EVEX, AVX512_VL), and 512-bit kernels (below): Q8_0 against one x
// row, Q4_K and Q6_K super-blocks, and the repacked tiles of 16 W rows. Built with -mavx2 -mfma
// -mf16c -mavx512f -mavx512bw -mavx512vl -mavx512vnni; runs only where avx512vnni_available().

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
  static constexpr bool kUnsignedFullRange = true;
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

// The 8 binary16 scales of 8 Q8_0 blocks from `blk` (272 bytes; the scales at bytes 34i) as f32:
// the bytes [0, 128) and [136, 264) from blk as 4 zmm, words 0, 17, 34, 51 of each pair picked by
// one vpermt2w (the scale conversions one at a time were 32 instructions per 8 blocks).
inline __m256 q8_0_scales8(const uint8_t* blk) {
  alignas(64) static constexpr int16_t kAt[32] = {0, 17, 34, 51};
  const __m512i at = _mm512_load_si512(kAt);
  const __m512i lo =
      _mm512_permutex2var_epi16(_mm512_loadu_si512(blk), at, _mm512_loadu_si512(blk + 64));
  const __m512i hi =
      _mm512_permutex2var_epi16(_mm512_loadu_si512(blk + 136), at, _mm512_loadu_si512(blk + 200));
  return _mm256_cvtph_ps(
      _mm_unpacklo_epi64(_mm512_castsi512_si128(lo), _mm512_castsi512_si128(hi)));
}

// Q8_0 against one x row: 8 blocks a step as 4 zmm of two blocks each, the weights taken unsigned
// (w + 128: the sign bit flipped) against x's q by vpdpbusd, the 8 block sums by reduce_pairs,
// less 128·Σx of each block (q8_0_x_starts, once per call), the scales by q8_0_scales8; then
// rows_blocks' combine; a last partial group of 8 as rows_blocks takes it. The same exact block
// sums, so the same bits.
void rows_q8_0_one(const Problem& p, const QuantizedX& x) {
  const int64_t blocks = p.k / kQ8_0BlockWeights, full = blocks / 8;
  const int tail = static_cast<int>(blocks % 8);
  const int64_t row_bytes = blocks * kQ8_0BlockBytes;
  float dw[8] = {};
  int32_t* xc = thread_scratch<int32_t, struct Q8_0XStarts>(static_cast<size_t>(8 * full));
  q8_0_x_starts(x.q.data(), 8 * full, xc);
  const auto* w = static_cast<const uint8_t*>(p.w);
  const int8_t* xq = x.q.data();
  const float* xd = x.d.data();
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t j = 0; j < p.n; ++j) {
    const uint8_t* wr = w + j * row_bytes;
    prefetch_ahead(w, j * row_bytes, row_bytes, prefetch_bytes(p, row_bytes));
    __m256 acc = _mm256_setzero_ps();
    for (int64_t g = 0; g < full; ++g) {
      const uint8_t* blk = wr + 8 * g * kQ8_0BlockBytes;
      __m512i v[4];
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) {
        const uint8_t* q = blk + 2 * i * kQ8_0BlockBytes + 2;
        const __m512i wv =
            _mm512_inserti64x4(_mm512_castsi256_si512(load32(q)), load32(q + kQ8_0BlockBytes), 1);
        v[i] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_xor_si512(wv, flip),
                                   _mm512_loadu_si512(xq + 256 * g + 64 * i));
      }
      const __m256i s = _mm256_add_epi32(reduce_pairs(v), load32(&xc[8 * g]));
      acc = combine_step(acc, q8_0_scales8(blk), _mm256_loadu_ps(xd + 8 * g), s);
    }
    if (tail != 0) {
      const uint8_t* blk = wr + 8 * full * kQ8_0BlockBytes;
      for (int b = 0; b < tail; ++b) dw[b] = half_at(blk + b * kQ8_0BlockBytes);
      const __m256i s = block_sums8<Avx512VnniDot, false, false>(blk, xq + 256 * full, tail);
      acc = combine_step(acc, _mm256_loadu_ps(dw), _mm256_loadu_ps(xd + 8 * full), s);
    }
    store_y(p, 0, j, tree8(acc));
  }
}

// ---- Q4_K and Q6_K on 512-bit vectors (SuperKernels512 below): a super-block's 256 weights as 4
// zmm of 64 unsigned bytes, each against 64 bytes of x by vpmaddubsw (i16 pair sums: no
// saturation, as matmul_int8_x86.h's) and vpdpwssd with the scales of its i16 lanes, so per x row
// 4 of each where the 256-bit kernels take 8. The integer sums are the same exact values.

// The i16 index vectors of the kernels below, as constants (built in registers per super-block,
// their mask blends cost as much as a super-block's dot): i16_index(a, b), 32 i16, a in lanes
// 0-15 and b in lanes 16-31 (lane l of a super-block's 512-bit vector v holds the pair sum of its
// weights 64v + 2l and 64v + 2l + 1); q6_k_scale_index(v), Q6_K's vector v: lane l is in group
// 4v + l / 8.
struct I16Indexes {
  alignas(64) int16_t pairs[8][8][32];  // [a][b]
  alignas(64) int16_t q6_k[4][32];
  constexpr I16Indexes() : pairs(), q6_k() {
    for (int a = 0; a < 8; ++a) {
      for (int b = 0; b < 8; ++b) {
        for (int l = 0; l < 32; ++l) pairs[a][b][l] = static_cast<int16_t>(l < 16 ? a : b);
      }
    }
    for (int v = 0; v < 4; ++v) {
      for (int l = 0; l < 32; ++l) q6_k[v][l] = static_cast<int16_t>(4 * v + l / 8);
    }
  }
};
constexpr I16Indexes kI16Indexes;

inline __m512i i16_index(int a, int b) { return _mm512_load_si512(kI16Indexes.pairs[a][b]); }

// (a & 0x0f) | b in every byte: one vpternlogd (A & C) | B.
inline __m512i low_nibbles_or512(__m512i a, __m512i b) {
  return _mm512_ternarylogic_epi32(a, b, _mm512_set1_epi8(0x0f), 0xEC);
}

// A Q6_K super-block's 256 6-bit values (0..63, ggml's block_q6_K) in 4 zmm: vector 2h the low
// nibbles of ql[64h, +64) with bits 0-1 and 2-3 of qh[32h, +32) above them, vector 2h + 1 the
// high nibbles with bits 4-5 and 6-7 (weights 64v to 64v + 63). The super-block kernel dots
// them; the repacked tile transposes them over its rows. qh's two bits go straight to bits 4-5 of
// their byte (left by 4 or 2 for bits 0-1 and 2-3, right by 0 or 2 for bits 4-5 and 6-7; what a
// 16-bit shift carries across the byte is masked off by 0x30) and join the nibble in one
// vpternlogd, (nibble & 0x0f) | top.
inline void q6_k_values(const uint8_t* blk, __m512i w[4]) {
  const __m512i m30 = _mm512_set1_epi8(0x30);
  const __m512i left_lo = i16_index(4, 2), right_hi = i16_index(0, 2);
#pragma GCC unroll 2
  for (int h = 0; h < 2; ++h) {
    const __m512i ql = _mm512_loadu_si512(blk + 64 * h);
    const __m512i qh = _mm512_broadcast_i64x4(load32(blk + 128 + 32 * h));
    const __m512i top_lo = _mm512_and_si512(_mm512_sllv_epi16(qh, left_lo), m30);
    const __m512i top_hi = _mm512_and_si512(_mm512_srlv_epi16(qh, right_hi), m30);
    w[2 * h] = low_nibbles_or512(ql, top_lo);
    w[2 * h + 1] = low_nibbles_or512(_mm512_srli_epi16(ql, 4), top_hi);
  }
}
inline __m512i q6_k_scale_index(int v) { return _mm512_load_si512(kI16Indexes.q6_k[v]); }

// A zmm's two 256-bit halves added: 8 i32 lanes whose total is the zmm's.
inline __m256i fold(__m512i v) {
  return _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
}

// x's q for SuperKernels512::q4_k: per super-block its 32-byte chunks (sub-blocks) in the order
// 0, 2, 1, 3, 4, 6, 5, 7, the sub-blocks of the low nibbles of qs[0, 64), of their high nibbles,
// then likewise for qs[64, 128).
std::vector<int8_t> permute_for_q4_k(const QuantizedX& x, int64_t rows, int64_t k) {
  std::vector<int8_t> out(static_cast<size_t>(rows * k));
  static constexpr int kOrder[8] = {0, 2, 1, 3, 4, 6, 5, 7};
  for (int64_t at = 0; at < rows * k; at += kSuperBlockWeights) {
    for (int c = 0; c < 8; ++c) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(&out[at + 32 * c]),
                          load32(x.q.data() + at + 32 * kOrder[c]));
    }
  }
  return out;
}

struct SuperKernels512 {
  // One x row's 256 int8 against a super-block's 4 vectors of unsigned weights: per 16-bit pair,
  // (w·x summed by vpmaddubsw) times its scale, summed into 16 int32 lanes by vpdpwssd.
  __attribute__((always_inline)) static __m512i superblock_dot(const __m512i (&w)[4],
                                                               const __m512i (&scales)[4],
                                                               const int8_t* xq) {
    __m512i acc = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) {
      acc = _mm512_dpwssd_epi32(acc, _mm512_maddubs_epi16(w[v], _mm512_loadu_si512(xq + 64 * v)),
                                scales[v]);
    }
    return acc;
  }

  // A Q4_K super-block's 4 vectors of unsigned weights: vector v = the low (v even) or high (v
  // odd) nibbles of qs[64·(v / 2), +64), sub-blocks 4·(v / 2) + (v % 2) and that + 2.
  __attribute__((always_inline)) static void q4_k_weights(const uint8_t* blk, __m512i (&w)[4]) {
    const __m512i m4 = _mm512_set1_epi8(15);
    const __m512i q0 = _mm512_loadu_si512(blk + 16), q1 = _mm512_loadu_si512(blk + 80);
    w[0] = _mm512_and_si512(q0, m4);
    w[1] = _mm512_and_si512(_mm512_srli_epi16(q0, 4), m4);
    w[2] = _mm512_and_si512(q1, m4);
    w[3] = _mm512_and_si512(_mm512_srli_epi16(q1, 4), m4);
  }

  // The i16 scales of q4_k_weights' vectors from q4_k_scales_mins' widened bytes sm.
  __attribute__((always_inline)) static void q4_k_scales(__m256i sm, __m512i (&scales)[4]) {
    const __m512i smz = _mm512_castsi256_si512(sm);
    scales[0] = _mm512_permutexvar_epi16(i16_index(0, 2), smz);
    scales[1] = _mm512_permutexvar_epi16(i16_index(1, 3), smz);
    scales[2] = _mm512_permutexvar_epi16(i16_index(4, 6), smz);
    scales[3] = _mm512_permutexvar_epi16(i16_index(5, 7), smz);
  }

  // A super-block's weights and scales; returns q4_k_scales_mins' widened scale and mins bytes.
  __attribute__((always_inline)) static __m256i q4_k_unpack(const uint8_t* blk, __m512i (&w)[4],
                                                            __m512i (&scales)[4]) {
    const __m256i sm = q4_k_scales_mins(blk + 4);
    q4_k_scales(sm, scales);
    q4_k_weights(blk, w);
    return sm;
  }

  // Q4_K: q4_k_unpack's vectors against x permuted (permute_for_q4_k); the mins as the 256-bit
  // kernel's.
  template <int R>
  static void q4_k(const uint8_t* blk, const XTile& t, int64_t b, __m256i (*sv)[8],
                   __m256i (*mv)[8]) {
    __m512i w[4], scales[4];
    const __m256i sm = q4_k_unpack(blk, w, scales);
    const __m256i mins = _mm256_cvtepu16_epi32(_mm256_extracti128_si256(sm, 1));
    const __m256i mins2 = _mm256_or_si256(mins, _mm256_slli_epi32(mins, 16));
    for (int i = 0; i < R; ++i) {
      const __m512i acc = superblock_dot(w, scales, t.q + i * t.k + 256 * b);
      sv[i][b % 8] = fold(acc);
      mv[i][b % 8] = _mm256_dpwssd_epi32(_mm256_setzero_si256(),
                                         load32(t.bsums + i * (t.k / 16) + 16 * b), mins2);
    }
  }

  // rows_super_one's Q4_K S (q4_k_one_n): the super-block at blk against x's q at xq, sm its
  // widened scale and mins bytes, as q4_k's. With q4_k_one_n's mins sum, fewer instructions than
  // q4_k<1> (on Intel, whose 512-bit vector code has two ports, the instruction count is the
  // loop's bound).
  __attribute__((always_inline)) static __m256i q4_k_one_s(const uint8_t* blk, __m256i sm,
                                                           const int8_t* xq) {
    __m512i w[4], scales[4];
    q4_k_scales(sm, scales);
    q4_k_weights(blk, w);
    return fold(superblock_dot(w, scales, xq));
  }

  // Q6_K: the super-block's values as q6_k_values decodes them (vector v: weights 64v to 64v + 63,
  // groups 4v to 4v + 3) against x as it is; the - 32 as the 256-bit kernel's.
  template <int R>
  static void q6_k(const uint8_t* blk, const XTile& t, int64_t b, __m256i (*sv)[8],
                   __m256i (*)[8]) {
    const __m256i sc =
        _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192)));
    const __m512i scz = _mm512_castsi256_si512(sc);
    __m512i w[4], scales[4];
    q6_k_values(blk, w);
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) {
      scales[v] = _mm512_permutexvar_epi16(q6_k_scale_index(v), scz);
    }
    for (int i = 0; i < R; ++i) {
      const __m512i acc = superblock_dot(w, scales, t.q + i * t.k + 256 * b);
      const __m256i bs = load32(t.bsums + i * (t.k / 16) + 16 * b);
      sv[i][b % 8] = _mm256_sub_epi32(fold(acc), _mm256_slli_epi32(_mm256_madd_epi16(bs, sc), 5));
    }
  }
};

// 512-bit vectors for rows_tiles (matmul_int8_x86.h): 16 W rows a tile.
struct Zmm {
  using I = __m512i;
  using F = __m512;
  static constexpr int kLanes = 16;
  static constexpr int64_t kMinRowsQ4K = 4, kMinRowsQ6K = 8, kMinRowsQ8_0 = 2;
  static constexpr bool kQ8_0Signed = false;
  static constexpr bool kUnsignedFullRange = true;
  static constexpr bool kScaledDot = false;
  static I zero() { return _mm512_setzero_si512(); }
  static I load(const void* p) { return _mm512_loadu_si512(p); }
  static void store(void* p, I v) { _mm512_storeu_si512(p, v); }
  static I set1(int32_t v) { return _mm512_set1_epi32(v); }
  static I and_(I a, I b) { return _mm512_and_si512(a, b); }
  static I or_(I a, I b) { return _mm512_or_si512(a, b); }
  static I xor_(I a, I b) { return _mm512_xor_si512(a, b); }
  static I low_nibbles_or(I a, I b) { return low_nibbles_or512(a, b); }
  static I srli(I a, int n) { return _mm512_srli_epi32(a, static_cast<unsigned>(n)); }
  static I slli(I a, int n) { return _mm512_slli_epi32(a, static_cast<unsigned>(n)); }
  static I srai(I a, int n) { return _mm512_srai_epi32(a, static_cast<unsigned>(n)); }
  static I srai16(I a, int n) { return _mm512_srai_epi16(a, static_cast<unsigned>(n)); }
  // As Ymm::bytes_in_dwords (matmul_int8_x86.h): vpshufb within each i32 lane.
  static I bytes_in_dwords(I v, uint32_t pattern) {
    const I lane_at =
        _mm512_broadcast_i32x4(_mm_setr_epi8(0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12));
    return _mm512_shuffle_epi8(
        v, _mm512_add_epi8(_mm512_set1_epi32(static_cast<int32_t>(pattern)), lane_at));
  }
  static I add(I a, I b) { return _mm512_add_epi32(a, b); }
  static I sub(I a, I b) { return _mm512_sub_epi32(a, b); }
  static I mullo(I a, I b) { return _mm512_mullo_epi32(a, b); }
  static I dot(I acc, I u, I s) { return _mm512_dpbusd_epi32(acc, u, s); }
  static I madd(I acc, I a, I b) { return _mm512_dpwssd_epi32(acc, a, b); }
  static I gather(I rows, const uint8_t* at) { return _mm512_i32gather_epi32(rows, at, 1); }
  static F half_lo(I v) { return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(v)); }
  static F halves(const void* p) { return _mm512_cvtph_ps(load32(p)); }
  static F fzero() { return _mm512_setzero_ps(); }
  static F fset1(float v) { return _mm512_set1_ps(v); }
  static F fadd(F a, F b) { return _mm512_add_ps(a, b); }
  static F fsub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F fmul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F cvt(I v) { return _mm512_cvtepi32_ps(v); }
  // y[0, lanes) = v (or y + v).
  static void store_rows(float* y, F v, int64_t lanes, bool accumulate) {
    const auto mask = static_cast<__mmask16>((1u << lanes) - 1);
    if (accumulate) v = _mm512_add_ps(_mm512_maskz_loadu_ps(mask, y), v);
    _mm512_mask_storeu_ps(y, mask, v);
  }
};

// in[r] (16 vectors of 16 dwords) transposed: out[t] lane r = dword t of in[r]. Two levels of
// unpacks within 128-bit lanes (per group of 4 rows, the dwords 4L + c of its 4 rows in lane L of
// vector c), then two of 128-bit lane shuffles.
inline void transpose16(const __m512i* in, __m512i* out) {
  __m512i a[16], g4[4][4];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {
    a[2 * i] = _mm512_unpacklo_epi32(in[2 * i], in[2 * i + 1]);
    a[2 * i + 1] = _mm512_unpackhi_epi32(in[2 * i], in[2 * i + 1]);
  }
#pragma GCC unroll 4
  for (int g = 0; g < 4; ++g) {
    const __m512i* t = a + 4 * g;
    g4[g][0] = _mm512_unpacklo_epi64(t[0], t[2]);
    g4[g][1] = _mm512_unpackhi_epi64(t[0], t[2]);
    g4[g][2] = _mm512_unpacklo_epi64(t[1], t[3]);
    g4[g][3] = _mm512_unpackhi_epi64(t[1], t[3]);
  }
#pragma GCC unroll 4
  for (int c = 0; c < 4; ++c) {  // lanes [dword c, 4 + c, 8 + c, 12 + c] of each group of rows
    const __m512i t0 = _mm512_shuffle_i32x4(g4[0][c], g4[1][c], 0x88);
    const __m512i t1 = _mm512_shuffle_i32x4(g4[0][c], g4[1][c], 0xdd);
    const __m512i t2 = _mm512_shuffle_i32x4(g4[2][c], g4[3][c], 0x88);
    const __m512i t3 = _mm512_shuffle_i32x4(g4[2][c], g4[3][c], 0xdd);
    out[c] = _mm512_shuffle_i32x4(t0, t2, 0x88);
    out[8 + c] = _mm512_shuffle_i32x4(t0, t2, 0xdd);
    out[4 + c] = _mm512_shuffle_i32x4(t1, t3, 0x88);
    out[12 + c] = _mm512_shuffle_i32x4(t1, t3, 0xdd);
  }
}

// Q6_K's tile on zmm without the 48 gathers of its weights: each of the 16 rows' super-block
// decoded as SuperKernels512::q6_k decodes it (4 zmm, weights 64v..64v + 63 as unsigned 6-bit
// values), then vector v of the 16 rows transposed into the tile's w[16v, +16) (lane r W row r,
// dword t of it weights 4t..4t + 3: the gathers' layout); the scales and d still by gathers.
void repack_tile(Q6KTile<Zmm>& t, const uint8_t* blk, __m512i rows, int64_t row_bytes,
                 int64_t lanes) {
  __m512i v[4][16];
  for (int r = 0; r < 16; ++r) {
    __m512i w[4];
    q6_k_values(blk + (r < lanes ? r : lanes - 1) * row_bytes, w);
    for (int q = 0; q < 4; ++q) v[q][r] = w[q];
  }
  for (int q = 0; q < 4; ++q) transpose16(v[q], t.w + 16 * q);
  t.repack_scales(GatherRows<Zmm>{blk, rows});
}

// Q4_K's tile on zmm without the 32 gathers of its weights: each row's qs[64h, +64) as one zmm,
// its low and high nibbles transposed over the 16 rows: dword 8c' + t of half h's nibbles is
// dword t of qs[32c, +32), c = 2h + c', that is w[16c + t] (low) and w[16c + 8 + t] (high).
void repack_tile(Q4KTile<Zmm>& t, const uint8_t* blk, __m512i rows, int64_t row_bytes,
                 int64_t lanes) {
  const __m512i m4 = _mm512_set1_epi8(15);
  __m512i lo[2][16], hi[2][16];
  for (int r = 0; r < 16; ++r) {
    const uint8_t* b = blk + (r < lanes ? r : lanes - 1) * row_bytes + 16;
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const __m512i q = _mm512_loadu_si512(b + 64 * h);
      lo[h][r] = _mm512_and_si512(q, m4);
      hi[h][r] = _mm512_and_si512(_mm512_srli_epi16(q, 4), m4);
    }
  }
  __m512i out[16];
  for (int h = 0; h < 2; ++h) {
    for (int nib = 0; nib < 2; ++nib) {
      transpose16(nib == 0 ? lo[h] : hi[h], out);
      for (int i = 0; i < 16; ++i) {  // c = 2h + i / 8, t = i % 8
        t.w[16 * (2 * h + i / 8) + 8 * nib + i % 8] = out[i];
      }
    }
  }
  t.repack_scales(GatherRows<Zmm>{blk, rows});
}

// Q8_0's tile on zmm (rows_q8_0_tiles): blocks b and b + 1 of each of the 16 rows as one zmm
// (zeros past the last block), the sign bits flipped, transposed over the rows: dword t < 8 is
// block b's w[t], dword 8 + t block b + 1's; the scales by one gather a block.
void repack_q8_0(Q80Tile<Zmm>* tile, const uint8_t* w, int64_t row_bytes, int64_t lanes,
                 int64_t blocks) {
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const __m512i rows = tile_rows<Zmm>(row_bytes, lanes);
  for (int64_t b = 0; b < blocks; b += 2) {
    const bool pair = b + 1 < blocks;
    __m512i in[16], out[16];
    for (int r = 0; r < 16; ++r) {
      const uint8_t* q = w + (r < lanes ? r : lanes - 1) * row_bytes + b * kQ8_0BlockBytes + 2;
      const __m256i hi = pair ? load32(q + kQ8_0BlockBytes) : _mm256_setzero_si256();
      in[r] = _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(load32(q)), hi, 1), flip);
    }
    transpose16(in, out);
#pragma GCC unroll 8
    for (int t = 0; t < 8; ++t) tile[b].w[t] = out[t];
    tile[b].d = Zmm::half_lo(Zmm::gather(rows, w + b * kQ8_0BlockBytes));
    if (!pair) break;
#pragma GCC unroll 8
    for (int t = 0; t < 8; ++t) tile[b + 1].w[t] = out[8 + t];
    tile[b + 1].d = Zmm::half_lo(Zmm::gather(rows, w + (b + 1) * kQ8_0BlockBytes));
  }
}

// Whether rows_avx512vnni reads x permuted for SuperKernels512::q4_k (prepare_avx512vnni).
bool reads_permuted_x(const Problem& p) {
  return p.wt == WeightType::kQ4_K && p.rows < Zmm::kMinRowsQ4K && !p.interleaved;
}

void rows_avx512vnni(const Problem& p, const QuantizedX& x) {
  if (p.interleaved) return rows_interleaved<Zmm>(p, x);
  if (p.wt == WeightType::kQ8_0 && p.rows >= Zmm::kMinRowsQ8_0) return rows_q8_0_tiles<Zmm>(p, x);
  if (p.wt == WeightType::kQ8_0) return rows_q8_0_one(p, x);
  if (p.wt == WeightType::kQ4_K && p.rows >= Zmm::kMinRowsQ4K)
    return rows_tiles<Zmm, Q4KTile>(p, x);
  if (p.wt == WeightType::kQ6_K && p.rows >= Zmm::kMinRowsQ6K)
    return rows_tiles<Zmm, Q6KTile>(p, x);
  if (reads_permuted_x(p)) {  // x permuted by prepare_avx512vnni (quantize_int8)
    const int8_t* xq = x.prepared.data();
    if (p.rows == 1) return rows_super_one<SuperKernels512, WeightType::kQ4_K>(p, x, xq);
    return rows_super<SuperKernels512, WeightType::kQ4_K>(p, x, xq);
  }
  if (p.wt == WeightType::kQ6_K) {
    if (p.rows == 1) return rows_super_one<SuperKernels512, WeightType::kQ6_K>(p, x, x.q.data());
    return rows_super<SuperKernels512, WeightType::kQ6_K>(p, x, x.q.data());
  }
  rows_x86<Avx512VnniDot>(p, x);
}

// What rows_avx512vnni reads besides x: for Q4_K under the tiles' row count, x permuted.
void prepare_avx512vnni(const Problem& p, QuantizedX& x) {
  if (reads_permuted_x(p)) x.prepared = permute_for_q4_k(x, p.rows, p.k);
}

}  // namespace

Int8Dots int8_dots_avx512vnni() {
  Int8Dots d = x86_dots<Avx512VnniDot>();
  d.rows = &rows_avx512vnni;
  d.prepare = &prepare_avx512vnni;
  return d;
}

}  // namespace simpler::llm::matmul_detail
