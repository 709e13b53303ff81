// The portable path of matmul_impl.h and the CPU check for the AVX-512 one.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "llm/matmul_impl.h"
#include "simpler/task/data_type.h"

namespace simpler::llm::matmul_detail {
namespace {

constexpr int kLanes = 16;
constexpr int64_t kChunkBytes = 256 * 1024;

float widen(const void* w, WeightType wt, int64_t i) {
  switch (wt) {
    case WeightType::kF32:
      return static_cast<const float*>(w)[i];
    case WeightType::kBF16:
      return task::bf16_to_f32(static_cast<const uint16_t*>(w)[i]);
    case WeightType::kF16:
      return task::f16_to_f32(static_cast<const uint16_t*>(w)[i]);
  }
  return 0;
}

float dot(const float* x, const void* w, WeightType wt, int64_t w_offset, int64_t k) {
  float lanes[kLanes] = {};
  for (int64_t kk = 0; kk < k; kk += kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      const int64_t i = kk + l;
      const float xv = i < k ? x[i] : 0.0f;
      const float wv = i < k ? widen(w, wt, w_offset + i) : 0.0f;
      lanes[l] = std::fma(xv, wv, lanes[l]);
    }
  }
  float s8[8], s4[4], s2[2];
  for (int i = 0; i < 8; ++i) s8[i] = lanes[i] + lanes[i + 8];
  for (int i = 0; i < 4; ++i) s4[i] = s8[i] + s8[i + 4];
  for (int i = 0; i < 2; ++i) s2[i] = s4[i] + s4[i + 2];
  return s2[0] + s2[1];
}

}  // namespace

void run_portable(const Problem& p) {
  const int64_t elem = p.wt == WeightType::kF32 ? 4 : 2;
  const int64_t chunk = std::max<int64_t>(8, kChunkBytes / std::max<int64_t>(p.k * elem, 1));
  for (int64_t j0 = 0; j0 < p.n; j0 += chunk) {
    const int64_t j1 = std::min(p.n, j0 + chunk);
    for (int64_t r = 0; r < p.rows; ++r) {
      for (int64_t j = j0; j < j1; ++j) {
        const float s = dot(p.x + r * p.k, p.w, p.wt, j * p.k, p.k);
        float* out = p.y + r * p.ldy + j;
        *out = p.accumulate ? *out + s : s;
      }
    }
  }
}

float fma_probe_portable(int64_t iters, float seed) {
  float acc[12][kLanes];
  for (int i = 0; i < 12; ++i) {
    for (int l = 0; l < kLanes; ++l) acc[i][l] = seed + static_cast<float>(i);
  }
  for (int64_t it = 0; it < iters; ++it) {
    for (int i = 0; i < 12; ++i) {
      for (int l = 0; l < kLanes; ++l) acc[i][l] = std::fma(acc[i][l], 0.999999f, 1e-7f);
    }
  }
  float s = 0;
  for (int i = 0; i < 12; ++i) {
    for (int l = 0; l < kLanes; ++l) s += acc[i][l];
  }
  return s;
}

bool avx512_available() {
  static const bool available =
      __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  return available;
}

}  // namespace simpler::llm::matmul_detail
