#include "simpler/kernels/kernels.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iostream>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/kernel_test_util.h"
#include "kernels/matmul_impl.h"

namespace simpler::llm {
namespace {

using ::testing::HasSubstr;

using testing::matmul_paths;
using testing::run_blocks;
using testing::view;

std::vector<float> random_floats(size_t n, uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

void expect_close(const std::vector<float>& got, const std::vector<double>& want, double tol) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_NEAR(got[i], want[i], tol * (1.0 + std::abs(want[i]))) << "element " << i;
  }
}

TEST(BlockRange, SplitsEvenlyAndCoversEverything) {
  const int64_t n = 10;
  int64_t covered = 0;
  for (int32_t b = 0; b < 4; ++b) {
    BlockRange r = block_range(n, b, 4);
    EXPECT_EQ(r.begin, covered);
    EXPECT_GE(r.end - r.begin, 2);
    EXPECT_LE(r.end - r.begin, 3);
    covered = r.end;
  }
  EXPECT_EQ(covered, n);
  BlockRange empty = block_range(2, 3, 5);
  EXPECT_EQ(empty.end - empty.begin, 0);
}

TEST(LlmKernels, ListIsInKernelIdOrderWithUniqueNames) {
  std::vector<task::Kernel> kernels = llm_kernels(KernelIsa::kAuto, Precision::kExact);
  ASSERT_EQ(kernels.size(), static_cast<size_t>(KernelId::kCount));
  EXPECT_EQ(kernels[static_cast<size_t>(KernelId::kMatmulAcc)].name, "matmul_acc");
  EXPECT_EQ(kernels[static_cast<size_t>(KernelId::kPagedAttention)].name, "paged_attention");
  EXPECT_EQ(kernels[static_cast<size_t>(KernelId::kArgmax)].name, "argmax");
}

TEST(EmbeddingKernel, GathersRowsAcrossBlocks) {
  const int64_t V = 11, H = 5;
  std::vector<float> table = random_floats(V * H, 1);
  std::vector<int32_t> ids = {3, 0, 10, 3};
  std::vector<float> out(ids.size() * H, NAN);
  ASSERT_TRUE(run_blocks(&embedding_kernel,
                         embedding_args(view(ids, {4}), view(table, {V, H}), view(out, {4, H})), 3)
                  .ok());
  for (size_t b = 0; b < ids.size(); ++b) {
    for (int64_t i = 0; i < H; ++i) EXPECT_EQ(out[b * H + i], table[ids[b] * H + i]);
  }
}

TEST(EmbeddingKernel, OutOfRangeIdIsInvalidArgumentNamingTheId) {
  const int64_t V = 11, H = 5;
  std::vector<float> table = random_floats(V * H, 1);
  std::vector<int32_t> ids = {1, 11};
  std::vector<float> out(2 * H);
  absl::Status s = run_blocks(
      &embedding_kernel, embedding_args(view(ids, {2}), view(table, {V, H}), view(out, {2, H})), 1);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(),
              HasSubstr("embedding: token id 11 at row 1 is outside the vocabulary [0, 11)"));
  ids = {-2, 0};
  s = run_blocks(&embedding_kernel,
                 embedding_args(view(ids, {2}), view(table, {V, H}), view(out, {2, H})), 2);
  EXPECT_THAT(s.message(), HasSubstr("token id -2 at row 0"));
}

TEST(RmsNormKernel, MatchesDoubleReferenceForUnevenSplits) {
  const int64_t R = 7, D = 10;
  const float eps = 1e-5f;
  std::vector<float> x = random_floats(R * D, 2, -3.0f, 3.0f);
  std::vector<float> w = random_floats(D, 3, 0.5f, 1.5f);
  std::vector<double> want(R * D);
  for (int64_t r = 0; r < R; ++r) {
    double ss = 0;
    for (int64_t i = 0; i < D; ++i) ss += double(x[r * D + i]) * x[r * D + i];
    const double inv = 1.0 / std::sqrt(ss / D + eps);
    for (int64_t i = 0; i < D; ++i) want[r * D + i] = x[r * D + i] * inv * w[i];
  }
  for (int32_t bd : {1, 3, 10}) {
    std::vector<float> out(R * D, NAN);
    ASSERT_TRUE(run_blocks(&rms_norm_kernel,
                           rms_norm_args(view(x, {R, D}), view(w, {D}), view(out, {R, D}), eps), bd)
                    .ok());
    expect_close(out, want, 1e-6);
  }
}

// Rows are normalized several at a time (their sums of squares advance together): each row's
// result is still bitwise the row normalized alone, whatever rows share its group or block.
TEST(RmsNormKernel, EachRowIsBitwiseItsOneRowResultWhateverTheSplit) {
  const int64_t R = 11, D = 37;
  const float eps = 1e-6f;
  std::vector<float> x = random_floats(R * D, 7, -4.0f, 4.0f);
  std::vector<float> w = random_floats(D, 8, 0.5f, 1.5f);
  std::vector<float> alone(R * D, NAN);
  for (int64_t r = 0; r < R; ++r) {
    std::vector<float> row(x.begin() + r * D, x.begin() + (r + 1) * D), out(D, NAN);
    ASSERT_TRUE(run_blocks(&rms_norm_kernel,
                           rms_norm_args(view(row, {1, D}), view(w, {D}), view(out, {1, D}), eps),
                           1)
                    .ok());
    std::copy(out.begin(), out.end(), alone.begin() + r * D);
  }
  for (int32_t bd : {1, 2, 3, 5, 11}) {
    std::vector<float> out(R * D, NAN);
    ASSERT_TRUE(run_blocks(&rms_norm_kernel,
                           rms_norm_args(view(x, {R, D}), view(w, {D}), view(out, {R, D}), eps), bd)
                    .ok());
    for (int64_t i = 0; i < R * D; ++i) {
      ASSERT_EQ(std::bit_cast<uint32_t>(out[i]), std::bit_cast<uint32_t>(alone[i]))
          << "element " << i << " with " << bd << " blocks";
    }
  }
}

TEST(MatmulKernel, MatchesDoubleReferenceForUnevenSplits) {
  const int64_t B = 3, in = 13, out = 10;
  std::vector<float> x = random_floats(B * in, 4);
  std::vector<float> w = random_floats(out * in, 5);
  std::vector<float> y0 = random_floats(B * out, 6);
  std::vector<double> prod(B * out, 0.0);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t o = 0; o < out; ++o) {
      for (int64_t i = 0; i < in; ++i) prod[b * out + o] += double(x[b * in + i]) * w[o * in + i];
    }
  }
  for (int32_t bd : {1, 3, 4, 16}) {
    std::vector<float> y(B * out, NAN);
    ASSERT_TRUE(run_blocks(&matmul_kernel,
                           matmul_args(view(x, {B, in}), view(w, {out, in}), view(y, {B, out})), bd)
                    .ok());
    expect_close(y, prod, 1e-5);

    std::vector<float> acc = y0;
    ASSERT_TRUE(
        run_blocks(&matmul_acc_kernel,
                   matmul_acc_args(view(x, {B, in}), view(w, {out, in}), view(acc, {B, out})), bd)
            .ok());
    std::vector<double> want(B * out);
    for (size_t i = 0; i < want.size(); ++i) want[i] = prod[i] + y0[i];
    expect_close(acc, want, 1e-5);
  }
}

// A row's result is bitwise the same alone,
// at any position of the batch, and under any block split: a request's logits
// do not depend on the other rows of its step.
TEST(MatmulKernel, ARowsResultIsBitwiseIndependentOfTheBatchAndSplit) {
  const int64_t in = 67, out = 2100;  // 3 chunks of W (65536 / 67 rows each)
  std::vector<float> w = random_floats(out * in, 9);
  std::vector<float> batch = random_floats(40 * in, 10);
  std::vector<std::vector<float>> alone(40);
  for (int64_t r = 0; r < 40; ++r) {
    std::vector<float> xr(batch.begin() + r * in, batch.begin() + (r + 1) * in);
    alone[r].assign(out, NAN);
    ASSERT_TRUE(
        run_blocks(&matmul_kernel,
                   matmul_args(view(xr, {1, in}), view(w, {out, in}), view(alone[r], {1, out})), 1)
            .ok());
  }
  for (int64_t rows : {2, 3, 4, 5, 17, 40}) {
    for (int32_t bd : {1, 2, 7}) {
      std::vector<float> xb(batch.begin(), batch.begin() + rows * in);
      std::vector<float> y(rows * out, NAN);
      ASSERT_TRUE(
          run_blocks(&matmul_kernel,
                     matmul_args(view(xb, {rows, in}), view(w, {out, in}), view(y, {rows, out})),
                     bd)
              .ok());
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t o = 0; o < out; ++o) {
          ASSERT_EQ(y[r * out + o], alone[r][o])
              << "rows " << rows << " blocks " << bd << " row " << r << " output " << o;
        }
      }
    }
  }
}

// Weights of one dtype for the ISA tests: the raw bits and the values they hold (widened, or
// dequantized for q8_0).
struct TestWeights {
  DataType dtype;
  std::vector<float> f32;
  std::vector<uint16_t> half;
  std::vector<double> values;
  std::vector<uint8_t> blocks;  // q8_0, q4_0
  Tensor tensor(int64_t out, int64_t in) {
    const uintptr_t a = dtype == DataType::kFloat32 ? reinterpret_cast<uintptr_t>(f32.data())
                        : task::block_elements(dtype) > 1
                            ? reinterpret_cast<uintptr_t>(blocks.data())
                            : reinterpret_cast<uintptr_t>(half.data());
    return Tensor::contiguous(a, {out, in}, dtype).value();
  }
};

// n / 32 q8_0 blocks of random bytes: any int8 q (-128 included, which ggml's quantizer never
// writes but a file may hold) and a random f16 scale of either sign, every 7th block a scale that
// is subnormal in f16 and every 11th a zero scale; `values` holds d·q in f64.
TestWeights make_q8_0_weights(size_t n, uint32_t seed) {
  TestWeights w{DataType::kQ8_0, {}, {}, {}, {}};
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> q(-128, 127);
  std::uniform_real_distribution<float> d(-0.05f, 0.05f);
  for (size_t b = 0; b < n / 32; ++b) {
    uint16_t d_bits = task::f32_to_f16(d(rng));
    if (b % 7 == 3) d_bits = static_cast<uint16_t>(1 + b % 1000);  // f16 subnormal
    if (b % 11 == 5) d_bits = 0;
    w.blocks.push_back(static_cast<uint8_t>(d_bits & 0xff));
    w.blocks.push_back(static_cast<uint8_t>(d_bits >> 8));
    for (int i = 0; i < 32; ++i) {
      const int v = q(rng);
      w.blocks.push_back(static_cast<uint8_t>(static_cast<int8_t>(v)));
      w.values.push_back(double(task::f16_to_f32(d_bits)) * v);
    }
  }
  return w;
}

// n / 32 q4_0 blocks of random bytes (every nibble value) with q8_0's scales; `values` holds
// d·(nibble - 8) in f64, low nibbles first.
TestWeights make_q4_0_weights(size_t n, uint32_t seed) {
  TestWeights w = make_q8_0_weights(n, seed);  // its scales, its bytes' randomness
  w.dtype = DataType::kQ4_0;
  std::vector<uint8_t> blocks;
  w.values.clear();
  for (size_t b = 0; b < n / 32; ++b) {
    const uint8_t* q8 = w.blocks.data() + b * 34;
    blocks.insert(blocks.end(), q8, q8 + 18);  // d and 16 random bytes
    const double d = task::f16_to_f32(static_cast<uint16_t>(q8[0] | q8[1] << 8));
    for (int i = 0; i < 32; ++i) {
      const uint8_t byte = q8[2 + i % 16];
      w.values.push_back(d * ((i < 16 ? byte & 15 : byte >> 4) - 8));
    }
  }
  w.blocks = std::move(blocks);
  return w;
}

// A random f16 scale of either sign for super-block b: every 7th subnormal in f16, every 11th
// zero.
uint16_t random_f16_scale(std::mt19937& rng, size_t b) {
  std::uniform_real_distribution<float> d(-0.05f, 0.05f);
  uint16_t bits = task::f32_to_f16(d(rng));
  if (b % 7 == 3) bits = static_cast<uint16_t>(1 + b % 1000);
  if (b % 11 == 5) bits = 0;
  return bits;
}

// n / 256 q4_k super-blocks: random d and dmin (random_f16_scale), random packed scale bytes and
// nibbles. `values` follows ggml's dequantize_row_q4_K loop (64 weights at a time: sub-block 2c's
// low nibbles of qs[32c..], then sub-block 2c + 1's high ones) in f64: (d·sc)·q - dmin·m is exact
// there, then rounded once to f32, the value the kernels use.
TestWeights make_q4_k_weights(size_t n, uint32_t seed) {
  TestWeights w{DataType::kQ4_K, {}, {}, {}, {}};
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> byte(0, 255);
  for (size_t b = 0; b < n / 256; ++b) {
    const uint16_t d = random_f16_scale(rng, b), dmin = random_f16_scale(rng, b + 5);
    uint8_t block[144];
    std::memcpy(block, &d, 2);
    std::memcpy(block + 2, &dmin, 2);
    for (int i = 4; i < 144; ++i) block[i] = static_cast<uint8_t>(byte(rng));
    const uint8_t* sc = block + 4;
    for (int c = 0; c < 4; ++c) {
      for (int half = 0; half < 2; ++half) {
        const int j = 2 * c + half;
        const int scale = j < 4 ? sc[j] & 0x3f : (sc[j + 4] & 0x0f) | ((sc[j - 4] >> 6) << 4);
        const int min = j < 4 ? sc[j + 4] & 0x3f : (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4);
        for (int l = 0; l < 32; ++l) {
          const uint8_t q = block[16 + 32 * c + l];
          const double v = double(task::f16_to_f32(d)) * scale * (half == 0 ? q & 15 : q >> 4) -
                           double(task::f16_to_f32(dmin)) * min;
          w.values.push_back(static_cast<float>(v));
        }
      }
    }
    w.blocks.insert(w.blocks.end(), block, block + 144);
  }
  return w;
}

// n / 256 q6_k super-blocks: random ql, qh and int8 scales (-128 included), d by
// random_f16_scale. `values` follows ggml's dequantize_row_q6_K loop (each half of 128: l < 32
// gives weights l, l + 32, l + 64, l + 96) in f64, d·sc·(q - 32), exact in f32.
TestWeights make_q6_k_weights(size_t n, uint32_t seed) {
  TestWeights w{DataType::kQ6_K, {}, {}, {}, {}};
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> byte(0, 255);
  for (size_t b = 0; b < n / 256; ++b) {
    uint8_t block[210];
    for (int i = 0; i < 208; ++i) block[i] = static_cast<uint8_t>(byte(rng));
    const uint16_t d_bits = random_f16_scale(rng, b);
    std::memcpy(block + 208, &d_bits, 2);
    const double d = task::f16_to_f32(d_bits);
    std::vector<double> v(256);
    for (int h = 0; h < 2; ++h) {
      const uint8_t* ql = block + 64 * h;
      const uint8_t* qh = block + 128 + 32 * h;
      const auto* sc = reinterpret_cast<const int8_t*>(block + 192 + 8 * h);
      for (int l = 0; l < 32; ++l) {
        const int is = l / 16;
        const int q1 = ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
        const int q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
        const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
        const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
        v[128 * h + l] = d * sc[is] * q1;
        v[128 * h + l + 32] = d * sc[is + 2] * q2;
        v[128 * h + l + 64] = d * sc[is + 4] * q3;
        v[128 * h + l + 96] = d * sc[is + 6] * q4;
      }
    }
    w.values.insert(w.values.end(), v.begin(), v.end());
    w.blocks.insert(w.blocks.end(), block, block + 210);
  }
  return w;
}

TestWeights make_weights(DataType dtype, size_t n, uint32_t seed) {
  if (dtype == DataType::kQ8_0) return make_q8_0_weights(n, seed);
  if (dtype == DataType::kQ4_0) return make_q4_0_weights(n, seed);
  if (dtype == DataType::kQ4_K) return make_q4_k_weights(n, seed);
  if (dtype == DataType::kQ6_K) return make_q6_k_weights(n, seed);
  TestWeights w{dtype, random_floats(n, seed), {}, {}, {}};
  if (dtype != DataType::kFloat32) {
    for (float v : w.f32) {
      w.half.push_back(dtype == DataType::kBFloat16 ? task::f32_to_bf16(v) : task::f32_to_f16(v));
    }
    for (uint16_t h : w.half) {
      w.values.push_back(dtype == DataType::kBFloat16 ? task::bf16_to_f32(h) : task::f16_to_f32(h));
    }
  } else {
    w.values.assign(w.f32.begin(), w.f32.end());
  }
  return w;
}

// y[r, o] of x [rows, in] · Wᵀ in f64 (plus y0[r, o] when accumulating), and the magnitude of
// its terms (the tolerance's scale).
std::pair<double, double> f64_entry(const std::vector<float>& x, const TestWeights& w, int64_t in,
                                    int64_t out, int64_t r, int64_t o,
                                    const std::vector<float>* y0) {
  double want = y0 != nullptr ? (*y0)[r * out + o] : 0.0, mag = std::abs(want);
  // Through pointers: vector's operator[] is a call per element at the sanitizer builds' -O1.
  const float* xr = x.data() + r * in;
  const double* wo = w.values.data() + o * in;
  for (int64_t i = 0; i < in; ++i) {
    const double t = double(xr[i]) * wo[i];
    want += t;
    mag += std::abs(t);
  }
  return {want, mag};
}

// The args of y += x · Wᵀ (matmul_acc) when `acc`, else y = x · Wᵀ (matmul): x [rows, in],
// y [rows, out].
TaskArgs matmul_args_for(bool acc, std::vector<float>& x, TestWeights& w, std::vector<float>& y,
                         int64_t rows, int64_t in, int64_t out) {
  const Tensor xt = view(x, {rows, in}), yt = view(y, {rows, out});
  return acc ? matmul_acc_args(xt, w.tensor(out, in), yt) : matmul_args(xt, w.tensor(out, in), yt);
}

// Every y[r, o] within 1e-6 (relative to its terms' magnitude) of the f64 product of `x` and
// `w` (plus y0 when accumulating); `what` names the case in a failure.
void expect_f64_product(const std::vector<float>& y, const std::vector<float>& x,
                        const TestWeights& w, int64_t rows, int64_t in, int64_t out,
                        const std::vector<float>* y0, const std::string& what) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t o = 0; o < out; ++o) {
      const auto [want, mag] = f64_entry(x, w, in, out, r, o, y0);
      ASSERT_NEAR(y[r * out + o], want, 1e-6 * (1 + mag)) << what;
    }
  }
}

// y[r, o] by the numerics contract of matmul_impl.h itself, in scalar code: 16 lane sums, lane l
// taking x[r, k]·W[o, k] for k ≡ l (mod 16) in increasing k with a fused multiply-add (`fused`;
// else a multiply, then an add, as the portable path on a baseline without FMA), reduced by the
// fixed tree (then added to y0[r, o] when accumulating).
float contract_entry(const std::vector<float>& x, const TestWeights& w, int64_t in, int64_t out,
                     int64_t r, int64_t o, const std::vector<float>* y0, bool fused) {
  float l[16] = {};
  const float* xr = x.data() + r * in;  // pointers, as in f64_entry
  const double* wo = w.values.data() + o * in;
  for (int64_t i = 0; i < in; ++i) {
    const float a = xr[i], b = static_cast<float>(wo[i]);
    if (fused) {
      l[i % 16] = std::fma(a, b, l[i % 16]);
    } else {
      const float p = a * b;  // its own statement: never contracted into an FMA
      l[i % 16] = p + l[i % 16];
    }
  }
  float s8[8], s4[4];
  for (int i = 0; i < 8; ++i) s8[i] = l[i] + l[i + 8];
  for (int i = 0; i < 4; ++i) s4[i] = s8[i] + s8[i + 4];
  const float s = (s4[0] + s4[2]) + (s4[1] + s4[3]);
  return y0 != nullptr ? (*y0)[r * out + o] + s : s;
}

// y (rows x out) bitwise the contract's (contract_entry) for the numerics of `isa`.
void expect_contract_bits(const std::vector<float>& y, const std::vector<float>& x,
                          const TestWeights& w, int64_t rows, int64_t in, int64_t out,
                          const std::vector<float>* y0, KernelIsa isa, const std::string& what) {
  const bool fused = kernel_isa_fused(isa);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t o = 0; o < out; ++o) {
      const float want = contract_entry(x, w, in, out, r, o, y0, fused);
      ASSERT_EQ(std::bit_cast<uint32_t>(y[r * out + o]), std::bit_cast<uint32_t>(want))
          << what << " (" << (fused ? "fused" : "multiply, then add") << ") at " << r << ", " << o
          << ": " << y[r * out + o] << " against " << want;
    }
  }
}

// x [rows, in] · W [out, in]ᵀ of dtype `dt` on every ISA path this CPU has, with and without
// accumulating into y: each result bitwise its contract's (expect_contract_bits), and, when
// `near_f64`, within 1e-6 · (1 + Σ|terms|) of the f64 product.
void expect_every_path(DataType dt, int64_t rows, int64_t in, int64_t out, uint32_t seed,
                       bool near_f64) {
  std::vector<float> x = random_floats(rows * in, seed + rows + in);
  TestWeights w = make_weights(dt, out * in, seed + 1 + out + in);
  std::vector<float> y0 = random_floats(rows * out, seed + 2);
  for (bool acc : {false, true}) {
    // Results that passed both checks, with their numerics (fused or not): a path whose result
    // is bitwise one of them passes the same checks, so the references are not summed again.
    std::vector<std::pair<bool, std::vector<float>>> passed;
    for (auto [isa, fn] : matmul_paths(Precision::kExact, acc)) {
      std::vector<float> y = acc ? y0 : std::vector<float>(rows * out, NAN);
      ASSERT_TRUE(run_blocks(fn, matmul_args_for(acc, x, w, y, rows, in, out), 2).ok());
      const bool fused = kernel_isa_fused(isa);
      if (std::any_of(passed.begin(), passed.end(), [&](const auto& p) {
            return p.first == fused && std::memcmp(p.second.data(), y.data(), y.size() * 4) == 0;
          })) {
        continue;
      }
      const std::string what =
          (::testing::Message() << name_of(isa) << " " << task::name_of(dt) << " rows " << rows
                                << " in " << in << " out " << out << " acc " << acc)
              .GetString();
      if (near_f64) {
        ASSERT_NO_FATAL_FAILURE(
            expect_f64_product(y, x, w, rows, in, out, acc ? &y0 : nullptr, what));
      }
      ASSERT_NO_FATAL_FAILURE(
          expect_contract_bits(y, x, w, rows, in, out, acc ? &y0 : nullptr, isa, what));
      passed.emplace_back(fused, std::move(y));
    }
  }
}

// Every ISA path this CPU has (portable always), on odd shapes (rows 1, 3, 16, 17; K below, at
// and past the 16-lane width and its 8- and 4-lane parts) and every weight dtype: close to the
// f64 product of the same (widened) values, and bitwise the contract's (contract_entry: fused
// on every target but a portable path built without FMA, which must give the multiply-then-add
// bits). Paths the CPU lacks are named, visibly, as not tested here.
TEST(MatmulKernel, IsaPathsMatchTheF64ReferenceAndEachOtherOnOddShapes) {
  for (KernelIsa isa : {KernelIsa::kX86_64V3, KernelIsa::kAvx512, KernelIsa::kNeon}) {
    if (!kernel_isa_available(isa)) {
      std::cout << "[ NOTE     ] this CPU lacks " << kernel_isa_requirements(isa) << ": the "
                << name_of(isa) << " path is not tested here\n";
    }
  }
  ASSERT_GE(matmul_paths(Precision::kExact, false).size(), 1u);
  for (DataType dt : {DataType::kFloat32, DataType::kBFloat16, DataType::kFloat16}) {
    for (int64_t rows : {1, 3, 16, 17}) {
      for (int64_t in : {1, 3, 7, 9, 15, 16, 17, 100}) {
        for (int64_t out : {1, 5, 9, 37}) {
          ASSERT_NO_FATAL_FAILURE(expect_every_path(dt, rows, in, out, 11, true));
        }
      }
    }
  }
}

// The bf16 path (precision bf16) on odd shapes (rows 1, 3, 15 on our streaming kernel; 16, 17,
// 64 on oneDNN's GEMM, the threshold being matmul_detail::kDnnlMinRows; K below, at and past
// the 32-wide chunk): close to the f64 product of the bf16-rounded x and the bf16 weights (its
// products are exact, only the f32 sums round). Below the threshold a row's result is bitwise
// the same alone and in a batch (oneDNN's GEMM does not promise that). f32 and f16 weights stay
// on the exact path. Skipped, visibly, without AVX512_BF16.
TEST(MatmulKernel, Bf16PathMatchesTheF64ProductOfBf16RoundedInputs) {
  if (!bf16_precision_available()) {
    GTEST_SKIP() << "this CPU has no AVX512_BF16: the bf16 path is not tested here";
  }
  const auto kernels = llm_kernels(KernelIsa::kAvx512, Precision::kBf16);
  for (bool acc : {false, true}) {
    const task::KernelFn fn =
        kernels[static_cast<size_t>(acc ? KernelId::kMatmulAcc : KernelId::kMatmul)].fn;
    for (int64_t rows : {1, 3, 15, 16, 17, 64}) {
      for (int64_t in : {1, 31, 32, 33, 100, 300}) {
        for (int64_t out : {1, 5, 37}) {
          std::vector<float> x = random_floats(rows * in, 31 + rows + in);
          std::vector<float> xb;  // x as the bf16 path sees it
          for (float v : x) xb.push_back(task::bf16_to_f32(task::f32_to_bf16(v)));
          TestWeights w = make_weights(DataType::kBFloat16, out * in, 32 + out);
          std::vector<float> y0 = random_floats(rows * out, 33);
          std::vector<float> y = acc ? y0 : std::vector<float>(rows * out, NAN);
          ASSERT_TRUE(run_blocks(fn, matmul_args_for(acc, x, w, y, rows, in, out), 2).ok());
          ASSERT_NO_FATAL_FAILURE(
              expect_f64_product(y, xb, w, rows, in, out, acc ? &y0 : nullptr,
                                 (::testing::Message() << "rows " << rows << " in " << in << " out "
                                                       << out << " acc " << acc)
                                     .GetString()));
          if (rows >= matmul_detail::kDnnlMinRows) continue;
          // Row r alone gives the same bits as row r in the batch.
          const int64_t r = rows - 1;
          std::vector<float> x1(x.begin() + r * in, x.begin() + (r + 1) * in);
          std::vector<float> y1(y0.begin() + r * out, y0.begin() + (r + 1) * out);
          if (!acc) y1.assign(out, NAN);
          ASSERT_TRUE(run_blocks(fn, matmul_args_for(acc, x1, w, y1, 1, in, out), 1).ok());
          for (int64_t o = 0; o < out; ++o) {
            ASSERT_EQ(std::bit_cast<uint32_t>(y1[o]), std::bit_cast<uint32_t>(y[r * out + o]))
                << "row " << r << " alone and in a batch of " << rows << " differ";
          }
        }
      }
    }
  }
  // The model load's line names both halves of the path and oneDNN's implementation.
  const std::string described = describe_bf16_precision();
  EXPECT_THAT(described, HasSubstr(absl::StrCat("fewer than ", matmul_detail::kDnnlMinRows,
                                                " rows on simpler's AVX-512 BF16 kernel")));
  EXPECT_THAT(described, HasSubstr("batched rows on oneDNN "));
  EXPECT_THAT(described, ::testing::Not(HasSubstr("unavailable")));
  EXPECT_THAT(described, HasSubstr("AMX"));  // which of: none, in use, not granted
  // f32 weights under precision bf16 stay exact: bitwise the avx512 exact path.
  const int64_t rows = 3, in = 40, out = 7;
  std::vector<float> x = random_floats(rows * in, 41);
  TestWeights w = make_weights(DataType::kFloat32, out * in, 42);
  std::vector<float> y_bf16(rows * out), y_exact(rows * out);
  ASSERT_TRUE(
      run_blocks(kernels[static_cast<size_t>(KernelId::kMatmul)].fn,
                 matmul_args(view(x, {rows, in}), w.tensor(out, in), view(y_bf16, {rows, out})), 1)
          .ok());
  ASSERT_TRUE(
      run_blocks(
          llm_kernels(KernelIsa::kAvx512, Precision::kExact)[static_cast<size_t>(KernelId::kMatmul)]
              .fn,
          matmul_args(view(x, {rows, in}), w.tensor(out, in), view(y_exact, {rows, out})), 1)
          .ok());
  EXPECT_EQ(y_bf16, y_exact);
  EXPECT_EQ(parse_precision("bf16").value(), Precision::kBf16);
  EXPECT_EQ(parse_precision("fp8").status().code(), absl::StatusCode::kInvalidArgument);
}

// Long K, past the blocks of k that several x rows take (k split evenly into blocks that keep
// x in L1, the lane sums carried between them; the last block ends inside a 16-lane chunk and
// inside a part): every path this CPU has gives its contract's bits exactly, for every dtype.
TEST(MatmulKernel, LongKAcrossBlocksGivesTheContractsBitsOnEveryPath) {
  for (DataType dt : {DataType::kFloat32, DataType::kBFloat16, DataType::kFloat16}) {
    for (int64_t rows : {1, 2, 5, 17}) {
      for (int64_t in : {1100, 2503, 4100}) {
        ASSERT_NO_FATAL_FAILURE(expect_every_path(dt, rows, in, 7, 21, false));
      }
    }
  }
  // q8_0 and q4_0 rows are whole blocks of 32: K past the blocks of k, not a multiple of 256.
  for (DataType dt : {DataType::kQ8_0, DataType::kQ4_0}) {
    for (int64_t rows : {1, 2, 5, 17}) {
      for (int64_t in : {1120, 2528, 4128}) {
        ASSERT_NO_FATAL_FAILURE(expect_every_path(dt, rows, in, 7, 23, false));
      }
    }
  }
  // q4_k and q6_k rows are whole super-blocks of 256.
  for (DataType dt : {DataType::kQ4_K, DataType::kQ6_K}) {
    for (int64_t rows : {1, 2, 5, 17}) {
      for (int64_t in : {1280, 2560, 4352}) {
        ASSERT_NO_FATAL_FAILURE(expect_every_path(dt, rows, in, 7, 25, false));
      }
    }
  }
}

// q8_0 weights (dequantized in registers) on every ISA path this CPU has, on odd shapes: rows 1 to
// 17, K a multiple of the block of 32 but not of 256 (and at, below and past the 16-lane chunks
// that split a block), outputs past the register tiles. Each result is within 1e-6 · (1 + Σ|terms|)
// of the f64 product of x and the dequantized weights d·q, and bitwise the contract's on those
// weights (d·q is exact in f32, so quantized weights change nothing in the numerics contract).
TEST(MatmulKernel, Q8_0PathsMatchTheDequantizedF64ReferenceOnOddShapes) {
  ASSERT_GE(matmul_paths(Precision::kExact, false).size(), 1u);
  for (int64_t rows = 1; rows <= 17; ++rows) {
    for (int64_t in : {32, 64, 96, 160, 288}) {
      for (int64_t out : {1, 5, 9, 37}) {
        ASSERT_NO_FATAL_FAILURE(expect_every_path(DataType::kQ8_0, rows, in, out, 13, true));
      }
    }
  }
}

// The same for q4_0 weights (d·(nibble - 8), low nibbles first in a block: exact in f32).
TEST(MatmulKernel, Q4_0PathsMatchTheDequantizedF64ReferenceOnOddShapes) {
  for (int64_t rows = 1; rows <= 17; ++rows) {
    for (int64_t in : {32, 64, 96, 160, 288}) {
      for (int64_t out : {1, 5, 9, 37}) {
        ASSERT_NO_FATAL_FAILURE(expect_every_path(DataType::kQ4_0, rows, in, out, 17, true));
      }
    }
  }
}

void expect_batch_invariant(DataType dt, int64_t in);

// The same for q4_k (one rounding of (d·sc)·q - dmin·m, the same on every path) and q6_k
// (d·sc·(q - 32), exact) weights: rows 1 to 7 (every remainder of the 2-, 4- and 6-row tiles), 12
// and 17, K one to three super-blocks, outputs past the tiles; scales of both signs, subnormal and
// zero, and every packed scale, min and 6-bit value.
TEST(MatmulKernel, Q4_KAndQ6_KPathsMatchTheDequantizedF64ReferenceOnOddShapes) {
  for (DataType dt : {DataType::kQ4_K, DataType::kQ6_K}) {
    for (int64_t rows : {1, 2, 3, 4, 5, 6, 7, 12, 17}) {
      for (int64_t in : {256, 512, 768}) {
        for (int64_t out : {1, 5, 9, 37}) {
          ASSERT_NO_FATAL_FAILURE(expect_every_path(dt, rows, in, out, 19, true));
        }
      }
    }
  }
}

// A q8_0, q4_k or q6_k row of whole blocks is a row's result whatever the batch and block split.
TEST(MatmulKernel, QuantizedRowsAreBatchInvariantOnEveryPath) {
  for (DataType dt : {DataType::kQ8_0, DataType::kQ4_K, DataType::kQ6_K}) {
    SCOPED_TRACE(task::name_of(dt));
    ASSERT_NO_FATAL_FAILURE(expect_batch_invariant(dt, dt == DataType::kQ8_0 ? 96 : 512));
  }
}

// Row 16 of x, alone and in batches of 2, 6 and 17 rows split into 1 or 3 blocks, gives the same
// bits on every path.
void expect_batch_invariant(DataType dt, int64_t in) {
  const int64_t out = 37;
  TestWeights w = make_weights(dt, out * in, 51);
  std::vector<float> x = random_floats(17 * in, 52);
  for (auto [isa, fn] : matmul_paths(Precision::kExact, false)) {
    std::vector<float> alone(out);
    std::vector<float> x1(x.end() - in, x.end());
    ASSERT_TRUE(run_blocks(fn, matmul_args_for(false, x1, w, alone, 1, in, out), 1).ok());
    for (int64_t rows : {2, 6, 17}) {
      std::vector<float> xb(x.end() - rows * in, x.end());
      for (int32_t bd : {1, 3}) {
        std::vector<float> y(rows * out, NAN);
        ASSERT_TRUE(run_blocks(fn, matmul_args_for(false, xb, w, y, rows, in, out), bd).ok());
        for (int64_t o = 0; o < out; ++o) {
          ASSERT_EQ(std::bit_cast<uint32_t>(y[(rows - 1) * out + o]),
                    std::bit_cast<uint32_t>(alone[o]))
              << name_of(isa) << " rows " << rows << " blocks " << bd << " output " << o;
        }
      }
    }
  }
}

// q8_0 and q4_k weights whose rows are not whole blocks (of 32, of 256) are refused, naming the
// argument (matmul and the embedding table alike).
TEST(MatmulKernel, QuantizedRowsThatAreNotWholeBlocksAreInvalidArgument) {
  std::vector<float> x(2 * 48), y(2 * 3);
  std::vector<uint8_t> w(3 * 51);  // a byte count that would hold 1.5 blocks a row
  const Tensor wt =
      Tensor::contiguous(reinterpret_cast<uintptr_t>(w.data()), {3, 48}, DataType::kQ8_0).value();
  absl::Status s =
      run_blocks(&matmul_kernel, matmul_args(view(x, {2, 48}), wt, view(y, {2, 3})), 1);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(),
            "matmul: argument 1 (W) is q8_0 with rows of 48 weights, not a whole number of blocks "
            "of 32");
  std::vector<int32_t> ids = {0};
  std::vector<float> out(48);
  s = run_blocks(&embedding_kernel, embedding_args(view(ids, {1}), wt, view(out, {1, 48})), 1);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(),
            "embedding: argument 1 (table) is q8_0 with rows of 48 weights, not a whole number of "
            "blocks of 32");
  // q4_k rows are whole super-blocks of 256.
  std::vector<uint8_t> k(3 * 144);
  std::vector<float> xk(2 * 128), yk(2 * 3);
  const Tensor kt =
      Tensor::contiguous(reinterpret_cast<uintptr_t>(k.data()), {3, 128}, DataType::kQ4_K).value();
  s = run_blocks(&matmul_kernel, matmul_args(view(xk, {2, 128}), kt, view(yk, {2, 3})), 1);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(),
            "matmul: argument 1 (W) is q4_k with rows of 128 weights, not a whole number of blocks "
            "of 256");
}

// The portable path alone, on every machine: the f64 reference on odd shapes and bf16 weights.
TEST(MatmulKernel, PortablePathMatchesTheF64Reference) {
  const auto kernels = llm_kernels(KernelIsa::kPortable, Precision::kExact);
  const task::KernelFn fn = kernels[static_cast<size_t>(KernelId::kMatmul)].fn;
  const int64_t rows = 17, in = 33, out = 9;
  std::vector<float> x = random_floats(rows * in, 21);
  TestWeights w = make_weights(DataType::kBFloat16, out * in, 22);
  std::vector<float> y(rows * out, NAN);
  ASSERT_TRUE(
      run_blocks(fn, matmul_args(view(x, {rows, in}), w.tensor(out, in), view(y, {rows, out})), 3)
          .ok());
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t o = 0; o < out; ++o) {
      double want = 0;
      for (int64_t i = 0; i < in; ++i) want += double(x[r * in + i]) * w.values[o * in + i];
      ASSERT_NEAR(y[r * out + o], want, 1e-5) << r << " " << o;
    }
  }
}

// The portable attention tile's fused multiply-add, computed in double without libm, against libm's
// fmaf (correctly rounded) on random operands and on the cases that need the round-to-odd step:
// products whose exact sum with c falls just off a float halfway point, signed zeros,
// subnormals, overflow, infinities and NaN.
TEST(MatmulKernel, PortableAttentionFmaIsCorrectlyRounded) {
  std::mt19937 gen(5);
  std::uniform_real_distribution<float> u(-2.0f, 2.0f);
  std::uniform_int_distribution<int> e(-30, 30);
  auto same = [](float a, float b) {
    return std::bit_cast<uint32_t>(a) == std::bit_cast<uint32_t>(b) ||
           (std::isnan(a) && std::isnan(b));
  };
  for (int i = 0; i < 2000000; ++i) {
    const float a = std::ldexp(u(gen), e(gen)), b = std::ldexp(u(gen), e(gen));
    const float c = i % 3 == 0 ? -a * b : std::ldexp(u(gen), e(gen));
    ASSERT_TRUE(same(matmul_detail::fma_exact_attention(a, b, c), std::fma(a, b, c)))
        << a << " * " << b << " + " << c;
  }
  // Exact sums on, just above and just below a float halfway point, and cancellations. With
  // h = 1 + 2^-12, h·h = 1 + 2^-11 + 2^-24 is a halfway point between two floats; adding 2^-70
  // puts the exact sum just above it, but rounding the sum to double first lands on the halfway
  // point and then rounds to even, down: only the round-to-odd step gets it right.
  const float h = 1.0f + 0x1p-12f;
  const float one_ulp = 1.0f + 0x1p-23f;
  const float big = std::numeric_limits<float>::max(),
              tiny = std::numeric_limits<float>::denorm_min();
  const float inf = std::numeric_limits<float>::infinity(), nan = std::nanf("");
  const float cases[][3] = {{h, h, 0x1p-70f},
                            {-h, h, -0x1p-70f},
                            {h, h, -0x1p-70f},
                            {h, h, 0.0f},
                            {one_ulp, one_ulp, -0x1p-24f},
                            {one_ulp, one_ulp, 0x1p-24f},
                            {one_ulp, -one_ulp, 0x1p-24f},
                            {1.0f, 1.0f, 0x1p-24f},
                            {1.0f, 1.0f, 0x1p-25f},
                            {1.0f + 0x1p-22f, 1.0f, -0x1p-60f},
                            {0.0f, -1.0f, 0.0f},
                            {-0.0f, 1.0f, -0.0f},
                            {tiny, 0.5f, 0.0f},
                            {tiny, 1.5f, tiny},
                            {big, 2.0f, -big},
                            {big, big, 0.0f},
                            {inf, 0.0f, 1.0f},
                            {inf, 1.0f, -inf},
                            {nan, 1.0f, 1.0f},
                            {2.0f, 3.0f, inf}};
  for (const auto& t : cases) {
    EXPECT_TRUE(
        same(matmul_detail::fma_exact_attention(t[0], t[1], t[2]), std::fma(t[0], t[1], t[2])))
        << t[0] << " * " << t[1] << " + " << t[2] << " (attention's)";
  }
}

TEST(MatmulKernel, IsaNamesParseAndUnknownOnesAreRefused) {
  EXPECT_THAT(available_kernel_isas(), HasSubstr("portable"));
  EXPECT_TRUE(kernel_isa_available(resolve_kernel_isa(KernelIsa::kAuto)));
  EXPECT_EQ(parse_kernel_isa("x86-64-v3").value(), KernelIsa::kX86_64V3);
  EXPECT_STREQ(kernel_isa_requirements(KernelIsa::kX86_64V3), "AVX2, FMA and F16C");
  for (KernelIsa isa : {KernelIsa::kAuto, KernelIsa::kAvx512, KernelIsa::kX86_64V3,
                        KernelIsa::kPortable, KernelIsa::kNeon}) {
    EXPECT_EQ(parse_kernel_isa(name_of(isa)).value(), isa);
  }
  // A binary holds its architecture's targets only: the others are named but unavailable.
#if defined(__x86_64__)
  EXPECT_FALSE(kernel_isa_available(KernelIsa::kNeon));
  EXPECT_THAT(available_kernel_isas(), ::testing::Not(HasSubstr("neon")));
#elif defined(__aarch64__)
  EXPECT_TRUE(kernel_isa_available(KernelIsa::kNeon));
  EXPECT_FALSE(kernel_isa_available(KernelIsa::kAvx512));
#endif
  auto bad = parse_kernel_isa("sse9");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("'sse9'"));
  EXPECT_NE(resolve_kernel_isa(KernelIsa::kAuto), KernelIsa::kAuto);
}

TEST(EmbeddingKernel, WidensBf16AndF16TablesExactly) {
  for (DataType dt : {DataType::kBFloat16, DataType::kFloat16}) {
    TestWeights table = make_weights(dt, 5 * 7, 31);
    std::vector<int32_t> ids = {4, 0, 4};
    std::vector<float> out(3 * 7, NAN);
    ASSERT_TRUE(run_blocks(&embedding_kernel,
                           embedding_args(view(ids, {3}), table.tensor(5, 7), view(out, {3, 7})), 2)
                    .ok());
    for (int64_t r = 0; r < 3; ++r) {
      for (int64_t i = 0; i < 7; ++i) {
        ASSERT_EQ(out[r * 7 + i], static_cast<float>(table.values[ids[r] * 7 + i]));
      }
    }
  }
}

// A q8_0, q4_0, q4_k or q6_k table's gathered rows are dequantized to the values the matmul uses
// (exact but for q4_k's one rounding).
TEST(EmbeddingKernel, DequantizesQuantizedRowsExactly) {
  for (DataType dt : {DataType::kQ8_0, DataType::kQ4_0, DataType::kQ4_K, DataType::kQ6_K}) {
    const int64_t vocab = 5, hidden = task::block_elements(dt) == 256 ? 512 : 96;
    TestWeights table = make_weights(dt, vocab * hidden, 33);
    std::vector<int32_t> ids = {4, 0, 2, 4};
    std::vector<float> out(4 * hidden, NAN);
    ASSERT_TRUE(
        run_blocks(
            &embedding_kernel,
            embedding_args(view(ids, {4}), table.tensor(vocab, hidden), view(out, {4, hidden})), 3)
            .ok());
    for (int64_t r = 0; r < 4; ++r) {
      for (int64_t i = 0; i < hidden; ++i) {
        ASSERT_EQ(out[r * hidden + i], static_cast<float>(table.values[ids[r] * hidden + i]))
            << task::name_of(dt) << " row " << r << " element " << i;
      }
    }
  }
}

// ---- matmul_merged / matmul_silu_mul ----

// The precisions whose merged kernels are tested: exact and int8 everywhere, bf16 where the CPU
// has its path.
std::vector<Precision> merged_precisions() {
  std::vector<Precision> p = {Precision::kExact, Precision::kInt8};
  if (bf16_precision_available()) p.push_back(Precision::kBf16);
  return p;
}

// Bitwise equality of two outputs, naming the case.
void expect_same_bits(const std::vector<float>& got, const std::vector<float>& want,
                      const std::string& what) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_EQ(std::bit_cast<uint32_t>(got[i]), std::bit_cast<uint32_t>(want[i]))
        << what << ": element " << i << " is " << got[i] << ", its own matmul " << want[i];
  }
}

// Every output of a merged task — weights of mixed dtypes (Q4_K_M's Q4_K q/k beside a Q6_K v,
// among others), 1 to 4 of them, odd row counts — is bitwise the output of a matmul task of its
// weight alone, on every ISA path and precision, whatever the block split and whether the blocks
// claim rows one after another or at once on threads (claims that span two weights included).
TEST(MatmulMergedKernel, EachOutputIsBitwiseItsOwnMatmulOnEveryPathAndPrecision) {
  const std::vector<std::vector<DataType>> mixes = {
      {DataType::kQ4_K, DataType::kQ4_K, DataType::kQ6_K},
      {DataType::kQ8_0, DataType::kQ4_0, DataType::kQ8_0},
      {DataType::kFloat32, DataType::kBFloat16, DataType::kFloat16},
      {DataType::kQ6_K},
      {DataType::kQ4_K, DataType::kBFloat16, DataType::kQ8_0, DataType::kQ6_K}};
  const int64_t in = 512, outs[] = {37, 16, 21, 5};
  for (const std::vector<DataType>& mix : mixes) {
    std::vector<TestWeights> ws;
    for (size_t i = 0; i < mix.size(); ++i) {
      ws.push_back(make_weights(mix[i], outs[i] * in, 60 + static_cast<uint32_t>(i)));
    }
    for (int64_t rows : {1, 3, 17}) {
      std::vector<float> x = random_floats(rows * in, 70);
      for (Precision precision : merged_precisions()) {
        for (auto [isa, matmul] : matmul_paths(precision, false)) {
          const task::KernelFn merged =
              llm_kernels(isa, precision)[static_cast<size_t>(KernelId::kMatmulMerged)].fn;
          std::vector<std::vector<float>> want(mix.size()), got(mix.size());
          std::vector<Tensor> wt, yt;
          for (size_t i = 0; i < mix.size(); ++i) {
            want[i].assign(rows * outs[i], NAN);
            ASSERT_TRUE(
                run_blocks(matmul, matmul_args_for(false, x, ws[i], want[i], rows, in, outs[i]), 1)
                    .ok());
            wt.push_back(ws[i].tensor(outs[i], in));
          }
          for (int32_t blocks : {1, 2, 3}) {
            for (bool threads : {false, true}) {
              yt.clear();
              for (size_t i = 0; i < mix.size(); ++i) {
                got[i].assign(rows * outs[i], NAN);
                yt.push_back(view(got[i], {rows, outs[i]}));
              }
              ASSERT_TRUE(
                  testing::run_blocks_sharing_lines(
                      merged, matmul_merged_args(view(x, {rows, in}), wt, yt), blocks, threads)
                      .ok());
              for (size_t i = 0; i < mix.size(); ++i) {
                ASSERT_NO_FATAL_FAILURE(
                    expect_same_bits(got[i], want[i],
                                     absl::StrCat(name_of(isa), " ", name_of(precision), " ",
                                                  std::string(task::name_of(mix[i])), " weight ", i,
                                                  " of ", mix.size(), ", rows ", rows, ", blocks ",
                                                  blocks, threads ? " on threads" : "")));
              }
            }
          }
        }
      }
    }
  }
}

// gate, up and act of matmul_silu_mul are bitwise two matmul tasks and a silu_mul task, on every
// path and precision and block split.
TEST(MatmulSiluMulKernel, IsBitwiseTwoMatmulsThenSiluMulOnEveryPathAndPrecision) {
  const int64_t in = 256, I = 53;
  for (auto [gate_dt, up_dt] :
       {std::pair{DataType::kQ4_K, DataType::kQ6_K}, std::pair{DataType::kQ8_0, DataType::kQ8_0},
        std::pair{DataType::kBFloat16, DataType::kFloat32}}) {
    TestWeights wg = make_weights(gate_dt, I * in, 80), wu = make_weights(up_dt, I * in, 81);
    for (int64_t rows : {1, 5}) {
      std::vector<float> x = random_floats(rows * in, 82, -3.0f, 3.0f);
      for (Precision precision : merged_precisions()) {
        for (auto [isa, matmul] : matmul_paths(precision, false)) {
          const auto kernels = llm_kernels(isa, precision);
          std::vector<float> g(rows * I), u(rows * I), act(rows * I);
          ASSERT_TRUE(run_blocks(matmul, matmul_args_for(false, x, wg, g, rows, in, I), 1).ok());
          ASSERT_TRUE(run_blocks(matmul, matmul_args_for(false, x, wu, u, rows, in, I), 1).ok());
          ASSERT_TRUE(
              run_blocks(
                  kernels[static_cast<size_t>(KernelId::kSiluMul)].fn,
                  silu_mul_args(view(g, {rows, I}), view(u, {rows, I}), view(act, {rows, I})), 1)
                  .ok());
          for (int32_t blocks : {1, 2, 3}) {
            std::vector<float> g2(rows * I, NAN), u2(rows * I, NAN), act2(rows * I, NAN);
            ASSERT_TRUE(testing::run_blocks_sharing_lines(
                            kernels[static_cast<size_t>(KernelId::kMatmulSiluMul)].fn,
                            matmul_silu_mul_args(view(x, {rows, in}), wg.tensor(I, in),
                                                 wu.tensor(I, in), view(g2, {rows, I}),
                                                 view(u2, {rows, I}), view(act2, {rows, I})),
                            blocks, blocks == 3)
                            .ok());
            const std::string what =
                absl::StrCat(name_of(isa), " ", std::string(task::name_of(gate_dt)), "/",
                             std::string(task::name_of(up_dt)), " rows ", rows, " blocks ", blocks);
            ASSERT_NO_FATAL_FAILURE(expect_same_bits(g2, g, what + " gate"));
            ASSERT_NO_FATAL_FAILURE(expect_same_bits(u2, u, what + " up"));
            ASSERT_NO_FATAL_FAILURE(expect_same_bits(act2, act, what + " act"));
          }
        }
      }
    }
  }
}

// w (q4_k, q6_k or q8_0, [out, in]) with its rows interleaved 16 at a time (q4_k_r16, q6_k_r16,
// q8_0_r16).
TestWeights interleaved(const TestWeights& w, int64_t out, int64_t in) {
  TestWeights r = w;
  r.dtype = task::interleaved_of(w.dtype);
  task::interleave_rows(r.dtype, w.blocks.data(), out, in, r.blocks.data());
  return r;
}

// Weights whose rows are interleaved 16 at a time give bitwise their plain form's outputs in
// every kernel that reads weights — matmul and matmul_acc (int8 and exact, every path, one to
// three blocks whose claims then come in whole groups, in turn and on threads), matmul_merged
// beside plain weights, matmul_silu_mul, and the embedding's gathered rows.
TEST(InterleavedWeights, GiveThePlainWeightsBitsInEveryKernelThatReadsWeights) {
  const int64_t in = 512, out = 1040;  // 65 groups: three blocks' row shares would split groups
  for (DataType dt : {DataType::kQ4_K, DataType::kQ6_K, DataType::kQ8_0}) {
    TestWeights w = make_weights(dt, out * in, 90), wi = interleaved(w, out, in);
    for (int64_t rows : {1, 5}) {
      std::vector<float> x = random_floats(rows * in, 91);
      for (Precision precision : {Precision::kInt8, Precision::kExact}) {
        for (bool acc : {false, true}) {  // matmul and matmul_acc
          for (auto [isa, matmul] : matmul_paths(precision, acc)) {
            std::vector<float> want(rows * out, acc ? 0.25f : NAN);
            ASSERT_TRUE(
                run_blocks(matmul, matmul_args_for(acc, x, w, want, rows, in, out), 1).ok());
            for (int32_t blocks : {1, 3}) {
              for (bool threads : {false, true}) {
                std::vector<float> got(rows * out, acc ? 0.25f : NAN);
                ASSERT_TRUE(
                    testing::run_blocks_sharing_lines(
                        matmul, matmul_args_for(acc, x, wi, got, rows, in, out), blocks, threads)
                        .ok());
                ASSERT_NO_FATAL_FAILURE(expect_same_bits(
                    got, want,
                    absl::StrCat(std::string(task::name_of(wi.dtype)), " ", name_of(isa), " ",
                                 name_of(precision), " acc ", acc ? 1 : 0, " rows ", rows,
                                 " blocks ", blocks, threads ? " on threads" : "")));
              }
            }
          }
        }
      }
    }
  }
}

// matmul_merged over an interleaved `dt` (q4_k or q8_0) of 48 rows, a plain q6_k and a plain `dt`
// of 16, then matmul_silu_mul over the interleaved `dt` and an interleaved q6_k: bitwise the
// plain weights' outputs (MergedTasksMixThemWithPlainWeights).
void expect_merged_mix(DataType dt) {
  const int64_t in = 512, outs[] = {48, 32, 16};
  std::vector<TestWeights> plain = {make_weights(dt, 48 * in, 93),
                                    make_weights(DataType::kQ6_K, 32 * in, 94),
                                    make_weights(dt, 16 * in, 95)};
  std::vector<TestWeights> mixed = {interleaved(plain[0], 48, in), plain[1], plain[2]};
  TestWeights up = make_weights(DataType::kQ6_K, 48 * in, 96);
  for (int64_t rows : {1, 3}) {
    std::vector<float> x = random_floats(rows * in, 92);
    for (Precision precision : {Precision::kInt8, Precision::kExact}) {
      for (auto [isa, matmul] : matmul_paths(precision, false)) {
        const auto kernels = llm_kernels(isa, precision);
        std::vector<std::vector<float>> want(3), got(3);
        std::vector<Tensor> wt, yt;
        for (size_t i = 0; i < 3; ++i) {
          want[i].assign(rows * outs[i], NAN);
          got[i].assign(rows * outs[i], NAN);
          ASSERT_TRUE(
              run_blocks(matmul, matmul_args_for(false, x, plain[i], want[i], rows, in, outs[i]), 1)
                  .ok());
          wt.push_back(mixed[i].tensor(outs[i], in));
          yt.push_back(view(got[i], {rows, outs[i]}));
        }
        for (int32_t blocks : {1, 2}) {
          ASSERT_TRUE(testing::run_blocks_sharing_lines(
                          kernels[static_cast<size_t>(KernelId::kMatmulMerged)].fn,
                          matmul_merged_args(view(x, {rows, in}), wt, yt), blocks, blocks == 2)
                          .ok());
          for (size_t i = 0; i < 3; ++i) {
            ASSERT_NO_FATAL_FAILURE(expect_same_bits(
                got[i], want[i],
                absl::StrCat(std::string(task::name_of(dt)), " ", name_of(isa), " merged weight ",
                             i, " rows ", rows, " blocks ", blocks)));
          }
        }
        std::vector<float> g(rows * 48, NAN), u(rows * 48, NAN), act(rows * 48, NAN),
            u_want(rows * 48);
        ASSERT_TRUE(
            run_blocks(matmul, matmul_args_for(false, x, up, u_want, rows, in, 48), 1).ok());
        ASSERT_TRUE(
            testing::run_blocks_sharing_lines(
                kernels[static_cast<size_t>(KernelId::kMatmulSiluMul)].fn,
                matmul_silu_mul_args(view(x, {rows, in}), mixed[0].tensor(48, in),
                                     interleaved(up, 48, in).tensor(48, in), view(g, {rows, 48}),
                                     view(u, {rows, 48}), view(act, {rows, 48})),
                3, true)
                .ok());
        ASSERT_NO_FATAL_FAILURE(expect_same_bits(g, want[0], absl::StrCat(name_of(isa), " gate")));
        ASSERT_NO_FATAL_FAILURE(expect_same_bits(u, u_want, absl::StrCat(name_of(isa), " up")));
      }
    }
  }
}

// matmul_merged over q4_k_r16, a plain q6_k and a plain q4_k (x quantized for q4_k is not shared
// between the two layouts: the avx512 kernels read it permuted for a plain q4_k at one x row),
// its one block claiming in order (q4_k_r16 first) or two on threads; matmul_silu_mul over
// q4_k_r16 and q6_k_r16. The same with q8_0_r16 beside a plain q8_0.
TEST(InterleavedWeights, MergedTasksMixThemWithPlainWeights) {
  for (DataType dt : {DataType::kQ4_K, DataType::kQ8_0}) {
    ASSERT_NO_FATAL_FAILURE(expect_merged_mix(dt));
  }
}

TEST(InterleavedWeights, TheEmbeddingGathersARowOutOfItsGroup) {
  const int64_t in = 512;
  for (DataType dt : {DataType::kQ6_K, DataType::kQ8_0}) {
    TestWeights table = make_weights(dt, 32 * in, 97);
    std::vector<int32_t> ids = {31, 0, 17, 5};
    std::vector<float> emb(4 * in, NAN);
    ASSERT_TRUE(run_blocks(&embedding_kernel,
                           embedding_args(view(ids, {4}), interleaved(table, 32, in).tensor(32, in),
                                          view(emb, {4, in})),
                           2)
                    .ok());
    for (int64_t r = 0; r < 4; ++r) {
      for (int64_t i = 0; i < in; ++i) {
        ASSERT_EQ(emb[r * in + i], static_cast<float>(table.values[ids[r] * in + i]))
            << task::name_of(dt) << " row " << r << " element " << i;
      }
    }
  }
}

// An interleaved weight whose rows are not whole groups of 16, or beside a weight whose rows are
// not, is INVALID_ARGUMENT saying so; nothing is written.
TEST(InterleavedWeights, RowsNotWholeGroupsAreInvalidArgument) {
  const int64_t in = 256, rows = 2;
  std::vector<float> x = random_floats(rows * in, 98);
  TestWeights w = make_weights(DataType::kQ4_K, 48 * in, 99), wi = interleaved(w, 48, in);
  std::vector<float> y(rows * 40, NAN);
  absl::Status s = run_blocks(&matmul_kernel, matmul_args_for(false, x, wi, y, rows, in, 40), 1);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("q4_k_r16 with 40 rows, not a whole number of groups of 16"),
            std::string::npos)
      << s;
  EXPECT_TRUE(std::all_of(y.begin(), y.end(), [](float v) { return std::isnan(v); }));
  TestWeights other = make_weights(DataType::kQ6_K, 37 * in, 100);
  std::vector<float> y0(rows * 48, NAN), y1(rows * 37, NAN);
  const std::vector<Tensor> ws = {wi.tensor(48, in), other.tensor(37, in)};
  const std::vector<Tensor> ys = {view(y0, {rows, 48}), view(y1, {rows, 37})};
  s = run_blocks(&matmul_merged_kernel, matmul_merged_args(view(x, {rows, in}), ws, ys), 1);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("every weight of the task needs a multiple of 16 rows"),
            std::string::npos)
      << s;
  EXPECT_TRUE(std::all_of(y0.begin(), y0.end(), [](float v) { return std::isnan(v); }));
  // an embedding table of 40 interleaved rows (the group of rows 32-47 is not all there)
  TestWeights table = interleaved(make_weights(DataType::kQ6_K, 48 * in, 101), 48, in);
  std::vector<int32_t> ids = {39};
  std::vector<float> emb(in, NAN);
  s = run_blocks(&embedding_kernel,
                 embedding_args(view(ids, {1}), table.tensor(40, in), view(emb, {1, in})), 1);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("q6_k_r16 with 40 rows, not a whole number of groups of 16"),
            std::string::npos)
      << s;
}

// Wrong argument counts, shapes and dtypes are INVALID_ARGUMENT naming the argument; the tags are
// x and the weights IN, the outputs OUT.
TEST(MatmulMergedKernel, ArgumentErrorsNameTheArgumentAndOutputsAreTaggedOut) {
  std::vector<float> x(2 * 32), w0(3 * 32), w1(5 * 32), y0(2 * 3), y1(2 * 5), act(2 * 5);
  const Tensor xt = view(x, {2, 32}), w0t = view(w0, {3, 32}), w1t = view(w1, {5, 32});
  const Tensor ws[] = {w0t, w1t};
  const Tensor ys[] = {view(y0, {2, 3}), view(y1, {2, 5})};
  const TaskArgs ok = matmul_merged_args(xt, ws, ys);
  ASSERT_EQ(ok.size(), 5u);
  EXPECT_EQ(ok[0].direction, task::ArgDirection::kIn);
  EXPECT_EQ(ok[2].direction, task::ArgDirection::kIn);
  EXPECT_EQ(ok[3].direction, task::ArgDirection::kOut);
  EXPECT_EQ(ok[4].direction, task::ArgDirection::kOut);
  EXPECT_TRUE(run_blocks(&matmul_merged_kernel, ok, 2).ok());

  // Weights and outputs of different counts, or more than 4: the arguments hold x alone.
  absl::Status s = run_blocks(&matmul_merged_kernel, matmul_merged_args(xt, ws, {ys, 1}), 1);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(),
            "matmul_merged: expects x, then 1 to 4 weights, then their outputs (3, 5, 7 or 9 "
            "arguments), got 1");
  TaskArgs six = matmul_merged_args(xt, ws, ys);
  six.add_tensor(view(y0, {2, 3}), task::ArgDirection::kOut);  // an output too many
  s = run_blocks(&matmul_merged_kernel, six, 1);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("got 6"));
  const Tensor five_w[] = {w0t, w0t, w0t, w0t, w0t};
  std::vector<float> y5(5 * 2 * 3);
  const Tensor five_y[] = {view(y5, {2, 3}), view(y5, {2, 3}), view(y5, {2, 3}), view(y5, {2, 3}),
                           view(y5, {2, 3})};
  s = run_blocks(&matmul_merged_kernel, matmul_merged_args(xt, five_w, five_y), 1);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("got 1"));
  const Tensor swapped[] = {view(y1, {2, 5}), view(y0, {2, 3})};
  s = run_blocks(&matmul_merged_kernel, matmul_merged_args(xt, ws, swapped), 1);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(),
              HasSubstr("matmul_merged: argument 3 (y0) must be a contiguous f32[2,3]"));
  const Tensor short_w[] = {w0t, view(w1, {5, 16})};
  s = run_blocks(&matmul_merged_kernel, matmul_merged_args(xt, short_w, ys), 1);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(),
              HasSubstr("matmul_merged: argument 2 (W1) must be a contiguous f32[*,32]"));
  std::vector<uint8_t> q(5 * 144);
  const Tensor q4k =
      Tensor::contiguous(reinterpret_cast<uintptr_t>(q.data()), {5, 32}, DataType::kQ4_K).value();
  const Tensor q_w[] = {w0t, q4k};
  s = run_blocks(&matmul_merged_kernel, matmul_merged_args(xt, q_w, ys), 1);
  EXPECT_EQ(s.message(),
            "matmul_merged: argument 2 (W1) is q4_k with rows of 32 weights, not a whole number of "
            "blocks of 256");

  // matmul_silu_mul: W_up must have W_gate's rows (named before its output, which matches it
  // here); act gate's shape.
  s = run_blocks(
      &matmul_silu_mul_kernel,
      matmul_silu_mul_args(xt, w0t, w1t, view(y0, {2, 3}), view(y1, {2, 5}), view(act, {2, 5})), 1);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("matmul_silu_mul: argument 2 (W_up) must be a contiguous "
                                     "f32[3,32]"));
  s = run_blocks(
      &matmul_silu_mul_kernel,
      matmul_silu_mul_args(xt, w0t, w0t, view(y0, {2, 3}), view(y5, {2, 3}), view(act, {2, 5})), 1);
  EXPECT_THAT(s.message(), HasSubstr("matmul_silu_mul: argument 5 (act) must be a contiguous "
                                     "f32[2,3]"));
  const TaskArgs silu =
      matmul_silu_mul_args(xt, w0t, w0t, view(y0, {2, 3}), view(y5, {2, 3}), view(act, {2, 3}));
  for (size_t i = 0; i < silu.size(); ++i) {
    EXPECT_EQ(silu[i].direction, i < 3 ? task::ArgDirection::kIn : task::ArgDirection::kOut) << i;
  }
}

TEST(MatmulKernel, AccTagsOutputInOut) {
  std::vector<float> x(4), w(4), y(4);
  TaskArgs a = matmul_acc_args(view(x, {2, 2}), view(w, {2, 2}), view(y, {2, 2}));
  EXPECT_EQ(a[2].direction, task::ArgDirection::kInOut);
  TaskArgs m = matmul_args(view(x, {2, 2}), view(w, {2, 2}), view(y, {2, 2}));
  EXPECT_EQ(m[2].direction, task::ArgDirection::kOut);
}

TEST(MatmulKernel, ShapeAndDtypeErrorsNameTheArgument) {
  std::vector<float> x(6), y(4);
  std::vector<float> w(6);
  absl::Status s =
      run_blocks(&matmul_kernel, matmul_args(view(x, {2, 3}), view(w, {3, 2}), view(y, {2, 2})), 1);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("matmul: argument 1 (W) must be a contiguous f32[*,3]"));
  std::vector<int32_t> wi(6);
  s = run_blocks(&matmul_kernel, matmul_args(view(x, {2, 3}), view(wi, {2, 3}), view(y, {2, 2})),
                 1);
  EXPECT_THAT(s.message(), HasSubstr("argument 1 (W)"));
  EXPECT_THAT(s.message(), HasSubstr("got i32[2,3]"));
  TaskArgs two;
  two.add_tensor(view(x, {2, 3}), task::ArgDirection::kIn);
  s = run_blocks(&matmul_kernel, two, 1);
  EXPECT_THAT(s.message(), HasSubstr("matmul: expects 3 arguments, got 1"));
}

TEST(RopeKernel, MatchesRotateHalfReferenceAtSeveralPositions) {
  const int64_t B = 4, heads = 3, d = 8;
  const float theta = 10000.0f;
  std::vector<float> x0 = random_floats(B * heads * d, 7);
  std::vector<int32_t> pos = {0, 1, 17, 1000};
  std::vector<double> want(x0.size());
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < heads; ++h) {
      const float* v = &x0[(b * heads + h) * d];
      double* o = &want[(b * heads + h) * d];
      for (int64_t i = 0; i < d / 2; ++i) {
        const double a = pos[b] * std::pow(double(theta), -2.0 * i / d);
        o[i] = v[i] * std::cos(a) - v[i + d / 2] * std::sin(a);
        o[i + d / 2] = v[i + d / 2] * std::cos(a) + v[i] * std::sin(a);
      }
    }
  }
  for (int32_t bd : {1, 3}) {
    std::vector<float> x = x0;
    ASSERT_TRUE(
        run_blocks(&rope_kernel, rope_args(view(x, {B, heads, d}), view(pos, {B}), theta), bd)
            .ok());
    expect_close(x, want, 1e-6);
  }
  // Position 0 is the identity.
  std::vector<float> x = x0;
  ASSERT_TRUE(
      run_blocks(&rope_kernel, rope_args(view(x, {B, heads, d}), view(pos, {B}), theta), 1).ok());
  for (int64_t i = 0; i < heads * d; ++i) EXPECT_EQ(x[i], x0[i]);
}

// RoPE's angles are kept per thread and position (row_ops::RopeTable): a rotation is bitwise the
// same whether the thread's table held its position, held another position in the same entry
// (p and p + 64), held other frequencies (another theta or head_dim), or was new (a fresh thread).
TEST(RopeKernel, KeptAnglesRotateBitwiseAsFreshOnes) {
  const int64_t heads = 2;
  const std::vector<int32_t> positions = {5, 69, 5, 133, 5, 0, 64};  // 5, 69, 133 share an entry
  for (const int64_t d : {int64_t{8}, int64_t{16}}) {
    for (const float theta : {10000.f, 1000000.f}) {
      std::vector<float> x0 = random_floats(3 * heads * d, static_cast<uint32_t>(d));
      std::copy_n(x0.begin(), heads * d, x0.begin() + 2 * heads * d);  // rows 0 and 2 alike
      auto rotate = [&](std::vector<int32_t> pos) {
        std::vector<float> x(x0.begin(), x0.begin() + static_cast<int64_t>(pos.size()) * heads * d);
        const int64_t b = static_cast<int64_t>(pos.size());
        EXPECT_TRUE(
            run_blocks(&rope_kernel, rope_args(view(x, {b, heads, d}), view(pos, {b}), theta), 1)
                .ok());
        return x;
      };
      for (const int32_t p : positions) {
        const std::vector<float> kept = rotate({p});
        std::vector<float> fresh;
        std::thread([&] { fresh = rotate({p}); }).join();
        EXPECT_EQ(0, std::memcmp(kept.data(), fresh.data(), kept.size() * sizeof(float)))
            << "position " << p << " d " << d << " theta " << theta;
      }
      const std::vector<float> rows = rotate({5, 69, 5});  // colliding rows in one call
      std::vector<float> fresh;
      std::thread([&] { fresh = rotate({5, 69, 5}); }).join();
      EXPECT_EQ(0, std::memcmp(rows.data(), fresh.data(), rows.size() * sizeof(float)));
      EXPECT_EQ(0,
                std::memcmp(rows.data(), rows.data() + 2 * heads * d, heads * d * sizeof(float)));
    }
  }
}

TEST(KvWriteKernel, WritesMappedSlotsAndSkipsPadding) {
  const int64_t pages = 5, ps = 4, nkv = 2, d = 6, B = 3;
  const int64_t row = nkv * d;
  std::vector<float> k = random_floats(B * row, 8), v = random_floats(B * row, 9);
  std::vector<int32_t> slots = {7, -1, 13};
  std::vector<float> kp0 = random_floats(pages * ps * row, 10),
                     vp0 = random_floats(pages * ps * row, 11);
  std::vector<float> kp = kp0, vp = vp0;
  TaskArgs args = kv_write_args(view(k, {B, nkv, d}), view(v, {B, nkv, d}), view(slots, {B}),
                                view(kp, {pages, nkv, ps, d}), view(vp, {pages, nkv, ps, d}));
  EXPECT_EQ(args[3].direction, task::ArgDirection::kInOut);
  EXPECT_EQ(args[4].direction, task::ArgDirection::kInOut);
  ASSERT_TRUE(run_blocks(&kv_write_kernel, args, 2).ok());
  // The pools hold a page kv head by kv head: slot s's row of kv head g starts at
  // ((page · nkv + g) · ps + offset) · d.
  for (int64_t s = 0; s < pages * ps; ++s) {
    const int64_t src = s == 7 ? 0 : s == 13 ? 2 : -1;
    for (int64_t i = 0; i < row; ++i) {
      const int64_t g = i / d, at = ((s / ps * nkv + g) * ps + s % ps) * d + i % d;
      EXPECT_EQ(kp[at], src >= 0 ? k[src * row + i] : kp0[at]) << s;
      EXPECT_EQ(vp[at], src >= 0 ? v[src * row + i] : vp0[at]) << s;
    }
  }
  slots = {7, 20, 0};
  absl::Status bad = run_blocks(&kv_write_kernel, args, 1);
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.message(),
              HasSubstr("kv_write: slot 20 at row 1 is outside the pool of 5 pages x 4 slots"));
}

// The fused kernel gives bitwise what q_norm, k_norm (rms_norm over the heads), the two ropes
// and kv_write give in sequence, for any split over rows (a padding row's slot -1 writes no cache
// slot), and refuses a negative position and a slot past the pool naming the row.
TEST(QkNormRopeKvKernel, IsBitwiseTheFiveKernelsInSequenceForAnySplit) {
  const int64_t B = 5, nh = 4, nkv = 2, d = 16, pages = 4, ps = 4;
  const float eps = 1e-6f, theta = 1000000.0f;
  std::vector<float> q = random_floats(B * nh * d, 21, -3, 3), k = random_floats(B * nkv * d, 22),
                     v = random_floats(B * nkv * d, 23), qn = random_floats(d, 24, 0.5f, 1.5f),
                     kn = random_floats(d, 25, 0.5f, 1.5f);
  std::vector<int32_t> pos = {0, 3, 17, 255, 4096}, slots = {5, -1, 0, 15, 9};
  const std::vector<float> kp0 = random_floats(pages * ps * nkv * d, 26),
                           vp0 = random_floats(pages * ps * nkv * d, 27);
  // The five kernels, as the decode program ran them.
  std::vector<float> want_q(q.size()), want_k(k.size()), want_kp = kp0, want_vp = vp0;
  ASSERT_TRUE(
      run_blocks(&rms_norm_kernel,
                 rms_norm_args(view(q, {B * nh, d}), view(qn, {d}), view(want_q, {B * nh, d}), eps),
                 1)
          .ok());
  ASSERT_TRUE(
      run_blocks(
          &rms_norm_kernel,
          rms_norm_args(view(k, {B * nkv, d}), view(kn, {d}), view(want_k, {B * nkv, d}), eps), 1)
          .ok());
  ASSERT_TRUE(
      run_blocks(&rope_kernel, rope_args(view(want_q, {B, nh, d}), view(pos, {B}), theta), 1).ok());
  ASSERT_TRUE(
      run_blocks(&rope_kernel, rope_args(view(want_k, {B, nkv, d}), view(pos, {B}), theta), 1)
          .ok());
  ASSERT_TRUE(run_blocks(&kv_write_kernel,
                         kv_write_args(view(want_k, {B, nkv, d}), view(v, {B, nkv, d}),
                                       view(slots, {B}), view(want_kp, {pages, nkv, ps, d}),
                                       view(want_vp, {pages, nkv, ps, d})),
                         1)
                  .ok());
  std::vector<float> q_out(q.size()), k_out(k.size()), kp = kp0, vp = vp0;
  const QkNormRopeKvTensors t{view(q, {B, nh, d}),
                              view(k, {B, nkv, d}),
                              view(v, {B, nkv, d}),
                              view(qn, {d}),
                              view(kn, {d}),
                              view(pos, {B}),
                              view(slots, {B}),
                              view(q_out, {B, nh, d}),
                              view(k_out, {B, nkv, d}),
                              view(kp, {pages, nkv, ps, d}),
                              view(vp, {pages, nkv, ps, d})};
  const TaskArgs args = qk_norm_rope_kv_args(t, eps, theta);
  EXPECT_EQ(args[7].direction, task::ArgDirection::kOut);
  EXPECT_EQ(args[9].direction, task::ArgDirection::kInOut);
  EXPECT_EQ(args[10].direction, task::ArgDirection::kInOut);
  const auto bits = [](const std::vector<float>& x) {
    std::vector<uint32_t> b(x.size());
    std::memcpy(b.data(), x.data(), sizeof(float) * x.size());
    return b;
  };
  for (int32_t bd : {1, 2, 5}) {
    std::fill(q_out.begin(), q_out.end(), 0.f);
    std::fill(k_out.begin(), k_out.end(), 0.f);
    kp = kp0;
    vp = vp0;
    ASSERT_TRUE(run_blocks(&qk_norm_rope_kv_kernel, args, bd).ok()) << bd << " blocks";
    EXPECT_EQ(bits(q_out), bits(want_q)) << bd << " blocks";
    EXPECT_EQ(bits(k_out), bits(want_k)) << bd << " blocks";
    EXPECT_EQ(bits(kp), bits(want_kp)) << bd << " blocks";
    EXPECT_EQ(bits(vp), bits(want_vp)) << bd << " blocks";
  }
  pos[2] = -1;
  absl::Status bad = run_blocks(&qk_norm_rope_kv_kernel, args, 1);
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.message(), HasSubstr("qk_norm_rope_kv: position -1 at row 2 is negative"));
  pos[2] = 17;
  slots[3] = 16;
  bad = run_blocks(&qk_norm_rope_kv_kernel, args, 1);
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.message(), HasSubstr("qk_norm_rope_kv: slot 16 at row 3 is outside the pool "
                                       "of 4 pages x 4 slots"));
  // A k that is not [B, n_kv, head_dim] beside q is refused naming it.
  QkNormRopeKvTensors odd = t;
  odd.k = view(k, {B, nkv * d / 2, 2});
  bad = run_blocks(&qk_norm_rope_kv_kernel, qk_norm_rope_kv_args(odd, eps, theta), 1);
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.message(), HasSubstr("qk_norm_rope_kv"));
  EXPECT_THAT(bad.message(), HasSubstr("k"));
}

// RoPE's parameters (row_ops::check_rope) are refused by both kernels that rotate: an odd
// head_dim, a theta of 0 and a NaN theta, each named with the kernel.
TEST(RopeKernel, OddHeadDimAndNonPositiveThetaAreRefusedByRopeAndTheFusedKernel) {
  const int64_t B = 1, h = 1;
  std::vector<float> x(B * h * 4), q(B * h * 4), k(B * h * 4), v(B * h * 4), w(4, 1.f), q_out(4),
      k_out(4), kp(4 * 4), vp(4 * 4);
  std::vector<int32_t> pos = {3}, slots = {0};
  for (const int64_t d : {int64_t{3}, int64_t{4}}) {
    for (const float theta : {10000.f, 0.f, std::nanf("")}) {
      const bool bad = d % 2 != 0 || !(theta > 0);
      if (!bad) continue;
      const std::string why =
          d % 2 != 0 ? absl::StrCat("head_dim ", d, " must be even") : "must be positive";
      absl::Status s =
          run_blocks(&rope_kernel, rope_args(view(x, {B, h, d}), view(pos, {B}), theta), 1);
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << d << " " << theta;
      EXPECT_THAT(s.message(), HasSubstr("rope")) << s;
      EXPECT_THAT(s.message(), HasSubstr(why)) << s;
      const QkNormRopeKvTensors t{view(q, {B, h, d}),
                                  view(k, {B, h, d}),
                                  view(v, {B, h, d}),
                                  view(w, {d}),
                                  view(w, {d}),
                                  view(pos, {B}),
                                  view(slots, {B}),
                                  view(q_out, {B, h, d}),
                                  view(k_out, {B, h, d}),
                                  view(kp, {1, 4 / d, h, d}),
                                  view(vp, {1, 4 / d, h, d})};
      s = run_blocks(&qk_norm_rope_kv_kernel, qk_norm_rope_kv_args(t, 1e-6f, theta), 1);
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << d << " " << theta;
      EXPECT_THAT(s.message(), HasSubstr("qk_norm_rope_kv")) << s;
      EXPECT_THAT(s.message(), HasSubstr(why)) << s;
    }
  }
}

// Naive paged attention in double.
std::vector<double> reference_attention(const std::vector<float>& q, const std::vector<float>& kp,
                                        const std::vector<float>& vp,
                                        const std::vector<int32_t>& tables,
                                        const std::vector<int32_t>& lens, int64_t B, int64_t nh,
                                        int64_t nkv, int64_t d, int64_t ps, int64_t max_blocks) {
  std::vector<double> out(B * nh * d, 0.0);
  const double scale = 1.0 / std::sqrt(double(d));
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < nh; ++h) {
      const int64_t g = h / (nh / nkv);
      std::vector<double> scores(lens[b]);
      double mx = -INFINITY;
      // Position t of kv head g: page tables[b, t / ps], its run of head g, offset t % ps.
      const auto at = [&](int64_t t) {
        return ((tables[b * max_blocks + t / ps] * nkv + g) * ps + t % ps) * d;
      };
      for (int64_t t = 0; t < lens[b]; ++t) {
        double s = 0;
        for (int64_t i = 0; i < d; ++i) s += double(q[(b * nh + h) * d + i]) * kp[at(t) + i];
        scores[t] = s * scale;
        mx = std::max(mx, scores[t]);
      }
      double sum = 0;
      for (double& s : scores) sum += (s = std::exp(s - mx));
      for (int64_t t = 0; t < lens[b]; ++t) {
        for (int64_t i = 0; i < d; ++i) {
          out[(b * nh + h) * d + i] += scores[t] / sum * vp[at(t) + i];
        }
      }
    }
  }
  return out;
}

TEST(PagedAttentionKernel, MatchesReferenceWithGqaAndNonContiguousPages) {
  const int64_t B = 4, nh = 4, nkv = 2, d = 8, pages = 8, ps = 4, max_blocks = 3;
  std::vector<float> q = random_floats(B * nh * d, 12, -2.0f, 2.0f);
  std::vector<float> kp = random_floats(pages * ps * nkv * d, 13, -2.0f, 2.0f);
  std::vector<float> vp = random_floats(pages * ps * nkv * d, 14);
  std::vector<int32_t> tables = {5,  2,  7,    // crosses two page boundaries
                                 0,  -1, -1,   // one token
                                 3,  6,  1,    // full table
                                 -1, -1, -1};  // padding row
  std::vector<int32_t> lens = {9, 1, 12, 0};
  const std::vector<double> want =
      reference_attention(q, kp, vp, tables, lens, B, nh, nkv, d, ps, max_blocks);
  for (int32_t bd : {1, 3, 5, 8, 11}) {
    std::vector<float> out(B * nh * d, NAN);
    TaskArgs args = paged_attention_args(
        view(q, {B, nh, d}), view(kp, {pages, nkv, ps, d}), view(vp, {pages, nkv, ps, d}),
        view(tables, {B, max_blocks}), view(lens, {B}), view(out, {B, nh * d}),
        static_cast<float>(1.0 / std::sqrt(double(d))));
    EXPECT_EQ(args[1].direction, task::ArgDirection::kIn);
    EXPECT_EQ(args[2].direction, task::ArgDirection::kIn);
    ASSERT_TRUE(run_blocks(&paged_attention_kernel, args, bd).ok());
    expect_close(out, want, 1e-5);
    for (int64_t i = 3 * nh * d; i < B * nh * d; ++i) EXPECT_EQ(out[i], 0.0f);
  }
}

// A shape of chunk_rows_are_tiled: head dim, page size, query and kv heads, request A's pages.
struct TiledAttentionCase {
  int64_t d, ps, nh, nkv;
  std::vector<int32_t> chunk_table;
};

void chunk_rows_are_tiled(const TiledAttentionCase& c, task::KernelFn fn,
                          std::vector<float>* alone);

// A prefill chunk's rows (one request: one block table, consecutive positions) are attended in
// tiles that read each cached K and V row once. A row's result is bitwise the same whether it
// is alone in the step or among 1-19 rows of its request, other requests' rows and padding, at
// any block split; and close to the float64 reference. On every ISA target this CPU has, each
// giving bitwise the same results. Head dims 64 and 128 take the AVX-512 and AVX2 tiles, 40 the
// generic body (with pages of 16 and 18, A's contexts of 40 and 70 too: its spans of 32 positions,
// ending on page boundaries at 16 and within a page at 18); pages of 4 positions (a block of 16
// keys spans pages: one kv head with A's first pages 0, 5, 7, 3 puts the block's last key exactly
// 15 rows after its first, through other pages), of 16 (a whole block within one page, read at
// fixed offsets; contexts of 40 and 70 too: several blocks and spans) and of 18 (blocks within a
// page and across pages in one row, on both paths of the AVX-512 tile; the AVX2 tile's blocks of
// 4 across pages; contexts of 40 and 70 too); groups of 2, 3 (a query's V sums alone after a
// pair) and 1 (queries of rows of different lengths).
TEST(PagedAttentionKernel, ChunkRowsAreTiledAndEachRowIsBitwiseItsOneRowResult) {
  const std::vector<int32_t> scattered = {7, 2, 9, 0, 11, 4};
  const std::vector<TiledAttentionCase> cases = {
      {40, 4, 4, 2, scattered},   {64, 4, 4, 2, scattered},           {128, 4, 4, 2, scattered},
      {64, 16, 4, 2, scattered},  {128, 16, 4, 2, scattered},         {128, 16, 6, 2, scattered},
      {64, 16, 3, 3, scattered},  {64, 4, 2, 1, {0, 5, 7, 3, 11, 4}}, {64, 18, 4, 2, scattered},
      {128, 18, 4, 2, scattered}, {40, 16, 4, 2, scattered},          {40, 18, 4, 2, scattered}};
  for (const TiledAttentionCase& c : cases) {
    std::vector<std::pair<KernelIsa, std::vector<float>>> results;
    for (KernelIsa isa :
         {KernelIsa::kPortable, KernelIsa::kX86_64V3, KernelIsa::kAvx512, KernelIsa::kNeon}) {
      if (!kernel_isa_available(isa)) continue;
      SCOPED_TRACE(::testing::Message() << "head dim " << c.d << ", page size " << c.ps << ", "
                                        << c.nh << " / " << c.nkv << " heads on " << name_of(isa));
      std::vector<float> alone;
      chunk_rows_are_tiled(c, llm_kernels(isa)[static_cast<size_t>(KernelId::kPagedAttention)].fn,
                           &alone);
      if (HasFatalFailure()) return;
      results.emplace_back(isa, std::move(alone));
    }
    for (size_t a = 1; a < results.size(); ++a) {  // every target against the portable one
      for (size_t i = 0; i < results[a].second.size(); ++i) {
        ASSERT_EQ(std::bit_cast<uint32_t>(results[0].second[i]),
                  std::bit_cast<uint32_t>(results[a].second[i]))
            << name_of(results[0].first) << " and " << name_of(results[a].first)
            << " differ at element " << i << ", head dim " << c.d << ", page size " << c.ps << ", "
            << c.nh << " / " << c.nkv << " heads";
      }
    }
  }
}

void chunk_rows_are_tiled(const TiledAttentionCase& c, task::KernelFn fn,
                          std::vector<float>* alone_out) {
  const int64_t d = c.d, ps = c.ps, nh = c.nh, nkv = c.nkv, pages = 12, max_blocks = 6;
  std::vector<float> kp = random_floats(pages * ps * nkv * d, 23, -2.0f, 2.0f);
  std::vector<float> vp = random_floats(pages * ps * nkv * d, 24);
  const std::vector<int32_t>& chunk_table = c.chunk_table;         // request A
  const std::vector<int32_t> other_table = {5, 8, 1, -1, -1, -1};  // request B: 10 positions
  // Rows: one of B, A's 19 chunk rows (contexts 4..22), a padding row, B again (and with pages
  // of 16 or 18, A at 40 and 70).
  std::vector<int32_t> tables, lens;
  auto add_row = [&](const std::vector<int32_t>& t, int32_t len) {
    tables.insert(tables.end(), t.begin(), t.end());
    lens.push_back(len);
  };
  add_row(other_table, 10);
  for (int32_t len = 4; len <= 22; ++len) add_row(chunk_table, len);
  add_row({-1, -1, -1, -1, -1, -1}, 0);
  add_row(other_table, 9);
  if (ps * max_blocks >= 70) {  // A's longer rows, where its pages hold them
    add_row(chunk_table, 40);
    add_row(chunk_table, 70);
  }
  const int64_t B = static_cast<int64_t>(lens.size());
  std::vector<float> q = random_floats(B * nh * d, 25, -2.0f, 2.0f);
  const float scale = static_cast<float>(1.0 / std::sqrt(double(d)));
  const std::vector<double> want =
      reference_attention(q, kp, vp, tables, lens, B, nh, nkv, d, ps, max_blocks);
  // Each row alone (a one-row step).
  std::vector<float> alone(B * nh * d);
  for (int64_t b = 0; b < B; ++b) {
    std::vector<float> q1(q.begin() + b * nh * d, q.begin() + (b + 1) * nh * d), out1(nh * d);
    std::vector<int32_t> t1(tables.begin() + b * max_blocks, tables.begin() + (b + 1) * max_blocks);
    std::vector<int32_t> l1 = {lens[b]};
    ASSERT_TRUE(
        run_blocks(fn,
                   paged_attention_args(view(q1, {1, nh, d}), view(kp, {pages, nkv, ps, d}),
                                        view(vp, {pages, nkv, ps, d}), view(t1, {1, max_blocks}),
                                        view(l1, {1}), view(out1, {1, nh * d}), scale),
                   1)
            .ok());
    std::copy(out1.begin(), out1.end(), alone.begin() + b * nh * d);
  }
  expect_close(alone, want, 1e-5);
  // Fixed shares (no task lines), then (kv head, row) pairs claimed by the blocks through shared
  // lines, one block after another (the last claims the others' pairs) and on threads at once.
  for (int mode = 0; mode < 3; ++mode) {
    for (int32_t bd : {1, 2, 3, 7, 64}) {
      std::vector<float> out(B * nh * d, NAN);
      const TaskArgs args = paged_attention_args(
          view(q, {B, nh, d}), view(kp, {pages, nkv, ps, d}), view(vp, {pages, nkv, ps, d}),
          view(tables, {B, max_blocks}), view(lens, {B}), view(out, {B, nh * d}), scale);
      ASSERT_TRUE((mode == 0 ? run_blocks(fn, args, bd)
                             : testing::run_blocks_sharing_lines(fn, args, bd, mode == 2))
                      .ok());
      for (int64_t i = 0; i < B * nh * d; ++i) {
        ASSERT_EQ(std::bit_cast<uint32_t>(out[i]), std::bit_cast<uint32_t>(alone[i]))
            << "row " << i / (nh * d) << " with " << bd << " blocks, "
            << (mode == 0   ? "fixed shares"
                : mode == 1 ? "claims"
                            : "claims on threads");
      }
    }
  }
  *alone_out = std::move(alone);
}

// A NaN in a cached key (NaN weights or activations upstream) makes that row's scores, and so
// its output, NaN on every target, without undefined behaviour in the softmax's exp (the
// sanitizer build checks the float-to-int conversion there); the other rows are untouched.
TEST(PagedAttentionKernel, ANanKeySpreadsToItsRowOnly) {
  for (const int64_t d : {40, 64}) {
    const int64_t B = 2, nh = 2, nkv = 1, pages = 2, ps = 4, max_blocks = 1;
    std::vector<float> q = random_floats(B * nh * d, 31, -2.0f, 2.0f);
    std::vector<float> kp = random_floats(pages * ps * nkv * d, 32, -2.0f, 2.0f);
    std::vector<float> vp = random_floats(pages * ps * nkv * d, 33);
    kp[1 * d + 3] = NAN;  // page 0, position 1: read by row 0 only
    std::vector<int32_t> tables = {0, 1};
    std::vector<int32_t> lens = {3, 4};
    for (KernelIsa isa :
         {KernelIsa::kPortable, KernelIsa::kX86_64V3, KernelIsa::kAvx512, KernelIsa::kNeon}) {
      if (!kernel_isa_available(isa)) continue;
      SCOPED_TRACE(::testing::Message() << "head dim " << d << " on " << name_of(isa));
      std::vector<float> out(B * nh * d, 0.0f);
      ASSERT_TRUE(run_blocks(llm_kernels(isa)[static_cast<size_t>(KernelId::kPagedAttention)].fn,
                             paged_attention_args(
                                 view(q, {B, nh, d}), view(kp, {pages, nkv, ps, d}),
                                 view(vp, {pages, nkv, ps, d}), view(tables, {B, max_blocks}),
                                 view(lens, {B}), view(out, {B, nh * d}), 0.125f),
                             1)
                      .ok());
      for (int64_t i = 0; i < nh * d; ++i) EXPECT_TRUE(std::isnan(out[i])) << i;
      for (int64_t i = nh * d; i < B * nh * d; ++i) EXPECT_TRUE(std::isfinite(out[i])) << i;
    }
  }
}

TEST(PagedAttentionKernel, BadContextOrPageIsInvalidArgument) {
  const int64_t B = 1, nh = 2, nkv = 1, d = 4, pages = 2, ps = 2, max_blocks = 2;
  std::vector<float> q(B * nh * d, 1.0f), kp(pages * ps * nkv * d), vp(kp.size()), out(B * nh * d);
  std::vector<int32_t> tables = {1, 2};
  std::vector<int32_t> lens = {5};
  TaskArgs args = paged_attention_args(view(q, {B, nh, d}), view(kp, {pages, nkv, ps, d}),
                                       view(vp, {pages, nkv, ps, d}), view(tables, {B, max_blocks}),
                                       view(lens, {B}), view(out, {B, nh * d}), 0.5f);
  absl::Status s = run_blocks(&paged_attention_kernel, args, 1);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(),
              HasSubstr("paged_attention: context length 5 at row 0 is outside [0, 4]"));
  lens = {3};
  s = run_blocks(&paged_attention_kernel, args, 1);
  EXPECT_THAT(s.message(), HasSubstr("page id 2 at row 0 block 1 is outside the pool of 2 pages"));
  lens = {2};  // only page 1 is read: fine
  EXPECT_TRUE(run_blocks(&paged_attention_kernel, args, 1).ok());
  // Several bad rows, blocks claiming pairs on threads: every block names the lowest bad row and
  // no output is written.
  const int64_t rows = 6;
  std::vector<float> q6(rows * nh * d, 1.0f), out6(rows * nh * d, -7.0f);
  std::vector<int32_t> tables6(rows * max_blocks, 0), lens6 = {1, 2, 9, 1, 8, 2};
  const TaskArgs args6 = paged_attention_args(
      view(q6, {rows, nh, d}), view(kp, {pages, nkv, ps, d}), view(vp, {pages, nkv, ps, d}),
      view(tables6, {rows, max_blocks}), view(lens6, {rows}), view(out6, {rows, nh * d}), 0.5f);
  for (int rep = 0; rep < 20; ++rep) {
    s = testing::run_blocks_sharing_lines(&paged_attention_kernel, args6, 3, /*threads=*/true);
    EXPECT_THAT(s.message(), HasSubstr("context length 9 at row 2 is outside [0, 4]")) << rep;
    for (float v : out6) ASSERT_EQ(v, -7.0f) << rep;
  }
}

// On every target this CPU has: close to the f64 reference over the whole range of gate values
// (where e^-g would overflow too), bitwise the same on each target, and NaN in, NaN out.
TEST(SiluMulKernel, MatchesTheReferenceBitwiseOnEveryTarget) {
  const int64_t B = 3, I = 67;
  std::vector<float> g = random_floats(B * I, 15, -6.0f, 6.0f), u = random_floats(B * I, 16);
  const float extremes[] = {0.0f,  -0.0f,  1e-30f, -1e-30f, 20.0f, -20.0f,
                            88.0f, -88.0f, 100.0f, -100.0f, 3e38f, -3e38f};
  for (size_t i = 0; i < std::size(extremes); ++i) g[i * 5] = extremes[i];
  std::vector<double> want(B * I);
  for (int64_t i = 0; i < B * I; ++i) want[i] = g[i] / (1.0 + std::exp(-double(g[i]))) * u[i];
  std::vector<float> first;
  for (KernelIsa isa :
       {KernelIsa::kPortable, KernelIsa::kX86_64V3, KernelIsa::kAvx512, KernelIsa::kNeon}) {
    if (!kernel_isa_available(isa)) continue;
    SCOPED_TRACE(name_of(isa));
    const task::KernelFn fn = llm_kernels(isa)[static_cast<size_t>(KernelId::kSiluMul)].fn;
    std::vector<float> out(B * I, NAN);
    ASSERT_TRUE(
        run_blocks(fn, silu_mul_args(view(g, {B, I}), view(u, {B, I}), view(out, {B, I})), 3).ok());
    expect_close(out, want, 1e-6);
    if (first.empty()) {
      first = out;
    } else {
      for (size_t i = 0; i < out.size(); ++i) {
        ASSERT_EQ(std::bit_cast<uint32_t>(out[i]), std::bit_cast<uint32_t>(first[i]))
            << "portable and " << name_of(isa) << " differ at " << i << ": g " << g[i];
      }
    }
    // The vector paths over the exp's whole range (-|g| down to its clamp at -87 and past it):
    // bitwise the portable path's scalar operations.
    std::vector<float> wide = random_floats(4099, 17, -100.0f, 100.0f), wide_up(4099, 1.5f);
    std::vector<float> wide_out(4099, NAN), wide_want(4099, NAN);
    ASSERT_TRUE(run_blocks(fn,
                           silu_mul_args(view(wide, {1, 4099}), view(wide_up, {1, 4099}),
                                         view(wide_out, {1, 4099})),
                           2)
                    .ok());
    ASSERT_TRUE(
        run_blocks(llm_kernels(KernelIsa::kPortable)[static_cast<size_t>(KernelId::kSiluMul)].fn,
                   silu_mul_args(view(wide, {1, 4099}), view(wide_up, {1, 4099}),
                                 view(wide_want, {1, 4099})),
                   1)
            .ok());
    for (size_t i = 0; i < wide.size(); ++i) {
      ASSERT_EQ(std::bit_cast<uint32_t>(wide_out[i]), std::bit_cast<uint32_t>(wide_want[i]))
          << name_of(isa) << " and portable differ at g " << wide[i];
    }
    std::vector<float> nan_gate(B * I, NAN), nan_out(B * I, 0.0f);
    ASSERT_TRUE(
        run_blocks(fn,
                   silu_mul_args(view(nan_gate, {B, I}), view(u, {B, I}), view(nan_out, {B, I})), 2)
            .ok());
    for (float v : nan_out) ASSERT_TRUE(std::isnan(v));
  }
}

TEST(AddKernel, AddsElementwiseAndRejectsShapeMismatch) {
  std::vector<float> a = random_floats(12, 17), b = random_floats(12, 18), out(12, NAN);
  ASSERT_TRUE(
      run_blocks(&add_kernel, add_args(view(a, {3, 4}), view(b, {3, 4}), view(out, {3, 4})), 5)
          .ok());
  for (int i = 0; i < 12; ++i) EXPECT_EQ(out[i], a[i] + b[i]);
  absl::Status s =
      run_blocks(&add_kernel, add_args(view(a, {3, 4}), view(b, {4, 3}), view(out, {3, 4})), 1);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(),
              HasSubstr("add: argument 1 (b) must be a contiguous f32[3,4], got f32[4,3]"));
}

TEST(GatherRowsKernel, GathersAndRejectsOutOfRangeRows) {
  const int64_t B = 3, H = 4;
  std::vector<float> x = random_floats(B * H, 19);
  std::vector<int32_t> rows = {2, 0, 2};
  std::vector<float> out(3 * H, NAN);
  ASSERT_TRUE(run_blocks(&gather_rows_kernel,
                         gather_rows_args(view(x, {B, H}), view(rows, {3}), view(out, {3, H})), 2)
                  .ok());
  for (int64_t j = 0; j < 3; ++j) {
    for (int64_t i = 0; i < H; ++i) EXPECT_EQ(out[j * H + i], x[rows[j] * H + i]);
  }
  rows = {0, 3, 1};
  absl::Status s =
      run_blocks(&gather_rows_kernel,
                 gather_rows_args(view(x, {B, H}), view(rows, {3}), view(out, {3, H})), 1);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("gather_rows: row 3 at index 1 is outside the batch [0, 3)"));
}

TEST(ArgmaxKernel, LowestIndexWinsTiesAndNanNeverWins) {
  const int64_t V = 9;
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> logits = {
      0,    1,    2,    5,     1,    0,    2,    5,    5,     // tie at 3, 7, 8 -> 3
      NAN,  -1,   -2,   -0.5f, NAN,  -3,   -4,   -5,   -6,    // NaN ignored -> 3
      -inf, -inf, -inf, -inf,  -inf, -inf, -inf, -inf, -inf,  // -> 0
      1,    1,    1,    1,     1,    1,    1,    1,    1,     // all tie -> 0
      0,    0,    0,    0,     0,    0,    0,    0,    7,     // last -> 8
  };
  for (int32_t bd : {1, 2, 7}) {
    std::vector<int32_t> ids(5, -7);
    ASSERT_TRUE(
        run_blocks(&argmax_kernel, argmax_args(view(logits, {5, V}), view(ids, {5})), bd).ok());
    EXPECT_THAT(ids, ::testing::ElementsAre(3, 3, 0, 0, 8));
  }
}

// Each target's argmax against the scalar loop (the portable entry) on rows of every length
// around the vector widths and a vocabulary-sized one, with ties, NaN, infinities and signed
// zeros placed at random: the same ids, bit for bit.
TEST(ArgmaxKernel, EveryTargetPicksTheScalarLoopsIndex) {
  const float inf = std::numeric_limits<float>::infinity();
  const float specials[] = {NAN, inf, -inf, 0.0f, -0.0f, 3.0f};
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> value(-4.0f, 4.0f);
  const auto portable =
      llm_kernels(KernelIsa::kPortable)[static_cast<size_t>(KernelId::kArgmax)].fn;
  for (KernelIsa isa : {KernelIsa::kAvx512, KernelIsa::kX86_64V3, KernelIsa::kNeon}) {
    if (!kernel_isa_available(isa)) continue;
    const auto fn = llm_kernels(isa)[static_cast<size_t>(KernelId::kArgmax)].fn;
    for (int64_t V : {1, 7, 8, 9, 15, 16, 17, 31, 33, 100, 151936}) {
      const int64_t n = 12;
      std::vector<float> logits(static_cast<size_t>(n * V));
      for (int64_t j = 0; j < n; ++j) {
        float* row = logits.data() + j * V;
        // Rows 0-3 ordinary values; 4-7 with specials sprinkled; 8 all NaN; 9 all -inf;
        // 10 one value repeated (every index ties); 11 the maximum only in the last element.
        for (int64_t i = 0; i < V; ++i) row[i] = j < 8 ? std::round(value(rng) * 2) : -inf;
        if (j >= 4 && j < 8) {
          for (int k = 0; k < 1 + V / 8; ++k) {
            row[rng() % V] = specials[rng() % std::size(specials)];
          }
        }
        if (j == 8) std::fill(row, row + V, NAN);
        if (j == 10) std::fill(row, row + V, 2.5f);
        if (j == 11) row[V - 1] = 1.0f;
      }
      std::vector<int32_t> want(n, -1), got(n, -2);
      ASSERT_TRUE(run_blocks(portable, argmax_args(view(logits, {n, V}), view(want, {n})), 3).ok());
      ASSERT_TRUE(run_blocks(fn, argmax_args(view(logits, {n, V}), view(got, {n})), 3).ok());
      EXPECT_EQ(got, want) << name_of(isa) << " V=" << V;
      EXPECT_EQ(want[8], 0);
      EXPECT_EQ(want[9], 0);
      EXPECT_EQ(want[10], 0);
      EXPECT_EQ(want[11], V - 1);
    }
  }
}

}  // namespace
}  // namespace simpler::llm
