#include "chip/chip_runtime.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "chip/tensor_map.h"
#include "simpler/base/status.h"

namespace simpler::chip {

absl::Status ChipOptions::validate() const {
  if (ring_capacity == 0) return absl::InvalidArgumentError("ChipOptions.ring_capacity is 0");
  if (max_task_args == 0) return absl::InvalidArgumentError("ChipOptions.max_task_args is 0");
  if (max_block_dim <= 0) return absl::InvalidArgumentError("ChipOptions.max_block_dim <= 0");
  return absl::OkStatus();
}

namespace {

// RESOURCE_EXHAUSTED when task `seq` would not fit a graph built whole (`graph`: a captured graph,
// a host-built graph image), which holds options.max_graph_tasks tasks.
absl::Status graph_fits(uint64_t seq, const ChipOptions& options, const char* graph) {
  if (seq < options.max_graph_tasks) return absl::OkStatus();
  return absl::ResourceExhaustedError(
      absl::StrCat("task ", seq, ": the run needs more than ", options.max_graph_tasks, " tasks; ",
                   graph, " holds ", options.max_graph_tasks, " — the run can never fit"));
}

// Submit-time checks shared by both placements. Messages start with
// "task T (kernel 'K')"; the caller prefixes the run. `tensor_bytes`, when not null, receives
// the bytes the task's tensor arguments span together (device::job_shape_key_of).
absl::Status validate_task(uint64_t seq, const task::ChipCallable& callable,
                           task::KernelIndex kernel, const task::Arg* args, size_t num_args,
                           int32_t block_dim, const ChipOptions& options,
                           const RangeCheck& check_range, uint64_t* tensor_bytes = nullptr) {
  if (kernel >= callable.kernels.size()) {
    return absl::InvalidArgumentError(absl::StrCat("task ", seq, ": kernel index ", kernel,
                                                   " out of range (callable '", callable.name,
                                                   "' has ", callable.kernels.size(), " kernels)"));
  }
  // Formatted only on an error: this runs for every task.
  auto where = [&] {
    return absl::StrCat("task ", seq, " (kernel '", callable.kernels[kernel].name, "')");
  };
  if (block_dim < 1 || block_dim > options.max_block_dim) {
    return absl::InvalidArgumentError(absl::StrCat(where(), ": block_dim ", block_dim,
                                                   " outside [1, ", options.max_block_dim, "]"));
  }
  if (num_args > options.max_task_args) {
    return absl::ResourceExhaustedError(
        absl::StrCat(where(), " has ", num_args, " arguments; a task ring slot holds ",
                     options.max_task_args, " — the run can never fit"));
  }
  uint64_t bytes = 0;
  for (size_t i = 0; i < num_args; ++i) {
    const task::Arg& a = args[i];
    if (absl::Status v = task::validate_arg(a, i); !v.ok()) {
      return base::annotate(v, absl::StrCat(where(), " "));
    }
    if (a.direction == task::ArgDirection::kScalar) continue;
    if (a.tensor.memory != task::MemoryKind::kDevice) {
      return absl::InvalidArgumentError(
          absl::StrCat(where(), " argument ", i, " is a HOST tensor; tasks take device tensors"));
    }
    const uint64_t span = a.tensor.span_bytes();
    bytes += span;
    if (span == 0) continue;
    if (absl::Status r = check_range(a.tensor.address, span); !r.ok()) {
      return base::annotate(
          r, absl::StrCat(where(), " argument ", i, " ", a.tensor.debug_string(), ": "));
    }
  }
  if (tensor_bytes != nullptr) *tensor_bytes = bytes;
  return absl::OkStatus();
}

// Records task `seq`'s tensor arguments in `map` (IN reads, OUT and INOUT writes) and sets
// `*deps` to the earlier tasks it must wait for (unsorted, may repeat; see TensorMap::access).
void record_accesses(TensorMap* map, uint64_t seq, const task::TaskArgs& args,
                     const TensorMap::IsDone& is_done, std::vector<uint64_t>* deps) {
  deps->clear();
  for (const task::Arg& a : args.args()) {
    if (a.direction == task::ArgDirection::kScalar) continue;
    const bool write = a.direction != task::ArgDirection::kIn;
    map->access(a.tensor.address, a.tensor.address + a.tensor.span_bytes(), write, seq, is_done,
                deps);
  }
}

constexpr uint32_t kInitialRingSlots = 64;

// The ready list: a FIFO of task sequence numbers in a ring of a power of two that doubles when
// full and keeps its capacity through clear() (a run boundary allocates nothing).
// Owner-thread only.
class ReadyQueue {
 public:
  ReadyQueue() = default;
  // A move leaves `other` empty, with no capacity.
  ReadyQueue(ReadyQueue&& other) noexcept { *this = std::move(other); }
  ReadyQueue& operator=(ReadyQueue&& other) noexcept {
    buf_ = std::exchange(other.buf_, {});
    mask_ = std::exchange(other.mask_, 0);
    head_ = std::exchange(other.head_, 0);
    tail_ = std::exchange(other.tail_, 0);
    return *this;
  }

  bool empty() const { return head_ == tail_; }
  uint64_t front() const { return buf_[head_ & mask_]; }
  void pop_front() { ++head_; }
  void push_back(uint64_t seq) {
    if (tail_ - head_ == buf_.size()) grow();
    buf_[tail_++ & mask_] = seq;
  }
  void clear() { head_ = tail_ = 0; }

 private:
  void grow() {
    std::vector<uint64_t> bigger(std::max<size_t>(64, buf_.size() * 2));
    const uint64_t mask = bigger.size() - 1;
    for (uint64_t i = head_; i < tail_; ++i) bigger[i & mask] = buf_[i & mask_];
    buf_ = std::move(bigger);
    mask_ = mask;
  }
  std::vector<uint64_t> buf_;
  uint64_t mask_ = 0;
  uint64_t head_ = 0;  // positions, not indices: the entry at position p is buf_[p & mask_]
  uint64_t tail_ = 0;
};

// The shared lines of the SPMD tasks that have blocks on cores (CoreJob::task_lines): a task
// takes an entry when its first block is dispatched and gives it back when its last block
// completed, so an entry serves one task at a time and a kernel's blocks never see another
// task's words. Entries keep their lines between tasks and runs (an executor's storage keeps the
// pool), so a steady state allocates nothing: the entries in use are at most the tasks with
// blocks in flight. Owner-thread only; the lines themselves are written by the blocks.
class TaskLinePool {
 public:
  // The lines of the next block of a task of `block_dim` blocks, `started` of them dispatched
  // before: its first block takes the task an entry (*entry, -1 until then). Null for one block.
  task::TaskLine* for_block(int32_t* entry, int32_t block_dim, int32_t started) {
    if (block_dim <= 1) return nullptr;
    if (started == 0) *entry = acquire(block_dim);
    return lines(*entry);
  }
  // Every block of the task holding *entry completed: the entry (if any) goes back.
  void release(int32_t* entry) {
    if (*entry >= 0) free_.push_back(*entry);
    *entry = -1;
  }
  // Every entry free (a run starts; the last one's blocks have all completed).
  void reset() {
    free_.clear();
    for (int32_t e = static_cast<int32_t>(entries_.size()); e-- > 0;) free_.push_back(e);
  }

 private:
  // An entry of at least `lines` lines, every word 0 (stored before the job that carries them is
  // handed to its core, which orders the stores before the block's reads).
  int32_t acquire(int32_t lines) {
    int32_t e;
    if (!free_.empty()) {
      e = free_.back();
      free_.pop_back();
    } else {
      e = static_cast<int32_t>(entries_.size());
      entries_.emplace_back();
    }
    Entry& entry = entries_[e];
    if (entry.capacity < lines) {
      entry.lines = std::make_unique<task::TaskLine[]>(static_cast<size_t>(lines));
      entry.capacity = lines;
    }
    for (int32_t i = 0; i < lines; ++i) entry.lines[i].word.store(0, std::memory_order_relaxed);
    return e;
  }
  task::TaskLine* lines(int32_t entry) const { return entries_[entry].lines.get(); }
  struct Entry {
    std::unique_ptr<task::TaskLine[]> lines;
    int32_t capacity = 0;
  };
  std::vector<Entry> entries_;
  std::vector<int32_t> free_;
};

// One ring slot. Reused for task seq, seq + capacity, ...
struct TaskSlot {
  uint64_t seq = 0;
  task::KernelIndex kernel = 0;
  int32_t block_dim = 1;
  uint64_t shape = 0;  // device::job_shape_key of its blocks (0: the device computes it)
  int32_t blocks_started = 0;
  int32_t blocks_done = 0;
  int32_t pending = 0;     // unfinished predecessors
  int32_t lines = -1;      // its TaskLinePool entry while its blocks run (several blocks only)
  bool completed = false;  // every block finished, successfully or not
  bool failed = false;     // some block returned an error
  std::vector<task::Arg> args;
  std::vector<uint64_t> successors;
  TaskTiming timing;
};

// What a GraphExecutor keeps between runs on one thread: a stream's scheduler
// thread executes one run at a time, so the ring, the idle and ready lists,
// the TensorMap (with its node pool) and the dependency scratch keep their
// capacity from run to run; a run boundary allocates only the empty node pool
// of the executor's own TensorMap, which it swaps with the kept one. Holds up
// to ring_capacity slots (and their argument capacity) per executing thread
// until it exits.
// Owner-thread only (thread_local).
struct ExecutorStorage {
  std::vector<TaskSlot> ring;
  std::vector<int32_t> idle;
  ReadyQueue ready;
  std::vector<uint64_t> deps;
  TensorMap tensor_map;
  TaskLinePool task_lines;
  bool in_use = false;
};

// Takes an idle core credit for the next ready job: core 0's when it has one, else the last
// freed. Core 0 is the one the sim device's scheduler thread stands in for (a job there runs on
// that thread, no hand-off), while a job past the 10 us the scheduler
// keeps for another core goes to that core's thread (a wake-up, 60-120 us on the 2-vCPU VM, ms
// under load). Taking the last freed core let a chain of dependent tasks that once ran on core 1
// (a replay readies independent tasks together, so one of them goes there) stay on core 1 for
// the rest of the step, handing each of its longer tasks off; the orchestrated run, whose tasks
// come one at a time, kept them on core 0. Placement only: what runs, its order and how a failure
// is attributed do not depend on it.
int32_t take_idle_core(std::vector<int32_t>& idle) {
  for (size_t i = idle.size(); i-- > 0;) {
    if (idle[i] == 0) {
      std::swap(idle[i], idle.back());
      break;
    }
  }
  const int32_t core = idle.back();
  idle.pop_back();
  return core;
}

// Whether the device was aborted (timeout, close); then `*failure` says so and the run starts
// nothing more (blocks on cores are still drained before it returns).
bool stopped_by_abort(device::ExecContext& ctx, absl::Status* failure) {
  if (!ctx.aborted()) return false;
  *failure = base::mark_unrecoverable(absl::AbortedError(
      absl::StrCat("run ", ctx.run_id(), ": device aborted; no further task dispatched")));
  return true;
}

// Folds completion `c` of task `task` (kernel `kernel`) into its record (TaskSlot, ReplayTask):
// its start and end, its finished blocks and, on an error, its failure; the run's first error
// becomes `*failure`, naming the run, the task, the kernel and the block. The block's own timing
// goes to `*blocks` (null: timings are not recorded).
template <typename Task>
void fold_completion(const device::CoreCompletion& c, uint64_t run_id, uint64_t task,
                     const std::string& kernel, Task& t, absl::Status* failure,
                     std::vector<BlockTiming>* blocks) {
  if (t.blocks_done == 0 || c.start_ns < t.timing.start_ns) t.timing.start_ns = c.start_ns;
  t.timing.end_ns = std::max(t.timing.end_ns, c.end_ns);
  if (blocks != nullptr) {
    blocks->push_back(BlockTiming{static_cast<uint32_t>(task), t.timing.kernel, c.block_idx,
                                  t.timing.block_dim, c.core, c.start_ns, c.end_ns});
  }
  ++t.blocks_done;
  if (c.status.ok()) return;
  t.failed = true;
  if (failure->ok()) {
    *failure = base::annotate(c.status, absl::StrCat("run ", run_id, " task ", task, " (kernel '",
                                                     kernel, "') block ", c.block_idx, ": "));
  }
}

// This thread's `Storage` (ExecutorStorage, ReplayStorage), marked in use; null (the caller
// uses fresh containers) should a run ever execute inside another on the same thread.
template <typename Storage>
Storage* claim_thread_storage() {
  thread_local Storage storage;
  if (storage.in_use) return nullptr;
  storage.in_use = true;
  return &storage;
}

// The graph builder and dispatcher of one run (device-built placement): it is
// the OrchestrationContext the orchestration function submits through, and it
// dispatches ready blocks to cores as tasks arrive. Owner-thread only.
class GraphExecutor final : public task::OrchestrationContext {
 public:
  GraphExecutor(device::ExecContext& ctx, const task::ChipCallable& callable,
                const ChipOptions& options, int32_t max_cores, bool record_timing,
                RunReport* report, GraphRecording* capture = nullptr)
      : ctx_(ctx),
        callable_(callable),
        options_(options),
        record_timing_(record_timing),
        report_(report),
        capture_(capture),
        st_(claim_thread_storage<ExecutorStorage>()) {
    // Take the kept containers (moves: O(1), capacity comes along); they go
    // back when the run ends. Members, not references, on the hot path.
    if (st_ != nullptr) {
      ring_ = std::move(st_->ring);
      ready_ = std::move(st_->ready);
      idle_ = std::move(st_->idle);
      tensor_map_ = std::move(st_->tensor_map);
      deps_ = std::move(st_->deps);
      task_lines_ = std::move(st_->task_lines);
    }
    task_lines_.reset();
    // Start from empty lists and map whatever the last run left (a failed run
    // can leave ready tasks); capacity stays. A ring kept from an earlier run
    // keeps its size (at most ring_capacity); its slots were reset when that
    // run ended.
    idle_.clear();
    ready_.clear();
    deps_.clear();
    tensor_map_.clear();
    const size_t initial = std::min<uint32_t>(options.ring_capacity, kInitialRingSlots);
    if (ring_.size() < initial || ring_.size() > options.ring_capacity) {
      ring_.clear();
      ring_.resize(initial);
    }
    int32_t cores = ctx.num_cores();
    if (max_cores > 0) cores = std::min(cores, max_cores);
    num_cores_ = cores;
    // A credit per job a core may hold (ExecContext::core_queue_depth), dealt round by round so
    // that every core gets a job before any gets a second.
    const int32_t depth = std::max(1, ctx.core_queue_depth());
    for (int32_t round = 0; round < depth; ++round) {
      for (int32_t c = cores - 1; c >= 0; --c) idle_.push_back(c);
    }
    is_done_ = [this](uint64_t seq) { return done(seq); };
    check_range_ = [this](uint64_t a, uint64_t b) { return ctx_.check_range(a, b); };
  }

  // Returns the containers to the storage with the used slots reset (only
  // this run knows which); the constructor clears the lists and the map.
  ~GraphExecutor() override {
    const uint64_t used = std::min<uint64_t>(next_seq_, ring_.size());
    for (uint64_t i = 0; i < used; ++i) {
      TaskSlot& s = ring_[i];
      s.seq = 0;
      s.completed = false;
      s.args.clear();
      s.successors.clear();
    }
    if (st_ != nullptr) {
      st_->ring = std::move(ring_);
      st_->ready = std::move(ready_);
      st_->idle = std::move(idle_);
      st_->tensor_map = std::move(tensor_map_);
      st_->deps = std::move(deps_);
      st_->task_lines = std::move(task_lines_);
      st_->in_use = false;
    }
  }

  int32_t num_cores() const override { return num_cores_; }
  uint64_t run_id() const override { return ctx_.run_id(); }

  absl::Status submit(task::KernelIndex kernel, const task::TaskArgs& args,
                      int32_t block_dim) override {
    if (!failure_.ok()) return failure_;
    const uint64_t seq = next_seq_;
    absl::Status v =
        capture_ == nullptr ? absl::OkStatus() : graph_fits(seq, options_, "a captured graph");
    uint64_t bytes = 0;
    if (v.ok()) {
      v = validate_task(seq, callable_, kernel, args.args().data(), args.size(), block_dim,
                        options_, check_range_, &bytes);
    }
    if (!v.ok()) return fail_submit(v);
    if (capture_ == nullptr) {
      record_accesses(&tensor_map_, seq, args, is_done_, &deps_);
    } else {
      // Capturing: the predecessors of the whole run, finished ones included.
      record_accesses(&tensor_map_, seq, args, never_done_, &deps_);
      std::sort(deps_.begin(), deps_.end());
      deps_.erase(std::unique(deps_.begin(), deps_.end()), deps_.end());
      capture_->add(kernel, block_dim, args.args().data(), args.size(), deps_);
    }
    return admit(kernel, args.args().data(), args.size(), block_dim, deps_,
                 device::job_shape_key_of(callable_.kernels[kernel].fn, bytes, block_dim));
  }

  // Executes `num_tasks` validated tasks behind their recorded predecessors.
  absl::Status run_tasks(uint32_t num_tasks, const GraphImageTask* tasks, const task::Arg* args,
                         const uint32_t* preds) {
    for (uint32_t i = 0; i < num_tasks && failure_.ok(); ++i) {
      const GraphImageTask& t = tasks[i];
      deps_.assign(preds + t.preds_begin, preds + t.preds_begin + t.num_preds);
      (void)admit(t.kernel, args + t.args_begin, t.num_args, t.block_dim, deps_);
    }
    return finish();
  }

  // Runs the orchestration, then drives every submitted task to completion.
  absl::Status run(const task::TaskArgs& args) {
    absl::Status orch;
    bool threw = false;
    try {
      orch = callable_.orchestration(*this, args);
    } catch (...) {
      // The orchestration's exception fails its run (recoverable); tasks it
      // submitted before throwing are drained by finish().
      threw = true;
      orch = base::status_from_current_exception(
          absl::StrCat("run ", ctx_.run_id(), " orchestration of '", callable_.name, "'"));
    }
    if (!orch.ok() && failure_.ok()) {
      failure_ =
          threw ? orch
                : base::annotate(orch, absl::StrCat("run ", ctx_.run_id(), " orchestration of '",
                                                    callable_.name, "': "));
    }
    return finish();
  }

 private:
  // Waits for every admitted task (or the first failure), drains the cores.
  absl::Status finish() {
    while (failure_.ok() && completed_ < next_seq_) {
      dispatch();
      if (!pump(/*block=*/true)) {
        failure_ = absl::InternalError(
            absl::StrCat("run ", ctx_.run_id(), ": ", next_seq_ - completed_,
                         " tasks can never become ready (internal dependency error)"));
      }
    }
    // Drain blocks still on cores so nothing touches run memory after return.
    while (running_ > 0) pump(/*block=*/true);
    report_->tasks_completed = completed_ - report_->tasks_failed;
    return failure_;
  }

  // Puts a validated task into the ring (waiting for space: backpressure),
  // links it behind its unfinished predecessors and dispatches ready work.
  // `shape`: the task's device::job_shape_key, 0 when the caller has not computed it.
  absl::Status admit(task::KernelIndex kernel, const task::Arg* args, size_t num_args,
                     int32_t block_dim, std::vector<uint64_t>& deps, uint64_t shape = 0) {
    if (next_seq_ - head_seq_ >= ring_.size() && ring_.size() < options_.ring_capacity) grow();
    while (next_seq_ - head_seq_ >= ring_.size()) {
      if (!failure_.ok()) return failure_;
      dispatch();
      if (!pump(/*block=*/true)) {
        return fail_submit(absl::InternalError("task ring full with nothing running"));
      }
    }
    if (!failure_.ok()) return failure_;
    const uint64_t seq = next_seq_;
    TaskSlot& s = slot(seq);
    s.seq = seq;
    s.kernel = kernel;
    s.block_dim = block_dim;
    s.shape = shape;
    s.blocks_started = 0;
    s.blocks_done = 0;
    s.pending = 0;
    s.lines = -1;
    s.completed = false;
    s.failed = false;
    s.args.assign(args, args + num_args);
    s.successors.clear();
    s.timing = TaskTiming{static_cast<uint32_t>(seq), kernel, -1, block_dim, 0, 0};
    ++next_seq_;
    ++report_->tasks_submitted;
    std::sort(deps.begin(), deps.end());
    deps.erase(std::unique(deps.begin(), deps.end()), deps.end());
    for (uint64_t d : deps) {
      if (done(d)) continue;
      slot(d).successors.push_back(seq);
      ++s.pending;
    }
    if (s.pending == 0) ready_.push_back(seq);
    dispatch();
    while (pump(/*block=*/false)) {
    }
    return failure_;
  }

  // A ring of a power of two slots (the usual: it starts at 64 and doubles) is indexed by a mask,
  // not a 64-bit division: this runs several times per task.
  TaskSlot& slot(uint64_t seq) {
    const size_t n = ring_.size();
    return ring_[(n & (n - 1)) == 0 ? seq & (n - 1) : seq % n];
  }

  // The ring starts small (runs are often short) and doubles up to
  // ring_capacity; live slots move to their index in the larger ring.
  void grow() {
    const size_t bigger = std::min<size_t>(ring_.size() * 2, options_.ring_capacity);
    std::vector<TaskSlot> next(bigger);
    for (uint64_t seq = head_seq_; seq < next_seq_; ++seq)
      next[seq % bigger] = std::move(slot(seq));
    ring_ = std::move(next);
  }
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
    if (!failure_.ok() || stopped_by_abort(ctx_, &failure_)) return;
    while (!idle_.empty() && !ready_.empty()) {
      TaskSlot& s = slot(ready_.front());
      const int32_t core = take_idle_core(idle_);
      device::CoreJob job;
      job.fn = callable_.kernels[s.kernel].fn;
      job.args = s.args.data();
      job.num_args = static_cast<uint32_t>(s.args.size());
      job.block_idx = s.blocks_started;
      job.block_dim = s.block_dim;
      job.task_index = static_cast<uint32_t>(s.seq);
      job.kernel = s.kernel;
      job.tag = s.seq;
      job.shape = s.shape;
      job.timed = record_timing_;  // the completion's timestamps go only into the task timings
      job.task_lines = task_lines_.for_block(&s.lines, s.block_dim, s.blocks_started);
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
    fold_completion(c, ctx_.run_id(), s.seq, callable_.kernels[s.kernel].name, s, &failure_,
                    record_timing_ ? &report_->blocks : nullptr);
    if (s.blocks_done == s.block_dim) {
      s.completed = true;  // finished: no block of it runs any more
      task_lines_.release(&s.lines);
      ++completed_;
      if (s.failed) {
        if (report_->tasks_failed++ == 0) report_->first_failed_task = static_cast<int64_t>(s.seq);
      }
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
  GraphRecording* capture_;  // null unless the run is captured
  ExecutorStorage* st_;      // where the containers go back to; may be null
  ReadyQueue ready_;
  std::vector<TaskSlot> ring_;
  uint64_t head_seq_ = 0;  // oldest task not retired
  uint64_t next_seq_ = 0;
  uint64_t completed_ = 0;
  int32_t num_cores_ = 0;
  int32_t running_ = 0;
  std::vector<int32_t> idle_;
  TaskLinePool task_lines_;
  TensorMap tensor_map_;
  TensorMap::IsDone is_done_;
  TensorMap::IsDone never_done_ = [](uint64_t) { return false; };
  std::vector<uint64_t> deps_;
  RangeCheck check_range_;
  absl::Status failure_;
};

// One task of a replay: its state for the whole run (a replay's tasks are all known up front).
struct ReplayTask {
  int32_t pending = 0;  // unfinished predecessors
  int32_t blocks_started = 0;
  int32_t blocks_done = 0;
  int32_t lines = -1;  // its TaskLinePool entry while its blocks run (several blocks only)
  bool failed = false;
  TaskTiming timing;
};

// What a ReplayExecutor keeps between runs on one thread, as ExecutorStorage: the task states,
// the ready queue and the idle credits keep their capacity. Owner-thread only (thread_local).
struct ReplayStorage {
  std::vector<ReplayTask> tasks;
  std::vector<uint32_t> ready;
  std::vector<int32_t> idle;
  TaskLinePool task_lines;
  bool in_use = false;
};

// Executes a recorded graph with linked successor lists (GraphRecording::link_successors): every
// task is admitted at once with its predecessor count, the tasks without predecessors are ready,
// and a finished task releases its recorded successors. No task ring, no argument copies (a
// job points into the bound arguments, which outlive the run), no linking at admission. Errors,
// their attribution and the drain as GraphExecutor's. Owner-thread only.
class ReplayExecutor {
 public:
  ReplayExecutor(device::ExecContext& ctx, const task::ChipCallable& callable,
                 const GraphRecording& graph, const task::Arg* args, int32_t max_cores,
                 bool record_timing, RunReport* report)
      : ctx_(ctx),
        callable_(callable),
        graph_(graph),
        args_(args),
        record_timing_(record_timing),
        has_shapes_(graph.job_shapes.size() == graph.tasks.size()),
        report_(report),
        st_(claim_thread_storage<ReplayStorage>()) {
    if (st_ != nullptr) {
      tasks_ = std::move(st_->tasks);
      ready_ = std::move(st_->ready);
      idle_ = std::move(st_->idle);
      task_lines_ = std::move(st_->task_lines);
    }
    task_lines_.reset();
    int32_t cores = ctx.num_cores();
    if (max_cores > 0) cores = std::min(cores, max_cores);
    idle_.clear();
    const int32_t depth = std::max(1, ctx.core_queue_depth());
    for (int32_t round = 0; round < depth; ++round) {
      for (int32_t c = cores - 1; c >= 0; --c) idle_.push_back(c);
    }
  }
  ~ReplayExecutor() {
    if (st_ == nullptr) return;
    st_->tasks = std::move(tasks_);
    st_->ready = std::move(ready_);
    st_->idle = std::move(idle_);
    st_->task_lines = std::move(task_lines_);
    st_->in_use = false;
  }

  absl::Status run() {
    const auto n = static_cast<uint32_t>(graph_.tasks.size());
    tasks_.resize(n);
    ready_.resize(n);  // every task enters the queue once
    for (uint32_t i = 0; i < n; ++i) {
      const GraphImageTask& t = graph_.tasks[i];
      ReplayTask& r = tasks_[i];
      r.pending = static_cast<int32_t>(t.num_preds);
      r.blocks_started = 0;
      r.blocks_done = 0;
      r.lines = -1;
      r.failed = false;
      r.timing = TaskTiming{i, t.kernel, -1, t.block_dim, 0, 0};
      if (r.pending == 0) ready_[ready_end_++] = i;
    }
    report_->tasks_submitted = n;
    while (failure_.ok() && completed_ < n) {
      dispatch();
      if (running_ == 0) {
        failure_ = absl::InternalError(
            absl::StrCat("run ", ctx_.run_id(), ": ", n - completed_,
                         " tasks can never become ready (internal dependency error)"));
        break;
      }
      complete_one();
    }
    while (running_ > 0) complete_one();  // nothing touches run memory after return
    report_->tasks_completed = completed_ - report_->tasks_failed;
    return failure_;
  }

 private:
  void dispatch() {
    if (!failure_.ok() || stopped_by_abort(ctx_, &failure_)) return;
    while (!idle_.empty() && ready_begin_ < ready_end_) {
      const uint32_t i = ready_[ready_begin_];
      const GraphImageTask& t = graph_.tasks[i];
      ReplayTask& r = tasks_[i];
      const int32_t core = take_idle_core(idle_);
      device::CoreJob job;
      job.fn = callable_.kernels[t.kernel].fn;
      job.args = args_ + t.args_begin;
      job.num_args = t.num_args;
      job.block_idx = r.blocks_started;
      job.block_dim = t.block_dim;
      job.task_index = i;
      job.kernel = t.kernel;
      job.tag = i;
      job.timed = record_timing_;
      if (has_shapes_) job.shape = graph_.job_shapes[i];
      job.task_lines = task_lines_.for_block(&r.lines, t.block_dim, r.blocks_started);
      if (r.blocks_started == 0) r.timing.core = core;
      ++r.blocks_started;
      ++running_;
      if (r.blocks_started == t.block_dim) ++ready_begin_;
      ctx_.start(core, job);
    }
  }

  // Waits for one completion and handles it.
  void complete_one() {
    device::CoreCompletion c;
    ctx_.next_completion(&c, /*block=*/true);
    --running_;
    idle_.push_back(c.core);
    const auto i = static_cast<uint32_t>(c.tag);
    const GraphImageTask& t = graph_.tasks[i];
    ReplayTask& r = tasks_[i];
    fold_completion(c, ctx_.run_id(), i, callable_.kernels[t.kernel].name, r, &failure_,
                    record_timing_ ? &report_->blocks : nullptr);
    if (r.blocks_done < t.block_dim) return;
    task_lines_.release(&r.lines);
    ++completed_;
    if (r.failed && report_->tasks_failed++ == 0) report_->first_failed_task = i;
    if (record_timing_) report_->tasks.push_back(r.timing);
    if (!failure_.ok()) return;
    for (uint32_t k = graph_.succ_begin[i]; k < graph_.succ_begin[i + 1]; ++k) {
      const uint32_t s = graph_.succs[k];
      if (--tasks_[s].pending == 0) ready_[ready_end_++] = s;
    }
  }

  device::ExecContext& ctx_;
  const task::ChipCallable& callable_;
  const GraphRecording& graph_;
  const task::Arg* args_;
  bool record_timing_;
  bool has_shapes_;  // the graph carries its jobs' shape keys (compute_job_shapes)
  RunReport* report_;
  ReplayStorage* st_;  // where the containers go back to; may be null
  std::vector<ReplayTask> tasks_;
  std::vector<uint32_t> ready_;  // FIFO in [ready_begin_, ready_end_)
  uint32_t ready_begin_ = 0;
  uint32_t ready_end_ = 0;
  std::vector<int32_t> idle_;
  TaskLinePool task_lines_;
  uint64_t completed_ = 0;
  int32_t running_ = 0;
  absl::Status failure_;
};

}  // namespace

absl::Status execute_run(device::ExecContext& ctx, const task::ChipCallable& callable,
                         const task::TaskArgs& args, const ChipOptions& options, int32_t max_cores,
                         bool record_task_timing, RunReport* report, GraphRecording* capture) {
  SIMPLER_RETURN_IF_ERROR(options.validate());
  if (capture != nullptr) capture->clear();
  GraphExecutor exec(ctx, callable, options, max_cores, record_task_timing, report, capture);
  return exec.run(args);
}

absl::Status execute_recorded(device::ExecContext& ctx, const task::ChipCallable& callable,
                              const GraphRecording& recording, const task::Arg* args,
                              const ChipOptions& options, int32_t max_cores,
                              bool record_task_timing, RunReport* report) {
  SIMPLER_RETURN_IF_ERROR(options.validate());
  if (recording.linked()) {
    ReplayExecutor exec(ctx, callable, recording, args, max_cores, record_task_timing, report);
    return exec.run();
  }
  GraphExecutor exec(ctx, callable, options, max_cores, record_task_timing, report);
  return exec.run_tasks(static_cast<uint32_t>(recording.tasks.size()), recording.tasks.data(), args,
                        recording.preds.data());
}

void GraphRecording::link_successors() {
  const size_t n = tasks.size();
  succ_begin.assign(n + 1, 0);
  for (uint32_t p : preds) ++succ_begin[p + 1];
  for (size_t i = 0; i < n; ++i) succ_begin[i + 1] += succ_begin[i];
  succs.resize(preds.size());
  std::vector<uint32_t> fill(succ_begin.begin(), succ_begin.end() - 1);
  // Tasks in order: each successor list comes out sorted.
  for (uint32_t i = 0; i < n; ++i) {
    const GraphImageTask& t = tasks[i];
    for (uint32_t k = 0; k < t.num_preds; ++k) succs[fill[preds[t.preds_begin + k]]++] = i;
  }
}

void GraphRecording::compute_job_shapes(const task::ChipCallable& callable) {
  job_shapes.resize(tasks.size());
  for (size_t i = 0; i < tasks.size(); ++i) {
    const GraphImageTask& t = tasks[i];
    job_shapes[i] = device::job_shape_key(callable.kernels[t.kernel].fn, args.data() + t.args_begin,
                                          t.num_args, t.block_dim);
  }
}

void GraphRecording::add(task::KernelIndex kernel, int32_t block_dim, const task::Arg* task_args,
                         size_t num_args, const std::vector<uint64_t>& deps) {
  GraphImageTask t;
  t.kernel = kernel;
  t.block_dim = block_dim;
  t.args_begin = static_cast<uint32_t>(args.size());
  t.num_args = static_cast<uint32_t>(num_args);
  t.preds_begin = static_cast<uint32_t>(preds.size());
  t.num_preds = static_cast<uint32_t>(deps.size());
  tasks.push_back(t);
  args.insert(args.end(), task_args, task_args + num_args);
  for (uint64_t d : deps) preds.push_back(static_cast<uint32_t>(d));
}

GraphImageHeader graph_image_header(const GraphRecording& recording, uint32_t num_kernels,
                                    uint64_t run_id) {
  GraphImageHeader h;
  h.num_tasks = static_cast<uint32_t>(recording.tasks.size());
  h.num_args = static_cast<uint32_t>(recording.args.size());
  h.num_preds = static_cast<uint32_t>(recording.preds.size());
  h.num_kernels = num_kernels;
  h.run_id = run_id;
  auto align = [](uint64_t x) { return (x + 63) / 64 * 64; };
  h.tasks_offset = align(sizeof(GraphImageHeader));
  h.args_offset = align(h.tasks_offset + h.num_tasks * sizeof(GraphImageTask));
  h.preds_offset = align(h.args_offset + h.num_args * sizeof(task::Arg));
  h.total_bytes = h.preds_offset + h.num_preds * sizeof(uint32_t);
  return h;
}

std::vector<uint8_t> graph_image(const GraphRecording& recording, const task::Arg* args,
                                 uint32_t num_kernels, uint64_t run_id) {
  const GraphImageHeader h = graph_image_header(recording, num_kernels, run_id);
  std::vector<uint8_t> out(h.total_bytes, 0);
  std::memcpy(out.data(), &h, sizeof(h));
  if (h.num_tasks > 0) {
    std::memcpy(out.data() + h.tasks_offset, recording.tasks.data(),
                h.num_tasks * sizeof(GraphImageTask));
  }
  if (h.num_args > 0) std::memcpy(out.data() + h.args_offset, args, h.num_args * sizeof(task::Arg));
  if (h.num_preds > 0) {
    std::memcpy(out.data() + h.preds_offset, recording.preds.data(),
                h.num_preds * sizeof(uint32_t));
  }
  return out;
}

namespace {

// The host side of a host-built graph: an OrchestrationContext that validates
// and records tasks, with dependencies from its own TensorMap.
class GraphRecorder final : public task::OrchestrationContext {
 public:
  GraphRecorder(const task::ChipCallable& callable, const ChipOptions& options, int32_t num_cores,
                uint64_t run_id, const RangeCheck& check_range)
      : callable_(callable),
        options_(options),
        num_cores_(num_cores),
        run_id_(run_id),
        check_range_(check_range) {}

  int32_t num_cores() const override { return num_cores_; }
  uint64_t run_id() const override { return run_id_; }

  absl::Status submit(task::KernelIndex kernel, const task::TaskArgs& args,
                      int32_t block_dim) override {
    if (!failure_.ok()) return failure_;
    const uint64_t seq = recording_.tasks.size();
    absl::Status v = graph_fits(seq, options_, "a graph image");
    if (v.ok()) {
      v = validate_task(seq, callable_, kernel, args.args().data(), args.size(), block_dim,
                        options_, check_range_);
    }
    if (!v.ok()) return fail(v);
    record_accesses(&map_, seq, args, never_done_, &deps_);
    std::sort(deps_.begin(), deps_.end());
    deps_.erase(std::unique(deps_.begin(), deps_.end()), deps_.end());
    recording_.add(kernel, block_dim, args.args().data(), args.size(), deps_);
    return absl::OkStatus();
  }

  GraphRecording take() { return std::move(recording_); }
  const absl::Status& failure() const { return failure_; }

 private:
  absl::Status fail(absl::Status st) {
    if (failure_.ok()) failure_ = base::annotate(st, absl::StrCat("run ", run_id_, " "));
    return failure_;
  }

  const task::ChipCallable& callable_;
  const ChipOptions& options_;
  int32_t num_cores_;
  uint64_t run_id_;
  const RangeCheck& check_range_;
  TensorMap map_;
  TensorMap::IsDone never_done_ = [](uint64_t) { return false; };
  std::vector<uint64_t> deps_;
  GraphRecording recording_;
  absl::Status failure_;
};

absl::Status bad_image(uint64_t run_id, const std::string& what) {
  return absl::InvalidArgumentError(
      absl::StrCat("run ", run_id, ": malformed graph image: ", what));
}

}  // namespace

absl::StatusOr<std::vector<uint8_t>> build_graph_image(const task::ChipCallable& callable,
                                                       const task::TaskArgs& args,
                                                       const ChipOptions& options,
                                                       int32_t num_cores, uint64_t run_id,
                                                       const RangeCheck& check_range) {
  SIMPLER_ASSIGN_OR_RETURN(GraphRecording rec,
                           record_graph(callable, args, options, num_cores, run_id, check_range));
  return graph_image(rec, rec.args.data(), static_cast<uint32_t>(callable.kernels.size()), run_id);
}

absl::StatusOr<GraphRecording> record_graph(const task::ChipCallable& callable,
                                            const task::TaskArgs& args, const ChipOptions& options,
                                            int32_t num_cores, uint64_t run_id,
                                            const RangeCheck& check_range) {
  SIMPLER_RETURN_IF_ERROR(options.validate());
  GraphRecorder rec(callable, options, num_cores, run_id, check_range);
  absl::Status orch;
  try {
    orch = callable.orchestration(rec, args);
  } catch (...) {
    if (!rec.failure().ok()) return rec.failure();
    return base::status_from_current_exception(
        absl::StrCat("run ", run_id, " orchestration of '", callable.name, "'"));
  }
  if (!rec.failure().ok()) return rec.failure();
  if (!orch.ok()) {
    return base::annotate(
        orch, absl::StrCat("run ", run_id, " orchestration of '", callable.name, "': "));
  }
  return rec.take();
}

absl::Status execute_graph_image(device::ExecContext& ctx, const task::ChipCallable& callable,
                                 uint64_t image_address, uint64_t image_bytes,
                                 const ChipOptions& options, int32_t max_cores,
                                 bool record_task_timing, RunReport* report) {
  SIMPLER_RETURN_IF_ERROR(options.validate());
  const uint64_t run = ctx.run_id();
  if (image_bytes < sizeof(GraphImageHeader)) return bad_image(run, "shorter than its header");
  SIMPLER_RETURN_IF_ERROR(ctx.check_range(image_address, image_bytes));
  const auto* base = reinterpret_cast<const uint8_t*>(static_cast<uintptr_t>(image_address));
  GraphImageHeader h;
  std::memcpy(&h, base, sizeof(h));
  if (h.magic != kGraphImageMagic) return bad_image(run, "bad magic");
  if (h.version != kGraphImageVersion) {
    return bad_image(
        run, absl::StrCat("version ", h.version, ", device understands ", kGraphImageVersion));
  }
  if (h.run_id != run) {
    return bad_image(run, absl::StrCat("built for run ", h.run_id));
  }
  if (h.total_bytes > image_bytes) return bad_image(run, "total_bytes beyond the buffer");
  if (h.num_kernels != callable.kernels.size()) {
    return bad_image(run, absl::StrCat("built for ", h.num_kernels, " kernels, callable '",
                                       callable.name, "' has ", callable.kernels.size()));
  }
  auto fits = [&](uint64_t offset, uint64_t count, uint64_t size, uint64_t align) {
    return offset % align == 0 && offset <= h.total_bytes &&
           count <= (h.total_bytes - offset) / size;
  };
  if (!fits(h.tasks_offset, h.num_tasks, sizeof(GraphImageTask), alignof(GraphImageTask))) {
    return bad_image(run, "task table outside the image");
  }
  if (!fits(h.args_offset, h.num_args, sizeof(task::Arg), alignof(task::Arg))) {
    return bad_image(run, "argument table outside the image");
  }
  if (!fits(h.preds_offset, h.num_preds, sizeof(uint32_t), alignof(uint32_t))) {
    return bad_image(run, "predecessor table outside the image");
  }
  const auto* tasks = reinterpret_cast<const GraphImageTask*>(base + h.tasks_offset);
  const auto* args = reinterpret_cast<const task::Arg*>(base + h.args_offset);
  const auto* preds = reinterpret_cast<const uint32_t*>(base + h.preds_offset);
  const RangeCheck check = [&ctx](uint64_t a, uint64_t b) { return ctx.check_range(a, b); };
  for (uint32_t i = 0; i < h.num_tasks; ++i) {
    const GraphImageTask& t = tasks[i];
    if (t.args_begin > h.num_args || t.num_args > h.num_args - t.args_begin) {
      return bad_image(run, absl::StrCat("task ", i, " arguments outside the table"));
    }
    if (t.preds_begin > h.num_preds || t.num_preds > h.num_preds - t.preds_begin) {
      return bad_image(run, absl::StrCat("task ", i, " predecessors outside the table"));
    }
    for (uint32_t k = 0; k < t.num_preds; ++k) {
      if (preds[t.preds_begin + k] >= i) {
        return bad_image(run, absl::StrCat("task ", i, " names predecessor ",
                                           preds[t.preds_begin + k], " that is not earlier"));
      }
    }
    if (absl::Status v = validate_task(i, callable, t.kernel, args + t.args_begin, t.num_args,
                                       t.block_dim, options, check);
        !v.ok()) {
      return base::annotate(v, absl::StrCat("run ", run, " graph image: "));
    }
  }
  GraphExecutor exec(ctx, callable, options, max_cores, record_task_timing, report);
  return exec.run_tasks(h.num_tasks, tasks, args, preds);
}

}  // namespace simpler::chip
