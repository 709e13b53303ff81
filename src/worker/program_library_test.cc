#include "simpler/worker/program_library.h"

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <string>

#include "gtest/gtest.h"
#include "simpler/base/status.h"
#include "worker/worker_test_util.h"

namespace simpler::worker::testing {
namespace {

WorkerOptions opts(int depth) { return testing::test_options(depth, 0, 60); }

TEST(ProgramLibrary, LoadsTheExampleAndItsSelfChecksPass) {
  auto lib = ProgramLibrary::load(SIMPLER_EXAMPLE_MATMUL_LIB);
  ASSERT_TRUE(lib.ok()) << lib.status();
  EXPECT_EQ(lib->name(), "example_matmul");
  ASSERT_EQ(lib->callables().size(), 1u);
  ASSERT_EQ(lib->self_checks().size(), 2u);
  for (int depth : {1, 2}) {
    auto results = run_self_checks(*lib, opts(depth), 3);
    ASSERT_TRUE(results.ok()) << results.status();
    ASSERT_EQ(results->size(), 6u);
    for (const auto& r : *results) {
      EXPECT_TRUE(r.passed) << r.name << " max error " << r.max_abs_error;
      EXPECT_LT(r.max_abs_error, 1e-3);
      EXPECT_EQ(r.run.report.tasks_completed, 2u);
    }
  }
}

TEST(ProgramLibrary, VersionMismatchIsAClearError) {
  EXPECT_TRUE(fails_with(ProgramLibrary::load(SIMPLER_TEST_BAD_ABI_LIB).status(),
                         absl::StatusCode::kFailedPrecondition,
                         "built for program ABI 7; this simpler is ABI 1"));
}

TEST(ProgramLibrary, MissingEntrySymbolIsAClearError) {
  EXPECT_TRUE(fails_with(ProgramLibrary::load(SIMPLER_TEST_NO_ENTRY_LIB).status(),
                         absl::StatusCode::kNotFound, "does not export 'simpler_program_entry'"));
}

TEST(ProgramLibrary, MissingFileIsAClearError) {
  EXPECT_TRUE(fails_with(ProgramLibrary::load("/nonexistent/libnothing.so").status(),
                         absl::StatusCode::kNotFound, "/nonexistent/libnothing.so"));
}

// A library's throwing orchestration or kernel fails only its run, with the
// exception's message, the run and the task; the library's healthy callable
// still runs on the same Worker.
TEST(ProgramLibrary, ALibrarysThrowingOrchestrationOrKernelFailsOnlyItsRun) {
  auto lib = ProgramLibrary::load(SIMPLER_TEST_THROW_LIB);
  ASSERT_TRUE(lib.ok()) << lib.status();
  for (int depth : {1, 2}) {
    Worker w(opts(depth));
    std::map<std::string, CallableHandle> h;
    for (const auto& c : lib->callables()) h[c.name] = *w.register_callable(c);
    ASSERT_TRUE(w.init().ok());
    DeviceBuffer buf = *w.malloc(16);
    task::TaskArgs args;
    args.add_tensor(*buf.tensor({4}, task::DataType::kFloat32), task::ArgDirection::kInOut);
    absl::StatusOr<RunHandle> r0 = w.submit(h["throw_orchestration"], args);
    absl::StatusOr<RunHandle> r1 = w.submit(h["throw_kernel"], args);
    absl::StatusOr<RunHandle> r2 = w.submit(h["add_one"], args);
    ASSERT_TRUE(r0.ok() && r1.ok() && r2.ok());
    const absl::Status e0 = r0->wait(5.0);
    EXPECT_TRUE(fails_with(e0, absl::StatusCode::kInternal,
                           "run 0 orchestration of 'throw_orchestration' threw "
                           "std::runtime_error: orchestration exploded"));
    const absl::Status e1 = r1->wait(5.0);
    EXPECT_TRUE(fails_with(e1, absl::StatusCode::kInternal,
                           "run 1 task 0 (kernel 'throwing_kernel') block 0: kernel threw "
                           "std::logic_error: kernel exploded"));
    EXPECT_FALSE(base::is_unrecoverable(e0) || base::is_unrecoverable(e1));
    ASSERT_TRUE(r2->wait(5.0).ok());
    float out[4];
    ASSERT_TRUE(w.copy_from(out, buf, sizeof(out)).ok());
    // throw_orchestration's task ran before it threw (+1), add_one (+1).
    EXPECT_EQ(out[0], 2.0f);
    EXPECT_TRUE(w.close().ok());
  }
}

// A refused launch while earlier runs are in flight: the runner drains (or
// closes) before the host buffers those runs copy back into are released, and
// reports the refusal. (AddressSanitizer saw finalize write freed memory.)
TEST(ProgramLibrary, ARefusedLaunchIsReportedAfterEveryInFlightRunIsDrained) {
  auto lib = ProgramLibrary::load(SIMPLER_EXAMPLE_MATMUL_LIB);
  ASSERT_TRUE(lib.ok()) << lib.status();
  for (int depth : {1, 2}) {
    const WorkerOptions o = faulty_options("run=1:task=0:kind=launch_refused", depth, 0, 60);
    EXPECT_TRUE(fails_with(run_self_checks(*lib, o, 4).status(), absl::StatusCode::kUnavailable,
                           "stream refused the launch of run 1"));
  }
}

// The odd program's library loaded with its registration `mode` (odd_program.cc).
absl::StatusOr<ProgramLibrary> load_odd_program(const std::string& mode) {
  ::setenv("SIMPLER_TEST_ODD_PROGRAM", mode.c_str(), 1);
  auto lib = ProgramLibrary::load(SIMPLER_TEST_ODD_PROGRAM_LIB);
  ::unsetenv("SIMPLER_TEST_ODD_PROGRAM");
  return lib;
}

TEST(ProgramLibrary, DuplicateCallableNameIsRefusedNamingTheLibrary) {
  auto lib = load_odd_program("duplicate");
  ASSERT_FALSE(lib.ok());
  EXPECT_EQ(lib.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(lib.status().message(), std::string("program library '") +
                                        SIMPLER_TEST_ODD_PROGRAM_LIB +
                                        "' registers two callables named 'twice'");
}

// Each rule of a self-check is checked at load, naming the library and the check.
TEST(ProgramLibrary, SelfChecksThatBreakARuleAreRefusedAtLoad) {
  const std::string lib = SIMPLER_TEST_ODD_PROGRAM_LIB;
  for (const auto& [mode, message] : std::map<std::string, std::string>{
           {"check_twice", "self-check 'check' is registered twice"},
           {"check_nameless", "a self-check of 'twice' has no name"},
           {"check_no_output", "self-check 'check' has no output: it would check nothing"},
           {"check_nan_tolerance",
            "self-check 'check' has tolerance nan: it must be a number >= 0"}}) {
    auto loaded = load_odd_program(mode);
    ASSERT_FALSE(loaded.ok()) << mode;
    EXPECT_EQ(loaded.status().code(), absl::StatusCode::kInvalidArgument) << mode;
    EXPECT_EQ(loaded.status().message(), "program library '" + lib + "': " + message) << mode;
  }
}

// A register_program that throws (anything, an int here) is the load's error naming the library
// (it ended the process); an empty path is refused; a bare file name is the file in the current
// directory (dlopen looked it up on the library search path: "No such file or directory").
TEST(ProgramLibrary, ARegistrationThatThrowsAnEmptyPathAndABareFileName) {
  auto thrown = load_odd_program("throw");
  ASSERT_FALSE(thrown.ok());
  EXPECT_EQ(thrown.status().code(), absl::StatusCode::kInternal);
  EXPECT_EQ(thrown.status().message(), std::string("program library '") +
                                           SIMPLER_TEST_ODD_PROGRAM_LIB +
                                           "': register_program threw an exception of type int");
  EXPECT_EQ(ProgramLibrary::load("").status().code(), absl::StatusCode::kInvalidArgument);

  const std::filesystem::path lib(SIMPLER_TEST_ODD_PROGRAM_LIB);
  const std::filesystem::path here = std::filesystem::current_path();
  std::filesystem::current_path(lib.parent_path());
  auto bare = ProgramLibrary::load(lib.filename().string());
  std::filesystem::current_path(here);
  EXPECT_TRUE(bare.ok()) << bare.status();
}

}  // namespace
}  // namespace simpler::worker::testing
