// RunResourceArena: the grant-sized pool of run resource sets. Private to the runtime.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "chip/captured_graph.h"
#include "chip/chip_runtime.h"
#include "simpler/base/clock.h"
#include "simpler/base/env.h"
#include "simpler/base/ids.h"
#include "simpler/base/sync.h"
#include "simpler/device/device.h"
#include "simpler/task/callable.h"
#include "simpler/task/task_args.h"
#include "simpler/worker/worker_stats.h"

namespace simpler::worker {

// A device buffer owned by a resource set and reused by the runs that hold the set.
struct StagingBuffer {
  uint64_t address = 0;
  uint64_t capacity = 0;  // bytes
};

// What the device reads and writes for one run, kept in the run's resource
// set (ARCHITECTURE.md invariant 3): the launch descriptor with the run's
// arguments and scalars (HOST tensors already replaced by their staging
// buffers), where its graph image is (host-built placement), and the
// device-written report (task counts, per-task timing: the device-side result
// and diagnostic records). Written by the run's submitter at prepare, by the
// device while the run executes, read by the lane once the device finished
// (the launch record's event orders them). The set's next run reuses it, with
// its capacity, only after this run retired; a quarantined set's records are
// never reused, so a device still writing them harms nothing.
struct RunRecords {
  const task::ChipCallable* callable = nullptr;
  task::TaskArgs args;
  int32_t max_cores = 0;  // 0 = all cores
  bool task_timing = true;
  chip::ChipOptions chip;
  bool host_built = false;
  uint64_t image_address = 0;  // host-built: the graph image in a staging buffer
  uint64_t image_bytes = 0;
  // A replay (docs/design/capture_replay.md): the graph, held until the run retires (or, once
  // quarantined, as long as the set), and its task arguments bound to `args`.
  std::shared_ptr<const chip::CapturedGraph> graph;
  std::vector<task::Arg> bound;
  // Kept across runs of the set (reset() leaves them), so that the set's next replay of the
  // same graph rewrites only what changes: the graph whose bound arguments `bound` holds (only
  // replays write `bound`), and the graph whose host-built image is at `image_for_address` in
  // the set's staging (any other run's prepare clears it: its staging may overwrite the image).
  // weak_ptr: the same control block is the same graph, even once the cache dropped it.
  std::weak_ptr<const chip::CapturedGraph> bound_for;
  std::weak_ptr<const chip::CapturedGraph> image_for;
  uint64_t image_for_address = 0;
  // A capture in the device-built placement: what the device recorded.
  bool capturing = false;
  chip::GraphRecording capture;
  chip::RunReport report;
  // Clears everything for the set's next run but what a replay reuses (above); vectors keep
  // their capacity.
  void reset();
};

// `run_grant` resource sets. A set holds what one run owns while the device
// may use it (staging buffers for HOST tensors and the graph image, and the
// run's RunRecords: arguments, scalars, device-written report and timing);
// it belongs to exactly one run from prepare to retire. A set whose
// device use cannot be proven finished is quarantined: never reused, still
// counted. Every handed-out set carries a generation; a SlotRef with a stale
// generation is refused (invariant 10).
// Thread-safe.
class RunResourceArena {
 public:
  // `device` (and `env`, when given) must outlive the arena. grant in [1,
  // kMaxRunGrant]. acquire()'s deadline is on `env`'s clock (null = the real one).
  RunResourceArena(device::Device* device, int32_t grant, base::Env* env = nullptr);
  ~RunResourceArena();

  // Takes a free set, blocking until one is free or `deadline` passes
  // (backpressure). DEADLINE_EXCEEDED when the deadline passed (naming the
  // counts), FAILED_PRECONDITION after shutdown() or when every set is
  // quarantined (no set can ever become free).
  absl::StatusOr<base::SlotRef> acquire(const base::Deadline& deadline);

  // Returns a live set to the free pool. FAILED_PRECONDITION for a stale or
  // non-live reference (the set is left untouched).
  absl::Status release(base::SlotRef ref);
  // Marks a live set quarantined. Same errors as release().
  absl::Status quarantine(base::SlotRef ref);

  // A device buffer of at least `bytes` belonging to live set `ref`, slot
  // `index` (0-based; one per staged tensor, handed out in increasing order by a run's
  // prepare). Reuses the set's buffer when big enough. When the device has no room
  // (RESOURCE_EXHAUSTED), first gives back the staging of every free set and this set's
  // slots above `index` (malloc_locked), then tries once more. Errors: stale ref
  // (FAILED_PRECONDITION) or device allocation errors.
  absl::StatusOr<StagingBuffer> staging(base::SlotRef ref, size_t index, uint64_t bytes);
  // Device memory for the Worker's user (Worker::malloc): the device's malloc, and when the
  // device has no room (RESOURCE_EXHAUSTED) for a request a capped heap could hold, the staging
  // of every free set is freed (their next run stages anew; a quarantined set's never is, the
  // device may still use it) and the request tried once more. Errors: the device's.
  absl::StatusOr<uint64_t> malloc(uint64_t bytes);
  // Frees live set `ref`'s staging (and every free set's) when its run failed before launch:
  // the device never saw the buffers, and a refused run keeps nothing from the next one.
  // Stale or non-live references are ignored.
  void release_staging(base::SlotRef ref);

  // free + live + quarantined == grant at every instant (one lock).
  ArenaCounts counts() const;

  // The records of live set `ref` (stable address for the arena's lifetime).
  // FAILED_PRECONDITION for a stale or non-live reference.
  absl::StatusOr<RunRecords*> records(base::SlotRef ref);
  int32_t grant() const { return grant_; }

  // Wakes blocked acquire() calls, which then fail; later ones fail at once.
  void shutdown();

 private:
  enum class SetState { kFree, kLive, kQuarantined };
  struct Set {
    SetState state = SetState::kFree;
    uint32_t generation = 0;
    std::vector<StagingBuffer> buffers;
    std::unique_ptr<RunRecords> records = std::make_unique<RunRecords>();
  };
  absl::Status check_live(base::SlotRef ref) const SIMPLER_REQUIRES(mu_);
  // malloc and staging's allocation: device_->malloc, then, when it found no room for a request
  // that could fit, release_idle_staging_locked(live, from) and one more try.
  absl::StatusOr<uint64_t> malloc_locked(uint64_t bytes, const Set* live, size_t from)
      SIMPLER_REQUIRES(mu_);
  // Frees the buffers of every free set and, when `live` names a set, its slots from `from`
  // on; a set whose staging changed forgets the image it held (RunRecords::image_for).
  // Returns the bytes freed.
  uint64_t release_idle_staging_locked(const Set* live, size_t from) SIMPLER_REQUIRES(mu_);
  // The only way a set changes state: keeps the per-state counts.
  void move_to(Set& set, SetState to) SIMPLER_REQUIRES(mu_);

  device::Device* device_;
  base::Env& env_;
  mutable base::Mutex mu_;
  base::CondVar cv_;
  const int32_t grant_;  // sets_.size(), fixed at construction
  std::vector<Set> sets_ SIMPLER_GUARDED_BY(mu_);
  bool shutdown_ SIMPLER_GUARDED_BY(mu_) = false;
  std::array<int32_t, 3> count_ SIMPLER_GUARDED_BY(mu_) = {};  // sets per SetState
  int32_t waiting_ SIMPLER_GUARDED_BY(mu_) = 0;
};

}  // namespace simpler::worker
