// The sim device: device memory in the host heap, one scheduler thread per
// stream, a pool of core threads, fault injection and device timestamps.

#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <iterator>
#include <map>
#include <optional>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/poll.h"
#include "base/quarantine.h"
#include "simpler/base/clock.h"
#include "simpler/base/event.h"
#include "simpler/base/log.h"
#include "simpler/base/status.h"
#include "simpler/base/sync.h"
#include "simpler/base/thread.h"
#include "simpler/device/device.h"

namespace simpler::device {
namespace {

// Device memory is host memory, 64-byte aligned and zeroed. Allocations of 2 MiB and more are
// anonymous mappings (zero pages from the kernel, no memset) that start on a 2 MiB boundary and
// are advised to use transparent huge pages: loading a checkpoint then takes one page fault per
// 2 MiB instead of per 4 KiB, also for tensors whose size is not a multiple of 2 MiB (a mapping
// at an unaligned address holds no huge page: a Q8_0 file of qwen3-0.6b, whose 3.2 MiB tensors
// were mapped that way, took 253,000 page faults to load, 22,500 aligned). The mapping is no
// longer than the allocation (rounded to 4 KiB): its last partial 2 MiB takes small pages, so
// nothing beyond the allocation becomes resident.
constexpr uint64_t kMappedAllocBytes = 2u << 20;
constexpr uint64_t kSmallPage = 4u << 10;
// The largest allocation: x86-64's and AArch64's user address space (47 / 48 bits) holds no more,
// and the page rounding below cannot wrap under it.
constexpr uint64_t kMaxAllocBytes = uint64_t{1} << 47;

// Before a large copy into device memory: its pages made present and writable in one call
// (MADV_POPULATE_WRITE, Linux 5.14) rather than one page fault each while the copy runs (each
// fault is a trap, costly on a VM); pages already present are left as they are. Best effort: an
// older kernel refuses the advice and the copy faults the pages in.
void populate_for_write(uint64_t dst, uint64_t bytes) {
#ifdef MADV_POPULATE_WRITE
  if (bytes < kMappedAllocBytes / 2) return;
  const uint64_t first = (dst + kSmallPage - 1) / kSmallPage * kSmallPage;
  const uint64_t last = (dst + bytes) / kSmallPage * kSmallPage;
  if (last > first) {
    (void)::madvise(reinterpret_cast<void*>(static_cast<uintptr_t>(first)), last - first,
                    MADV_POPULATE_WRITE);
  }
#else
  (void)dst;
  (void)bytes;
#endif
}

uint64_t mapped_length(uint64_t bytes) {
  return (bytes + kSmallPage - 1) / kSmallPage * kSmallPage;
}

void* host_alloc_zeroed(uint64_t bytes) {
  if (bytes >= kMappedAllocBytes) {
    // Reserve 2 MiB more than needed, then give back the head before the first 2 MiB boundary and
    // the tail past the allocation.
    const uint64_t length = mapped_length(bytes);
    const uint64_t reserved = length + kMappedAllocBytes;
    void* p = ::mmap(nullptr, reserved, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return nullptr;
    const auto base = reinterpret_cast<uintptr_t>(p);
    const uintptr_t start = (base + kMappedAllocBytes - 1) / kMappedAllocBytes * kMappedAllocBytes;
    if (start > base) (void)::munmap(p, start - base);
    if (base + reserved > start + length) {
      (void)::munmap(reinterpret_cast<void*>(start + length), base + reserved - (start + length));
    }
    (void)::madvise(reinterpret_cast<void*>(start), length, MADV_HUGEPAGE);
    return reinterpret_cast<void*>(start);
  }
  const uint64_t rounded = (bytes + 63) / 64 * 64;
  void* p = std::aligned_alloc(64, rounded);
  if (p != nullptr) std::memset(p, 0, rounded);
  return p;
}

void host_free(void* p, uint64_t bytes) {
  if (bytes >= kMappedAllocBytes) {
    (void)::munmap(p, mapped_length(bytes));
  } else {
    std::free(p);
  }
}

using base::MutexLock;

// Spins up to `spin_ns` while `ready()` is false. Returns ready(). For the
// core threads' hand-offs within a run, which involve only device threads: the
// spin pauses the CPU instead of yielding, since under CFS a yield hands the
// core to a competing process for a whole slice, which turns a µs hand-off into
// ms. (The stream's wait for a host launch yields instead: SimStream::loop.)
//
// The clock is read once every kPollsPerClockRead looks, not at every look: a steady_clock read
// costs ~20-40 ns on a VM (more than a look and a pause together), and the profile of
// `bench dispatch` had spin loops with their clock reads at ~43% of the run. A pause is
// ~10-140 cycles by CPU, so the spin ends at most a few µs past `spin_ns`.
constexpr int32_t kPollsPerClockRead = 32;

template <typename F>
bool spin_until(F&& ready, int64_t spin_ns) {
  if (ready()) return true;
  if (spin_ns <= 0) return false;
  const int64_t until = base::now_ns() + spin_ns;
  do {
    for (int32_t i = 0; i < kPollsPerClockRead; ++i) {
      if (ready()) return true;
      base::cpu_relax();
    }
  } while (base::now_ns() < until);
  return ready();
}

// The completions of the device's cores on their way to the launch that started the jobs: a
// bounded multi-producer, single-consumer ring (Vyukov's bounded queue with one consumer), no
// mutex. Producers are the core threads and the scheduler thread (a job it ran inline); the
// consumer is the scheduler thread of the running launch (launches are serialized by
// launch_mu_). Each core has at most core_queue_depth jobs started and not yet returned by
// next_completion (ExecContext::start's precondition), so at most num_cores * core_queue_depth
// completions are in the ring: with that capacity a producer never waits for a cell. FIFO:
// completions are taken in the order producers claimed their cells. Thread-safe as described.
class CompletionRing {
 public:
  explicit CompletionRing(int32_t min_capacity) {
    size_t cap = 1;
    while (cap < static_cast<size_t>(std::max(min_capacity, 1))) cap *= 2;
    cells_ = std::vector<Cell>(cap);
    for (size_t i = 0; i < cap; ++i) cells_[i].seq.store(i, std::memory_order_relaxed);
    mask_ = cap - 1;
  }

  // Any thread. Publishes with a seq_cst store, so a consumer that announced it sleeps (seq_cst)
  // and then found the ring empty is seen by the producer's seq_cst load of that announcement.
  void push(CoreCompletion c) {
    const uint64_t pos = tail_.fetch_add(1, std::memory_order_relaxed);
    Cell& cell = cells_[pos & mask_];
    // Free once the consumer took the completion a lap earlier; with capacity >= cores it is.
    while (cell.seq.load(std::memory_order_acquire) != pos) base::cpu_relax();
    cell.value = std::move(c);
    cell.seq.store(pos + 1, std::memory_order_seq_cst);
  }

  // Consumer only. Whether a completion is ready to pop (seq_cst: see push).
  bool ready() const {
    return cells_[head_ & mask_].seq.load(std::memory_order_seq_cst) == head_ + 1;
  }

  // Consumer only. Takes the oldest published completion; false when there is none.
  bool pop(CoreCompletion* out) {
    Cell& cell = cells_[head_ & mask_];
    if (cell.seq.load(std::memory_order_acquire) != head_ + 1) return false;
    *out = std::move(cell.value);
    cell.seq.store(head_ + mask_ + 1, std::memory_order_release);
    ++head_;
    return true;
  }

 private:
  struct alignas(64) Cell {
    std::atomic<uint64_t> seq{0};
    CoreCompletion value;
  };
  std::vector<Cell> cells_;
  uint64_t mask_ = 0;
  alignas(64) std::atomic<uint64_t> tail_{0};
  alignas(64) uint64_t head_ = 0;  // consumer's
};

class SimDevice;

constexpr int32_t kMaxCoreQueueDepth = 64;

// A core's moving averages of block durations by job shape (SimDevice::job_shape_key), in ns: a
// direct-mapped table of atomics, so the scheduler can read an estimate (a hint: start() and the
// predicted ends) while the core's current owner updates it. A reader may see one entry's key with
// another's duration after a collision or a concurrent update; that only blends two estimates.
// Written only by the thread that holds its core's claim (Core::claimed). Thread-safe as described.
class DurationEstimates {
 public:
  int64_t get(uint64_t key) const {
    const Entry& e = entries_[index(key)];
    return e.key.load(std::memory_order_relaxed) == key ? e.ns.load(std::memory_order_relaxed) : 0;
  }
  // Blends `ns` into the key's average (1/8 weight), except that a sample under half the average
  // replaces it; a new key takes the entry over. A sample runs long by accident (a preemption, or
  // a cold run: a process's first engine runs each kernel's code and data for the first time, up
  // to 100x its later time) far more than short, and the average decides hand-offs
  // (kept_by_scheduler): a 3 us job's average held over 10 us by one such sample
  // blended in at 1/8 would hand it to its core thread for ~25 runs; the next ordinary sample
  // ends that instead.
  void record(uint64_t key, int64_t ns) {
    Entry& e = entries_[index(key)];
    if (e.key.load(std::memory_order_relaxed) == key) {
      const int64_t old = e.ns.load(std::memory_order_relaxed);
      e.ns.store(ns < old / 2 ? ns : old + (ns - old) / 8, std::memory_order_relaxed);
      return;
    }
    e.key.store(key, std::memory_order_relaxed);
    e.ns.store(ns, std::memory_order_relaxed);
  }

 private:
  static constexpr size_t kEntries = 256;
  static size_t index(uint64_t key) { return (key ^ (key >> 29) ^ (key >> 47)) % kEntries; }
  struct Entry {
    std::atomic<uint64_t> key{0};
    std::atomic<int64_t> ns{0};
  };
  std::array<Entry, kEntries> entries_;
};

// One core: its thread and its job queue. The scheduler (the running launch's thread, the only
// producer) writes a job into the next cell of `queue` and publishes it by advancing `tail`
// (seq_cst). Jobs are taken from `head` by whoever holds the core's claim (`claimed`, taken by
// exchange with acquire, given back with release): the core thread, which drains every queued
// job per claim, or the scheduler itself when it runs a job inline instead of waking a sleeping
// core thread (SimDevice::try_run_inline). So a core's jobs run one at a time, in order, and the
// claim orders successive owners' reads of `head` and writes of `estimates`. A queued cell is
// written again only after its job's completion came back through the CompletionRing (the
// executor holds at most core_queue_depth jobs per core), so it is never written while read.
// No lock on the hand-off: a core thread about to sleep announces it in `sleeping` (seq_cst,
// under `mu`) and then looks at `tail` again, and the scheduler looks at `sleeping` after it
// advanced `tail`; of the two, at least one sees the other's store, and only a poster that sees
// a sleeper takes `mu` to wake it.
struct Core {
  struct QueuedJob {
    CoreJob job;
    uint64_t run_id = 0;
    uint64_t shape = 0;  // SimDevice::job_shape_key(job)
  };
  int32_t index = 0;
  std::thread thread;
  base::Mutex mu;  // held by a sleeping core thread around its wait on `cv`
  base::CondVar cv;
  std::vector<QueuedJob> queue;       // core_queue_depth cells, job i in cell i % size
  std::atomic<uint64_t> tail{0};      // jobs posted (the scheduler's)
  std::atomic<uint64_t> head{0};      // jobs taken (the claim holder's)
  std::atomic<bool> claimed{false};   // a thread is taking and running this core's jobs
  std::atomic<bool> sleeping{false};  // waiting (or about to wait) on `cv`
  // When the running job is expected to end (now_ns() time; 0 = idle or no
  // estimate yet). Written by the claim holder, read by the scheduler (relaxed: a hint).
  std::atomic<int64_t> predicted_end_ns{0};
  // When the last job handed to this core's thread (SimDevice::start) is expected to end, its
  // thread's wake-up (kWakeUpNs, when it slept) and the job's estimate from when it was posted
  // (0 = no estimate): stands in for predicted_end_ns while the job is queued and not started.
  // The scheduler's only (written and read on its thread).
  int64_t handed_end_ns = 0;
  // What the core executes now, for Device::executing(): written by the
  // thread running the job before and after it (relaxed: a diagnostic
  // snapshot, never used to decide anything). exec_start_ns 0 = idle.
  std::atomic<int64_t> exec_start_ns{0};
  std::atomic<uint64_t> exec_run{0};
  std::atomic<uint32_t> exec_task{0};
  std::atomic<uint32_t> exec_kernel{0};
  std::atomic<int32_t> exec_block{0};
  // Signalled as the core thread exits (close() joins only exited threads).
  base::Event exited;
  DurationEstimates estimates;

  // Whether a posted job waits to be taken (seq_cst: see above).
  bool has_job() const {
    return head.load(std::memory_order_acquire) != tail.load(std::memory_order_seq_cst);
  }
  // Takes the claim; false when another thread holds it.
  bool try_claim() {
    return !claimed.load(std::memory_order_relaxed) &&
           !claimed.exchange(true, std::memory_order_acquire);
  }
  void release() { claimed.store(false, std::memory_order_release); }
  // Claim holder only: takes the oldest queued job; false when there is none.
  bool pop(QueuedJob* out) {
    const uint64_t h = head.load(std::memory_order_relaxed);
    if (h == tail.load(std::memory_order_acquire)) return false;
    *out = queue[h % queue.size()];
    head.store(h + 1, std::memory_order_release);
    return true;
  }
  // The scheduler only: queues `job` (the queue has room: see above).
  void push(const CoreJob& job, uint64_t run_id, uint64_t shape) {
    const uint64_t t = tail.load(std::memory_order_relaxed);
    queue[t % queue.size()] = QueuedJob{job, run_id, shape};
    tail.store(t + 1, std::memory_order_seq_cst);
  }
};

class SimStream;

class SimDevice final : public Device {
 public:
  explicit SimDevice(const SimDeviceOptions& o)
      : options_(o),
        completions_((o.num_cores == 0 ? base::hardware_threads() : o.num_cores) *
                     o.core_queue_depth) {
    caps_.platform = "sim";
    caps_.device_id = o.device_id;
    int32_t n = o.num_cores;
    // Default: one core per hardware thread. Measured on 2 vCPUs (docs/benchmarks-history.md,
    // "decode, prefill and load at the machine's limits"):
    // against hardware threads - 1, batch-16 decode 145 -> 101 ms, a 512-token prefill
    // 3.2 -> 1.9 s, batch-1 decode and dispatch unchanged; the stream scheduler thread sleeps
    // after a short spin, so it costs the cores little.
    if (n == 0) n = base::hardware_threads();
    caps_.num_cores = n;
    const int32_t cpus =
        o.cpus.empty() ? base::hardware_threads() : static_cast<int32_t>(o.cpus.size());
    using SchedulerCore = SimDeviceOptions::SchedulerCore;
    scheduler_core_ =
        o.run_jobs_inline && (o.scheduler_core == SchedulerCore::kOn ||
                              (o.scheduler_core == SchedulerCore::kAuto && n >= cpus));
    caps_.memory_bytes = o.memory_bytes;
    cores_.reserve(n);
    for (int32_t i = 0; i < n; ++i) {
      cores_.push_back(std::make_unique<Core>());
      cores_.back()->index = i;
      cores_.back()->queue.resize(o.core_queue_depth);
    }
    for (auto& c : cores_) {
      c->thread = std::thread([this, core = c.get()] {
        pin();
        core_loop(core);
        core->exited.signal();
      });
      base::set_thread_name(c->thread, absl::StrCat("sim-core", c->index));
    }
  }
  ~SimDevice() override { close(); }

  const DeviceCaps& caps() const override { return caps_; }

  absl::StatusOr<uint64_t> malloc(uint64_t bytes) override {
    if (bytes == 0) return absl::InvalidArgumentError("device malloc of 0 bytes");
    MutexLock lock(mem_mu_);
    if (closed_) return absl::FailedPreconditionError("device is closed");
    if (bytes > kMaxAllocBytes) {
      return absl::ResourceExhaustedError(
          absl::StrCat("device ", caps_.device_id, ": requested ", bytes,
                       " bytes, above the largest allocation of ", kMaxAllocBytes, " bytes"));
    }
    if (caps_.memory_bytes != 0 && bytes > caps_.memory_bytes - allocated_) {
      return absl::ResourceExhaustedError(
          absl::StrCat("device ", caps_.device_id, " heap exhausted: requested ", bytes, " bytes, ",
                       caps_.memory_bytes - allocated_, " of ", caps_.memory_bytes, " bytes free"));
    }
    void* p = host_alloc_zeroed(bytes);
    if (p == nullptr) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "device ", caps_.device_id, ": host memory exhausted allocating ", bytes, " bytes"));
    }
    const auto addr = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(p));
    allocs_[addr] = Allocation{bytes, next_allocation_id_++};
    allocated_ += bytes;
    return addr;
  }

  absl::Status free(uint64_t address) override {
    MutexLock lock(mem_mu_);
    auto it = allocs_.find(address);
    if (it == allocs_.end()) {
      return absl::NotFoundError(absl::StrCat("device free of 0x", absl::Hex(address),
                                              ": not the base of a live allocation"));
    }
    // Before the memory goes: a cached range check that still sees the old count ran before
    // this free (RangeCache).
    frees_.fetch_add(1, std::memory_order_release);
    allocated_ -= it->second.bytes;
    host_free(reinterpret_cast<void*>(static_cast<uintptr_t>(address)), it->second.bytes);
    allocs_.erase(it);
    return absl::OkStatus();
  }

  absl::Status check_range(uint64_t address, uint64_t bytes) const override {
    MutexLock lock(mem_mu_);
    return check_range_locked(address, bytes);
  }

  // The allocations a run's tasks were last checked against (ExecContext::check_range, once per
  // tensor argument of every task): a range inside one of them while no allocation has been
  // freed since is inside a live allocation, with no lock and no map lookup. A few entries,
  // replaced round-robin. Owner-thread only (the run's scheduler thread).
  struct RangeCache {
    static constexpr size_t kEntries = 8;
    struct Entry {
      uint64_t begin = 0;
      uint64_t end = 0;  // begin == end: empty
    };
    std::array<Entry, kEntries> entries{};
    uint64_t frees = 0;  // frees_ when the entries were filled
    size_t next = 0;     // the entry replaced next
  };

  // check_range through `cache`: the same answers.
  absl::Status check_range_cached(uint64_t address, uint64_t bytes, RangeCache* cache) const {
    // Acquire: pairs with free's increment, made before it releases the memory.
    const uint64_t frees = frees_.load(std::memory_order_acquire);
    if (frees == cache->frees) {
      for (const RangeCache::Entry& e : cache->entries) {
        if (address >= e.begin && address < e.end && bytes <= e.end - address) {
          return absl::OkStatus();
        }
      }
    } else {
      cache->entries = {};
      cache->frees = frees;
    }
    MutexLock lock(mem_mu_);
    SIMPLER_RETURN_IF_ERROR(check_range_locked(address, bytes));
    // Entered only when no free came between the count read above and this check.
    if (frees_.load(std::memory_order_relaxed) == cache->frees) {
      const auto& [base, a] = *std::prev(allocs_.upper_bound(address));
      cache->entries[cache->next] = RangeCache::Entry{base, base + a.bytes};
      cache->next = (cache->next + 1) % RangeCache::kEntries;
    }
    return absl::OkStatus();
  }

  absl::StatusOr<uint64_t> allocation_id(uint64_t address, uint64_t bytes) const override {
    MutexLock lock(mem_mu_);
    SIMPLER_RETURN_IF_ERROR(check_range_locked(address, bytes));
    return std::prev(allocs_.upper_bound(address))->second.id;
  }

  uint64_t next_allocation_id() const override {
    MutexLock lock(mem_mu_);
    return next_allocation_id_;
  }

  // frees_ counts a free (with release) before the free releases its memory, under mem_mu_.
  uint64_t free_count() const override { return frees_.load(std::memory_order_acquire); }

  absl::Status check_range_locked(uint64_t address, uint64_t bytes) const
      SIMPLER_REQUIRES(mem_mu_) {
    auto it = allocs_.upper_bound(address);
    if (it != allocs_.begin()) {
      --it;
      const uint64_t base = it->first, size = it->second.bytes;
      if (address >= base && address - base <= size && bytes <= size - (address - base)) {
        return absl::OkStatus();
      }
      if (address >= base && address < base + size) {
        return absl::InvalidArgumentError(absl::StrCat(
            "device range [0x", absl::Hex(address), ", +", bytes, ") overruns allocation [0x",
            absl::Hex(base), ", +", size, ") by ", address + bytes - (base + size), " bytes"));
      }
    }
    return absl::InvalidArgumentError(absl::StrCat("device range [0x", absl::Hex(address), ", +",
                                                   bytes, ") is not inside a live allocation"));
  }

  absl::Status copy_to_device(uint64_t dst, const void* src, uint64_t bytes) override {
    if (bytes == 0) return absl::OkStatus();
    SIMPLER_RETURN_IF_ERROR(check_range(dst, bytes));
    populate_for_write(dst, bytes);
    std::memcpy(reinterpret_cast<void*>(static_cast<uintptr_t>(dst)), src, bytes);
    return absl::OkStatus();
  }

  absl::Status copy_from_device(void* dst, uint64_t src, uint64_t bytes) override {
    if (bytes == 0) return absl::OkStatus();
    SIMPLER_RETURN_IF_ERROR(check_range(src, bytes));
    std::memcpy(dst, reinterpret_cast<const void*>(static_cast<uintptr_t>(src)), bytes);
    return absl::OkStatus();
  }

  uint64_t allocated_bytes() const override {
    MutexLock lock(mem_mu_);
    return allocated_;
  }
  size_t live_allocations() const override {
    MutexLock lock(mem_mu_);
    return allocs_.size();
  }

  absl::StatusOr<Stream*> create_stream() override;

  std::vector<ExecutingJob> executing() const override {
    std::vector<ExecutingJob> out;
    for (const auto& c : cores_) {
      const int64_t start = c->exec_start_ns.load(std::memory_order_relaxed);
      if (start == 0) continue;
      ExecutingJob j;
      j.run_id = c->exec_run.load(std::memory_order_relaxed);
      j.task_index = c->exec_task.load(std::memory_order_relaxed);
      j.kernel = c->exec_kernel.load(std::memory_order_relaxed);
      j.block_idx = c->exec_block.load(std::memory_order_relaxed);
      j.core = c->index;
      j.start_ns = start;
      out.push_back(j);
    }
    return out;
  }

  int32_t abandoned_threads() const override { return abandoned_.load(std::memory_order_acquire); }

  void abort(const absl::Status& reason) override {
    {
      MutexLock lock(abort_mu_);
      if (aborted_.load(std::memory_order_relaxed)) return;
      abort_reason_ = reason;
      aborted_.store(true, std::memory_order_release);
    }
    abort_cv_.notify_all();
    // Wake the scheduler threads sleeping on completions.
    completion_cv_.notify_all();
  }
  bool aborted() const override { return aborted_.load(std::memory_order_acquire); }
  // The launch_refused entry for run `run`, if any (counted as fired).
  std::optional<FaultSpec> launch_fault_for(uint64_t run) const {
    return options_.faults.find_at(run, 0, /*at_launch=*/true);
  }
  absl::Status abort_reason() const {
    MutexLock lock(abort_mu_);
    return abort_reason_;
  }

  void close() override;

  // --- used by streams and the exec context ---
  int32_t num_cores() const { return caps_.num_cores; }
  int64_t spin_ns() const { return options_.spin_ns; }
  int32_t core_queue_depth() const { return options_.core_queue_depth; }
  // Pins the calling device thread to options_.cpus (validated at creation).
  void pin() const {
    if (options_.cpus.empty()) return;
    if (absl::Status st = base::pin_this_thread(options_.cpus); !st.ok()) {
      SIMPLER_LOG_WARN("sim device {}: cannot pin a device thread: {}", caps_.device_id,
                       st.ToString());
    }
  }

  // Starts `job` on core `core_index`. A job its core timed short stays with the scheduler,
  // which runs it when it next waits (kept_by_scheduler); any other is queued to the core. A
  // core thread that is awake (running its queue or spinning) takes it without a wake-up. A
  // sleeping one is woken — except that one job at a time may be deferred, the scheduler running it
  // itself when it next waits (try_run_inline): a futex wake costs the waker ~15 µs on a VM and the
  // woken thread tens of µs more. The deferred job is a job of the scheduler's core when there is
  // one (scheduler_core: every job of core 0 is the scheduler's), else a job posted to a sleeping
  // core while the device held no other. A deferred core thread is woken as soon as a second job
  // starts, when the scheduler sleeps instead, or when the job has waited spin_ns; the scheduler's
  // own jobs (scheduler_job_) wait for the scheduler.
  void start(int32_t core_index, const CoreJob& job, uint64_t run_id) {
    Core& c = *cores_[core_index];
    // Read before the job is published (the estimates are atomics: a core thread running an
    // earlier job of its queue may update them meanwhile).
    const uint64_t shape = job_shape_key(job);
    const int64_t estimate = c.estimates.get(shape);
    if (kept_by_scheduler(job, estimate)) {
      short_jobs_.push_back(ShortJob{core_index, job, run_id, shape, estimate});
      kept_ns_ += estimate;
      ++jobs_in_flight_;
      return;
    }
    const bool for_scheduler = schedulers_core(c);
    c.push(job, run_id, shape);
    const bool sleeping = c.sleeping.load(std::memory_order_seq_cst);
    ++jobs_in_flight_;
    c.handed_end_ns = 0;  // set below when its thread is to run it
    if (for_scheduler) {
      flush_deferred_wakes();  // a core thread deferred before: the scheduler runs this one
      const bool short_job = estimate <= kShortJobNs;  // 0: not timed yet
      const bool was_short = !scheduler_job_ || scheduler_job_short_;
      scheduler_job_short_ = was_short && short_job;
      if (was_short && !short_job) scheduler_job_since_ns_ = base::now_ns();
      scheduler_job_ = true;
      return;
    }
    if (sleeping && options_.run_jobs_inline && jobs_in_flight_ == 1) {
      deferred_since_ns_ = base::now_ns();
      deferred_.push_back(core_index);
      return;
    }
    flush_deferred_wakes();
    c.handed_end_ns = estimate > 0 ? base::now_ns() + estimate + (sleeping ? kWakeUpNs : 0) : 0;
    if (sleeping) wake(c);
  }
  // What waking a core thread costs before it runs (60-120 us measured on the 2-vCPU VM).
  static constexpr int64_t kWakeUpNs = 100'000;

  // The earliest predicted end of a job on a core thread (0 when none): a running job's
  // predicted_end_ns, or, for a core whose job is handed and not started yet, its handed_end_ns.
  int64_t earliest_predicted_end() const {
    int64_t earliest = 0;
    for (const auto& c : cores_) {
      int64_t p = c->predicted_end_ns.load(std::memory_order_relaxed);
      if (p == 0 && c->has_job()) p = c->handed_end_ns;
      if (p > 0 && (earliest == 0 || p < earliest)) earliest = p;
    }
    return earliest;
  }

  // Wakes core `c`'s thread. Taking `mu` first: a thread that announced it sleeps holds `mu`
  // until it waits on `cv`, so the notification cannot fall between its look and its wait.
  static void wake(Core& c) {
    { MutexLock lock(c.mu); }
    c.cv.notify_one();
  }

  // Wakes the deferred core threads (the scheduler's own job stays its own).
  void flush_deferred_wakes() {
    for (int32_t i : deferred_) wake(*cores_[i]);
    deferred_.clear();
  }

  // Runs a deferred job (its core thread sleeps, or it is a job of the
  // scheduler's core) on the scheduler thread, attributed to its core, and
  // returns the completion. False when there is none, or its core thread woke
  // and took it.
  bool try_run_inline(CoreCompletion* out) {
    if (run_short_job(out)) return true;
    if (run_schedulers_job(out)) return true;
    while (!deferred_.empty()) {
      Core& c = *cores_[deferred_.back()];
      deferred_.pop_back();
      if (run_if_unclaimed(c, out)) return true;
    }
    return false;
  }

  // Claims core `c` (its thread may be running its queue: then it runs this job too) and runs its
  // oldest queued job into `*out`; false when it has none or another thread holds the claim.
  bool run_if_unclaimed(Core& c, CoreCompletion* out) {
    if (!c.has_job() || !c.try_claim()) return false;
    Core::QueuedJob q;
    const bool got = c.pop(&q);
    if (got) *out = execute(c, q);
    c.release();
    return got;
  }

  // Whether a non-blocking poll runs the jobs queued for the scheduler on its core: when every one
  // is short or not timed yet (scheduler_job_short_), or one longer has waited spin_ns. Before,
  // only a blocking wait ran them, and an orchestration polls between submits and blocks only
  // when the executor's ring is full: a core-0 job not timed yet (a process's first of its
  // shape), or timed long by a cold first run, waited while the run's oldest task held the ring
  // until it filled (4,096 tasks, milliseconds).
  bool polled_schedulers_job() const {
    if (!scheduler_job_) return false;
    return scheduler_job_short_ || base::now_ns() - scheduler_job_since_ns_ >= options_.spin_ns;
  }

  // The scheduler's core: its jobs stay queued for the scheduler until none is left
  // (scheduler_job_); runs the oldest. False when there is none.
  bool run_schedulers_job(CoreCompletion* out) {
    if (!scheduler_job_) return false;
    if (run_if_unclaimed(*cores_[0], out)) return true;
    scheduler_job_ = cores_[0]->has_job();
    if (!scheduler_job_) scheduler_job_short_ = false;
    return false;
  }

  // Whether the scheduler keeps `job`, expected to take `estimate` ns on its core, and runs it
  // itself when it next waits (try_run_inline), whichever core it was started on, instead of
  // queueing it for the core's thread: while the jobs it keeps add up to at most kShortJobNs, so
  // that short independent tasks still spread over the cores once the scheduler has that much
  // to run. Where the cores are at least the CPUs (scheduler_core), a hand-off to another thread
  // costs more than such a job: a wake-up (60-120 µs on a 2-vCPU VM), or
  // a spinning core thread that holds the CPU the scheduler needs. A job of unknown duration goes
  // to its core, which measures it. Only at a queue depth of 1, where the executor starts a job
  // on a core only after the core's previous one came back, so the core has no other job and
  // its jobs still run one at a time and in order. Only a task's single block: the blocks of an
  // SPMD task started together run at the same time on their cores (a kernel may wait for its
  // partner blocks), as before.
  bool kept_by_scheduler(const CoreJob& job, int64_t estimate) const {
    return scheduler_core_ && job.block_dim == 1 && options_.core_queue_depth == 1 &&
           estimate > 0 && kept_ns_ + estimate <= kShortJobNs;
  }
  static constexpr int64_t kShortJobNs = 10'000;

  // Runs the oldest kept short job (kept_by_scheduler) on the scheduler thread, attributed to its
  // core, and returns its completion; false when none is kept.
  bool run_short_job(CoreCompletion* out) {
    if (short_jobs_begin_ == short_jobs_.size()) return false;
    const ShortJob j = short_jobs_[short_jobs_begin_];
    kept_ns_ -= j.estimate;
    // Taken jobs are dropped when none is left, or once they are most of the list: a list that
    // never empties (a replay keeps a job per core in flight, each started as another is taken)
    // would otherwise grow by a job per task — reallocations and fresh pages, a 100k-task run's
    // ~10 MB — while what it holds is at most a job per core.
    if (++short_jobs_begin_ == short_jobs_.size()) {
      short_jobs_.clear();
      short_jobs_begin_ = 0;
    } else if (short_jobs_begin_ >= kShortJobsCompactAt &&
               2 * short_jobs_begin_ >= short_jobs_.size()) {
      short_jobs_.erase(short_jobs_.begin(),
                        short_jobs_.begin() + static_cast<ptrdiff_t>(short_jobs_begin_));
      short_jobs_begin_ = 0;
    }
    // The core's thread holds no job (a depth of 1), but may not have given its claim back after
    // posting its last completion yet.
    Core& c = *cores_[j.core];
    while (!c.try_claim()) base::cpu_relax();
    const Core::QueuedJob q{j.job, j.run_id, j.shape};
    if (j.job.timed || time_untimed_run()) {
      *out = execute(c, q, /*kept=*/true);
      last_job_clock_ns_ = out->end_ns;
    } else {
      *out = execute_untimed(c, q);
    }
    c.release();
    return true;
  }

  // Whether to time this run of an untimed kept job anyway, for its core's estimates: about one
  // run in kUntimedSampleEvery, picked by a xorshift sequence rather than a count, so that jobs
  // kept in a repeating order of any period are each timed now and then.
  bool time_untimed_run() {
    untimed_rng_ ^= untimed_rng_ << 13;
    untimed_rng_ ^= untimed_rng_ >> 7;
    untimed_rng_ ^= untimed_rng_ << 17;
    return (untimed_rng_ & (kUntimedSampleEvery - 1)) == 0;
  }
  static constexpr uint64_t kUntimedSampleEvery = 16;
  static constexpr size_t kShortJobsCompactAt = 64;

  // Whether a core running a job is predicted to finish it within `ns` from now.
  bool a_core_ends_within(int64_t ns) const {
    int64_t earliest = 0;
    for (const auto& c : cores_) {
      const int64_t p = c->predicted_end_ns.load(std::memory_order_relaxed);
      if (p > 0 && (earliest == 0 || p < earliest)) earliest = p;
    }
    return earliest > 0 && earliest <= base::now_ns() + ns;  // the clock only when one runs
  }

  // How long a blocking wait that did not sleep towards a predicted end (it was too near) spins
  // before it sleeps: spin_ns, or, when the core's predicted end (`earliest`, 0 when none) lies
  // beyond that, through it (a quarter of spin_ns past it), at most kSpinThroughNs. Sleeping
  // through a completion costs a futex wake-up after it (60-120 us on the 2-vCPU VM): after the
  // scheduler ran its block of a two-block task inline, core 1's block, started on its thread,
  // often ends 50-100 us later. With spin_ns 0 nothing spins.
  int64_t spin_through(int64_t earliest) const {
    if (options_.spin_ns <= 0 || earliest <= 0) return options_.spin_ns;
    const int64_t through = earliest + options_.spin_ns / 4 - base::now_ns();
    return std::clamp<int64_t>(through, options_.spin_ns, kSpinThroughNs);
  }
  static constexpr int64_t kSpinThroughNs = 150'000;
  // Whether the next job this thread would run inline is its own core's job that is not short
  // (scheduler_job_ without scheduler_job_short_, no kept short job ahead of it) while a core
  // thread's job is predicted to end within kNearEndNs (its end stands until its completion is
  // posted). next_completion then waits for that completion first, so the executor hands that core
  // its next job — often the other block of the task whose first block the scheduler is about to
  // run, started on core 0 alone because core 1 was a few µs from free. Run inline first, that
  // block took every row the task's blocks claim (task_lines) while core 1 idled through it:
  // 1.5-2.1% of a batch-1 decode step's two-block tasks, 0.32-0.50 ms a step; with the wait
  // 0.2-0.9% on Q8_0, 0.1-1.5% on Q4_K_M (docs/design/scheduler.md). Short jobs (kept, at most
  // kShortJobNs) run without it.
  bool near_end_first() const {
    return short_jobs_begin_ == short_jobs_.size() && scheduler_job_ && !scheduler_job_short_ &&
           jobs_in_flight_ > 1 && a_core_ends_within(kNearEndNs);
  }
  static constexpr int64_t kNearEndNs = 10'000;

  // Whether `c` is the core the scheduler thread stands in for (scheduler_core): every job of that
  // core runs on the scheduler thread, long ones too, and its own thread only waits for the stop
  // (core_loop): where the cores are the CPUs, a third busy thread leaves one of them waiting for
  // a CPU for up to a time slice (docs/design/scheduler.md, "Core 0's long jobs").
  bool schedulers_core(const Core& c) const { return scheduler_core_ && c.index == 0; }

  // Blocking waits model a device scheduler that polls for completions
  // without burning a host CPU: it sleeps until shortly before the earliest
  // predicted block end (each core's moving average of the kernel's block
  // durations; none for a kernel's first block on a core), then
  // spins at most spin_ns, then sleeps until woken. A non-blocking call takes
  // no lock and reads no clock, unless a deferred wake-up is pending or it is
  // about to run its own core's longer job inline (near_end_first: then it may
  // wait up to kNearEndNs for another core's completion first).
  bool next_completion(CoreCompletion* out, bool block) {
    auto ready = [this] { return completions_.ready(); };
    if (!block) {
      if (!deferred_.empty() && base::now_ns() - deferred_since_ns_ >= options_.spin_ns) {
        flush_deferred_wakes();
      }
      if (take_completion(out)) return true;
      // As a blocking wait (below), a core about to finish is waited for before the scheduler's
      // own longer job runs inline.
      if (near_end_first()) {
        spin_until(ready, kNearEndNs);
        if (take_completion(out)) return true;
      }
      // A kept short job runs now: its cores have no thread that would run it meanwhile, and an
      // orchestration polling between submits thereby overlaps its tasks' execution. So does a
      // job queued to the scheduler's core for the scheduler (polled_schedulers_job).
      if (!run_short_job(out) && !(polled_schedulers_job() && run_schedulers_job(out))) {
        return false;
      }
      --jobs_in_flight_;
      return true;
    }
    // near_end_first: a core about to finish is waited for before the scheduler's longer job.
    if (!ready() && near_end_first()) spin_until(ready, kNearEndNs);
    if (!ready()) {
      CoreCompletion mine;
      if (try_run_inline(&mine)) {
        // Queued behind the completions that core threads posted while it ran, and those
        // about to be posted (a core predicted to finish within spin_ns is waited for: the
        // blocks of one task end about together): those cores are handed their next jobs
        // first, instead of this thread taking the next block while they sit idle behind it.
        if (jobs_in_flight_ > 1 && a_core_ends_within(options_.spin_ns)) {
          spin_until(ready, options_.spin_ns);
        }
        if (!ready()) {  // nothing came meanwhile: no trip through the ring
          --jobs_in_flight_;
          *out = std::move(mine);
          if (!deferred_.empty()) flush_deferred_wakes();
          return true;
        }
        completions_.push(std::move(mine));
      }
    }
    if (!deferred_.empty()) flush_deferred_wakes();
    if (!ready()) {
      const int64_t earliest = earliest_predicted_end();
      // Aim the wake-up so the spin window covers the predicted end, and start
      // it early by how late timed wake-ups have been arriving (moving average).
      const int64_t lateness = oversleep_ns_.load(std::memory_order_relaxed);
      const int64_t wake_at = earliest - options_.spin_ns * 3 / 4 - lateness;
      int64_t spin = options_.spin_ns;
      if (earliest > 0 && wake_at > base::now_ns() + options_.spin_ns) {
        if (!sleep_until_ready(base::steady_time(wake_at))) {
          const int64_t late = std::clamp<int64_t>(base::now_ns() - wake_at, 0, 500'000);
          oversleep_ns_.store(lateness + (late - lateness) / 8, std::memory_order_relaxed);
        }
      } else {
        spin = spin_through(earliest);  // the end is too near to sleep towards
      }
      spin_until(ready, spin);
    }
    while (!take_completion(out)) sleep_until_ready(std::nullopt);
    return true;
  }

  // Serializes launches of all streams on the core pool.
  base::Mutex launch_mu_;

 private:
  void core_loop(Core* c) {
    if (schedulers_core(*c)) {
      // The scheduler runs this core's jobs (schedulers_core); its thread waits for the stop, then
      // runs what is still queued, as every core thread does.
      MutexLock lock(c->mu);
      c->sleeping.store(true, std::memory_order_seq_cst);
      while (!c_stop()) c->cv.wait(lock);
    }
    bool ran = false;
    while (true) {
      // After its jobs, spin briefly for the next one; after a wake-up whose job
      // the scheduler ran inline, go straight back to sleep.
      if (ran) {
        spin_until([c, this] { return c->has_job() || c_stop(); }, options_.spin_ns);
      }
      if (!c->has_job() && !c_stop()) {
        MutexLock lock(c->mu);
        c->sleeping.store(true, std::memory_order_seq_cst);  // see Core
        while (!c->has_job() && !c_stop()) c->cv.wait(lock);
        c->sleeping.store(false, std::memory_order_relaxed);
      }
      // Only a stop with no job queued ends the thread (a job posted before the stop still runs).
      if (!c->has_job()) {
        if (c_stop()) return;
        ran = false;  // the scheduler took it
        continue;
      }
      if (!c->try_claim()) {  // the scheduler runs one of its jobs inline: it gives it back soon
        base::cpu_relax();
        ran = true;
        continue;
      }
      Core::QueuedJob q;
      while (c->pop(&q)) {
        // The job's end stays its predicted end until its completion is posted, so a scheduler
        // deciding meanwhile whether to run a job inline waits for it (kNearEndNs).
        post_completion(execute(*c, q, /*kept=*/false, /*posted_by_caller=*/true));
        c->predicted_end_ns.store(0, std::memory_order_relaxed);
      }
      c->release();
      ran = true;
    }
  }
  // Runs one claimed job as core `c` and returns its completion.
  // `kept`: a job the scheduler kept (run_short_job). It publishes no predicted end
  // (Core::predicted_end_ns: the scheduler is the only reader), and its duration enters the
  // core's estimate as at most kKeptSampleCapNs: a kept job is expected within kShortJobNs, so
  // a longer sample is most likely the scheduler thread preempted mid-job on a loaded machine,
  // and taken whole it would hand the job's next run to its core thread (a wake-up, 60-120 us)
  // for a blip. A job that really became long still leaves the scheduler after a few samples
  // (the blend climbs past kShortJobNs).
  // `posted_by_caller`: the core thread posts the completion, and clears predicted_end_ns after
  // it; until then the job's actual end stands as its predicted end.
  CoreCompletion execute(Core& c, const Core::QueuedJob& q, bool kept = false,
                         bool posted_by_caller = false) {
    const bool predict = !kept;
    const int64_t start_ns = base::now_ns();
    if (predict) {
      const int64_t estimate = c.estimates.get(q.shape);
      c.predicted_end_ns.store(estimate > 0 ? start_ns + estimate : 0, std::memory_order_relaxed);
    }
    CoreCompletion done = run_as(c, q, start_ns);
    done.start_ns = start_ns;
    done.end_ns = base::now_ns();
    if (predict) {
      c.predicted_end_ns.store(posted_by_caller ? done.end_ns : 0, std::memory_order_relaxed);
    }
    const int64_t ns = done.end_ns - done.start_ns;
    c.estimates.record(q.shape, kept ? std::min(ns, kKeptSampleCapNs) : ns);
    return done;
  }
  static constexpr int64_t kKeptSampleCapNs = 2 * kShortJobNs;

  // Runs one claimed job untimed (CoreJob::timed false) as core `c`: no clock read, so the
  // completion's timestamps are 0 and the core's estimates are not updated. For
  // Device::executing() the job's start is the last time the scheduler timed a kept job.
  CoreCompletion execute_untimed(Core& c, const Core::QueuedJob& q) {
    return run_as(c, q, std::max<int64_t>(last_job_clock_ns_, 1));
  }

  // Runs `q`'s job as core `c`, shown by Device::executing() as started at `start_ns` while it
  // runs, and returns its completion (no timestamps).
  CoreCompletion run_as(Core& c, const Core::QueuedJob& q, int64_t start_ns) {
    const CoreJob& job = q.job;
    CoreCompletion done;
    done.core = c.index;
    done.tag = job.tag;
    done.task_index = job.task_index;
    done.block_idx = job.block_idx;
    c.exec_run.store(q.run_id, std::memory_order_relaxed);
    c.exec_task.store(job.task_index, std::memory_order_relaxed);
    c.exec_kernel.store(job.kernel, std::memory_order_relaxed);
    c.exec_block.store(job.block_idx, std::memory_order_relaxed);
    c.exec_start_ns.store(start_ns, std::memory_order_relaxed);
    done.status = run_job(job, q.run_id, c.index);
    c.exec_start_ns.store(0, std::memory_order_relaxed);
    return done;
  }

  bool c_stop() const { return stop_cores_.load(std::memory_order_acquire); }

  // A core thread's completion: into the ring, then a wake-up only when the scheduler announced
  // it sleeps (seq_cst on both sides, as for Core::sleeping; the lock orders the notification
  // after the scheduler's wait began).
  void post_completion(CoreCompletion c) {
    completions_.push(std::move(c));
    if (scheduler_waiting_.load(std::memory_order_seq_cst)) {
      { MutexLock lock(completion_mu_); }
      completion_cv_.notify_one();
    }
  }

  // The running launch's thread: the oldest completion, if any.
  bool take_completion(CoreCompletion* out) {
    if (!completions_.pop(out)) return false;
    --jobs_in_flight_;
    return true;
  }

  // The running launch's thread: sleeps until a completion is ready or `deadline` passed;
  // false when the deadline passed first.
  bool sleep_until_ready(std::optional<base::SteadyTime> deadline) {
    MutexLock lock(completion_mu_);
    scheduler_waiting_.store(true, std::memory_order_seq_cst);
    bool in_time = true;
    while (!completions_.ready()) {
      if (!deadline.has_value()) {
        completion_cv_.wait(lock);
      } else if (!completion_cv_.wait_until(lock, *deadline)) {
        in_time = completions_.ready();
        break;
      }
    }
    scheduler_waiting_.store(false, std::memory_order_relaxed);
    return in_time;
  }

  void abandon(std::string what) {
    SIMPLER_LOG_ERROR("abandoning {}", what);
    base::note_abandoned_thread(std::move(what));
    abandoned_.fetch_add(1, std::memory_order_acq_rel);
  }

  // The job's shape key (device::job_shape_key): precomputed by the caller, or computed here.
  static uint64_t job_shape_key(const CoreJob& job) {
    if (job.shape != 0) return job.shape;
    return device::job_shape_key(job.fn, job.args, job.num_args, job.block_dim);
  }

  absl::Status run_job(const CoreJob& job, uint64_t run_id, int32_t core) {
    if (auto fault = options_.faults.find_at(run_id, job.task_index, /*at_launch=*/false);
        fault.has_value() && job.block_idx == 0) {
      switch (fault->kind) {
        case FaultKind::kKernelError:
          return absl::InternalError(absl::StrCat(
              "kernel reported failure (injected kernel_error, code ", fault->code, ")"));
        case FaultKind::kDeviceFault:
          return base::mark_unrecoverable(absl::InternalError(
              absl::StrCat("device fault, error code ", fault->code, " (injected device_fault)")));
        case FaultKind::kLaunchRefused:
          break;  // refused at launch (SimStream::push); never reaches a core
        case FaultKind::kProcessKill:
          SIMPLER_LOG_WARN("run {} task {}: injected process_kill: SIGKILL to process {}", run_id,
                           job.task_index, static_cast<int64_t>(getpid()));
          (void)kill(getpid(), SIGKILL);
          pause();  // never returns: SIGKILL cannot be caught
          break;
        case FaultKind::kProcessStop:
          SIMPLER_LOG_WARN("run {} task {}: injected process_stop: SIGSTOP to process {}", run_id,
                           job.task_index, static_cast<int64_t>(getpid()));
          // raise, not kill(getpid()): a signal to the process stops its threads when each next
          // enters the kernel, so this task could finish and its run complete first.
          (void)raise(SIGSTOP);  // this thread stops at once; returns once continued, if ever
          break;
        case FaultKind::kHang: {
          MutexLock lock(abort_mu_);
          while (!aborted_.load(std::memory_order_acquire)) abort_cv_.wait(lock);
          return base::mark_unrecoverable(absl::AbortedError(
              absl::StrCat("task hung (injected hang) until the device was aborted: ",
                           std::string(abort_reason_.message()))));
        }
      }
    }
    task::KernelContext ctx;
    ctx.args = job.args;
    ctx.num_args = job.num_args;
    ctx.block_idx = job.block_idx;
    ctx.block_dim = job.block_dim;
    ctx.core = core;
    ctx.run_id = run_id;
    ctx.task_index = job.task_index;
    ctx.task_lines = job.task_lines;
    try {
      return job.fn(ctx);
    } catch (...) {
      // A throwing kernel fails its task (recoverable), never the device thread.
      return base::status_from_current_exception("kernel");
    }
  }

  SimDeviceOptions options_;
  DeviceCaps caps_;

  mutable base::Mutex mem_mu_;
  struct Allocation {
    uint64_t bytes = 0;
    uint64_t id = 0;  // Device::allocation_id
  };
  std::map<uint64_t, Allocation> allocs_ SIMPLER_GUARDED_BY(mem_mu_);  // by base address
  uint64_t next_allocation_id_ SIMPLER_GUARDED_BY(mem_mu_) = 1;
  uint64_t allocated_ SIMPLER_GUARDED_BY(mem_mu_) = 0;
  // Allocations freed so far (written under mem_mu_; read without it by check_range_cached).
  std::atomic<uint64_t> frees_{0};
  bool closed_ SIMPLER_GUARDED_BY(mem_mu_) = false;

  std::vector<std::unique_ptr<Core>> cores_;
  std::atomic<bool> stop_cores_{false};

  std::atomic<int64_t> oversleep_ns_{0};  // how late timed wake-ups arrive (average)

  // Completions travel through the lock-free ring; the mutex and condition variable only put
  // the scheduler to sleep and wake it (scheduler_waiting_: it sleeps, or is about to).
  CompletionRing completions_;
  base::Mutex completion_mu_;
  base::CondVar completion_cv_;
  std::atomic<bool> scheduler_waiting_{false};
  // Jobs started and not yet returned by next_completion. Touched only by the
  // launch running under launch_mu_.
  int32_t jobs_in_flight_ = 0;
  bool scheduler_core_ = false;    // the scheduler stands in for core 0 (scheduler_core)
  std::vector<int32_t> deferred_;  // cores whose wake-up is deferred (see start)
  bool scheduler_job_ = false;     // a job of core 0 waits for the scheduler (see start)
  // Every job waiting for the scheduler on core 0 is expected within kShortJobNs or untimed, so a
  // non-blocking next_completion runs it at once (a longer one after spin_ns).
  bool scheduler_job_short_ = false;
  int64_t scheduler_job_since_ns_ = 0;  // when a job of core 0 not short began to wait for it
  int64_t deferred_since_ns_ = 0;
  // Short single-block jobs of any core that the scheduler runs itself (kept_by_scheduler), FIFO
  // from short_jobs_begin_.
  struct ShortJob {
    int32_t core = 0;
    CoreJob job;
    uint64_t run_id = 0;
    uint64_t shape = 0;    // job_shape_key(job)
    int64_t estimate = 0;  // its core's estimate at start, in ns
  };
  std::vector<ShortJob> short_jobs_;
  int64_t kept_ns_ = 0;  // the estimates of the kept jobs not yet run, summed
  size_t short_jobs_begin_ = 0;
  uint64_t untimed_rng_ = 0x9E3779B97F4A7C15ull;  // time_untimed_run's xorshift state
  int64_t last_job_clock_ns_ = 0;  // the clock at the last kept job the scheduler timed

  mutable base::Mutex abort_mu_;
  base::CondVar abort_cv_;
  std::atomic<bool> aborted_{false};
  absl::Status abort_reason_ SIMPLER_GUARDED_BY(abort_mu_);

  base::Mutex streams_mu_;
  std::vector<std::unique_ptr<SimStream>> streams_ SIMPLER_GUARDED_BY(streams_mu_);
  std::once_flag close_once_;
  std::atomic<int32_t> abandoned_{0};  // device threads close() could not join
};

class SimExecContext final : public ExecContext {
 public:
  SimExecContext(SimDevice* d, uint64_t run_id) : device_(d), run_id_(run_id) {}
  int32_t num_cores() const override { return device_->num_cores(); }
  uint64_t run_id() const override { return run_id_; }
  int32_t core_queue_depth() const override { return device_->core_queue_depth(); }
  void start(int32_t core, const CoreJob& job) override { device_->start(core, job, run_id_); }
  bool next_completion(CoreCompletion* out, bool block) override {
    return device_->next_completion(out, block);
  }
  bool aborted() const override { return device_->aborted(); }
  absl::Status check_range(uint64_t address, uint64_t bytes) const override {
    return device_->check_range_cached(address, bytes, &ranges_);
  }

 private:
  SimDevice* device_;
  uint64_t run_id_;
  mutable SimDevice::RangeCache ranges_;  // the run's thread only, as the context
};

// In-order stream: one scheduler thread takes the next item only after the
// previous one finished.
class SimStream final : public Stream {
 public:
  explicit SimStream(SimDevice* d) : device_(d) {
    thread_ = std::thread([this] {
      base::set_thread_name("sim-stream");
      device_->pin();
      base::use_precise_timers();  // it sleeps until predicted block ends
      loop();
      exited_.signal();
    });
  }
  ~SimStream() override { stop(); }

  absl::StatusOr<std::shared_ptr<LaunchRecord>> launch(uint64_t run_id, LaunchFn fn) override {
    return push(run_id, std::move(fn), nullptr);
  }
  absl::StatusOr<std::shared_ptr<LaunchRecord>> enqueue_host(
      std::function<absl::Status()> fn) override {
    return push(0, nullptr, std::move(fn));
  }
  size_t pending() const override {
    MutexLock lock(mu_);
    return queue_.size() + (busy_ ? 1 : 0);
  }

  // Whether the scheduler thread is inside an item (a launch or a host function).
  bool busy() const {
    MutexLock lock(mu_);
    return busy_;
  }

  // Asks the scheduler thread to exit once its queue is empty.
  void request_stop() {
    {
      MutexLock lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
  }

  // Stops the scheduler thread: joins it when it exits by `deadline`, else
  // detaches it (it is inside a launch that never returns) and returns false.
  bool stop(const base::Deadline& deadline = base::Deadline::forever()) {
    request_stop();
    if (!thread_.joinable()) return true;
    if (!exited_.wait(deadline)) {
      thread_.detach();
      return false;
    }
    thread_.join();
    return true;
  }

 private:
  struct Item {
    std::shared_ptr<LaunchRecord> record;
    LaunchFn launch;
    std::function<absl::Status()> host;
  };

  absl::StatusOr<std::shared_ptr<LaunchRecord>> push(uint64_t run_id, LaunchFn fn,
                                                     std::function<absl::Status()> host) {
    if (device_->aborted()) {
      return absl::FailedPreconditionError(
          absl::StrCat("device aborted: ", std::string(device_->abort_reason().message())));
    }
    if (fn != nullptr) {
      if (auto f = device_->launch_fault_for(run_id); f.has_value()) {
        return absl::UnavailableError(absl::StrCat("stream refused the launch of run ", run_id,
                                                   " (injected launch_refused)"));
      }
    }
    auto rec = std::make_shared<LaunchRecord>();
    rec->run_id = run_id;
    {
      MutexLock lock(mu_);
      if (stopping_) return absl::FailedPreconditionError("stream is closed");
      queue_.push_back(Item{rec, std::move(fn), std::move(host)});
      ready_.fetch_add(1, std::memory_order_release);
    }
    cv_.notify_one();
    return rec;
  }

  void loop() {
    while (true) {
      // Between runs the next launch comes from a host thread, which on a machine with few CPUs
      // may be waiting for this very CPU (a child's mailbox server that this thread's wake-up
      // preempted, say): poll yielding, not pausing (docs/benchmarks-history.md, the L3 hierarchy:
      // a pause-spin here held the submitting thread off its CPU for the whole spin, 20 µs of every
      // L3 run in process mode). Within a run the core threads pause-spin (device-only hand-offs).
      base::poll_yielding([this] { return ready_.load(std::memory_order_acquire) > 0; },
                          device_->spin_ns());
      Item item;
      {
        MutexLock lock(mu_);
        while (queue_.empty() && !stopping_) cv_.wait(lock);
        if (queue_.empty()) return;
        item = std::move(queue_.front());
        queue_.pop_front();
        ready_.fetch_sub(1, std::memory_order_relaxed);
        busy_ = true;
      }
      LaunchRecord& rec = *item.record;
      rec.start_ns = base::now_ns();
      absl::Status st;
      if (device_->aborted()) {
        st = base::mark_unrecoverable(
            absl::AbortedError(absl::StrCat("device aborted before the item started: ",
                                            std::string(device_->abort_reason().message()))));
      } else if (item.launch) {
        MutexLock launch_lock(device_->launch_mu_);
        SimExecContext ctx(device_, rec.run_id);
        try {
          st = item.launch(ctx);
        } catch (...) {
          // Nothing escapes the scheduler thread: the launch fails (recoverable).
          st = base::status_from_current_exception(absl::StrCat("launch of run ", rec.run_id));
        }
        // A device fault leaves the device's state unknown: like a real
        // stream, it executes nothing more (queued items fail as aborted).
        if (base::is_unrecoverable(st)) device_->abort(st);
      } else {
        try {
          st = item.host();
        } catch (...) {
          st = base::status_from_current_exception("stream host function");
        }
      }
      rec.end_ns = base::now_ns();
      {
        MutexLock lock(mu_);
        busy_ = false;
      }
      rec.done.signal(std::move(st));
    }
  }

  SimDevice* device_;
  mutable base::Mutex mu_;
  base::CondVar cv_;
  std::deque<Item> queue_ SIMPLER_GUARDED_BY(mu_);
  bool busy_ SIMPLER_GUARDED_BY(mu_) = false;
  bool stopping_ SIMPLER_GUARDED_BY(mu_) = false;
  std::atomic<int64_t> ready_{0};
  base::Event exited_;  // signalled as the scheduler thread exits
  std::thread thread_;
};

absl::StatusOr<Stream*> SimDevice::create_stream() {
  if (aborted()) return absl::FailedPreconditionError("device is aborted");
  MutexLock lock(streams_mu_);
  streams_.push_back(std::make_unique<SimStream>(this));
  return streams_.back().get();
}

// How long close() waits for a device thread that is not inside a kernel (idle, or between
// items): such a thread exits within microseconds once scheduled, so only a machine that does
// not schedule it for this long (far beyond a loaded 2-vCPU machine under ThreadSanitizer, where
// a 1 s grace once ran out) gets it abandoned.
constexpr std::chrono::seconds kIdleThreadExit{10};

void SimDevice::close() {
  std::call_once(close_once_, [this] {
    options_.faults.warn_unfired(absl::StrCat("sim device ", caps_.device_id));
    abort(base::mark_unrecoverable(absl::CancelledError("device closed")));
    // The abort releases injected hangs and stops dispatch, so every thread
    // exits promptly unless it is inside a kernel that never returns: such a
    // thread cannot be joined and is abandoned after the grace (one deadline
    // for all threads).
    const base::Deadline grace = base::Deadline::after(std::chrono::nanoseconds(
        static_cast<int64_t>(std::min(options_.close_grace_s, 86400.0) * 1e9)));
    {
      MutexLock lock(streams_mu_);
      for (auto& s : streams_) s->request_stop();
      for (size_t i = 0; i < streams_.size(); ++i) {
        // A scheduler thread between items exits as soon as it gets a CPU: abandoning it
        // would only be a loaded machine's (or a sanitizer's) delay mistaken for a stuck
        // kernel, so it gets kIdleThreadExit whatever the grace.
        const base::Deadline wait =
            streams_[i]->busy() ? grace : base::Deadline::after(kIdleThreadExit);
        if (!streams_[i]->stop(wait)) {  // queued items fail: device aborted
          abandon(absl::StrCat("sim device ", caps_.device_id, " stream ", i,
                               " scheduler thread (inside a launch that does not return)"));
        }
      }
    }
    stop_cores_.store(true, std::memory_order_release);
    for (auto& c : cores_) {
      { MutexLock lock(c->mu); }
      c->cv.notify_all();
    }
    for (auto& c : cores_) {
      if (!c->thread.joinable()) continue;
      // A core that is not inside a kernel exits as soon as it gets a CPU after the stop:
      // it gets kIdleThreadExit of its own, even when a stuck stream used up the shared grace.
      const bool in_kernel = c->exec_start_ns.load(std::memory_order_relaxed) != 0;
      const base::Deadline wait = !in_kernel ? base::Deadline::after(kIdleThreadExit)
                                  : grace.expired()
                                      ? base::Deadline::after(std::chrono::milliseconds(10))
                                      : grace;
      if (c->exited.wait(wait)) {
        c->thread.join();
        continue;
      }
      c->thread.detach();
      const int64_t start = c->exec_start_ns.load(std::memory_order_relaxed);
      abandon(absl::StrCat("sim device ", caps_.device_id, " core ", c->index, " thread (run ",
                           c->exec_run.load(std::memory_order_relaxed), " task ",
                           c->exec_task.load(std::memory_order_relaxed),
                           ": its kernel has not returned after ",
                           start > 0 ? (base::now_ns() - start) / 1e9 : 0.0, " s)"));
    }
    if (abandoned_.load(std::memory_order_acquire) > 0) {
      // An abandoned thread may still read or write device memory: none is
      // released (the owner keeps this device alive until exit).
      SIMPLER_LOG_ERROR(
          "sim device {}: {} device thread(s) abandoned inside kernels that never returned; "
          "device memory ({} bytes) stays allocated until the process exits",
          caps_.device_id, abandoned_.load(), allocated_bytes());
      MutexLock lock(mem_mu_);
      closed_ = true;
      return;
    }
    MutexLock lock(mem_mu_);
    closed_ = true;
    frees_.fetch_add(1, std::memory_order_release);
    for (auto& [addr, a] : allocs_)
      host_free(reinterpret_cast<void*>(static_cast<uintptr_t>(addr)), a.bytes);
    allocs_.clear();
    allocated_ = 0;
  });
}

}  // namespace

absl::StatusOr<std::unique_ptr<Device>> create_sim_device(const SimDeviceOptions& options) {
  if (options.num_cores < 0 || options.num_cores > kMaxSimCores) {
    return absl::InvalidArgumentError(absl::StrCat("sim device: num_cores must be in [0, ",
                                                   kMaxSimCores, "] (0 = all), got ",
                                                   options.num_cores));
  }
  if (options.spin_ns < 0 || options.spin_ns > 50'000) {
    return absl::InvalidArgumentError(
        absl::StrCat("sim device: spin_ns must be in [0, 50000], got ", options.spin_ns));
  }
  if (options.core_queue_depth < 1 || options.core_queue_depth > kMaxCoreQueueDepth) {
    return absl::InvalidArgumentError(absl::StrCat("sim device: core_queue_depth must be in [1, ",
                                                   kMaxCoreQueueDepth, "], got ",
                                                   options.core_queue_depth));
  }
  if (!(options.close_grace_s >= 0) || std::isinf(options.close_grace_s)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "sim device: close_grace_s must be finite and >= 0, got ", options.close_grace_s));
  }
  if (!options.cpus.empty()) {
    if (absl::Status c = base::check_cpus(options.cpus); !c.ok()) {
      return base::annotate(c, "sim device: cpus: ");
    }
  }
  return std::unique_ptr<Device>(new SimDevice(options));
}

}  // namespace simpler::device
