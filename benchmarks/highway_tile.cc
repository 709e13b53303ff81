// A peer of the x86-64-v3 matmul path written on Google Highway (Debian libhwy-dev 1.0.3, its
// static AVX2 target): matmul_tile.h's tile_rows algorithm for bf16 W and several x rows (a
// 4 x 3 tile, the 16 lanes of matmul_impl.h's contract as two 8-lane parts, one part at a time,
// k in blocks that keep x in L1), on Highway's ops instead of our traits, so that the two can be
// timed side by side (benchmarks/highway_tile.sh). Shapes: rows % 4 == 0, k % 16 == 0, and each
// chunk of W rows a multiple of 3 (the script's shapes are).
#include <hwy/highway.h>

#include <cstdint>
#include <cstring>
#include <vector>
namespace hn = hwy::HWY_NAMESPACE;
using D = hn::FixedTag<float, 8>;
using DB = hn::Rebind<hwy::bfloat16_t, D>;
using V = hn::Vec<D>;
static inline V load_w(const uint16_t* p) {
  return hn::PromoteTo(D(), hn::LoadU(DB(), reinterpret_cast<const hwy::bfloat16_t*>(p)));
}
static inline float reduce(V p0, V p1) {
  const V s8 = hn::Add(p0, p1);
  const hn::Half<D> dh;
  const auto s4 = hn::Add(hn::LowerHalf(dh, s8), hn::UpperHalf(dh, s8));
  float l[4];
  hn::StoreU(s4, dh, l);
  return (l[0] + l[2]) + (l[1] + l[3]);
}
template <int R, int C>
static void tile_rows(const float* x, int64_t k, int64_t k0, int64_t k1, const uint16_t* w,
                      float* sums, float* y, int64_t ldy) {
  const D d;
  for (int q = 0; q < 2; ++q) {
    V acc[R][C];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c)
        acc[r][c] = k0 == 0 ? hn::Zero(d) : hn::LoadU(d, sums + (r * C + c) * 16 + q * 8);
    const int64_t off = q * 8;
    for (int64_t kk = k0; kk + 16 <= k1; kk += 16) {
      V wv[C];
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) wv[c] = load_w(w + c * k + kk + off);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const V xv = hn::LoadU(d, x + r * k + kk + off);
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) acc[r][c] = hn::MulAdd(xv, wv[c], acc[r][c]);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) hn::StoreU(acc[r][c], d, sums + (r * C + c) * 16 + q * 8);
  }
  if (!y) return;
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      y[r * ldy + c] =
          reduce(hn::LoadU(d, sums + (r * C + c) * 16), hn::LoadU(d, sums + (r * C + c) * 16 + 8));
}
// y [rows, n] = x [rows, k] · W [n, k]ᵀ (bf16 W), bitwise what run_x86_64_v3 gives.
void hwy_run(const float* x, int64_t rows, int64_t k, const uint16_t* w, int64_t n, float* y) {
  const int64_t chunk = (256 * 1024 / (k * 2)) / 3 * 3;
  const int64_t per_lane = 4 * 4 + 3 * 2, max_lanes = 24 * 1024 / per_lane;
  const int64_t blocks = (k + max_lanes - 1) / max_lanes;
  const int64_t kb = ((k + blocks - 1) / blocks + 15) / 16 * 16;
  std::vector<float> sums(4 * 3 * 16 * (chunk / 3 + 1));
  for (int64_t j0 = 0; j0 < n; j0 += chunk) {
    const int64_t jn = n - j0 < chunk ? n - j0 : chunk;
    for (int64_t r0 = 0; r0 < rows; r0 += 4) {
      for (int64_t k0 = 0; k0 < k; k0 += kb) {
        const int64_t k1 = k - k0 < kb ? k : k0 + kb;
        for (int64_t j = 0; j < jn; j += 3) {
          tile_rows<4, 3>(x + r0 * k, k, k0, k1, w + (j0 + j) * k, sums.data() + (j / 3) * 192,
                          k1 == k ? y + r0 * n + j0 + j : nullptr, n);
        }
      }
    }
  }
}
