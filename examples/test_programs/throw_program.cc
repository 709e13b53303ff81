// Test fixture: a program library whose functions throw C++ exceptions, for
// the runtime's "an exception becomes the run's error" contract.
//
// Callables (each takes one f32 [4] tensor, INOUT):
//   throw_orchestration — its orchestration submits one task, then throws
//                         std::runtime_error("orchestration exploded").
//   throw_kernel        — one task whose kernel throws
//                         std::logic_error("kernel exploded").
//   add_one             — one task adding 1 to every element (a healthy run).
#include <stdexcept>

#include "simpler/task/program_abi.h"

namespace {

using simpler::task::ArgDirection;
using simpler::task::KernelContext;
using simpler::task::TaskArgs;

absl::Status add_one(const KernelContext& ctx) {
  const auto& t = ctx.tensor(0);
  for (int64_t i = 0; i < t.shape[0]; ++i) t.data<float>()[i] += 1.0f;
  return absl::OkStatus();
}

absl::Status throwing_kernel(const KernelContext&) { throw std::logic_error("kernel exploded"); }

absl::Status one_task(simpler::task::OrchestrationContext& ctx, const TaskArgs& args) {
  TaskArgs a;
  a.add_tensor(args.tensor(0), ArgDirection::kInOut);
  return ctx.submit(0, a);
}

int register_program(simpler::task::ProgramRegistry* registry) {
  registry->add_callable(simpler::task::ChipCallable{
      "throw_orchestration",
      [](simpler::task::OrchestrationContext& ctx, const TaskArgs& args) -> absl::Status {
        absl::Status s = one_task(ctx, args);
        if (s.ok()) throw std::runtime_error("orchestration exploded");
        return s;
      },
      {{"add_one", add_one}}});
  registry->add_callable(simpler::task::ChipCallable{
      "throw_kernel", one_task, {{"throwing_kernel", throwing_kernel}}});
  registry->add_callable(simpler::task::ChipCallable{"add_one", one_task, {{"add_one", add_one}}});
  return 0;
}

}  // namespace

SIMPLER_PROGRAM_ENTRY("test_throw", register_program)
