#include "simpler/device/fault_plan.h"

#include <charconv>
#include <cstdlib>
#include <optional>
#include <set>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "simpler/base/enum_names.h"
#include "simpler/base/log.h"

namespace simpler::device {

namespace {

constexpr base::EnumNames<FaultKind> kFaultKindNames = {
    {FaultKind::kKernelError, "kernel_error"},
    {FaultKind::kDeviceFault, "device_fault"},
    {FaultKind::kHang, "hang"},
    {FaultKind::kLaunchRefused, "launch_refused"},
    {FaultKind::kProcessKill, "process_kill"},
    {FaultKind::kProcessStop, "process_stop"}};

}  // namespace

std::string_view name_of(FaultKind kind) { return kFaultKindNames.name(kind, "?"); }

namespace {

absl::Status bad(size_t index, std::string_view fault, const std::string& why) {
  return absl::InvalidArgumentError(
      absl::StrCat("SIMPLER_SIM_FAULTS: fault ", index, " ('", std::string(fault), "'): ", why));
}

bool parse_u64(std::string_view s, uint64_t* out) {
  if (s.empty()) return false;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), *out);
  return ec == std::errc() && p == s.data() + s.size();
}

}  // namespace

absl::StatusOr<FaultPlan> FaultPlan::parse(std::string_view text) {
  std::vector<FaultSpec> faults;
  if (text.empty()) return FaultPlan();
  std::set<std::pair<uint64_t, uint32_t>> seen;
  size_t index = 0;
  for (absl::string_view fault_av :
       absl::StrSplit(absl::string_view(text.data(), text.size()), ',')) {
    std::string_view fault(fault_av.data(), fault_av.size());
    FaultSpec spec;
    bool has_run = false, has_task = false, has_kind = false, has_code = false;
    if (fault.empty()) return bad(index, fault, "empty fault (stray comma?)");
    for (absl::string_view kv_av : absl::StrSplit(fault_av, ':')) {
      std::string_view kv(kv_av.data(), kv_av.size());
      size_t eq = kv.find('=');
      if (eq == std::string_view::npos) {
        return bad(index, fault, absl::StrCat("'", std::string(kv), "' is not key=value"));
      }
      std::string key(kv.substr(0, eq));
      std::string_view value = kv.substr(eq + 1);
      uint64_t n = 0;
      if (key == "run" || key == "task" || key == "code") {
        if (!parse_u64(value, &n)) {
          return bad(
              index, fault,
              absl::StrCat(key, "='", std::string(value), "' is not a non-negative integer"));
        }
        if (key == "run") {
          spec.run = n;
          has_run = true;
        } else if (key == "task") {
          if (n > UINT32_MAX) return bad(index, fault, "task index too large");
          spec.task = static_cast<uint32_t>(n);
          has_task = true;
        } else {
          if (n > static_cast<uint64_t>(INT64_MAX)) {
            return bad(index, fault,
                       absl::StrCat("code=", n, " is above the largest error code, ", INT64_MAX));
          }
          spec.code = static_cast<int64_t>(n);
          has_code = true;
        }
      } else if (key == "kind") {
        std::optional<FaultKind> kind = kFaultKindNames.parse(value);
        if (!kind.has_value()) {
          return bad(index, fault,
                     absl::StrCat("unknown kind '", std::string(value),
                                  "' (expected kernel_error, device_fault, hang, "
                                  "launch_refused, process_kill or process_stop)"));
        }
        spec.kind = *kind;
        has_kind = true;
      } else {
        return bad(index, fault,
                   absl::StrCat("unknown key '", key, "' (expected run, task, kind, code)"));
      }
    }
    if (!has_run) return bad(index, fault, "missing run=");
    if (!has_task) return bad(index, fault, "missing task=");
    if (!has_kind) return bad(index, fault, "missing kind=");
    if (spec.kind == FaultKind::kLaunchRefused && spec.task != 0) {
      return bad(index, fault, "launch_refused applies to a whole run: task must be 0");
    }
    if (!has_code) spec.code = spec.kind == FaultKind::kDeviceFault ? 507018 : 1;
    if (!seen.insert({spec.run, spec.task}).second) {
      return bad(index, fault, "duplicate fault for the same run and task");
    }
    faults.push_back(spec);
    ++index;
  }
  return FaultPlan(std::move(faults));
}

absl::StatusOr<FaultPlan> FaultPlan::from_env() {
  const char* v = std::getenv("SIMPLER_SIM_FAULTS");
  if (v == nullptr) return FaultPlan();
  return parse(v);
}

std::string to_string(const FaultSpec& spec) {
  return absl::StrCat("run=", spec.run, ":task=", spec.task,
                      ":kind=", std::string(name_of(spec.kind)), ":code=", spec.code);
}

std::optional<FaultSpec> FaultPlan::find(uint64_t run, uint32_t task) const {
  for (size_t i = 0; i < faults_.size(); ++i) {
    const FaultSpec& f = faults_[i];
    if (f.run == run && f.task == task) {
      hits_[i].fetch_add(1, std::memory_order_relaxed);
      return f;
    }
  }
  return std::nullopt;
}

std::optional<FaultSpec> FaultPlan::find_at(uint64_t run, uint32_t task, bool at_launch) const {
  for (size_t i = 0; i < faults_.size(); ++i) {
    const FaultSpec& f = faults_[i];
    if (f.run != run || f.task != task) continue;
    if ((f.kind == FaultKind::kLaunchRefused) != at_launch) continue;
    hits_[i].fetch_add(1, std::memory_order_relaxed);
    return f;
  }
  return std::nullopt;
}

std::vector<FaultSpec> FaultPlan::unfired() const {
  std::vector<FaultSpec> out;
  for (size_t i = 0; i < faults_.size(); ++i) {
    if (hits_[i].load(std::memory_order_relaxed) == 0) out.push_back(faults_[i]);
  }
  return out;
}

void FaultPlan::warn_unfired(std::string_view who) const {
  for (const FaultSpec& f : unfired()) {
    SIMPLER_LOG_WARN(
        "SIMPLER_SIM_FAULTS entry {} never fired on {}: no run reached task {} of run {}",
        to_string(f), who, f.task, f.run);
  }
}

}  // namespace simpler::device
