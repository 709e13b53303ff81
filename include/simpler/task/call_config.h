// Per-run execution options.
#pragma once

#include <cstdint>

#include "absl/status/status.h"

namespace simpler::task {

// Where the task graph of a run is built (ARCHITECTURE.md "Where the task graph
// is built"). kDefault takes the callable's, then the Worker's choice.
enum class GraphPlacement : uint8_t { kDefault = 0, kDevice = 1, kHost = 2 };

// Options for one run. Plain value.
struct CallConfig {
  // Cores the run may use; 0 = all cores of the device. Must be >= 0.
  int32_t max_cores = 0;
  // Operation timeout in seconds for this run's device execution; 0 = the
  // Worker's default. Must be finite and >= 0.
  double timeout_s = 0;
  GraphPlacement placement = GraphPlacement::kDefault;
  // Record per-task device timestamps (run start/end are always recorded).
  bool task_timing = true;
  // The caller's shape key (docs/design/capture_replay.md); 0 = neither capture nor replay.
  // The first run of a callable under a key is captured into a graph; later runs under it
  // replay that graph with their own arguments bound, when they keep its signature (every
  // argument's direction, memory kind, dtype, shape and strides; every scalar that is not a
  // parameter; the cores; how the device tensors overlap), and are refused at submit naming
  // the argument when they do not. The orchestration must decide its tasks from that signature
  // alone. A device-built capture is built when its run finishes: when that fails the run is
  // FAILED with the capture's error, its HOST outputs copied back. A capture whose fixed memory
  // (what the orchestration captured) was freed, or allocated after the capturing run was
  // submitted, before that run retired is not kept: the next run under the key captures again.
  uint64_t capture_key = 0;
  // Bit i: run argument i (< 64) is a scalar parameter — forwarded to kernels unchanged, free
  // to change between replays. Keeping that promise is the caller's obligation: at capture each
  // is probed once, by running the orchestration again with the value plus one and refusing the
  // capture unless only the task scalars equal to it moved with it; a use the probe cannot see
  // (e.g. max(p, 1), or a branch on p past that value) makes replays wrong without an error. So
  // a capture runs the orchestration 1 + popcount(capture_scalar_params) times on the host (for
  // a device-built run, at its finalize, on the thread that retires it). Only with a
  // capture_key; every bit must name a scalar argument (checked at submit).
  uint64_t capture_scalar_params = 0;

  // INVALID_ARGUMENT naming the field when a value is out of range or NaN, or
  // capture_scalar_params is set without a capture_key.
  absl::Status validate() const;
};

}  // namespace simpler::task
