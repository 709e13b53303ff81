// A kernel that never returns (in its own process: the device thread running
// it is abandoned, and stays abandoned until this process exits).
#include <chrono>

#include "gtest/gtest.h"
#include "simpler/base/quarantine.h"
#include "simpler/worker/program_library.h"

namespace simpler::worker {
namespace {

bool contains(const absl::Status& s, const std::string& needle) {
  return std::string(s.message()).find(needle) != std::string::npos;
}

// The run fails at its timeout naming run, task and kernel; close is bounded
// although the thread executing the kernel can never be joined: it is
// abandoned (detached, counted, its device kept alive), and the library is
// not unloaded under it when the ProgramLibrary goes away.
TEST(AbandonedKernel, ARunWhoseKernelNeverReturnsFailsAtItsTimeoutAndCloseIsBounded) {
  auto lib = ProgramLibrary::load(SIMPLER_TEST_SPIN_LIB);
  ASSERT_TRUE(lib.ok()) << lib.status();
  WorkerOptions o;
  o.num_cores = 2;
  o.launch_depth = 2;
  o.operation_timeout_s = 1.0;
  o.faults = device::FaultPlan();
  const auto t0 = std::chrono::steady_clock::now();
  auto results = run_self_checks(*lib, o, 3);
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_FALSE(results.ok());
  EXPECT_EQ(results.status().code(), absl::StatusCode::kDeadlineExceeded) << results.status();
  EXPECT_TRUE(contains(results.status(),
                       "self-check 'spin_check': run 0 did not finish within the operation "
                       "timeout of 1 s; still executing: task 0 (kernel 'spin_forever', block 0"))
      << results.status();
  // 1 s timeout + 1 s close grace, with slack for a loaded machine.
  EXPECT_LT(took, 6.0);
  EXPECT_GE(base::abandoned_threads(), 1);
  EXPECT_FALSE(base::abandoned_thread_descriptions().empty());
  lib = absl::StatusOr<ProgramLibrary>(absl::CancelledError("dropped"));  // not dlclose()d
}

}  // namespace
}  // namespace simpler::worker
