// The AVX-VNNI target of the int8-activation matmul (matmul_int8.h, matmul_int8_x86.h): vpdpbusd
// on 256-bit vectors (VEX). Built with -mavx2 -mfma -mf16c -mavxvnni; runs only where
// avxvnni_available().
#include <immintrin.h>

#include "kernels/matmul_int8.h"
#include "kernels/matmul_int8_x86.h"

namespace simpler::llm::matmul_detail {
namespace {

struct AvxVnniDot {
  static __m256i dot(__m256i acc, __m256i u, __m256i s) {
    return _mm256_dpbusd_avx_epi32(acc, u, s);
  }
  static __m256i madd(__m256i acc, __m256i a, __m256i b) {
    return _mm256_dpwssd_avx_epi32(acc, a, b);
  }
  static constexpr bool kUnsignedFullRange = true;
};

}  // namespace

Int8Dots int8_dots_avxvnni() { return x86_dots<AvxVnniDot>(); }

}  // namespace simpler::llm::matmul_detail
