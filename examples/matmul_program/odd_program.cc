// Test fixture: a program library whose registration is chosen by the environment variable
// SIMPLER_TEST_ODD_PROGRAM, for the CLI's and the loader's bad-input tests:
//   non_utf8    a callable, kernel and self-check whose names are not UTF-8 (the check passes)
//   duplicate   two callables with the same name
//   no_checks   one callable and no self-checks
//   throw       register_program throws an int (not a std::exception)
//   check_twice, check_nameless, check_no_output, check_nan_tolerance
//               one callable and a self-check that breaks that rule (ProgramLibrary::load)
#include <cmath>
#include <cstdlib>
#include <string>

#include "simpler/task/program_abi.h"

namespace {

using simpler::task::ArgDirection;
using simpler::task::KernelContext;
using simpler::task::TaskArgs;

// args: 0 x f32 [N] IN, 1 y f32 [N] OUT: y = 2x.
absl::Status twice(const KernelContext& ctx) {
  const auto& x = ctx.tensor(0);
  const auto& y = ctx.tensor(1);
  for (int64_t i = 0; i < x.shape[0]; ++i) y.data<float>()[i] = 2 * x.data<float>()[i];
  return absl::OkStatus();
}

absl::Status orchestrate(simpler::task::OrchestrationContext& ctx, const TaskArgs& args) {
  TaskArgs t;
  t.add_tensor(args.tensor(0), ArgDirection::kIn).add_tensor(args.tensor(1), ArgDirection::kOut);
  return ctx.submit(0, t, 1);
}

simpler::task::ChipCallable callable(const std::string& name) {
  return simpler::task::ChipCallable{name, orchestrate, {{name + "_twice", twice}}};
}

int register_program(simpler::task::ProgramRegistry* registry) {
  const char* mode_env = std::getenv("SIMPLER_TEST_ODD_PROGRAM");
  const std::string mode = mode_env != nullptr ? mode_env : "non_utf8";
  if (mode == "duplicate") {
    registry->add_callable(callable("twice"));
    registry->add_callable(callable("twice"));
    return 0;
  }
  if (mode == "throw") throw 42;
  if (mode.starts_with("check_")) {
    registry->add_callable(callable("twice"));
    using K = simpler::task::SelfCheckArg::Kind;
    simpler::task::SelfCheck chk;
    chk.name = mode == "check_nameless" ? "" : "check";
    chk.callable = "twice";
    chk.args = {{K::kInput, {4}, {1, 2, 3, 4}, 0}, {K::kOutput, {4}, {2, 4, 6, 8}, 0}};
    if (mode == "check_no_output") chk.args.pop_back();
    if (mode == "check_nan_tolerance") chk.tolerance = std::nan("");
    registry->add_self_check(chk);
    if (mode == "check_twice") registry->add_self_check(chk);
    return 0;
  }
  if (mode == "no_checks") {
    registry->add_callable(callable("twice"));
    return 0;
  }
  const std::string name = "twice\xff";
  registry->add_callable(callable(name));
  using K = simpler::task::SelfCheckArg::Kind;
  simpler::task::SelfCheck chk;
  chk.name = "check\xfe";
  chk.callable = name;
  chk.args = {{K::kInput, {4}, {1, 2, 3, 4}, 0}, {K::kOutput, {4}, {2, 4, 6, 8}, 0}};
  chk.tolerance = 0;
  registry->add_self_check(chk);
  return 0;
}

}  // namespace

SIMPLER_PROGRAM_ENTRY("odd\xfd", register_program)
