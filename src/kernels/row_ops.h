// The per-row arithmetic of RMSNorm and RoPE (kernels.h), shared by their own kernels and by
// qk_norm_rope_kv, which applies both to a token's q and k heads in one task: one definition,
// so the fused kernel's values are bitwise the separate kernels'. Internal to the kernels room.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

namespace simpler::llm::row_ops {

// out[r, :] = x[r, :] · inv_r · w for `rows` rows of `dim` floats (row-major, rows contiguous):
// inv_r = f32(1 / sqrt(ss_r / dim + eps)), ss_r the sum of x[r, i]² in f64, one chain of
// additions in increasing i per row (the order the reference fixes). kRows rows' chains advance
// together, so the adds of different rows overlap instead of each waiting on the one before it
// (the chain's latency, ~4 cycles an element, was the kernel's whole time); each row's chain is
// still its own, so a row's result does not depend on its neighbours.
inline void rms_norm_rows(const float* x, const float* w, int64_t rows, int64_t dim, double eps,
                          float* out) {
  constexpr int64_t kRows = 4;
  for (int64_t row0 = 0; row0 < rows; row0 += kRows) {
    const int64_t n = rows - row0 < kRows ? rows - row0 : kRows;
    double ss[kRows] = {};
    const float* xr = x + row0 * dim;
    if (n == kRows) {
      for (int64_t i = 0; i < dim; ++i) {
        for (int64_t j = 0; j < kRows; ++j) {
          ss[j] += static_cast<double>(xr[j * dim + i]) * xr[j * dim + i];
        }
      }
    } else {
      for (int64_t j = 0; j < n; ++j) {
        for (int64_t i = 0; i < dim; ++i) {
          ss[j] += static_cast<double>(xr[j * dim + i]) * xr[j * dim + i];
        }
      }
    }
    for (int64_t j = 0; j < n; ++j) {
      const float inv = static_cast<float>(1.0 / std::sqrt(ss[j] / static_cast<double>(dim) + eps));
      float* yr = out + (row0 + j) * dim;
      for (int64_t i = 0; i < dim; ++i) yr[i] = xr[j * dim + i] * inv * w[i];
    }
  }
}

// Rotate-half RoPE's angles for one head_dim `dim` (even) and base `theta` (> 0): the
// frequencies f_i = theta^(-2i/dim), i < dim/2, in f64, once per task; then per position p
// (>= 0) cos and sin of p·f_i (computed in f64, rounded to f32), once per token for all of its
// heads.
class RopeAngles {
 public:
  RopeAngles(int64_t dim, double theta)
      : half_(dim / 2), inv_freq_(half_), cos_(half_), sin_(half_) {
    for (int64_t i = 0; i < half_; ++i) {
      inv_freq_[i] = std::pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(dim));
    }
  }
  void at(int64_t p) {
    for (int64_t i = 0; i < half_; ++i) {
      const double angle = static_cast<double>(p) * inv_freq_[i];
      cos_[i] = static_cast<float>(std::cos(angle));
      sin_[i] = static_cast<float>(std::sin(angle));
    }
  }
  // `heads` heads of dim floats from `v`, rotated in place at the position of the last at().
  void rotate(float* v, int64_t heads) const {
    for (int64_t h = 0; h < heads; ++h) {
      float* x = v + h * 2 * half_;
      for (int64_t i = 0; i < half_; ++i) {
        const float lo = x[i];
        const float hi = x[i + half_];
        x[i] = lo * cos_[i] - hi * sin_[i];
        x[i + half_] = hi * cos_[i] + lo * sin_[i];
      }
    }
  }

 private:
  int64_t half_;
  std::vector<double> inv_freq_;
  std::vector<float> cos_, sin_;
};

}  // namespace simpler::llm::row_ops
