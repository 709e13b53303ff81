// The matmul paths of a cross-built target, run under qemu-user by scripts/test_neon.sh
// (kernels only: the rest of simpler needs the target's libraries, which a cross build lacks).
// On aarch64: the NEON path against the portable one bitwise (the 16-lane contract of
// matmul_impl.h), both against the f64 product of the same widened values, on odd shapes (rows
// 1-17, K around the 4- and 16-lane widths and past the blocks of k) and every weight type, Q8_0,
// Q4_0, Q4_K and Q6_K included (the
// portable path is fused on aarch64: portable_fused()); the FMA probe; and the portable attention
// tile's exact fused multiply-add against the hardware one; the int8-activation path's NEON
// integer sums (sdot or widening multiplies) against the portable ones, bitwise. A plain main (the
// target's GoogleTest is not installed): it prints the first mismatches and exits 1.
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "Eigen/Core"
#include "kernels/matmul_impl.h"
#include "kernels/matmul_int8.h"

namespace md = simpler::llm::matmul_detail;

namespace {

int failures = 0;

void fail(const char* what, double got, double want) {
  if (++failures <= 10) std::printf("FAIL %s: got %.9g, want %.9g\n", what, got, want);
}

struct Weights {
  std::vector<uint8_t> bytes;
  std::vector<double> values;  // the widened values
};

// n / 32 Q8_0 blocks: a random f16 scale (every 5th block an f16 subnormal), any int8 q.
Weights make_q8_0_weights(size_t n, std::mt19937& gen) {
  std::uniform_real_distribution<float> u(-0.05f, 0.05f);
  std::uniform_int_distribution<int> q(-128, 127);
  Weights w;
  for (size_t b = 0; b < n / 32; ++b) {
    uint16_t d = Eigen::numext::bit_cast<uint16_t>(Eigen::half(u(gen)));
    if (b % 5 == 2) d = static_cast<uint16_t>(1 + b % 900);
    w.bytes.push_back(static_cast<uint8_t>(d & 0xff));
    w.bytes.push_back(static_cast<uint8_t>(d >> 8));
    const double scale = static_cast<float>(Eigen::numext::bit_cast<Eigen::half>(d));
    for (int i = 0; i < 32; ++i) {
      const int v = q(gen);
      w.bytes.push_back(static_cast<uint8_t>(static_cast<int8_t>(v)));
      w.values.push_back(scale * v);
    }
  }
  return w;
}

// n / 32 Q4_0 blocks: Q8_0's scales and the first 16 of its random bytes as nibble pairs.
Weights make_q4_0_weights(size_t n, std::mt19937& gen) {
  const Weights q8 = make_q8_0_weights(n, gen);
  Weights w;
  for (size_t b = 0; b < n / 32; ++b) {
    const uint8_t* block = q8.bytes.data() + b * 34;
    w.bytes.insert(w.bytes.end(), block, block + 18);
    const uint16_t d = static_cast<uint16_t>(block[0] | block[1] << 8);
    const double scale = static_cast<float>(Eigen::numext::bit_cast<Eigen::half>(d));
    for (int i = 0; i < 32; ++i) {
      const uint8_t byte = block[2 + i % 16];
      w.values.push_back(scale * ((i < 16 ? byte & 15 : byte >> 4) - 8));
    }
  }
  return w;
}

// A random f16 scale (every 5th an f16 subnormal), as a double.
uint16_t random_scale(size_t b, std::mt19937& gen) {
  std::uniform_real_distribution<float> u(-0.05f, 0.05f);
  uint16_t d = Eigen::numext::bit_cast<uint16_t>(Eigen::half(u(gen)));
  if (b % 5 == 2) d = static_cast<uint16_t>(1 + b % 900);
  return d;
}
double half(uint16_t h) { return static_cast<float>(Eigen::numext::bit_cast<Eigen::half>(h)); }

// n / 256 Q4_K super-blocks (random d, dmin and bytes; values by ggml's dequantize_row_q4_K
// loop, (d·sc)·q - dmin·m exact in f64, rounded once to f32) or Q6_K ones (random bytes and d;
// d·sc·(q - 32), exact).
Weights make_k_weights(md::WeightType wt, size_t n, std::mt19937& gen) {
  std::uniform_int_distribution<int> byte(0, 255);
  Weights w;
  const bool q4 = wt == md::WeightType::kQ4_K;
  for (size_t b = 0; b < n / 256; ++b) {
    uint8_t k[210];
    for (uint8_t& v : k) v = static_cast<uint8_t>(byte(gen));
    const uint16_t d = random_scale(b, gen), dmin = random_scale(b + 1, gen);
    std::memcpy(k + (q4 ? 0 : 208), &d, 2);
    if (q4) std::memcpy(k + 2, &dmin, 2);
    std::vector<double> v(256);
    for (int c = 0; c < 4 && q4; ++c) {
      for (int j = 2 * c; j < 2 * c + 2; ++j) {
        const uint8_t* sc = k + 4;
        const int s = j < 4 ? sc[j] & 63 : (sc[j + 4] & 15) | ((sc[j - 4] >> 6) << 4);
        const int m = j < 4 ? sc[j + 4] & 63 : (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4);
        for (int l = 0; l < 32; ++l) {
          const uint8_t q = k[16 + 32 * c + l];
          v[32 * j + l] =
              static_cast<float>(half(d) * s * (j == 2 * c ? q & 15 : q >> 4) - half(dmin) * m);
        }
      }
    }
    for (int h = 0; h < 2 && !q4; ++h) {
      const uint8_t *ql = k + 64 * h, *qh = k + 128 + 32 * h;
      const auto* sc = reinterpret_cast<const int8_t*>(k + 192 + 8 * h);
      for (int l = 0; l < 32; ++l) {
        v[128 * h + l] = half(d) * sc[l / 16] * (((ql[l] & 15) | (qh[l] & 3) << 4) - 32);
        v[128 * h + l + 32] =
            half(d) * sc[l / 16 + 2] * (((ql[l + 32] & 15) | ((qh[l] >> 2) & 3) << 4) - 32);
        v[128 * h + l + 64] =
            half(d) * sc[l / 16 + 4] * (((ql[l] >> 4) | ((qh[l] >> 4) & 3) << 4) - 32);
        v[128 * h + l + 96] =
            half(d) * sc[l / 16 + 6] * (((ql[l + 32] >> 4) | ((qh[l] >> 6) & 3) << 4) - 32);
      }
    }
    w.bytes.insert(w.bytes.end(), k, k + (q4 ? 144 : 210));
    w.values.insert(w.values.end(), v.begin(), v.end());
  }
  return w;
}

Weights make_weights(md::WeightType wt, size_t n, std::mt19937& gen) {
  if (wt == md::WeightType::kQ8_0) return make_q8_0_weights(n, gen);
  if (wt == md::WeightType::kQ4_0) return make_q4_0_weights(n, gen);
  if (wt == md::WeightType::kQ4_K || wt == md::WeightType::kQ6_K) return make_k_weights(wt, n, gen);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  Weights w;
  w.values.resize(n);
  w.bytes.resize(n * (wt == md::WeightType::kF32 ? 4 : 2));
  for (size_t i = 0; i < n; ++i) {
    const float f = u(gen);
    if (wt == md::WeightType::kF32) {
      std::memcpy(w.bytes.data() + 4 * i, &f, 4);
      w.values[i] = f;
    } else if (wt == md::WeightType::kBF16) {
      const uint16_t h = static_cast<uint16_t>(std::bit_cast<uint32_t>(f) >> 16);
      std::memcpy(w.bytes.data() + 2 * i, &h, 2);
      w.values[i] = std::bit_cast<float>(static_cast<uint32_t>(h) << 16);
    } else {
      const uint16_t h = Eigen::numext::bit_cast<uint16_t>(Eigen::half(f));
      std::memcpy(w.bytes.data() + 2 * i, &h, 2);
      w.values[i] = static_cast<float>(Eigen::half(f));
    }
  }
  return w;
}

// y = x·Wᵀ over `rows` rows of x [rows, k] and W [n, k] of type `wt`, y dense [rows, n]; y
// and accumulate left to the caller.
md::Problem problem(const std::vector<float>& x, int64_t rows, int64_t k, const Weights& w,
                    md::WeightType wt, int64_t n) {
  md::Problem p;
  p.x = x.data();
  p.rows = rows;
  p.k = k;
  p.w = w.bytes.data();
  p.wt = wt;
  p.n = n;
  p.ldy = n;
  return p;
}

[[maybe_unused]] void check_shapes() {
  std::mt19937 gen(7);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  int cases = 0;
  for (md::WeightType wt :
       {md::WeightType::kF32, md::WeightType::kBF16, md::WeightType::kF16, md::WeightType::kQ8_0,
        md::WeightType::kQ4_0, md::WeightType::kQ4_K, md::WeightType::kQ6_K}) {
    for (int64_t rows : {1, 2, 3, 5, 16, 17}) {
      for (int64_t k : {1, 3, 4, 5, 15, 16, 17, 32, 96, 100, 256, 512, 1100, 1120, 2503, 2560}) {
        const bool blocks = wt == md::WeightType::kQ8_0 || wt == md::WeightType::kQ4_0;
        const bool super = wt == md::WeightType::kQ4_K || wt == md::WeightType::kQ6_K;
        if ((blocks && k % 32 != 0) || (super && k % 256 != 0)) continue;  // whole blocks
        for (int64_t n : {1, 5, 6, 7, 37}) {
          std::vector<float> x(rows * k), y0(rows * n);
          for (float& v : x) v = u(gen);
          for (float& v : y0) v = u(gen);
          const Weights w = make_weights(wt, static_cast<size_t>(n * k), gen);
          for (bool acc : {false, true}) {
            std::vector<float> y_portable = y0, y_neon = y0;
            md::Problem p = problem(x, rows, k, w, wt, n);
            p.accumulate = acc;
            p.y = y_portable.data();
            md::run_portable(p);
            p.y = y_neon.data();
            md::run_neon(p);
            ++cases;
            for (int64_t r = 0; r < rows; ++r) {
              for (int64_t j = 0; j < n; ++j) {
                double want = acc ? y0[r * n + j] : 0.0, mag = std::fabs(want);
                for (int64_t i = 0; i < k; ++i) {
                  want += double(x[r * k + i]) * w.values[j * k + i];
                  mag += std::fabs(double(x[r * k + i]) * w.values[j * k + i]);
                }
                const float a = y_portable[r * n + j], b = y_neon[r * n + j];
                if (std::bit_cast<uint32_t>(a) != std::bit_cast<uint32_t>(b)) {
                  fail("neon differs from portable", b, a);
                }
                if (std::fabs(b - want) > 1e-6 * (1 + mag))
                  fail("neon vs the f64 product", b, want);
              }
            }
          }
        }
      }
    }
  }
  std::printf("matmul: %d cases, neon bitwise equal to portable and within 1e-6 of f64\n", cases);
}

// Precision int8 (matmul_int8.h): the NEON integer sums give bitwise the portable ones' y.
void check_int8() {
  std::mt19937 gen(11);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  int cases = 0;
  for (md::WeightType wt : {md::WeightType::kQ8_0, md::WeightType::kQ4_0, md::WeightType::kQ4_K,
                            md::WeightType::kQ6_K}) {
    const bool super = wt == md::WeightType::kQ4_K || wt == md::WeightType::kQ6_K;
    for (int64_t rows : {1, 3, 17}) {
      for (int64_t k : {32, 96, 256, 1120, 2560}) {
        if (super && k % 256 != 0) continue;
        for (int64_t n : {1, 7, 37}) {
          std::vector<float> x(rows * k), y_portable(rows * n), y_neon(rows * n);
          for (float& v : x) v = u(gen);
          const Weights w = make_weights(wt, static_cast<size_t>(n * k), gen);
          md::Problem p = problem(x, rows, k, w, wt, n);
          p.y = y_portable.data();
          md::run_int8(p, md::int8_dots_portable());
          p.y = y_neon.data();
          md::run_int8(p, md::int8_dots_neon());
          ++cases;
          for (size_t i = 0; i < y_neon.size(); ++i) {
            if (std::bit_cast<uint32_t>(y_neon[i]) != std::bit_cast<uint32_t>(y_portable[i])) {
              fail("int8: neon differs from portable", y_neon[i], y_portable[i]);
            }
          }
        }
      }
    }
  }
  std::printf("int8: %d cases, neon bitwise equal to portable\n", cases);
}

[[maybe_unused]] void check_fma() {
  std::mt19937 gen(5);
  std::uniform_real_distribution<float> u(-2.0f, 2.0f);
  for (int i = 0; i < 200000; ++i) {
    const float a = std::ldexp(u(gen), i % 40 - 20), b = u(gen), c = i % 3 ? u(gen) : -a * b;
    const float got = md::fma_exact_attention(a, b, c), want = std::fma(a, b, c);
    if (std::bit_cast<uint32_t>(got) != std::bit_cast<uint32_t>(want)) {
      fail("fma_exact_attention", got, want);
    }
  }
  const float probe = md::fma_probe_neon(1000, 1.0f);
  if (!std::isfinite(probe)) fail("fma_probe_neon is not finite", probe, 0);
  std::printf("fma: 200000 operands agree with std::fma; probe %.6g\n", probe);
}

}  // namespace

int main() {
  if (!md::neon_available()) {
    std::printf("FAIL neon_available() is false on aarch64\n");
    return 1;
  }
  if (!md::portable_fused()) {  // the bitwise comparison below rests on it
    std::printf("FAIL portable_fused() is false on aarch64\n");
    return 1;
  }
#if defined(SIMPLER_CROSS_INT8_ONLY)  // the sdot build: only the int8 path differs there
  check_int8();
#else
  check_shapes();
  check_int8();
  check_fma();
#endif
  std::printf("%s: %d failure(s)\n", failures == 0 ? "ok" : "FAILED", failures);
  return failures == 0 ? 0 : 1;
}
