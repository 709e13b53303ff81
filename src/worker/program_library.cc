#include "simpler/worker/program_library.h"

#include <dlfcn.h>

#include <cmath>
#include <map>
#include <set>

#include "absl/functional/function_ref.h"
#include "absl/strings/str_cat.h"
#include "base/quarantine.h"
#include "simpler/base/clock.h"
#include "simpler/base/status.h"

namespace simpler::worker {

namespace {

class CollectingRegistry final : public task::ProgramRegistry {
 public:
  void add_callable(task::ChipCallable c) override { callables.push_back(std::move(c)); }
  void add_self_check(task::SelfCheck c) override { checks.push_back(std::move(c)); }
  std::vector<task::ChipCallable> callables;
  std::vector<task::SelfCheck> checks;
};

}  // namespace

ProgramLibrary::ProgramLibrary(ProgramLibrary&& o) noexcept { *this = std::move(o); }

ProgramLibrary& ProgramLibrary::operator=(ProgramLibrary&& o) noexcept {
  if (this != &o) {
    if (handle_ != nullptr) {
      callables_.clear();
      if (base::abandoned_threads() == 0) ::dlclose(handle_);
    }
    handle_ = o.handle_;
    o.handle_ = nullptr;
    name_ = std::move(o.name_);
    callables_ = std::move(o.callables_);
    checks_ = std::move(o.checks_);
  }
  return *this;
}

ProgramLibrary::~ProgramLibrary() {
  callables_.clear();  // std::function targets may live in the library
  checks_.clear();
  if (handle_ == nullptr) return;
  if (base::abandoned_threads() > 0) {
    // A device thread abandoned inside a kernel may be running this
    // library's code: it stays loaded until the process exits.
    return;
  }
  ::dlclose(handle_);
}

namespace {

// The self-checks' rules: a name, each once; a registered callable; a tolerance that is a number
// >= 0; at least one output (a check of none would pass having checked nothing).
absl::Status check_self_checks(const std::string& path,
                               const std::vector<task::ChipCallable>& callables,
                               const std::vector<task::SelfCheck>& checks) {
  std::set<std::string> names;
  for (const task::SelfCheck& chk : checks) {
    const std::string where =
        absl::StrCat("program library '", path, "': self-check '", chk.name, "'");
    if (chk.name.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "program library '", path, "': a self-check of '", chk.callable, "' has no name"));
    }
    if (!names.insert(chk.name).second) {
      return absl::InvalidArgumentError(where + " is registered twice");
    }
    bool found = false;
    for (const auto& c : callables) found = found || c.name == chk.callable;
    if (!found) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, " names unknown callable '", chk.callable, "'"));
    }
    if (!(chk.tolerance >= 0)) {  // NaN too
      return absl::InvalidArgumentError(
          absl::StrCat(where, " has tolerance ", chk.tolerance, ": it must be a number >= 0"));
    }
    bool output = false;
    for (const auto& a : chk.args) output = output || a.kind == task::SelfCheckArg::Kind::kOutput;
    if (!output) {
      return absl::InvalidArgumentError(where + " has no output: it would check nothing");
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ProgramLibrary> ProgramLibrary::load(const std::string& path) {
  ProgramLibrary lib;
  if (path.empty()) return absl::InvalidArgumentError("program library path is empty");
  // A path without a '/' is a file here (the flag's "path of the program library"), not a name
  // for dlopen to look up on the library search path.
  const std::string open_path = path.find('/') == std::string::npos ? "./" + path : path;
  lib.handle_ = ::dlopen(open_path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (lib.handle_ == nullptr) {
    const char* err = ::dlerror();
    return absl::NotFoundError(
        absl::StrCat("cannot load program library '", path, "': ", err ? err : "unknown error"));
  }
  ::dlerror();
  void* sym = ::dlsym(lib.handle_, task::kProgramEntrySymbol);
  if (sym == nullptr) {
    return absl::NotFoundError(absl::StrCat("program library '", path, "' does not export '",
                                            task::kProgramEntrySymbol, "'"));
  }
  auto entry = reinterpret_cast<SimplerProgramEntryFn>(sym);
  const SimplerProgramAbi* abi = entry();
  if (abi == nullptr) {
    return absl::InternalError(absl::StrCat("program library '", path,
                                            "': ", task::kProgramEntrySymbol, "() returned null"));
  }
  if (abi->abi_version != task::kProgramAbiVersion) {
    return absl::FailedPreconditionError(
        absl::StrCat("program library '", path, "' was built for program ABI ", abi->abi_version,
                     "; this simpler is ABI ", task::kProgramAbiVersion, " — rebuild it"));
  }
  lib.name_ = abi->name != nullptr && abi->name[0] != '\0' ? abi->name : path;
  CollectingRegistry reg;
  if (abi->register_program == nullptr) {
    return absl::InternalError(
        absl::StrCat("program library '", path, "' has no register_program"));
  }
  int rc = 0;
  try {
    rc = abi->register_program(&reg);
  } catch (...) {  // the program's own code: no exception leaves it
    return base::annotate(base::status_from_current_exception("register_program"),
                          absl::StrCat("program library '", path, "': "));
  }
  if (rc != 0) {
    return absl::InternalError(
        absl::StrCat("program library '", path, "': register_program failed with code ", rc));
  }
  for (size_t i = 0; i < reg.callables.size(); ++i) {
    const task::ChipCallable& c = reg.callables[i];
    SIMPLER_RETURN_IF_ERROR(
        base::annotate(c.validate(), absl::StrCat("program library '", path, "': ")));
    for (size_t j = 0; j < i; ++j) {
      if (reg.callables[j].name == c.name) {
        return absl::InvalidArgumentError(absl::StrCat(
            "program library '", path, "' registers two callables named '", c.name, "'"));
      }
    }
  }
  SIMPLER_RETURN_IF_ERROR(check_self_checks(path, reg.callables, reg.checks));
  lib.callables_ = std::move(reg.callables);
  lib.checks_ = std::move(reg.checks);
  return lib;
}

namespace {

// One submitted run of a self-check.
struct PendingCheck {
  const task::SelfCheck* check;
  std::vector<std::vector<float>> outputs;  // host staging per output arg
  RunHandle handle;
};

// The run arguments of `chk`: its inputs as HOST tensors over its data, its outputs as HOST
// tensors over staging buffers appended to p.outputs (reserved by the caller). A value count
// that does not match its shape is returned through `fail`.
absl::StatusOr<task::TaskArgs> self_check_args(const task::SelfCheck& chk, PendingCheck& p,
                                               absl::FunctionRef<absl::Status(absl::Status)> fail) {
  task::TaskArgs args;
  for (size_t i = 0; i < chk.args.size(); ++i) {
    const auto& a = chk.args[i];
    if (a.kind == task::SelfCheckArg::Kind::kScalar) {
      args.add_scalar(a.scalar);
      continue;
    }
    int64_t numel = 1;
    for (int64_t d : a.shape) numel *= d;
    if (static_cast<int64_t>(a.data.size()) != numel) {
      return fail(absl::InvalidArgumentError(
          absl::StrCat("self-check '", chk.name, "' argument ", i, ": ", a.data.size(),
                       " values for a shape of ", numel, " elements")));
    }
    if (a.kind == task::SelfCheckArg::Kind::kInput) {
      // A HOST tensor: the run stages it into its resource set at prepare,
      // so no copy waits for earlier runs and the checks pipeline.
      SIMPLER_ASSIGN_OR_RETURN(
          task::Tensor t,
          task::Tensor::contiguous(reinterpret_cast<uintptr_t>(a.data.data()), a.shape.data(),
                                   static_cast<int32_t>(a.shape.size()), task::DataType::kFloat32,
                                   task::MemoryKind::kHost));
      args.add_tensor(t, task::ArgDirection::kIn);
    } else {
      p.outputs.emplace_back(numel, 0.0f);
      SIMPLER_ASSIGN_OR_RETURN(
          task::Tensor t,
          task::Tensor::contiguous(reinterpret_cast<uintptr_t>(p.outputs.back().data()),
                                   a.shape.data(), static_cast<int32_t>(a.shape.size()),
                                   task::DataType::kFloat32, task::MemoryKind::kHost));
      args.add_tensor(t, task::ArgDirection::kOut);
    }
  }
  return args;
}

// The error of a submit of `chk` refused with `refused`: when an earlier run poisoned the lane,
// that run's own error (e.g. its refused launch), naming its check.
absl::Status refused_check_error(const absl::Status& refused, const task::SelfCheck& chk,
                                 const std::vector<PendingCheck>& pending) {
  const PendingCheck* culprit = nullptr;
  absl::Status cause = poison_cause(refused, [&](uint64_t run) -> std::optional<RunHandle> {
    for (const auto& q : pending) {
      if (q.handle.id().value == run) {
        culprit = &q;
        return q.handle;
      }
    }
    return std::nullopt;
  });
  const std::string& name =
      cause != refused && culprit != nullptr ? culprit->check->name : chk.name;
  return base::annotate(cause, absl::StrCat("self-check '", name, "': "));
}

// The result of a finished run: its outputs against the expected values.
SelfCheckResult score_check(const PendingCheck& p) {
  SelfCheckResult r;
  r.name = p.check->name;
  r.tolerance = p.check->tolerance;
  r.run = p.handle.result();
  size_t out = 0;
  for (const auto& a : p.check->args) {
    if (a.kind != task::SelfCheckArg::Kind::kOutput) continue;
    const auto& got = p.outputs[out++];
    for (size_t i = 0; i < got.size(); ++i) {
      const double e = std::fabs(static_cast<double>(got[i]) - a.data[i]);
      if (std::isnan(e) || e > r.max_abs_error) r.max_abs_error = std::isnan(e) ? INFINITY : e;
    }
  }
  r.passed = r.max_abs_error <= r.tolerance;
  return r;
}

}  // namespace

absl::StatusOr<std::vector<SelfCheckResult>> run_self_checks(const ProgramLibrary& lib,
                                                             const WorkerOptions& options,
                                                             int repeats) {
  // Declared before the Worker, so it is destroyed after it: the Worker's
  // close drains every run (whose finalize copies into these host buffers)
  // on every way out, error paths included.
  std::vector<PendingCheck> pending;
  Worker worker(options);
  // On an error while runs are in flight, the error is known: close at once
  // (bounded) instead of waiting out each run, then return the error.
  auto fail = [&worker](absl::Status error) {
    (void)worker.close(base::Deadline::poll());
    return error;
  };
  std::map<std::string, CallableHandle> handles;
  for (const auto& c : lib.callables()) {
    SIMPLER_ASSIGN_OR_RETURN(handles[c.name], worker.register_callable(c));
  }
  SIMPLER_RETURN_IF_ERROR(worker.init());

  pending.reserve(lib.self_checks().size() * std::max(1, repeats));
  for (int rep = 0; rep < std::max(1, repeats); ++rep) {
    for (const auto& chk : lib.self_checks()) {
      PendingCheck p{&chk, {}, {}};
      p.outputs.reserve(chk.args.size());
      absl::StatusOr<task::TaskArgs> args = self_check_args(chk, p, fail);
      if (!args.ok()) return args.status();
      absl::StatusOr<RunHandle> h = worker.submit(handles[chk.callable], *args);
      if (!h.ok()) return fail(refused_check_error(h.status(), chk, pending));
      p.handle = *std::move(h);
      pending.push_back(std::move(p));
    }
  }
  // Runs are waited for in order; the first error is returned as soon as it is
  // known (the close cancels the runs still in flight).
  for (auto& p : pending) {
    absl::Status s = p.handle.wait();
    if (!s.ok()) {
      return fail(base::annotate(s, absl::StrCat("self-check '", p.check->name, "': ")));
    }
  }
  std::vector<SelfCheckResult> results;
  for (auto& p : pending) results.push_back(score_check(p));
  SIMPLER_RETURN_IF_ERROR(worker.close());
  return results;
}

}  // namespace simpler::worker
