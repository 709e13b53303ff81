// Chrome / Perfetto trace events ("Trace Event Format", complete events,
// ph = "X"; timestamps and durations in µs). Written as one JSON object
// {"traceEvents": [...], "displayTimeUnit": "ns", "otherData": {...}}.
// `ts` is µs since the earliest span; otherData.origin_ns is that span's
// start on CLOCK_MONOTONIC (base::now_ns), so a trace lines up with other
// tools on the same clock (e.g. `perf sched record -k CLOCK_MONOTONIC`).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "simpler/base/sync.h"

namespace simpler::base {

// One complete span. `start_ns` / `dur_ns` are steady-clock nanoseconds
// (now_ns()); `run_id` < 0 means the span belongs to no run.
struct TraceSpan {
  std::string name;
  std::string category;  // "host" or "device"
  int64_t start_ns = 0;
  int64_t dur_ns = 0;
  int32_t pid = 0;  // 0 = host, 1 = device
  int32_t tid = 0;  // host: 0 = caller, 1 = lane; device: 0 = scheduler, 1 + core index
  int64_t run_id = -1;
  int64_t task = -1;
  int32_t block = -1;  // an SPMD task's block (device spans of a task with several blocks)
};

// Collects spans from any thread and writes them as trace JSON.
// Thread-safe. An idle recorder costs one branch per span site.
class TraceRecorder {
 public:
  void add(TraceSpan span);
  std::vector<TraceSpan> spans() const;
  size_t size() const;
  // Writes the trace JSON to `path`; errors name the path.
  absl::Status write(const std::string& path) const;
  std::string to_json() const;

 private:
  mutable Mutex mu_;
  std::vector<TraceSpan> spans_ SIMPLER_GUARDED_BY(mu_);
};

}  // namespace simpler::base
