// The ABI of programs compiled into separate shared libraries.
//
// A program library exports exactly one C symbol, `simpler_program_entry`
// (kProgramEntrySymbol), returning a pointer to a static SimplerProgramAbi.
// The host reads `abi_version` first and refuses a mismatch before calling
// anything else; then `register_program` adds the library's callables and its
// self-checks to the host's ProgramRegistry. Library and host must be built
// with the same C++ standard library (the registry passes C++ types).
//
// Building one: the library carries its own copy of the task layer it calls (TaskArgs, Tensor,
// ...); the host does not export its code. In this CMake project, examples/CMakeLists.txt's
// simpler_program_library(NAME SOURCES...) does it (a MODULE linking simpler_task, hidden
// visibility). Outside it, after `scripts/build.sh release`, from the repository root (one
// command):
//   g++ -std=c++20 -O2 -shared -fPIC -fvisibility=hidden -I include prog.cc -o libprog.so
//     build/release/src/task/libsimpler_task.a build/release/src/base/libsimpler_base.a
//     -labsl_status -labsl_strings
// then `build/release/simpler run ./libprog.so`.
// A library built without them loads with "undefined symbol: _ZNK7simpler4task8TaskArgs...".
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "simpler/task/callable.h"

namespace simpler::task {

// Bumped on any change to SimplerProgramAbi, ProgramRegistry or SelfCheck.
inline constexpr uint32_t kProgramAbiVersion = 1;
inline constexpr const char* kProgramEntrySymbol = "simpler_program_entry";

// One argument of a self-check run. Tensors are f32, row-major, on the host;
// the runner copies them into device buffers.
struct SelfCheckArg {
  enum class Kind : uint8_t { kInput, kOutput, kScalar };
  Kind kind = Kind::kInput;
  std::vector<int64_t> shape;  // tensors
  std::vector<float> data;     // kInput: the values; kOutput: the program's reference result
  uint64_t scalar = 0;         // kScalar
};

// A run of `callable` on known inputs with the program's own reference for
// every output; `tolerance` is the largest acceptable max-abs error.
struct SelfCheck {
  std::string name;
  std::string callable;
  std::vector<SelfCheckArg> args;  // signature order
  double tolerance = 1e-4;
};

// Host side of registration. Owner-thread only (used during register_program).
class ProgramRegistry {
 public:
  virtual ~ProgramRegistry() = default;
  virtual void add_callable(ChipCallable callable) = 0;
  virtual void add_self_check(SelfCheck check) = 0;
};

}  // namespace simpler::task

extern "C" {
// What `simpler_program_entry` returns. Plain struct: the version comes first
// so any future layout can be recognised.
struct SimplerProgramAbi {
  uint32_t abi_version;
  uint32_t reserved;
  const char* name;
  // Returns 0 on success, non-zero on failure (the host reports the code).
  int (*register_program)(simpler::task::ProgramRegistry* registry);
};
typedef const SimplerProgramAbi* (*SimplerProgramEntryFn)(void);
}

// Defines `simpler_program_entry` for the current ABI version: the library named `name` (a
// string literal) whose `register_fn` adds its callables and self-checks. Use it once, at global
// scope, in one source file of the library.
#define SIMPLER_PROGRAM_ENTRY(name, register_fn)                                                 \
  extern "C" __attribute__((visibility("default"))) const SimplerProgramAbi*                     \
  simpler_program_entry() {                                                                      \
    static const SimplerProgramAbi abi{simpler::task::kProgramAbiVersion, 0, name, register_fn}; \
    return &abi;                                                                                 \
  }
