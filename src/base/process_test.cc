#include "simpler/base/process.h"

#include "gtest/gtest.h"

namespace simpler::base {
namespace {

TEST(RunProcess, CapturesOutputAndExitStatusWithoutAShell) {
  // An argument with quotes and a semicolon reaches the program as one argument, unquoted.
  absl::StatusOr<ProcessResult> r =
      run_process({"sh", "-c", "printf '%s|' \"$1\"; echo err >&2; exit 3", "x", "a 'b'; c"});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->exit_code, 3);
  EXPECT_FALSE(r->ok());
  EXPECT_EQ(r->output, "a 'b'; c|err\n");
  EXPECT_EQ(r->describe(), "exited with status 3");
}

TEST(RunProcess, ReportsASignalAndBoundsTheOutput) {
  absl::StatusOr<ProcessResult> r =
      run_process({"sh", "-c", "head -c 100000 /dev/zero; kill -9 $$"}, 1000);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->signal, 9);
  EXPECT_EQ(r->output.size(), 1000u);
  EXPECT_EQ(r->describe(), "killed by signal 9 (Killed)");
}

TEST(RunProcess, AProgramThatCannotStartIsAnErrorNamingIt) {
  absl::StatusOr<ProcessResult> r = run_process({"simpler-no-such-program"});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInternal);
  EXPECT_NE(std::string(r.status().message()).find("cannot run 'simpler-no-such-program'"),
            std::string::npos)
      << r.status();
  EXPECT_EQ(run_process({}).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace simpler::base
