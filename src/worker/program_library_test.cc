#include "simpler/worker/program_library.h"

#include <cstdlib>

#include "gtest/gtest.h"

namespace simpler::worker {
namespace {

bool contains(const absl::Status& s, const std::string& needle) {
  return std::string(s.message()).find(needle) != std::string::npos;
}

WorkerOptions opts(int depth) {
  WorkerOptions o;
  o.num_cores = 2;
  o.launch_depth = depth;
  o.faults = device::FaultPlan();
  return o;
}

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
  auto lib = ProgramLibrary::load(SIMPLER_TEST_BAD_ABI_LIB);
  ASSERT_FALSE(lib.ok());
  EXPECT_EQ(lib.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(contains(lib.status(), "built for program ABI 7; this simpler is ABI 1"))
      << lib.status();
}

TEST(ProgramLibrary, MissingEntrySymbolIsAClearError) {
  auto lib = ProgramLibrary::load(SIMPLER_TEST_NO_ENTRY_LIB);
  ASSERT_FALSE(lib.ok());
  EXPECT_EQ(lib.status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(contains(lib.status(), "does not export 'simpler_program_entry'")) << lib.status();
}

TEST(ProgramLibrary, MissingFileIsAClearError) {
  auto lib = ProgramLibrary::load("/nonexistent/libnothing.so");
  ASSERT_FALSE(lib.ok());
  EXPECT_EQ(lib.status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(contains(lib.status(), "/nonexistent/libnothing.so")) << lib.status();
}

TEST(ProgramLibrary, DuplicateCallableNameIsRefusedNamingTheLibrary) {
  ::setenv("SIMPLER_TEST_ODD_PROGRAM", "duplicate", 1);
  auto lib = ProgramLibrary::load(SIMPLER_TEST_ODD_PROGRAM_LIB);
  ::unsetenv("SIMPLER_TEST_ODD_PROGRAM");
  ASSERT_FALSE(lib.ok());
  EXPECT_EQ(lib.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(lib.status().message(), std::string("program library '") +
                                        SIMPLER_TEST_ODD_PROGRAM_LIB +
                                        "' registers two callables named 'twice'");
}

}  // namespace
}  // namespace simpler::worker
