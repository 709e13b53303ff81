// L3Worker::Impl's scheduler: submit, orchestration through L3Context (Exec), the TensorMap
// dependencies between tasks of the runs in flight, dispatch to children in submission order
// and to the sub-task pool, completion, and retirement in run order. Everything here runs with
// mu_ held, on whichever thread brought the news (l3_worker_impl.h).
#include <algorithm>
#include <optional>
#include <set>

#include "absl/strings/str_cat.h"
#include "hierarchy/l3_worker_impl.h"
#include "simpler/base/status.h"

namespace simpler::hierarchy {

namespace {

// DEVICE ranges of different children live in different address spaces: the
// TensorMap keys them apart (host pointers stay below 2^56).
uint64_t map_key(const task::Tensor& t, int32_t child) {
  if (t.memory == task::MemoryKind::kHost) return t.address;
  return t.address | (static_cast<uint64_t>(child + 1) << 56);
}

}  // namespace

// ---- Exec: the orchestration's L3Context ----

absl::StatusOr<uint32_t> L3Worker::Impl::Exec::submit_next_level(ChildCallable callable,
                                                                 const task::TaskArgs& args,
                                                                 int32_t child,
                                                                 const task::CallConfig& config) {
  SIMPLER_RETURN_IF_ERROR(check_context());
  impl_.mu_.assert_held();
  if (callable.index >= impl_.callables.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("submit_next_level: unknown callable handle ", callable.index));
  }
  if (child < 0 || child >= num_children()) {
    return absl::InvalidArgumentError(
        absl::StrCat("submit_next_level: child ", child, " outside [0, ", num_children(), ")"));
  }
  SIMPLER_RETURN_IF_ERROR(args.validate());
  SIMPLER_RETURN_IF_ERROR(config.validate());
  for (size_t i = 0; i < args.size(); ++i) {
    const task::Arg& a = args[i];
    if (a.direction == task::ArgDirection::kScalar || a.tensor.span_bytes() == 0) continue;
    if (a.tensor.memory != task::MemoryKind::kHost) continue;  // the child's device memory
    if (!impl_.in_heap_locked(a.tensor.address, a.tensor.span_bytes())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "submit_next_level: argument ", i, " ", a.tensor.debug_string(),
          " is not inside the shared host heap: a child sees only create_buffer() memory"));
    }
  }
  return impl_.add_task_locked(run_, child, callable.index, args, config);
}

absl::StatusOr<uint32_t> L3Worker::Impl::Exec::submit_sub(SubHandle fn,
                                                          const task::TaskArgs& args) {
  SIMPLER_RETURN_IF_ERROR(check_context());
  impl_.mu_.assert_held();
  if (fn.index >= impl_.subs.size()) {
    return absl::InvalidArgumentError(absl::StrCat("submit_sub: unknown sub handle ", fn.index));
  }
  SIMPLER_RETURN_IF_ERROR(args.validate());
  for (size_t i = 0; i < args.size(); ++i) {
    const task::Arg& a = args[i];
    if (a.direction != task::ArgDirection::kScalar && a.tensor.memory != task::MemoryKind::kHost) {
      return absl::InvalidArgumentError(absl::StrCat("submit_sub: argument ", i,
                                                     " is a DEVICE tensor; a host sub-task "
                                                     "takes HOST tensors and scalars"));
    }
  }
  return impl_.add_task_locked(run_, -1, fn.index, args, {});
}

// The context is valid only during its orchestration call, on that call's thread.
absl::Status L3Worker::Impl::Exec::check_context() const {
  if (t_orchestrating != &impl_) {
    return absl::FailedPreconditionError(
        "an L3Context used outside its orchestration call (or from another thread)");
  }
  return absl::OkStatus();
}

// ---- runs ----

absl::StatusOr<worker::RunHandle> L3Worker::Impl::submit(ProgramHandle program,
                                                         const task::TaskArgs& args) {
  SIMPLER_RETURN_IF_ERROR(check_not_orchestrating("L3Worker::submit"));
  if (program.index >= programs.size()) {
    return absl::InvalidArgumentError(absl::StrCat("unknown L3 program handle ", program.index,
                                                   " (", programs.size(), " registered)"));
  }
  SIMPLER_RETURN_IF_ERROR(args.validate());
  base::MutexLock lock(mu_);
  if (!ready_) return absl::FailedPreconditionError("L3 submit before init()");
  if (closing_) return absl::FailedPreconditionError("L3 submit after close()");
  auto shared = std::make_shared<worker::RunShared>();
  shared->id = base::RunId{next_run_++};
  shared->result.requested_depth = options_.launch_depth;
  shared->progress = progress_[program.index];
  queue_.push_back({program.index, args, shared});
  note_ranges_locked(shared->id.value, args);
  ++queued_or_running_;
  advance_locked();  // on this thread: orchestrated and dispatched now when the depth allows
  return worker::RunHandle(shared);
}

// The host heap ranges `args` name, kept until run `seq` finalizes (free_buffer checks them).
// DEVICE tensors are a child's memory, not the heap's.
void L3Worker::Impl::note_ranges_locked(uint64_t seq, const task::TaskArgs& args) {
  for (size_t i = 0; i < args.size(); ++i) {
    const task::Arg& a = args[i];
    if (a.direction == task::ArgDirection::kScalar) continue;
    if (a.tensor.memory != task::MemoryKind::kHost) continue;
    const uint64_t bytes = a.tensor.span_bytes();
    if (bytes == 0 || !in_heap_locked(a.tensor.address, bytes)) continue;
    named_[seq].emplace_back(a.tensor.address, a.tensor.address + bytes);
  }
}

std::string L3Worker::Impl::name_task(const Task& k) const {
  if (k.child < 0) {
    return absl::StrCat("L3 run ", k.run, " task ", k.index, " (host sub '", subs[k.fn].first,
                        "')");
  }
  return absl::StrCat("L3 run ", k.run, " task ", k.index, " (child ", k.child, ", callable '",
                      callables[k.fn].name, "')");
}

L3Worker::Impl::RunCtx* L3Worker::Impl::run_of_locked(uint64_t seq) {
  for (RunCtx& r : inflight_) {
    if (r.seq == seq) return &r;
  }
  return nullptr;
}

std::vector<uint64_t> L3Worker::Impl::dependencies_locked(uint64_t id, uint64_t seq, int32_t child,
                                                          const task::TaskArgs& args) {
  std::vector<uint64_t> deps;
  // A failed task of this run stays a dependency (its outputs are unwritten); a finished task
  // of an earlier run, failed or not, is done.
  // Called by map_.access below, on this thread, with mu_ held (the analysis cannot see
  // through the callback).
  const auto is_done = [this, seq](uint64_t task) SIMPLER_NO_THREAD_SAFETY_ANALYSIS {
    auto it = tasks_.find(task);
    if (it == tasks_.end()) return true;  // retired with its run
    return it->second.done && (it->second.status.ok() || it->second.run != seq);
  };
  for (size_t i = 0; i < args.size(); ++i) {
    const task::Arg& a = args[i];
    if (a.direction == task::ArgDirection::kScalar) continue;
    const uint64_t bytes = a.tensor.span_bytes();
    if (bytes == 0) continue;
    const uint64_t begin = map_key(a.tensor, child);
    if (a.direction != task::ArgDirection::kOut) {
      map_.access(begin, begin + bytes, false, id, is_done, &deps);
    }
    if (a.direction != task::ArgDirection::kIn) {
      map_.access(begin, begin + bytes, true, id, is_done, &deps);
    }
  }
  std::sort(deps.begin(), deps.end());
  deps.erase(std::unique(deps.begin(), deps.end()), deps.end());
  return deps;
}

// Adds a task of `run`: its dependencies come from the TensorMap, which
// spans every run in flight (a staged run's tasks wait for the earlier run's
// tasks on the same buffers). Within a run, a task whose input task failed
// is not run; across runs a failed task only orders (as at L2, a failed
// run's outputs are undefined and a later run is not failed for them).
uint32_t L3Worker::Impl::add_task_locked(RunCtx& run, int32_t child, uint32_t fn,
                                         const task::TaskArgs& args,
                                         const task::CallConfig& config) {
  const uint64_t id = next_task_++;
  Task& k = tasks_[id];
  k.run = run.seq;
  k.child = child;
  k.fn = fn;
  k.index = static_cast<uint32_t>(run.tasks.size());
  k.args = args;
  k.config = config;
  run.tasks.push_back(id);
  ++run.unfinished;
  note_ranges_locked(run.seq, args);
  const std::vector<uint64_t> deps = dependencies_locked(id, run.seq, child, args);
  for (uint64_t d : deps) {
    const Task& dep = tasks_.at(d);
    if (dep.done) {  // a task of this run that failed before this one was submitted
      finish_locked(
          id, absl::CancelledError(absl::StrCat("not run: its input task ", dep.index, " failed")));
      if (child >= 0) try_dispatch_child_locked(child);
      return k.index;
    }
  }
  for (uint64_t d : deps) {
    tasks_.at(d).dependents.push_back(id);
    ++k.waiting;
  }
  if (child >= 0) {
    child_queue_[child].push_back(id);
    try_dispatch_child_locked(child);
  } else if (k.waiting == 0) {
    dispatch_locked(id);
  }
  return k.index;
}

// Next-level tasks go to a child in submission order across runs (a staged
// task never overtakes an earlier run's): only the head of the child's
// queue is dispatched, once its inputs are ready and the child's transport
// has room. A full transport is backpressure: the head waits for the child's
// next completion (there is one: the transport is full of this worker's runs),
// so no thread ever blocks in a dispatch.
void L3Worker::Impl::try_dispatch_child_locked(int32_t child) {
  std::deque<uint64_t>& q = child_queue_[child];
  while (!q.empty()) {
    Task& k = tasks_.at(q.front());
    if (k.done) {  // cancelled before dispatch
      q.pop_front();
      continue;
    }
    if (k.waiting > 0) return;
    if (child_in_flight_[child] > 0 && !endpoint(child).can_dispatch()) return;
    const uint64_t id = q.front();
    q.pop_front();
    dispatch_locked(id);
  }
}

void L3Worker::Impl::dispatch_locked(uint64_t id) {
  Task& k = tasks_.at(id);
  k.dispatched = true;
  if (k.child < 0) {
    (void)sub_jobs_.push({id, k.fn, k.args});
    return;
  }
  dispatched_.fetch_add(1, std::memory_order_relaxed);
  RunRequest req;
  req.callable = callables[k.fn].name;
  req.args = k.args;
  req.config = k.config;
  absl::StatusOr<worker::RunHandle> h = endpoint(k.child).submit(req);
  if (!h.ok()) {
    finish_locked(id, h.status());
    return;
  }
  k.handle = *h;
  ++child_in_flight_[k.child];
  by_child_run_[{k.child, h->id().value}] = id;
}

void L3Worker::Impl::on_child_done_locked(int32_t child, uint64_t run) {
  auto it = by_child_run_.find({child, run});
  if (it == by_child_run_.end()) return;  // a task that failed at dispatch
  const uint64_t id = it->second;
  by_child_run_.erase(it);
  --child_in_flight_[child];
  finish_locked(id, tasks_.at(id).handle.wait());  // done: returns at once, delivers it
  try_dispatch_child_locked(child);                // its transport has room again
}

void L3Worker::Impl::finish_locked(uint64_t id, const absl::Status& status) {
  Task& k = tasks_.at(id);
  if (k.done) return;
  k.done = true;
  k.status = status.ok() ? status : base::annotate(status, name_task(k) + ": ");
  if (RunCtx* r = run_of_locked(k.run)) --r->unfinished;
  std::set<int32_t> children;
  for (uint64_t d : k.dependents) {
    Task& dep = tasks_.at(d);
    if (dep.done) continue;
    if (!status.ok() && dep.run == k.run && !dep.dispatched) {
      // Never run on an input its producer (in the same run) failed to write.
      finish_locked(
          d, absl::CancelledError(absl::StrCat("not run: its input task ", k.index, " failed")));
      if (dep.child >= 0) children.insert(dep.child);
      continue;
    }
    if (--dep.waiting == 0 && !dep.dispatched) {
      if (dep.child >= 0) {
        children.insert(dep.child);
      } else {
        dispatch_locked(d);
      }
    }
  }
  for (int32_t c : children) try_dispatch_child_locked(c);
}

// Retires finished runs in run order, then orchestrates queued runs while fewer than
// launch_depth are in flight (their ready next-level tasks go out behind the runs ahead).
void L3Worker::Impl::advance_locked() {
  while (true) {
    retire_finished_locked();
    if (static_cast<int32_t>(inflight_.size()) >= options_.launch_depth || queue_.empty()) {
      break;
    }
    inflight_.push_back(RunCtx{});
    RunCtx& r = inflight_.back();
    r.seq = queue_.front().shared->id.value;
    r.queued = std::move(queue_.front());
    queue_.pop_front();
    orchestrate_locked(r);
  }
  if (queue_.empty() && inflight_.empty()) cv_.notify_all();  // close() waits for this
}

void L3Worker::Impl::orchestrate_locked(RunCtx& r) {
  Exec ex(*this, r);
  const void* outer = t_orchestrating;
  t_orchestrating = this;
  try {
    r.orchestration = programs[r.queued.program].orchestration(ex, r.queued.args);
  } catch (...) {
    r.orchestration = base::status_from_current_exception("L3 orchestration");
  }
  t_orchestrating = outer;
  if (!r.orchestration.ok()) {
    r.orchestration =
        base::annotate(r.orchestration, absl::StrCat("L3 run ", r.seq, " orchestration ('",
                                                     programs[r.queued.program].name, "'): "));
  }
  r.orchestrated = true;
}

// Finalizes finished runs from the front, in run order.
void L3Worker::Impl::retire_finished_locked() {
  while (!inflight_.empty()) {
    RunCtx& r = inflight_.front();
    if (!r.orchestrated || r.unfinished > 0) return;
    const absl::Status st = finalize_result_locked(r);
    for (uint64_t id : r.tasks) tasks_.erase(id);
    std::shared_ptr<worker::RunShared> shared = r.queued.shared;
    inflight_.pop_front();
    if (inflight_.empty()) map_.clear();  // nothing in flight: no range can matter
    named_.erase(shared->id.value);
    if (!st.ok()) failed_.push_back(shared);
    --queued_or_running_;
    shared->finalized.signal(st);
  }
}

absl::Status L3Worker::Impl::finalize_result_locked(RunCtx& r) {
  absl::Status st = r.orchestration;
  worker::RunResult& res = r.queued.shared->result;
  for (uint64_t id : r.tasks) {
    Task& k = tasks_.at(id);
    if (st.ok() && !k.status.ok()) st = k.status;  // the first failed task in task order
    if (k.child >= 0 && k.handle.valid() && k.handle.done()) {
      const worker::RunTiming& t = k.handle.result().timing;
      if (t.device_start_ns != 0) {
        res.report.tasks.push_back({k.index, k.fn, k.child, 1, t.device_start_ns, t.device_end_ns});
        res.report.blocks.push_back(
            {k.index, k.fn, 0, 1, k.child, t.device_start_ns, t.device_end_ns});
      }
    }
  }
  res.id = r.queued.shared->id;
  res.status = st;
  res.terminal_state = st.ok() ? worker::RunState::kCompleted : worker::RunState::kFailed;
  res.report.tasks_submitted = r.tasks.size();
  res.effective_depth = static_cast<int32_t>(inflight_.size());
  return st;
}

void L3Worker::Impl::sub_loop() {
  while (std::optional<SubJob> next = sub_jobs_.pop()) {
    const SubJob& job = *next;
    absl::Status st;
    try {
      st = subs[job.fn].second(job.args);
    } catch (...) {
      st = base::status_from_current_exception("host sub-task");
    }
    base::MutexLock lock(mu_);
    finish_locked(job.task, st);
    advance_locked();
  }
}

}  // namespace simpler::hierarchy
