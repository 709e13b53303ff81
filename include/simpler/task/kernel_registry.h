// Kernels registered by name.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "simpler/base/sync.h"
#include "simpler/task/callable.h"

namespace simpler::task {

// A name -> kernel table that programs draw their kernels from. Thread-safe.
class KernelRegistry {
 public:
  // ALREADY_EXISTS when `name` is registered with a different function;
  // INVALID_ARGUMENT for an empty name or null function.
  absl::Status add(std::string name, KernelFn fn);
  // NOT_FOUND names the missing kernel.
  absl::StatusOr<Kernel> find(std::string_view name) const;
  // The kernels named, in order; the first missing one is NOT_FOUND.
  absl::StatusOr<std::vector<Kernel>> find_all(const std::vector<std::string>& names) const;
  std::vector<std::string> names() const;

 private:
  mutable base::Mutex mu_;
  std::map<std::string, KernelFn, std::less<>> kernels_ SIMPLER_GUARDED_BY(mu_);
};

}  // namespace simpler::task
