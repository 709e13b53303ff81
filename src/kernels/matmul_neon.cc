// The aarch64 NEON path of matmul_impl.h (ASIMD with FMA, every aarch64 CPU): matmul_tile.h
// with each 16-lane chunk as four 4-lane float32x4_t parts, so the results are bitwise those of
// the other paths. Built only for aarch64, where ASIMD is part of the baseline: no target flags,
// and no code here can run on a CPU that lacks it.
#include <arm_neon.h>

#include <cstdint>
#include <cstring>

#include "kernels/matmul_impl.h"
#include "kernels/matmul_tile.h"

namespace simpler::llm::matmul_detail {
namespace {

struct Neon : PartsOf<4>, HalfWidthWeights<Neon> {
  using P = float32x4_t;
  static_assert(sizeof(P) == kPartLanes * sizeof(float));
  // 32 vector registers: a 4 x 4 tile holds 16 accumulators (one part at a time, tile_rows), its 4
  // W parts and an x part; one x row streams 6 W rows at a time (24 accumulators, 6 W parts, x).
  static constexpr int kMaxRows = 4;
  static constexpr int kMaxCols = 4;
  static constexpr int kDecodeCols = 6;

  static P zero() { return vdupq_n_f32(0.0f); }
  static P load(const float* p) { return vld1q_f32(p); }
  static P load_tail(const float* p, int n) {
    float part[kPartLanes] = {};
    std::memcpy(part, p, static_cast<size_t>(n) * sizeof(float));
    return vld1q_f32(part);
  }
  static uint16x4_t load_h(const uint16_t* p) { return vld1_u16(p); }
  template <WeightType WT>
  static P widen(uint16x4_t h) {
    if constexpr (WT == WeightType::kBF16) {
      return vreinterpretq_f32_u32(vshll_n_u16(h, 16));  // bf16: the high half of an f32
    } else {
      return vcvt_f32_f16(vreinterpret_f16_u16(h));
    }
  }
  // Q8_0: 4 int8 widened to i32, converted (exact), times the block's scale (exact: 8-bit q
  // times an 11-bit f16 significand fits f32's 24). Reads exactly the 4 bytes.
  static P load_q8_0(const uint8_t* block, int first) {
    uint16_t d_bits;
    uint32_t q_bits;
    std::memcpy(&d_bits, block, sizeof(d_bits));
    std::memcpy(&q_bits, block + 2 + first, sizeof(q_bits));
    const float32x4_t d = vcvt_f32_f16(vreinterpret_f16_u16(vdup_n_u16(d_bits)));
    const int16x8_t q16 = vmovl_s8(vreinterpret_s8_u32(vdup_n_u32(q_bits)));
    return vmulq_f32(d, vcvtq_f32_s32(vmovl_s16(vget_low_s16(q16))));
  }
  // Q4_0: 4 nibbles (low ones of qs[first..] for first < 16, else high ones of qs[first - 16..])
  // widened to i32, less 8, converted and scaled (all exact). Reads exactly the 4 bytes.
  static P load_q4_0(const uint8_t* block, int first) {
    uint16_t d_bits;
    uint32_t q_bits;
    std::memcpy(&d_bits, block, sizeof(d_bits));
    std::memcpy(&q_bits, block + 2 + first % 16, sizeof(q_bits));
    if (first >= 16) q_bits >>= 4;
    q_bits &= 0x0f0f0f0fu;
    const float32x4_t d = vcvt_f32_f16(vreinterpret_f16_u16(vdup_n_u16(d_bits)));
    const uint16x8_t q16 = vmovl_u8(vreinterpret_u8_u32(vdup_n_u32(q_bits)));
    const int32x4_t q32 = vreinterpretq_s32_u32(vmovl_u16(vget_low_u16(q16)));
    return vmulq_f32(d, vcvtq_f32_s32(vsubq_s32(q32, vdupq_n_s32(8))));
  }
  // Four bytes widened to i32 lanes.
  static int32x4_t widen4(uint32_t bytes) {
    const uint16x8_t q16 = vmovl_u8(vreinterpret_u8_u32(vdup_n_u32(bytes)));
    return vreinterpretq_s32_u32(vmovl_u16(vget_low_u16(q16)));
  }
  // Q4_K: 4 nibbles widened and converted, times a (exact), less m (one rounding). Reads exactly
  // the 4 bytes.
  static P load_q4_k(const uint8_t* qs, bool high, float a, float m) {
    uint32_t q_bits;
    std::memcpy(&q_bits, qs, sizeof(q_bits));
    if (high) q_bits >>= 4;
    const float32x4_t f = vcvtq_f32_s32(widen4(q_bits & 0x0f0f0f0fu));
    return vsubq_f32(vmulq_f32(vdupq_n_f32(a), f), vdupq_n_f32(m));
  }
  // Q6_K: 4 low nibbles or'ed with 2 high bits each, less 32, converted and scaled (exact).
  static P load_q6_k(const uint8_t* ql, bool high, const uint8_t* qh, int shift, float s) {
    uint32_t lo, hi;
    std::memcpy(&lo, ql, sizeof(lo));
    std::memcpy(&hi, qh, sizeof(hi));
    if (high) lo >>= 4;
    const uint32_t q = (lo & 0x0f0f0f0fu) | ((hi >> shift) & 0x03030303u) << 4;
    const int32x4_t v = vsubq_s32(widen4(q), vdupq_n_s32(32));
    return vmulq_f32(vdupq_n_f32(s), vcvtq_f32_s32(v));
  }
  static P fmadd(P a, P b, P c) { return vfmaq_f32(c, a, b); }
  // Lane l is lane l % 4 of part l / 4: s8 = (parts 0 + 2, parts 1 + 3), s4 = s8's halves added,
  // s2[i] = s4[i] + s4[i+2], s2[0] + s2[1].
  static float reduce(const P* parts) {
    const P s4 = vaddq_f32(vaddq_f32(parts[0], parts[2]), vaddq_f32(parts[1], parts[3]));
    return (vgetq_lane_f32(s4, 0) + vgetq_lane_f32(s4, 2)) +
           (vgetq_lane_f32(s4, 1) + vgetq_lane_f32(s4, 3));
  }
};

}  // namespace

bool neon_available() { return true; }  // ASIMD is part of the aarch64 baseline

void run_neon(const Problem& p) { run_on<Neon>(p); }

float fma_probe_neon(int64_t iters, float seed) { return fma_probe<Neon>(iters, seed); }

}  // namespace simpler::llm::matmul_detail
