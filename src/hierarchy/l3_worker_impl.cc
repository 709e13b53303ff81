// L3Worker::Impl: lifecycle, the shared host heap and the calls into one child (the scheduler
// is l3_scheduler.cc).
#include "hierarchy/l3_worker_impl.h"

#include <sys/mman.h>

#include <cerrno>
#include <cstring>
#include <exception>
#include <iterator>

#include "absl/strings/str_cat.h"
#include "simpler/base/status.h"
#include "simpler/base/thread.h"

namespace simpler::hierarchy {

namespace {

constexpr uint64_t kAlign = 64;

}  // namespace

// ---- ChildPoller ----

void ChildPoller::poll() {
  // Never from inside an orchestration (it holds the scheduler's lock that a completion
  // takes); and one poller at a time is enough.
  if (t_orchestrating != nullptr || !mu_.try_lock()) return;
  base::MutexLock lock(mu_, std::adopt_lock);
  for (Endpoint* e : endpoints_) e->poll();
}

void ChildPoller::begin_window() {
  if (t_orchestrating != nullptr) return;  // such a waiter polls nothing
  base::MutexLock lock(mu_);
  if (windows_++ == 0) {
    for (Endpoint* e : endpoints_) e->set_waiter_polling(true);
  }
}

void ChildPoller::end_window() {
  if (t_orchestrating != nullptr) return;
  base::MutexLock lock(mu_);
  if (windows_ == 0) return;  // detached while the window was open
  if (--windows_ == 0) stop_polling(endpoints_);
}

void ChildPoller::detach() {
  base::MutexLock lock(mu_);
  const int32_t open = std::exchange(windows_, 0);
  std::vector<Endpoint*> endpoints = std::exchange(endpoints_, {});
  if (open > 0) stop_polling(endpoints);
}

void ChildPoller::stop_polling(const std::vector<Endpoint*>& endpoints) {
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

// ---- registration checks ----

absl::Status L3Worker::Impl::check_registration(const char* what) const {
  if (started_) return absl::FailedPreconditionError(absl::StrCat(what, " after init()"));
  return absl::OkStatus();
}

absl::Status L3Worker::Impl::check_not_orchestrating(const char* what) const {
  if (t_orchestrating == this) {
    return absl::FailedPreconditionError(
        absl::StrCat(what,
                     " called from an L3 orchestration of the same worker; an "
                     "orchestration submits tasks through its L3Context only"));
  }
  return absl::OkStatus();
}

// ---- lifecycle ----

absl::Status L3Worker::Impl::init() {
  if (started_) return absl::FailedPreconditionError("L3 init() called twice");
  SIMPLER_RETURN_IF_ERROR(options_.validate());
  started_ = true;
  SIMPLER_RETURN_IF_ERROR(map_heap());
  // Children first: a process child is forked while this process is still
  // single-threaded (every thread below starts after the forks).
  SIMPLER_ASSIGN_OR_RETURN(std::vector<std::unique_ptr<Endpoint>> children, start_children());
  {
    base::MutexLock lock(mu_);
    children_ = std::move(children);
    child_queue_.resize(children_.size());
    child_in_flight_.assign(children_.size(), 0);
    initialized_.store(true, std::memory_order_release);
  }
  // children_ is fixed from here until close(): read without the lock by the methods
  // that only call into an endpoint.
  start_polling();
  start_threads();
  base::MutexLock lock(mu_);
  ready_ = true;
  return absl::OkStatus();
}

absl::Status L3Worker::Impl::map_heap() {
  void* heap = mmap(nullptr, options_.host_heap_bytes, PROT_READ | PROT_WRITE,
                    MAP_SHARED | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (heap == MAP_FAILED) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "shared host heap of ", options_.host_heap_bytes, " bytes: mmap: ", std::strerror(errno)));
  }
  base::MutexLock lock(mu_);
  heap_ = static_cast<uint8_t*>(heap);
  free_[0] = options_.host_heap_bytes;
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::unique_ptr<Endpoint>>> L3Worker::Impl::start_children() {
  uintptr_t heap = 0;
  {
    base::MutexLock lock(mu_);
    heap = reinterpret_cast<uintptr_t>(heap_);
  }
  std::vector<ChildSpec> specs;
  for (size_t i = 0; i < options_.device_ids.size(); ++i) {
    ChildSpec spec;
    spec.index = static_cast<int32_t>(i);
    spec.options = options_.child;
    spec.options.device_id = options_.device_ids[i];
    spec.callables = callables;
    spec.setups = setups;
    spec.host_ranges = {{heap, heap + options_.host_heap_bytes}};
    specs.push_back(std::move(spec));
  }
  if (options_.child_mode == ChildMode::kProcess) {
    absl::StatusOr<std::vector<std::unique_ptr<Endpoint>>> all = start_process_children(specs);
    if (!all.ok()) return base::annotate(all.status(), "L3 init: ");
    return all;
  }
  std::vector<std::unique_ptr<Endpoint>> children;
  for (const ChildSpec& spec : specs) {
    absl::StatusOr<std::unique_ptr<Endpoint>> e = start_lane_child(spec);
    if (!e.ok()) {
      for (auto& c : children) (void)c->close();
      return base::annotate(e.status(), absl::StrCat("L3 init, child ", spec.index, ": "));
    }
    children.push_back(std::move(*e));
  }
  return children;
}

void L3Worker::Impl::start_polling() {
  std::vector<Endpoint*> endpoints;
  for (size_t i = 0; i < options_.device_ids.size(); ++i) {
    endpoints.push_back(&endpoint(static_cast<int32_t>(i)));
  }
  auto poller = std::make_shared<ChildPoller>(std::move(endpoints));
  std::vector<std::shared_ptr<ProgramProgress>> progress;
  for (size_t p = 0; p < programs.size(); ++p) {
    progress.push_back(std::make_shared<ProgramProgress>(poller));
  }
  {
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
}

void L3Worker::Impl::start_threads() {
  for (int32_t t = 0; t < options_.sub_threads; ++t) {
    sub_threads_.emplace_back([this] {
      base::set_thread_name("simpler-l3-sub");
      sub_loop();
    });
  }
}

absl::Status L3Worker::Impl::close() {
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

absl::Status L3Worker::Impl::close_children() {
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

// ---- host heap ----

absl::StatusOr<HostBuffer> L3Worker::Impl::create_buffer(uint64_t bytes) {
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
  return absl::ResourceExhaustedError(
      absl::StrCat("create_buffer(", bytes, "): no free range that large in the ",
                   options_.host_heap_bytes, "-byte shared host heap (L3Options.host_heap_bytes)"));
}

absl::Status L3Worker::Impl::free_buffer(const HostBuffer& b) {
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

// ---- one child ----

absl::Status L3Worker::Impl::check_child(int32_t child) const {
  if (child < 0 || child >= static_cast<int32_t>(options_.device_ids.size()) || !initialized()) {
    return absl::InvalidArgumentError(absl::StrCat("child ", child, " outside [0, ",
                                                   initialized() ? options_.device_ids.size() : 0,
                                                   ") (after init())"));
  }
  return absl::OkStatus();
}

absl::StatusOr<worker::DeviceBuffer> L3Worker::Impl::child_malloc(int32_t child, uint64_t bytes) {
  SIMPLER_RETURN_IF_ERROR(check_not_orchestrating("child_malloc"));
  SIMPLER_RETURN_IF_ERROR(check_child(child));
  return endpoint(child).malloc(bytes);
}

absl::Status L3Worker::Impl::child_free(int32_t child, const worker::DeviceBuffer& buffer) {
  SIMPLER_RETURN_IF_ERROR(check_not_orchestrating("child_free"));
  SIMPLER_RETURN_IF_ERROR(check_child(child));
  return endpoint(child).free(buffer);
}

absl::Status L3Worker::Impl::copy_child(bool to_child, int32_t child,
                                        const worker::DeviceBuffer& device, const HostBuffer& host,
                                        uint64_t bytes, uint64_t offset) {
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

bool L3Worker::Impl::in_heap_locked(uint64_t address, uint64_t bytes) const {
  const uint64_t b = reinterpret_cast<uintptr_t>(heap_);
  return heap_ != nullptr && address >= b && bytes <= options_.host_heap_bytes &&
         address - b <= options_.host_heap_bytes - bytes;
}

std::vector<std::string> L3Worker::Impl::describe_children() const {
  std::vector<std::string> out;
  if (!initialized()) return out;
  for (size_t i = 0; i < options_.device_ids.size(); ++i) {
    out.push_back(endpoint(static_cast<int32_t>(i)).describe());
  }
  return out;
}

}  // namespace simpler::hierarchy
