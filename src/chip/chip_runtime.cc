#include "simpler/chip/chip_runtime.h"

#include <algorithm>
#include <deque>

#include "absl/strings/str_cat.h"
#include "simpler/base/status.h"
#include "simpler/chip/tensor_map.h"

namespace simpler::chip {

absl::Status ChipOptions::validate() const {
  if (ring_capacity == 0) return absl::InvalidArgumentError("ChipOptions.ring_capacity is 0");
  if (max_task_args == 0) return absl::InvalidArgumentError("ChipOptions.max_task_args is 0");
  if (max_block_dim <= 0) return absl::InvalidArgumentError("ChipOptions.max_block_dim <= 0");
  return absl::OkStatus();
}

namespace {

// One ring slot. Reused for task seq, seq + capacity, ...
struct TaskSlot {
  uint64_t seq = 0;
  task::KernelIndex kernel = 0;
  int32_t block_dim = 1;
  int32_t blocks_started = 0;
  int32_t blocks_done = 0;
  int32_t pending = 0;  // unfinished predecessors
  bool completed = false;
  std::vector<task::Arg> args;
  std::vector<uint64_t> successors;
  TaskTiming timing;
};

// The graph builder and dispatcher of one run (device-built placement): it is
// the OrchestrationContext the orchestration function submits through, and it
// dispatches ready blocks to cores as tasks arrive. Owner-thread only.
class GraphExecutor final : public task::OrchestrationContext {
 public:
  GraphExecutor(device::ExecContext& ctx, const task::ChipCallable& callable,
                const ChipOptions& options, int32_t max_cores, bool record_timing,
                RunReport* report)
      : ctx_(ctx),
        callable_(callable),
        options_(options),
        record_timing_(record_timing),
        report_(report),
        ring_(options.ring_capacity) {
    int32_t cores = ctx.num_cores();
    if (max_cores > 0) cores = std::min(cores, max_cores);
    num_cores_ = cores;
    for (int32_t c = cores - 1; c >= 0; --c) idle_.push_back(c);
    is_done_ = [this](uint64_t seq) { return done(seq); };
  }

  int32_t num_cores() const override { return num_cores_; }
  uint64_t run_id() const override { return ctx_.run_id(); }

  absl::Status submit(task::KernelIndex kernel, const task::TaskArgs& args,
                      int32_t block_dim) override {
    if (!failure_.ok()) return failure_;
    const uint64_t seq = next_seq_;
    if (kernel >= callable_.kernels.size()) {
      return fail_submit(absl::InvalidArgumentError(
          absl::StrCat("task ", seq, ": kernel index ", kernel, " out of range (callable '",
                       callable_.name, "' has ", callable_.kernels.size(), " kernels)")));
    }
    const std::string& kname = callable_.kernels[kernel].name;
    if (block_dim < 1 || block_dim > options_.max_block_dim) {
      return fail_submit(absl::InvalidArgumentError(
          absl::StrCat("task ", seq, " (kernel '", kname, "'): block_dim ", block_dim,
                       " outside [1, ", options_.max_block_dim, "]")));
    }
    if (args.size() > options_.max_task_args) {
      return fail_submit(absl::ResourceExhaustedError(absl::StrCat(
          "task ", seq, " (kernel '", kname, "') has ", args.size(),
          " arguments; a task ring slot holds ", options_.max_task_args,
          " — the run can never fit")));
    }
    if (absl::Status v = args.validate(); !v.ok()) {
      return fail_submit(base::annotate(v, absl::StrCat("task ", seq, " (kernel '", kname, "'): ")));
    }
    for (size_t i = 0; i < args.size(); ++i) {
      const task::Arg& a = args[i];
      if (a.direction == task::ArgDirection::kScalar) continue;
      if (a.tensor.memory != task::MemoryKind::kDevice) {
        return fail_submit(absl::InvalidArgumentError(
            absl::StrCat("task ", seq, " (kernel '", kname, "') argument ", i,
                         " is a HOST tensor; tasks take device tensors")));
      }
      const uint64_t span = a.tensor.span_bytes();
      if (span == 0) continue;
      if (absl::Status r = ctx_.check_range(a.tensor.address, span); !r.ok()) {
        return fail_submit(base::annotate(
            r, absl::StrCat("task ", seq, " (kernel '", kname, "') argument ", i, " ",
                            a.tensor.debug_string(), ": ")));
      }
    }
    // Backpressure: wait for the oldest tasks to retire.
    while (next_seq_ - head_seq_ >= ring_.size()) {
      if (!failure_.ok()) return failure_;
      dispatch();
      if (!pump(/*block=*/true)) {
        return fail_submit(absl::InternalError("task ring full with nothing running"));
      }
    }
    if (!failure_.ok()) return failure_;

    TaskSlot& s = slot(seq);
    s.seq = seq;
    s.kernel = kernel;
    s.block_dim = block_dim;
    s.blocks_started = 0;
    s.blocks_done = 0;
    s.pending = 0;
    s.completed = false;
    s.args.assign(args.args().begin(), args.args().end());
    s.successors.clear();
    s.timing = TaskTiming{static_cast<uint32_t>(seq), kernel, -1, block_dim, 0, 0};
    ++next_seq_;
    ++report_->tasks_submitted;

    deps_.clear();
    for (const task::Arg& a : s.args) {
      if (a.direction == task::ArgDirection::kScalar) continue;
      const uint64_t span = a.tensor.span_bytes();
      const bool write = a.direction != task::ArgDirection::kIn;
      tensor_map_.access(a.tensor.address, a.tensor.address + span, write, seq, is_done_, &deps_);
    }
    std::sort(deps_.begin(), deps_.end());
    deps_.erase(std::unique(deps_.begin(), deps_.end()), deps_.end());
    for (uint64_t d : deps_) {
      slot(d).successors.push_back(seq);
      ++s.pending;
    }
    if (s.pending == 0) ready_.push_back(seq);
    dispatch();
    while (pump(/*block=*/false)) {
    }
    return failure_;
  }

  // Runs the orchestration, then drives every submitted task to completion.
  absl::Status run(const task::TaskArgs& args) {
    absl::Status orch = callable_.orchestration(*this, args);
    if (!orch.ok() && failure_.ok()) {
      failure_ = base::annotate(
          orch, absl::StrCat("run ", ctx_.run_id(), " orchestration of '", callable_.name, "': "));
    }
    while (failure_.ok() && completed_ < next_seq_) {
      dispatch();
      if (!pump(/*block=*/true)) {
        failure_ = absl::InternalError(absl::StrCat(
            "run ", ctx_.run_id(), ": ", next_seq_ - completed_,
            " tasks can never become ready (internal dependency error)"));
      }
    }
    // Drain blocks still on cores so nothing touches run memory after return.
    while (running_ > 0) pump(/*block=*/true);
    report_->tasks_completed = completed_;
    return failure_;
  }

 private:
  TaskSlot& slot(uint64_t seq) { return ring_[seq % ring_.size()]; }
  bool done(uint64_t seq) {
    if (seq < head_seq_) return true;
    TaskSlot& s = slot(seq);
    return s.seq == seq && s.completed;
  }

  absl::Status fail_submit(absl::Status st) {
    if (failure_.ok()) failure_ = base::annotate(st, absl::StrCat("run ", ctx_.run_id(), " "));
    return failure_;
  }

  void dispatch() {
    if (!failure_.ok()) return;
    while (!idle_.empty() && !ready_.empty()) {
      TaskSlot& s = slot(ready_.front());
      const int32_t core = idle_.back();
      idle_.pop_back();
      device::CoreJob job;
      job.fn = callable_.kernels[s.kernel].fn;
      job.args = s.args.data();
      job.num_args = static_cast<uint32_t>(s.args.size());
      job.block_idx = s.blocks_started;
      job.block_dim = s.block_dim;
      job.task_index = static_cast<uint32_t>(s.seq);
      job.tag = s.seq;
      if (s.blocks_started == 0) s.timing.core = core;
      ++s.blocks_started;
      ++running_;
      if (s.blocks_started == s.block_dim) ready_.pop_front();
      ctx_.start(core, job);
    }
  }

  // Handles one completion. Returns false when none was available.
  bool pump(bool block) {
    if (running_ == 0) return false;  // nothing on a core: nothing to wait for
    device::CoreCompletion c;
    if (!ctx_.next_completion(&c, block)) return false;
    --running_;
    idle_.push_back(c.core);
    TaskSlot& s = slot(c.tag);
    if (s.blocks_done == 0 || c.start_ns < s.timing.start_ns) s.timing.start_ns = c.start_ns;
    s.timing.end_ns = std::max(s.timing.end_ns, c.end_ns);
    ++s.blocks_done;
    if (!c.status.ok() && failure_.ok()) {
      failure_ = base::annotate(
          c.status, absl::StrCat("run ", ctx_.run_id(), " task ", s.seq, " (kernel '",
                                 callable_.kernels[s.kernel].name, "') block ", c.block_idx,
                                 ": "));
    }
    if (s.blocks_done == s.block_dim) {
      s.completed = true;
      ++completed_;
      if (record_timing_) report_->tasks.push_back(s.timing);
      if (failure_.ok()) {
        for (uint64_t succ : s.successors) {
          if (--slot(succ).pending == 0) ready_.push_back(succ);
        }
      }
      while (head_seq_ < next_seq_ && slot(head_seq_).completed) ++head_seq_;
    }
    dispatch();
    return true;
  }

  device::ExecContext& ctx_;
  const task::ChipCallable& callable_;
  const ChipOptions& options_;
  bool record_timing_;
  RunReport* report_;
  std::vector<TaskSlot> ring_;
  uint64_t head_seq_ = 0;  // oldest task not retired
  uint64_t next_seq_ = 0;
  uint64_t completed_ = 0;
  int32_t num_cores_ = 0;
  int32_t running_ = 0;
  std::vector<int32_t> idle_;
  std::deque<uint64_t> ready_;
  TensorMap tensor_map_;
  TensorMap::IsDone is_done_;
  std::vector<uint64_t> deps_;
  absl::Status failure_;
};

}  // namespace

absl::Status execute_run(device::ExecContext& ctx, const task::ChipCallable& callable,
                         const task::TaskArgs& args, const ChipOptions& options,
                         int32_t max_cores, bool record_task_timing, RunReport* report) {
  SIMPLER_RETURN_IF_ERROR(options.validate());
  GraphExecutor exec(ctx, callable, options, max_cores, record_task_timing, report);
  return exec.run(args);
}

}  // namespace simpler::chip
