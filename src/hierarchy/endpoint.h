// A child chip worker as the level above it sees it: an *endpoint* that takes runs of callables
// registered by name and gives back live RunHandles with the L2 run semantics (ARCHITECTURE.md
// "Run lifecycle"): FIFO completion, each run's own error delivered exactly once, close() drains
// and reports only errors no wait() delivered. Three kinds, one contract
// (endpoint_contract_test.cc runs the same suite against each):
//
//  * lane    — an L2 worker::Worker in this process, called directly;
//  * thread  — a child worker served by its own thread behind a mailbox in this process's
//              memory (the whole transport, no fork);
//  * process — a forked child process behind a shared-memory mailbox (mailbox.h). The fork is
//              taken from a single-threaded point: start_process_child() refuses to fork a
//              process that already runs other threads (a multi-threaded parent cannot fork
//              safely). What the child runs crosses by name: callables are registered before
//              the fork and a request names one (run_request.h).
//
// A process child that dies (even by SIGKILL) fails every run it held, naming the child and its
// exit signal, within milliseconds (a reaper thread blocked in waitpid publishes the stop); a
// parent that dies takes its process children with it (PR_SET_PDEATHSIG, with the parent's pid
// taken before the fork).
#pragma once

#include <sys/types.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "hierarchy/mailbox.h"
#include "hierarchy/run_request.h"
#include "simpler/base/clock.h"
#include "simpler/task/callable.h"
#include "simpler/worker/run_handle.h"
#include "simpler/worker/worker.h"

namespace simpler::hierarchy {

// Thread-safe.
class Endpoint {
 public:
  virtual ~Endpoint() = default;
  // "child 1 (process 4242)", "child 0 (thread)", "child 0 (lane)": how errors name it.
  virtual std::string describe() const = 0;
  // Whether submit() would go out now without waiting for transport (a free request frame and
  // run-state entry; for a lane, a free run resource set of its worker). Running out is
  // backpressure, never an error.
  virtual bool can_dispatch() const = 0;
  // Submits a run of the callable registered under `request.callable`; returns a live handle at
  // once (blocking only for transport, until `admission`). The run's own errors (unknown
  // callable, bad arguments, kernel and device errors) are delivered by its handle, prefixed with
  // describe(). Errors returned here: FAILED_PRECONDITION after close() or once the endpoint
  // stopped (its reason: a child's death, a corrupt frame), DEADLINE_EXCEEDED when no transport
  // freed up by `admission`, INVALID_ARGUMENT when the request cannot be encoded.
  virtual absl::StatusOr<worker::RunHandle> submit(
      const RunRequest& request, const base::Deadline& admission = base::Deadline::forever()) = 0;
  // Refuses new submits, drains every run submitted (bounded by `deadline`: past it the runs
  // still held fail UNAVAILABLE naming the close), stops the child (a process child is waited
  // for, and SIGKILLed when it does not exit within 5 s). Returns the first error in run order
  // that no wait() delivered, with the count of the others; OK when none. Idempotent.
  virtual absl::Status close(const base::Deadline& deadline = base::Deadline::forever()) = 0;
  // Device memory on the child (zeroed) and its release; errors are the child worker's
  // (Worker::malloc / free), prefixed with describe(), or FAILED_PRECONDITION once the endpoint
  // stopped or closed.
  virtual absl::StatusOr<worker::DeviceBuffer> malloc(uint64_t bytes) = 0;
  virtual absl::Status free(const worker::DeviceBuffer& buffer) = 0;
  // Copies between host memory the child reads and writes at the same address (ChildSpec::
  // host_ranges: for a process child, memory mapped shared before the fork) and a child buffer
  // (`bytes` at `offset`). Ordered after every run submitted before (Worker::copy_to).
  // INVALID_ARGUMENT when the host range is not inside ChildSpec::host_ranges (checked in the
  // child too) or the device range exceeds the buffer.
  virtual absl::Status copy_to(const worker::DeviceBuffer& dst, const void* src, uint64_t bytes,
                               uint64_t offset = 0) = 0;
  virtual absl::Status copy_from(void* dst, const worker::DeviceBuffer& src, uint64_t bytes,
                                 uint64_t offset = 0) = 0;
  // Collects the runs that finished on the calling thread (their set_on_done callbacks run
  // here) and returns at once: without waiting, and without doing anything while another
  // thread is collecting. What a waiter calls while it polls (RunShared::progress), so a
  // finished run reaches it without a hand-off through the endpoint's own thread, which
  // collects otherwise. Must not be called from a set_on_done callback or with a lock the
  // callback takes. (A lane child's runs are queued by its worker's lane thread as they retire;
  // a mailbox child's are read from the run-state entries.)
  virtual void poll() {}
  // Whether a thread of the parent polls this endpoint (poll()) until told otherwise. While set,
  // the endpoint's own thread is not woken for finished runs — the poller collects them — so it
  // does not compete with the poller for a CPU (docs/benchmarks.md). The owner must
  // keep polling while it is set (a finished run then waits for the owner's next poll; the
  // endpoint's thread still looks by itself about once a second) and must clear it before
  // close(). Clearing it collects once on the calling thread, waiting for a collection in
  // progress: a run that finished while it was set is delivered by the time it returns, and
  // runs finishing later wake the endpoint's thread again. One owner sets it (the L3 worker's
  // child poller); not from a set_on_done callback or with a lock that callback takes.
  // Default: nothing.
  virtual void set_waiter_polling(bool polling) { (void)polling; }
  // Called with a run's id once its handle is done (after the handle's result is written),
  // in run order, on one of the endpoint's threads, a thread in poll() or the thread clearing
  // set_waiter_polling (for an L3 worker, also close()'s thread); set before the first
  // submit(). None of the
  // endpoint's run-table locks is held (only the one that keeps notifications in order), so it
  // may submit to this endpoint — but must not wait there for transport (check can_dispatch()
  // first: the thread it runs on is the one that frees transport), must not close() it (that
  // joins the thread running it) and must not wait for the endpoint's later runs. Lets a
  // scheduler advance on the completion itself, without a thread of its own.
  virtual void set_on_done(std::function<void(uint64_t run_id)> on_done) = 0;
  // The mailbox's grant (runs the child may hold at once; grant + K run-state entries) and its
  // change while runs go on (MailboxParent::regrant: sized into detached storage, checked by the
  // child against the region's extent, committed in one step; any error leaves the previous
  // grant and every run intact), prefixed with describe(). A lane has no mailbox: 0, and
  // FAILED_PRECONDITION.
  virtual absl::Status set_mailbox_grant(uint32_t grant) = 0;
  virtual uint32_t mailbox_grant() const = 0;
};

// What a child worker is built from: its Worker options (level 2; faults unset = the child
// reads SIMPLER_SIM_FAULTS), the callables it registers (by name), and its mailbox grant (run
// resource sets it may hold at once; 0 = the worker's effective grant).
struct ChildSpec {
  int32_t index = 0;  // the child's number in its parent (used in describe())
  worker::WorkerOptions options;
  std::vector<task::ChipCallable> callables;
  uint32_t grant = 0;
  // [begin, end) host ranges the child may copy from and to (copy_to / copy_from): memory it
  // sees at the same address as the parent. Anything else is refused.
  std::vector<std::pair<uint64_t, uint64_t>> host_ranges;
  // Run on the child's side, in order, once its worker is initialized and before it serves
  // anything (a process child: in the child process; given the child's index and worker): what
  // a callable needs that only the child can make — its device buffers, weights loaded from a
  // file. Registered before the fork like the callables; state it fills is the child's own. A
  // setup's error stops the child: start_lane_child returns it; a thread or process child
  // refuses every submit naming it ("... could not start its worker: ...").
  std::vector<std::function<absl::Status(int32_t child, worker::Worker& worker)>> setups;
};

// A lane endpoint: builds and initializes the worker here. Errors: the Worker's init and
// registration errors.
absl::StatusOr<std::unique_ptr<Endpoint>> start_lane_child(const ChildSpec& spec);
// A thread child: a mailbox in this process and a thread serving it with its own worker.
absl::StatusOr<std::unique_ptr<Endpoint>> start_thread_child(const ChildSpec& spec);
// A process child: forks. FAILED_PRECONDITION ("... this process runs N threads ...") when the
// process is not single-threaded; INTERNAL naming the system call when fork/memfd fail. The
// child's worker init errors come back as the endpoint's stop reason (every submit refused
// naming them).
absl::StatusOr<std::unique_ptr<Endpoint>> start_process_child(const ChildSpec& spec);
// Several process children, every one forked before any endpoint thread starts (an endpoint
// runs threads, so forking one child after another endpoint started would fork a threaded
// process). On error no child is left running.
absl::StatusOr<std::vector<std::unique_ptr<Endpoint>>> start_process_children(
    const std::vector<ChildSpec>& specs);

// Threads this process runs now (entries of /proc/self/task); 0 when it cannot tell.
int32_t process_thread_count();

// The child's side of one control command (serve_mailbox runs it for each): every field came
// from shared memory and is checked before use — an unknown op is INVALID_ARGUMENT, a copy's
// host range must lie in `host_ranges` (INVALID_ARGUMENT), a device range is the worker's to
// check (a live allocation, inside the buffer), a grant is checked against the region's extent
// (MailboxRegion::adopt_grant). Returns the reply to write over the command (the status code
// and its text, cut to kErrorTextBytes - 1; kMalloc: the new buffer's address).
ControlReply serve_control_command(const ControlCommand& command, worker::Worker& worker,
                                   MailboxRegion& region,
                                   const std::vector<std::pair<uint64_t, uint64_t>>& host_ranges);

// The child's side: serves `region` with `worker` (initialized; `handles` maps each callable
// name a request may carry to its registration) until the endpoint stops, then drains the runs
// it accepted. Requests are taken in publication order and each run's terminal state is written
// in that order; a request naming no registered callable, or one that does not decode, fails
// that run only. Control commands (malloc, free, copies) run on this thread, ordered among the
// requests; a copy's host range must lie in `host_ranges`. An error text longer than an entry
// holds is logged in full here. Blocks the calling thread; not reentrant.
void serve_mailbox(MailboxRegion& region, worker::Worker& worker,
                   const std::map<std::string, worker::CallableHandle>& handles,
                   const std::vector<std::pair<uint64_t, uint64_t>>& host_ranges);

}  // namespace simpler::hierarchy
