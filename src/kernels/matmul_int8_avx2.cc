// The AVX2 target of the int8-activation matmul (matmul_int8.h, matmul_int8_x86.h): vpmaddubsw then
// vpmaddwd. Built with -mavx2 -mfma -mf16c; runs only where x86_64_v3_available().
#include <immintrin.h>

#include "kernels/matmul_int8.h"
#include "kernels/matmul_int8_x86.h"

namespace simpler::llm::matmul_detail {
namespace {

struct Avx2Dot {
  static __m256i dot(__m256i acc, __m256i u, __m256i s) {
    const __m256i pairs = _mm256_maddubs_epi16(u, s);
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
  }
  static __m256i madd(__m256i acc, __m256i a, __m256i b) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
  }
  static constexpr bool kUnsignedFullRange = false;
};

}  // namespace

Int8Dots int8_dots_avx2() { return x86_dots<Avx2Dot>(); }

}  // namespace simpler::llm::matmul_detail
