// <immintrin.h> for the files built with the AVX-512 flags (matmul_avx512_common.h,
// matmul_int8_avx512vnni.cc). GCC 12's AVX-512 headers build some intrinsics from
// _mm512_undefined_*(), which its own uninitialized-use warnings then report at every call site
// (a known false positive): those two warnings are off for the rest of the including file.
#pragma once

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>
