// The int8-activation matmul (precision int8, matmul_int8.h): the quantizers of x against ggml's
// formulas restated here, and every ISA path against the f64 product of the dequantized weights
// and the quantized-then-dequantized x, bitwise equal to each other and batch-invariant.
#include "kernels/matmul_int8.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/kernel_test_util.h"
#include "simpler/kernels/kernels.h"
#include "simpler/task/data_type.h"

namespace simpler::llm {
namespace {

using task::DataType;
using testing::matmul_paths;
using testing::run_blocks;
using testing::view;

// binary16 rounding (to nearest even) by the compiler's _Float16 where it has one (g++ 12; clang
// from 15 on x86), a reference independent of ours; else by task's f32_to_f16 (clang 14, the
// sanitizer builds' compiler, has no _Float16 on x86).
#ifdef __FLT16_MAX__
uint16_t to_half(float f) {
  const auto h = static_cast<_Float16>(f);
  uint16_t bits;
  std::memcpy(&bits, &h, sizeof(bits));
  return bits;
}
float from_half(uint16_t bits) {
  _Float16 h;
  std::memcpy(&h, &bits, sizeof(h));
  return static_cast<float>(h);
}
#else
uint16_t to_half(float f) { return task::f32_to_f16(f); }
float from_half(uint16_t bits) { return task::f16_to_f32(bits); }
#endif

// ggml's quantize_row_q8_0 (x86 / NEON: ties to even) for one row: q and the dequantized scales.
void ref_q8_0(const std::vector<float>& x, std::vector<int8_t>& q, std::vector<float>& d) {
  const size_t blocks = x.size() / 32;
  q.assign(x.size(), 0);
  d.assign(blocks, 0);
  for (size_t b = 0; b < blocks; ++b) {
    float amax = 0;
    for (size_t i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[32 * b + i]));
    d[b] = from_half(to_half(amax / 127.f));
    const float id = amax != 0 ? 127.f / amax : 0.f;
    for (size_t i = 0; i < 32; ++i) {
      q[32 * b + i] = static_cast<int8_t>(std::nearbyint(x[32 * b + i] * id));
    }
  }
}

// ggml's quantize_row_q8_K_ref for one row.
void ref_q8_k(const std::vector<float>& x, std::vector<int8_t>& q, std::vector<float>& d,
              std::vector<int16_t>& bsums) {
  const size_t supers = x.size() / 256;
  q.assign(x.size(), 0);
  d.assign(supers, 0);
  bsums.assign(x.size() / 16, 0);
  for (size_t b = 0; b < supers; ++b) {
    float max = 0, amax = 0;
    for (size_t i = 0; i < 256; ++i) {
      if (std::fabs(x[256 * b + i]) > amax) {
        amax = std::fabs(x[256 * b + i]);
        max = x[256 * b + i];
      }
    }
    if (amax == 0) continue;
    const float iscale = -127.f / max;
    for (size_t i = 0; i < 256; ++i) {
      const int v = static_cast<int>(std::nearbyint(iscale * x[256 * b + i]));
      q[256 * b + i] = static_cast<int8_t>(std::min(127, v));
    }
    for (size_t g = 0; g < 16; ++g) {
      int s = 0;
      for (size_t i = 0; i < 16; ++i) s += q[256 * b + 16 * g + i];
      bsums[16 * b + g] = static_cast<int16_t>(s);
    }
    d[b] = 1 / iscale;
  }
}

std::vector<float> random_x(size_t n, uint32_t seed, bool edges = true) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> g(0.f, 1.f);
  std::vector<float> x(n);
  for (float& v : x) v = g(rng);
  if (edges && n >= 64) {
    for (size_t i = 32; i < 64; ++i) x[i] = 0;  // an all-zero block
    x[3] = 40.f;                                // an outlier
    x[5] = -0.5f * 40.f / 127.f * 2;            // a value near a tie
  }
  return x;
}

TEST(Int8Quantizers, FollowGgmlsQ8_0AndQ8_KFormulas) {
  for (int64_t k : {256, 512, 1280}) {
    const std::vector<float> x = random_x(static_cast<size_t>(k), static_cast<uint32_t>(k));
    std::vector<int8_t> q(x.size()), rq;
    std::vector<float> d(x.size() / 32), rd;
    matmul_detail::quantize_x_q8_0(x.data(), k, q.data(), d.data());
    ref_q8_0(x, rq, rd);
    EXPECT_EQ(q, rq) << "q8_0 k " << k;
    EXPECT_EQ(d, rd) << "q8_0 k " << k;
    std::vector<float> dk(x.size() / 256);
    std::vector<int16_t> bs(x.size() / 16), rbs;
    matmul_detail::quantize_x_q8_k(x.data(), k, q.data(), dk.data(), bs.data());
    ref_q8_k(x, rq, rd, rbs);
    EXPECT_EQ(q, rq) << "q8_k k " << k;
    EXPECT_EQ(dk, rd) << "q8_k k " << k;
    EXPECT_EQ(bs, rbs) << "q8_k k " << k;
  }
}

TEST(Int8Quantizers, RoundTiesToEvenAsGgmlsSimdQuantizer) {
  // amax 127: id = 1, so x is q exactly; 0.5 and 2.5 are ties (to 0 and 2), 1.5 to 2, -0.5 to -0.
  std::vector<float> x(32, 0.f);
  x[0] = 127.f;
  x[1] = 0.5f;
  x[2] = 2.5f;
  x[3] = 1.5f;
  x[4] = -0.5f;
  x[5] = -126.5f;
  std::vector<int8_t> q(32);
  float d = 0;
  matmul_detail::quantize_x_q8_0(x.data(), 32, q.data(), &d);
  EXPECT_EQ(d, from_half(to_half(1.f)));
  EXPECT_EQ(q[0], 127);
  EXPECT_EQ(q[1], 0);
  EXPECT_EQ(q[2], 2);
  EXPECT_EQ(q[3], 2);
  EXPECT_EQ(q[4], 0);
  EXPECT_EQ(q[5], -126);
}

// Random blocks of `dt` with sane scales (any quantized integers; Q8_0's -128 included).
std::vector<uint8_t> random_weights(DataType dt, int64_t out, int64_t in, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> w(task::bytes_of(dt, static_cast<uint64_t>(out * in)));
  for (uint8_t& b : w) b = static_cast<uint8_t>(rng());
  std::uniform_real_distribution<float> u(-0.02f, 0.02f);
  const int64_t per = task::block_elements(dt);
  const auto block_bytes = static_cast<int64_t>(task::bytes_of(dt, static_cast<uint64_t>(per)));
  for (int64_t b = 0; b < out * in / per; ++b) {
    uint8_t* blk = w.data() + b * block_bytes;
    const uint16_t d = b % 7 == 3 ? 0 : to_half(u(rng));
    const uint16_t dmin = to_half(u(rng));
    switch (dt) {
      case DataType::kQ6_K:
        std::memcpy(blk + 208, &d, 2);
        break;
      case DataType::kQ4_K:
        std::memcpy(blk, &d, 2);
        std::memcpy(blk + 2, &dmin, 2);
        break;
      default:
        std::memcpy(blk, &d, 2);
    }
  }
  return w;
}

// y[r, o] in f64: Σ_k W[o, k]·x̂[r, k], x̂ the quantized-then-dequantized x (as the weights' x
// block type), W dequantized.
std::vector<double> reference(DataType dt, const std::vector<uint8_t>& w,
                              const std::vector<float>& x, int64_t rows, int64_t in, int64_t out,
                              std::vector<double>* mag) {
  std::vector<float> wf(static_cast<size_t>(out * in));
  task::dequantize_blocks(dt, w.data(), out * in, wf.data());
  const bool super = dt == DataType::kQ4_K || dt == DataType::kQ6_K;
  std::vector<double> y(static_cast<size_t>(rows * out)), m(y.size());
  for (int64_t r = 0; r < rows; ++r) {
    std::vector<float> xr(x.begin() + r * in, x.begin() + (r + 1) * in), d;
    std::vector<int8_t> q;
    std::vector<int16_t> bs;
    if (super) {
      ref_q8_k(xr, q, d, bs);
    } else {
      ref_q8_0(xr, q, d);
    }
    const int64_t per = super ? 256 : 32;
    for (int64_t o = 0; o < out; ++o) {
      double s = 0, a = 0;
      for (int64_t i = 0; i < in; ++i) {
        const double t = static_cast<double>(wf[o * in + i]) * d[i / per] * q[i];
        s += t;
        a += std::fabs(t);
      }
      y[r * out + o] = s;
      m[r * out + o] = a;
    }
  }
  *mag = m;
  return y;
}

std::vector<float> run(task::KernelFn fn, bool acc, std::vector<float>& x, std::vector<uint8_t>& w,
                       DataType dt, int64_t rows, int64_t in, int64_t out, int32_t blocks) {
  std::vector<float> y(static_cast<size_t>(rows * out), acc ? 0.25f : NAN);
  const task::Tensor wt =
      task::Tensor::contiguous(reinterpret_cast<uintptr_t>(w.data()), {out, in}, dt).value();
  const task::TaskArgs args = acc ? matmul_acc_args(view(x, {rows, in}), wt, view(y, {rows, out}))
                                  : matmul_args(view(x, {rows, in}), wt, view(y, {rows, out}));
  EXPECT_TRUE(run_blocks(fn, args, blocks).ok());
  return y;
}

// Every integer-sum target this CPU has (the x86 ones whichever KernelIsa picks), through
// run_int8 directly.
std::vector<std::pair<std::string, matmul_detail::Int8Dots>> all_dots() {
  std::vector<std::pair<std::string, matmul_detail::Int8Dots>> d = {
      {"portable", matmul_detail::int8_dots_portable()}};
#if defined(__x86_64__)
  if (kernel_isa_available(KernelIsa::kX86_64V3))
    d.emplace_back("avx2", matmul_detail::int8_dots_avx2());
  if (matmul_detail::avxvnni_available())
    d.emplace_back("avx-vnni", matmul_detail::int8_dots_avxvnni());
  if (matmul_detail::avx512vnni_available()) {
    d.emplace_back("avx512-vnni", matmul_detail::int8_dots_avx512vnni());
  }
#elif defined(__aarch64__)
  d.emplace_back("neon", matmul_detail::int8_dots_neon());
#endif
  return d;
}

// Every target's quantizers of x are bitwise the shared ones, on Gaussian rows and on the edges:
// zero and tiny blocks (the x86 ones hand blocks below 2^-100 to the shared code), blocks whose
// largest magnitude comes twice with both signs (Q8_K keeps the first), huge values, ties.
TEST(Int8Quantizers, EveryTargetsQuantizersAreBitwiseTheShared) {
  const int64_t k = 2048;
  std::vector<float> x = random_x(static_cast<size_t>(k), 17);
  for (int i = 0; i < 32; ++i) {
    x[64 + i] = 1e-35f * static_cast<float>(i - 16);         // below 2^-100
    x[96 + i] = 0x1p-100f * static_cast<float>(i % 5 + 1);   // just above it
    x[128 + i] = 3e30f * static_cast<float>(i % 7) - 1e30f;  // huge
    x[512 + i] = static_cast<float>(i % 3) - 1.f;            // -1 before +1
  }
  const float ties[] = {127.f, 0.5f, 2.5f, -0.5f, -126.5f, 1.5f};  // amax 127: id 1
  for (size_t i = 0; i < 6; ++i) x[576 + i] = ties[i];
  x[256 + 40] = -9.f;  // super-block 1: -9 first, then +9
  x[256 + 200] = 9.f;
  for (int i = 1024; i < 1280; ++i)  // super-block 4: all tiny
    x[static_cast<size_t>(i)] = 0x1p-120f * static_cast<float>(i % 9);
  std::vector<int8_t> q0(x.size()), rq0(x.size()), qk(x.size()), rqk(x.size());
  std::vector<float> d0(x.size() / 32), rd0(x.size() / 32), dk(x.size() / 256), rdk(x.size() / 256);
  std::vector<int16_t> bs(x.size() / 16), rbs(x.size() / 16);
  matmul_detail::quantize_x_q8_0(x.data(), k, rq0.data(), rd0.data());
  matmul_detail::quantize_x_q8_k(x.data(), k, rqk.data(), rdk.data(), rbs.data());
  for (const auto& [name, dots] : all_dots()) {
    if (dots.quantize_q8_0 != nullptr) {
      dots.quantize_q8_0(x.data(), k, q0.data(), d0.data());
      EXPECT_EQ(q0, rq0) << name;
      EXPECT_EQ(0, std::memcmp(d0.data(), rd0.data(), d0.size() * sizeof(float))) << name;
    }
    if (dots.quantize_q8_k != nullptr) {
      dots.quantize_q8_k(x.data(), k, qk.data(), dk.data(), bs.data());
      EXPECT_EQ(qk, rqk) << name;
      EXPECT_EQ(0, std::memcmp(dk.data(), rdk.data(), dk.size() * sizeof(float))) << name;
      EXPECT_EQ(bs, rbs) << name;
    }
  }
}

// The problem y [rows, out] = x [rows, in] · W [out, in]ᵀ, all three contiguous, W of type `dt`.
matmul_detail::Problem problem(const std::vector<float>& x, int64_t rows, int64_t in,
                               const std::vector<uint8_t>& w, DataType dt, int64_t out,
                               std::vector<float>* y) {
  matmul_detail::Problem p;
  p.x = x.data();
  p.rows = rows;
  p.k = in;
  p.w = w.data();
  p.wt = matmul_detail::weight_type_of(dt);
  p.n = out;
  p.y = y->data();
  p.ldy = out;
  return p;
}

void expect_dots_agree(DataType dt, const std::vector<float>& x, const std::vector<uint8_t>& w,
                       int64_t rows, int64_t in, int64_t out, const std::vector<float>& want,
                       const std::string& what) {
  for (const auto& [name, dots] : all_dots()) {
    std::vector<float> y(static_cast<size_t>(rows * out), NAN);
    matmul_detail::run_int8(problem(x, rows, in, w, dt, out, &y), dots);
    ASSERT_EQ(0, std::memcmp(y.data(), want.data(), y.size() * sizeof(float)))
        << what << ": the " << name << " integer sums differ";
  }
}

void expect_paths(DataType dt, int64_t rows, int64_t in, int64_t out) {
  std::vector<uint8_t> w =
      random_weights(dt, out, in, static_cast<uint32_t>(rows * 7919 + in + out));
  std::vector<float> x = random_x(static_cast<size_t>(rows * in), static_cast<uint32_t>(in + rows));
  std::vector<double> mag;
  const std::vector<double> ref = reference(dt, w, x, rows, in, out, &mag);
  const std::string what =
      absl::StrCat(std::string(task::name_of(dt)), " rows ", rows, " in ", in, " out ", out);
  for (bool acc : {false, true}) {
    std::vector<float> first;
    for (auto [isa, fn] : matmul_paths(Precision::kInt8, acc)) {
      const std::vector<float> y = run(fn, acc, x, w, dt, rows, in, out, 3);
      for (size_t i = 0; i < y.size(); ++i) {
        const double want = ref[i] + (acc ? 0.25 : 0.0);
        // The f32 combine's rounding (matmul_int8.h): far below this bound.
        ASSERT_LE(std::fabs(y[i] - want), 1e-6 * mag[i] + 1e-7)
            << what << " acc " << acc << " " << name_of(isa) << " element " << i;
      }
      if (first.empty()) {
        first = y;
        if (!acc) {
          ASSERT_NO_FATAL_FAILURE(expect_dots_agree(dt, x, w, rows, in, out, y, what));
        }
      } else {
        ASSERT_EQ(0, std::memcmp(first.data(), y.data(), y.size() * sizeof(float)))
            << what << " acc " << acc << ": " << name_of(isa) << " differs from portable";
      }
      // Batch invariance: each row alone, one block, gives its bits in the batch.
      for (int64_t r = 0; r < rows; r += 3) {
        std::vector<float> xr(x.begin() + r * in, x.begin() + (r + 1) * in);
        const std::vector<float> yr = run(fn, acc, xr, w, dt, 1, in, out, 1);
        ASSERT_EQ(0, std::memcmp(yr.data(), y.data() + r * out, yr.size() * sizeof(float)))
            << what << " " << name_of(isa) << ": row " << r << " alone differs";
      }
    }
  }
}

TEST(MatmulInt8, Q8_0AndQ4_0PathsMatchTheQuantizedF64ReferenceOnOddShapes) {
  for (DataType dt : {DataType::kQ8_0, DataType::kQ4_0}) {
    for (int64_t rows : {1, 2, 5, 17}) {
      for (int64_t in : {32, 96, 160, 288, 1120}) {
        for (int64_t out : {1, 5, 37}) ASSERT_NO_FATAL_FAILURE(expect_paths(dt, rows, in, out));
      }
    }
  }
  // One x row's Q4_K takes super-blocks two at a time: an odd count's last one alone at slot 6
  // of its group of 8 (7), at slot 0 of the second group (9) and at slot 0 of the third (17).
  for (int64_t in : {1792, 2304, 4352}) {
    for (int64_t out : {5, 13}) ASSERT_NO_FATAL_FAILURE(expect_paths(DataType::kQ4_K, 1, in, out));
  }
}

// Q8_0 over several x rows takes repacked tiles on AVX2 (W signed) and AVX-VNNI (8 W rows a tile,
// from 4 x rows) and on AVX-512 VNNI (16, from 2 x rows), x rows 8, 4, 2 and 1 at a time: bitwise
// the portable path on every count of x rows around those (23 takes each group), short tiles of W
// rows (outputs 1, 5, 15, 17, 37), an odd number of blocks and partial groups of 8 (K 32, 96, 288,
// 1120), weights with -128 and zero scales.
TEST(MatmulInt8, Q8_0TilesAreBitwiseThePortablePathOnOddShapes) {
  for (int64_t rows : {2, 3, 4, 7, 8, 9, 16, 23}) {
    for (int64_t in : {32, 96, 288, 1120}) {
      for (int64_t out : {1, 5, 15, 16, 17, 37}) {
        const std::vector<uint8_t> w = random_weights(
            DataType::kQ8_0, out, in, static_cast<uint32_t>(rows * 131 + in * 7 + out));
        const std::vector<float> x =
            random_x(static_cast<size_t>(rows * in), static_cast<uint32_t>(rows + in + out));
        std::vector<float> want(static_cast<size_t>(rows * out), NAN);
        matmul_detail::run_int8(problem(x, rows, in, w, DataType::kQ8_0, out, &want),
                                matmul_detail::int8_dots_portable());
        ASSERT_NO_FATAL_FAILURE(
            expect_dots_agree(DataType::kQ8_0, x, w, rows, in, out, want,
                              absl::StrCat("q8_0 rows ", rows, " in ", in, " out ", out)));
      }
    }
  }
}

TEST(MatmulInt8, Q4_KAndQ6_KPathsMatchTheQuantizedF64ReferenceOnOddShapes) {
  for (DataType dt : {DataType::kQ4_K, DataType::kQ6_K}) {
    // x86 takes x rows 4 at a time (7 ends with 3), or from 4 (Q4_K) or 8 (Q6_K) rows on the
    // repacked tiles, 8, 4, 2 and 1 at a time (7 and 31 take each); one x row takes W rows 8 at a
    // time (outputs 1 and 5: one short group; 37: four whole and a short one)
    for (int64_t rows : {1, 2, 7, 17, 31}) {
      for (int64_t in : {256, 768, 2560}) {
        for (int64_t out : {1, 5, 37}) ASSERT_NO_FATAL_FAILURE(expect_paths(dt, rows, in, out));
      }
    }
  }
  // One x row's Q4_K takes super-blocks two at a time: an odd count's last one alone at slot 6
  // of its group of 8 (7), at slot 0 of the second group (9) and at slot 0 of the third (17).
  for (int64_t in : {1792, 2304, 4352}) {
    for (int64_t out : {5, 13}) ASSERT_NO_FATAL_FAILURE(expect_paths(DataType::kQ4_K, 1, in, out));
  }
}

// W rows interleaved 16 at a time (task::DataType::kQ4_K_R16, kQ6_K_R16, kQ8_0_R16;
// Problem::interleaved) give bitwise the plain rows' y on every target: the x86 ones read the
// interleaving (their tiles at every x row count), the portable one through run_deinterleaved. x
// rows 1 to 17 (the tiles' 8, 4, 2 and 1 at a time), one to three groups of 16 W rows, 1 to 10
// super-blocks a row; Q8_0 1 to 80 blocks (the combine's 8 lanes whole and not).
TEST(MatmulInt8, InterleavedRowsAreBitwiseThePlainRows) {
  for (DataType dt : {DataType::kQ4_K, DataType::kQ6_K, DataType::kQ8_0}) {
    const std::vector<int64_t> ins = dt == DataType::kQ8_0
                                         ? std::vector<int64_t>{32, 288, 768, 2560}
                                         : std::vector<int64_t>{256, 768, 2560};
    for (int64_t rows : {1, 2, 3, 4, 7, 8, 17}) {
      for (int64_t in : ins) {
        for (int64_t out : {16, 48}) {
          const std::vector<uint8_t> w =
              random_weights(dt, out, in, static_cast<uint32_t>(rows * 31 + in + out));
          std::vector<uint8_t> wi(w.size());
          task::interleave_rows(task::interleaved_of(dt), w.data(), out, in, wi.data());
          ASSERT_NE(w, wi);
          const std::vector<float> x =
              random_x(static_cast<size_t>(rows * in), static_cast<uint32_t>(rows + 3 * in));
          std::vector<float> want(static_cast<size_t>(rows * out), NAN);
          matmul_detail::run_int8(problem(x, rows, in, w, dt, out, &want),
                                  matmul_detail::int8_dots_portable());
          for (const auto& [name, dots] : all_dots()) {
            std::vector<float> y(want.size(), NAN);
            matmul_detail::Problem p = problem(x, rows, in, wi, dt, out, &y);
            p.interleaved = true;
            matmul_detail::run_int8(p, dots);
            ASSERT_EQ(0, std::memcmp(y.data(), want.data(), y.size() * sizeof(float)))
                << task::name_of(dt) << " rows " << rows << " in " << in << " out " << out << ": "
                << name << " over interleaved rows differs";
          }
        }
      }
    }
  }
}

// AVX2's dots add several vpmaddubsw pair sums in i16 before a run's scale (Q4_K 8 dots, Q6_K 2:
// kDotsPerI16Sum in matmul_int8_x86.h), exact only while each sum stays within ±32,767. Every
// weight at its largest value (Q4_K 15, Q6_K 63, all scales 63 for Q4_K) against x at ±127 puts
// those sums at their bound (30,480 and 32,004); a sum of one more dot would wrap. Q8_0 at -128
// (AVX2's |w| against x with w's sign: pair sums of 32,512; the VNNI dots' w + 128 at 0). Every
// scale and d non-zero (1.0, Q6_K's group scales 127), so no wrapped sum is multiplied away.
// Every target's dots, plain and interleaved rows, fused (1-3 x rows: R 1, 2, and 2 + 1) and
// tiles (4, 8), give bitwise the portable integers' y.
TEST(MatmulInt8, WeightsAndActivationsAtTheirLargestMagnitudeStayExact) {
  constexpr int64_t in = 512, out = 16;
  constexpr uint8_t kOneLo = 0x00, kOneHi = 0x3c;  // binary16 1.0, little-endian
  for (DataType dt : {DataType::kQ4_K, DataType::kQ6_K, DataType::kQ8_0}) {
    std::vector<uint8_t> w = random_weights(dt, out, in, 97);
    const int64_t block_weights = dt == DataType::kQ8_0 ? 32 : 256;
    const int64_t block_bytes = static_cast<int64_t>(task::bytes_of(dt, block_weights));
    for (int64_t b = 0; b < out * in / block_weights; ++b) {
      uint8_t* blk = w.data() + b * block_bytes;
      if (dt == DataType::kQ4_K) {
        blk[0] = blk[2] = kOneLo;  // d and dmin 1.0
        blk[1] = blk[3] = kOneHi;
        std::memset(blk + 4, 0xff, 12 + 128);  // scales and mins 63, every q 15
      } else if (dt == DataType::kQ6_K) {
        std::memset(blk, 0xff, 128 + 64);  // ql and qh: every q 63
        std::memset(blk + 192, 127, 16);   // the group scales
        blk[208] = kOneLo;                 // d 1.0
        blk[209] = kOneHi;
      } else {
        blk[0] = kOneLo;  // d 1.0
        blk[1] = kOneHi;
        std::memset(blk + 2, 0x80, 32);  // every q -128
      }
    }
    std::vector<uint8_t> wi(w.size());
    task::interleave_rows(task::interleaved_of(dt), w.data(), out, in, wi.data());
    for (float sign : {1.0f, -1.0f}) {
      for (int64_t rows : {1, 2, 3, 4, 8}) {
        const std::vector<float> x(static_cast<size_t>(rows * in), sign);  // every q ±127
        std::vector<float> want(static_cast<size_t>(rows * out), NAN);
        matmul_detail::run_int8(problem(x, rows, in, w, dt, out, &want),
                                matmul_detail::int8_dots_portable());
        for (const auto& [name, dots] : all_dots()) {
          for (bool interleaved : {false, true}) {
            std::vector<float> y(want.size(), NAN);
            matmul_detail::Problem p = problem(x, rows, in, interleaved ? wi : w, dt, out, &y);
            p.interleaved = interleaved;
            matmul_detail::run_int8(p, dots);
            ASSERT_EQ(0, std::memcmp(y.data(), want.data(), y.size() * sizeof(float)))
                << task::name_of(dt) << " rows " << rows << " x " << sign << ": " << name
                << (interleaved ? " over interleaved rows" : " over plain rows") << " differs";
          }
        }
      }
    }
  }
}

// The model runner stores Q4_K, Q6_K and Q8_0 interleaved for precision int8 on the x86 targets,
// whose int8 dots read them natively (every set: AVX-512 VNNI, AVX-VNNI, AVX2), never for the exact
// or bf16 precisions, the portable and NEON targets, or a target the CPU lacks.
TEST(MatmulInt8, InterleavedWeightsArePreferredWhereTheInt8DotsReadThem) {
#if defined(__x86_64__)
  EXPECT_EQ(prefers_interleaved_weights(KernelIsa::kAvx512, Precision::kInt8),
            kernel_isa_available(KernelIsa::kAvx512));
  EXPECT_EQ(prefers_interleaved_weights(KernelIsa::kX86_64V3, Precision::kInt8),
            kernel_isa_available(KernelIsa::kX86_64V3));
  EXPECT_EQ(prefers_interleaved_weights(KernelIsa::kAuto, Precision::kInt8),
            resolve_kernel_isa(KernelIsa::kAuto) != KernelIsa::kPortable);
  EXPECT_FALSE(prefers_interleaved_weights(KernelIsa::kX86_64V3, Precision::kExact));
#endif
  EXPECT_FALSE(prefers_interleaved_weights(KernelIsa::kAvx512, Precision::kExact));
  EXPECT_FALSE(prefers_interleaved_weights(KernelIsa::kAvx512, Precision::kBf16));
  EXPECT_FALSE(prefers_interleaved_weights(KernelIsa::kPortable, Precision::kInt8));
  EXPECT_FALSE(prefers_interleaved_weights(KernelIsa::kNeon, Precision::kInt8));
}

// W of `dt` with random values: the block types' random blocks, f32 and bf16 from random floats.
std::vector<uint8_t> claim_test_weights(DataType dt, int64_t out, int64_t in) {
  if (dt != DataType::kFloat32 && dt != DataType::kBFloat16) return random_weights(dt, out, in, 17);
  const std::vector<float> f = random_x(static_cast<size_t>(out * in), 23, false);
  std::vector<uint8_t> w(task::bytes_of(dt, static_cast<uint64_t>(out * in)));
  for (size_t i = 0; i < f.size(); ++i) {
    uint32_t bits;
    std::memcpy(&bits, &f[i], 4);
    if (dt == DataType::kFloat32) std::memcpy(&w[4 * i], &bits, 4);
    if (dt == DataType::kBFloat16) {
      const auto top = static_cast<uint16_t>(bits >> 16);
      std::memcpy(&w[2 * i], &top, 2);
    }
  }
  return w;
}

// The blocks really claimed the rows (row_claims.h's words: the rows taken from the front of
// block b's share in the low 32 bits, from its back in the high ones): every row once; in turn,
// the last block, run first, took every other block's share from its back.
void expect_claimed(const std::vector<uint64_t>& words, int64_t out, int32_t blocks, bool threads,
                    const std::string& what) {
  ASSERT_EQ(words.size(), static_cast<size_t>(blocks)) << what;
  int64_t claimed = 0;
  for (int32_t b = 0; b < blocks; ++b) {
    const BlockRange r = block_range(out, b, blocks);
    const auto front = static_cast<int64_t>(words[b] & 0xFFFFFFFF);
    const auto back = static_cast<int64_t>(words[b] >> 32);
    EXPECT_EQ(front + back, r.end - r.begin) << what << ": block " << b << "'s share";
    if (!threads && b + 1 < blocks) {
      EXPECT_EQ(back, r.end - r.begin) << what << ": block " << b;
    }
    claimed += front + back;
  }
  EXPECT_EQ(claimed, out) << what;
}

// A matmul whose blocks claim their rows (RowClaims over KernelContext::task_lines) writes bitwise
// what a fixed split writes, whichever block computes which rows: the block weight types at
// precisions int8 and exact, f32 and bf16 W at exact and bf16 (its AVX-512 BF16 kernel below 16 x
// rows, oneDNN's GEMM from 16, which keeps the fixed split), every path this CPU runs, one and
// several x rows, 2 and 3 blocks, the blocks one after another (the last claims every row) and on
// threads at once. 1000 W rows at K 512 take claims of 64-128 rows (~32 KiB of W) and less at the
// end, so the threads take each other's rows.
TEST(MatmulInt8, RowsClaimedByTheBlocksAreBitwiseAFixedSplit) {
  const int64_t in = 512, out = 1000;
  for (DataType dt : {DataType::kQ8_0, DataType::kQ4_0, DataType::kQ4_K, DataType::kQ6_K,
                      DataType::kFloat32, DataType::kBFloat16}) {
    std::vector<uint8_t> w = claim_test_weights(dt, out, in);
    const bool blocks_type = dt != DataType::kFloat32 && dt != DataType::kBFloat16;
    for (int64_t rows : {1, 3, 16}) {
      std::vector<float> x = random_x(static_cast<size_t>(rows * in), static_cast<uint32_t>(rows));
      for (Precision precision : {Precision::kInt8, Precision::kExact, Precision::kBf16}) {
        if ((precision == Precision::kInt8) != blocks_type && precision != Precision::kExact) {
          continue;  // int8 for the block types, bf16 for f32 / bf16 W, exact for all
        }
        for (bool acc : {false, true}) {
          for (auto [isa, fn] : matmul_paths(precision, acc)) {
            const std::vector<float> want = run(fn, acc, x, w, dt, rows, in, out, 1);
            for (int32_t blocks : {2, 3}) {
              for (bool threads : {false, true}) {
                std::vector<float> y(want.size(), acc ? 0.25f : NAN);
                const task::Tensor wt =
                    task::Tensor::contiguous(reinterpret_cast<uintptr_t>(w.data()), {out, in}, dt)
                        .value();
                const task::TaskArgs args =
                    acc ? matmul_acc_args(view(x, {rows, in}), wt, view(y, {rows, out}))
                        : matmul_args(view(x, {rows, in}), wt, view(y, {rows, out}));
                std::vector<uint64_t> words;
                ASSERT_TRUE(
                    testing::run_blocks_sharing_lines(fn, args, blocks, threads, &words).ok());
                const std::string what =
                    absl::StrCat(std::string(task::name_of(dt)), " rows ", rows, " ",
                                 name_of(precision), " acc ", acc ? 1 : 0, " ", name_of(isa), ", ",
                                 blocks, " blocks", threads ? " on threads" : " in turn");
                ASSERT_EQ(0, std::memcmp(y.data(), want.data(), y.size() * sizeof(float))) << what;
                ASSERT_NO_FATAL_FAILURE(expect_claimed(words, out, blocks, threads, what));
              }
            }
          }
        }
      }
    }
  }
}

// Precision int8 really quantizes x (it differs from the exact path), within x's 8-bit rounding
// (relative L2 well under 1e-2 here); f32 weights are computed exactly under it.
TEST(MatmulInt8, DiffersFromTheExactPathByTheActivationRoundingOnly) {
  const int64_t rows = 3, in = 512, out = 64;
  std::vector<float> x = random_x(rows * in, 5, false);
  for (DataType dt : {DataType::kQ8_0, DataType::kQ4_K}) {
    std::vector<uint8_t> w = random_weights(dt, out, in, 9);
    const auto exact = llm_kernels(KernelIsa::kPortable, Precision::kExact);
    const auto int8 = llm_kernels(KernelIsa::kPortable, Precision::kInt8);
    const auto matmul = static_cast<size_t>(KernelId::kMatmul);
    const std::vector<float> ye = run(exact[matmul].fn, false, x, w, dt, rows, in, out, 1);
    const std::vector<float> yi = run(int8[matmul].fn, false, x, w, dt, rows, in, out, 1);
    double num = 0, den = 0;
    for (size_t i = 0; i < ye.size(); ++i) {
      num += (ye[i] - yi[i]) * (ye[i] - yi[i]);
      den += ye[i] * ye[i];
    }
    EXPECT_GT(num, 0) << task::name_of(dt);
    EXPECT_LT(std::sqrt(num / den), 1e-2) << task::name_of(dt);
  }
  std::vector<float> wf(static_cast<size_t>(out * in), 0.5f);
  std::vector<float> ye(rows * out), yi(rows * out);
  const auto matmul = static_cast<size_t>(KernelId::kMatmul);
  ASSERT_TRUE(
      run_blocks(llm_kernels(KernelIsa::kPortable, Precision::kExact)[matmul].fn,
                 matmul_args(view(x, {rows, in}), view(wf, {out, in}), view(ye, {rows, out})), 1)
          .ok());
  ASSERT_TRUE(
      run_blocks(llm_kernels(KernelIsa::kPortable, Precision::kInt8)[matmul].fn,
                 matmul_args(view(x, {rows, in}), view(wf, {out, in}), view(yi, {rows, out})), 1)
          .ok());
  EXPECT_EQ(ye, yi);
}

TEST(MatmulInt8, PrecisionNamesParse) {
  EXPECT_EQ(parse_precision("int8").value(), Precision::kInt8);
  EXPECT_STREQ(name_of(Precision::kInt8), "int8");
  EXPECT_EQ(parse_precision("int4").status().message(),
            "precision 'int4': expected exact, bf16 or int8");
  EXPECT_EQ(effective_precision(KernelIsa::kPortable, Precision::kInt8), Precision::kInt8);
}

}  // namespace
}  // namespace simpler::llm
