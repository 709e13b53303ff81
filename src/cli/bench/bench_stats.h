// Summary statistics the benchmarks print.
#pragma once

#include <algorithm>
#include <cmath>
#include <vector>

namespace simpler::cli {

// The q-quantile (q in [0, 1]) with linear interpolation between order statistics (numpy's
// default, as vLLM's benchmarks report); 0 when empty.
inline double percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const double pos = q * static_cast<double>(v.size() - 1);
  const size_t lo = static_cast<size_t>(std::floor(pos));
  const size_t hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (v[hi] - v[lo]) * (pos - static_cast<double>(lo));
}

inline double mean(const std::vector<double>& v) {
  double sum = 0;
  for (double x : v) sum += x;
  return v.empty() ? 0 : sum / static_cast<double>(v.size());
}

}  // namespace simpler::cli
