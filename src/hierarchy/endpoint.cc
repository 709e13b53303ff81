#include "hierarchy/endpoint.h"

#include <dirent.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <deque>
#include <functional>
#include <limits>
#include <map>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/poll.h"
#include "simpler/base/clock.h"
#include "simpler/base/log.h"
#include "simpler/base/process.h"
#include "simpler/base/status.h"
#include "simpler/base/sync.h"
#include "simpler/base/thread.h"
#include "worker/run_shared.h"

namespace simpler::hierarchy {

namespace {

// A control command (malloc, free, a copy) gets this long; a copy waits for the runs before it. A
// process child that stalls on one is stopped sooner (MailboxEndpoint::watch_progress).
constexpr int64_t kControlTimeoutNs = 600'000'000'000;
constexpr int64_t kDoorbellSliceNs =
    1'000'000'000;  // a doorbell wait re-checks at least this often

double seconds_left(const base::Deadline& d) {
  switch (d.kind) {
    case base::Deadline::Kind::kForever:
      return std::numeric_limits<double>::infinity();
    case base::Deadline::Kind::kPoll:
      return -1;
    case base::Deadline::Kind::kAt:
      return std::max(0.0, (base::to_ns(d.at) - base::now_ns()) / 1e9);
  }
  return -1;
}

// Whether [address, address + bytes) lies inside one of `ranges`.
bool in_ranges(const std::vector<std::pair<uint64_t, uint64_t>>& ranges, uint64_t address,
               uint64_t bytes) {
  for (const auto& [b, e] : ranges) {
    if (address >= b && bytes <= e - b && address - b <= e - b - bytes) return true;
  }
  return false;
}

absl::Status host_range_error(uint64_t address, uint64_t bytes) {
  return absl::InvalidArgumentError(absl::StrCat(
      "host range 0x", absl::Hex(address), " + ", bytes,
      " bytes is not memory the child shares with its parent (ChildSpec::host_ranges)"));
}

// A child worker's callable handles, by callable name.
using Handles = std::map<std::string, worker::CallableHandle>;

// The parent's side of every endpoint: run identity, FIFO finalization,
// exactly-once delivery and close()'s accounting. Subclasses are transports.
class EndpointBase : public Endpoint {
 public:
  explicit EndpointBase(std::string description, const ChildSpec& spec)
      : description_(std::move(description)) {
    for (const task::ChipCallable& c : spec.callables) names_.push_back(c.name);
    host_ranges_ = spec.host_ranges;
  }

  std::string describe() const override { return description_; }

  absl::Status copy_to(const worker::DeviceBuffer& dst, const void* src, uint64_t bytes,
                       uint64_t offset) override {
    return checked_copy(ControlOp::kCopyTo, dst, reinterpret_cast<uintptr_t>(src), bytes, offset);
  }
  absl::Status copy_from(void* dst, const worker::DeviceBuffer& src, uint64_t bytes,
                         uint64_t offset) override {
    return checked_copy(ControlOp::kCopyFrom, src, reinterpret_cast<uintptr_t>(dst), bytes, offset);
  }
  void set_on_done(std::function<void(uint64_t run_id)> on_done) override {
    base::MutexLock lock(mu_);
    on_done_ = std::move(on_done);
  }

  absl::StatusOr<worker::RunHandle> submit(const RunRequest& request,
                                           const base::Deadline& admission) override {
    if (std::find(names_.begin(), names_.end(), request.callable) == names_.end()) {
      return absl::NotFoundError(
          absl::StrCat(description_, ": no callable named '", request.callable, "' is registered"));
    }
    SIMPLER_RETURN_IF_ERROR(request.config.validate());
    SIMPLER_RETURN_IF_ERROR(request.args.validate());
    base::MutexLock order(submit_mu_);  // runs go out in identity order
    auto shared = std::make_shared<worker::RunShared>();
    {
      // Registered before it is sent, so a close() racing this submit waits
      // for it (and its completion always finds it).
      base::MutexLock lock(mu_);
      if (closing_) {
        return absl::FailedPreconditionError(absl::StrCat(description_, ": submit after close()"));
      }
      if (!stop_.ok()) return stop_;
      shared->id = base::RunId{next_id_++};
      shared->state.store(worker::RunState::kLaunched, std::memory_order_release);
      shared->result.requested_depth = 1;
      runs_.push_back(Pending{shared, false, absl::OkStatus(), 0, 0});
    }
    absl::Status sent = send(shared->id.value, request, admission);
    if (!sent.ok()) {
      // Nothing went out: the run is withdrawn and its identity reused (this
      // submit holds submit_mu_, so it is the newest run).
      base::MutexLock lock(mu_);
      runs_.pop_back();
      --next_id_;
      cv_.notify_all();
      return sent;
    }
    return worker::RunHandle(shared);
  }

  absl::Status close(const base::Deadline& deadline) override {
    {
      base::MutexLock lock(mu_);
      if (closed_) return absl::OkStatus();
      closing_ = true;
      while (!runs_.empty()) {
        if (deadline.is_forever()) {
          cv_.wait(lock);
        } else if (!deadline.expired()) {
          (void)cv_.wait_until(lock, deadline.at);
        } else {
          break;
        }
      }
    }
    if (!drained()) {
      abort_transport(
          absl::StrCat(description_, " was closed at its deadline with runs still in flight"));
    }
    {
      base::MutexLock lock(mu_);
      while (!runs_.empty()) cv_.wait(lock);
    }
    shutdown_transport();
    base::MutexLock lock(mu_);
    closed_ = true;
    return worker::report_undelivered(&failed_);
  }

  void poll() final {
    if (!collect_mu_.try_lock()) return;  // the endpoint's thread (or another waiter) is at it
    base::MutexLock lock(collect_mu_, std::adopt_lock);
    collect_locked();
  }

  void set_waiter_polling(bool polling) final {
    mark_waiter_polling(polling);
    if (polling) return;
    // Runs that finished while the flag was set woke nobody: collected here, after the clear
    // (each transport's mark_waiter_polling says why none is missed), waiting for a collection
    // in progress.
    base::MutexLock lock(collect_mu_);
    collect_locked();
  }

 protected:
  // Sends run `id` (the next in order). Errors are submit()'s.
  virtual absl::Status send(uint64_t id, const RunRequest& request,
                            const base::Deadline& admission) = 0;
  // One collection: the runs the transport finished since the last one, each delivered with
  // complete(). The endpoint's own thread calls it under collect_mu_ too.
  virtual void collect_locked() SIMPLER_REQUIRES(collect_mu_) = 0;
  // Whether a waiter polls (set_waiter_polling): while it does, the transport does not wake the
  // endpoint's thread for finished runs. A clear is followed by one collect_locked().
  virtual void mark_waiter_polling(bool polling) = 0;
  // Held by whoever collects (the endpoint's thread, a waiter in poll(), the thread clearing
  // set_waiter_polling): one at a time, so one collection's runs are delivered before the next
  // one's and the clear waits for a collection in progress.
  base::Mutex collect_mu_;
  // A copy whose host range was checked against what the child shares; errors named.
  absl::Status checked_copy(ControlOp op, const worker::DeviceBuffer& buffer, uint64_t host,
                            uint64_t bytes, uint64_t offset) {
    const std::string what =
        description_ + (op == ControlOp::kCopyTo ? ": copy_to: " : ": copy_from: ");
    if (!in_ranges(host_ranges_, host, bytes)) {
      return base::annotate(host_range_error(host, bytes), what);
    }
    return base::annotate(copy(op, buffer, host, bytes, offset), what);
  }
  // The copy itself, the host range checked.
  virtual absl::Status copy(ControlOp op, const worker::DeviceBuffer& buffer, uint64_t host,
                            uint64_t bytes, uint64_t offset) = 0;
  // Makes every run still held end now with `reason` (close's deadline passed).
  virtual void abort_transport(const std::string& reason) = 0;
  // Stops the child and joins the transport's threads. Every run is finalized by then.
  virtual void shutdown_transport() = 0;

  // Run `id` ended with `status` (any order; finalized in run order), having
  // run on the child's device from `start_ns` to `end_ns` (0 = unknown). The first report of
  // a run counts; later ones are ignored.
  // set_on_done's callback runs after mu_ is released (it may submit to this endpoint), under
  // notify_mu_, so the notifications of consecutive completions keep run order.
  void complete(uint64_t id, const absl::Status& status, int64_t start_ns = 0, int64_t end_ns = 0) {
    base::MutexLock notify(notify_mu_);
    std::vector<uint64_t> finalized;
    std::function<void(uint64_t)> on_done;
    {
      base::MutexLock lock(mu_);
      bool found = false;
      for (Pending& p : runs_) {
        if (p.shared->id.value != id) continue;
        if (p.done)
          break;  // reported twice (a lane may finalize a run it refused): the first counts
        p.done = true;
        p.status = status;
        p.start_ns = start_ns;
        p.end_ns = end_ns;
        found = true;
        break;
      }
      if (found) finalize_ready_locked(&finalized);
      on_done = on_done_;
    }
    if (on_done) {
      for (uint64_t run : finalized) on_done(run);
    }
  }

  // Refuses new submits from now on with `status` (the endpoint stopped).
  void set_stopped(const absl::Status& status) {
    base::MutexLock lock(mu_);
    if (stop_.ok()) stop_ = status;
  }

  bool drained() const {
    base::MutexLock lock(mu_);
    return runs_.empty();
  }

 private:
  struct Pending {
    std::shared_ptr<worker::RunShared> shared;
    bool done = false;
    absl::Status status;
    int64_t start_ns = 0;
    int64_t end_ns = 0;
  };

  void finalize_ready_locked(std::vector<uint64_t>* finalized) SIMPLER_REQUIRES(mu_) {
    while (!runs_.empty() && runs_.front().done) {
      Pending p = std::move(runs_.front());
      runs_.pop_front();
      worker::RunResult& res = p.shared->result;
      res.id = p.shared->id;
      res.status = p.status.ok() ? p.status : base::annotate(p.status, description_ + ": ");
      res.terminal_state = p.status.ok() ? worker::RunState::kCompleted : worker::RunState::kFailed;
      res.effective_depth = 1;
      res.timing.device_start_ns = p.start_ns;
      res.timing.device_end_ns = p.end_ns;
      if (!res.status.ok()) failed_.push_back(p.shared);
      p.shared->finalized.signal(res.status);
      finalized->push_back(res.id.value);
    }
    cv_.notify_all();
  }

  const std::string description_;
  std::vector<std::string> names_;
  std::vector<std::pair<uint64_t, uint64_t>> host_ranges_;
  base::Mutex submit_mu_;
  base::Mutex notify_mu_;  // taken before mu_; held while on_done_ runs
  mutable base::Mutex mu_;
  base::CondVar cv_;
  uint64_t next_id_ SIMPLER_GUARDED_BY(mu_) = 0;
  std::deque<Pending> runs_ SIMPLER_GUARDED_BY(mu_);
  std::vector<std::shared_ptr<worker::RunShared>> failed_ SIMPLER_GUARDED_BY(mu_);
  std::function<void(uint64_t)> on_done_ SIMPLER_GUARDED_BY(mu_);
  absl::Status stop_ SIMPLER_GUARDED_BY(mu_);
  bool closing_ SIMPLER_GUARDED_BY(mu_) = false;
  bool closed_ SIMPLER_GUARDED_BY(mu_) = false;
};

// ---- lane: an L2 Worker in this process ----

class LaneEndpoint final : public EndpointBase {
 public:
  absl::Status set_mailbox_grant(uint32_t) override {
    return absl::FailedPreconditionError(
        describe() + " has no mailbox: its runs are bounded by its worker's run_grant");
  }
  uint32_t mailbox_grant() const override { return 0; }

  LaneEndpoint(const ChildSpec& spec, std::unique_ptr<worker::Worker> w, Handles handles)
      : EndpointBase(absl::StrCat("child ", spec.index, " (lane)"), spec),
        worker_(std::move(w)),
        handles_(std::move(handles)) {
    collector_ = std::thread([this] {
      base::set_thread_name("simpler-l3-lane");
      collect_loop();
    });
  }
  ~LaneEndpoint() override { (void)close(base::Deadline::forever()); }

  // A free run resource set: submit() then does not wait for admission.
  bool can_dispatch() const override { return worker_->resources().free > 0; }

  absl::StatusOr<worker::DeviceBuffer> malloc(uint64_t bytes) override {
    absl::StatusOr<worker::DeviceBuffer> b = worker_->malloc(bytes);
    if (!b.ok()) return base::annotate(b.status(), describe() + ": malloc: ");
    return b;
  }
  absl::Status free(const worker::DeviceBuffer& buffer) override {
    return base::annotate(worker_->free(buffer), describe() + ": free: ");
  }

 protected:
  absl::Status copy(ControlOp op, const worker::DeviceBuffer& buffer, uint64_t host, uint64_t bytes,
                    uint64_t offset) override {
    void* p = reinterpret_cast<void*>(static_cast<uintptr_t>(host));
    return op == ControlOp::kCopyTo ? worker_->copy_to(buffer, p, bytes, offset)
                                    : worker_->copy_from(p, buffer, bytes, offset);
  }
  absl::Status send(uint64_t id, const RunRequest& request,
                    const base::Deadline& admission) override {
    // The worker's lane thread hands each finished run over as it retires it (no thread of
    // ours waits on the handle in between); the collector thread or a polling waiter delivers
    // it (never the lane thread: delivering runs the scheduler, which may submit here).
    absl::StatusOr<worker::RunHandle> run = worker_->submit(
        handles_.at(request.callable), request.args, request.config, seconds_left(admission),
        [this, id](const worker::RunResult& r) {
          finished(Finished{id, r.status, r.timing.device_start_ns, r.timing.device_end_ns});
        });
    if (!run.ok()) {
      // What the child's lane refuses is the run's error, as for a mailbox child.
      if (run.status().code() == absl::StatusCode::kDeadlineExceeded) return run.status();
      finished(Finished{id, run.status(), 0, 0});
    }
    return absl::OkStatus();
  }
  void collect_locked() override SIMPLER_REQUIRES(collect_mu_) { deliver(take_finished()); }
  // The clear's collect sees finished()'s push, or that push's later look at the flag sees it
  // cleared: finished_mu_ orders the two.
  void mark_waiter_polling(bool polling) override {
    waiter_polling_.store(polling, std::memory_order_seq_cst);
  }
  void abort_transport(const std::string& reason) override {
    (void)reason;  // the lane's close names its own cause
    (void)worker_->close(base::Deadline::poll());
  }
  void shutdown_transport() override {
    {
      base::MutexLock lock(finished_mu_);
      stopping_ = true;
    }
    finished_cv_.notify_all();
    if (collector_.joinable()) collector_.join();
    // Each run's error went to the endpoint's own handle (on_finalized delivers nothing to the
    // worker's), so the worker's report of undelivered errors repeats them: not used.
    (void)worker_->close();
  }

 private:
  struct Finished {
    uint64_t id;
    absl::Status status;
    int64_t start_ns, end_ns;
  };

  void finished(Finished f) {
    {
      base::MutexLock lock(finished_mu_);
      finished_.push_back(std::move(f));
    }
    // A polling waiter collects it (set_waiter_polling): the collector sleeps on.
    if (!waiter_polling_.load(std::memory_order_seq_cst)) finished_cv_.notify_one();
  }
  std::deque<Finished> take_finished() {
    base::MutexLock lock(finished_mu_);
    return std::exchange(finished_, {});
  }
  // Completes runs in any order (EndpointBase finalizes them in run order).
  void deliver(const std::deque<Finished>& done) {
    for (const Finished& f : done) complete(f.id, f.status, f.start_ns, f.end_ns);
  }

  void collect_loop() {
    while (true) {
      {
        base::MutexLock lock(finished_mu_);
        // Timed: while a waiter polls, finished() does not notify; should that waiter stop
        // polling without clearing the flag, runs still come out within a second.
        while (finished_.empty() && !stopping_) {
          (void)finished_cv_.wait_until(
              lock, std::chrono::steady_clock::now() + std::chrono::nanoseconds(kDoorbellSliceNs));
        }
        if (finished_.empty()) return;  // stopping: close() drained every run first
      }
      base::MutexLock lock(collect_mu_);
      collect_locked();
    }
  }

  std::unique_ptr<worker::Worker> worker_;
  const Handles handles_;  // by callable name
  base::Mutex finished_mu_;
  base::CondVar finished_cv_;
  std::deque<Finished> finished_ SIMPLER_GUARDED_BY(finished_mu_);  // not yet delivered
  bool stopping_ SIMPLER_GUARDED_BY(finished_mu_) = false;
  std::atomic<bool> waiter_polling_{false};
  std::thread collector_;
};

// A child's worker, initialized, with its callables registered.
absl::StatusOr<std::unique_ptr<worker::Worker>> build_worker(const ChildSpec& spec,
                                                             Handles* handles) {
  auto w = std::make_unique<worker::Worker>(spec.options);
  for (const task::ChipCallable& c : spec.callables) {
    SIMPLER_ASSIGN_OR_RETURN((*handles)[c.name], w->register_callable(c));
  }
  SIMPLER_RETURN_IF_ERROR(w->init());
  for (const auto& setup : spec.setups) {
    absl::Status s;
    try {
      s = setup(spec.index, *w);
    } catch (...) {
      s = base::status_from_current_exception("child setup");
    }
    if (!s.ok()) {
      (void)w->close();
      return base::annotate(s, "setup: ");
    }
  }
  return w;
}

// ---- mailbox: thread and process children ----

class MailboxEndpoint final : public EndpointBase {
 public:
  // `child_pid` > 0 for a process child (reaped here); `serve` for a thread
  // child (run on a thread of its own over this endpoint's region).
  MailboxEndpoint(const ChildSpec& spec, std::string description, MailboxRegion region,
                  pid_t child_pid, std::function<void(MailboxRegion&)> serve)
      : EndpointBase(std::move(description), spec),
        region_(std::move(region)),
        parent_(&region_),
        child_pid_(child_pid),
        stall_limit_ns_(stall_limit_ns(child_pid, spec.options.operation_timeout_s)) {
    if (serve) {
      server_ = std::thread([this, serve = std::move(serve)] {
        base::set_thread_name("simpler-l3-thread");
        serve(region_);
      });
    }
    collector_ = std::thread([this] {
      base::set_thread_name("simpler-l3-collect");
      collect_loop();
    });
    if (child_pid_ > 0) {
      reaper_ = std::thread([this] {
        base::set_thread_name("simpler-l3-reap");
        int wstatus = 0;
        pid_t r;
        do {
          r = waitpid(child_pid_, &wstatus, 0);
        } while (r < 0 && errno == EINTR);
        {
          base::MutexLock lock(mu_);
          reaped_ = true;
          cv_.notify_all();
        }
        // A child that died without the parent stopping it first: every run it
        // held fails naming it and how it died.
        publish_stop(region_,
                     r == child_pid_
                         ? absl::StrCat(describe(), " ", base::describe_wait_status(wstatus))
                         : absl::StrCat(describe(), ": waitpid: ", std::strerror(errno)));
      });
    }
  }
  ~MailboxEndpoint() override { (void)close(base::Deadline::forever()); }

  bool can_dispatch() const override { return parent_.can_dispatch(); }

  absl::Status set_mailbox_grant(uint32_t grant) override {
    return base::annotate(parent_.regrant(grant, kControlTimeoutNs), describe() + ": ");
  }
  uint32_t mailbox_grant() const override { return parent_.grant(); }

  absl::StatusOr<worker::DeviceBuffer> malloc(uint64_t bytes) override {
    ControlCommand c;
    c.op = static_cast<uint32_t>(ControlOp::kMalloc);
    c.device_bytes = bytes;
    absl::StatusOr<ControlReply> r = parent_.control(c, kControlTimeoutNs);
    if (!r.ok()) return base::annotate(r.status(), describe() + ": malloc: ");
    return worker::DeviceBuffer{r->device, bytes};
  }
  absl::Status free(const worker::DeviceBuffer& buffer) override {
    ControlCommand c;
    c.op = static_cast<uint32_t>(ControlOp::kFree);
    c.device = buffer.address;
    c.device_bytes = buffer.bytes;
    return base::annotate(parent_.control(c, kControlTimeoutNs).status(), describe() + ": free: ");
  }

 protected:
  absl::Status copy(ControlOp op, const worker::DeviceBuffer& buffer, uint64_t host, uint64_t bytes,
                    uint64_t offset) override {
    ControlCommand c;
    c.op = static_cast<uint32_t>(op);
    c.device = buffer.address;
    c.device_bytes = buffer.bytes;
    c.host = host;
    c.bytes = bytes;
    c.offset = offset;
    return parent_.control(c, kControlTimeoutNs).status();
  }
  absl::Status send(uint64_t id, const RunRequest& request,
                    const base::Deadline& admission) override {
    SIMPLER_ASSIGN_OR_RETURN(std::vector<uint8_t> bytes, encode_run_request(request));
    while (true) {
      const uint32_t seen = parent_.doorbell();
      if (std::optional<std::string> why = parent_.stop_reason(); why.has_value()) {
        absl::Status s = absl::FailedPreconditionError(
            absl::StrCat("submit to ", describe(), ": the endpoint stopped: ", *why));
        set_stopped(s);
        return s;
      }
      if (parent_.can_dispatch()) {
        absl::StatusOr<Ticket> t = parent_.publish(id, bytes);
        if (t.ok()) return absl::OkStatus();
        if (t.status().code() != absl::StatusCode::kResourceExhausted) return t.status();
        continue;  // raced with a stop; look again
      }
      if (admission.expired()) {
        return absl::DeadlineExceededError(
            absl::StrCat("submit to ", describe(),
                         ": no request frame or run-state entry freed before the "
                         "admission deadline (",
                         parent_.in_flight(), " runs in flight)"));
      }
      int64_t slice = kDoorbellSliceNs;
      if (admission.kind == base::Deadline::Kind::kAt) {
        slice = std::clamp<int64_t>(base::to_ns(admission.at) - base::now_ns(), 1, slice);
      }
      parent_.wait(seen, slice);
    }
  }
  void abort_transport(const std::string& reason) override { parent_.stop(reason); }
  void shutdown_transport() override {
    // The child drains what it accepted, sees the stop and exits.
    {
      base::MutexLock lock(mu_);
      stopping_ = true;
    }
    parent_.stop(absl::StrCat(describe(), " was closed by its parent"));
    if (collector_.joinable()) collector_.join();
    if (server_.joinable()) server_.join();
    if (child_pid_ > 0) {
      base::MutexLock lock(mu_);
      const auto grace = std::chrono::steady_clock::now() + std::chrono::seconds(5);
      while (!reaped_) {
        if (!cv_.wait_until(lock, grace)) {
          SIMPLER_LOG_WARN("{} did not exit within 5 s of being stopped: SIGKILL", describe());
          (void)kill(child_pid_, SIGKILL);
          while (!reaped_) cv_.wait(lock);
        }
      }
    }
    if (reaper_.joinable()) reaper_.join();
  }

  // The completions the child wrote, delivered in the order collected.
  void collect_locked() override SIMPLER_REQUIRES(collect_mu_) {
    for (const Completion& c : parent_.collect()) {
      complete(c.ticket.run_id, c.status, c.device_start_ns, c.device_end_ns);
    }
  }
  // Terminal states whose rings saw the flag set are seen by the clear's collect
  // (MailboxParent::set_polled).
  void mark_waiter_polling(bool polling) override { parent_.set_polled(polling); }

 private:
  // A process child's stall limit: twice its operation timeout plus 1 s, in ns (none for a thread
  // child, whose stuck thread could not be stopped, or an infinite timeout: 0).
  static int64_t stall_limit_ns(pid_t child_pid, double operation_timeout_s) {
    if (child_pid <= 0 || !std::isfinite(operation_timeout_s)) return 0;
    return static_cast<int64_t>((2 * operation_timeout_s + 1) * 1e9);
  }

  void collect_loop() {
    Progress progress{parent_.completions(), parent_.controls_published(), base::now_ns()};
    while (true) {
      const uint32_t seen = parent_.completions();
      {
        base::MutexLock lock(collect_mu_);
        collect_locked();
      }
      if (std::optional<std::string> why = parent_.stop_reason(); why.has_value()) {
        set_stopped(absl::FailedPreconditionError(
            absl::StrCat("submit to ", describe(), ": the endpoint stopped: ", *why)));
        base::MutexLock lock(mu_);
        if (stopping_ && parent_.in_flight() == 0) return;
      } else {
        watch_progress(seen, progress);
      }
      parent_.wait_completions(seen, kDoorbellSliceNs);
    }
  }

  // The completion and control-command counts last seen to move, and when (or when the child
  // last had nothing to do).
  struct Progress {
    uint32_t completions;
    uint32_t controls;
    int64_t since_ns;
  };
  // A process child that, with runs in flight, completes nothing and is given no new command for
  // stall_limit_ns_ is stopped (SIGSTOP, a debugger) or hung where its own operation timeout
  // cannot fire; with only a control command (malloc, free, a copy, a grant change) out, one that
  // answers nothing for as long while it is stopped (its scheduler state). Every run it held
  // fails naming that, as does the command's caller (publish_stop, the first reason wins), and it
  // is killed, so its reaper returns and close() does not wait for it. A live child completes a
  // run at least once an operation timeout plus its host preparation (the device runs them one at
  // a time, each bounded by the timeout), so twice the timeout plus 1 s never fires on one; a
  // command's own time is unbounded (a copy's bytes, the child's setups before it), hence the
  // state.
  void watch_progress(uint32_t seen, Progress& p) {
    const int64_t now = base::now_ns();
    // The command first: one published after this read moves the count read next.
    const std::optional<ControlOp> control = parent_.control_out();
    const uint32_t controls = parent_.controls_published();
    const int32_t in_flight = parent_.in_flight();
    if (seen != p.completions || controls != p.controls || (in_flight == 0 && !control)) {
      p = {seen, controls, now};
      return;
    }
    if (stall_limit_ns_ == 0 || now - p.since_ns < stall_limit_ns_) return;
    // A command alone (no run) may legitimately take long: a copy of gigabytes, or one sent
    // while the child still loads its model (its setups). It counts as a stall only while the
    // child is stopped (SIGSTOP, a debugger), never while it works.
    if (in_flight == 0) {
      const char state = base::process_state(child_pid_);
      if (state != 'T' && state != 't') return;
    }
    const std::string waiting =
        in_flight > 0 ? absl::StrCat(in_flight, " run(s) in flight")
                      : absl::StrCat("its ", control_op_name(static_cast<uint32_t>(*control)),
                                     " command unanswered");
    publish_stop(region_,
                 absl::StrCat(describe(), " completed nothing for ", (now - p.since_ns) / 1e9,
                              " s with ", waiting, ", past twice its operation timeout plus 1 s (",
                              stall_limit_ns_ / 1e9, " s): it is stopped or hung; killed"));
    SIMPLER_LOG_WARN("{}: completed nothing for {:.1f} s with {}: SIGKILL", describe(),
                     (now - p.since_ns) / 1e9, waiting);
    (void)kill(child_pid_, SIGKILL);
  }

  MailboxRegion region_;
  MailboxParent parent_;
  const pid_t child_pid_;
  const int64_t stall_limit_ns_;  // watch_progress's limit; 0: none
  std::thread server_;
  std::thread collector_;
  std::thread reaper_;
  base::Mutex mu_;
  base::CondVar cv_;
  bool stopping_ SIMPLER_GUARDED_BY(mu_) = false;
  bool reaped_ SIMPLER_GUARDED_BY(mu_) = false;
};

}  // namespace

int32_t process_thread_count() {
  DIR* d = opendir("/proc/self/task");
  if (d == nullptr) return 0;
  int32_t n = 0;
  while (dirent* e = readdir(d)) {
    if (e->d_name[0] != '.') ++n;
  }
  closedir(d);
  return n;
}

ControlReply serve_control_command(const ControlCommand& c, worker::Worker& w,
                                   MailboxRegion& region,
                                   const std::vector<std::pair<uint64_t, uint64_t>>& host_ranges) {
  absl::Status st;
  ControlReply reply;
  const worker::DeviceBuffer buffer{c.device, c.device_bytes};
  void* host = reinterpret_cast<void*>(static_cast<uintptr_t>(c.host));
  switch (static_cast<ControlOp>(c.op)) {
    case ControlOp::kMalloc: {
      absl::StatusOr<worker::DeviceBuffer> b = w.malloc(c.device_bytes);
      if (b.ok()) reply.device = b->address;
      st = b.status();
      break;
    }
    case ControlOp::kFree:
      st = w.free(buffer);
      break;
    case ControlOp::kCopyTo:
    case ControlOp::kCopyFrom:
      if (!in_ranges(host_ranges, c.host, c.bytes)) {
        st = host_range_error(c.host, c.bytes);
      } else if (static_cast<ControlOp>(c.op) == ControlOp::kCopyTo) {
        st = w.copy_to(buffer, host, c.bytes, c.offset);
      } else {
        st = w.copy_from(host, buffer, c.bytes, c.offset);
      }
      break;
    case ControlOp::kRegrant:
      // Checked against the region's extent before the table is installed (adopt_grant).
      st = region.adopt_grant(c.grant);
      break;
    default:
      st = absl::InvalidArgumentError(absl::StrCat("unknown control op ", c.op));
  }
  reply.code = static_cast<int32_t>(st.code());
  const std::string text(st.message().substr(0, kErrorTextBytes - 1));
  std::memcpy(reply.text, text.data(), text.size());
  reply.text_bytes = static_cast<uint32_t>(text.size());
  return reply;
}

namespace {

// serve_mailbox's terminal states go out in acceptance order, each as soon as its run finished:
// written by the thread that retires the run — the worker's lane thread, or serve_mailbox's
// while it polls completions — in Worker::submit's on_finalized (no thread of our own in
// between), or by serve_mailbox for a request refused before it ran. Shared with the
// notifications, which may come after a refusal already ended a slot.
struct ResultSlot {
  Ticket ticket;
  bool done = false;
  absl::Status status;
  int64_t start_ns = 0, end_ns = 0;
  worker::RunHandle handle;  // set once submit() returned, when still pending
};
struct ResultOrder {
  base::Mutex mu;
  base::CondVar cv;
  std::deque<std::shared_ptr<ResultSlot>> slots SIMPLER_GUARDED_BY(mu);
};

// Ends a slot (a refusal and a notification: the first one counts) and writes the terminal
// states of the done slots at the head of `order` to the mailbox, in order. Copied into each
// run's notification; `out` is used only while a slot is pending (serve_mailbox waits for them).
struct FinishSlot {
  std::shared_ptr<ResultOrder> order;
  MailboxChild* out;
  void operator()(const std::shared_ptr<ResultSlot>& slot, const absl::Status& status,
                  int64_t start_ns, int64_t end_ns) const;
};

void FinishSlot::operator()(const std::shared_ptr<ResultSlot>& slot, const absl::Status& status,
                            int64_t start_ns, int64_t end_ns) const {
  base::MutexLock lock(order->mu);
  if (slot->done) return;  // a refusal and a notification: the first one counts
  slot->done = true;
  slot->status = status;
  slot->start_ns = start_ns;
  slot->end_ns = end_ns;
  while (!order->slots.empty() && order->slots.front()->done) {
    const ResultSlot& s = *order->slots.front();
    if (!s.status.ok() && s.status.message().size() >= kErrorTextBytes) {
      SIMPLER_LOG_ERROR("run {} (its error is truncated in the mailbox): {}", s.ticket.run_id,
                        s.status.ToString());
    }
    (void)out->complete(s.ticket, s.status, s.start_ns, s.end_ns);
    // The parent receives the error: delivered here, so the worker's close() does not report it.
    if (s.handle.valid()) (void)s.handle.wait();
    order->slots.pop_front();
  }
  order->cv.notify_all();
}

// Queues a slot for `req` (before the submit: its notification may come first), decodes and
// submits it; a request refused finishes its slot here.
void accept_request(const Request& req, worker::Worker& w,
                    const std::map<std::string, worker::CallableHandle>& handles,
                    const std::shared_ptr<ResultOrder>& order, const FinishSlot& finish) {
  auto slot = std::make_shared<ResultSlot>();
  slot->ticket = req.ticket;
  {
    base::MutexLock lock(order->mu);
    order->slots.push_back(slot);  // before the submit: its notification may come first
  }
  absl::Status refused;
  absl::StatusOr<RunRequest> decoded = decode_run_request(req.payload);
  if (!decoded.ok()) {
    refused = decoded.status();
  } else if (auto it = handles.find(decoded->callable); it == handles.end()) {
    refused = absl::NotFoundError(
        absl::StrCat("no callable named '", decoded->callable, "' is registered"));
  } else {
    absl::StatusOr<worker::RunHandle> run = w.submit(
        it->second, decoded->args, decoded->config, std::numeric_limits<double>::infinity(),
        [finish, slot](const worker::RunResult& r) {
          finish(slot, r.status, r.timing.device_start_ns, r.timing.device_end_ns);
        });
    if (!run.ok()) {
      refused = run.status();
    } else {
      base::MutexLock lock(order->mu);
      if (slot->done) {
        (void)run->wait();  // already written to the mailbox: done, delivered here
      } else {
        slot->handle = *run;
      }
    }
  }
  if (!refused.ok()) finish(slot, refused, 0, 0);
}

}  // namespace

void serve_mailbox(MailboxRegion& region, worker::Worker& w,
                   const std::map<std::string, worker::CallableHandle>& handles,
                   const std::vector<std::pair<uint64_t, uint64_t>>& host_ranges) {
  MailboxChild child(&region);
  // Terminal states go out in acceptance order (ResultOrder, FinishSlot).
  auto order = std::make_shared<ResultOrder>();
  const FinishSlot finish{order, &child};
  // While this thread polls the doorbell anyway, it also reaps its runs (Worker's polled
  // completion): a short run then finishes without waking the worker's lane thread, which on a
  // machine with few CPUs is one more runnable thread between the device and the terminal state
  // (docs/benchmarks.md). For one poll window from a request's arrival, while that
  // pays off (base::AdaptivePoll: runs longer than the window are left to the lane thread).
  base::AdaptivePoll completion_poll(kDoorbellSpinNs);
  bool polling = false;
  int64_t poll_until = 0;
  const auto stop_polling = [&w, &polling] {
    if (polling) w.set_completion_polling(false);
    polling = false;
  };
  const auto pending = [&order] {
    base::MutexLock lock(order->mu);
    return !order->slots.empty();
  };
  while (true) {
    const uint32_t seen = child.doorbell();
    if (polling) {
      // Each turn of the loop, requests arriving or not: a stream of requests does not hold
      // back the terminal states of the runs before them.
      (void)w.poll_completions();
      if (!pending()) {
        completion_poll.polled(true);
        stop_polling();
      } else if (base::now_ns() >= poll_until) {
        completion_poll.polled(false);  // left to the lane thread from here on
        stop_polling();
      }
    }
    if (std::optional<ControlCommand> c = child.take_control(); c.has_value()) {
      stop_polling();  // a command may wait for the runs in flight: the lane thread reaps them
      child.reply_control(serve_control_command(*c, w, region, host_ranges));
      continue;
    }
    absl::StatusOr<std::optional<Request>> taken = child.take();
    if (!taken.ok()) break;  // stopped (by the parent, or a frame nobody can attribute)
    if (!taken->has_value()) {
      if (polling) {
        std::this_thread::yield();
        continue;
      }
      child.wait(seen, kDoorbellSliceNs);
      continue;
    }
    if (!polling) {
      if (const int64_t window = completion_poll.window_ns(); window > 0) {
        w.set_completion_polling(true);
        polling = true;
        poll_until = base::now_ns() + window;
      }
    }
    accept_request(**taken, w, handles, order, finish);
  }
  // Stopped: the runs accepted still finish (reaped by the lane thread), and their terminal
  // states are written, in order.
  stop_polling();
  base::MutexLock lock(order->mu);
  while (!order->slots.empty()) order->cv.wait(lock);
}

absl::StatusOr<std::unique_ptr<Endpoint>> start_lane_child(const ChildSpec& spec) {
  Handles handles;
  SIMPLER_ASSIGN_OR_RETURN(std::unique_ptr<worker::Worker> w, build_worker(spec, &handles));
  return std::unique_ptr<Endpoint>(new LaneEndpoint(spec, std::move(w), std::move(handles)));
}

namespace {

uint32_t grant_of(const ChildSpec& spec) {
  return spec.grant != 0 ? spec.grant : static_cast<uint32_t>(spec.options.effective_grant());
}

}  // namespace

absl::StatusOr<std::unique_ptr<Endpoint>> start_thread_child(const ChildSpec& spec) {
  SIMPLER_ASSIGN_OR_RETURN(MailboxRegion region, MailboxRegion::create(grant_of(spec)));
  Handles handles;
  SIMPLER_ASSIGN_OR_RETURN(std::unique_ptr<worker::Worker> built, build_worker(spec, &handles));
  std::shared_ptr<worker::Worker> w(std::move(built));
  return std::unique_ptr<Endpoint>(
      new MailboxEndpoint(spec, absl::StrCat("child ", spec.index, " (thread)"), std::move(region),
                          0, [w, handles, ranges = spec.host_ranges](MailboxRegion& r) {
                            serve_mailbox(r, *w, handles, ranges);
                            (void)w->close();
                          }));
}

absl::StatusOr<std::vector<std::unique_ptr<Endpoint>>> start_process_children(
    const std::vector<ChildSpec>& specs) {
  const int32_t threads = process_thread_count();
  if (threads != 1) {
    return absl::FailedPreconditionError(absl::StrCat(
        "process children are forked from a single-threaded point, but this process runs ",
        threads == 0 ? std::string("an unknown number of") : absl::StrCat(threads),
        " threads; start the process children (L3 init) before any thread starts"));
  }
  // Every child is forked before any endpoint thread starts.
  struct Forked {
    MailboxRegion region;
    pid_t pid;
  };
  std::vector<Forked> forked;
  const auto kill_forked = [&forked] {
    for (Forked& f : forked) {
      (void)kill(f.pid, SIGKILL);
      (void)waitpid(f.pid, nullptr, 0);
    }
  };
  const pid_t parent = getpid();
  for (const ChildSpec& spec : specs) {
    absl::StatusOr<MailboxRegion> region = MailboxRegion::create(grant_of(spec));
    if (!region.ok()) {
      kill_forked();
      return region.status();
    }
    std::fflush(nullptr);
    const pid_t pid = fork();
    if (pid < 0) {
      const absl::Status s = absl::InternalError(absl::StrCat("fork: ", std::strerror(errno)));
      kill_forked();
      return s;
    }
    if (pid == 0) {
      // The child: dies with its parent (the pid was taken before the fork,
      // so a parent that died before the prctl is caught too). Mailboxes of
      // its earlier-forked siblings are closed here: not its business.
      (void)prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != parent) _exit(1);
      forked.clear();
      const std::string who = absl::StrCat("child ", spec.index, " (process ", getpid(), ")");
      Handles handles;
      absl::StatusOr<std::unique_ptr<worker::Worker>> w = build_worker(spec, &handles);
      if (!w.ok()) {
        publish_stop(
            *region,
            absl::StrCat(who, " could not start its worker: ", std::string(w.status().message())));
        _exit(1);
      }
      serve_mailbox(*region, **w, handles, spec.host_ranges);
      (void)(*w)->close();
      _exit(0);
    }
    forked.push_back(Forked{std::move(*region), pid});
  }
  std::vector<std::unique_ptr<Endpoint>> out;
  for (size_t i = 0; i < specs.size(); ++i) {
    out.push_back(std::unique_ptr<Endpoint>(new MailboxEndpoint(
        specs[i], absl::StrCat("child ", specs[i].index, " (process ", forked[i].pid, ")"),
        std::move(forked[i].region), forked[i].pid, nullptr)));
  }
  return out;
}

absl::StatusOr<std::unique_ptr<Endpoint>> start_process_child(const ChildSpec& spec) {
  SIMPLER_ASSIGN_OR_RETURN(std::vector<std::unique_ptr<Endpoint>> one,
                           start_process_children({spec}));
  return std::move(one.front());
}

}  // namespace simpler::hierarchy
