// The per-row work of RMSNorm, RoPE and the KV-cache write (kernels.h) with their argument
// checks, shared by their own kernels and by qk_norm_rope_kv, which does all three for a token's
// q and k heads in one task: one definition, so the fused kernel's values and refusals are the
// separate kernels'. Internal to the kernels room.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "simpler/task/arg_check.h"

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

// RoPE's parameters: INVALID_ARGUMENT through `c` (naming its kernel) for an odd head_dim `dim`
// or a `theta` that is not > 0 (NaN included).
inline absl::Status check_rope(const task::ArgChecker& c, int64_t dim, double theta) {
  if (dim % 2 != 0) return c.error(absl::StrCat("head_dim ", dim, " must be even"));
  if (!(theta > 0.0)) return c.error(absl::StrCat("theta ", theta, " must be positive"));
  return absl::OkStatus();
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
  // at(positions[b]); INVALID_ARGUMENT through `c`, naming row b, for a negative position.
  absl::Status at_row(const task::ArgChecker& c, const int32_t* positions, int64_t b) {
    const int64_t p = positions[b];
    if (p < 0) return c.error(absl::StrCat("position ", p, " at row ", b, " is negative"));
    at(p);
    return absl::OkStatus();
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

// One layer's paged KV cache as kv_write and qk_norm_rope_kv write it: k and v pools of
// [pages, page_size] slots of `row_elems` floats (n_kv · head_dim) each. Not owned.
struct KvCache {
  float* k = nullptr;
  float* v = nullptr;
  int64_t pages = 0, page_size = 0, row_elems = 0;
};

// Row b's k and v (row_elems floats each) into slot s of `cache`: a slot < 0 skips the row
// (padding); one >= pages · page_size is INVALID_ARGUMENT through `c`, naming the row.
inline absl::Status write_kv_row(const task::ArgChecker& c, const KvCache& cache, int64_t b,
                                 int64_t s, const float* k, const float* v) {
  if (s < 0) return absl::OkStatus();
  if (s >= cache.pages * cache.page_size) {
    return c.error(absl::StrCat("slot ", s, " at row ", b, " is outside the pool of ", cache.pages,
                                " pages x ", cache.page_size, " slots"));
  }
  std::memcpy(cache.k + s * cache.row_elems, k, sizeof(float) * cache.row_elems);
  std::memcpy(cache.v + s * cache.row_elems, v, sizeof(float) * cache.row_elems);
  return absl::OkStatus();
}

}  // namespace simpler::llm::row_ops
