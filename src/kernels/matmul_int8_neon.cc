// The NEON target of the int8-activation matmul (matmul_int8.h): sdot (vdotq_s32) where the build's
// baseline has the dot-product extension (__ARM_FEATURE_DOTPROD: -march=armv8.2-a+dotprod and
// later), else widening multiplies (vmull_s8) and pairwise accumulation (vpadalq_s16): the same
// integer sums either way (exact). Built only for aarch64.
#include <arm_neon.h>

#include <cstdint>

#include "kernels/matmul_impl.h"
#include "kernels/matmul_int8.h"

namespace simpler::llm::matmul_detail {
namespace {

// acc + the products of a and b, four adjacent bytes into each i32 lane (sdot's grouping; the
// fallback groups them otherwise, which an integer sum does not see).
inline int32x4_t dot16(int32x4_t acc, int8x16_t a, int8x16_t b) {
#if defined(__ARM_FEATURE_DOTPROD)
  return vdotq_s32(acc, a, b);
#else
  acc = vpadalq_s16(acc, vmull_s8(vget_low_s8(a), vget_low_s8(b)));
  return vpadalq_s16(acc, vmull_high_s8(a, b));
#endif
}

inline int32_t dot32(int8x16_t w0, int8x16_t w1, const int8_t* x) {
  return vaddvq_s32(dot16(dot16(vdupq_n_s32(0), w0, vld1q_s8(x)), w1, vld1q_s8(x + 16)));
}

void dots_q8_0(const uint8_t* w, const int8_t* xq, int64_t blocks, int32_t* sums) {
  for (int64_t b = 0; b < blocks; ++b) {
    const auto* q = reinterpret_cast<const int8_t*>(w + b * kQ8_0BlockBytes + 2);
    sums[b] = dot32(vld1q_s8(q), vld1q_s8(q + 16), xq + 32 * b);
  }
}

void dots_q4_0(const uint8_t* w, const int8_t* xq, int64_t blocks, int32_t* sums) {
  const int8x16_t k8 = vdupq_n_s8(8);
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8x16_t qs = vld1q_u8(w + b * kQ4_0BlockBytes + 2);
    const int8x16_t lo = vsubq_s8(vreinterpretq_s8_u8(vandq_u8(qs, vdupq_n_u8(15))), k8);
    const int8x16_t hi = vsubq_s8(vreinterpretq_s8_u8(vshrq_n_u8(qs, 4)), k8);
    sums[b] = dot32(lo, hi, xq + 32 * b);
  }
}

void dots_q4_k(const uint8_t* w, const int8_t* xq, int64_t supers, int32_t* sums) {
  const uint8x16_t m4 = vdupq_n_u8(15);
  for (int64_t b = 0; b < supers; ++b) {
    const uint8_t* qs = w + b * kQ4_KBlockBytes + 16;
    const int8_t* x = xq + 256 * b;
    for (int c = 0; c < 4; ++c) {
      const uint8x16_t q0 = vld1q_u8(qs + 32 * c), q1 = vld1q_u8(qs + 32 * c + 16);
      sums[8 * b + 2 * c] = dot32(vreinterpretq_s8_u8(vandq_u8(q0, m4)),
                                  vreinterpretq_s8_u8(vandq_u8(q1, m4)), x + 64 * c);
      sums[8 * b + 2 * c + 1] = dot32(vreinterpretq_s8_u8(vshrq_n_u8(q0, 4)),
                                      vreinterpretq_s8_u8(vshrq_n_u8(q1, 4)), x + 64 * c + 32);
    }
  }
}

void dots_q6_k(const uint8_t* w, const int8_t* xq, int64_t supers, int32_t* sums) {
  const uint8x16_t m4 = vdupq_n_u8(15), m2 = vdupq_n_u8(3);
  for (int64_t b = 0; b < supers; ++b) {
    const uint8_t* blk = w + b * kQ6_KBlockBytes;
    for (int g = 0; g < 16; ++g) {  // weights 16g + i = 128h + 32c + l
      const int h = g / 8, c = g % 8 / 2, l0 = g % 2 * 16;
      const uint8x16_t ql = vld1q_u8(blk + 64 * h + 32 * (c & 1) + l0);
      const uint8x16_t lo = c >= 2 ? vshrq_n_u8(ql, 4) : vandq_u8(ql, m4);
      const uint8x16_t qh = vld1q_u8(blk + 128 + 32 * h + l0);
      const uint8x16_t hi = vandq_u8(vshlq_u8(qh, vdupq_n_s8(static_cast<int8_t>(-2 * c))), m2);
      const int8x16_t q =
          vsubq_s8(vreinterpretq_s8_u8(vorrq_u8(lo, vshlq_n_u8(hi, 4))), vdupq_n_s8(32));
      sums[16 * b + g] = vaddvq_s32(dot16(vdupq_n_s32(0), q, vld1q_s8(xq + 256 * b + 16 * g)));
    }
  }
}

}  // namespace

Int8Dots int8_dots_neon() { return {&dots_q8_0, &dots_q4_0, &dots_q4_k, &dots_q6_k}; }

}  // namespace simpler::llm::matmul_detail
