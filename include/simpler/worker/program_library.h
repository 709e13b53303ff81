// Loading program libraries (see task/program_abi.h) and running their self-checks.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "simpler/task/program_abi.h"
#include "simpler/worker/worker.h"

namespace simpler::worker {

// A loaded program library: its callables and self-checks. The shared object
// stays loaded for the lifetime of this object (kernel function pointers
// point into it). Move-only; thread-compatible.
class ProgramLibrary {
 public:
  // dlopen()s `path` (a path without a '/' is a file in the current directory, never looked
  // up on the library search path) and registers its program. Errors name the path:
  // INVALID_ARGUMENT for an empty path; NOT_FOUND (cannot load, or no `simpler_program_entry`
  // symbol); FAILED_PRECONDITION (ABI version mismatch: "was built for program ABI 7; this
  // simpler is ABI 1 — rebuild it"); INTERNAL (register_program returned non-zero, or threw:
  // "register_program threw <type>: <what>"); INVALID_ARGUMENT (a registered callable is
  // invalid; a self-check without a name or registered twice, naming an unknown callable, with
  // a tolerance that is NaN or negative, or with no output). A library whose name is empty is
  // named by its path.
  static absl::StatusOr<ProgramLibrary> load(const std::string& path);

  ProgramLibrary(ProgramLibrary&&) noexcept;
  ProgramLibrary& operator=(ProgramLibrary&&) noexcept;
  ~ProgramLibrary();

  const std::string& name() const { return name_; }
  const std::vector<task::ChipCallable>& callables() const { return callables_; }
  const std::vector<task::SelfCheck>& self_checks() const { return checks_; }

 private:
  ProgramLibrary() = default;
  void* handle_ = nullptr;
  std::string name_;
  std::vector<task::ChipCallable> callables_;
  std::vector<task::SelfCheck> checks_;
};

// Result of one self-check.
struct SelfCheckResult {
  std::string name;
  double max_abs_error = 0;
  double tolerance = 0;
  bool passed = false;
  RunResult run;
};

// Registers every callable of `lib` on a fresh Worker made from `options`,
// runs every self-check (submitting all checks back to back, so they pipeline
// at launch_depth > 1: inputs and outputs are HOST tensors, staged by each run
// at prepare and copied back at finalize, so no copy waits for earlier runs)
// and compares each output with the program's reference.
// Errors: Worker errors, run errors (naming the check), shape mismatches.
absl::StatusOr<std::vector<SelfCheckResult>> run_self_checks(const ProgramLibrary& lib,
                                                             const WorkerOptions& options,
                                                             int repeats = 1);

}  // namespace simpler::worker
