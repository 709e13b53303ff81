#include "simpler/hierarchy/l3_worker.h"

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <map>
#include <set>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "simpler/base/poll.h"
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

// The scheduler is a monitor, not a thread: whoever brings news — the caller's submit(), an
// endpoint's completion, a sub-task's end — takes mu_ and advances the runs itself (retires the
// finished ones, orchestrates queued runs while the launch depth allows, dispatches ready
// tasks). No hand-off to a scheduler thread sits on a run's path.
//
// Which Impl this thread is orchestrating for (an orchestration runs with mu_ held): L3Context
// calls are checked against it, and this worker's own API refuses to be called from inside.
static thread_local const void* t_orchestrating = nullptr;

namespace {

// What a thread waiting on an L3 run does between looks (RunShared::progress): collects the
// children's finished tasks itself (Endpoint::poll), so a run's end reaches its waiter without
// two thread hand-offs (child endpoint thread -> scheduler -> waiter) — on a machine with few
// CPUs each one is a sleeping thread's wake-up (docs/benchmarks.md, issue 14). Shared with the
// runs' handles, which may outlive the worker: close() detaches the endpoints first, waiting
// for a poll in progress. While any waiter's poll window is open the endpoints' own threads
// are not woken for finished runs (Endpoint::set_waiter_polling): a sleeping collector woken
// for a run its waiter is about to collect anyway costs the child a system call and puts a
// third runnable thread on a machine with few CPUs (docs/benchmarks.md, issue 14). Thread-safe.
class ChildPoller {
 public:
  explicit ChildPoller(std::vector<Endpoint*> endpoints) : endpoints_(std::move(endpoints)) {}

  void poll() {
    // Never from inside an orchestration (it holds the scheduler's lock that a completion
    // takes); and one poller at a time is enough.
    if (t_orchestrating != nullptr || !mu_.try_lock()) return;
    base::MutexLock lock(mu_, std::adopt_lock);
    for (Endpoint* e : endpoints_) e->poll();
  }

  // A waiter's poll window opens / closes (windows of several waiters overlap; the endpoints
  // hear of the first opening and the last closing, which collects once per endpoint).
  void begin_window() {
    if (t_orchestrating != nullptr) return;  // such a waiter polls nothing
    base::MutexLock lock(mu_);
    if (windows_++ == 0) {
      for (Endpoint* e : endpoints_) e->set_waiter_polling(true);
    }
  }
  void end_window() {
    if (t_orchestrating != nullptr) return;
    base::MutexLock lock(mu_);
    if (windows_ == 0) return;  // detached while the window was open
    if (--windows_ == 0) stop_polling(endpoints_);
  }

  void detach() {
    base::MutexLock lock(mu_);
    // The endpoints' threads collect again (and wait for close()'s drain) from here on.
    const int32_t open = std::exchange(windows_, 0);
    std::vector<Endpoint*> endpoints = std::exchange(endpoints_, {});
    if (open > 0) stop_polling(endpoints);
  }

 private:
  // Clears every endpoint's flag even when a collection it runs throws (the first exception is
  // rethrown after): a flag left set would leave that endpoint's thread unwoken.
  static void stop_polling(const std::vector<Endpoint*>& endpoints) {
    std::exception_ptr first;
    for (Endpoint* e : endpoints) {
      try {
        e->set_waiter_polling(false);
      } catch (...) {
        if (!first) first = std::current_exception();
      }
    }
    if (first) std::rethrow_exception(first);
  }

  base::Mutex mu_;
  std::vector<Endpoint*> endpoints_ SIMPLER_GUARDED_BY(mu_);
  int32_t windows_ SIMPLER_GUARDED_BY(mu_) = 0;  // poll windows open now
};

// How long a waiter on an L3 run polls the children before sleeping (ns).
constexpr int64_t kWaitPollNs = 50'000;

// The RunProgress of one program's runs: polls the children while that pays off for this
// program (base::AdaptivePoll: a program whose runs outlast the window has its waiters sleep at
// once, woken by the child endpoint's thread — a poller left runnable next to a computing device
// thread would wait out that thread's time slice).
class ProgramProgress final : public worker::RunProgress {
 public:
  explicit ProgramProgress(std::shared_ptr<ChildPoller> children)
      : children_(std::move(children)) {}
  void poll() override { children_->poll(); }
  void begin_window() override { children_->begin_window(); }
  void end_window() override { children_->end_window(); }
  int64_t poll_window_ns() override { return adaptive_.window_ns(); }
  void polled(bool finished) override { adaptive_.polled(finished); }

 private:
  const std::shared_ptr<ChildPoller> children_;
  base::AdaptivePoll adaptive_{kWaitPollNs};
};

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

  // FAILED_PRECONDITION when called from one of this worker's orchestrations (it holds mu_).
  absl::Status check_not_orchestrating(const char* what) const {
    if (t_orchestrating == this) {
      return absl::FailedPreconditionError(
          absl::StrCat(what,
                       " called from an L3 orchestration of the same worker; an "
                       "orchestration submits tasks through its L3Context only"));
    }
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
      spec.host_ranges = {{reinterpret_cast<uintptr_t>(heap),
                           reinterpret_cast<uintptr_t>(heap) + options_.host_heap_bytes}};
      specs.push_back(std::move(spec));
    }
    std::vector<std::unique_ptr<Endpoint>> children;
    if (options_.child_mode == ChildMode::kProcess) {
      absl::StatusOr<std::vector<std::unique_ptr<Endpoint>>> all = start_process_children(specs);
      if (!all.ok()) return base::annotate(all.status(), "L3 init: ");
      children = std::move(*all);
    } else {
      for (const ChildSpec& spec : specs) {
        absl::StatusOr<std::unique_ptr<Endpoint>> e = start_lane_child(spec);
        if (!e.ok()) {
          for (auto& c : children) (void)c->close();
          return base::annotate(e.status(), absl::StrCat("L3 init, child ", spec.index, ": "));
        }
        children.push_back(std::move(*e));
      }
    }
    {
      base::MutexLock lock(mu_);
      children_ = std::move(children);
      child_queue_.resize(children_.size());
      child_in_flight_.assign(children_.size(), 0);
      initialized_.store(true, std::memory_order_release);
    }
    // children_ is fixed from here until close(): read without the lock by the methods
    // that only call into an endpoint.
    {
      std::vector<Endpoint*> endpoints;
      for (size_t i = 0; i < options_.device_ids.size(); ++i) {
        endpoints.push_back(&endpoint(static_cast<int32_t>(i)));
      }
      auto poller = std::make_shared<ChildPoller>(std::move(endpoints));
      std::vector<std::shared_ptr<ProgramProgress>> progress;
      for (size_t p = 0; p < programs.size(); ++p) {
        progress.push_back(std::make_shared<ProgramProgress>(poller));
      }
      base::MutexLock lock(mu_);
      poller_ = std::move(poller);
      progress_ = std::move(progress);
    }
    for (size_t i = 0; i < options_.device_ids.size(); ++i) {
      endpoint(static_cast<int32_t>(i)).set_on_done([this, i](uint64_t run) {
        base::MutexLock lock(mu_);
        on_child_done_locked(static_cast<int32_t>(i), run);
        advance_locked();
      });
    }
    for (int32_t t = 0; t < options_.sub_threads; ++t) {
      sub_threads_.emplace_back([this] {
        base::set_thread_name("simpler-l3-sub");
        sub_loop();
      });
    }
    base::MutexLock lock(mu_);
    ready_ = true;
    return absl::OkStatus();
  }

  absl::Status close() {
    SIMPLER_RETURN_IF_ERROR(check_not_orchestrating("L3Worker::close"));
    {
      base::MutexLock lock(mu_);
      if (closed_) {
        // Idempotent: a second close() returns once the first one finished.
        while (!close_done_) cv_.wait(lock);
        return absl::OkStatus();
      }
      closed_ = true;
      closing_ = true;
      // Queued runs are orchestrated and every run finishes: the events that move them come
      // from the children and the sub-task threads, which are still running.
      while (!queue_.empty() || !inflight_.empty()) cv_.wait(lock);
    }
    sub_jobs_.close();
    for (auto& t : sub_threads_) t.join();
    sub_threads_.clear();
    absl::Status child_error = close_children();
    uint8_t* heap = nullptr;
    {
      base::MutexLock lock(mu_);
      heap = std::exchange(heap_, nullptr);  // create_buffer refuses from here on
    }
    if (heap != nullptr) (void)munmap(heap, options_.host_heap_bytes);
    base::MutexLock lock(mu_);
    absl::Status undelivered = worker::report_undelivered(&failed_);
    close_done_ = true;
    cv_.notify_all();
    return undelivered.ok() ? child_error : undelivered;
  }

  // ---- host heap ----
  absl::StatusOr<HostBuffer> create_buffer(uint64_t bytes) {
    SIMPLER_RETURN_IF_ERROR(check_not_orchestrating("create_buffer"));
    if (bytes == 0) return absl::InvalidArgumentError("create_buffer: 0 bytes");
    base::MutexLock lock(mu_);
    if (heap_ == nullptr) {
      return absl::FailedPreconditionError(closed_ ? "create_buffer after close()"
                                                   : "create_buffer before init()");
    }
    const uint64_t size = (bytes + kAlign - 1) / kAlign * kAlign;
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (it->second < size) continue;
      const uint64_t offset = it->first;
      const uint64_t left = it->second - size;
      free_.erase(it);
      if (left > 0) free_[offset + size] = left;
      used_[offset] = size;
      uint8_t* p = heap_ + offset;
      // Zeroed outside the lock (the range is this caller's alone): a large buffer does not
      // hold up the runs' completions. close() waits for no create_buffer: the caller must not
      // race the two (as any use after close).
      lock.unlock();
      std::memset(p, 0, size);
      return HostBuffer{reinterpret_cast<uintptr_t>(p), bytes};
    }
    return absl::ResourceExhaustedError(absl::StrCat(
        "create_buffer(", bytes, "): no free range that large in the ", options_.host_heap_bytes,
        "-byte shared host heap (L3Options.host_heap_bytes)"));
  }

  absl::Status free_buffer(const HostBuffer& b) {
    SIMPLER_RETURN_IF_ERROR(check_not_orchestrating("free_buffer"));
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
    if (child < 0 || child >= static_cast<int32_t>(options_.device_ids.size()) || !initialized()) {
      return absl::InvalidArgumentError(absl::StrCat("child ", child, " outside [0, ",
                                                     initialized() ? options_.device_ids.size() : 0,
                                                     ") (after init())"));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<worker::DeviceBuffer> child_malloc(int32_t child, uint64_t bytes) {
    SIMPLER_RETURN_IF_ERROR(check_not_orchestrating("child_malloc"));
    SIMPLER_RETURN_IF_ERROR(check_child(child));
    return endpoint(child).malloc(bytes);
  }
  absl::Status child_free(int32_t child, const worker::DeviceBuffer& buffer) {
    SIMPLER_RETURN_IF_ERROR(check_not_orchestrating("child_free"));
    SIMPLER_RETURN_IF_ERROR(check_child(child));
    return endpoint(child).free(buffer);
  }
  absl::Status copy_child(bool to_child, int32_t child, const worker::DeviceBuffer& device,
                          const HostBuffer& host, uint64_t bytes, uint64_t offset) {
    SIMPLER_RETURN_IF_ERROR(check_not_orchestrating("copy_to_child / copy_from_child"));
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
    return to_child ? endpoint(child).copy_to(device, p, bytes, offset)
                    : endpoint(child).copy_from(p, device, bytes, offset);
  }

  bool in_heap_locked(uint64_t address, uint64_t bytes) const SIMPLER_REQUIRES(mu_) {
    const uint64_t b = reinterpret_cast<uintptr_t>(heap_);
    return heap_ != nullptr && address >= b && bytes <= options_.host_heap_bytes &&
           address - b <= options_.host_heap_bytes - bytes;
  }

  // ---- runs ----
  absl::StatusOr<worker::RunHandle> submit(ProgramHandle program, const task::TaskArgs& args) {
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

  uint64_t next_level_dispatched() const { return dispatched_.load(std::memory_order_relaxed); }

  std::vector<std::string> describe_children() const {
    std::vector<std::string> out;
    if (!initialized()) return out;
    for (size_t i = 0; i < options_.device_ids.size(); ++i) {
      out.push_back(endpoint(static_cast<int32_t>(i)).describe());
    }
    return out;
  }

  // The host heap ranges `args` name, kept until run `seq` finalizes (free_buffer checks them).
  // DEVICE tensors are a child's memory, not the heap's.
  void note_ranges_locked(uint64_t seq, const task::TaskArgs& args) SIMPLER_REQUIRES(mu_) {
    for (size_t i = 0; i < args.size(); ++i) {
      const task::Arg& a = args[i];
      if (a.direction == task::ArgDirection::kScalar) continue;
      if (a.tensor.memory != task::MemoryKind::kHost) continue;
      const uint64_t bytes = a.tensor.span_bytes();
      if (bytes == 0 || !in_heap_locked(a.tensor.address, bytes)) continue;
      named_[seq].emplace_back(a.tensor.address, a.tensor.address + bytes);
    }
  }

 private:
  struct Queued {
    uint32_t program;
    task::TaskArgs args;
    std::shared_ptr<worker::RunShared> shared;
  };
  struct SubJob {
    uint64_t task;
    uint32_t fn;
    task::TaskArgs args;
  };

  // One task of a run in flight.
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

  // The orchestration's view while one run is orchestrated (with mu_ held, on the thread that
  // advanced the runs).
  class Exec final : public L3Context {
   public:
    Exec(Impl& impl, RunCtx& run) : impl_(impl), run_(run) {}

    absl::StatusOr<uint32_t> submit_next_level(ChildCallable callable, const task::TaskArgs& args,
                                               int32_t child,
                                               const task::CallConfig& config) override {
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

    absl::StatusOr<uint32_t> submit_sub(SubHandle fn, const task::TaskArgs& args) override {
      SIMPLER_RETURN_IF_ERROR(check_context());
      impl_.mu_.assert_held();
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
      return impl_.add_task_locked(run_, -1, fn.index, args, {});
    }

    int32_t num_children() const override {
      return static_cast<int32_t>(impl_.options_.device_ids.size());
    }

   private:
    // The context is valid only during its orchestration call, on that call's thread.
    absl::Status check_context() const {
      if (t_orchestrating != &impl_) {
        return absl::FailedPreconditionError(
            "an L3Context used outside its orchestration call (or from another thread)");
      }
      return absl::OkStatus();
    }
    Impl& impl_;
    RunCtx& run_;
  };

  bool initialized() const { return initialized_.load(std::memory_order_acquire); }
  // A child's endpoint; children_ does not change between init() and close().
  Endpoint& endpoint(int32_t child) const SIMPLER_NO_THREAD_SAFETY_ANALYSIS {
    return *children_[child];
  }

  std::string name_task(const Task& k) const {
    if (k.child < 0) {
      return absl::StrCat("L3 run ", k.run, " task ", k.index, " (host sub '", subs[k.fn].first,
                          "')");
    }
    return absl::StrCat("L3 run ", k.run, " task ", k.index, " (child ", k.child, ", callable '",
                        callables[k.fn].name, "')");
  }

  RunCtx* run_of_locked(uint64_t seq) SIMPLER_REQUIRES(mu_) {
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
  uint32_t add_task_locked(RunCtx& run, int32_t child, uint32_t fn, const task::TaskArgs& args,
                           const task::CallConfig& config) SIMPLER_REQUIRES(mu_) {
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
    std::vector<uint64_t> deps;
    const uint64_t seq = run.seq;
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
    for (uint64_t d : deps) {
      const Task& dep = tasks_.at(d);
      if (dep.done) {  // a task of this run that failed before this one was submitted
        finish_locked(id, absl::CancelledError(
                              absl::StrCat("not run: its input task ", dep.index, " failed")));
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
  void try_dispatch_child_locked(int32_t child) SIMPLER_REQUIRES(mu_) {
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

  void dispatch_locked(uint64_t id) SIMPLER_REQUIRES(mu_) {
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

  void on_child_done_locked(int32_t child, uint64_t run) SIMPLER_REQUIRES(mu_) {
    auto it = by_child_run_.find({child, run});
    if (it == by_child_run_.end()) return;  // a task that failed at dispatch
    const uint64_t id = it->second;
    by_child_run_.erase(it);
    --child_in_flight_[child];
    finish_locked(id, tasks_.at(id).handle.wait());  // done: returns at once, delivers it
    try_dispatch_child_locked(child);                // its transport has room again
  }

  void finish_locked(uint64_t id, const absl::Status& status) SIMPLER_REQUIRES(mu_) {
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
  void advance_locked() SIMPLER_REQUIRES(mu_) {
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
    if (queue_.empty() && inflight_.empty()) cv_.notify_all();  // close() waits for this
  }

  // Finalizes finished runs from the front, in run order.
  void retire_finished_locked() SIMPLER_REQUIRES(mu_) {
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
      named_.erase(shared->id.value);
      if (!st.ok()) failed_.push_back(shared);
      --queued_or_running_;
      shared->finalized.signal(st);
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
      base::MutexLock lock(mu_);
      finish_locked(job.task, st);
      advance_locked();
    }
  }

  absl::Status close_children() {
    std::shared_ptr<ChildPoller> poller;
    {
      base::MutexLock lock(mu_);
      poller = poller_;
    }
    if (poller != nullptr) poller->detach();  // waiters stop polling endpoints closed below
    absl::Status first;
    for (size_t i = 0; i < options_.device_ids.size() && initialized(); ++i) {
      absl::Status s = endpoint(static_cast<int32_t>(i)).close();
      if (first.ok() && !s.ok()) first = s;
    }
    base::MutexLock lock(mu_);
    children_.clear();
    initialized_.store(false, std::memory_order_release);
    return first;
  }

  const L3Options options_;
  bool started_ = false;  // init() began: registration is over (caller's thread)
  std::vector<std::thread> sub_threads_;

  base::Mutex mu_;
  base::CondVar cv_;
  // Set once the children run (init), cleared when they are closed; children_ is fixed between.
  std::atomic<bool> initialized_{false};
  std::vector<std::unique_ptr<Endpoint>> children_ SIMPLER_GUARDED_BY(mu_);
  std::shared_ptr<ChildPoller> poller_ SIMPLER_GUARDED_BY(mu_);  // set in init, with children_
  std::vector<std::shared_ptr<ProgramProgress>> progress_ SIMPLER_GUARDED_BY(mu_);  // by program
  std::deque<Queued> queue_ SIMPLER_GUARDED_BY(mu_);
  uint64_t next_run_ SIMPLER_GUARDED_BY(mu_) = 0;
  bool ready_ SIMPLER_GUARDED_BY(mu_) = false;
  bool closing_ SIMPLER_GUARDED_BY(mu_) = false;
  bool closed_ SIMPLER_GUARDED_BY(mu_) = false;
  bool close_done_ SIMPLER_GUARDED_BY(mu_) = false;
  int64_t queued_or_running_ SIMPLER_GUARDED_BY(mu_) = 0;  // submitted, not finalized
  std::atomic<uint64_t> dispatched_{0};
  // Runs in flight (orchestrated, not finalized), their tasks by id, the TensorMap over all of
  // them, each child's queue of next-level tasks not yet dispatched, each child's dispatched
  // and unfinished tasks, and child run -> task.
  std::deque<RunCtx> inflight_ SIMPLER_GUARDED_BY(mu_);
  std::map<uint64_t, Task> tasks_ SIMPLER_GUARDED_BY(mu_);
  uint64_t next_task_ SIMPLER_GUARDED_BY(mu_) = 0;
  chip::TensorMap map_ SIMPLER_GUARDED_BY(mu_);
  std::vector<std::deque<uint64_t>> child_queue_ SIMPLER_GUARDED_BY(mu_);
  std::vector<int64_t> child_in_flight_ SIMPLER_GUARDED_BY(mu_);
  std::map<std::pair<int32_t, uint64_t>, uint64_t> by_child_run_ SIMPLER_GUARDED_BY(mu_);
  std::vector<std::shared_ptr<worker::RunShared>> failed_ SIMPLER_GUARDED_BY(mu_);
  uint8_t* heap_ SIMPLER_GUARDED_BY(mu_) = nullptr;            // set in init, cleared in close
  std::map<uint64_t, uint64_t> free_ SIMPLER_GUARDED_BY(mu_);  // offset -> bytes
  std::map<uint64_t, uint64_t> used_ SIMPLER_GUARDED_BY(mu_);
  // Heap ranges [begin, end) each run that has not finalized names (its args and its tasks').
  std::map<uint64_t, std::vector<std::pair<uint64_t, uint64_t>>> named_ SIMPLER_GUARDED_BY(mu_);
  base::WorkQueue<SubJob> sub_jobs_;  // for the sub-task threads
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
