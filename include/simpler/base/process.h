// Running another program and collecting its output (benchmark peers, reference scripts).
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace simpler::base {

// How a waited-for process ended, from waitpid's status: "exited with status 3", "killed by
// signal 9 (Killed)".
std::string describe_wait_status(int wstatus);

// The scheduler state of process (or thread id) `pid`: the letter of /proc/PID/stat's third field
// ('R' running, 'S' asleep, 'D' in uninterruptible wait, 'T' stopped by a signal, 't' stopped by a
// debugger, 'Z' a zombie, ...), or '?' when it cannot be read (no such process, no /proc).
// Linux only. Thread-safe.
char process_state(int pid);

struct ProcessResult {
  int wait_status = 0;  // waitpid's status
  int exit_code = -1;   // the program's exit status; -1 when a signal ended it
  int signal = 0;       // the signal that ended it; 0 when it exited
  std::string output;   // its stdout and stderr, interleaved, at most max_output bytes
  bool ok() const { return signal == 0 && exit_code == 0; }
  std::string describe() const { return describe_wait_status(wait_status); }
};

// Runs argv[0] (looked up on PATH) with arguments argv[1..] directly, without a shell (so no
// argument needs quoting), with stdin from /dev/null and stdout + stderr captured; waits for it.
// Safe in a multi-threaded process (posix_spawn). A non-zero exit is a result, not an error.
// Errors: INVALID_ARGUMENT for an empty argv; INTERNAL naming the program and the reason when
// it cannot be started (not found, not executable) or a pipe or wait fails. Thread-safe.
absl::StatusOr<ProcessResult> run_process(const std::vector<std::string>& argv,
                                          size_t max_output = 1 << 20);

}  // namespace simpler::base
