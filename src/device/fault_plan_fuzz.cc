// libFuzzer target: the SIMPLER_SIM_FAULTS string through FaultPlan::parse.
// Checks: no crash/UB; an accepted plan holds what the header promises (launch_refused only
// with task 0, no duplicate run/task pair, codes non-negative), and printing it back in the
// documented syntax parses to the same plan.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <set>
#include <string>
#include <string_view>
#include <utility>

#include "base/fuzz_check.h"
#include "simpler/device/fault_plan.h"

namespace {

using simpler::fuzz::check;

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace simpler::device;
  auto plan = FaultPlan::parse(std::string_view(reinterpret_cast<const char*>(data), size));
  if (!plan.ok()) return 0;
  std::set<std::pair<uint64_t, uint32_t>> seen;
  std::string text;
  for (const FaultSpec& f : plan->faults()) {
    check(f.kind != FaultKind::kLaunchRefused || f.task == 0, "launch_refused with a task");
    check(seen.insert({f.run, f.task}).second, "duplicate run/task pair accepted");
    check(f.code >= 0, "negative code accepted (the syntax has no negative numbers)");
    check(plan->find(f.run, f.task).has_value(), "find() misses an accepted fault");
    if (!text.empty()) text += ",";
    text += "run=" + std::to_string(f.run) + ":task=" + std::to_string(f.task) +
            ":kind=" + std::string(name_of(f.kind)) + ":code=" + std::to_string(f.code);
  }
  auto again = FaultPlan::parse(text);
  check(again.ok(), "the printed plan does not parse");
  check(again->faults().size() == plan->faults().size(), "printed plan differs in size");
  for (size_t i = 0; i < plan->faults().size(); ++i) {
    const FaultSpec& a = plan->faults()[i];
    const FaultSpec& b = again->faults()[i];
    check(a.run == b.run && a.task == b.task && a.kind == b.kind && a.code == b.code,
          "printed plan differs");
  }
  return 0;
}
