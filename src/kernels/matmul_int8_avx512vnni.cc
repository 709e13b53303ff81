// The AVX-512 VNNI target of the int8-activation matmul (matmul_int8.h, matmul_int8_x86.h):
// vpdpbusd on 256-bit vectors (EVEX, AVX512_VL). Built with -mavx2 -mfma -mf16c -mavx512f
// -mavx512bw -mavx512vl -mavx512vnni; runs only where avx512vnni_available().
#include <immintrin.h>

#include "kernels/matmul_int8.h"
#include "kernels/matmul_int8_x86.h"

namespace simpler::llm::matmul_detail {
namespace {

struct Avx512VnniDot {
  static __m256i dot(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_epi32(acc, u, s); }
  static __m256i madd(__m256i acc, __m256i a, __m256i b) { return _mm256_dpwssd_epi32(acc, a, b); }
};

}  // namespace

Int8Dots int8_dots_avx512vnni() { return x86_dots<Avx512VnniDot>(); }

}  // namespace simpler::llm::matmul_detail
