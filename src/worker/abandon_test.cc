// A kernel that never returns (in its own process: the device thread running
// it is abandoned, and stays abandoned until this process exits).
#include <atomic>
#include <chrono>
#include <thread>

#include "base/quarantine.h"
#include "gtest/gtest.h"
#include "simpler/base/status.h"
#include "simpler/worker/program_library.h"
#include "worker/worker_test_util.h"

namespace simpler::worker::testing {
namespace {

// The run fails at its timeout naming run, task and kernel; close is bounded
// although the thread executing the kernel can never be joined: it is
// abandoned (detached, counted, its device kept alive), and the library is
// not unloaded under it when the ProgramLibrary goes away.
TEST(AbandonedKernel, ARunWhoseKernelNeverReturnsFailsAtItsTimeoutAndCloseIsBounded) {
  auto lib = ProgramLibrary::load(SIMPLER_TEST_SPIN_LIB);
  ASSERT_TRUE(lib.ok()) << lib.status();
  const auto t0 = std::chrono::steady_clock::now();
  auto results = run_self_checks(*lib, test_options(2, 0, 1.0), 3);
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_FALSE(results.ok());
  EXPECT_EQ(results.status().code(), absl::StatusCode::kDeadlineExceeded) << results.status();
  EXPECT_TRUE(contains(results.status(),
                       "self-check 'spin_check': run 0 did not finish within the operation "
                       "timeout of 1 s; still executing: task 0 (kernel 'spin_forever', block 0"))
      << results.status();
  // 1 s timeout + 1 s close grace, with slack for a loaded machine.
  EXPECT_LT(took, 6.0);
  // Only the thread running the kernel is abandoned (the stream's scheduler
  // thread, which runs a lone job inline, or the core thread that took it),
  // never an idle core.
  const std::vector<std::string> abandoned = base::abandoned_thread_descriptions();
  ASSERT_GE(abandoned.size(), 1u);
  ASSERT_LE(abandoned.size(), 2u);
  for (const std::string& d : abandoned) {
    const bool stream = d.find("stream 0 scheduler thread") != std::string::npos;
    const bool core_in_kernel =
        d.find("thread (run 0 task 0: its kernel has not returned") != std::string::npos;
    EXPECT_TRUE(stream || core_in_kernel) << d;
  }
  lib = absl::StatusOr<ProgramLibrary>(absl::CancelledError("dropped"));  // not dlclose()d
}

// close(deadline) is bounded by the deadline even when the run in flight
// would otherwise hold the lane for its whole operation timeout (60 s) and
// its kernel never returns: the lane thread stops waiting within a slice.
TEST(AbandonedKernel, ABoundedCloseReturnsPromptlyWhileAKernelNeverReturns) {
  static testing::Gate never;          // never opened: the kernel waits for ever
  static std::atomic<int> entered{0};  // kernels that reached the gate
  Worker w(faulty_options("run=0:task=0:kind=kernel_error", 2, 0, 60));
  auto h = w.register_callable(
      scalar_program("gate", [](const task::KernelContext& ctx) -> absl::Status {
        entered.fetch_add(1);
        return gate_kernel(ctx);
      }));
  ASSERT_TRUE(w.init().ok());
  const task::TaskArgs args = gate_args(never);
  RunHandle r0 = *w.submit(*h, args);  // fails: injected kernel_error
  RunHandle r1 = *w.submit(*h, args);  // its gate never opens
  EXPECT_EQ(r0.wait(5.0).code(), absl::StatusCode::kInternal);
  ASSERT_TRUE(testing::eventually([] { return entered.load() >= 1; }));  // r1 is executing
  const auto t0 = std::chrono::steady_clock::now();
  (void)w.close(base::Deadline::after(std::chrono::milliseconds(100)));
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  // 0.1 s deadline + a 50 ms slice + the 1 s close grace, with slack.
  EXPECT_LT(took, 3.0);
  ASSERT_TRUE(r1.done());
  EXPECT_EQ(r1.result().status.code(), absl::StatusCode::kCancelled) << r1.result().status;
  EXPECT_TRUE(contains(r1.result().status,
                       "run 1 cancelled: the lane was closed at its close "
                       "deadline with the run still in flight; first error: "
                       "run 0: run 0 task 0 (kernel 'gate')"))
      << r1.result().status;
  EXPECT_EQ(w.resources().quarantined, 1);
  EXPECT_GE(w.abandoned_threads(), 1);
}

}  // namespace
}  // namespace simpler::worker::testing
