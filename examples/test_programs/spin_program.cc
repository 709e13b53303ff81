// Test fixture: a program library whose kernel never returns (it sleeps in a
// loop on a flag nothing ever sets), for the runtime's bounded timeout, close
// and exit when a device thread can never be joined. Its self-check is what
// `simpler run` executes.
#include <atomic>
#include <chrono>
#include <thread>

#include "simpler/task/program_abi.h"

namespace {

using simpler::task::ArgDirection;
using simpler::task::KernelContext;
using simpler::task::TaskArgs;

std::atomic<bool> g_release{false};  // never set

absl::Status spin_forever(const KernelContext&) {
  while (!g_release.load(std::memory_order_acquire)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return absl::OkStatus();
}

absl::Status orchestrate(simpler::task::OrchestrationContext& ctx, const TaskArgs& args) {
  TaskArgs a;
  a.add_tensor(args.tensor(0), ArgDirection::kIn).add_tensor(args.tensor(1), ArgDirection::kOut);
  return ctx.submit(0, a);
}

int register_program(simpler::task::ProgramRegistry* registry) {
  registry->add_callable(
      simpler::task::ChipCallable{"spin", orchestrate, {{"spin_forever", spin_forever}}});
  using K = simpler::task::SelfCheckArg::Kind;
  simpler::task::SelfCheck chk;
  chk.name = "spin_check";
  chk.callable = "spin";
  chk.args = {{K::kInput, {4}, {1, 2, 3, 4}, 0}, {K::kOutput, {4}, {1, 2, 3, 4}, 0}};
  registry->add_self_check(chk);
  return 0;
}

}  // namespace

SIMPLER_PROGRAM_ENTRY("test_spin", register_program)
