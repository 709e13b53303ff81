// Internal to the llm kernels: the int8-activation matmul over block-quantized weights (precision
// int8, llama.cpp's way; docs/design/quantized_matmul.md). y[r, j] (+)= x[r]·W[j] where each x row
// is first quantized per block to int8 with an f32 scale, once for all W rows (once per call of
// run_int8, once per block of a matmul task computing its rows in several claims):
//   - for Q8_0 and Q4_0 weights, as ggml's Q8_0 (quantize_row_q8_0 of ggml-cpu's x86 and NEON
//     code): blocks of 32, amax = max |x|, d = amax / 127 stored as binary16 (nearest even),
//     id = 127 / amax (0 when amax is 0), q = x·id rounded to nearest, ties to even;
//   - for Q4_K and Q6_K weights, as ggml's Q8_K (quantize_row_q8_K_ref): super-blocks of 256,
//     max = the first x of largest magnitude (sign kept), iscale = -127 / max, q = min(127,
//     nearest_int(iscale·x)) (ties to even), d = 1 / iscale (f32), an all-zero block d = 0, q = 0;
//     bsums[g] = Σ of q over each group of 16.
// Every q lies in [-127, 127].
//
// Numerics, the same on every target: a target computes only integer dot products of a W block's
// integers with x's (exact: int32 without overflow), and one shared function built with the
// baseline flags and without contraction (matmul_int8.cc) combines them in a fixed order:
//   - Q8_0 / Q4_0, block b: t_b = (dw_b·dx_b)·S_b, S_b = Σ_i wq_i·xq_i (wq = q, or nibble - 8;
//     |S_b| <= 2^19, so its f32 is exact), each product rounded to f32;
//   - Q4_K, super-block b: t_b = (dx_b·d_b)·f32(S_b) and u_b = (dx_b·dmin_b)·f32(M_b), S_b = Σ_j
//     sc_j·Σ_i q_i·xq_i over the 8 sub-blocks (q the nibble, 0..15), M_b = Σ_j m_j·(bsums of j);
//   - Q6_K: t_b = (dx_b·d_b)·f32(S_b), S_b = Σ_g sc_g·Σ_i (q_i - 32)·xq_i over the 16 groups;
//   (f32 of an int32 rounds to nearest even when it is past 2^24);
// lane l = b mod 8 sums its t_b in increasing b (a multiply, then an add: two roundings), the 8
// lanes reduce by s4[i] = l[i] + l[i+4], s2[i] = s4[i] + s4[i+2], s = s2[0] + s2[1] (and the u_b
// likewise into m, s = s - m); then y = s, or y = y + s when accumulating. So every target gives
// bitwise the same y, and a row's result depends on nothing but its own x and W
// (batch-invariant). Its error against the f64 product of the dequantized weights and the
// dequantized x is the f32 combine's (about (#blocks / 8 + 5)·2^-24 of Σ|t_b|), on top of the
// quantization of x itself.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/matmul_impl.h"

namespace simpler::llm::matmul_detail {

// x quantized per block (above), once for every W row: row r's k int8 at q + r·k, its
// scales at d + r·d_stride (k / 32 or k / 256 of them, then zeros up to d_stride, a multiple of 8,
// so a target may read the scales 8 at a time), and for Q8_K its group sums at bsums + r·(k / 16).
// `prepared`: what the target's rows kernel derives from q once for all W rows (Int8Dots::prepare;
// empty when it derives nothing).
struct QuantizedX {
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int16_t> bsums;
  int64_t d_stride = 0;
  std::vector<int8_t> prepared;
};

// One target's integer dot products of one W row with one quantized x row (`xq`, the row's k
// int8). Exact: any order of the integer sums gives the same result.
struct Int8Dots {
  // Q8_0 / Q4_0 W row of `blocks` blocks of 32: sums[b] = Σ_{i<32} wq[32b + i]·xq[32b + i].
  void (*q8_0)(const uint8_t* w, const int8_t* xq, int64_t blocks, int32_t* sums);
  void (*q4_0)(const uint8_t* w, const int8_t* xq, int64_t blocks, int32_t* sums);
  // Q4_K W row of `supers` super-blocks: sums[8s + j] = Σ_{i<32} q[256s + 32j + i]·xq[...], q the
  // unsigned nibble (0..15) of sub-block j.
  void (*q4_k)(const uint8_t* w, const int8_t* xq, int64_t supers, int32_t* sums);
  // Q6_K W row: sums[16s + g] = Σ_{i<16} (q[256s + 16g + i] - 32)·xq[...], q the 6-bit value.
  void (*q6_k)(const uint8_t* w, const int8_t* xq, int64_t supers, int32_t* sums);
  // Optional (null: the shared loop over the functions above and the shared combine): the whole
  // product p (its weight type one of the four) against x quantized for it, in the target's
  // vectors, bitwise the shared path's: the same exact integer sums per block or super-block,
  // then the combine's roundings in the same lanes in the same order (built without
  // contraction).
  void (*rows)(const Problem& p, const QuantizedX& x) = nullptr;
  // Optional (null: the shared ones): quantize_x_q8_0 and quantize_x_q8_k below in the target's
  // vectors, bitwise theirs.
  void (*quantize_q8_0)(const float* x, int64_t k, int8_t* q, float* d) = nullptr;
  void (*quantize_q8_k)(const float* x, int64_t k, int8_t* q, float* d, int16_t* bsums) = nullptr;
  // Optional (null: nothing): fills x.prepared for `rows`, once per x (p's W rows do not matter);
  // quantize_int8 calls it when `rows` is set.
  void (*prepare)(const Problem& p, QuantizedX& x) = nullptr;
  // Whether `rows` reads W rows interleaved 16 at a time (Problem::interleaved) itself; else
  // run_int8_quantized runs such a W through run_deinterleaved.
  bool interleaved = false;
};

// The targets' dot products. The portable one runs anywhere (matmul_int8.cc, baseline flags); the
// x86 ones only where the CPU has their instructions: AVX2 (vpmaddubsw), AVX-VNNI and AVX-512
// VNNI (vpdpbusd); NEON (sdot where the CPU has the dot-product extension, else widening
// multiplies).
Int8Dots int8_dots_portable();
Int8Dots int8_dots_avx2();
bool avxvnni_available();
Int8Dots int8_dots_avxvnni();
// Whether the environment variable SIMPLER_INT8_AVX2 is set to 1 (read once): x86-64-v3 (and
// avx512 without AVX-512 VNNI) then takes AVX2's integer sums (vpmaddubsw + vpmaddwd) where it
// would take AVX-VNNI's, as a CPU without AVX-VNNI runs them (benchmarks and tests of that path
// on a CPU that has it; the results are bitwise the same).
bool int8_avx2_forced();
bool avx512vnni_available();
Int8Dots int8_dots_avx512vnni();
Int8Dots int8_dots_neon();

// Whether `wt` has an int8-activation path (Q8_0, Q4_0, Q4_K, Q6_K).
bool int8_weight_type(WeightType wt);

// p (a block weight type: int8_weight_type) with x quantized per block as above and `dots`.
void run_int8(const Problem& p, const Int8Dots& dots);
// The same in two steps, so that a block computing its W rows in several pieces quantizes x once:
// quantize_int8 quantizes p's x for p's weight type (and the target's prepare), run_int8_quantized
// runs p against it with the same `dots`; p's x, rows, k and weight type must be those
// quantize_int8 saw, its W rows (w, n, y) any of them. The kernels still derive some small things
// from x per call (Q8_0's block sums of x, Q4_K's group-sum pairs, the tiles' x sums): per claim.
QuantizedX quantize_int8(const Problem& p, const Int8Dots& dots);
void run_int8_quantized(const Problem& p, const QuantizedX& x, const Int8Dots& dots);

// The quantizers of x, exposed for the tests: one row of k floats (k a multiple of 32, or of 256
// for Q8_K) into q[k], d[k / 32] (binary16 values, as f32) or d[k / 256] and bsums[k / 16].
void quantize_x_q8_0(const float* x, int64_t k, int8_t* q, float* d);
void quantize_x_q8_k(const float* x, int64_t k, int8_t* q, float* d, int16_t* bsums);

// A Q8_K super-block's 16 bsums: the sums of its quants `qb[256]` 16 at a time.
inline void q8_k_bsums(const int8_t* qb, int16_t* bsums) {
  for (int g = 0; g < 16; ++g) {
    int s = 0;
    for (int i = 0; i < 16; ++i) s += qb[16 * g + i];
    bsums[g] = static_cast<int16_t>(s);
  }
}

}  // namespace simpler::llm::matmul_detail
