#include "simpler/hierarchy/l3_worker.h"

#include <sys/mman.h>

#include <algorithm>
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
    if (scheduler_.joinable()) scheduler_.join();
    {
      base::MutexLock lock(ev_mu_);
      subs_stop_ = true;
      ev_cv_.notify_all();
    }
    for (auto& t : sub_threads_) t.join();
    sub_threads_.clear();
    absl::Status child_error = close_children();
    if (heap_ != nullptr) {
      (void)munmap(heap_, options_.host_heap_bytes);
      heap_ = nullptr;
    }
    base::MutexLock lock(mu_);
    std::vector<std::shared_ptr<worker::RunShared>> undelivered;
    for (auto& f : failed_) {
      if (!f->delivered.load(std::memory_order_acquire)) undelivered.push_back(f);
    }
    failed_.clear();
    if (undelivered.empty()) return child_error;
    const absl::Status& first = undelivered.front()->result.status;
    std::string msg(first.message());
    if (undelivered.size() > 1) {
      absl::StrAppend(&msg, " (and ", undelivered.size() - 1, " more undelivered run error",
                      undelivered.size() > 2 ? "s" : "", ")");
    }
    for (auto& u : undelivered) u->delivered.store(true, std::memory_order_release);
    return absl::Status(first.code(), msg);
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
    if (!queue_.empty() || executing_) {
      return absl::FailedPreconditionError(
          "free_buffer while L3 runs are queued or executing (they may name the buffer); "
          "wait for them first");
    }
    uint64_t offset = it->first, size = it->second;
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
    queue_.push_back({program.index, args, shared});
    cv_.notify_all();
    return worker::RunHandle(shared);
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
  // (child -1, task index, its status).
  struct Event {
    int32_t child;
    uint64_t run;
    uint32_t task;
    absl::Status status;
  };
  struct SubJob {
    uint32_t task;
    uint32_t fn;
    task::TaskArgs args;
  };

  // One L3 run's task graph while it executes (scheduler thread only).
  struct Task {
    int32_t child = -1;  // -1: a host sub-task
    uint32_t fn = 0;     // callable or sub index
    task::TaskArgs args;
    task::CallConfig config;
    int32_t waiting = 0;  // unfinished dependencies
    std::vector<uint32_t> dependents;
    bool dispatched = false;
    bool done = false;
    absl::Status status;
    worker::RunHandle handle;
  };

  class Exec final : public L3Context {
   public:
    Exec(Impl& impl, uint64_t run_id) : impl_(impl), run_id_(run_id) {}

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
        if (a.tensor.memory != task::MemoryKind::kHost) {
          return absl::InvalidArgumentError(absl::StrCat(
              "submit_next_level: argument ", i,
              " is a DEVICE tensor; next-level tasks take HOST tensors in create_buffer() "
              "buffers (child device buffers are not exposed yet)"));
        }
        if (!impl_.in_heap(a.tensor.address, a.tensor.span_bytes())) {
          return absl::InvalidArgumentError(absl::StrCat(
              "submit_next_level: argument ", i, " ", a.tensor.debug_string(),
              " is not inside the shared host heap: a child sees only create_buffer() memory"));
        }
      }
      return add(child, callable.index, args, config);
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
      return add(-1, fn.index, args, {});
    }

    int32_t num_children() const override { return static_cast<int32_t>(impl_.children_.size()); }

    // Handles completions until every dispatched task finished; `block`
    // false: only those already in.
    void pump(bool block) {
      while (true) {
        std::deque<Event> got;
        {
          base::MutexLock lock(impl_.ev_mu_);
          if (block) {
            while (impl_.events_.empty() && unfinished_ > 0) impl_.ev_cv_.wait(lock);
          }
          got.swap(impl_.events_);
        }
        for (Event& e : got) on_event(e);
        if (!block || unfinished_ == 0) return;
      }
    }

    // The run's status: the first failed task in task order, else OK.
    absl::Status status() const {
      for (size_t i = 0; i < tasks_.size(); ++i) {
        if (!tasks_[i].status.ok()) return tasks_[i].status;
      }
      return absl::OkStatus();
    }
    size_t task_count() const { return tasks_.size(); }

   private:
    std::string name_task(uint32_t t) const {
      const Task& k = tasks_[t];
      if (k.child < 0) {
        return absl::StrCat("L3 run ", run_id_, " task ", t, " (host sub '", impl_.subs[k.fn].first,
                            "')");
      }
      return absl::StrCat("L3 run ", run_id_, " task ", t, " (child ", k.child, ", callable '",
                          impl_.callables[k.fn].name, "')");
    }

    absl::StatusOr<uint32_t> add(int32_t child, uint32_t fn, const task::TaskArgs& args,
                                 const task::CallConfig& config) {
      pump(false);  // completions so far: fewer false dependencies
      const uint32_t t = static_cast<uint32_t>(tasks_.size());
      tasks_.push_back(Task{});
      Task& k = tasks_.back();
      k.child = child;
      k.fn = fn;
      k.args = args;
      k.config = config;
      std::vector<uint64_t> deps;
      // A failed task stays a dependency (its outputs are unwritten): only
      // tasks that finished well count as done for the TensorMap.
      const auto is_done = [this](uint64_t task) {
        return tasks_[task].done && tasks_[task].status.ok();
      };
      for (size_t i = 0; i < args.size(); ++i) {
        const task::Arg& a = args[i];
        if (a.direction == task::ArgDirection::kScalar) continue;
        const uint64_t bytes = a.tensor.span_bytes();
        if (bytes == 0) continue;
        const uint64_t begin = map_key(a.tensor, child);
        if (a.direction != task::ArgDirection::kOut) {
          map_.access(begin, begin + bytes, false, t, is_done, &deps);
        }
        if (a.direction != task::ArgDirection::kIn) {
          map_.access(begin, begin + bytes, true, t, is_done, &deps);
        }
      }
      std::sort(deps.begin(), deps.end());
      deps.erase(std::unique(deps.begin(), deps.end()), deps.end());
      ++unfinished_;
      for (uint64_t d : deps) {
        if (tasks_[d].done) {  // failed before this task was submitted
          finish(t, absl::CancelledError(absl::StrCat("not run: its input task ", d, " failed")));
          return t;
        }
      }
      for (uint64_t d : deps) {
        tasks_[d].dependents.push_back(t);
        ++tasks_[t].waiting;
      }
      if (tasks_[t].waiting == 0) dispatch(t);
      return t;
    }

    void dispatch(uint32_t t) {
      Task& k = tasks_[t];
      k.dispatched = true;
      if (k.child < 0) {
        base::MutexLock lock(impl_.ev_mu_);
        impl_.sub_jobs_.push_back({t, k.fn, k.args});
        impl_.ev_cv_.notify_all();
        return;
      }
      RunRequest req;
      req.callable = impl_.callables[k.fn].name;
      req.args = k.args;
      req.config = k.config;
      absl::StatusOr<worker::RunHandle> h = impl_.children_[k.child]->submit(req);
      if (!h.ok()) {
        finish(t, h.status());
        return;
      }
      k.handle = *h;
      by_child_run_[{k.child, h->id().value}] = t;
    }

    void on_event(const Event& e) {
      if (e.child < 0) {
        finish(e.task, e.status);
        return;
      }
      auto it = by_child_run_.find({e.child, e.run});
      if (it == by_child_run_.end()) return;  // not this run's (cannot happen: runs are serial)
      const uint32_t t = it->second;
      by_child_run_.erase(it);
      finish(t, tasks_[t].handle.wait());  // done: returns at once, delivers it
    }

    void finish(uint32_t t, const absl::Status& status) {
      Task& k = tasks_[t];
      if (k.done) return;
      k.done = true;
      k.status = status.ok() ? status : base::annotate(status, name_task(t) + ": ");
      --unfinished_;
      for (uint32_t d : k.dependents) {
        Task& dep = tasks_[d];
        if (dep.done) continue;
        if (!status.ok()) {
          // Never run on an input its producer failed to write.
          if (!dep.dispatched) {
            finish(d, absl::CancelledError(absl::StrCat("not run: its input task ", t, " failed")));
          }
          continue;
        }
        if (--dep.waiting == 0 && !dep.dispatched) dispatch(d);
      }
    }

    Impl& impl_;
    const uint64_t run_id_;
    std::vector<Task> tasks_;
    chip::TensorMap map_;
    int64_t unfinished_ = 0;
    std::map<std::pair<int32_t, uint64_t>, uint32_t> by_child_run_;
  };

  void scheduler_loop() {
    while (true) {
      Queued q;
      {
        base::MutexLock lock(mu_);
        while (queue_.empty() && !closing_) cv_.wait(lock);
        if (queue_.empty()) return;
        q = std::move(queue_.front());
        queue_.pop_front();
        executing_ = true;
      }
      Exec ex(*this, q.shared->id.value);
      absl::Status orchestrated;
      try {
        orchestrated = programs[q.program].orchestration(ex, q.args);
      } catch (...) {
        orchestrated = base::status_from_current_exception("L3 orchestration");
      }
      ex.pump(true);  // every task dispatched finishes, whatever the orchestration returned
      absl::Status st = ex.status();
      if (!orchestrated.ok()) {
        st = base::annotate(orchestrated,
                            absl::StrCat("L3 run ", q.shared->id.value, " orchestration ('",
                                         programs[q.program].name, "'): "));
      }
      worker::RunResult& res = q.shared->result;
      res.id = q.shared->id;
      res.status = st;
      res.terminal_state = st.ok() ? worker::RunState::kCompleted : worker::RunState::kFailed;
      res.report.tasks_submitted = ex.task_count();
      base::MutexLock lock(mu_);
      executing_ = false;
      if (!st.ok()) failed_.push_back(q.shared);
      q.shared->finalized.signal(st);
      cv_.notify_all();
    }
  }

  void sub_loop() {
    while (true) {
      SubJob job;
      {
        base::MutexLock lock(ev_mu_);
        while (sub_jobs_.empty() && !subs_stop_) ev_cv_.wait(lock);
        if (sub_jobs_.empty()) return;
        job = std::move(sub_jobs_.front());
        sub_jobs_.pop_front();
      }
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
  bool executing_ SIMPLER_GUARDED_BY(mu_) = false;
  std::vector<std::shared_ptr<worker::RunShared>> failed_ SIMPLER_GUARDED_BY(mu_);
  uint8_t* heap_ = nullptr;  // set in init, cleared in close (no run in flight then)
  std::map<uint64_t, uint64_t> free_ SIMPLER_GUARDED_BY(mu_);  // offset -> bytes
  std::map<uint64_t, uint64_t> used_ SIMPLER_GUARDED_BY(mu_);

  base::Mutex ev_mu_;  // completions and sub-task jobs
  base::CondVar ev_cv_;
  std::deque<Event> events_ SIMPLER_GUARDED_BY(ev_mu_);
  std::deque<SubJob> sub_jobs_ SIMPLER_GUARDED_BY(ev_mu_);
  bool subs_stop_ SIMPLER_GUARDED_BY(ev_mu_) = false;
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

std::vector<std::string> L3Worker::describe_children() const { return impl_->describe_children(); }

}  // namespace simpler::hierarchy
