#include "simpler/engine/metrics.h"

#include <algorithm>

namespace simpler::llm {

Histogram Histogram::with_bounds(std::vector<double> bounds) {
  Histogram h;
  h.bounds = std::move(bounds);
  h.counts.assign(h.bounds.size() + 1, 0);
  return h;
}

void Histogram::observe(double value) {
  if (counts.size() != bounds.size() + 1) counts.assign(bounds.size() + 1, 0);
  // First bound >= value (Prometheus buckets are "less than or equal").
  const size_t i =
      static_cast<size_t>(std::lower_bound(bounds.begin(), bounds.end(), value) - bounds.begin());
  ++counts[i];
  ++count;
  sum += value;
}

double Histogram::quantile_bound(double q) const {
  if (count == 0 || bounds.empty()) return 0;
  const double target = std::clamp(q, 0.0, 1.0) * static_cast<double>(count);
  int64_t seen = 0;
  for (size_t i = 0; i < counts.size(); ++i) {
    seen += counts[i];
    if (static_cast<double>(seen) >= target && seen > 0) {
      return i < bounds.size() ? bounds[i] : bounds.back();
    }
  }
  return bounds.back();
}

std::vector<double> ttft_buckets_s() {
  return {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1,  0.25,  0.5,   0.75,
          1.0,   2.5,   5.0,  7.5,  10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0};
}

std::vector<double> inter_token_buckets_s() {
  return {0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2,  0.3,  0.4, 0.5,
          0.75, 1.0,   2.5,  5.0,   7.5, 10.0, 20.0, 40.0, 80.0};
}

std::vector<double> request_latency_buckets_s() {
  return {0.3,  0.5,  0.8,  1.0,  1.5,   2.0,   2.5,   5.0,   10.0,   15.0,  20.0,
          30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0};
}

std::vector<double> build_1_2_5_buckets(int64_t max) {
  std::vector<double> out;
  const int64_t mantissas[] = {1, 2, 5};
  for (int64_t exponent = 1;; exponent *= 10) {
    for (int64_t m : mantissas) {
      const int64_t v = m * exponent;
      if (v > max) return out;
      out.push_back(static_cast<double>(v));
    }
  }
}

}  // namespace simpler::llm
