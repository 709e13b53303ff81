// Internal to the llm kernels: a·b + c rounded once (what std::fma returns), computed without an
// FMA instruction and without libm, for the portable attention tile and SiLU on targets that
// lack one (baseline x86-64; the portable matmul there multiplies, then adds: kernel_isa_fused). In
// double, a·b is exact (24 + 24 significand bits); the sum is rounded to odd (round to nearest,
// then, when inexact and even, one ulp toward the exact value, which the TwoSum error term
// locates); rounding a round-to-odd double (53 bits, at least 24 + 2) to float gives the correctly
// rounded result (Boldo and Melquiond, "Emulation of FMA and correctly rounded sums: proved
// algorithms using rounding to odd", IEEE Transactions on Computers 57(4), 2008). Infinities and
// NaN pass through as std::fma's do. Branch-free, so loops over it vectorize.
#pragma once

#include <bit>
#include <cstdint>

namespace simpler::llm::matmul_detail {

inline float fma_exact_scalar(float a, float b, float c) {
  const double p = static_cast<double>(a) * static_cast<double>(b);
  const double cd = c;
  const double s = p + cd;
  const double bb = s - p;
  const double err = (p - (s - bb)) + (cd - bb);
  // Round to odd: truncated toward zero, last bit set, when inexact (and s finite).
  const bool inexact = err != 0.0 && s - s == 0.0;
  const bool toward_zero = (err > 0.0) != (s > 0.0);  // the exact value lies inside |s|
  uint64_t bits = std::bit_cast<uint64_t>(s);
  bits = (bits - uint64_t{inexact && toward_zero}) | uint64_t{inexact};
  return static_cast<float>(std::bit_cast<double>(bits));
}

}  // namespace simpler::llm::matmul_detail
