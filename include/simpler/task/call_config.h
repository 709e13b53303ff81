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

  // INVALID_ARGUMENT naming the field when a value is out of range or NaN.
  absl::Status validate() const;
};

}  // namespace simpler::task
