// The StarPU peer of `simpler bench dispatch --compare starpu` (Debian libstarpu-dev 1.3):
// the same three patterns of empty tasks, dependencies inferred by StarPU from STARPU_RW
// accesses to registered data (sequential consistency), timed from the first submit to
// starpu_task_wait_for_all. Built only where pkg-config finds starpu-1.3.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "cli/bench/bench_runtime.h"

namespace simpler::cli {

// Whether this binary was built with StarPU, and its version ("" without).
bool starpu_available();
std::string starpu_version();

// Runs the patterns "independent" (task i accesses handle i), "chain" (every task handle 0) and
// "8_chains" (handle i mod 8) with `tasks` tasks each, on `ncpu` CPU workers. Sets STARPU_NCPU,
// STARPU_SCHED=eager, STARPU_CALIBRATE=0 and a fresh temporary STARPU_HOME (removed after)
// before starpu_init; call it once per process, after the sim device has closed.
// FAILED_PRECONDITION without StarPU; INTERNAL when StarPU fails to start.
absl::StatusOr<std::vector<DispatchRow>> bench_dispatch_starpu(int ncpu, int64_t tasks);

}  // namespace simpler::cli
