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

// ---- Q4_K and Q6_K on 512-bit vectors (SuperKernels512 below): a super-block's 256 weights as 4
// zmm of 64 unsigned bytes, each against 64 bytes of x by vpmaddubsw (i16 pair sums: no
// saturation, as matmul_int8_x86.h's) and vpdpwssd with the scales of its i16 lanes, so per x row
// 4 of each where the 256-bit kernels take 8. The integer sums are the same exact values.

// 32 i16: a in lanes 0-15, b in lanes 16-31 (lane l of a super-block's 512-bit vector v holds
// the pair sum of its weights 64v + 2l and 64v + 2l + 1).
inline __m512i i16_index(int a, int b) {
  return _mm512_mask_blend_epi16(0xffff0000u, _mm512_set1_epi16(static_cast<int16_t>(a)),
                                 _mm512_set1_epi16(static_cast<int16_t>(b)));
}

// Q6_K's vector v: lane l is in group 4v + l / 8.
inline __m512i q6_k_scale_index(int v) {
  __m512i idx = _mm512_set1_epi16(static_cast<int16_t>(4 * v));
  for (int g = 1; g < 4; ++g) {
    idx = _mm512_mask_blend_epi16(0xffu << (8 * g), idx,
                                  _mm512_set1_epi16(static_cast<int16_t>(4 * v + g)));
  }
  return idx;
}

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

  // Q4_K: vector v = the low (v even) or high (v odd) nibbles of qs[64·(v / 2), +64), sub-blocks
  // 4·(v / 2) + (v % 2) and that + 2, against x permuted (permute_for_q4_k); the mins as the
  // 256-bit kernel's.
  template <int R>
  static void q4_k(const uint8_t* blk, const XTile& t, int64_t b, __m256i (*sv)[8],
                   __m256i (*mv)[8]) {
    const __m256i sm = q4_k_scales_mins(blk + 4);
    const __m512i smz = _mm512_castsi256_si512(sm);
    const __m512i scales[4] = {_mm512_permutexvar_epi16(i16_index(0, 2), smz),
                               _mm512_permutexvar_epi16(i16_index(1, 3), smz),
                               _mm512_permutexvar_epi16(i16_index(4, 6), smz),
                               _mm512_permutexvar_epi16(i16_index(5, 7), smz)};
    const __m512i m4 = _mm512_set1_epi8(15);
    const __m512i q0 = _mm512_loadu_si512(blk + 16), q1 = _mm512_loadu_si512(blk + 80);
    const __m512i w[4] = {_mm512_and_si512(q0, m4), _mm512_and_si512(_mm512_srli_epi16(q0, 4), m4),
                          _mm512_and_si512(q1, m4), _mm512_and_si512(_mm512_srli_epi16(q1, 4), m4)};
    const __m256i mins = _mm256_cvtepu16_epi32(_mm256_extracti128_si256(sm, 1));
    const __m256i mins2 = _mm256_or_si256(mins, _mm256_slli_epi32(mins, 16));
    for (int i = 0; i < R; ++i) {
      const __m512i acc = superblock_dot(w, scales, t.q + i * t.k + 256 * b);
      sv[i][b % 8] = fold(acc);
      mv[i][b % 8] = _mm256_dpwssd_epi32(_mm256_setzero_si256(),
                                         load32(t.bsums + i * (t.k / 16) + 16 * b), mins2);
    }
  }

  // Q6_K: vector 2h = the low nibbles of ql[64h, +64) (runs c = 0, 1 of half h) with bits 0-1 and
  // 2-3 of qh[32h, +32) above them, vector 2h + 1 the high nibbles (runs 2, 3) with bits 4-5 and
  // 6-7: weights 64v to 64v + 63, groups 4v to 4v + 3, against x as it is; the - 32 as the
  // 256-bit kernel's.
  template <int R>
  static void q6_k(const uint8_t* blk, const XTile& t, int64_t b, __m256i (*sv)[8],
                   __m256i (*)[8]) {
    const __m256i sc =
        _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192)));
    const __m512i scz = _mm512_castsi256_si512(sc);
    const __m512i m4 = _mm512_set1_epi8(15), m2 = _mm512_set1_epi8(3);
    const __m512i shift_lo = i16_index(0, 2), shift_hi = i16_index(4, 6);
    __m512i w[4], scales[4];
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const __m512i ql = _mm512_loadu_si512(blk + 64 * h);
      const __m512i qh = _mm512_broadcast_i64x4(load32(blk + 128 + 32 * h));
      const __m512i top_lo = _mm512_and_si512(_mm512_srlv_epi16(qh, shift_lo), m2);
      const __m512i top_hi = _mm512_and_si512(_mm512_srlv_epi16(qh, shift_hi), m2);
      w[2 * h] = _mm512_or_si512(_mm512_and_si512(ql, m4), _mm512_slli_epi16(top_lo, 4));
      w[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), m4),
                                     _mm512_slli_epi16(top_hi, 4));
    }
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

// ---- Q4_K and Q6_K over several x rows (rows_tiles): W taken 16 rows at a time, repacked once
// per call into a buffer that stays in L2 so that zmm lane r is W row r. A sub-block's 32 weights
// (Q4_K) or a group's 16 (Q6_K) then meet x by 8 or 4 vpdpbusd (the unsigned 4 or 6-bit values
// of dword t of each of the 16 rows against x's dword t, broadcast), whose lanes hold that
// sub-block's or group's whole integer sum for each row, and its scale is applied once by one
// vpmulld: one instruction per 64 products where SuperKernels512 takes two (vpmaddubsw, then
// vpdpwssd with per-pair scales). The integer sums are the same exact values (a lane's sub-block
// sum is at most 32·15·127 and Σ_j sc_j·S_j at most 8·63·60960; a group's at most 16·63·127 and
// Σ_g sc_g·S_g at most 16·128·128016), and the combine runs on 16 W rows' lanes in the shared
// order (matmul_int8.h), so the results are bitwise the shared path's.

constexpr int kTileRows = 16;

// At and above this many x rows Q4_K and Q6_K take the repacked tiles (rows_tiles).
constexpr int64_t kTileMinRows = 4;

inline __m512i broadcast_i32(const void* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return _mm512_set1_epi32(v);
}

// Bits [shift, shift + 8) of every i32 lane, as a value 0..255.
inline __m512i byte_of(__m512i v, int shift) {
  return _mm512_and_si512(_mm512_srli_epi32(v, static_cast<unsigned>(shift)),
                          _mm512_set1_epi32(255));
}

// i16 pairs (a | b << 16) of two vectors of values that fit i16.
inline __m512i i16_pairs(__m512i a, __m512i b) {
  return _mm512_or_si512(_mm512_and_si512(a, _mm512_set1_epi32(0xffff)), _mm512_slli_epi32(b, 16));
}

// Lane r: the offset of W row min(r, rows - 1) (`row_bytes` apart): a short tile's last lanes
// repeat its last row, whose results are not stored.
inline __m512i tile_rows(int64_t row_bytes, int64_t rows) {
  alignas(64) int32_t at[kTileRows];
  for (int r = 0; r < kTileRows; ++r) {
    at[r] = static_cast<int32_t>((r < rows ? r : rows - 1) * row_bytes);
  }
  return _mm512_load_si512(at);
}

inline __m512i gather(__m512i rows, const uint8_t* at) {
  return _mm512_i32gather_epi32(rows, at, 1);
}

// One Q4_K super-block of a tile of 16 W rows, lane r row r: w[4j + t] the weights 4t..4t+3 of
// sub-block j as unsigned bytes, sc[j] the sub-block scales as i32, mins[q] the mins
// (m_2q, m_2q+1) as i16 pairs, d and dmin as f32. aux: per x row and super-block 4 i32, x's group
// sums as the pairs the mins meet (q4_k_aux).
struct Q4KTile {
  static constexpr bool kMins = true;
  static constexpr int64_t kBytes = kQ4_KBlockBytes;
  static constexpr int kAux = 4;
  __m512i w[64];
  __m512i sc[8];
  __m512i mins[4];
  __m512 d, dmin;

  // The packed 6-bit fields decoded as q4_k_scales_mins does, lane by lane.
  void repack_scales(const uint8_t* blk, __m512i rows) {
    const __m512i dd = gather(rows, blk);  // d | dmin << 16
    d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dd));
    dmin = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dd, 16)));
    const __m512i a = gather(rows, blk + 4), b = gather(rows, blk + 8), c = gather(rows, blk + 12);
    const __m512i k6 = _mm512_set1_epi8(0x3f), k4 = _mm512_set1_epi8(15), k2 = _mm512_set1_epi8(3);
    const __m512i sc03 = _mm512_and_si512(a, k6), m03 = _mm512_and_si512(b, k6);
    const __m512i sc47 =
        _mm512_or_si512(_mm512_and_si512(c, k4),
                        _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(a, 6), k2), 4));
    const __m512i m47 =
        _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(c, 4), k4),
                        _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(b, 6), k2), 4));
    for (int j = 0; j < 4; ++j) {
      sc[j] = byte_of(sc03, 8 * j);
      sc[j + 4] = byte_of(sc47, 8 * j);
    }
    for (int q = 0; q < 2; ++q) {
      mins[q] = i16_pairs(byte_of(m03, 16 * q), byte_of(m03, 16 * q + 8));
      mins[q + 2] = i16_pairs(byte_of(m47, 16 * q), byte_of(m47, 16 * q + 8));
    }
  }

  void repack(const uint8_t* blk, __m512i rows) {
    const __m512i k4 = _mm512_set1_epi8(15);
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {  // qs[32c, +32): sub-block 2c low nibbles, 2c + 1 high
#pragma GCC unroll 8
      for (int t = 0; t < 8; ++t) {
        const __m512i g = gather(rows, blk + 16 + 32 * c + 4 * t);
        w[16 * c + t] = _mm512_and_si512(g, k4);
        w[16 * c + 8 + t] = _mm512_and_si512(_mm512_srli_epi32(g, 4), k4);
      }
    }
    repack_scales(blk, rows);
  }

  // M for one x row: Σ_j m_j·(its group sums 2j, 2j + 1).
  __m512i mins_sum(const int32_t* aux) const {
    __m512i m = _mm512_dpwssd_epi32(_mm512_setzero_si512(), mins[0], broadcast_i32(aux));
#pragma GCC unroll 3
    for (int q = 1; q < 4; ++q) m = _mm512_dpwssd_epi32(m, mins[q], broadcast_i32(aux + q));
    return m;
  }
};

// One Q6_K super-block of a tile: w[v] the unsigned 6-bit values of weights 4v..4v+3, sc[g] the
// group scales as i32, pairs[p] (sc_2p, sc_2p+1) as i16 pairs, d as f32. aux: x's 16 group sums
// (i16) per x row and super-block.
struct Q6KTile {
  static constexpr bool kMins = false;
  static constexpr int64_t kBytes = kQ6_KBlockBytes;
  static constexpr int kAux = 8;
  __m512i w[64];
  __m512i sc[16];
  __m512i pairs[8];
  __m512 d, dmin;

  // Weight 128h + 32c + l: the low (c < 2) or high nibble of ql[64h + 32(c & 1) + l] with bits
  // 2c, 2c + 1 of qh[32h + l] above it.
  void repack(const uint8_t* blk, __m512i rows) {
    const __m512i k4 = _mm512_set1_epi8(15), k2 = _mm512_set1_epi8(3);
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
#pragma GCC unroll 8
      for (int t = 0; t < 8; ++t) {
        const __m512i qh = gather(rows, blk + 128 + 32 * h + 4 * t);
#pragma GCC unroll 2
        for (int c = 0; c < 2; ++c) {
          const __m512i ql = gather(rows, blk + 64 * h + 32 * c + 4 * t);
          const __m512i lo = _mm512_and_si512(ql, k4);
          const __m512i hi = _mm512_and_si512(_mm512_srli_epi32(ql, 4), k4);
          const __m512i top_lo = _mm512_and_si512(_mm512_srli_epi32(qh, 2 * c), k2);
          const __m512i top_hi = _mm512_and_si512(_mm512_srli_epi32(qh, 2 * c + 4), k2);
          w[32 * h + 8 * c + t] = _mm512_or_si512(lo, _mm512_slli_epi32(top_lo, 4));
          w[32 * h + 8 * c + 16 + t] = _mm512_or_si512(hi, _mm512_slli_epi32(top_hi, 4));
        }
      }
    }
    for (int q = 0; q < 4; ++q) {
      const __m512i s4 = gather(rows, blk + 192 + 4 * q);
      for (int i = 0; i < 4; ++i) {  // the int8 scale in byte i, sign-extended
        sc[4 * q + i] = _mm512_srai_epi32(_mm512_slli_epi32(s4, 24 - 8 * i), 24);
      }
      pairs[2 * q] = i16_pairs(sc[4 * q], sc[4 * q + 1]);
      pairs[2 * q + 1] = i16_pairs(sc[4 * q + 2], sc[4 * q + 3]);
    }
    // d in bytes 208-209: the dword at 206 (a row's last bytes are d's)
    d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(gather(rows, blk + 206), 16)));
    dmin = _mm512_setzero_ps();
  }

  // The - 32 of every q: 32·Σ_g sc_g·(x's group sum g), to subtract.
  __m512i offset(const int32_t* aux) const {
    __m512i m = _mm512_dpwssd_epi32(_mm512_setzero_si512(), pairs[0], broadcast_i32(aux));
#pragma GCC unroll 7
    for (int q = 1; q < 8; ++q) m = _mm512_dpwssd_epi32(m, pairs[q], broadcast_i32(aux + q));
    return _mm512_slli_epi32(m, 5);
  }
};

// R x rows (row i's q at xq + i·k, its aux at aux + i·kAux·supers) against a repacked tile: row
// i's S (and Q4_K's M) of super-block b, 16 W rows' lanes, at s (m) + 16·(i·supers + b). A run
// of kRun weights (a sub-block or group) is kRun / 4 dwords, its scale sc[run].
template <class Tile, int R>
void tile_dots(const Tile* tile, int64_t supers, const int8_t* xq, int64_t k, const int32_t* aux,
               int32_t* s, int32_t* m) {
  constexpr int kRuns = sizeof(Tile::sc) / sizeof(__m512i), kDwords = 64 / kRuns;
  for (int64_t b = 0; b < supers; ++b) {
    const Tile& o = tile[b];
    const int8_t* xb = xq + 256 * b;
    __m512i sum[R];
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) sum[i] = _mm512_setzero_si512();
    for (int run = 0; run < kRuns; ++run) {
      __m512i a[R];
#pragma GCC unroll 8
      for (int i = 0; i < R; ++i) a[i] = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int t = 0; t < kDwords; ++t) {
        const __m512i wv = _mm512_load_si512(&o.w[kDwords * run + t]);
#pragma GCC unroll 8
        for (int i = 0; i < R; ++i) {
          a[i] = _mm512_dpbusd_epi32(a[i], wv, broadcast_i32(xb + i * k + 4 * (kDwords * run + t)));
        }
      }
      const __m512i sc = _mm512_load_si512(&o.sc[run]);
#pragma GCC unroll 8
      for (int i = 0; i < R; ++i) sum[i] = _mm512_add_epi32(sum[i], _mm512_mullo_epi32(a[i], sc));
    }
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      const int32_t* ai = aux + (i * supers + b) * Tile::kAux;
      if constexpr (Tile::kMins) {
        _mm512_storeu_si512(m + 16 * (i * supers + b), o.mins_sum(ai));
      } else {
        sum[i] = _mm512_sub_epi32(sum[i], o.offset(ai));
      }
      _mm512_storeu_si512(s + 16 * (i * supers + b), sum[i]);
    }
  }
}

// matmul_int8.h's tree of 8 lanes, for 16 W rows at once.
inline __m512 tree8_rows(const __m512* l) {
  __m512 s4[4];
  for (int i = 0; i < 4; ++i) s4[i] = _mm512_add_ps(l[i], l[i + 4]);
  return _mm512_add_ps(_mm512_add_ps(s4[0], s4[2]), _mm512_add_ps(s4[1], s4[3]));
}

// One x row's combine (matmul_int8.h) over a tile: the `lanes` W rows' y stored at `y`.
template <class Tile>
void combine_tile(const Tile* tile, int64_t supers, const float* dx, const int32_t* s,
                  const int32_t* m, float* y, int64_t lanes, bool accumulate) {
  __m512 acc[8], accm[8];
#pragma GCC unroll 8
  for (int l = 0; l < 8; ++l) acc[l] = accm[l] = _mm512_setzero_ps();
  for (int64_t b0 = 0; b0 < supers; b0 += 8) {
#pragma GCC unroll 8
    for (int l = 0; l < 8; ++l) {  // lane l: super-block b0 + l
      const int64_t b = b0 + l;
      if (b >= supers) break;
      const __m512 x = _mm512_set1_ps(dx[b]);
      acc[l] =
          _mm512_add_ps(acc[l], _mm512_mul_ps(_mm512_mul_ps(x, tile[b].d),
                                              _mm512_cvtepi32_ps(_mm512_loadu_si512(s + 16 * b))));
      if constexpr (Tile::kMins) {
        const __m512 u = _mm512_mul_ps(_mm512_mul_ps(x, tile[b].dmin),
                                       _mm512_cvtepi32_ps(_mm512_loadu_si512(m + 16 * b)));
        accm[l] = _mm512_add_ps(accm[l], u);
      }
    }
  }
  __m512 out = tree8_rows(acc);
  if constexpr (Tile::kMins) out = _mm512_sub_ps(out, tree8_rows(accm));
  const auto mask = static_cast<__mmask16>((1u << lanes) - 1);
  if (accumulate) out = _mm512_add_ps(_mm512_maskz_loadu_ps(mask, y), out);
  _mm512_mask_storeu_ps(y, mask, out);
}

// x's Q8_K group sums per row and super-block, as Tile's aux: Q6_K's 16 i16 as they are; Q4_K's
// 4 i32, q holding (bsum_4q + bsum_4q+1) | (bsum_4q+2 + bsum_4q+3) << 16 (each at most 32·127).
template <class Tile>
std::vector<int32_t> tile_aux(const QuantizedX& x, int64_t rows, int64_t supers) {
  std::vector<int32_t> out(static_cast<size_t>(rows * supers * Tile::kAux));
  if constexpr (Tile::kMins) {
    for (size_t g = 0; g < out.size(); ++g) {
      const int16_t* bs = x.bsums.data() + 4 * g;
      const auto lo = static_cast<uint16_t>(bs[0] + bs[1]);
      const auto hi = static_cast<uint16_t>(bs[2] + bs[3]);
      out[g] = static_cast<int32_t>(static_cast<uint32_t>(lo) | static_cast<uint32_t>(hi) << 16);
    }
  } else {
    std::memcpy(out.data(), x.bsums.data(), out.size() * sizeof(int32_t));
  }
  return out;
}

// A tile's scratch for one call: the repacked super-blocks, x's aux, the sums of 8 x rows.
template <class Tile>
struct TileScratch {
  std::vector<Tile> tile;
  std::vector<int32_t> aux, s, m;
};

// R x rows from r0 against the tile at W rows [j0, j0 + lanes): dots, then each row's combine.
template <class Tile, int R>
void tile_rows(const Problem& p, const QuantizedX& x, TileScratch<Tile>& t, int64_t r0, int64_t j0,
               int64_t lanes) {
  const int64_t supers = p.k / kSuperBlockWeights;
  tile_dots<Tile, R>(t.tile.data(), supers, x.q.data() + r0 * p.k, p.k,
                     t.aux.data() + r0 * supers * Tile::kAux, t.s.data(), t.m.data());
  for (int64_t i = 0; i < R; ++i) {
    combine_tile(t.tile.data(), supers, x.d.data() + (r0 + i) * x.d_stride,
                 t.s.data() + 16 * i * supers, t.m.data() + 16 * i * supers,
                 p.y + (r0 + i) * p.ldy + j0, lanes, p.accumulate);
  }
}

template <class Tile>
void rows_tiles(const Problem& p, const QuantizedX& x) {
  const int64_t supers = p.k / kSuperBlockWeights, row_bytes = supers * Tile::kBytes;
  TileScratch<Tile> t{std::vector<Tile>(static_cast<size_t>(supers)),
                      tile_aux<Tile>(x, p.rows, supers),
                      std::vector<int32_t>(static_cast<size_t>(8 * 16 * supers)),
                      std::vector<int32_t>(static_cast<size_t>(8 * 16 * supers))};
  const auto* w = static_cast<const uint8_t*>(p.w);
  for (int64_t j0 = 0; j0 < p.n; j0 += kTileRows) {
    const int64_t lanes = p.n - j0 < kTileRows ? p.n - j0 : kTileRows;
    const __m512i rows = tile_rows(row_bytes, lanes);
    // the next tile's rows arrive while this one meets the x rows
    const int64_t next = (j0 + kTileRows) * row_bytes, end = p.n * row_bytes;
    for (int64_t at = next; at < next + kTileRows * row_bytes && at < end; at += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(w + at), _MM_HINT_T0);
    }
    for (int64_t b = 0; b < supers; ++b)
      t.tile[b].repack(w + j0 * row_bytes + b * Tile::kBytes, rows);
    for (int64_t r0 = 0; r0 < p.rows;) {
      const int64_t left = p.rows - r0;
      if (left >= 8) {
        tile_rows<Tile, 8>(p, x, t, r0, j0, lanes);
      } else if (left >= 4) {
        tile_rows<Tile, 4>(p, x, t, r0, j0, lanes);
      } else if (left >= 2) {
        tile_rows<Tile, 2>(p, x, t, r0, j0, lanes);
      } else {
        tile_rows<Tile, 1>(p, x, t, r0, j0, lanes);
      }
      r0 += left >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
    }
  }
}

void rows_avx512vnni(const Problem& p, const QuantizedX& x) {
  if (p.wt == WeightType::kQ8_0 && p.rows >= 2) return rows_q8_0_wide(p, x);
  if (p.wt == WeightType::kQ4_K && p.rows >= kTileMinRows) return rows_tiles<Q4KTile>(p, x);
  if (p.wt == WeightType::kQ6_K && p.rows >= kTileMinRows) return rows_tiles<Q6KTile>(p, x);
  if (p.wt == WeightType::kQ4_K) {
    const std::vector<int8_t> xq = permute_for_q4_k(x, p.rows, p.k);
    return rows_super<SuperKernels512, WeightType::kQ4_K>(p, x, xq.data());
  }
  if (p.wt == WeightType::kQ6_K) {
    return rows_super<SuperKernels512, WeightType::kQ6_K>(p, x, x.q.data());
  }
  rows_x86<Avx512VnniDot>(p, x);
}

}  // namespace

Int8Dots int8_dots_avx512vnni() {
  Int8Dots d = x86_dots<Avx512VnniDot>();
  d.rows = &rows_avx512vnni;
  return d;
}

}  // namespace simpler::llm::matmul_detail
