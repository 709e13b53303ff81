// Internal to the matmul paths (matmul_portable.cc, matmul_x86_64_v3.cc, matmul_avx512.cc,
// matmul_neon.cc): the one source of the exact inner loops of matmul_impl.h, instantiated once
// per ISA target on a small traits type. Include it only after the traits of the including
// file's target; everything here has internal linkage (an anonymous namespace), so no code built
// for one target can be picked by the linker for another file's copy of an inline function.
//
// A traits type `V` describes the target's 16 lanes as kParts parts of kPartLanes f32 lanes each
// (AVX-512: 1 x 16, AVX2: 2 x 8, NEON and the portable path: 4 x 4); lane l of the numerics
// contract is lane l % kPartLanes of part l / kPartLanes. It provides:
//   using P;                                   one part
//   static constexpr int kParts, kPartLanes;   kParts · kPartLanes == 16
//                                              (the last two from PartsOf<kPartLanes>)
//   static constexpr int kMaxRows, kMaxCols;   the register tile for several x rows
//   static constexpr int kDecodeCols;          W rows per tile for one x row (decode)
//   static P zero();
//   static P load(const float* p);             kPartLanes floats
//   static P load_tail(const float* p, int n); the first n (0 <= n < kPartLanes) floats, then 0
//   template <WeightType WT> static P load_w(const WeightT<WT>* p);            widened to f32
//   template <WeightType WT> static P load_w_tail(const WeightT<WT>* p, int n);  likewise, then 0
//                                              (both from HalfWidthWeights<V> where they fit)
//   static P load_q8_0(const uint8_t* block, int first);  weights [first, first + kPartLanes) of
//                                              one Q8_0 block dequantized: d·q, exact in f32
//   static P load_q4_0(const uint8_t* block, int first);  likewise for a Q4_0 block
//   static P load_q4_k(const uint8_t* qs, bool high, float a, float m);  kPartLanes Q4_K weights:
//                                              the low (or high) nibbles q of qs[0, kPartLanes),
//                                              a·q - m (a·q exact, then one rounding)
//   static P load_q6_k(const uint8_t* ql, bool high, const uint8_t* qh, int shift, float s);
//                                              kPartLanes Q6_K weights: q = (the low or high
//                                              nibble of ql[l], l < kPartLanes, or'ed with
//                                              bits shift, shift + 1 of qh[l] as bits 4-5) - 32,
//                                              s·q (exact)
//   static P fmadd(P a, P b, P c);             a·b + c per lane, one rounding (fused)
//   static float reduce(const P* parts);       the fixed tree of matmul_impl.h over the 16 lanes
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "kernels/matmul_impl.h"

namespace simpler::llm::matmul_detail {
namespace {

template <WeightType WT>
struct WeightStorage {
  using T = uint16_t;  // bf16 and f16 bits
};
template <>
struct WeightStorage<WeightType::kF32> {
  using T = float;
};
template <>
struct WeightStorage<WeightType::kQ8_0> {
  using T = uint8_t;  // the bytes of whole blocks
};
template <>
struct WeightStorage<WeightType::kQ4_0> {
  using T = uint8_t;
};
template <>
struct WeightStorage<WeightType::kQ4_K> {
  using T = uint8_t;
};
template <>
struct WeightStorage<WeightType::kQ6_K> {
  using T = uint8_t;
};

// Whether WT is a super-block type (256 weights a block).
template <WeightType WT>
constexpr bool kSuperBlockType = WT == WeightType::kQ4_K || WT == WeightType::kQ6_K;
// Whether WT is a block type, its block's weights and bytes.
template <WeightType WT>
constexpr bool kBlockType =
    WT == WeightType::kQ8_0 || WT == WeightType::kQ4_0 || kSuperBlockType<WT>;
template <WeightType WT>
constexpr int64_t kBlockWeights = kSuperBlockType<WT> ? kSuperBlockWeights : kQ8_0BlockWeights;
template <WeightType WT>
constexpr int64_t kBlockBytes = WT == WeightType::kQ8_0   ? kQ8_0BlockBytes
                                : WT == WeightType::kQ4_0 ? kQ4_0BlockBytes
                                : WT == WeightType::kQ4_K ? kQ4_KBlockBytes
                                                          : kQ6_KBlockBytes;
template <WeightType WT>
using WeightT = typename WeightStorage<WT>::T;

// The storage unit (WeightT) of a row that holds weight i (for a block type, the start of i's
// block: 34 bytes for Q8_0, 18 for Q4_0, 144 for Q4_K, 210 for Q6_K).
template <WeightType WT>
constexpr int64_t unit_of(int64_t i) {
  if constexpr (kBlockType<WT>) {
    return i / kBlockWeights<WT> * kBlockBytes<WT>;
  } else {
    return i;
  }
}

// Storage units of one W row of k weights (k whole blocks for a block type: matmul_impl.h).
template <WeightType WT>
constexpr int64_t row_units(int64_t k) {
  return unit_of<WT>(k);
}

// An IEEE binary16 as f32, exactly (bit manipulation: the portable path's scalar widening of a
// Q8_0 scale and of the tail helper below; the other targets widen with their instruction).
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);  // inf, NaN
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;  // ±0
  } else {
    exp = 113;  // subnormal: normalize
    while ((man & 0x400u) == 0) {
      man <<= 1;
      --exp;
    }
    bits = sign | (exp << 23) | ((man & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// A Q4_K sub-block's (j < 8) a = d·sc and m = dmin·min (both exact in f32: 11-bit significands
// times 6-bit integers), from the super-block's d, dmin and packed scales (ggml's
// get_scale_min_k4).
struct Q4KScales {
  float a, m;
};
inline Q4KScales q4_k_scales(const uint8_t* block, int j) {
  uint16_t bits[2];
  std::memcpy(bits, block, sizeof(bits));
  const uint8_t* s = block + 4;
  const int sc = j < 4 ? s[j] & 63 : (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
  const int mn = j < 4 ? s[j + 4] & 63 : (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  return {half_to_float(bits[0]) * static_cast<float>(sc),
          half_to_float(bits[1]) * static_cast<float>(mn)};
}

// A Q6_K super-block's scale of weight `first` (< 256): d·scales[8h + 2c + l / 16], exact.
inline float q6_k_scale(const uint8_t* block, int first) {
  uint16_t d_bits;
  std::memcpy(&d_bits, block + 208, sizeof(d_bits));
  const int h = first / 128, c = first % 128 / 32, l = first % 32;
  return half_to_float(d_bits) *
         static_cast<float>(static_cast<int8_t>(block[192 + 8 * h + 2 * c + l / 16]));
}

// Weights [first, first + kPartLanes) of a Q4_K or Q6_K super-block (first a multiple of
// kPartLanes, so the part lies in one sub-block of 32 and, for Q6_K, one scale group of 16).
template <class V, WeightType WT>
inline auto load_super_part(const uint8_t* block, int first) {
  const int l = first % 32;
  if constexpr (WT == WeightType::kQ4_K) {
    const int j = first / 32;
    const Q4KScales s = q4_k_scales(block, j);
    return V::load_q4_k(block + 16 + 32 * (j / 2) + l, j % 2 != 0, s.a, s.m);
  } else {
    const int h = first / 128, c = first % 128 / 32;
    return V::load_q6_k(block + 64 * h + 32 * (c & 1) + l, c >= 2, block + 128 + 32 * h + l, 2 * c,
                        q6_k_scale(block, first));
  }
}

// Weights [i, i + kPartLanes) of `row` (i a multiple of kPartLanes), widened or dequantized to f32:
// one part.
template <class V, WeightType WT>
inline auto load_part(const WeightT<WT>* row, int64_t i) {
  if constexpr (WT == WeightType::kQ8_0) {
    return V::load_q8_0(row + unit_of<WT>(i), static_cast<int>(i % kQ8_0BlockWeights));
  } else if constexpr (WT == WeightType::kQ4_0) {
    return V::load_q4_0(row + unit_of<WT>(i), static_cast<int>(i % kQ8_0BlockWeights));
  } else if constexpr (kSuperBlockType<WT>) {
    return load_super_part<V, WT>(row + unit_of<WT>(i), static_cast<int>(i % kSuperBlockWeights));
  } else {
    return V::template load_w<WT>(row + i);
  }
}
// The scale d of a Q8_0 or Q4_0 block (its first two bytes, f16), widened exactly.
inline float block_scale(const uint8_t* block) {
  uint16_t d_bits;
  std::memcpy(&d_bits, block, sizeof(d_bits));
  return half_to_float(d_bits);
}

// The integer of weight j (< 32) of a Q8_0 or Q4_0 block: q, or the nibble less 8.
template <WeightType WT>
inline int block_int(const uint8_t* block, int64_t j) {
  if constexpr (WT == WeightType::kQ8_0) {
    return static_cast<int8_t>(block[2 + j]);
  } else {
    return (j < 16 ? block[2 + j] & 15 : block[2 + j - 16] >> 4) - 8;
  }
}

// Weight i (< 256) of a Q4_K or Q6_K super-block, by the formulas of load_super_part.
template <WeightType WT>
inline float super_weight(const uint8_t* block, int i) {
  const int l = i % 32;
  if constexpr (WT == WeightType::kQ4_K) {
    const int j = i / 32;
    const Q4KScales s = q4_k_scales(block, j);
    const uint8_t byte = block[16 + 32 * (j / 2) + l];
    const float aq = s.a * static_cast<float>(j % 2 != 0 ? byte >> 4 : byte & 15);  // exact
    return aq - s.m;
  } else {
    const int h = i / 128, c = i % 128 / 32;
    const uint8_t lo = block[64 * h + 32 * (c & 1) + l];
    const int hi = (block[128 + 32 * h + l] >> (2 * c)) & 3;
    return q6_k_scale(block, i) * static_cast<float>(((c >= 2 ? lo >> 4 : lo & 15) | hi << 4) - 32);
  }
}

// The first n (0 <= n < kPartLanes) of those weights, then 0. A block type's row is whole blocks
// of 32 or 256, so its k is a multiple of 16 and no chunk is partial; that branch is still exact,
// lane by lane.
template <class V, WeightType WT>
inline auto load_part_tail(const WeightT<WT>* row, int64_t i, int n) {
  if constexpr (kSuperBlockType<WT>) {
    const uint8_t* block = row + unit_of<WT>(i);
    float part[V::kPartLanes] = {};
    for (int l = 0; l < n; ++l) {
      part[l] = super_weight<WT>(block, static_cast<int>(i % kSuperBlockWeights) + l);
    }
    return V::load(part);
  } else if constexpr (kBlockType<WT>) {
    const uint8_t* block = row + unit_of<WT>(i);
    const float d = block_scale(block);
    float part[V::kPartLanes] = {};
    for (int l = 0; l < n; ++l) {
      part[l] = d * static_cast<float>(block_int<WT>(block, i % kQ8_0BlockWeights + l));
    }
    return V::load(part);
  } else {
    return V::template load_w_tail<WT>(row + i, n);
  }
}

// kPartLanes and kParts for a traits type (derived from this) whose part is a vector of
// `PartLanes` f32 lanes. The traits type names its part itself (`using P = __m256;`): a vector
// type passed as a template argument loses its attributes (__m256's __may_alias__ and
// __aligned__; g++'s -Wignored-attributes), so the part is never one.
template <int PartLanes>
struct PartsOf {
  static constexpr int kPartLanes = PartLanes;
  static constexpr int kParts = 16 / kPartLanes;
  static_assert(kParts * kPartLanes == 16, "a part holds 1, 2, 4, 8 or 16 f32 lanes");
};

// load_w and load_w_tail for a traits type `V` (derived from this) whose kPartLanes 16-bit
// weights load as one half-width vector (`static H load_h(const uint16_t* p)`) that
// `template <WeightType WT> static P widen(H h)` widens to a part; f32 weights load as x does.
template <class V>
struct HalfWidthWeights {
  template <WeightType WT>
  static auto load_w(const WeightT<WT>* p) {
    if constexpr (WT == WeightType::kF32) {
      return V::load(p);
    } else {
      return V::template widen<WT>(V::load_h(p));
    }
  }
  template <WeightType WT>
  static auto load_w_tail(const WeightT<WT>* p, int n) {
    if constexpr (WT == WeightType::kF32) {
      return V::load_tail(p, n);
    } else {
      uint16_t part[V::kPartLanes] = {};
      std::memcpy(part, p, static_cast<size_t>(n) * sizeof(uint16_t));
      return V::template widen<WT>(V::load_h(part));
    }
  }
};

// One R x C register tile: rows [0, R) of x against W rows [0, C), k in chunks of 16 lanes.
template <class V, WeightType WT, int R, int C>
void tile(const float* x, int64_t k, const WeightT<WT>* w, float* y, int64_t ldy, bool accumulate) {
  using P = typename V::P;
  constexpr int kL = V::kPartLanes;
  const int64_t ru = row_units<WT>(k);
  P acc[R][C][V::kParts];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
#pragma GCC unroll 4
      for (int q = 0; q < V::kParts; ++q) acc[r][c][q] = V::zero();
    }
  }
  int64_t kk = 0;
  for (; kk + 16 <= k; kk += 16) {
    if constexpr (R == 1) {
      // One x row streams W: prefetch (into L2, locality 1) the next tile's rows, which follow
      // these C rows, at the same k while this tile's are in flight. C interleaved rows of a few
      // KB are too short for the hardware prefetcher to follow in time (docs/design/
      // kernel_targets.md, "Streaming one row"; locality 0 or 3, or two tiles ahead, did less).
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) __builtin_prefetch(w + (C + c) * ru + unit_of<WT>(kk), 0, 1);
    }
#pragma GCC unroll 4
    for (int q = 0; q < V::kParts; ++q) {
      P wv[C];
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) wv[c] = load_part<V, WT>(w + c * ru, kk + q * kL);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const P xv = V::load(x + r * k + kk + q * kL);
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) acc[r][c][q] = V::fmadd(xv, wv[c], acc[r][c][q]);
      }
    }
  }
  // The tail repeats the main loop's FMA block with loads that stop at k, kept apart so that the
  // main loop carries no tail branches (for jscpd, the copy check of scripts/test.sh):
  /* jscpd:ignore-start */
  if (kk < k) {
    // The last chunk: lanes past k add 0·0.
#pragma GCC unroll 4
    for (int q = 0; q < V::kParts; ++q) {
      const int64_t left = k - kk - q * kL;
      if (left <= 0) break;
      P wv[C];
      if (left >= kL) {
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) wv[c] = load_part<V, WT>(w + c * ru, kk + q * kL);
      } else {
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) {
          wv[c] = load_part_tail<V, WT>(w + c * ru, kk + q * kL, static_cast<int>(left));
        }
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const float* xp = x + r * k + kk + q * kL;
        const P xv = left >= kL ? V::load(xp) : V::load_tail(xp, static_cast<int>(left));
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) acc[r][c][q] = V::fmadd(xv, wv[c], acc[r][c][q]);
      }
    }
  }
  /* jscpd:ignore-end */
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      const float s = V::reduce(acc[r][c]);
      float* out = y + r * ldy + c;
      *out = accumulate ? *out + s : s;
    }
  }
}

// The same R x C tile for several x rows, over one block [k0, k1) of k (k0 a multiple of 16),
// the 16 lane sums of each output carried between blocks in `sums` ([R][C][16] floats, zeroed
// here when k0 == 0; reduced into y when y is not null, after the last block). In the block, part
// q's lanes accumulate before part q + 1 starts (each lane still takes its k in increasing order,
// so the bits are tile()'s). Only R x C accumulators are live at a time, not R x C x kParts: a
// target whose 16 lanes are several parts fits a tile kParts times larger in its registers (more
// fused multiply-adds per W and x load: AVX2's 4 x 3 tile against 3 x 2), and the block's x and W
// lines stay in L1 from one part to the next.
template <class V, WeightType WT, int R, int C>
void tile_rows(const float* x, int64_t k, int64_t k0, int64_t k1, const WeightT<WT>* w, float* sums,
               float* y, int64_t ldy, bool accumulate) {
  using P = typename V::P;
  constexpr int kL = V::kPartLanes;
  constexpr int kQ = V::kParts;
  static_assert(kQ * kL == 16);
  const int64_t ru = row_units<WT>(k);
#pragma GCC unroll 4
  for (int q = 0; q < kQ; ++q) {
    P acc[R][C];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) {
        acc[r][c] = k0 == 0 ? V::zero() : V::load(sums + (r * C + c) * 16 + q * kL);
      }
    }
    const int64_t off = q * kL;
    int64_t kk = k0;
    for (; kk + 16 <= k1; kk += 16) {
      if (q == 0) {
        // The next tile's W rows (these C rows' successors) at this k, into L1: W comes from
        // L2 in short runs (one block of k of C rows), too short for the L1 prefetcher to
        // follow; the first part's pass fetches them for every part.
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) __builtin_prefetch(w + (C + c) * ru + unit_of<WT>(kk), 0, 3);
      }
      P wv[C];
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) wv[c] = load_part<V, WT>(w + c * ru, kk + off);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const P xv = V::load(x + r * k + kk + off);
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) acc[r][c] = V::fmadd(xv, wv[c], acc[r][c]);
      }
    }
    const int64_t left = k1 - kk - off;  // the last chunk's lanes of this part; past k, 0·0
    if (left > 0) {
      P wv[C];
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) {
        const WeightT<WT>* row = w + c * ru;
        wv[c] = left >= kL ? load_part<V, WT>(row, kk + off)
                           : load_part_tail<V, WT>(row, kk + off, static_cast<int>(left));
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const float* xp = x + r * k + kk + off;
        const P xv = left >= kL ? V::load(xp) : V::load_tail(xp, static_cast<int>(left));
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) acc[r][c] = V::fmadd(xv, wv[c], acc[r][c]);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c)
        std::memcpy(sums + (r * C + c) * 16 + q * kL, &acc[r][c], sizeof(P));
    }
  }
  if (y == nullptr) return;
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      P parts[kQ];
#pragma GCC unroll 4
      for (int q = 0; q < kQ; ++q) parts[q] = V::load(sums + (r * C + c) * 16 + q * kL);
      const float s = V::reduce(parts);
      float* out = y + r * ldy + c;
      *out = accumulate ? *out + s : s;
    }
  }
}

template <WeightType WT>
using TileFn = void (*)(const float*, int64_t, const WeightT<WT>*, float*, int64_t, bool);
template <WeightType WT>
using RowsTileFn = void (*)(const float*, int64_t, int64_t, int64_t, const WeightT<WT>*, float*,
                            float*, int64_t, bool);

// The tiles of one x row against 1 ... kMaxCols W rows, indexed by cols - 1.
template <class V, WeightType WT, int... Cs>
constexpr auto decode_tiles(std::integer_sequence<int, Cs...>) {
  return std::array<TileFn<WT>, sizeof...(Cs)>{&tile<V, WT, 1, Cs + 1>...};
}
// The tiles of R rows against 1 ... kMaxCols W rows, indexed by cols - 1.
template <class V, WeightType WT, int R, int... Cs>
constexpr auto rows_tile_row(std::integer_sequence<int, Cs...>) {
  return std::array<RowsTileFn<WT>, sizeof...(Cs)>{&tile_rows<V, WT, R, Cs + 1>...};
}
// rows_tiles[rows - 1][cols - 1]: every tile up to kMaxRows x kMaxCols.
template <class V, WeightType WT, int... Rs>
constexpr auto rows_tiles(std::integer_sequence<int, Rs...>) {
  return std::array<std::array<RowsTileFn<WT>, V::kMaxCols>, sizeof...(Rs)>{
      rows_tile_row<V, WT, Rs + 1>(std::make_integer_sequence<int, V::kMaxCols>{})...};
}

// Lanes of k per block of several x rows: k split evenly (a multiple of 16 each) into the fewest
// blocks whose x rows (kMaxRows f32) and W rows (kMaxCols weights) fit l1_block_bytes() (three
// quarters of the L1d), so a block's x stays in L1 while the chunk's W tiles pass. One block when
// k fits.
template <class V, WeightType WT>
int64_t k_block(int64_t k) {
  // A Q8_0 weight takes 34/32 bytes: counted as 2; a Q4_0, Q4_K or Q6_K one (18/32, 144/256,
  // 210/256): counted as 1.
  constexpr int64_t kWeightBytes = WT == WeightType::kQ8_0 ? 2 : sizeof(WeightT<WT>);
  constexpr int64_t kPerLane = V::kMaxRows * 4 + V::kMaxCols * kWeightBytes;
  const int64_t max_lanes = l1_block_bytes() / kPerLane;
  const int64_t blocks = (k + max_lanes - 1) / max_lanes;
  const int64_t lanes = (k + blocks - 1) / blocks;
  return (lanes + 15) / 16 * 16;
}

// One x row: W streams through 1 x kDecodeCols tiles.
template <class V, WeightType WT>
void run_decode(const Problem& p) {
  static constexpr auto kTiles =
      decode_tiles<V, WT>(std::make_integer_sequence<int, V::kMaxCols>{});
  using T = WeightT<WT>;
  const T* w = static_cast<const T*>(p.w);
  const int64_t ru = row_units<WT>(p.k);
  int64_t j = 0;
  for (; j + V::kDecodeCols <= p.n; j += V::kDecodeCols) {
    tile<V, WT, 1, V::kDecodeCols>(p.x, p.k, w + j * ru, p.y + j, p.ldy, p.accumulate);
  }
  for (; j < p.n; j += V::kMaxCols) {
    const int cols = static_cast<int>(p.n - j < V::kMaxCols ? p.n - j : V::kMaxCols);
    kTiles[cols - 1](p.x, p.k, w + j * ru, p.y + j, p.ldy, p.accumulate);
  }
}

// p on target V: one x row streams W (run_decode); several rows take W in chunks of rows that
// stay in L2 while every row group of x passes, and k in blocks (k_block) whose x rows stay in L1
// while the chunk's kMaxRows x kMaxCols tiles pass; each tile's lane sums wait in `sums` between
// blocks.
template <class V, WeightType WT>
void run_tiles(const Problem& p) {
  if (p.rows == 1) return run_decode<V, WT>(p);
  using T = WeightT<WT>;
  static constexpr auto kTiles = rows_tiles<V, WT>(std::make_integer_sequence<int, V::kMaxRows>{});
  const int64_t kb = k_block<V, WT>(p.k);
  constexpr int64_t kTileSums = V::kMaxRows * V::kMaxCols * 16;
  const T* w = static_cast<const T*>(p.w);
  const int64_t ru = row_units<WT>(p.k);
  const int64_t chunk = chunk_rows(ru * static_cast<int64_t>(sizeof(T)), V::kMaxCols);
  const int64_t tiles_per_chunk = (std::min(chunk, p.n) + V::kMaxCols - 1) / V::kMaxCols;
  // One tile's sums when k is one block (each tile finishes in one call); else every tile's of
  // the chunk.
  std::vector<float> sums(static_cast<size_t>(kTileSums * (p.k > kb ? tiles_per_chunk : 1)));
  for (int64_t j0 = 0; j0 < p.n; j0 += chunk) {
    const int64_t jn = p.n - j0 < chunk ? p.n - j0 : chunk;
    for (int64_t r0 = 0; r0 < p.rows; r0 += V::kMaxRows) {
      const int rows = static_cast<int>(p.rows - r0 < V::kMaxRows ? p.rows - r0 : V::kMaxRows);
      const float* x = p.x + r0 * p.k;
      float* y = p.y + r0 * p.ldy + j0;
      for (int64_t k0 = 0; k0 < p.k; k0 += kb) {
        const int64_t k1 = p.k - k0 < kb ? p.k : k0 + kb;
        for (int64_t j = 0; j < jn; j += V::kMaxCols) {
          const int cols = static_cast<int>(jn - j < V::kMaxCols ? jn - j : V::kMaxCols);
          float* tile_sums = sums.data() + (p.k > kb ? j / V::kMaxCols * kTileSums : 0);
          kTiles[rows - 1][cols - 1](x, p.k, k0, k1, w + (j0 + j) * ru, tile_sums,
                                     k1 == p.k ? y + j : nullptr, p.ldy, p.accumulate);
        }
      }
    }
  }
}

// Problem p on target V, whatever its weight type.
template <class V>
void run_on(const Problem& p) {
  switch (p.wt) {
    case WeightType::kF32:
      return run_tiles<V, WeightType::kF32>(p);
    case WeightType::kBF16:
      return run_tiles<V, WeightType::kBF16>(p);
    case WeightType::kF16:
      return run_tiles<V, WeightType::kF16>(p);
    case WeightType::kQ8_0:
      return run_tiles<V, WeightType::kQ8_0>(p);
    case WeightType::kQ4_0:
      return run_tiles<V, WeightType::kQ4_0>(p);
    case WeightType::kQ4_K:
      return run_tiles<V, WeightType::kQ4_K>(p);
    case WeightType::kQ6_K:
      return run_tiles<V, WeightType::kQ6_K>(p);
  }
}

// `iters` rounds of 12 · 16 lane FMAs on target V (matmul_impl.h's probes): 12 independent
// chains of one part each, every chain advanced kParts times per round (enough chains in flight
// for two FMA ports of latency 4-6 in the target's registers, none spilled).
template <class V>
float fma_probe(int64_t iters, float seed) {
  using P = typename V::P;
  P acc[12];
  float init[16], av[16], bv[16];
  for (int l = 0; l < 16; ++l) {
    av[l] = 0.999999f;
    bv[l] = 1e-7f;
  }
  for (int i = 0; i < 12; ++i) {
    for (float& f : init) f = seed + static_cast<float>(i);
    acc[i] = V::load(init);
  }
  const P a = V::load(av), b = V::load(bv);
  for (int64_t it = 0; it < iters; ++it) {
#pragma GCC unroll 4
    for (int q = 0; q < V::kParts; ++q) {
#pragma GCC unroll 12
      for (int i = 0; i < 12; ++i) acc[i] = V::fmadd(acc[i], a, b);
    }
  }
  P parts[V::kParts];
  for (int q = 0; q < V::kParts; ++q) parts[q] = acc[q];
  for (int i = V::kParts; i < 12; ++i)
    parts[i % V::kParts] = V::fmadd(acc[i], a, parts[i % V::kParts]);
  return V::reduce(parts);
}

}  // namespace
}  // namespace simpler::llm::matmul_detail
