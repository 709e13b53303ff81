#include "simpler/worker/run_handle.h"

#include <algorithm>
#include <limits>

#include "absl/strings/str_cat.h"
#include "base/poll.h"
#include "simpler/base/clock.h"
#include "simpler/base/enum_names.h"
#include "worker/run_shared.h"

namespace simpler::worker {

namespace {

constexpr base::EnumNames<RunState> kRunStateNames = {
    {RunState::kAccepted, "ACCEPTED"},   {RunState::kPrepared, "PREPARED"},
    {RunState::kLaunched, "LAUNCHED"},   {RunState::kCompleted, "COMPLETED"},
    {RunState::kFailed, "FAILED"},       {RunState::kCancelled, "CANCELLED"},
    {RunState::kFinalized, "FINALIZED"}, {RunState::kRetired, "RETIRED"}};

}  // namespace

std::string_view name_of(RunState state) { return kRunStateNames.name(state, "?"); }

namespace {

// Polls a run that has a RunProgress: calls it between looks, yielding the CPU, for its poll
// window or until `deadline` (once for a poll-once deadline).
void poll_progress(RunShared& shared, const base::Deadline& deadline) {
  RunProgress* p = shared.progress.get();
  if (p == nullptr || shared.finalized.is_signaled()) return;
  const auto made_progress = [&] {
    p->poll();
    return shared.finalized.is_signaled();
  };
  if (deadline.kind == base::Deadline::Kind::kPoll) {
    (void)made_progress();
    return;
  }
  const int64_t left = deadline.kind == base::Deadline::Kind::kAt
                           ? base::to_ns(deadline.at) - base::now_ns()
                           : std::numeric_limits<int64_t>::max();
  const int64_t window = p->poll_window_ns();
  if (std::min(window, left) <= 0) {
    (void)made_progress();  // no window: one look
    return;
  }
  p->begin_window();
  try {
    (void)base::poll_window(made_progress, window, left,
                            [p](bool finished) { p->polled(finished); });
  } catch (...) {
    p->end_window();  // a window left open would keep the endpoints' threads unwoken
    throw;
  }
  p->end_window();
}

}  // namespace

RunHandle::RunHandle(std::shared_ptr<RunShared> shared) : shared_(std::move(shared)) {}

base::RunId RunHandle::id() const { return shared_ ? shared_->id : base::RunId{}; }

bool RunHandle::done() const { return !shared_ || shared_->finalized.is_signaled(); }

RunState RunHandle::state() const {
  if (!shared_) return RunState::kCancelled;
  if (shared_->finalized.is_signaled()) return RunState::kRetired;
  return shared_->state.load(std::memory_order_acquire);
}

absl::Status RunHandle::wait(double timeout_s) const {
  if (!shared_) return absl::FailedPreconditionError("wait on an empty RunHandle");
  auto deadline = base::deadline_from_seconds(timeout_s);
  if (!deadline.ok()) return deadline.status();
  poll_progress(*shared_, *deadline);
  if (!shared_->finalized.wait(*deadline)) {
    return absl::DeadlineExceededError(
        timeout_s > 0
            ? absl::StrCat("run ", shared_->id.value, " not finished after ", timeout_s, " s")
            : absl::StrCat("run ", shared_->id.value, " not finished (polled once)"));
  }
  shared_->delivered.store(true, std::memory_order_release);
  return shared_->result.status;
}

absl::Status RunHandle::wait() const { return wait(std::numeric_limits<double>::infinity()); }

const RunResult& RunHandle::result() const {
  if (!shared_) {
    static const RunResult* const kEmpty = [] {
      auto* r = new RunResult;
      r->status = absl::FailedPreconditionError("result of an empty RunHandle");
      r->terminal_state = RunState::kCancelled;
      return r;
    }();
    return *kEmpty;
  }
  poll_progress(*shared_, base::Deadline::forever());
  shared_->finalized.wait(base::Deadline::forever());
  shared_->delivered.store(true, std::memory_order_release);
  return shared_->result;
}

absl::Status report_undelivered(std::vector<std::shared_ptr<RunShared>>* failed) {
  std::vector<std::shared_ptr<RunShared>> undelivered;
  for (auto& f : *failed) {
    if (!f->delivered.load(std::memory_order_acquire)) undelivered.push_back(f);
  }
  failed->clear();
  if (undelivered.empty()) return absl::OkStatus();
  const absl::Status& first = undelivered.front()->result.status;
  std::string msg(first.message());
  if (undelivered.size() > 1) {
    absl::StrAppend(&msg, " (and ", undelivered.size() - 1, " more undelivered run error",
                    undelivered.size() > 2 ? "s" : "", ")");
  }
  for (auto& u : undelivered) u->delivered.store(true, std::memory_order_release);
  absl::Status out(first.code(), msg);
  first.ForEachPayload([&out](absl::string_view k, const absl::Cord& v) { out.SetPayload(k, v); });
  return out;
}

}  // namespace simpler::worker
