#include "simpler/worker/worker.h"

#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>

#include "absl/strings/str_cat.h"
#include "base/quarantine.h"
#include "simpler/base/status.h"
#include "simpler/base/sync.h"
#include "simpler/base/thread_annotations.h"
#include "worker/chip_worker.h"

namespace simpler::worker {

absl::Status WorkerOptions::validate() const {
  if (level != 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("WorkerOptions.level ", level, " is not supported (only 2: one chip)"));
  }
  if (platform != "sim") {
    return absl::InvalidArgumentError(
        absl::StrCat("WorkerOptions.platform '", platform, "' is unknown (available: sim)"));
  }
  if (device_id < 0) {
    return absl::InvalidArgumentError(absl::StrCat("WorkerOptions.device_id ", device_id, " < 0"));
  }
  if (num_cores < 0 || num_cores > device::kMaxSimCores) {
    return absl::InvalidArgumentError(absl::StrCat("WorkerOptions.num_cores ", num_cores,
                                                   " outside [0, ", device::kMaxSimCores,
                                                   "] (0 = one per hardware thread)"));
  }
  if (launch_depth < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("WorkerOptions.launch_depth ", launch_depth, " < 1"));
  }
  if (launch_depth > kMaxRunGrant) {
    return absl::InvalidArgumentError(absl::StrCat(
        "WorkerOptions.launch_depth ", launch_depth, " above ", kMaxRunGrant,
        " (the depth may not exceed the run grant, which is at most ", kMaxRunGrant, ")"));
  }
  const int32_t grant = effective_grant();
  if (run_grant < 0 || grant > kMaxRunGrant) {
    return absl::InvalidArgumentError(absl::StrCat("WorkerOptions.run_grant ", run_grant,
                                                   " outside [1, ", kMaxRunGrant,
                                                   "] (0 = launch_depth + 1)"));
  }
  if (grant < launch_depth) {
    return absl::InvalidArgumentError(
        absl::StrCat("WorkerOptions.run_grant ", grant, " is below launch_depth ", launch_depth));
  }
  if (!(operation_timeout_s > 0) || std::isinf(operation_timeout_s)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "WorkerOptions.operation_timeout_s must be finite and > 0, got ", operation_timeout_s));
  }
  if (max_captured_graphs < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("WorkerOptions.max_captured_graphs ", max_captured_graphs, " < 1"));
  }
  return chip.validate();
}

absl::StatusOr<task::Tensor> DeviceBuffer::tensor(std::initializer_list<int64_t> shape,
                                                  task::DataType dtype, uint64_t offset) const {
  return tensor(std::vector<int64_t>(shape), dtype, offset);
}

absl::StatusOr<task::Tensor> DeviceBuffer::tensor(const std::vector<int64_t>& shape,
                                                  task::DataType dtype, uint64_t offset) const {
  return task::Tensor::in_buffer(address, bytes, offset, shape.data(),
                                 static_cast<int32_t>(shape.size()), dtype,
                                 task::MemoryKind::kDevice);
}

absl::Status poison_cause(const absl::Status& refusal,
                          absl::FunctionRef<std::optional<RunHandle>(uint64_t run)> find) {
  const std::optional<uint64_t> run = base::poisoned_by(refusal);
  if (!run.has_value()) return refusal;
  std::optional<RunHandle> h = find(*run);
  if (!h.has_value() || !h->valid()) return refusal;
  absl::Status own = h->wait();
  return own.ok() ? refusal : own;
}

// --- ChipWorker (chip_worker.h) ---

ChipWorker::~ChipWorker() { (void)close(); }

absl::Status ChipWorker::init(
    const std::vector<std::shared_ptr<const task::ChipCallable>>* callables) {
  callables_ = callables;
  device::SimDeviceOptions d;
  d.device_id = options_.device_id;
  d.num_cores = options_.num_cores;
  d.memory_bytes = options_.device_memory_bytes;
  d.cpus = options_.device_cpus;
  if (options_.faults.has_value()) {
    d.faults = *options_.faults;
  } else {
    SIMPLER_ASSIGN_OR_RETURN(d.faults, device::FaultPlan::from_env());
  }
  SIMPLER_ASSIGN_OR_RETURN(device_, device::create_sim_device(d));
  SIMPLER_ASSIGN_OR_RETURN(stream_, device_->create_stream());
  arena_ =
      std::make_shared<RunResourceArena>(device_.get(), options_.effective_grant(), options_.env);
  const LaneOptions lane = {.launch_depth = options_.launch_depth,
                            .operation_timeout_s = options_.operation_timeout_s,
                            .chip = options_.chip,
                            .placement = options_.placement,
                            .trace = options_.trace,
                            .env = options_.env,
                            .max_captured_graphs = options_.max_captured_graphs};
  lane_ = std::make_unique<ChipRunLane>(device_.get(), stream_, arena_.get(), lane);
  return absl::OkStatus();
}

absl::Status ChipWorker::close(const base::Deadline& deadline) {
  if (closed_ || !device_) return absl::OkStatus();
  closed_ = true;
  // Drains while the device is up.
  absl::Status s = lane_ ? lane_->close(deadline) : absl::OkStatus();
  device_->close();  // joins the device threads; lane and arena stay for read-only queries
  abandoned_ = device_->abandoned_threads();
  if (abandoned_ > 0) {
    // A thread stuck in a kernel may still touch the device, the run records
    // in the arena and the callables: they stay alive until the process exits.
    base::keep_until_exit(device_);
    base::keep_until_exit(arena_);
    if (callables_ != nullptr) {
      for (const auto& c : *callables_) base::keep_until_exit(c);
    }
  }
  return s;
}

// --- Worker ---

struct Worker::Impl {
  explicit Impl(WorkerOptions o) : options(std::move(o)) {}

  // The chip init() built, or null before it (`initialized`, acquire, publishes it).
  ChipWorker* ready_chip() const {
    return initialized.load(std::memory_order_acquire) ? chip.get() : nullptr;
  }

  absl::Status check_ready() const {
    if (!initialized) return absl::FailedPreconditionError("Worker used before init()");
    if (closed) return absl::FailedPreconditionError("Worker used after close()");
    return absl::OkStatus();
  }

  const WorkerOptions options;
  std::vector<std::shared_ptr<const task::ChipCallable>> callables;
  std::unique_ptr<ChipWorker> chip;
  // Written by init()/close(), read by every call (acquire/release).
  std::atomic<bool> initialized{false};
  std::atomic<bool> closed{false};
  mutable base::Mutex buffers_mu;
  std::map<uint64_t, uint64_t> buffers SIMPLER_GUARDED_BY(buffers_mu);  // base -> bytes
  // Set once the first close() returned: calls racing it wait for this.
  base::Mutex close_mu;
  base::CondVar close_cv;
  bool close_done SIMPLER_GUARDED_BY(close_mu) = false;
};

Worker::Worker(WorkerOptions options) : impl_(std::make_unique<Impl>(std::move(options))) {}

Worker::~Worker() { (void)close(); }

absl::StatusOr<CallableHandle> Worker::register_callable(task::ChipCallable callable) {
  if (impl_->initialized) {
    return absl::FailedPreconditionError(
        absl::StrCat("register_callable('", callable.name, "') after init()"));
  }
  SIMPLER_RETURN_IF_ERROR(callable.validate());
  for (const auto& c : impl_->callables) {
    if (c->name == callable.name) {
      return absl::InvalidArgumentError(
          absl::StrCat("a callable named '", callable.name, "' is already registered"));
    }
  }
  impl_->callables.push_back(std::make_shared<const task::ChipCallable>(std::move(callable)));
  return CallableHandle{static_cast<uint32_t>(impl_->callables.size() - 1)};
}

absl::Status Worker::init() {
  if (impl_->initialized) return absl::FailedPreconditionError("Worker::init called twice");
  SIMPLER_RETURN_IF_ERROR(impl_->options.validate());
  auto chip = std::make_unique<ChipWorker>(impl_->options);
  SIMPLER_RETURN_IF_ERROR(chip->init(&impl_->callables));
  impl_->chip = std::move(chip);
  impl_->initialized.store(true, std::memory_order_release);  // publishes impl_->chip
  return absl::OkStatus();
}

absl::StatusOr<DeviceBuffer> Worker::malloc(uint64_t bytes) {
  SIMPLER_RETURN_IF_ERROR(impl_->check_ready());
  // Through the arena: staging cached by idle resource sets gives way when the heap is full.
  SIMPLER_ASSIGN_OR_RETURN(uint64_t addr, impl_->chip->arena().malloc(bytes));
  base::MutexLock lock(impl_->buffers_mu);
  impl_->buffers[addr] = bytes;
  return DeviceBuffer{addr, bytes};
}

absl::Status Worker::free(const DeviceBuffer& buffer) {
  SIMPLER_RETURN_IF_ERROR(impl_->check_ready());
  {
    base::MutexLock lock(impl_->buffers_mu);
    auto it = impl_->buffers.find(buffer.address);
    if (it == impl_->buffers.end()) {
      return absl::NotFoundError(absl::StrCat("free of 0x", absl::Hex(buffer.address),
                                              ": not a live buffer of this Worker"));
    }
    if (it->second != buffer.bytes) {  // as bind(): a buffer is its address and its size
      return absl::NotFoundError(absl::StrCat("free of 0x", absl::Hex(buffer.address), " (",
                                              buffer.bytes, " bytes): the buffer there has ",
                                              it->second, " bytes"));
    }
    // Checked and freed as one step under the lane's lock, so no run can
    // register these bytes in between (a run registered after it re-checks
    // its tensors at prepare and is refused).
    const uint64_t address = it->first;
    SIMPLER_RETURN_IF_ERROR(impl_->chip->lane().release_if_unused(
        address, it->second, [&] { return impl_->chip->device().free(address); }));
    impl_->buffers.erase(it);
  }
  return absl::OkStatus();
}

namespace {

// INVALID_ARGUMENT naming `op` unless [offset, offset + bytes) lies inside `buffer`.
absl::Status check_copy_range(const char* op, const DeviceBuffer& buffer, uint64_t bytes,
                              uint64_t offset) {
  if (offset > buffer.bytes || bytes > buffer.bytes - offset) {
    return absl::InvalidArgumentError(absl::StrCat(op, " of ", bytes, " bytes at offset ", offset,
                                                   " exceeds the ", buffer.bytes, "-byte buffer"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status Worker::copy_to(const DeviceBuffer& dst, const void* src, uint64_t bytes,
                             uint64_t offset) {
  SIMPLER_RETURN_IF_ERROR(impl_->check_ready());
  SIMPLER_RETURN_IF_ERROR(check_copy_range("copy_to", dst, bytes, offset));
  impl_->chip->lane().wait_idle();
  return impl_->chip->device().copy_to_device(dst.address + offset, src, bytes);
}

absl::Status Worker::copy_from(void* dst, const DeviceBuffer& src, uint64_t bytes,
                               uint64_t offset) {
  SIMPLER_RETURN_IF_ERROR(impl_->check_ready());
  SIMPLER_RETURN_IF_ERROR(check_copy_range("copy_from", src, bytes, offset));
  impl_->chip->lane().wait_idle();
  return impl_->chip->device().copy_from_device(dst, src.address + offset, bytes);
}

absl::StatusOr<RunHandle> Worker::submit(CallableHandle callable, const task::TaskArgs& args,
                                         const task::CallConfig& config, double admission_timeout_s,
                                         std::function<void(const RunResult&)> on_finalized) {
  SIMPLER_RETURN_IF_ERROR(impl_->check_ready());
  if (callable.index >= impl_->callables.size()) {
    return absl::InvalidArgumentError(absl::StrCat("unknown callable handle ", callable.index, " (",
                                                   impl_->callables.size(), " registered)"));
  }
  base::Env& env = impl_->options.env != nullptr ? *impl_->options.env : base::Env::real();
  SIMPLER_ASSIGN_OR_RETURN(base::Deadline admission, env.deadline_after(admission_timeout_s));
  return impl_->chip->lane().submit(impl_->callables[callable.index].get(), args, config, admission,
                                    std::move(on_finalized));
}

void Worker::set_completion_polling(bool on) {
  if (!impl_->check_ready().ok()) return;
  impl_->chip->lane().set_completion_polling(on);
}

int32_t Worker::poll_completions() {
  if (!impl_->check_ready().ok()) return 0;
  return impl_->chip->lane().poll_completions();
}

absl::Status Worker::run(CallableHandle callable, const task::TaskArgs& args,
                         const task::CallConfig& config) {
  SIMPLER_ASSIGN_OR_RETURN(RunHandle h, submit(callable, args, config));
  return h.wait();
}

absl::Status Worker::close() { return close(base::Deadline::forever()); }

absl::Status Worker::close(const base::Deadline& deadline) {
  if (!impl_->initialized.load(std::memory_order_acquire)) return absl::OkStatus();
  if (impl_->closed.exchange(true, std::memory_order_acq_rel)) {
    // Another call closes: return once it did, so that no caller sees OK with runs in flight,
    // or once this call's own deadline passed.
    base::Env& env = impl_->options.env != nullptr ? *impl_->options.env : base::Env::real();
    base::MutexLock lock(impl_->close_mu);
    while (!impl_->close_done) {
      if (env.expired(deadline)) {
        return absl::DeadlineExceededError(
            "close: another close() is still draining the runs at this call's deadline");
      }
      (void)env.wait(impl_->close_cv, lock, deadline);
    }
    return absl::OkStatus();
  }
  absl::Status s = impl_->chip->close(deadline);
  base::MutexLock lock(impl_->close_mu);
  impl_->close_done = true;
  impl_->close_cv.notify_all();
  return s;
}

absl::Status Worker::bind(CallableHandle callable, const DeviceBuffer& buffer) {
  SIMPLER_RETURN_IF_ERROR(impl_->check_ready());
  if (callable.index >= impl_->callables.size()) {
    return absl::InvalidArgumentError(absl::StrCat("bind: unknown callable handle ", callable.index,
                                                   " (", impl_->callables.size(), " registered)"));
  }
  base::MutexLock lock(impl_->buffers_mu);  // the buffer stays live while it is bound
  auto it = impl_->buffers.find(buffer.address);
  if (it == impl_->buffers.end() || it->second != buffer.bytes) {
    return absl::NotFoundError(absl::StrCat(
        "bind of 0x", absl::Hex(buffer.address), " (", buffer.bytes, " bytes) to '",
        impl_->callables[callable.index]->name, "': not a live buffer of this Worker"));
  }
  return impl_->chip->lane().bind(impl_->callables[callable.index].get(), buffer.address,
                                  buffer.bytes);
}

absl::Status Worker::unbind(CallableHandle callable, const DeviceBuffer& buffer) {
  SIMPLER_RETURN_IF_ERROR(impl_->check_ready());
  if (callable.index >= impl_->callables.size()) {
    return absl::InvalidArgumentError(absl::StrCat("unbind: unknown callable handle ",
                                                   callable.index, " (", impl_->callables.size(),
                                                   " registered)"));
  }
  return impl_->chip->lane().unbind(impl_->callables[callable.index].get(), buffer.address);
}

int32_t Worker::abandoned_threads() const {
  return impl_->chip != nullptr ? impl_->chip->abandoned_threads() : 0;
}

// Before init() there is no chip: the queries answer zeros (they dereferenced a null chip).
const device::DeviceCaps& Worker::caps() const {
  static const device::DeviceCaps kNone{};
  ChipWorker* chip = impl_->ready_chip();
  return chip != nullptr ? chip->device().caps() : kNone;
}
ArenaCounts Worker::resources() const {
  ChipWorker* chip = impl_->ready_chip();
  return chip != nullptr ? chip->arena().counts() : ArenaCounts{};
}
LaneStats Worker::lane_stats() const {
  ChipWorker* chip = impl_->ready_chip();
  return chip != nullptr ? chip->lane().stats() : LaneStats{};
}
CaptureStats Worker::capture_stats() const {
  ChipWorker* chip = impl_->ready_chip();
  return chip != nullptr ? chip->lane().capture_stats() : CaptureStats{};
}
device::Device& Worker::device() {
  if (impl_->ready_chip() == nullptr) {
    std::fprintf(stderr, "simpler: Worker::device() called before init() (a caller defect)\n");
    std::abort();
  }
  return impl_->chip->device();
}
const WorkerOptions& Worker::options() const { return impl_->options; }

}  // namespace simpler::worker
