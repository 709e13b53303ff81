// The int8-activation matmul (matmul_int8.h): the quantizers of x, the shared combine of the
// targets' integer sums, and the portable target's integer sums. Built with the baseline flags and
// -ffp-contract=off (CMakeLists.txt), one copy for every target, so the float operations of the
// combine are the same instructions whichever target computed the integers.
#include "kernels/matmul_int8.h"

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string_view>
#include <vector>

#if defined(__x86_64__)
#include <cpuid.h>
#endif

#include "kernels/matmul_impl.h"
#include "kernels/matmul_tile.h"

namespace simpler::llm::matmul_detail {
namespace {

// f32 to IEEE binary16 bits, rounded to nearest even (as GGML_FP32_TO_FP16); overflow to ±inf.
uint16_t float_to_half(float f) {
  uint32_t x;
  std::memcpy(&x, &f, sizeof(x));
  const auto sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  x &= 0x7fffffffu;
  if (x >= 0x7f800000u)
    return static_cast<uint16_t>(sign | 0x7c00u | (x > 0x7f800000u ? 0x200u : 0));
  if (x >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds past 65504
  if (x < 0x38800000u) {  // below 2^-14: a subnormal half k·2^-24, k = m·2^(e - 126)
    const uint32_t e = x >> 23;
    if (e < 102) return sign;  // below 2^-25: rounds to 0
    const uint32_t m = (x & 0x7fffffu) | 0x800000u;
    const uint32_t s = 126 - e;
    uint32_t k = m >> s;
    const uint32_t rem = m & ((1u << s) - 1), half = 1u << (s - 1);
    if (rem > half || (rem == half && (k & 1u) != 0)) ++k;
    return static_cast<uint16_t>(sign | k);
  }
  const uint32_t rebiased = x - 0x38000000u;  // exponent 127 -> 15
  const uint32_t r = (rebiased + 0xfffu + ((rebiased >> 13) & 1u)) >> 13;
  return static_cast<uint16_t>(sign | r);
}

// v rounded to the nearest integer, ties to even (ggml's nearest_int: |v| < 2^22), kept in
// [-127, 127] (where a finite row's q always lies; a non-finite x gives an unspecified q there).
int8_t nearest_q(float v) {
  const float t = v + 12582912.f;  // 1.5·2^23
  int32_t bits;
  std::memcpy(&bits, &t, sizeof(bits));
  int32_t q = (bits & 0x007fffff) - 0x00400000;
  q = q > 127 ? 127 : q < -127 ? -127 : q;
  return static_cast<int8_t>(q);
}

float abs_f(float v) { return v < 0 ? -v : v; }

// The fixed tree of 8 lanes (matmul_int8.h).
float tree8(const float* l) {
  float s4[4], s2[2];
  for (int i = 0; i < 4; ++i) s4[i] = l[i] + l[i + 4];
  for (int i = 0; i < 2; ++i) s2[i] = s4[i] + s4[i + 2];
  return s2[0] + s2[1];
}

// Q8_0 / Q4_0 (block bytes `stride`): Σ_b (dw_b·dx_b)·S_b in lanes b mod 8.
float combine_blocks(const uint8_t* w, int64_t stride, int64_t blocks, const int32_t* sums,
                     const float* xd) {
  float acc[8] = {};
  for (int64_t b = 0; b < blocks; ++b) {
    const float dd = block_scale(w + b * stride) * xd[b];
    const float t = dd * static_cast<float>(sums[b]);
    acc[b & 7] = acc[b & 7] + t;
  }
  return tree8(acc);
}

// Q4_K: Σ_b (dx·d)·f32(S_b) - Σ_b (dx·dmin)·f32(M_b), each in lanes b mod 8.
float combine_q4_k(const uint8_t* w, int64_t supers, const int32_t* sums, const float* xd,
                   const int16_t* bsums) {
  float acc[8] = {}, accm[8] = {};
  for (int64_t b = 0; b < supers; ++b) {
    const uint8_t* blk = w + b * kQ4_KBlockBytes;
    const uint8_t* s = blk + 4;
    int32_t sum = 0, mins = 0;
    for (int j = 0; j < 8; ++j) {
      const int sc = j < 4 ? s[j] & 63 : (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
      const int mn = j < 4 ? s[j + 4] & 63 : (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
      sum += sc * sums[8 * b + j];
      mins += mn * (bsums[16 * b + 2 * j] + bsums[16 * b + 2 * j + 1]);
    }
    uint16_t dh[2];
    std::memcpy(dh, blk, sizeof(dh));
    const float dd = xd[b] * half_to_float(dh[0]);
    const float dm = xd[b] * half_to_float(dh[1]);
    const float t = dd * static_cast<float>(sum);
    const float u = dm * static_cast<float>(mins);
    acc[b & 7] = acc[b & 7] + t;
    accm[b & 7] = accm[b & 7] + u;
  }
  return tree8(acc) - tree8(accm);
}

// Q6_K: Σ_b (dx·d)·f32(S_b) in lanes b mod 8.
float combine_q6_k(const uint8_t* w, int64_t supers, const int32_t* sums, const float* xd) {
  float acc[8] = {};
  for (int64_t b = 0; b < supers; ++b) {
    const uint8_t* blk = w + b * kQ6_KBlockBytes;
    int32_t sum = 0;
    for (int g = 0; g < 16; ++g) sum += static_cast<int8_t>(blk[192 + g]) * sums[16 * b + g];
    uint16_t dh;
    std::memcpy(&dh, blk + 208, sizeof(dh));
    const float dd = xd[b] * half_to_float(dh);
    const float t = dd * static_cast<float>(sum);
    acc[b & 7] = acc[b & 7] + t;
  }
  return tree8(acc);
}

// ---- the portable target's integer sums (the compiler vectorizes the loops) ----

void dots_q8_0_portable(const uint8_t* w, const int8_t* xq, int64_t blocks, int32_t* sums) {
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* q = w + b * kQ8_0BlockBytes + 2;
    int32_t s = 0;
    for (int i = 0; i < 32; ++i) s += static_cast<int8_t>(q[i]) * xq[32 * b + i];
    sums[b] = s;
  }
}

void dots_q4_0_portable(const uint8_t* w, const int8_t* xq, int64_t blocks, int32_t* sums) {
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* q = w + b * kQ4_0BlockBytes + 2;
    const int8_t* x = xq + 32 * b;
    int32_t s = 0;
    for (int i = 0; i < 16; ++i) s += ((q[i] & 15) - 8) * x[i] + ((q[i] >> 4) - 8) * x[i + 16];
    sums[b] = s;
  }
}

void dots_q4_k_portable(const uint8_t* w, const int8_t* xq, int64_t supers, int32_t* sums) {
  for (int64_t b = 0; b < supers; ++b) {
    const uint8_t* qs = w + b * kQ4_KBlockBytes + 16;
    const int8_t* x = xq + 256 * b;
    for (int c = 0; c < 4; ++c) {  // 32 bytes: sub-block 2c (low nibbles), 2c + 1 (high)
      int32_t lo = 0, hi = 0;
      for (int i = 0; i < 32; ++i) {
        lo += (qs[32 * c + i] & 15) * x[64 * c + i];
        hi += (qs[32 * c + i] >> 4) * x[64 * c + 32 + i];
      }
      sums[8 * b + 2 * c] = lo;
      sums[8 * b + 2 * c + 1] = hi;
    }
  }
}

void dots_q6_k_portable(const uint8_t* w, const int8_t* xq, int64_t supers, int32_t* sums) {
  for (int64_t b = 0; b < supers; ++b) {
    const uint8_t* blk = w + b * kQ6_KBlockBytes;
    const int8_t* x = xq + 256 * b;
    for (int g = 0; g < 16; ++g) {  // weights 16g + i = 128h + 32c + l
      const int h = g / 8, c = g % 8 / 2, l0 = g % 2 * 16;
      const uint8_t* ql = blk + 64 * h + 32 * (c & 1) + l0;
      const uint8_t* qh = blk + 128 + 32 * h + l0;
      int32_t s = 0;
      for (int i = 0; i < 16; ++i) {
        const int lo = c >= 2 ? ql[i] >> 4 : ql[i] & 15;
        const int q = (lo | (((qh[i] >> (2 * c)) & 3) << 4)) - 32;
        s += q * x[16 * g + i];
      }
      sums[16 * b + g] = s;
    }
  }
}

QuantizedX quantize_rows(const Problem& p, bool super, const Int8Dots& dots) {
  QuantizedX qx;
  const int64_t per = super ? kSuperBlockWeights : kQ8_0BlockWeights;
  qx.d_stride = (p.k / per + 7) / 8 * 8;
  qx.q.resize(static_cast<size_t>(p.rows * p.k));
  qx.d.assign(static_cast<size_t>(p.rows * qx.d_stride), 0.f);
  if (super) qx.bsums.resize(static_cast<size_t>(p.rows * (p.k / 16)));
  for (int64_t r = 0; r < p.rows; ++r) {
    int8_t* q = qx.q.data() + r * p.k;
    float* d = qx.d.data() + r * qx.d_stride;
    if (super) {
      (dots.quantize_q8_k != nullptr ? dots.quantize_q8_k : quantize_x_q8_k)(
          p.x + r * p.k, p.k, q, d, qx.bsums.data() + r * (p.k / 16));
    } else {
      (dots.quantize_q8_0 != nullptr ? dots.quantize_q8_0 : quantize_x_q8_0)(p.x + r * p.k, p.k, q,
                                                                             d);
    }
  }
  return qx;
}

// One W row of type WT against x row r.
template <WeightType WT>
float row_dot(const Int8Dots& dots, const uint8_t* w, const QuantizedX& qx, int64_t r, int64_t k,
              int32_t* sums) {
  const int8_t* xq = qx.q.data() + r * k;
  if constexpr (WT == WeightType::kQ8_0 || WT == WeightType::kQ4_0) {
    const int64_t blocks = k / kQ8_0BlockWeights;
    const float* xd = qx.d.data() + r * qx.d_stride;
    constexpr int64_t kBytes = WT == WeightType::kQ8_0 ? kQ8_0BlockBytes : kQ4_0BlockBytes;
    (WT == WeightType::kQ8_0 ? dots.q8_0 : dots.q4_0)(w, xq, blocks, sums);
    return combine_blocks(w, kBytes, blocks, sums, xd);
  } else {
    const int64_t supers = k / kSuperBlockWeights;
    const float* xd = qx.d.data() + r * qx.d_stride;
    if constexpr (WT == WeightType::kQ4_K) {
      dots.q4_k(w, xq, supers, sums);
      return combine_q4_k(w, supers, sums, xd, qx.bsums.data() + r * (k / 16));
    } else {
      dots.q6_k(w, xq, supers, sums);
      return combine_q6_k(w, supers, sums, xd);
    }
  }
}

// W rows in order, each against every x row (a W row stays in L1 while the x rows pass).
template <WeightType WT>
void run_int8_on(const Problem& p, const QuantizedX& qx, const Int8Dots& dots) {
  if (dots.rows != nullptr) return dots.rows(p, qx);
  std::vector<int32_t> sums(static_cast<size_t>(p.k / 16));
  const auto* w = static_cast<const uint8_t*>(p.w);
  const int64_t row_bytes = row_units<WT>(p.k);
  for (int64_t j = 0; j < p.n; ++j) {
    const uint8_t* wr = w + j * row_bytes;
    for (int64_t r = 0; r < p.rows; ++r) {
      const float s = row_dot<WT>(dots, wr, qx, r, p.k, sums.data());
      float* out = p.y + r * p.ldy + j;
      *out = p.accumulate ? *out + s : s;
    }
  }
}

}  // namespace

void quantize_x_q8_0(const float* x, int64_t k, int8_t* q, float* d) {
  for (int64_t b = 0; b < k / kQ8_0BlockWeights; ++b) {
    const float* xb = x + b * kQ8_0BlockWeights;
    float amax = 0;
    for (int i = 0; i < 32; ++i) amax = abs_f(xb[i]) > amax ? abs_f(xb[i]) : amax;
    d[b] = half_to_float(float_to_half(amax / 127.f));
    const float id = amax != 0 ? 127.f / amax : 0.f;
    for (int i = 0; i < 32; ++i) q[b * 32 + i] = nearest_q(xb[i] * id);
  }
}

void quantize_x_q8_k(const float* x, int64_t k, int8_t* q, float* d, int16_t* bsums) {
  for (int64_t b = 0; b < k / kSuperBlockWeights; ++b) {
    const float* xb = x + b * kSuperBlockWeights;
    int8_t* qb = q + b * kSuperBlockWeights;
    float max = 0, amax = 0;
    for (int i = 0; i < 256; ++i) {
      if (abs_f(xb[i]) > amax) {
        amax = abs_f(xb[i]);
        max = xb[i];
      }
    }
    const float iscale = amax != 0 ? -127.f / max : 0.f;
    for (int i = 0; i < 256; ++i) qb[i] = amax != 0 ? nearest_q(iscale * xb[i]) : int8_t{0};
    q8_k_bsums(qb, bsums + 16 * b);
    d[b] = amax != 0 ? 1 / iscale : 0.f;
  }
}

bool int8_weight_type(WeightType wt) {
  return wt == WeightType::kQ8_0 || wt == WeightType::kQ4_0 || wt == WeightType::kQ4_K ||
         wt == WeightType::kQ6_K;
}

QuantizedX quantize_int8(const Problem& p, const Int8Dots& dots) {
  QuantizedX qx = quantize_rows(p, p.wt == WeightType::kQ4_K || p.wt == WeightType::kQ6_K, dots);
  if (dots.prepare != nullptr && dots.rows != nullptr) dots.prepare(p, qx);
  return qx;
}

void run_int8_quantized(const Problem& p, const QuantizedX& qx, const Int8Dots& dots) {
  if (p.interleaved && !(dots.interleaved && dots.rows != nullptr)) {
    return run_deinterleaved(p, [&](const Problem& q) { run_int8_quantized(q, qx, dots); });
  }
  switch (p.wt) {
    case WeightType::kQ8_0:
      return run_int8_on<WeightType::kQ8_0>(p, qx, dots);
    case WeightType::kQ4_0:
      return run_int8_on<WeightType::kQ4_0>(p, qx, dots);
    case WeightType::kQ4_K:
      return run_int8_on<WeightType::kQ4_K>(p, qx, dots);
    case WeightType::kQ6_K:
      return run_int8_on<WeightType::kQ6_K>(p, qx, dots);
    default:
      return;
  }
}

void run_int8(const Problem& p, const Int8Dots& dots) {
  if (!int8_weight_type(p.wt)) return;
  run_int8_quantized(p, quantize_int8(p, dots), dots);
}

bool avxvnni_available() {
#if defined(__x86_64__)
  static const bool available = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;  // CPUID.(7, 1):EAX bit 4, AVX-VNNI
    return x86_64_v3_available() && __get_cpuid_count(7, 1, &a, &b, &c, &d) != 0 &&
           (a & (1u << 4)) != 0;
  }();
  return available;
#else
  return false;
#endif
}

bool int8_avx2_forced() {
  static const bool forced = [] {
    const char* v = std::getenv("SIMPLER_INT8_AVX2");
    return v != nullptr && std::string_view(v) == "1";
  }();
  return forced;
}

bool avx512vnni_available() {
#if defined(__x86_64__)
  static const bool available =
      x86_64_v3_available() && avx512_available() && __builtin_cpu_supports("avx512vnni");
  return available;
#else
  return false;
#endif
}

Int8Dots int8_dots_portable() {
  return {&dots_q8_0_portable, &dots_q4_0_portable, &dots_q4_k_portable, &dots_q6_k_portable};
}

}  // namespace simpler::llm::matmul_detail
