// The portable path of matmul_impl.h (matmul_tile.h on GCC/Clang vector extensions, 4 x 4 lanes,
// any CPU) and the CPU checks for the other paths. Built for the baseline target. Where that
// target has a fused multiply-add instruction (aarch64, and x86-64 built for FMA), each lane's
// step is fused and the results are bitwise those of the other paths. Where it has none (baseline
// x86-64), each step is a multiply, then an add: two roundings, not the contract's bits (the bound
// is in matmul_impl.h). Computing the fused result exactly there (a·b in double, the sum rounded to
// odd) took ~12 instructions a lane, and ran at 8% of the x86-64-v3 path; this runs at ~70% of it
// (one thread streaming bf16 W, Zen 3).
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <cpuid.h>
#endif

#include "Eigen/Core"
#include "kernels/fma_exact.h"
#include "kernels/matmul_impl.h"
#include "kernels/matmul_tile.h"

namespace simpler::llm::matmul_detail {
namespace {

using F4 = float __attribute__((vector_size(16)));
using U16x4 = uint16_t __attribute__((vector_size(8)));
using U32x4 = uint32_t __attribute__((vector_size(16)));

// A lane's step: a·b + c fused where the baseline has an FMA instruction (the contract's bits),
// else a multiply then an add.
#if defined(__FP_FAST_FMAF)
__attribute__((always_inline)) inline F4 fmadd4(F4 a, F4 b, F4 c) {
  F4 r;
  for (int l = 0; l < 4; ++l) r[l] = __builtin_fmaf(a[l], b[l], c[l]);
  return r;
}
#else
__attribute__((always_inline)) inline F4 fmadd4(F4 a, F4 b, F4 c) {
  const F4 p = a * b;  // its own statement: never contracted (clang contracts within one)
  return p + c;
}
#endif

struct Portable : PartsOf<4> {
  using P = F4;
  static_assert(sizeof(P) == kPartLanes * sizeof(float));
  static constexpr int kMaxRows = 2;
  static constexpr int kMaxCols = 2;
  static constexpr int kDecodeCols = 2;

  static P zero() { return P{}; }
  static P load(const float* p) {
    P v;
    std::memcpy(&v, p, sizeof(v));
    return v;
  }
  static P load_tail(const float* p, int n) {
    P v{};
    std::memcpy(&v, p, static_cast<size_t>(n) * sizeof(float));
    return v;
  }
  template <WeightType WT>
  static P widen(const uint16_t* h, int n) {
    P v{};
    for (int l = 0; l < n; ++l) {
      if constexpr (WT == WeightType::kBF16) {
        v[l] = std::bit_cast<float>(static_cast<uint32_t>(h[l]) << 16);  // bf16: the high half
      } else {
        v[l] = static_cast<float>(Eigen::numext::bit_cast<Eigen::half>(h[l]));  // exact
      }
    }
    return v;
  }
  template <WeightType WT>
  static P load_w(const WeightT<WT>* p) {
    if constexpr (WT == WeightType::kBF16) {
      // bf16 is the high half of an f32: 4 of them widened at once (zero-extend, shift).
      U16x4 h;
      std::memcpy(&h, p, sizeof(h));
      const U32x4 bits = __builtin_convertvector(h, U32x4) << 16;
      P v;
      std::memcpy(&v, &bits, sizeof(v));
      return v;
    } else if constexpr (WT == WeightType::kF32) {
      return load(p);
    } else {
      return widen<WT>(p, kPartLanes);
    }
  }
  template <WeightType WT>
  static P load_w_tail(const WeightT<WT>* p, int n) {
    if constexpr (WT == WeightType::kF32) {
      return load_tail(p, n);
    } else {
      return widen<WT>(p, n);
    }
  }
  // Q8_0 / Q4_0: the block's scale widened exactly, times each weight's integer (q, or the
  // nibble less 8): exact in f32.
  template <WeightType WT>
  static P load_block(const uint8_t* block, int first) {
    const float d = block_scale(block);
    P v;
    for (int l = 0; l < kPartLanes; ++l) {
      v[l] = d * static_cast<float>(block_int<WT>(block, first + l));
    }
    return v;
  }
  static P load_q8_0(const uint8_t* block, int first) {
    return load_block<WeightType::kQ8_0>(block, first);
  }
  static P load_q4_0(const uint8_t* block, int first) {
    return load_block<WeightType::kQ4_0>(block, first);
  }
  // Q4_K: a·q exact, less m (one rounding: the same value fused or not).
  static P load_q4_k(const uint8_t* qs, bool high, float a, float m) {
    P v;
    for (int l = 0; l < kPartLanes; ++l) {
      const float aq = a * static_cast<float>(high ? qs[l] >> 4 : qs[l] & 15);
      v[l] = aq - m;
    }
    return v;
  }
  // Q6_K: the 6-bit q less 32 times the sub-block's scale s (exact).
  static P load_q6_k(const uint8_t* ql, bool high, const uint8_t* qh, int shift, float s) {
    P v;
    for (int l = 0; l < kPartLanes; ++l) {
      const int q = ((high ? ql[l] >> 4 : ql[l] & 15) | ((qh[l] >> shift) & 3) << 4) - 32;
      v[l] = s * static_cast<float>(q);
    }
    return v;
  }
  static P fmadd(P a, P b, P c) { return fmadd4(a, b, c); }
  // Lane l is lane l % 4 of part l / 4: s8 = (parts 0 + 2, parts 1 + 3), s4 = s8's halves added,
  // s2[i] = s4[i] + s4[i+2], s2[0] + s2[1].
  static float reduce(const P* parts) {
    const P s8lo = parts[0] + parts[2];
    const P s8hi = parts[1] + parts[3];
    const P s4 = s8lo + s8hi;
    return (s4[0] + s4[2]) + (s4[1] + s4[3]);
  }
};

}  // namespace

bool portable_fused() {
#if defined(__FP_FAST_FMAF)
  return true;
#else
  return false;
#endif
}

float fma_exact_attention(float a, float b, float c) { return fma_exact_scalar(a, b, c); }

int64_t chunk_rows(int64_t row_bytes, int64_t multiple) {
  constexpr int64_t kChunkBytes = 256 * 1024;
  const int64_t chunk = kChunkBytes / (row_bytes > 0 ? row_bytes : 1);
  return chunk < multiple ? multiple : chunk - chunk % multiple;
}

int64_t l1_block_bytes() {
  static const int64_t bytes = [] {
    const long reported = sysconf(_SC_LEVEL1_DCACHE_SIZE);
    const int64_t l1 = std::min<int64_t>(reported, 64 * 1024);
    return std::max<int64_t>(24 * 1024, l1 / 3 * 2);
  }();
  return bytes;
}

void run_portable(const Problem& p) { run_on<Portable>(p); }

float fma_probe_portable(int64_t iters, float seed) { return fma_probe<Portable>(iters, seed); }

bool x86_64_v3_available() {
#if defined(__x86_64__)
  static const bool available = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    const bool f16c = __get_cpuid(1, &a, &b, &c, &d) != 0 && (c & bit_F16C) != 0;
    return f16c && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }();
  return available;
#else
  return false;
#endif
}

bool avx512_available() {
#if defined(__x86_64__)
  static const bool available =
      __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  return available;
#else
  return false;
#endif
}

}  // namespace simpler::llm::matmul_detail
