#include "simpler/hierarchy/l3_worker.h"

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <set>
#include <thread>

#include "absl/strings/str_cat.h"
#include "simpler/base/status.h"
#include "simpler/base/sync.h"
#include "simpler/base/thread.h"
#include "simpler/base/work_queue.h"
#include "simpler/chip/tensor_map.h"

namespace simpler::hierarchy {

std::string_view name_of(ChildMode mode) {
  return mode == ChildMode::kThread ? "thread" : "process";
}

absl::StatusOr<ChildMode> parse_child_mode(std::string_view text) {
  if (text == "thread") return ChildMode::kThread;
  if (text == "process") return ChildMode::kProcess;
  return absl::InvalidArgumentError(
      absl::StrCat("child mode '", std::string(text), "': expected thread or process"));
}

absl::Status L3Options::validate() const {
  if (device_ids.empty()) return absl::InvalidArgumentError("L3Options.device_ids is empty");
  std::set<int32_t> seen;
  for (int32_t id : device_ids) {
    if (id < 0) {
      return absl::InvalidArgumentError(absl::StrCat("L3Options.device_ids: negative id ", id));
    }
    if (!seen.insert(id).second) {
      return absl::InvalidArgumentError(absl::StrCat("L3Options.device_ids: id ", id, " repeats"));
    }
  }
  if (sub_threads < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("L3Options.sub_threads ", sub_threads, " is below 1"));
  }
  if (host_heap_bytes == 0) return absl::InvalidArgumentError("L3Options.host_heap_bytes is 0");
  if (launch_depth < 1 || launch_depth > 16) {
    return absl::InvalidArgumentError(
        absl::StrCat("L3Options.launch_depth ", launch_depth, " is outside [1, 16]"));
  }
  if (child.level != 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("L3Options.child.level ", child.level, ": children are level-2 workers"));
  }
  return base::annotate(child.validate(), "L3Options.child: ");
}

absl::StatusOr<task::Tensor> HostBuffer::tensor(std::initializer_list<int64_t> shape,
                                                task::DataType dtype, uint64_t offset) const {
  const std::vector<int64_t> dims(shape);
  SIMPLER_ASSIGN_OR_RETURN(task::Tensor t,
                           task::Tensor::contiguous(address + offset, dims.data(),
                                                    static_cast<int32_t>(dims.size()), dtype));
  if (offset > bytes || t.span_bytes() > bytes - offset) {
    return absl::InvalidArgumentError(absl::StrCat("tensor ", t.debug_string(), " of ",
                                                   t.span_bytes(), " bytes at offset ", offset,
                                                   " exceeds the ", bytes, "-byte host buffer"));
  }
  t.memory = task::MemoryKind::kHost;
  return t;
}

namespace {

constexpr uint64_t kAlign = 64;

// DEVICE ranges of different children live in different address spaces: the
// TensorMap keys them apart (host pointers stay below 2^56).
uint64_t map_key(const task::Tensor& t, int32_t child) {
  if (t.memory == task::MemoryKind::kHost) return t.address;
  return t.address | (static_cast<uint64_t>(child + 1) << 56);
}

}  // namespace

class L3Worker::Impl {
 public:
  explicit Impl(const L3Options& options) : options_(options) {}

  // ---- registration ----
  std::vector<task::ChipCallable> callables;
  std::vector<std::pair<std::string, SubFn>> subs;
  std::vector<L3Program> programs;
  std::vector<std::function<absl::Status(int32_t, worker::Worker&)>> setups;

  absl::Status check_registration(const char* what) const {
    if (started_) return absl::FailedPreconditionError(absl::StrCat(what, " after init()"));
    return absl::OkStatus();
  }

  // ---- lifecycle ----
  absl::Status init() {
    if (started_) return absl::FailedPreconditionError("L3 init() called twice");
    SIMPLER_RETURN_IF_ERROR(options_.validate());
    started_ = true;
    void* heap = mmap(nullptr, options_.host_heap_bytes, PROT_READ | PROT_WRITE,
                      MAP_SHARED | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (heap == MAP_FAILED) {
      return absl::ResourceExhaustedError(absl::StrCat("shared host heap of ",
                                                       options_.host_heap_bytes,
                                                       " bytes: mmap: ", std::strerror(errno)));
    }
    {
      base::MutexLock lock(mu_);
      heap_ = static_cast<uint8_t*>(heap);
      free_[0] = options_.host_heap_bytes;
    }
    // Children first: a process child is forked while this process is still
    // single-threaded (every thread below starts after the forks).
    std::vector<ChildSpec> specs;
    for (size_t i = 0; i < options_.device_ids.size(); ++i) {
      ChildSpec spec;
      spec.index = static_cast<int32_t>(i);
      spec.options = options_.child;
      spec.options.device_id = options_.device_ids[i];
      spec.callables = callables;
      spec.setups = setups;
      spec.host_ranges = {{reinterpret_cast<uintptr_t>(heap_),
                           reinterpret_cast<uintptr_t>(heap_) + options_.host_heap_bytes}};
      specs.push_back(std::move(spec));
    }
    if (options_.child_mode == ChildMode::kProcess) {
      absl::StatusOr<std::vector<std::unique_ptr<Endpoint>>> all = start_process_children(specs);
      if (!all.ok()) return base::annotate(all.status(), "L3 init: ");
      children_ = std::move(*all);
    } else {
      for (const ChildSpec& spec : specs) {
        absl::StatusOr<std::unique_ptr<Endpoint>> e = start_lane_child(spec);
        if (!e.ok()) {
          (void)close_children();
          return base::annotate(e.status(), absl::StrCat("L3 init, child ", spec.index, ": "));
        }
        children_.push_back(std::move(*e));
      }
    }
    for (size_t i = 0; i < children_.size(); ++i) {
      children_[i]->set_on_done([this, i](uint64_t run) {
        base::MutexLock lock(ev_mu_);
        events_.push_back({static_cast<int32_t>(i), run, 0, absl::OkStatus()});
        ev_cv_.notify_all();
      });
    }
    child_queue_.resize(children_.size());
    for (int32_t t = 0; t < options_.sub_threads; ++t) {
      sub_threads_.emplace_back([this] {
        base::set_thread_name("simpler-l3-sub");
        sub_loop();
      });
    }
    scheduler_ = std::thread([this] {
      base::set_thread_name("simpler-l3-sched");
      scheduler_loop();
    });
    base::MutexLock lock(mu_);
    ready_ = true;
    return absl::OkStatus();
  }

  absl::Status close() {
    {
      base::MutexLock lock(mu_);
      if (closed_) return absl::OkStatus();
      closed_ = true;
      closing_ = true;
      cv_.notify_all();
    }
    kick();
    if (scheduler_.joinable()) scheduler_.join();
    sub_jobs_.close();
    for (auto& t : sub_threads_) t.join();
    sub_threads_.clear();
    absl::Status child_error = close_children();
    if (heap_ != nullptr) {
      (void)munmap(heap_, options_.host_heap_bytes);
      heap_ = nullptr;
    }
    base::MutexLock lock(mu_);
    absl::Status undelivered = worker::report_undelivered(&failed_);
    return undelivered.ok() ? child_error : undelivered;
  }

  // ---- host heap ----
  absl::StatusOr<HostBuffer> create_buffer(uint64_t bytes) {
    if (bytes == 0) return absl::InvalidArgumentError("create_buffer: 0 bytes");
    base::MutexLock lock(mu_);
    if (heap_ == nullptr) return absl::FailedPreconditionError("create_buffer before init()");
    const uint64_t size = (bytes + kAlign - 1) / kAlign * kAlign;
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (it->second < size) continue;
      const uint64_t offset = it->first;
      const uint64_t left = it->second - size;
      free_.erase(it);
      if (left > 0) free_[offset + size] = left;
      used_[offset] = size;
      std::memset(heap_ + offset, 0, size);
      return HostBuffer{reinterpret_cast<uintptr_t>(heap_ + offset), bytes};
    }
    return absl::ResourceExhaustedError(absl::StrCat(
        "create_buffer(", bytes, "): no free range that large in the ", options_.host_heap_bytes,
        "-byte shared host heap (L3Options.host_heap_bytes)"));
  }

  absl::Status free_buffer(const HostBuffer& b) {
    base::MutexLock lock(mu_);
    const uint64_t base_addr = reinterpret_cast<uintptr_t>(heap_);
    auto it =
        heap_ == nullptr || b.address < base_addr ? used_.end() : used_.find(b.address - base_addr);
    if (it == used_.end()) {
      return absl::NotFoundError(absl::StrCat("free_buffer: 0x", absl::Hex(b.address),
                                              " is not a buffer of this L3 worker"));
    }
    uint64_t offset = it->first, size = it->second;
    const uint64_t begin = base_addr + offset, end = begin + size;
    for (const auto& [run, ranges] : named_) {
      for (const auto& [named_begin, named_end] : ranges) {
        if (named_begin < end && begin < named_end) {
          return absl::FailedPreconditionError(absl::StrCat(
              "free_buffer: L3 run ", run, " names the buffer at 0x", absl::Hex(b.address), " (",
              b.bytes, " bytes) and has not finalized; wait for it first"));
        }
      }
    }
    used_.erase(it);
    // Coalesce with the free neighbours.
    auto next = free_.lower_bound(offset);
    if (next != free_.end() && next->first == offset + size) {
      size += next->second;
      next = free_.erase(next);
    }
    if (next != free_.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second == offset) {
        prev->second += size;
        return absl::OkStatus();
      }
    }
    free_[offset] = size;
    return absl::OkStatus();
  }

  absl::Status check_child(int32_t child) const {
    if (child < 0 || child >= static_cast<int32_t>(children_.size())) {
      return absl::InvalidArgumentError(
          absl::StrCat("child ", child, " outside [0, ", children_.size(), ") (after init())"));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<worker::DeviceBuffer> child_malloc(int32_t child, uint64_t bytes) {
    SIMPLER_RETURN_IF_ERROR(check_child(child));
    return children_[child]->malloc(bytes);
  }
  absl::Status child_free(int32_t child, const worker::DeviceBuffer& buffer) {
    SIMPLER_RETURN_IF_ERROR(check_child(child));
    return children_[child]->free(buffer);
  }
  absl::Status copy_child(bool to_child, int32_t child, const worker::DeviceBuffer& device,
                          const HostBuffer& host, uint64_t bytes, uint64_t offset) {
    SIMPLER_RETURN_IF_ERROR(check_child(child));
    if (bytes > host.bytes) {
      return absl::InvalidArgumentError(
          absl::StrCat(bytes, " bytes do not fit the ", host.bytes, "-byte host buffer"));
    }
    {
      base::MutexLock lock(mu_);
      if (queued_or_running_ > 0) {
        return absl::FailedPreconditionError(
            "a copy between host and child buffers while L3 runs are queued or executing (they "
            "may use either buffer); wait for them first");
      }
    }
    void* p = reinterpret_cast<void*>(static_cast<uintptr_t>(host.address));
    return to_child ? children_[child]->copy_to(device, p, bytes, offset)
                    : children_[child]->copy_from(p, device, bytes, offset);
  }

  bool in_heap(uint64_t address, uint64_t bytes) const {
    const uint64_t b = reinterpret_cast<uintptr_t>(heap_);
    return heap_ != nullptr && address >= b && bytes <= options_.host_heap_bytes &&
           address - b <= options_.host_heap_bytes - bytes;
  }

  // ---- runs ----
  absl::StatusOr<worker::RunHandle> submit(ProgramHandle program, const task::TaskArgs& args) {
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
    queue_.push_back({program.index, args, shared});
    note_ranges_locked(shared->id.value, args);
    ++queued_or_running_;
    lock.unlock();
    kick();
    return worker::RunHandle(shared);
  }

  uint64_t next_level_dispatched() const { return dispatched_.load(std::memory_order_relaxed); }

  // The host heap ranges `args` name, kept until run `seq` finalizes (free_buffer checks them).
  // DEVICE tensors are a child's memory, not the heap's.
  void note_ranges_locked(uint64_t seq, const task::TaskArgs& args) SIMPLER_REQUIRES(mu_) {
    for (size_t i = 0; i < args.size(); ++i) {
      const task::Arg& a = args[i];
      if (a.direction == task::ArgDirection::kScalar) continue;
      if (a.tensor.memory != task::MemoryKind::kHost) continue;
      const uint64_t bytes = a.tensor.span_bytes();
      if (bytes == 0 || !in_heap(a.tensor.address, bytes)) continue;
      named_[seq].emplace_back(a.tensor.address, a.tensor.address + bytes);
    }
  }

  std::vector<std::string> describe_children() const {
    std::vector<std::string> out;
    for (const auto& c : children_) out.push_back(c->describe());
    return out;
  }

 private:
  struct Queued {
    uint32_t program;
    task::TaskArgs args;
    std::shared_ptr<worker::RunShared> shared;
  };
  // A completion: a child's run (child >= 0, endpoint run id) or a sub-task
  // (child -1, task id, its status).
  struct Event {
    int32_t child;
    uint64_t run;
    uint64_t task;
    absl::Status status;
  };
  struct SubJob {
    uint64_t task;
    uint32_t fn;
    task::TaskArgs args;
  };

  // One task of a run in flight (scheduler thread only).
  struct Task {
    size_t run = 0;      // index into runs_ (RunCtx) at submission: RunCtx::seq
    int32_t child = -1;  // -1: a host sub-task
    uint32_t fn = 0;     // callable or sub index
    uint32_t index = 0;  // the task's index in its run
    task::TaskArgs args;
    task::CallConfig config;
    int32_t waiting = 0;  // unfinished dependencies
    std::vector<uint64_t> dependents;
    bool dispatched = false;
    bool done = false;
    absl::Status status;
    worker::RunHandle handle;
  };
  // One L3 run in flight: orchestrated (or being orchestrated) and not finalized.
  struct RunCtx {
    uint64_t seq = 0;  // the run's id
    Queued queued;
    bool orchestrated = false;
    absl::Status orchestration;
    int64_t unfinished = 0;
    std::vector<uint64_t> tasks;  // task ids in task order
  };

  // The orchestration's view while one run is orchestrated.
  class Exec final : public L3Context {
   public:
    Exec(Impl& impl, RunCtx& run) : impl_(impl), run_(run) {}

    absl::StatusOr<uint32_t> submit_next_level(ChildCallable callable, const task::TaskArgs& args,
                                               int32_t child,
                                               const task::CallConfig& config) override {
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
        if (!impl_.in_heap(a.tensor.address, a.tensor.span_bytes())) {
          return absl::InvalidArgumentError(absl::StrCat(
              "submit_next_level: argument ", i, " ", a.tensor.debug_string(),
              " is not inside the shared host heap: a child sees only create_buffer() memory"));
        }
      }
      return impl_.add_task(run_, child, callable.index, args, config);
    }

    absl::StatusOr<uint32_t> submit_sub(SubHandle fn, const task::TaskArgs& args) override {
      if (fn.index >= impl_.subs.size()) {
        return absl::InvalidArgumentError(
            absl::StrCat("submit_sub: unknown sub handle ", fn.index));
      }
      SIMPLER_RETURN_IF_ERROR(args.validate());
      for (size_t i = 0; i < args.size(); ++i) {
        const task::Arg& a = args[i];
        if (a.direction != task::ArgDirection::kScalar &&
            a.tensor.memory != task::MemoryKind::kHost) {
          return absl::InvalidArgumentError(absl::StrCat("submit_sub: argument ", i,
                                                         " is a DEVICE tensor; a host sub-task "
                                                         "takes HOST tensors and scalars"));
        }
      }
      return impl_.add_task(run_, -1, fn.index, args, {});
    }

    int32_t num_children() const override { return static_cast<int32_t>(impl_.children_.size()); }

   private:
    Impl& impl_;
    RunCtx& run_;
  };

  std::string name_task(const Task& k) const {
    if (k.child < 0) {
      return absl::StrCat("L3 run ", k.run, " task ", k.index, " (host sub '", subs[k.fn].first,
                          "')");
    }
    return absl::StrCat("L3 run ", k.run, " task ", k.index, " (child ", k.child, ", callable '",
                        callables[k.fn].name, "')");
  }

  RunCtx* run_of(uint64_t seq) {
    for (RunCtx& r : inflight_) {
      if (r.seq == seq) return &r;
    }
    return nullptr;
  }

  // Adds a task of `run`: its dependencies come from the TensorMap, which
  // spans every run in flight (a staged run's tasks wait for the earlier run's
  // tasks on the same buffers). Within a run, a task whose input task failed
  // is not run; across runs a failed task only orders (as at L2, a failed
  // run's outputs are undefined and a later run is not failed for them).
  uint32_t add_task(RunCtx& run, int32_t child, uint32_t fn, const task::TaskArgs& args,
                    const task::CallConfig& config) {
    pump(false);  // completions so far: fewer false dependencies
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
    {
      base::MutexLock lock(mu_);
      note_ranges_locked(run.seq, args);
    }
    std::vector<uint64_t> deps;
    const uint64_t seq = run.seq;
    // A failed task of this run stays a dependency (its outputs are unwritten); a finished task
    // of an earlier run, failed or not, is done.
    const auto is_done = [this, seq](uint64_t task) {
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
    for (uint64_t d : deps) {
      const Task& dep = tasks_.at(d);
      if (dep.done) {  // a task of this run that failed before this one was submitted
        finish(id, absl::CancelledError(
                       absl::StrCat("not run: its input task ", dep.index, " failed")));
        if (child >= 0) try_dispatch_child(child);
        return k.index;
      }
    }
    for (uint64_t d : deps) {
      tasks_.at(d).dependents.push_back(id);
      ++k.waiting;
    }
    if (child >= 0) {
      child_queue_[child].push_back(id);
      try_dispatch_child(child);
    } else if (k.waiting == 0) {
      dispatch(id);
    }
    return k.index;
  }

  // Next-level tasks go to a child in submission order across runs (a staged
  // task never overtakes an earlier run's): only the head of the child's
  // queue is dispatched, once its inputs are ready.
  void try_dispatch_child(int32_t child) {
    std::deque<uint64_t>& q = child_queue_[child];
    while (!q.empty()) {
      Task& k = tasks_.at(q.front());
      if (k.done) {  // cancelled before dispatch
        q.pop_front();
        continue;
      }
      if (k.waiting > 0) return;
      const uint64_t id = q.front();
      q.pop_front();
      dispatch(id);
    }
  }

  void dispatch(uint64_t id) {
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
    absl::StatusOr<worker::RunHandle> h = children_[k.child]->submit(req);
    if (!h.ok()) {
      finish(id, h.status());
      return;
    }
    k.handle = *h;
    by_child_run_[{k.child, h->id().value}] = id;
  }

  void on_event(const Event& e) {
    if (e.child < 0) {
      finish(e.task, e.status);
      return;
    }
    auto it = by_child_run_.find({e.child, e.run});
    if (it == by_child_run_.end()) return;  // a task that failed at dispatch
    const uint64_t id = it->second;
    by_child_run_.erase(it);
    finish(id, tasks_.at(id).handle.wait());  // done: returns at once, delivers it
  }

  void finish(uint64_t id, const absl::Status& status) {
    Task& k = tasks_.at(id);
    if (k.done) return;
    k.done = true;
    k.status = status.ok() ? status : base::annotate(status, name_task(k) + ": ");
    if (RunCtx* r = run_of(k.run)) --r->unfinished;
    std::set<int32_t> children;
    for (uint64_t d : k.dependents) {
      Task& dep = tasks_.at(d);
      if (dep.done) continue;
      if (!status.ok() && dep.run == k.run && !dep.dispatched) {
        // Never run on an input its producer (in the same run) failed to write.
        finish(d,
               absl::CancelledError(absl::StrCat("not run: its input task ", k.index, " failed")));
        if (dep.child >= 0) children.insert(dep.child);
        continue;
      }
      if (--dep.waiting == 0 && !dep.dispatched) {
        if (dep.child >= 0) {
          children.insert(dep.child);
        } else {
          dispatch(d);
        }
      }
    }
    for (int32_t c : children) try_dispatch_child(c);
  }

  // Handles completions; `block`: waits until at least one arrived (or a new
  // submission / close wants the scheduler's attention).
  void pump(bool block) {
    std::deque<Event> got;
    {
      base::MutexLock lock(ev_mu_);
      if (block) {
        while (events_.empty() && !kick_) ev_cv_.wait(lock);
      }
      kick_ = false;
      got.swap(events_);
    }
    for (Event& e : got) on_event(e);
  }

  void kick() {
    base::MutexLock lock(ev_mu_);
    kick_ = true;
    ev_cv_.notify_all();
  }

  // Finalizes finished runs from the front, in run order.
  void retire_finished() {
    while (!inflight_.empty()) {
      RunCtx& r = inflight_.front();
      if (!r.orchestrated || r.unfinished > 0) return;
      absl::Status st = r.orchestration;
      worker::RunResult& res = r.queued.shared->result;
      for (uint64_t id : r.tasks) {
        Task& k = tasks_.at(id);
        if (st.ok() && !k.status.ok()) st = k.status;  // the first failed task in task order
        if (k.child >= 0 && k.handle.valid() && k.handle.done()) {
          const worker::RunTiming& t = k.handle.result().timing;
          if (t.device_start_ns != 0) {
            res.report.tasks.push_back(
                {k.index, k.fn, k.child, 1, t.device_start_ns, t.device_end_ns});
          }
        }
      }
      res.id = r.queued.shared->id;
      res.status = st;
      res.terminal_state = st.ok() ? worker::RunState::kCompleted : worker::RunState::kFailed;
      res.report.tasks_submitted = r.tasks.size();
      res.effective_depth = static_cast<int32_t>(inflight_.size());
      for (uint64_t id : r.tasks) tasks_.erase(id);
      std::shared_ptr<worker::RunShared> shared = r.queued.shared;
      inflight_.pop_front();
      if (inflight_.empty()) map_.clear();  // nothing in flight: no range can matter
      base::MutexLock lock(mu_);
      named_.erase(shared->id.value);
      if (!st.ok()) failed_.push_back(shared);
      shared->finalized.signal(st);
      --queued_or_running_;
      cv_.notify_all();
    }
  }

  void scheduler_loop() {
    while (true) {
      retire_finished();
      // Stage: orchestrate the next queued run while fewer than launch_depth
      // runs are in flight; its ready tasks go out behind the runs ahead.
      if (static_cast<int32_t>(inflight_.size()) < options_.launch_depth) {
        std::optional<Queued> next;
        {
          base::MutexLock lock(mu_);
          if (!queue_.empty()) {
            next = std::move(queue_.front());
            queue_.pop_front();
          } else if (closing_ && inflight_.empty()) {
            return;
          }
        }
        if (next.has_value()) {
          inflight_.push_back(RunCtx{});
          RunCtx& r = inflight_.back();
          r.seq = next->shared->id.value;
          r.queued = std::move(*next);
          Exec ex(*this, r);
          try {
            r.orchestration = programs[r.queued.program].orchestration(ex, r.queued.args);
          } catch (...) {
            r.orchestration = base::status_from_current_exception("L3 orchestration");
          }
          if (!r.orchestration.ok()) {
            r.orchestration = base::annotate(r.orchestration,
                                             absl::StrCat("L3 run ", r.seq, " orchestration ('",
                                                          programs[r.queued.program].name, "'): "));
          }
          r.orchestrated = true;
          continue;
        }
      }
      pump(true);
    }
  }

  void sub_loop() {
    while (std::optional<SubJob> next = sub_jobs_.pop()) {
      const SubJob& job = *next;
      absl::Status st;
      try {
        st = subs[job.fn].second(job.args);
      } catch (...) {
        st = base::status_from_current_exception("host sub-task");
      }
      base::MutexLock lock(ev_mu_);
      events_.push_back({-1, 0, job.task, st});
      ev_cv_.notify_all();
    }
  }

  absl::Status close_children() {
    absl::Status first;
    for (auto& c : children_) {
      absl::Status s = c->close();
      if (first.ok() && !s.ok()) first = s;
    }
    children_.clear();
    return first;
  }

  const L3Options options_;
  bool started_ = false;  // init() began: registration is over (caller's thread)
  std::vector<std::unique_ptr<Endpoint>> children_;
  std::thread scheduler_;
  std::vector<std::thread> sub_threads_;

  base::Mutex mu_;
  base::CondVar cv_;
  std::deque<Queued> queue_ SIMPLER_GUARDED_BY(mu_);
  uint64_t next_run_ SIMPLER_GUARDED_BY(mu_) = 0;
  bool ready_ SIMPLER_GUARDED_BY(mu_) = false;
  bool closing_ SIMPLER_GUARDED_BY(mu_) = false;
  bool closed_ SIMPLER_GUARDED_BY(mu_) = false;
  int64_t queued_or_running_ SIMPLER_GUARDED_BY(mu_) = 0;  // submitted, not finalized
  std::atomic<uint64_t> dispatched_{0};
  // Scheduler thread only: runs in flight (orchestrated, not finalized), their
  // tasks by id, the TensorMap over all of them, each child's queue of
  // next-level tasks not yet dispatched, and child run -> task.
  std::deque<RunCtx> inflight_;
  std::map<uint64_t, Task> tasks_;
  uint64_t next_task_ = 0;
  chip::TensorMap map_;
  std::vector<std::deque<uint64_t>> child_queue_;
  std::map<std::pair<int32_t, uint64_t>, uint64_t> by_child_run_;
  std::vector<std::shared_ptr<worker::RunShared>> failed_ SIMPLER_GUARDED_BY(mu_);
  uint8_t* heap_ = nullptr;  // set in init, cleared in close (no run in flight then)
  std::map<uint64_t, uint64_t> free_ SIMPLER_GUARDED_BY(mu_);  // offset -> bytes
  std::map<uint64_t, uint64_t> used_ SIMPLER_GUARDED_BY(mu_);
  // Heap ranges [begin, end) each run that has not finalized names (its args and its tasks').
  std::map<uint64_t, std::vector<std::pair<uint64_t, uint64_t>>> named_ SIMPLER_GUARDED_BY(mu_);

  base::Mutex ev_mu_;  // completions and kicks
  base::CondVar ev_cv_;
  std::deque<Event> events_ SIMPLER_GUARDED_BY(ev_mu_);
  base::WorkQueue<SubJob> sub_jobs_;              // for the sub-task threads
  bool kick_ SIMPLER_GUARDED_BY(ev_mu_) = false;  // a submission or close for the scheduler
};

L3Worker::L3Worker(L3Options options)
    : options_(std::move(options)), impl_(std::make_unique<Impl>(options_)) {}

L3Worker::~L3Worker() { (void)close(); }

absl::StatusOr<ChildCallable> L3Worker::register_callable(task::ChipCallable callable) {
  SIMPLER_RETURN_IF_ERROR(impl_->check_registration("register_callable"));
  SIMPLER_RETURN_IF_ERROR(callable.validate());
  for (const auto& c : impl_->callables) {
    if (c.name == callable.name) {
      return absl::InvalidArgumentError(
          absl::StrCat("a callable named '", callable.name, "' is already registered"));
    }
  }
  impl_->callables.push_back(std::move(callable));
  return ChildCallable{static_cast<uint32_t>(impl_->callables.size() - 1)};
}

absl::StatusOr<SubHandle> L3Worker::register_sub(std::string name, SubFn fn) {
  SIMPLER_RETURN_IF_ERROR(impl_->check_registration("register_sub"));
  if (name.empty() || !fn) {
    return absl::InvalidArgumentError("register_sub: a sub needs a name and a function");
  }
  impl_->subs.emplace_back(std::move(name), std::move(fn));
  return SubHandle{static_cast<uint32_t>(impl_->subs.size() - 1)};
}

absl::StatusOr<ProgramHandle> L3Worker::register_program(L3Program program) {
  SIMPLER_RETURN_IF_ERROR(impl_->check_registration("register_program"));
  if (program.name.empty() || !program.orchestration) {
    return absl::InvalidArgumentError(
        "register_program: an L3 program needs a name and an orchestration");
  }
  impl_->programs.push_back(std::move(program));
  return ProgramHandle{static_cast<uint32_t>(impl_->programs.size() - 1)};
}

absl::Status L3Worker::register_child_setup(
    std::function<absl::Status(int32_t child, worker::Worker& worker)> setup) {
  SIMPLER_RETURN_IF_ERROR(impl_->check_registration("register_child_setup"));
  if (!setup) return absl::InvalidArgumentError("register_child_setup: an empty function");
  impl_->setups.push_back(std::move(setup));
  return absl::OkStatus();
}

absl::Status L3Worker::init() { return impl_->init(); }

absl::StatusOr<HostBuffer> L3Worker::create_buffer(uint64_t bytes) {
  return impl_->create_buffer(bytes);
}

absl::Status L3Worker::free_buffer(const HostBuffer& buffer) { return impl_->free_buffer(buffer); }

absl::StatusOr<worker::RunHandle> L3Worker::submit(ProgramHandle program,
                                                   const task::TaskArgs& args) {
  return impl_->submit(program, args);
}

absl::Status L3Worker::run(ProgramHandle program, const task::TaskArgs& args) {
  SIMPLER_ASSIGN_OR_RETURN(worker::RunHandle h, submit(program, args));
  return h.wait();
}

absl::Status L3Worker::close() { return impl_->close(); }

absl::StatusOr<worker::DeviceBuffer> L3Worker::child_malloc(int32_t child, uint64_t bytes) {
  return impl_->child_malloc(child, bytes);
}

absl::Status L3Worker::child_free(int32_t child, const worker::DeviceBuffer& buffer) {
  return impl_->child_free(child, buffer);
}

absl::Status L3Worker::copy_to_child(int32_t child, const worker::DeviceBuffer& dst,
                                     const HostBuffer& src, uint64_t bytes, uint64_t offset) {
  return impl_->copy_child(true, child, dst, src, bytes, offset);
}

absl::Status L3Worker::copy_from_child(int32_t child, const HostBuffer& dst,
                                       const worker::DeviceBuffer& src, uint64_t bytes,
                                       uint64_t offset) {
  return impl_->copy_child(false, child, src, dst, bytes, offset);
}

uint64_t L3Worker::next_level_dispatched() const { return impl_->next_level_dispatched(); }

std::vector<std::string> L3Worker::describe_children() const { return impl_->describe_children(); }

}  // namespace simpler::hierarchy
