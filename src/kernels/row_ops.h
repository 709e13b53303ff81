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
#include "simpler/kernels/kernels.h"
#include "simpler/task/arg_check.h"

namespace simpler::llm::row_ops {

// The elementwise loops below go kRowLanes elements at a time, each chunk read into locals before
// any of it is written: GCC's -O2 vectorizes a loop of a fixed count whose stores cannot change
// its loads, and the results are the scalar loop's (the same operations on each element) where
// the output is disjoint from the inputs or starts at or before them (in place included).
constexpr int64_t kRowLanes = 16;

// y[i] = x[i] · inv · w[i] for i < dim (x times inv, then times w: two roundings, as written).
inline void scale_row(const float* x, float inv, const float* w, int64_t dim, float* y) {
  int64_t i = 0;
  for (; i + kRowLanes <= dim; i += kRowLanes) {
    float xi[kRowLanes], wi[kRowLanes];
    for (int64_t l = 0; l < kRowLanes; ++l) {
      xi[l] = x[i + l];
      wi[l] = w[i + l];
    }
    for (int64_t l = 0; l < kRowLanes; ++l) y[i + l] = xi[l] * inv * wi[l];
  }
  for (; i < dim; ++i) y[i] = x[i] * inv * w[i];
}

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
      scale_row(xr + j * dim, inv, w, dim, out + (row0 + j) * dim);
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
// frequencies f_i = theta^(-2i/dim), i < dim/2, in f64; per position p (>= 0) cos and sin of
// p·f_i (computed in f64, rounded to f32), once per token for all of its heads.
//
// Computed once per thread for each (dim, theta, position) and kept (RopeTable): a decode step's
// layers (28 in qwen3-0.6b) rotate at the same positions, and computing them was dim/2 pow, cos
// and sin in f64 a token, most of a batch-1 qk_norm_rope_kv task (~5 of 9-11 us). The values are
// the ones computed, so kept or not they are the same bits.
class RopeTable {
 public:
  // cos (then sin) of p·f_i, i < dim/2, as 2·(dim/2) floats, p >= 0: this thread's, valid until
  // its next call. A thread alternating two (dim, theta) recomputes every time (one model's RoPE
  // has one).
  static const float* angles(int64_t dim, double theta, int64_t p) {
    thread_local RopeTable table;
    return table.lookup(dim, theta, p);
  }

 private:
  static constexpr int64_t kEntries = 64;  // positions kept: direct-mapped by p mod 64
  const float* lookup(int64_t dim, double theta, int64_t p) {
    const int64_t half = dim / 2;
    if (dim != dim_ || !(theta == theta_)) {  // other frequencies: every entry is stale
      dim_ = dim;
      theta_ = theta;
      inv_freq_.resize(static_cast<size_t>(half));
      for (int64_t i = 0; i < half; ++i) {
        inv_freq_[i] = std::pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(dim));
      }
      values_.assign(static_cast<size_t>(kEntries * 2 * half), 0.f);
      positions_.assign(kEntries, -1);
    }
    const int64_t e = p % kEntries;
    float* v = values_.data() + e * 2 * half;
    if (positions_[e] != p) {
      for (int64_t i = 0; i < half; ++i) {
        const double angle = static_cast<double>(p) * inv_freq_[i];
        v[i] = static_cast<float>(std::cos(angle));
        v[half + i] = static_cast<float>(std::sin(angle));
      }
      positions_[e] = p;
    }
    return v;
  }
  int64_t dim_ = -1;
  double theta_ = 0;
  std::vector<double> inv_freq_;
  std::vector<float> values_;  // entry e's cos then sin at e·2·half
  std::vector<int64_t> positions_;
};

class RopeAngles {
 public:
  RopeAngles(int64_t dim, double theta) : half_(dim / 2), dim_(dim), theta_(theta) {}
  // The angles at positions[b]; INVALID_ARGUMENT through `c`, naming row b, for a negative
  // position.
  absl::Status at_row(const task::ArgChecker& c, const int32_t* positions, int64_t b) {
    const int64_t p = positions[b];
    if (p < 0) return c.error(absl::StrCat("position ", p, " at row ", b, " is negative"));
    cos_ = RopeTable::angles(dim_, theta_, p);
    sin_ = cos_ + half_;
    return absl::OkStatus();
  }
  // `heads` heads of dim floats from `v`, rotated in place at the position of the last at_row()
  // (on this thread, with no other RopeAngles' at_row() between).
  void rotate(float* v, int64_t heads) const {
    for (int64_t h = 0; h < heads; ++h) rotate_half(v + h * 2 * half_, v + h * 2 * half_ + half_);
  }

 private:
  // One head's halves lo and hi (half_ floats each), rotated in place (kRowLanes at a time).
  void rotate_half(float* lo, float* hi) const {
    const float* c = cos_;
    const float* s = sin_;
    int64_t i = 0;
    for (; i + kRowLanes <= half_; i += kRowLanes) {
      float l[kRowLanes], u[kRowLanes], ci[kRowLanes], si[kRowLanes];
      for (int64_t j = 0; j < kRowLanes; ++j) {
        l[j] = lo[i + j];
        u[j] = hi[i + j];
        ci[j] = c[i + j];
        si[j] = s[i + j];
      }
      for (int64_t j = 0; j < kRowLanes; ++j) lo[i + j] = l[j] * ci[j] - u[j] * si[j];
      for (int64_t j = 0; j < kRowLanes; ++j) hi[i + j] = u[j] * ci[j] + l[j] * si[j];
    }
    for (; i < half_; ++i) {
      const float l = lo[i];
      const float u = hi[i];
      lo[i] = l * c[i] - u * s[i];
      hi[i] = u * c[i] + l * s[i];
    }
  }

  int64_t half_, dim_;
  double theta_;
  const float* cos_ = nullptr;
  const float* sin_ = nullptr;
};

// One layer's paged KV cache as kv_write and qk_norm_rope_kv write it: k and v pools of `pages`
// pages, each page kv head by kv head (kv_heads runs of page_size slots of head_dim floats:
// [pages, kv_heads, page_size, head_dim], docs/design/engine.md), so that one kv head's
// cached positions within a page are contiguous. Not owned.
struct KvCache {
  float* k = nullptr;
  float* v = nullptr;
  int64_t pages = 0, page_size = 0, kv_heads = 0, head_dim = 0;

  // Where slot s's row of kv head h starts in a pool, in floats.
  int64_t offset(int64_t s, int64_t h) const {
    return kv_pool_offset(s / page_size, h, s % page_size, kv_heads, page_size, head_dim);
  }
};

// Row b's k and v (kv_heads · head_dim floats each, head by head) into slot s of `cache`: a slot
// < 0 skips the row (padding); one >= pages · page_size is INVALID_ARGUMENT through `c`, naming
// the row.
inline absl::Status write_kv_row(const task::ArgChecker& c, const KvCache& cache, int64_t b,
                                 int64_t s, const float* k, const float* v) {
  if (s < 0) return absl::OkStatus();
  if (s >= cache.pages * cache.page_size) {
    return c.error(absl::StrCat("slot ", s, " at row ", b, " is outside the pool of ", cache.pages,
                                " pages x ", cache.page_size, " slots"));
  }
  const size_t bytes = sizeof(float) * static_cast<size_t>(cache.head_dim);
  for (int64_t h = 0; h < cache.kv_heads; ++h) {
    std::memcpy(cache.k + cache.offset(s, h), k + h * cache.head_dim, bytes);
    std::memcpy(cache.v + cache.offset(s, h), v + h * cache.head_dim, bytes);
  }
  return absl::OkStatus();
}

}  // namespace simpler::llm::row_ops
