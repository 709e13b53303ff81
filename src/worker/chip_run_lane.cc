#include "worker/chip_run_lane.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/poll.h"
#include "simpler/base/log.h"
#include "simpler/base/status.h"
#include "simpler/base/thread.h"

namespace simpler::worker {

namespace {

// Follows a smaller sample at once and a larger one by 1/16 of the excess:
// for estimates where erring low is cheap and erring high is not.
void track_low(int64_t& estimate, int64_t sample) {
  estimate = sample < estimate ? sample : estimate + (sample - estimate) / 16;
}

// Whether `cached` names `graph`: the same control block, so never a later graph at a reused
// address (the weak_ptr keeps the block). False when `graph` is null.
bool same_graph(const std::weak_ptr<const chip::CapturedGraph>& cached,
                const std::shared_ptr<const chip::CapturedGraph>& graph) {
  return graph != nullptr && !cached.owner_before(graph) && !graph.owner_before(cached);
}

bool is_terminal(RunState s) {
  return s == RunState::kCompleted || s == RunState::kFailed || s == RunState::kCancelled;
}

// Checks a run's tensor arguments: a HOST tensor needs an address, a DEVICE
// tensor must lie inside one live device allocation. Appends each DEVICE
// tensor's [begin, end) to `device_ranges` when given.
absl::Status check_tensor_args(const device::Device& device, const task::TaskArgs& args,
                               std::vector<std::pair<uint64_t, uint64_t>>* device_ranges) {
  for (size_t i = 0; i < args.size(); ++i) {
    const task::Arg& a = args[i];
    if (a.direction == task::ArgDirection::kScalar) continue;
    const uint64_t span_bytes = a.tensor.span_bytes();
    if (span_bytes == 0) continue;
    if (a.tensor.memory == task::MemoryKind::kHost) {
      if (a.tensor.address == 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("argument ", i, " is a HOST tensor with a null address"));
      }
      continue;
    }
    if (absl::Status r = device.check_range(a.tensor.address, span_bytes); !r.ok()) {
      return base::annotate(r, absl::StrCat("argument ", i, " ", a.tensor.debug_string(), ": "));
    }
    if (device_ranges != nullptr) {
      device_ranges->emplace_back(a.tensor.address, a.tensor.address + span_bytes);
    }
  }
  return absl::OkStatus();
}

// "task 7 (kernel 'spin', block 0 on core 1, running for 3.02 s)" for each
// task of run `run` the device reports executing, "; "-joined; empty when none.
std::string describe_executing(const std::vector<device::ExecutingJob>& jobs, uint64_t run,
                               const task::ChipCallable& callable) {
  std::string out;
  const int64_t now = base::now_ns();
  for (const device::ExecutingJob& j : jobs) {
    if (j.run_id != run) continue;
    const std::string kernel =
        j.kernel < callable.kernels.size() ? callable.kernels[j.kernel].name : "?";
    absl::StrAppend(&out, out.empty() ? "" : "; ", "task ", j.task_index, " (kernel '", kernel,
                    "', block ", j.block_idx, " on core ", j.core, ", running for ",
                    absl::StrFormat("%.2f", (now - j.start_ns) / 1e9), " s)");
  }
  return out;
}

// Every bit of config.capture_scalar_params names a scalar argument of `args`.
absl::Status check_scalar_params(const task::CallConfig& config, const task::TaskArgs& args) {
  for (size_t i = 0; i < 64; ++i) {
    if ((config.capture_scalar_params >> i & 1) == 0) continue;
    if (i >= args.size()) {
      return absl::InvalidArgumentError(absl::StrCat("CallConfig.capture_scalar_params bit ", i,
                                                     ": the run has ", args.size(), " arguments"));
    }
    if (args[i].direction != task::ArgDirection::kScalar) {
      return absl::InvalidArgumentError(absl::StrCat("CallConfig.capture_scalar_params bit ", i,
                                                     ": argument ", i, " is not a scalar"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

struct ChipRun {
  std::shared_ptr<RunShared> shared;
  RunRecords* records = nullptr;  // in the run's resource set
  task::CallConfig config;
  base::SlotRef set;
  RunState state = RunState::kAccepted;  // guarded by the lane's mu_
  absl::Status status;
  bool quarantine = false;
  bool record_done = false;
  struct Staged {
    uint64_t host = 0;
    uint64_t device = 0;
    uint64_t bytes = 0;
    task::ArgDirection direction = task::ArgDirection::kIn;
  };
  std::vector<Staged> staged;
  std::vector<std::pair<uint64_t, uint64_t>> device_ranges;  // [begin, end) named in args
  std::shared_ptr<device::LaunchRecord> record;
  RunTiming timing;
  int32_t effective_depth = 0;
  std::function<void(const RunResult&)> on_finalized;  // run by the lane thread after retire
  // A capturing run: its arguments as submitted, and (host-built at prepare, device-built at
  // finalize) its graph, cached when the run retires OK.
  task::TaskArgs submitted;
  std::shared_ptr<const chip::CapturedGraph> captured;
  // Device::next_allocation_id() when the capturing run was admitted: fixed memory its graph
  // names must be older (allocated later, it may have taken the place of what the orchestration
  // saw, freed during the run).
  uint64_t allocation_epoch = 0;
  uint64_t id() const { return shared->id.value; }
};

ChipRunLane::ChipRunLane(device::Device* device, device::Stream* stream, RunResourceArena* arena,
                         LaneOptions options)
    : device_(device),
      stream_(stream),
      arena_(arena),
      options_(std::move(options)),
      env_(options_.env != nullptr ? *options_.env : base::Env::real()),
      graphs_(options_.max_captured_graphs) {
  thread_ = std::thread([this] {
    // The lane thread is bookkeeping behind the device: SCHED_BATCH keeps its
    // wake-ups from preempting the device's scheduler thread at a run boundary
    // (on a 2-vCPU machine that preemption alone cost ~250 µs per boundary).
    // Best effort: an error leaves the default policy.
    sched_param param{};
    (void)pthread_setschedparam(pthread_self(), SCHED_BATCH, &param);
    base::set_thread_name("simpler-lane");
    base::use_precise_timers();  // it sleeps until predicted run ends
    lane_loop();
  });
}

ChipRunLane::~ChipRunLane() { (void)close(); }

void ChipRunLane::span(const char* name, int64_t start, int64_t end, uint64_t run,
                       int32_t tid) const {
  if (options_.trace == nullptr) return;
  options_.trace->add({name, "host", start, end - start, 0, tid, static_cast<int64_t>(run), -1});
}

absl::StatusOr<RunHandle> ChipRunLane::submit(const task::ChipCallable* callable,
                                              const task::TaskArgs& args,
                                              const task::CallConfig& config,
                                              const base::Deadline& admission,
                                              std::function<void(const RunResult&)> on_finalized) {
  const int64_t submit_ns = base::now_ns();
  if (callable == nullptr) return absl::InvalidArgumentError("submit: no callable");
  SIMPLER_RETURN_IF_ERROR(config.validate());
  SIMPLER_RETURN_IF_ERROR(args.validate());
  SIMPLER_RETURN_IF_ERROR(check_scalar_params(config, args));
  auto run = std::make_unique<ChipRun>();
  SIMPLER_RETURN_IF_ERROR(check_tensor_args(*device_, args, &run->device_ranges));
  {
    base::MutexLock lock(mu_);
    if (closing_) return absl::FailedPreconditionError("submit after close(): the lane is closed");
    if (!poison_.ok()) return poison_;
  }
  absl::StatusOr<base::SlotRef> set = acquire_set(admission);
  if (!set.ok()) return set.status();
  run->set = *set;

  // Admission: identity and FIFO position.
  run->shared = std::make_shared<RunShared>();
  SIMPLER_RETURN_IF_ERROR(fill_records(*run, callable, args, config));
  run->config = config;
  run->on_finalized = std::move(on_finalized);
  run->timing.submit_ns = submit_ns;
  ChipRun* r = run.get();
  {
    base::MutexLock lock(mu_);
    SIMPLER_RETURN_IF_ERROR(admit_locked(run, callable));
  }

  absl::Status prepared = prepare_timed(*r);
  RunHandle handle(r->shared);
  prepared = launch_prepared(*r, std::move(prepared));
  span("submit", submit_ns, base::now_ns(), handle.id().value, 0);
  if (!prepared.ok()) return prepared;
  return handle;
}

absl::StatusOr<base::SlotRef> ChipRunLane::acquire_set(const base::Deadline& admission) {
  // A submit that must wait for a resource set has the lane thread reap even while completion
  // pollers are on: the poller may be this very thread.
  absl::StatusOr<base::SlotRef> set = arena_->acquire(base::Deadline::poll());
  if (!set.ok() && admission.kind != base::Deadline::Kind::kPoll) {
    {
      base::MutexLock lock(mu_);
      ++admission_waiters_;
    }
    lane_cv_.notify_all();
    set = arena_->acquire(admission);
    base::MutexLock lock(mu_);
    --admission_waiters_;
  }
  return set;
}

absl::Status ChipRunLane::fill_records(ChipRun& run, const task::ChipCallable* callable,
                                       const task::TaskArgs& args, const task::CallConfig& config) {
  // The run's records live in its set: reused from the set's previous run
  // (retired, so the device is done with them), capacity included.
  absl::StatusOr<RunRecords*> records = arena_->records(run.set);
  if (!records.ok()) {
    (void)arena_->release(run.set);
    return records.status();
  }
  RunRecords& rec = **records;
  rec.reset();
  rec.callable = callable;
  rec.args = args;
  rec.max_cores = config.max_cores;
  rec.task_timing = config.task_timing;
  rec.chip = options_.chip;
  run.records = &rec;
  task::GraphPlacement placement = config.placement;
  if (placement == task::GraphPlacement::kDefault) placement = callable->placement;
  if (placement == task::GraphPlacement::kDefault) placement = options_.placement;
  rec.host_built = placement == task::GraphPlacement::kHost;
  return absl::OkStatus();
}

absl::Status ChipRunLane::admit_locked(std::unique_ptr<ChipRun>& run,
                                       const task::ChipCallable* callable) {
  absl::Status refuse;
  if (closing_) refuse = absl::FailedPreconditionError("submit after close(): the lane is closed");
  if (!poison_.ok()) refuse = poison_;
  if (refuse.ok()) {
    // The buffers the callable binds: checked live, and protected from
    // free until this run retires, like its argument tensors.
    if (auto it = bindings_.find(callable); it != bindings_.end()) {
      for (const auto& [address, bytes] : it->second) {
        if (absl::Status live = device_->check_range(address, bytes); !live.ok()) {
          refuse = absl::FailedPreconditionError(absl::StrCat(
              "submit of '", callable->name, "': its bound device buffer 0x", absl::Hex(address),
              " (", bytes,
              " bytes) is no longer a live allocation: ", std::string(live.message())));
          break;
        }
        run->device_ranges.emplace_back(address, address + bytes);
      }
    }
  }
  if (refuse.ok() && run->config.capture_key != 0) refuse = admit_capture_locked(*run, callable);
  if (!refuse.ok()) {
    (void)arena_->release(run->set);
    return refuse;
  }
  run->shared->id = base::RunId{next_id_++};
  run->shared->result.requested_depth = options_.launch_depth;
  runs_.push_back(std::move(run));
  return absl::OkStatus();
}

absl::Status ChipRunLane::prepare_timed(ChipRun& r) {
  // Prepare outside the lane lock: the set is this run's alone.
  r.timing.prepare_start_ns = base::now_ns();
  absl::Status prepared;
  try {
    prepared = prepare(r);
  } catch (...) {
    // A host-built graph's orchestration (or anything else prepare calls)
    // threw: the run's error, returned by this submit; the lane goes on.
    prepared = base::status_from_current_exception("prepare");
  }
  if (prepared.code() == absl::StatusCode::kResourceExhausted) {
    arena_->release_staging(r.set);  // it never launched: what it staged goes back at once
  }
  r.timing.prepare_end_ns = base::now_ns();
  span("prepare", r.timing.prepare_start_ns, r.timing.prepare_end_ns, r.id(), 0);
  return prepared;
}

absl::Status ChipRunLane::launch_prepared(ChipRun& r, absl::Status prepared) {
  bool wake_lane = true;
  {
    base::MutexLock lock(mu_);
    if (!prepared.ok() || !poison_.ok()) {
      // Returned by submit: delivered here, retired in order by the lane thread.
      set_state_locked(r, RunState::kCancelled,
                       !prepared.ok()
                           ? base::annotate(prepared, absl::StrCat("run ", r.id(), " prepare: "))
                           : poison_);  // the lane was poisoned while this run was preparing
      r.shared->delivered.store(true, std::memory_order_relaxed);
      prepared = r.status;
    } else {
      set_state_locked(r, RunState::kPrepared);
    }
    launch_ready_locked();
    if (prepared.ok() && r.state == RunState::kFailed) {
      // Its own launch, attempted in this call, was refused: returned here.
      r.shared->delivered.store(true, std::memory_order_relaxed);
      prepared = r.status;
    }
    // Completion pollers reap, launch and retire it (poll_completions): the lane thread is not
    // woken for it (its wake-up would cost this thread a system call and put one more runnable
    // thread on the CPUs).
    wake_lane = !left_to_pollers_locked();
  }
  if (wake_lane) lane_cv_.notify_all();
  return prepared;
}

absl::Status ChipRunLane::prepare(ChipRun& run) {
  task::TaskArgs& args = run.records->args;
  // Re-check the tensors now that the run is registered: a free that slipped
  // in between submit's first check and the registration (e.g. while the
  // submit waited for a resource set) is visible here, and from now on every
  // free of these ranges is refused (release_if_unused).
  SIMPLER_RETURN_IF_ERROR(check_tensor_args(*device_, args, nullptr));
  // Only a replay of the graph whose image the set's staging holds may keep it (its HOST
  // tensors take the same staging buffers as last time); anything else may overwrite it.
  if (!same_graph(run.records->image_for, run.records->graph)) run.records->image_for.reset();
  SIMPLER_ASSIGN_OR_RETURN(const size_t staged, stage_host_tensors(run));
  if (run.records->graph != nullptr) return prepare_replay(run, staged);
  if (run.records->host_built) {
    // Host-built graph: orchestrate here and place the image in a run-owned buffer.
    SIMPLER_ASSIGN_OR_RETURN(
        chip::GraphRecording recording,
        chip::record_graph(*run.records->callable, args, run.records->chip,
                           cores_for(run.records->max_cores), run.id(),
                           [this](uint64_t a, uint64_t b) { return device_->check_range(a, b); }));
    const std::vector<uint8_t> image =
        chip::graph_image(recording, recording.args.data(),
                          static_cast<uint32_t>(run.records->callable->kernels.size()), run.id());
    SIMPLER_RETURN_IF_ERROR(place_image(run, staged, image));
    if (run.records->capturing) {
      SIMPLER_ASSIGN_OR_RETURN(run.captured, build_capture(run, std::move(recording)));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<size_t> ChipRunLane::stage_host_tensors(ChipRun& run) {
  task::TaskArgs& args = run.records->args;
  struct HostSpan {
    uint64_t begin, end;
    size_t arg;
  };
  std::vector<HostSpan> spans;
  for (size_t i = 0; i < args.size(); ++i) {
    task::Arg& a = args[i];
    if (a.direction == task::ArgDirection::kScalar) continue;
    if (a.tensor.memory != task::MemoryKind::kHost) continue;
    const uint64_t bytes = a.tensor.span_bytes();
    if (bytes == 0) {
      a.tensor.memory = task::MemoryKind::kDevice;
      continue;
    }
    spans.push_back({a.tensor.address, a.tensor.address + bytes, i});
  }
  // Groups of overlapping spans, each in argument order of its first member (so a run's staging
  // slots follow its arguments, as a replay of its graph expects).
  std::sort(spans.begin(), spans.end(), [](const HostSpan& x, const HostSpan& y) {
    return x.begin != y.begin ? x.begin < y.begin : x.arg < y.arg;
  });
  std::vector<std::vector<HostSpan>> groups;
  uint64_t group_end = 0;
  for (const HostSpan& sp : spans) {
    if (groups.empty() || sp.begin >= group_end) {
      groups.emplace_back();
      group_end = sp.end;
    }
    groups.back().push_back(sp);
    group_end = std::max(group_end, sp.end);
  }
  const auto first_arg = [](const std::vector<HostSpan>& g) {
    size_t first = g.front().arg;
    for (const HostSpan& sp : g) first = std::min(first, sp.arg);
    return first;
  };
  std::sort(groups.begin(), groups.end(),
            [&](const auto& x, const auto& y) { return first_arg(x) < first_arg(y); });
  size_t staged = 0;
  for (const std::vector<HostSpan>& g : groups) {
    const uint64_t begin = g.front().begin;
    uint64_t end = 0;
    bool copy_in = false;
    for (const HostSpan& sp : g) {
      end = std::max(end, sp.end);
      // Inputs are copied in, and so is a strided output: its copy-back spans the gaps between
      // its elements, which must come back as the host had them.
      const task::Arg& a = args[sp.arg];
      copy_in = copy_in || a.direction != task::ArgDirection::kOut || !a.tensor.is_contiguous();
    }
    SIMPLER_ASSIGN_OR_RETURN(StagingBuffer buf, arena_->staging(run.set, staged++, end - begin));
    if (copy_in) {
      SIMPLER_RETURN_IF_ERROR(device_->copy_to_device(
          buf.address, reinterpret_cast<const void*>(static_cast<uintptr_t>(begin)), end - begin));
    }
    for (const HostSpan& sp : g) {
      task::Arg& a = args[sp.arg];
      const uint64_t device = buf.address + (sp.begin - begin);
      run.staged.push_back({sp.begin, device, sp.end - sp.begin, a.direction});
      a.tensor.address = device;
      a.tensor.memory = task::MemoryKind::kDevice;
    }
  }
  return staged;
}

int32_t ChipRunLane::cores_for(int32_t max_cores) const {
  int32_t cores = device_->caps().num_cores;
  if (max_cores > 0) cores = std::min(cores, max_cores);
  return cores;
}

absl::Status ChipRunLane::place_image(ChipRun& run, size_t index,
                                      const std::vector<uint8_t>& image) {
  SIMPLER_ASSIGN_OR_RETURN(StagingBuffer buf, arena_->staging(run.set, index, image.size()));
  SIMPLER_RETURN_IF_ERROR(device_->copy_to_device(buf.address, image.data(), image.size()));
  run.records->image_address = buf.address;
  run.records->image_bytes = image.size();
  return absl::OkStatus();
}

absl::Status ChipRunLane::admit_capture_locked(ChipRun& run, const task::ChipCallable* callable) {
  const uint64_t key = run.config.capture_key;
  RunRecords& rec = *run.records;
  std::shared_ptr<const chip::CapturedGraph> graph = graphs_.find(callable, key);
  if (graph == nullptr) {
    rec.capturing = true;
    run.submitted = rec.args;
    run.allocation_epoch = device_->next_allocation_id();
    return absl::OkStatus();
  }
  SIMPLER_RETURN_IF_ERROR(
      graph->check_bind(rec.args, cores_for(rec.max_cores), run.config.capture_scalar_params));
  // Looked up once per free on the device, not once per replay (a qwen3-0.6b step's graph has
  // hundreds of fixed ranges, each a lookup under the device's memory lock): read before the
  // lookups, so a free during them moves the count and the next replay looks again.
  const uint64_t frees = device_->free_count();
  if (!graphs_.fixed_live_at(callable, key, frees)) {
    if (absl::Status stale = stale_fixed_memory(*graph, 0); !stale.ok()) {
      graphs_.erase(callable, key);
      return absl::FailedPreconditionError(
          absl::StrCat("submit of '", callable->name, "': the graph captured under capture key ",
                       key, " uses ", stale.message(),
                       "; the graph was dropped and the next submit under the key captures again"));
    }
    graphs_.set_fixed_live_at(callable, key, frees);
  }
  // Protected from free like the run's arguments until it retires.
  for (const chip::CapturedGraph::FixedRange& f : graph->fixed()) {
    run.device_ranges.emplace_back(f.begin, f.end);
  }
  rec.graph = std::move(graph);
  graphs_.count_replay();
  return absl::OkStatus();
}

absl::Status ChipRunLane::stale_fixed_memory(const chip::CapturedGraph& graph,
                                             uint64_t epoch) const {
  for (const chip::CapturedGraph::FixedRange& f : graph.fixed()) {
    absl::StatusOr<uint64_t> id = device_->allocation_id(f.begin, f.end - f.begin);
    if (id.ok() && f.allocation != 0 && *id == f.allocation &&
        (epoch == 0 || f.allocation < epoch)) {
      continue;  // every replay's admission comes here once per fixed range: no message built
    }
    const std::string what = absl::StrCat("device memory 0x", absl::Hex(f.begin), " (task ", f.task,
                                          " argument ", f.arg, ") at a fixed address");
    if (!id.ok() || f.allocation == 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          what, " that is no longer a live allocation (",
          id.ok() ? "freed while the graph was captured" : id.status().message(), ")"));
    }
    if (*id != f.allocation || (epoch != 0 && f.allocation >= epoch)) {
      return absl::FailedPreconditionError(absl::StrCat(
          what, " whose allocation was freed and allocated again since the capture (allocation ",
          f.allocation, " then, ", *id, " now)"));
    }
  }
  return absl::OkStatus();
}

absl::Status ChipRunLane::prepare_replay(ChipRun& run, size_t staged) {
  RunRecords& rec = *run.records;
  const chip::CapturedGraph& graph = *rec.graph;
  // The set's last replay of this graph left its bound arguments (and, host-built, its image):
  // only what a replay changes is written again.
  if (same_graph(rec.bound_for, rec.graph)) {
    graph.rebind(rec.args, &rec.bound);
  } else {
    graph.bind(rec.args, &rec.bound);
    rec.bound_for = rec.graph;
  }
  if (!rec.host_built) return absl::OkStatus();
  const uint32_t kernels = static_cast<uint32_t>(rec.callable->kernels.size());
  const chip::GraphImageHeader h = chip::graph_image_header(graph.recording(), kernels, run.id());
  SIMPLER_ASSIGN_OR_RETURN(StagingBuffer buf, arena_->staging(run.set, staged, h.total_bytes));
  if (same_graph(rec.image_for, rec.graph) && rec.image_for_address == buf.address) {
    // Tasks and predecessors are the graph's and still there: the header (run id) and the
    // argument table change.
    SIMPLER_RETURN_IF_ERROR(device_->copy_to_device(buf.address, &h, sizeof(h)));
    SIMPLER_RETURN_IF_ERROR(device_->copy_to_device(buf.address + h.args_offset, rec.bound.data(),
                                                    rec.bound.size() * sizeof(task::Arg)));
    rec.image_address = buf.address;
    rec.image_bytes = h.total_bytes;
    return absl::OkStatus();
  }
  SIMPLER_RETURN_IF_ERROR(place_image(
      run, staged, chip::graph_image(graph.recording(), rec.bound.data(), kernels, run.id())));
  rec.image_for = rec.graph;
  rec.image_for_address = rec.image_address;
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<const chip::CapturedGraph>> ChipRunLane::build_capture(
    ChipRun& run, chip::GraphRecording recording) {
  const RunRecords& rec = *run.records;
  chip::CaptureInput in;
  in.callable = rec.callable;
  in.key = run.config.capture_key;
  in.submitted = &run.submitted;
  in.staged = &rec.args;
  in.num_cores = cores_for(rec.max_cores);
  in.scalar_params = run.config.capture_scalar_params;
  in.run_id = run.id();
  in.allocation_id = [this](uint64_t a, uint64_t b) { return device_->allocation_id(a, b); };
  const chip::Rerecord rerecord = [&](const task::TaskArgs& args) {
    return chip::record_graph(
        *rec.callable, args, rec.chip, in.num_cores, run.id(),
        [this](uint64_t a, uint64_t b) { return device_->check_range(a, b); });
  };
  return chip::CapturedGraph::build(in, std::move(recording), rerecord);
}

// The one place a run's state changes. A terminal state records the run's
// status with it; the not-done states (ACCEPTED, PREPARED, LAUNCHED) are
// published to the handles at once, the terminal ones only by finalize's
// event (a handle shows RETIRED from then on; RunHandle::state()).
void ChipRunLane::set_state_locked(ChipRun& run, RunState state, absl::Status status) {
  run.state = state;
  if (is_terminal(state)) {
    run.status = std::move(status);
  } else {
    run.shared->state.store(state, std::memory_order_release);
  }
}

void ChipRunLane::launch_ready_locked() {
  for (auto& up : runs_) {
    ChipRun& run = *up;
    if (run.state == RunState::kLaunched || is_terminal(run.state)) continue;
    if (!poison_.ok()) {
      // A run still being prepared belongs to its submitter, which cancels it
      // itself once prepare returns.
      if (run.state != RunState::kPrepared) continue;
      // Never launched: fail it with the poison cause (or, when close()'s
      // deadline passed, its own cancellation); its set is provably unused.
      set_state_locked(run, RunState::kCancelled,
                       close_expired_ ? cancel_status_locked(run.id()) : poison_);
      continue;
    }
    if (run.state != RunState::kPrepared) break;  // FIFO: an earlier run is still preparing
    const int32_t on_device = launched_on_device_locked();
    if (on_device >= options_.launch_depth) break;
    // An unrecoverable error of a run ahead aborted the device (the stream
    // stops at a device fault): this run stays prepared until the lane reaps
    // that run, poisons the lane and cancels it with the poison cause.
    if (device_->aborted()) break;
    // The device reads and writes the run's records in its set, which is not
    // reused before the run retired (or ever, once quarantined) and outlives
    // the device's threads (the arena is destroyed after the device closed).
    RunRecords* records = run.records;
    const uint64_t id = run.id();
    run.timing.launch_ns = base::now_ns();
    auto rec = stream_->launch(id, [records](device::ExecContext& ctx) {
      const RunRecords& r = *records;
      if (r.host_built) {
        return chip::execute_graph_image(ctx, *r.callable, r.image_address, r.image_bytes, r.chip,
                                         r.max_cores, r.task_timing, &records->report);
      }
      if (r.graph != nullptr) {
        return chip::execute_recorded(ctx, *r.callable, r.graph->recording(), r.bound.data(),
                                      r.chip, r.max_cores, r.task_timing, &records->report);
      }
      return chip::execute_run(ctx, *r.callable, r.args, r.chip, r.max_cores, r.task_timing,
                               &records->report, r.capturing ? &records->capture : nullptr);
    });
    if (!rec.ok()) {
      if (device_->aborted()) {  // raced with an abort: as above
        run.timing.launch_ns = 0;
        break;
      }
      set_state_locked(run, RunState::kFailed,
                       base::mark_unrecoverable(
                           base::annotate(rec.status(), absl::StrCat("run ", id, " launch: "))));
      poison_locked(id, run.status);
      continue;
    }
    run.record = std::move(rec).value();
    set_state_locked(run, RunState::kLaunched);
    ++launched_;
    launched_now_.store(launched_, std::memory_order_relaxed);
    run.effective_depth = on_device + 1;
    // Launched by a submitting caller (tid 0) or by the lane thread after a reap (tid 1).
    span("launch", run.timing.launch_ns, base::now_ns(), id,
         std::this_thread::get_id() == thread_.get_id() ? 1 : 0);
  }
}

// The earliest unrecoverable run names the poison: a later run's refused
// launch may have set it first; a later run never replaces it.
void ChipRunLane::poison_locked(uint64_t run, const absl::Status& cause) {
  if (!poison_.ok() && run >= poisoned_by_) return;
  // Runs launched behind the poisoning run share one short drain window,
  // opened when that run is named: an earlier run that takes the poison over
  // (a refused launch poisoned first, then a run ahead of it timed out long
  // after) opens a fresh one, so the runs between them are not failed
  // unwaited-for and quarantined.
  behind_poison_deadline_ = env_.after(std::chrono::seconds(1));
  poison_ = base::mark_poisoned_by(
      base::mark_unrecoverable(absl::FailedPreconditionError(
          absl::StrCat("lane poisoned by run ", run, ": ", std::string(cause.message())))),
      run);
  poisoned_by_ = run;
}

bool ChipRunLane::behind_poison_locked(uint64_t run) const {
  return !poison_.ok() && run > poisoned_by_;
}

// Launched runs the device has not finished. A run whose launch record is
// already signalled no longer occupies the device even before the lane thread
// reaps it, so a successor's launch never waits on the lane thread's turn.
// Counted exactly (at most run_grant entries) even below the depth: the count
// is also each run's reported effective depth.
int32_t ChipRunLane::launched_on_device_locked() const {
  int32_t n = 0;
  for (const auto& r : runs_) {
    if (r->state == RunState::kLaunched && !r->record->done.is_signaled()) ++n;
  }
  return n;
}

// The lane thread: reap the head run when it is launched, then finalize and
// retire it; runs retire strictly in FIFO order (invariant 1).
void ChipRunLane::lane_loop() {
  base::MutexLock lock(mu_);
  while (true) {
    if (runs_.empty() && !head_claimed_) {
      if (closing_) return;
      lane_cv_.wait(lock);
      continue;
    }
    if (head_claimed_) {
      lane_cv_.wait(lock);  // a completion poller is retiring the head
      continue;
    }
    ChipRun& head = *runs_.front();
    if (head.state == RunState::kLaunched) {
      if (left_to_pollers_locked()) {
        lane_cv_.wait(lock);  // completion pollers reap it (woken when the last one stops)
        continue;
      }
      head_claimed_ = true;
      reap_locked(head, /*known_done=*/false);
      launch_ready_locked();  // the successor goes onto the device before we finalize
    } else if (!is_terminal(head.state)) {
      lane_cv_.wait(lock);  // still preparing, or waiting for launch capacity
      continue;
    } else {
      head_claimed_ = true;
    }
    retire_claimed_head_locked(/*keep_callback_errors=*/true);
  }
}

bool ChipRunLane::left_to_pollers_locked() const {
  return completion_pollers_ > 0 && admission_waiters_ == 0 && !closing_;
}

void ChipRunLane::retire_claimed_head_locked(bool keep_callback_errors) {
  // The head stays in runs_ (terminal and claimed, so nothing else acts on it) until retired.
  ChipRun& head = *runs_.front();
  mu_.unlock();
  finalize(head);
  mu_.lock();
  head.state = head.shared->result.terminal_state;  // FAILED when finalize's own step failed
  std::function<void(const RunResult&)> notify = std::move(head.on_finalized);
  std::shared_ptr<RunShared> shared = head.shared;
  retire_head_locked();
  if (notify) {
    mu_.unlock();
    absl::Status thrown;
    try {
      notify(shared->result);  // finalized: the result is immutable now
    } catch (...) {
      if (!keep_callback_errors) {
        mu_.lock();
        release_head_claim_locked();
        throw;
      }
      // On the lane thread nothing can take the exception (the run is retired, its result
      // final): kept for close() (the first; the others counted).
      thrown = base::status_from_current_exception(
          absl::StrCat("run ", shared->id.value, " on_finalized"));
    }
    mu_.lock();
    if (!thrown.ok()) {
      SIMPLER_LOG_ERROR("{}", std::string(thrown.message()));
      if (callback_error_.ok()) callback_error_ = thrown;
      ++callback_errors_;
    }
  }
  // Released only now: the next run's on_finalized never starts before this one's returned.
  release_head_claim_locked();
}

void ChipRunLane::release_head_claim_locked() {
  head_claimed_ = false;
  // The lane thread may be waiting for the claim (a poller retired the head), and close() waits
  // until no run is left and no notification is running.
  if (closing_ || (!runs_.empty() && !left_to_pollers_locked())) lane_cv_.notify_all();
  if (closing_) cv_.notify_all();
}

void ChipRunLane::set_completion_polling(bool on) {
  base::MutexLock lock(mu_);
  if (on) {
    ++completion_pollers_;
    return;
  }
  if (completion_pollers_ == 0) return;  // unmatched: nothing to undo
  // The last poller stopped: the lane thread takes over what is left.
  if (--completion_pollers_ == 0 && !runs_.empty()) lane_cv_.notify_all();
}

int32_t ChipRunLane::poll_completions() {
  if (!mu_.try_lock()) return 0;
  base::MutexLock lock(mu_, std::adopt_lock);
  int32_t retired = 0;
  while (!runs_.empty() && !head_claimed_) {
    ChipRun& head = *runs_.front();
    if (head.state == RunState::kLaunched) {
      if (!head.record->done.is_signaled()) break;
      head_claimed_ = true;
      reap_locked(head, /*known_done=*/true);
      launch_ready_locked();
    } else if (is_terminal(head.state)) {
      head_claimed_ = true;
    } else {
      break;  // still preparing, or waiting for launch capacity
    }
    retire_claimed_head_locked();
    ++retired;
  }
  return retired;
}

void ChipRunLane::reap_locked(ChipRun& run, bool known_done) {
  // Wait for the device outside the lock, bounded by the operation timeout.
  std::shared_ptr<device::LaunchRecord> rec = run.record;
  const int64_t reap_start = base::now_ns();
  // The run's own timeout, else the lane's; beyond the clock's range: forever.
  const double timeout_s =
      run.config.timeout_s > 0 ? run.config.timeout_s : options_.operation_timeout_s;
  // Behind a poisoned lane the device was aborted: the run fails with the
  // poison cause; wait only briefly for the device to drop it. A run
  // launched before the poisoning run (possible when a later launch was
  // refused) is not behind it: it finishes with its own result.
  const bool poisoned_before = behind_poison_locked(run.id());
  // When the run is expected to end on the device: it starts when its
  // predecessor ended (or at launch) and lasts as long as this callable's
  // recent runs. 0 = no estimate.
  int64_t expected_end = 0;
  if (auto it = run_ns_estimate_.find(run.records->callable);
      it != run_ns_estimate_.end() && !poisoned_before) {
    expected_end = std::max(run.timing.launch_ns, last_device_end_ns_) + it->second;
  }
  const base::Deadline deadline =
      poisoned_before ? behind_poison_deadline_ : env_.deadline_after(timeout_s).value();
  // The caller's lock scope still owns mu_: released here and retaken
  // before returning.
  bool done = true;
  if (known_done) {
    device_polls_.fetch_add(1, std::memory_order_relaxed);
  } else {
    mu_.unlock();
    done = await_record(*rec, expected_end, deadline);
    mu_.lock();
  }
  run.timing.complete_ns = base::now_ns();
  span("reap", reap_start, run.timing.complete_ns, run.id(), 1);
  --launched_;
  launched_now_.store(launched_, std::memory_order_relaxed);
  if (done) {
    run.record_done = true;
    run.timing.device_start_ns = rec->start_ns;
    run.timing.device_end_ns = rec->end_ns;
    last_device_end_ns_ = rec->end_ns;
    const int64_t took = rec->end_ns - rec->start_ns;
    auto [est, fresh] = run_ns_estimate_.emplace(run.records->callable, took);
    // Sleeping past the end delays the host (and, at depth 1, the next
    // launch), waking early only costs a poll: follow shorter runs at once,
    // longer ones slowly (a sample counts at most twice the estimate), so
    // one stalled run does not push the next reaps late.
    if (!fresh) track_low(est->second, std::min(took, 2 * est->second));
  }
  const absl::Status status = reaped_status_locked(run, done, *rec, timeout_s);
  set_state_locked(run, status.ok() ? RunState::kCompleted : RunState::kFailed, status);
}

// What a reaped run ends with; poisons the lane and aborts the device on an
// unrecoverable outcome, and marks the run quarantined when its device use
// is unproven.
absl::Status ChipRunLane::reaped_status_locked(ChipRun& run, bool done,
                                               const device::LaunchRecord& rec, double timeout_s) {
  if (!done) {
    run.quarantine = true;  // the device may still hold it
    // close(deadline) passed with this run still on the device.
    if (close_expired_) return cancel_status_locked(run.id());
    if (behind_poison_locked(run.id())) return poison_;
    // Named while the device still executes it: the abort below releases
    // hung tasks, after which nothing would say which task overran.
    const std::string executing =
        describe_executing(device_->executing(), run.id(), *run.records->callable);
    absl::Status overran = base::mark_unrecoverable(absl::DeadlineExceededError(absl::StrCat(
        "run ", run.id(), " did not finish within the operation timeout of ", timeout_s, " s; ",
        executing.empty()
            ? std::string("no task of it was executing (its orchestration was still running)")
            : "still executing: " + executing,
        "; device aborted")));
    poison_locked(run.id(), overran);
    device_->abort(overran);
    return overran;
  }
  absl::Status st = rec.done.status();
  if (close_expired_ && base::is_unrecoverable(st) && rec.end_ns >= close_expired_ns_) {
    // Stopped by close()'s abort (it ended after the abort): cancelled,
    // not a device failure. A fault that ended before keeps its error.
    return cancel_status_locked(run.id());
  }
  // Launched behind the run that poisoned the lane.
  if (behind_poison_locked(run.id())) return poison_;
  if (!st.ok() && base::is_unrecoverable(st)) {
    run.quarantine = true;  // device state unknown
    poison_locked(run.id(), st);
    device_->abort(poison_);
  }
  return st;
}

void ChipRunLane::retire_head_locked() {
  std::unique_ptr<ChipRun> owned = std::move(runs_.front());
  runs_.pop_front();
  // Retire: the set goes back, or into quarantine when device use is unproven
  // (its buffers then stay in use until the device closes).
  const int64_t retire_start = base::now_ns();
  if (owned->status.ok() && owned->captured != nullptr) {
    // Its fixed memory checked here, under the lock Worker::free's erase_using takes: a free
    // during the run (or behind the Worker, even if allocated again at the address) is seen.
    if (stale_fixed_memory(*owned->captured, owned->allocation_epoch).ok()) {
      graphs_.insert(owned->records->callable, std::move(owned->captured));
    } else {
      graphs_.count_stale_capture();
    }
  }
  // A replay's graph goes with the run; a quarantined set keeps it (the device may still read
  // it) until the Worker closes.
  if (!owned->quarantine) owned->records->graph.reset();
  absl::Status back =
      owned->quarantine ? arena_->quarantine(owned->set) : arena_->release(owned->set);
  if (!back.ok()) SIMPLER_LOG_ERROR("run {} retire: {}", owned->id(), back.ToString());
  if (owned->quarantine) {
    for (const auto& r : owned->device_ranges) quarantined_ranges_.push_back({owned->id(), r});
  }
  span("retire", retire_start, base::now_ns(), owned->id(), 1);
  ++retired_;
  if (!owned->status.ok() && first_error_.ok() && !close_expired_) {
    first_error_ = owned->status;
    first_error_run_ = owned->id();
  }
  if (!owned->status.ok() && !owned->shared->delivered.load(std::memory_order_acquire)) {
    failed_.push_back(owned->shared);
  }
  // Publish (RunHandle::state()'s order): the run is finalized and retired
  // (its set is back); the event is the one publication of done-ness
  // (Event::signal is a release: a thread that sees done() or RETIRED sees
  // the result).
  owned->shared->finalized.signal(owned->status);
  cv_.notify_all();
}

// Reaping without costing the device a wake-up: a thread sleeping on the
// record's event must be woken by the device thread that signals it, and that
// futex wake costs the signaller ~15 µs on a VM — right at the run boundary.
// So, when the end is predictable, the lane thread sleeps (on the event, with
// a deadline) until just before the predicted end (compensating how late its
// timer fires) and polls the record for at most kReapSpinNs; when a successor is
// queued it takes one more look kReapSpinNs later; only then does it sleep on
// the event. Each look counts as one device poll (at most three per run).

bool ChipRunLane::await_record(device::LaunchRecord& rec, int64_t expected_end,
                               const base::Deadline& deadline) {
  constexpr int64_t kReapSpinNs = 100'000;
  if (expected_end > 0 && deadline.kind != base::Deadline::Kind::kPoll) {
    // The prediction is on the device's clock (base::now_ns); the deadline
    // is on the lane's Env: translated once, as what is left of it.
    const int64_t left = env_.remaining_ns(deadline);
    const int64_t deadline_ns = left == std::numeric_limits<int64_t>::max()
                                    ? left
                                    : base::now_ns() + std::max<int64_t>(left, 0);
    const int64_t wake_at =
        std::min(expected_end - timer_lateness_ns_ - kReapSpinNs / 2, deadline_ns);
    if (wake_at > base::now_ns() + 2'000) {
      // Asleep on the event until then: a run that ends much earlier than
      // predicted (the estimate is stale) is reaped at once instead of at
      // the stale end — at the price of a device-paid wake-up for such runs.
      // A few µs after wake_at the lane is no longer a waiter, so the device
      // signals a run that ends on time without a wake-up.
      if (wait_record(rec, env_.after(std::chrono::nanoseconds(wake_at - base::now_ns())))) {
        device_polls_.fetch_add(1, std::memory_order_relaxed);
        return true;
      }
      // close()'s deadline passed: no more looks (the second one below is a
      // plain sleep, which nothing interrupts).
      if (interrupt_.load(std::memory_order_acquire)) return interrupted_wait(rec);
      // A wake-up that was late because the CPU was busy (not the timer) must
      // not make later wake-ups early, which would cost the device a wake-up
      // at the boundary.
      track_low(timer_lateness_ns_, std::clamp<int64_t>(base::now_ns() - wake_at, 0, 200'000));
    }
    device_polls_.fetch_add(1, std::memory_order_relaxed);
    // Polled yielding the CPU: on a machine with few CPUs the device thread that signals the
    // record may share this thread's CPU, and a pause-spin would hold it off for the whole
    // spin (docs/benchmarks.md: 100 µs per run when the scheduler packed both there).
    if (base::poll_yielding([&rec] { return rec.done.is_signaled(); }, kReapSpinNs)) return true;
    // Woke too early (the timer fired earlier than its usual lateness) or the
    // run overran its prediction: one more timed look, just after the
    // predicted end (or kReapSpinNs on when that has passed), late rather than
    // costing the device a wake-up at the boundary. Only worth it when a
    // successor is queued on the device: otherwise the wake-up costs an idle
    // device nothing and the host would only learn later.
    const int64_t look_at = std::max(expected_end + 10'000, base::now_ns() + kReapSpinNs);
    // Whether a successor is queued is read now, not when the wait began: at
    // depth 2 the host usually launches it while this run executes.
    const bool successor_queued = launched_now_.load(std::memory_order_relaxed) > 1;
    if (successor_queued && look_at < deadline_ns) {
      std::this_thread::sleep_until(base::steady_time(look_at));
      device_polls_.fetch_add(1, std::memory_order_relaxed);
      if (rec.done.is_signaled()) return true;
    }
  }
  device_polls_.fetch_add(1, std::memory_order_relaxed);
  return wait_record(rec, deadline);
}

// Sleeps on the record's event in slices of at most kInterruptSliceNs, so a
// close() whose deadline passed (interrupt_) stops the wait within a slice:
// nothing else can wake this thread while a kernel never returns.
bool ChipRunLane::wait_record(device::LaunchRecord& rec, const base::Deadline& deadline) {
  constexpr int64_t kInterruptSliceNs = 50'000'000;
  while (true) {
    if (interrupt_.load(std::memory_order_acquire)) return interrupted_wait(rec);
    if (deadline.kind == base::Deadline::Kind::kPoll) return rec.done.is_signaled();
    const bool last = env_.remaining_ns(deadline) <= kInterruptSliceNs;
    if (env_.wait(rec.done,
                  last ? deadline : env_.after(std::chrono::nanoseconds(kInterruptSliceNs)))) {
      return true;
    }
    if (last && env_.expired(deadline)) return rec.done.is_signaled();
  }
}

// Once close()'s deadline passed: the device was aborted, which releases hung
// tasks and drops queued runs at once — but not instantly, and not at all for a
// kernel that never returns. So every launched run gets what is left of one
// shared grace window to be proven done (and retire normally) before it is
// quarantined, keeping close() bounded.
bool ChipRunLane::interrupted_wait(device::LaunchRecord& rec) {
  const int64_t left = interrupt_grace_end_ns_.load(std::memory_order_relaxed) - base::now_ns();
  if (left <= 0) return rec.done.is_signaled();
  return rec.done.wait(base::Deadline::after(std::chrono::nanoseconds(left)));
}

// close()'s deadline passed with runs in flight: runs not launched are
// cancelled by the poison set here; launched ones still executing fail
// CANCELLED each (the lane thread stops waiting for them within a slice); the
// device is aborted so hung tasks return and nothing more is dispatched.
void ChipRunLane::expire_close_locked() {
  close_expired_ = true;
  close_expired_ns_ = base::now_ns();
  const absl::Status cause = base::mark_unrecoverable(absl::CancelledError(cancel_cause_locked()));
  if (poison_.ok()) {
    poison_ = base::mark_unrecoverable(
        absl::CancelledError(absl::StrCat("cancelled before launch: ", cancel_cause_locked())));
    poisoned_by_ = std::numeric_limits<uint64_t>::max();  // no run is "behind" it
    behind_poison_deadline_ = base::Deadline::poll();
  }
  interrupt_grace_end_ns_.store(base::now_ns() + kInterruptGraceNs, std::memory_order_relaxed);
  interrupt_.store(true, std::memory_order_release);
  launch_ready_locked();
  device_->abort(cause);
  lane_cv_.notify_all();
}

absl::Status ChipRunLane::cancel_status_locked(uint64_t run) const {
  return base::mark_unrecoverable(
      absl::CancelledError(absl::StrCat("run ", run, " cancelled: ", cancel_cause_locked())));
}

std::string ChipRunLane::cancel_cause_locked() const {
  std::string cause = "the lane was closed at its close deadline with the run still in flight";
  if (!first_error_.ok()) {
    absl::StrAppend(&cause, "; first error: run ", first_error_run_, ": ",
                    std::string(first_error_.message()));
  } else if (!poison_.ok() && poisoned_by_ != std::numeric_limits<uint64_t>::max()) {
    absl::StrAppend(&cause, "; ", std::string(poison_.message()));  // a real poison, not ours
  }
  return cause;
}

void ChipRunLane::finalize(ChipRun& run) {
  const int64_t start = base::now_ns();
  RunResult& res = run.shared->result;
  // The head is claimed: nothing else writes its state or status now.
  RunState terminal = run.state;
  if (run.status.ok()) {
    for (const auto& s : run.staged) {
      if (s.direction == task::ArgDirection::kIn) continue;
      absl::Status c = device_->copy_from_device(
          reinterpret_cast<void*>(static_cast<uintptr_t>(s.host)), s.device, s.bytes);
      if (!c.ok()) {
        run.status = base::annotate(c, absl::StrCat("run ", run.id(), " copy-back: "));
        break;
      }
    }
  }
  if (run.status.ok() && run.records->capturing && run.captured == nullptr) {
    // Device-built capture: the graph from what the device recorded, after the HOST outputs
    // were copied back (the run computed them; only its capture failed).
    absl::StatusOr<std::shared_ptr<const chip::CapturedGraph>> graph =
        build_capture(run, std::move(run.records->capture));
    if (graph.ok()) {
      run.captured = *std::move(graph);
    } else {
      run.status = graph.status();
    }
  }
  // A copy-back or capture error fails a run the device completed.
  if (!run.status.ok() && terminal == RunState::kCompleted) terminal = RunState::kFailed;
  // A copy: the set keeps the report's capacity for its next run, so the
  // device does not allocate for it in steady state.
  if (run.record_done) res.report = run.records->report;
  res.id = run.shared->id;
  res.resource_set = run.set;
  res.status = run.status;
  res.terminal_state = terminal;
  res.effective_depth = run.effective_depth;
  run.timing.finalize_ns = base::now_ns();
  res.timing = run.timing;
  span("finalize", start, base::now_ns(), run.id(), 1);

  if (options_.trace != nullptr && run.record_done) {
    options_.trace->add({"run", "device", run.timing.device_start_ns,
                         run.timing.device_end_ns - run.timing.device_start_ns, 1, 0,
                         static_cast<int64_t>(run.id()), -1});
    // One span per block, on the track of the core that ran it (a task's TaskTiming spans its
    // first block's start to its last block's end, on block 0's core); the block index only for
    // tasks of several blocks.
    for (const auto& b : res.report.blocks) {
      options_.trace->add({run.records->callable->kernels[b.kernel].name, "device", b.start_ns,
                           b.end_ns - b.start_ns, 1, 1 + b.core, static_cast<int64_t>(run.id()),
                           b.task, b.block_dim > 1 ? b.block : -1});
    }
  }
}

absl::Status ChipRunLane::release_if_unused(uint64_t address, uint64_t bytes,
                                            absl::FunctionRef<absl::Status()> release) {
  base::MutexLock lock(mu_);
  for (const auto& [callable, bound] : bindings_) {
    for (const auto& [b, n] : bound) {
      if (b < address + bytes && address < b + n) {
        return absl::FailedPreconditionError(absl::StrCat(
            "device buffer 0x", absl::Hex(address), " is bound to callable '", callable->name,
            "' (bound buffer 0x", absl::Hex(b), ", ", n, " bytes); unbind it first"));
      }
    }
  }
  for (const auto& [id, range] : quarantined_ranges_) {
    if (range.first < address + bytes && address < range.second) {
      return absl::FailedPreconditionError(absl::StrCat(
          "device buffer 0x", absl::Hex(address), " is named by run ", id,
          ", which is quarantined (its device use could not be proven finished); the buffer "
          "stays allocated until the Worker closes"));
    }
  }
  for (const auto& r : runs_) {
    for (const auto& [b, e] : r->device_ranges) {
      if (b < address + bytes && address < e) {
        return absl::FailedPreconditionError(absl::StrCat(
            "device buffer 0x", absl::Hex(address), " is in use by run ", r->id(), " (state ",
            std::string(name_of(r->state)), "); it stays valid until that run retires"));
      }
    }
  }
  SIMPLER_RETURN_IF_ERROR(release());
  graphs_.erase_using(address, bytes);
  return absl::OkStatus();
}

void ChipRunLane::wait_idle() {
  std::shared_ptr<RunShared> last;
  {
    base::MutexLock lock(mu_);
    if (runs_.empty()) return;
    last = runs_.back()->shared;
  }
  last->finalized.wait(base::Deadline::forever());
}

absl::Status ChipRunLane::bind(const task::ChipCallable* callable, uint64_t address,
                               uint64_t bytes) {
  if (callable == nullptr) return absl::InvalidArgumentError("bind: no callable");
  if (bytes == 0) {
    return absl::InvalidArgumentError(absl::StrCat("bind of device buffer 0x", absl::Hex(address),
                                                   " to '", callable->name, "': 0 bytes"));
  }
  base::MutexLock lock(mu_);
  if (closing_) return absl::FailedPreconditionError("bind after close(): the lane is closed");
  if (absl::Status live = device_->check_range(address, bytes); !live.ok()) {
    return base::annotate(live, absl::StrCat("bind to '", callable->name, "': "));
  }
  auto& bound = bindings_[callable];
  for (const auto& [b, n] : bound) {
    if (b == address) {
      return absl::AlreadyExistsError(absl::StrCat("device buffer 0x", absl::Hex(address),
                                                   " is already bound to '", callable->name, "'"));
    }
  }
  bound.emplace_back(address, bytes);
  return absl::OkStatus();
}

absl::Status ChipRunLane::unbind(const task::ChipCallable* callable, uint64_t address) {
  if (callable == nullptr) return absl::InvalidArgumentError("unbind: no callable");
  base::MutexLock lock(mu_);
  auto it = bindings_.find(callable);
  const auto is_address = [address](const auto& b) { return b.first == address; };
  if (it == bindings_.end() || std::none_of(it->second.begin(), it->second.end(), is_address)) {
    return absl::NotFoundError(absl::StrCat("device buffer 0x", absl::Hex(address),
                                            " is not bound to '", callable->name, "'"));
  }
  for (const auto& r : runs_) {
    if (r->records->callable != callable) continue;
    return absl::FailedPreconditionError(absl::StrCat(
        "cannot unbind device buffer 0x", absl::Hex(address), " from '", callable->name, "': run ",
        r->id(), " of it has not retired (state ", std::string(name_of(r->state)), ")"));
  }
  std::erase_if(it->second, is_address);
  if (it->second.empty()) bindings_.erase(it);
  return absl::OkStatus();
}

absl::Status ChipRunLane::close() { return close(base::Deadline::forever()); }

absl::Status ChipRunLane::close(const base::Deadline& deadline) {
  {
    base::MutexLock lock(mu_);
    if (closing_) {
      while (!closed_) cv_.wait(lock);  // another thread is closing: wait for it
      return absl::OkStatus();
    }
    closing_ = true;
    lane_cv_.notify_all();  // it reaps from now on even while completion pollers are on
    // Until every run retired and the last one's on_finalized returned (on a completion poller's
    // thread it may still run after the run left runs_).
    while (!runs_.empty() || head_claimed_) {
      if (close_expired_ || deadline.is_forever()) {
        cv_.wait(lock);
      } else if (!env_.expired(deadline)) {
        (void)env_.wait(cv_, lock, deadline);
      } else {
        expire_close_locked();
      }
    }
  }
  lane_cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  arena_->shutdown();
  base::MutexLock lock(mu_);
  closed_ = true;
  cv_.notify_all();
  absl::Status s = report_undelivered(&failed_);
  if (s.ok() && !callback_error_.ok()) {
    s = callback_errors_ > 1
            ? absl::Status(callback_error_.code(),
                           absl::StrCat(callback_error_.message(), " (and ", callback_errors_ - 1,
                                        " more on_finalized calls threw)"))
            : callback_error_;
  }
  return s;
}

LaneStats ChipRunLane::stats() const {
  base::MutexLock lock(mu_);
  LaneStats s;
  s.submitted = next_id_;
  s.retired = retired_;
  s.device_polls = device_polls_.load(std::memory_order_relaxed);
  s.in_flight = static_cast<int32_t>(runs_.size());
  s.launched = launched_;
  return s;
}

CaptureStats ChipRunLane::capture_stats() const {
  base::MutexLock lock(mu_);
  return graphs_.stats();
}

absl::Status ChipRunLane::poison() const {
  base::MutexLock lock(mu_);
  return poison_;
}

}  // namespace simpler::worker
