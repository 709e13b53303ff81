// Internal to the AVX-512 matmul paths (matmul_avx512.cc, matmul_avx512_bf16.cc): what both
// share. Include it only from files built with the AVX-512 flags. Everything here has internal
// linkage (an anonymous namespace), so no AVX-512 code can be picked by the linker for another
// file's copy of an inline function.
#pragma once

#include "kernels/avx512_intrinsics.h"

namespace simpler::llm::matmul_detail {
namespace {

// The fixed reduction tree of matmul_impl.h: s8[i] = l[i] + l[i+8], s4 = ..., s = s2[0] + s2[1].
inline float reduce(__m512 v) {
  const __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  const __m128 s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
  return _mm_cvtss_f32(s1);
}

}  // namespace
}  // namespace simpler::llm::matmul_detail
