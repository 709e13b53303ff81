// What a Worker reports about its run resources and its lane (Worker::resources(),
// Worker::lane_stats()), and the largest run grant it accepts.
#pragma once

#include <cstdint>

namespace simpler::worker {

// Largest run_grant a Worker accepts.
inline constexpr int32_t kMaxRunGrant = 1024;

// Counts of an arena's sets; free + live + quarantined == grant always
// (ARCHITECTURE.md invariant 3).
struct ArenaCounts {
  int32_t free = 0;
  int32_t live = 0;
  int32_t quarantined = 0;
  int32_t grant = 0;
  int32_t waiting = 0;  // acquire() calls blocked for a free set (backpressure); not a set
};

// Lane statistics, for tests and benchmarks.
struct LaneStats {
  uint64_t submitted = 0;
  uint64_t retired = 0;
  uint64_t device_polls = 0;  // completion queries of device launch records
  int32_t in_flight = 0;      // admitted, not retired
  int32_t launched = 0;       // launched, completion not yet observed
};

// Captured graphs of a lane (docs/design/capture_replay.md), for tests and benchmarks.
struct CaptureStats {
  int32_t graphs = 0;          // in the cache now
  uint64_t captures = 0;       // graphs that entered the cache
  uint64_t replays = 0;        // runs admitted as replays
  uint64_t evictions = 0;      // graphs dropped: the LRU bound, or a fixed range freed
  int32_t evicted_in_use = 0;  // dropped graphs still held by runs that have not retired
  // Captures not kept: fixed memory of the graph was freed, or allocated after the capturing run
  // was submitted, before the run retired (the next run under the key captures again).
  uint64_t stale_captures = 0;
};

}  // namespace simpler::worker
