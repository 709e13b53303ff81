// Times the x86-64-v3 matmul path (run_x86_64_v3) against its Highway peer (highway_tile.cc) on
// one thread, interleaved, best of 30 rounds of 3 calls each, after checking the two give the
// same bits. Usage: highway_tile ROWS K N.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "kernels/matmul_impl.h"
void hwy_run(const float* x, int64_t rows, int64_t k, const uint16_t* w, int64_t n, float* y);
using namespace simpler::llm::matmul_detail;
int main(int argc, char** argv) {
  int64_t rows = atoi(argv[1]), k = atoi(argv[2]), n = atoi(argv[3]);
  std::vector<float> x(rows * k), y1(rows * n), y2(rows * n);
  std::vector<uint16_t> w(n * k);
  for (size_t i = 0; i < x.size(); ++i) x[i] = 0.001f * (i % 97) - 0.05f;
  for (size_t i = 0; i < w.size(); ++i) w[i] = 0x3c00 + i % 251;
  Problem p;
  p.x = x.data();
  p.rows = rows;
  p.k = k;
  p.n = n;
  p.y = y1.data();
  p.ldy = n;
  p.wt = WeightType::kBF16;
  p.w = w.data();
  run_x86_64_v3(p);
  hwy_run(x.data(), rows, k, w.data(), n, y2.data());
  if (std::memcmp(y1.data(), y2.data(), y1.size() * 4) != 0) {
    std::printf("highway_tile: the Highway peer's bits differ from run_x86_64_v3's\n");
    return 1;
  }
  double best[2] = {0, 0};
  for (int rep = 0; rep < 30; ++rep) {
    for (int which = 0; which < 2; ++which) {
      auto t0 = std::chrono::steady_clock::now();
      for (int it = 0; it < 3; ++it)
        which ? hwy_run(x.data(), rows, k, w.data(), n, y2.data()) : run_x86_64_v3(p);
      double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      double g = 2.0 * rows * k * n * 3 / s / 1e9;
      if (g > best[which]) best[which] = g;
    }
  }
  printf("rows %ld k %ld n %ld: ours %.1f, highway %.1f GFLOP/s (best of 30, interleaved)\n", rows,
         k, n, best[0], best[1]);
}
