// Engine metrics: counters, gauges and histograms the engine keeps and
// `LlmEngine::metrics()` snapshots (the server exposes them in Prometheus'
// text format). Histogram bucket boundaries are vLLM's (vllm/v1/metrics/
// loggers.py, PrometheusStatLogger), in seconds unless named otherwise.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "simpler/engine/kv_pages.h"

namespace simpler::llm {

// A cumulative histogram: counts[i] observations <= bounds[i] (not cumulative
// in storage: counts[i] is the bucket (bounds[i-1], bounds[i]]), plus the
// +Inf bucket at counts.back(). Plain value; thread-compatible.
struct Histogram {
  std::vector<double> bounds;   // ascending upper bounds
  std::vector<int64_t> counts;  // bounds.size() + 1 buckets, the last is +Inf
  int64_t count = 0;
  double sum = 0;

  static Histogram with_bounds(std::vector<double> bounds);
  void observe(double value);
  // The q-quantile (q in [0, 1]) estimated as the upper bound of the bucket
  // holding it (+Inf bucket: the largest bound); 0 when empty.
  double quantile_bound(double q) const;
};

// vLLM's bucket boundaries.
std::vector<double> ttft_buckets_s();             // time to first token
std::vector<double> inter_token_buckets_s();      // inter-token latency / time per output token
std::vector<double> request_latency_buckets_s();  // e2e, queue, prefill, decode time
// 1, 2, 5, 10, 20, 50, ... up to `max` (vLLM build_1_2_5_buckets): rows and tokens per step.
std::vector<double> build_1_2_5_buckets(int64_t max);

struct EngineMetrics {
  bool healthy = true;
  std::string unhealthy_cause;
  int64_t requests_waiting = 0;
  int64_t requests_running = 0;
  int64_t preemptions_total = 0;
  int64_t requests_finished_stop = 0, requests_finished_length = 0, requests_finished_abort = 0,
          requests_finished_error = 0;
  int64_t requests_refused = 0;  // add_request errors
  PageCounts kv_pages;           // free / used / fenced / quarantined, summing to the pool
  int64_t kv_pages_total = 0;
  int64_t kv_pages_cached = 0;  // pages in the prefix cache (any state)
  // Prefix caching, in tokens (vLLM's prefix_cache_queries / prefix_cache_hits): each admission
  // queries the tokens it knows and hits those found in the cache.
  int64_t prefix_cache_queries_total = 0;
  int64_t prefix_cache_hits_total = 0;
  int64_t prompt_tokens_total = 0;      // prompt positions computed (recompute included)
  int64_t generation_tokens_total = 0;  // output tokens accepted
  int64_t steps_total = 0;
  Histogram time_to_first_token_s;
  Histogram inter_token_latency_s;
  Histogram e2e_request_latency_s;
  Histogram request_queue_time_s;
  Histogram step_time_s;      // submit to retire of each step
  Histogram rows_per_step;    // rows (requests) per step
  Histogram tokens_per_step;  // positions per step
  // Host time of one constrained row's token mask (buckets 0.1 ms to 1 s, 1-2-5).
  Histogram grammar_mask_time_s;
};

}  // namespace simpler::llm
