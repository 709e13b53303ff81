#include "cli/bench_probes.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "simpler/base/clock.h"

namespace simpler::cli {
namespace {

// Sums 64-bit words with 8 independent chains (no loop-carried latency): bound by the loads.
uint64_t sum_words(const uint64_t* p, size_t n) {
  uint64_t a[8] = {};
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int j = 0; j < 8; ++j) a[j] += p[i + j];
  }
  for (; i < n; ++i) a[0] += p[i];
  uint64_t s = 0;
  for (uint64_t v : a) s += v;
  return s;
}

}  // namespace

double read_bandwidth_bytes_per_s(size_t bytes, int threads, int passes) {
  if (threads <= 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const size_t words = std::max<size_t>(bytes / 8, 1024);
  std::unique_ptr<uint64_t[]> buf(new uint64_t[words]);
  for (size_t i = 0; i < words; ++i) buf[i] = i;
  double best_s = 1e30;
  std::atomic<uint64_t> sink{0};
  for (int pass = 0; pass < passes; ++pass) {
    std::atomic<int> ready{0};
    std::atomic<bool> go{false};
    std::vector<std::thread> ts;
    for (int t = 0; t < threads; ++t) {
      ts.emplace_back([&, t] {
        const size_t begin = words * t / threads, end = words * (t + 1) / threads;
        ready.fetch_add(1);
        while (!go.load(std::memory_order_acquire)) {
        }
        sink.fetch_add(sum_words(buf.get() + begin, end - begin), std::memory_order_relaxed);
      });
    }
    while (ready.load() < threads) std::this_thread::yield();
    const int64_t t0 = base::now_ns();
    go.store(true, std::memory_order_release);
    for (std::thread& th : ts) th.join();
    best_s = std::min(best_s, (base::now_ns() - t0) / 1e9);
  }
  if (sink.load() == 42) std::fprintf(stderr, " ");  // keeps the sums
  return static_cast<double>(words * 8) / best_s;
}

uint64_t peak_resident_bytes() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("VmHWM:", 0) == 0) return std::stoull(line.substr(6)) * 1024;  // kB
  }
  return 0;
}

}  // namespace simpler::cli
