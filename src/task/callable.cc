#include "simpler/task/callable.h"

#include <set>

#include "absl/strings/str_cat.h"
#include "simpler/task/kernel_registry.h"

namespace simpler::task {

absl::StatusOr<KernelIndex> ChipCallable::kernel_index(std::string_view kernel_name) const {
  for (size_t i = 0; i < kernels.size(); ++i) {
    if (kernels[i].name == kernel_name) return static_cast<KernelIndex>(i);
  }
  return absl::NotFoundError(
      absl::StrCat("callable '", name, "' has no kernel named '", std::string(kernel_name), "'"));
}

absl::Status ChipCallable::validate() const {
  if (name.empty()) return absl::InvalidArgumentError("callable has an empty name");
  if (!orchestration) {
    return absl::InvalidArgumentError(
        absl::StrCat("callable '", name, "' has no orchestration function"));
  }
  if (static_cast<uint8_t>(placement) > static_cast<uint8_t>(GraphPlacement::kHost)) {
    return absl::InvalidArgumentError(
        absl::StrCat("callable '", name, "' has unknown placement ", static_cast<int>(placement)));
  }
  std::set<std::string_view> seen;
  for (const Kernel& k : kernels) {
    if (k.name.empty()) {  // kernel_index could not find it, nor a message name it
      return absl::InvalidArgumentError(
          absl::StrCat("callable '", name, "': kernel ", &k - kernels.data(), " has no name"));
    }
    if (k.fn == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("callable '", name, "': kernel '", k.name, "' has no function"));
    }
    if (!seen.insert(k.name).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("callable '", name, "': kernel name '", k.name, "' appears twice"));
    }
  }
  return absl::OkStatus();
}

ChipCallable one_kernel_callable(std::string name, KernelFn kernel) {
  std::string kernel_name = name;
  return {std::move(name),
          [](OrchestrationContext& ctx, const TaskArgs& args) { return ctx.submit(0, args); },
          {{std::move(kernel_name), kernel}}};
}

absl::Status KernelRegistry::add(std::string kernel_name, KernelFn fn) {
  if (kernel_name.empty() || fn == nullptr) {
    return absl::InvalidArgumentError("kernel registration needs a name and a function");
  }
  base::MutexLock lock(mu_);
  auto [it, inserted] = kernels_.emplace(kernel_name, fn);
  if (!inserted && it->second != fn) {
    return absl::AlreadyExistsError(
        absl::StrCat("kernel '", kernel_name, "' is already registered with another function"));
  }
  return absl::OkStatus();
}

absl::StatusOr<Kernel> KernelRegistry::find(std::string_view kernel_name) const {
  base::MutexLock lock(mu_);
  auto it = kernels_.find(kernel_name);
  if (it == kernels_.end()) {
    return absl::NotFoundError(
        absl::StrCat("no kernel registered as '", std::string(kernel_name), "'"));
  }
  return Kernel{it->first, it->second};
}

absl::StatusOr<std::vector<Kernel>> KernelRegistry::find_all(
    const std::vector<std::string>& kernel_names) const {
  std::vector<Kernel> out;
  for (const auto& n : kernel_names) {
    auto k = find(n);
    if (!k.ok()) return k.status();
    out.push_back(*k);
  }
  return out;
}

std::vector<std::string> KernelRegistry::names() const {
  base::MutexLock lock(mu_);
  std::vector<std::string> out;
  for (const auto& [n, fn] : kernels_) out.push_back(n);
  return out;
}

}  // namespace simpler::task
