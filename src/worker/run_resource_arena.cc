#include "worker/run_resource_arena.h"

#include "absl/strings/str_cat.h"

namespace simpler::worker {

RunResourceArena::RunResourceArena(device::Device* device, int32_t grant, base::Env* env)
    : device_(device),
      env_(env != nullptr ? *env : base::Env::real()),
      grant_(grant),
      sets_(static_cast<size_t>(grant)) {
  base::MutexLock lock(mu_);
  count_[static_cast<size_t>(SetState::kFree)] = grant;
}

void RunResourceArena::move_to(Set& set, SetState to) {
  --count_[static_cast<size_t>(set.state)];
  ++count_[static_cast<size_t>(to)];
  set.state = to;
}

RunResourceArena::~RunResourceArena() {
  base::MutexLock lock(mu_);
  // Quarantined buffers may still be referenced by a dead launch: they stay
  // allocated until the device itself closes.
  for (auto& s : sets_) {
    if (s.state == SetState::kQuarantined) continue;
    for (auto& b : s.buffers) (void)device_->free(b.address);
    s.buffers.clear();
  }
}

absl::StatusOr<base::SlotRef> RunResourceArena::acquire(const base::Deadline& deadline) {
  base::MutexLock lock(mu_);
  while (true) {
    if (shutdown_) return absl::FailedPreconditionError("worker is closing; no run resources");
    for (size_t i = 0; i < sets_.size(); ++i) {
      if (sets_[i].state == SetState::kFree) {
        move_to(sets_[i], SetState::kLive);
        ++sets_[i].generation;
        return base::SlotRef{static_cast<uint32_t>(i), sets_[i].generation};
      }
    }
    const int32_t quarantined = count_[static_cast<size_t>(SetState::kQuarantined)];
    if (quarantined == grant_) {
      return absl::FailedPreconditionError(absl::StrCat(
          "all ", sets_.size(), " run resource sets are quarantined; none can become free"));
    }
    if (env_.expired(deadline)) {
      return absl::DeadlineExceededError(
          absl::StrCat("no run resource set became free before the deadline (grant ", sets_.size(),
                       ", ", quarantined, " quarantined)"));
    }
    ++waiting_;
    (void)env_.wait(cv_, lock, deadline);
    --waiting_;
  }
}

absl::Status RunResourceArena::check_live(base::SlotRef ref) const {
  if (ref.index >= sets_.size()) {
    return absl::FailedPreconditionError(
        absl::StrCat("resource set ", ref.index, " does not exist (grant ", sets_.size(), ")"));
  }
  const Set& s = sets_[ref.index];
  if (s.generation != ref.generation) {
    return absl::FailedPreconditionError(absl::StrCat("stale reference to resource set ", ref.index,
                                                      ": generation ", ref.generation, ", current ",
                                                      s.generation));
  }
  if (s.state != SetState::kLive) {
    return absl::FailedPreconditionError(
        absl::StrCat("resource set ", ref.index, " generation ", ref.generation, " is not live"));
  }
  return absl::OkStatus();
}

absl::Status RunResourceArena::release(base::SlotRef ref) {
  {
    base::MutexLock lock(mu_);
    if (absl::Status s = check_live(ref); !s.ok()) return s;
    move_to(sets_[ref.index], SetState::kFree);
  }
  cv_.notify_all();
  return absl::OkStatus();
}

absl::Status RunResourceArena::quarantine(base::SlotRef ref) {
  base::MutexLock lock(mu_);
  if (absl::Status s = check_live(ref); !s.ok()) return s;
  move_to(sets_[ref.index], SetState::kQuarantined);
  cv_.notify_all();  // waiters re-check "all quarantined"
  return absl::OkStatus();
}

absl::StatusOr<StagingBuffer> RunResourceArena::staging(base::SlotRef ref, size_t index,
                                                        uint64_t bytes) {
  base::MutexLock lock(mu_);
  if (absl::Status s = check_live(ref); !s.ok()) return s;
  auto& bufs = sets_[ref.index].buffers;
  if (bufs.size() <= index) bufs.resize(index + 1);
  StagingBuffer& b = bufs[index];
  if (b.capacity < bytes) {
    if (b.address != 0) (void)device_->free(b.address);
    b = StagingBuffer{};
    const uint64_t want = std::max<uint64_t>(bytes, 64);
    auto addr = malloc_locked(want, &sets_[ref.index], index + 1);
    if (!addr.ok()) return addr.status();
    b = StagingBuffer{*addr, want};
  }
  return b;
}

absl::StatusOr<uint64_t> RunResourceArena::malloc(uint64_t bytes) {
  base::MutexLock lock(mu_);
  return malloc_locked(bytes, nullptr, 0);
}

absl::StatusOr<uint64_t> RunResourceArena::malloc_locked(uint64_t bytes, const Set* live,
                                                         size_t from) {
  absl::StatusOr<uint64_t> addr = device_->malloc(bytes);
  const uint64_t heap = device_->caps().memory_bytes;  // 0: host-limited
  if (!addr.ok() && addr.status().code() == absl::StatusCode::kResourceExhausted &&
      (heap == 0 || bytes <= heap) && release_idle_staging_locked(live, from) > 0) {
    addr = device_->malloc(bytes);  // the cached staging no run holds was in the way
  }
  return addr;
}

void RunResourceArena::release_staging(base::SlotRef ref) {
  base::MutexLock lock(mu_);
  if (check_live(ref).ok()) (void)release_idle_staging_locked(&sets_[ref.index], 0);
}

uint64_t RunResourceArena::release_idle_staging_locked(const Set* live, size_t from) {
  uint64_t freed = 0;
  for (Set& s : sets_) {
    const bool own = &s == live;
    if (!own && s.state != SetState::kFree) continue;
    bool changed = false;
    for (size_t i = own ? from : 0; i < s.buffers.size(); ++i) {
      StagingBuffer& b = s.buffers[i];
      if (b.address == 0) continue;
      (void)device_->free(b.address);
      freed += b.capacity;
      b = StagingBuffer{};
      changed = true;
    }
    if (changed) {  // a buffer at the image's address may come back holding something else
      s.records->image_for.reset();
      s.records->image_for_address = 0;
    }
  }
  return freed;
}

void RunRecords::reset() {
  callable = nullptr;
  args.clear();
  max_cores = 0;
  task_timing = true;
  chip = chip::ChipOptions{};
  host_built = false;
  image_address = 0;
  image_bytes = 0;
  graph.reset();
  capturing = false;
  capture.clear();
  report.tasks_submitted = 0;
  report.tasks_completed = 0;
  report.tasks_failed = 0;
  report.first_failed_task = -1;
  report.tasks.clear();
  report.blocks.clear();
}

absl::StatusOr<RunRecords*> RunResourceArena::records(base::SlotRef ref) {
  base::MutexLock lock(mu_);
  if (absl::Status s = check_live(ref); !s.ok()) return s;
  return sets_[ref.index].records.get();
}

ArenaCounts RunResourceArena::counts() const {
  base::MutexLock lock(mu_);
  // Kept per transition (move_to), not recounted from the sets: a transition
  // that forgot its bookkeeping shows up as counts that no longer sum to the
  // grant.
  return ArenaCounts{count_[static_cast<size_t>(SetState::kFree)],
                     count_[static_cast<size_t>(SetState::kLive)],
                     count_[static_cast<size_t>(SetState::kQuarantined)], grant_, waiting_};
}

void RunResourceArena::shutdown() {
  {
    base::MutexLock lock(mu_);
    shutdown_ = true;
  }
  cv_.notify_all();
}

}  // namespace simpler::worker
