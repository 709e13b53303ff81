// Test fixture: a program library built for a future ABI version.
#include "simpler/task/program_abi.h"

namespace {
int register_program(simpler::task::ProgramRegistry*) { return 0; }
const SimplerProgramAbi kAbi{simpler::task::kProgramAbiVersion + 6, 0, "future", register_program};
}  // namespace

extern "C" __attribute__((visibility("default"))) const SimplerProgramAbi* simpler_program_entry() {
  return &kAbi;
}
