// Fault injection for the sim device: make a chosen task of a chosen run fail.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace simpler::device {

// What an injected fault does to its task.
//  kKernelError: the kernel reports failure; recoverable (fails its run only).
//  kDeviceFault: the device reports an error code; device state unknown —
//                unrecoverable, poisons the lane.
//  kHang:        the task never finishes until the device is aborted (operation
//                timeout or close); unrecoverable. Stays interruptible.
//  kLaunchRefused: the stream refuses to enqueue the run (Stream::launch
//                returns UNAVAILABLE); nothing of the run reaches the device.
//                Applies to the whole run: `task` must be 0.
//  kProcessKill: the process hosting the device SIGKILLs itself when the task
//                starts (an L3 process-mode child dying mid-run; its parent
//                must fail every run the child held, naming it and the signal).
//  kProcessStop: the process hosting the device SIGSTOPs itself when the task
//                starts (an L3 process-mode child that stops answering, as under
//                a debugger or `kill -STOP`: its own operation timeout cannot
//                fire, so its parent's watch must fail every run it held and
//                kill it). Continued, the task runs on as if nothing happened.
enum class FaultKind : uint8_t {
  kKernelError,
  kDeviceFault,
  kHang,
  kLaunchRefused,
  kProcessKill,
  kProcessStop
};

std::string_view name_of(FaultKind kind);

// One fault: task `task` (0-based submission index inside the run) of run
// `run` (0-based RunId on its lane). `code` is the device error code reported
// (default 507018 for device_fault, 1 for kernel_error).
struct FaultSpec {
  uint64_t run = 0;
  uint32_t task = 0;
  FaultKind kind = FaultKind::kKernelError;
  int64_t code = 0;
};

// "run=3:task=7:kind=device_fault:code=507018": the SIMPLER_SIM_FAULTS spelling of one fault.
std::string to_string(const FaultSpec& spec);

// An immutable list of faults, with a hit counter per entry. Thread-safe: the list is read-only
// after construction and the counters are atomic. Copies share the counters.
class FaultPlan {
 public:
  FaultPlan() = default;
  explicit FaultPlan(std::vector<FaultSpec> faults)
      : faults_(std::move(faults)), hits_(new std::atomic<uint64_t>[faults_.size()]()) {}

  // Parses the SIMPLER_SIM_FAULTS syntax: comma-separated faults, each a
  // colon-separated list of key=value with keys run, task, kind
  // (kernel_error|device_fault|hang|launch_refused|process_kill|process_stop) and optional code,
  // e.g.
  //   run=3:task=7:kind=device_fault:code=507018,run=5:task=0:kind=hang
  // An empty string is an empty plan. INVALID_ARGUMENT names the offending
  // fault and key (unknown key, missing run/task/kind, non-numeric or negative
  // number, unknown kind, duplicate run/task pair, launch_refused with a task
  // other than 0).
  static absl::StatusOr<FaultPlan> parse(std::string_view text);

  // The plan from the environment variable SIMPLER_SIM_FAULTS (empty when unset).
  static absl::StatusOr<FaultPlan> from_env();

  // The fault for (run, task), if any; a match counts as a hit of that entry.
  std::optional<FaultSpec> find(uint64_t run, uint32_t task) const;
  // The same, limited to where the fault acts: at the run's launch
  // (launch_refused) or at a task (every other kind). A device asks at both
  // places, and only the entry that acts there counts as hit — a task fault
  // of a run that was launched but never reached the task did not fire.
  std::optional<FaultSpec> find_at(uint64_t run, uint32_t task, bool at_launch) const;
  // The entries that no find() has matched yet, in plan order.
  std::vector<FaultSpec> unfired() const;
  // Logs a warning naming every entry that never fired ("SIMPLER_SIM_FAULTS entry
  // run=0:task=7:kind=kernel_error:code=1 never fired on <who>: no run reached that task"); a
  // device calls it when it closes.
  void warn_unfired(std::string_view who) const;
  bool empty() const { return faults_.empty(); }
  const std::vector<FaultSpec>& faults() const { return faults_; }

 private:
  std::vector<FaultSpec> faults_;
  std::shared_ptr<std::atomic<uint64_t>[]> hits_;  // one per entry of faults_
};

}  // namespace simpler::device
