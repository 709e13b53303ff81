// The shared-memory mailbox between an L3 parent and one process-mode child (ARCHITECTURE.md "L3";
// reference/004). It keeps *transport* apart from *execution lifetime*:
//
//   region             count          holds
//   header             1              magic, version, grant, byte extent, doorbells, stop reason
//   control frame      1              start-up and control commands (kFrameBytes)
//   request frames     K = 2          one submission's bytes each (kFrameBytes), handed back to
//                                     the parent as soon as the child copied them out
//   run-state entries  M = grant + K  one in-flight run each: identity, state, code, error text
//
// The layout is plain versioned structs (no pointer, no byte-offset table): MailboxLayout, then
// RunEntry[M]. Both sides map the same memfd; every word the other side writes is read through an
// atomic or copied out and bounds-checked before use.
//
// Hand-off rules (each has a test that fails when it breaks, and Promela models,
// tests/protocol/mailbox*.pml, check them for K = 2 and a small grant):
//  * A frame is the parent's while kFree and the child's while kPublished. The parent's
//    publication (state = kPublished) is its last store to a frame; the child's ACK (state =
//    kFree) is its last store to a frame — the parent may refill it the instant it sees the ACK.
//  * An entry's generation is odd while occupied and even while free. The parent claims an entry
//    (generation to odd, state kClaimed) before publishing the frame that names it, and frees it
//    (generation to even, state kFree) only after it read a terminal state.
//  * The child writes an entry's terminal state (kCompleted / kFailed) as its last store to that
//    entry, after the code and error text; the parent may free the entry the instant it sees it.
//  * A frame naming a live entry at a generation that moved on is returned untouched (ACKed, no
//    entry written). A frame naming an index outside the table, or an even generation, stops the
//    endpoint with a published reason; the parent then gives every run it held a terminal status
//    with that cause.
//  * Whoever publishes checks first that a frame and an entry are free (can_dispatch()); running
//    out of either is ordinary backpressure, never an error path.
//  * Waiting is on futex doorbells in the shared region (a bounded poll, yielding, then a futex
//    sleep; no unbounded spinning): the parent rings the child's after publishing; the child
//    rings the parent's after an ACK and the completion doorbell after a terminal state — without
//    waking its sleepers while a parent thread polls the entries itself (parent_polling: the
//    poller collects the run; the thread that clears the flag collects once after it, so no
//    terminal state is left unseen).
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/poll.h"
#include "simpler/base/sync.h"
#include "simpler/base/thread_annotations.h"

namespace simpler::hierarchy {

inline constexpr uint32_t kMailboxMagic = 0x584d4253;  // "SBMX" in memory order
inline constexpr uint32_t kMailboxVersion = 2;
inline constexpr uint32_t kRequestFrames = 2;       // K
inline constexpr uint32_t kFrameBytes = 64 * 1024;  // one request or control frame, header included
inline constexpr uint32_t kErrorTextBytes = 256;    // an entry's error text, NUL included
inline constexpr uint32_t kStopReasonBytes = 512;   // the published stop reason, NUL included
inline constexpr uint32_t kMaxMailboxGrant = 1024;  // worker::kMaxRunGrant
// Appended to an error text cut to fit an entry; the full text goes to the child's log.
inline constexpr char kTruncationMarker[] = " [...truncated]";

enum class FrameState : uint32_t { kFree = 0, kPublished = 1 };
enum class EntryState : uint32_t {
  kFree = 0,       // no run (generation even)
  kClaimed = 1,    // the parent claimed it for a run whose frame is published or being published
  kAccepted = 2,   // the child copied the run's request out of its frame
  kCompleted = 3,  // terminal: the run succeeded
  kFailed = 4,     // terminal: `code` / `error` say why
};
bool is_terminal(EntryState s);

struct FrameHeader {
  std::atomic<uint32_t> state;  // FrameState
  uint32_t entry_index;         // the run-state entry this frame's run occupies
  uint32_t entry_generation;    // that entry's generation when the parent claimed it (odd)
  uint32_t payload_bytes;       // <= kFramePayloadBytes
  uint64_t run_id;
};
inline constexpr uint32_t kFramePayloadBytes = kFrameBytes - sizeof(FrameHeader);

struct RequestFrame {
  FrameHeader header;
  uint8_t payload[kFramePayloadBytes];
};
static_assert(sizeof(RequestFrame) == kFrameBytes);

struct RunEntry {
  std::atomic<uint32_t> generation;  // odd while occupied, even while free
  std::atomic<uint32_t> state;       // EntryState
  uint64_t run_id;                   // written by the parent at claim
  int32_t code;                      // absl::StatusCode of a terminal state (0 for kCompleted)
  uint32_t error_bytes;              // bytes of `error` used, < kErrorTextBytes
  int64_t device_start_ns;           // the run on the child's device (CLOCK_MONOTONIC ns; 0 =
  int64_t device_end_ns;             // not executed), written with the terminal state
  char error[kErrorTextBytes];
};
static_assert(std::atomic<uint32_t>::is_always_lock_free,
              "shared-memory atomics must be lock-free");

// A futex word the other side rings, and how many threads sleep on it: a ring wakes (a system
// call) only when someone sleeps. A waiter first polls the word for a bounded time
// (kDoorbellSpinNs, while polling pays off: base::AdaptivePoll), yielding the CPU between looks,
// then sleeps; no waiter spins without bound.
struct Doorbell {
  std::atomic<uint32_t> value;
  std::atomic<uint32_t> sleepers;
};
inline constexpr int64_t kDoorbellSpinNs = 50'000;

struct MailboxHeader {
  uint32_t magic;
  uint32_t version;
  uint32_t grant;         // run resource sets the child may hold at once
  uint32_t entry_count;   // grant + K
  uint64_t region_bytes;  // mailbox_bytes(grant)
  int32_t parent_pid;     // taken before any child is forked
  std::atomic<int32_t> child_pid;
  Doorbell child_doorbell;       // the child sleeps on it; the parent rings it
  Doorbell parent_doorbell;      // publishers and control commands sleep on it; ACKs ring it
  Doorbell completion_doorbell;  // the parent's collector sleeps on it; terminal states ring it
  // Nonzero while a parent thread polls the entries itself (MailboxParent::set_polled): a
  // terminal state's ring then wakes no sleeper. Written by the parent, read by the child; a
  // wrong value only costs a wake-up or delays one until the sleeper's timeout.
  std::atomic<uint32_t> parent_polling;
  std::atomic<uint32_t> stopped;  // 0 running; 1 once stop_reason is published
  uint32_t stop_reason_bytes;
  char stop_reason[kStopReasonBytes];
};

// The fixed part of the region; RunEntry[entry_count] follows it.
struct MailboxLayout {
  MailboxHeader header;
  RequestFrame control;
  RequestFrame frames[kRequestFrames];
};

// Bytes of a mailbox for `grant` (sizeof(MailboxLayout) + (grant + K) * sizeof(RunEntry)).
// INVALID_ARGUMENT when grant is outside [1, kMaxMailboxGrant].
absl::StatusOr<uint64_t> mailbox_bytes(uint32_t grant);

// Where a run stands in the mailbox: its entry and that entry's (odd) generation.
struct Ticket {
  uint32_t entry = 0;
  uint32_t generation = 0;
  uint64_t run_id = 0;
};

// The mapping of one mailbox: a memfd (mode 0600) sized to the grant. Owns the fd and the
// mapping; movable, not copyable. Its accessors and adopt_grant may be called from several
// threads (a thread child's parent and child share one region); prepare_grant is the parent's
// alone (MailboxParent::regrant serializes it). MailboxParent / MailboxChild are thread-safe.
class MailboxRegion {
 public:
  // A fresh region for `grant`: header written, every frame free, every entry free at
  // generation 0. The fd is close-on-exec unless `inheritable`. INVALID_ARGUMENT for a grant
  // outside [1, kMaxMailboxGrant]; INTERNAL naming the system call when memfd/mmap fails.
  static absl::StatusOr<MailboxRegion> create(uint32_t grant);
  // Maps an existing region (the child's side) and checks it before anything else is read: the
  // mapped byte extent (fstat) holds the header, the magic and version match, the grant is in
  // range and mailbox_bytes(grant) == region_bytes <= the extent, entry_count == grant + K.
  // FAILED_PRECONDITION naming the first mismatch. Takes ownership of `fd` on success.
  static absl::StatusOr<MailboxRegion> attach(int fd);

  // Grant changes, two-phase (the parent's MailboxParent::regrant drives them):
  // prepare_grant (parent) sizes detached storage: grows the memfd and maps its new tail, and
  // clears the entries between the current table's end and the new one's — memory no side
  // reads until the commit. The committed table, header and mapping of everything below are
  // untouched, so a failure (INVALID_ARGUMENT for a grant outside [1, kMaxMailboxGrant];
  // INTERNAL naming ftruncate or mmap) leaves the region at its previous grant.
  absl::Status prepare_grant(uint32_t grant);
  // adopt_grant (either side) commits: checks the grant against the region's byte extent
  // (fstat) before anything is mapped or read — FAILED_PRECONDITION naming both sizes when it
  // does not hold the table, INVALID_ARGUMENT for a grant out of range, nothing changed on
  // either — then maps what is missing and publishes the new entry count in one store.
  // Thread-safe against entry() (a shrink is the caller's to make safe: no entry above the new
  // table may be in use). The region's base address never moves: the whole largest mailbox's
  // address range is reserved when it is mapped.
  absl::Status adopt_grant(uint32_t grant);

  MailboxRegion(MailboxRegion&& other) noexcept;
  MailboxRegion& operator=(MailboxRegion&& other) noexcept;
  MailboxRegion(const MailboxRegion&) = delete;
  MailboxRegion& operator=(const MailboxRegion&) = delete;
  ~MailboxRegion();

  int fd() const { return fd_; }
  // The bytes the committed grant needs (mailbox_bytes(grant)).
  uint64_t bytes() const { return bytes_.load(std::memory_order_acquire); }
  uint32_t entry_count() const { return entry_count_.load(std::memory_order_acquire); }
  MailboxLayout& layout() const { return *static_cast<MailboxLayout*>(base_); }
  MailboxHeader& header() const { return layout().header; }
  RequestFrame& frame(uint32_t i) const { return layout().frames[i]; }  // i < kRequestFrames
  // nullptr when `i` is outside the table this side validated (never read past the mapping).
  RunEntry* entry(uint32_t i) const;

 private:
  MailboxRegion(int fd, void* base, uint64_t mapped, uint64_t bytes, uint32_t entry_count);
  // Maps `fd`'s first `bytes` (page-rounded) at the start of a fresh reservation of the
  // largest mailbox's address range; returns the base or MAP_FAILED (errno set).
  static void* map_reserved(int fd, uint64_t bytes);
  // Maps [mapped_, bytes) of the file behind what is mapped (the tail only).
  absl::Status map_to(uint64_t bytes);
  void reset();
  int fd_ = -1;
  void* base_ = nullptr;
  uint64_t mapped_ = 0;  // page-rounded bytes of the file mapped at base_
  std::atomic<uint64_t> bytes_{0};
  // Validated at create/attach/adopt_grant; never re-read from shared memory.
  std::atomic<uint32_t> entry_count_{0};
};

// One run's outcome as the parent collects it.
struct Completion {
  Ticket ticket;
  absl::Status status;
  int64_t device_start_ns = 0;  // as the child reported them (base::now_ns's clock)
  int64_t device_end_ns = 0;
};

// A control command in the control frame: the parent's memory operations on the child's
// device. Plain struct, copied in and out of the frame's payload and checked on arrival.
// kRegrant: the child adopts the grant in `grant` (MailboxParent::regrant).
enum class ControlOp : uint32_t {
  kMalloc = 1,
  kFree = 2,
  kCopyTo = 3,
  kCopyFrom = 4,
  kRegrant = 5
};
// The op's name ("malloc", "free", "copy_to", "copy_from", "regrant"; "?" for another value).
std::string control_op_name(uint32_t op);
struct ControlCommand {
  uint32_t op = 0;            // ControlOp
  uint32_t grant = 0;         // kRegrant
  uint64_t device = 0;        // the device buffer (kFree, kCopyTo, kCopyFrom)
  uint64_t device_bytes = 0;  // its size (kFree, kCopyTo, kCopyFrom); bytes to allocate (kMalloc)
  uint64_t host = 0;          // memory the child sees at the same address (kCopyTo, kCopyFrom)
  uint64_t bytes = 0;         // bytes to copy
  uint64_t offset = 0;        // into the device buffer
};
// The child's answer, written over the command before its ACK.
struct ControlReply {
  int32_t code = 0;  // absl::StatusCode
  uint32_t text_bytes = 0;
  uint64_t device = 0;  // kMalloc: the new buffer's address
  char text[kErrorTextBytes] = {};
};

// The parent's half. Thread-safe (one internal mutex; the child is the only other writer).
class MailboxParent {
 public:
  // `region` must outlive this object. Records this process's pid as the parent's.
  explicit MailboxParent(MailboxRegion* region);

  // True when a request frame and a run-state entry are free and the endpoint is not stopped:
  // a publish() now succeeds.
  bool can_dispatch() const;
  // Claims a free entry for `run_id` and publishes `payload` in a free frame, then rings the
  // child. Errors: INVALID_ARGUMENT (payload longer than kFramePayloadBytes), FAILED_PRECONDITION
  // (the endpoint stopped: its reason), RESOURCE_EXHAUSTED (no free frame or entry: the caller
  // skipped can_dispatch(), a caller defect; nothing was claimed).
  absl::StatusOr<Ticket> publish(uint64_t run_id, std::span<const uint8_t> payload);
  // Frees the entries that hold a terminal state and returns their runs' outcomes; once the
  // endpoint stopped, also every run still held, failed with UNAVAILABLE naming the stop reason.
  // Rings the parent doorbell when it freed any (a publisher may be waiting for an entry).
  std::vector<Completion> collect();
  // Stops the endpoint with `reason` (kept when a reason is already published): new publishes
  // are refused and collect() fails every run still held with it. Used when the child died
  // ("child 1234 killed by signal 9 (Killed)") or the parent closes.
  void stop(const std::string& reason);
  // The published stop reason, when the endpoint stopped (by either side).
  std::optional<std::string> stop_reason() const;
  // Runs published and not yet collected.
  int32_t in_flight() const;
  // Requests published whose frames the child has not ACKed yet.
  int32_t frames_in_use() const;
  // Runs `command` in the child through the control frame and returns its reply: waits until
  // every request frame was taken (so the command is ordered after the runs published before
  // it), publishes the command, rings the child and waits for its ACK. One command at a time.
  // Errors: FAILED_PRECONDITION when the endpoint stopped (before or while waiting: its reason);
  // DEADLINE_EXCEEDED after `timeout_ns`; the child's own error for the command.
  // A command the child does not answer by the deadline stops the endpoint (what the child did
  // with it is unknown, and the control frame cannot be reused).
  absl::StatusOr<ControlReply> control(const ControlCommand& command, int64_t timeout_ns);
  // Changes the grant (the run-state entries are grant + K) while runs go on: sizes detached
  // storage (MailboxRegion::prepare_grant), has the child check the new table against the
  // region's extent and adopt it (a kRegrant control command, ordered after the runs published
  // before), then commits this side's table and the header in one step. Until the commit,
  // publish() claims only entries both tables hold. Grant changes and control commands take
  // turns (concurrent calls wait). Errors, each leaving the previous grant intact (table,
  // header, every run in flight): INVALID_ARGUMENT for a grant outside [1, kMaxMailboxGrant];
  // FAILED_PRECONDITION when shrinking below an entry a run holds (naming it and the run) or
  // the endpoint stopped; the sizing's INTERNAL error; the child's refusal. A child that does
  // not answer within `timeout_ns` is DEADLINE_EXCEEDED and stops the endpoint, as control().
  absl::Status regrant(uint32_t grant, int64_t timeout_ns);
  // Control commands published so far (a grant change is one), and the op of the one still out
  // (published, its reply not seen yet), if any: what a watch on the child's progress reads.
  uint32_t controls_published() const;
  std::optional<ControlOp> control_out() const;
  // The committed grant (this side's table: grant + K entries).
  uint32_t grant() const;

  // The parent doorbell's current value (rung by ACKs, control replies, freed entries and a
  // stop), and a wait until it moves from `seen` (or `timeout_ns` passes; spurious returns are
  // possible — re-check). The wait polls first while polling pays off on this side
  // (base::AdaptivePoll over kDoorbellSpinNs), then sleeps.
  uint32_t doorbell() const;
  void wait(uint32_t seen, int64_t timeout_ns) const;
  // The same for the completion doorbell (rung by terminal states and a stop): what the thread
  // that collects by itself sleeps on. While set_polled(true) is in effect the wait does not poll
  // (another thread does) and the child's terminal states do not wake it.
  uint32_t completions() const;
  void wait_completions(uint32_t seen, int64_t timeout_ns) const;
  // Whether a thread of this parent polls collect() itself (a waiter on a run): while set, the
  // child's terminal states ring the completion doorbell without waking its sleepers, so the
  // collector thread stays asleep instead of competing with the poller for a CPU. Clearing it
  // (a seq_cst store, then a seq_cst load of the completion doorbell) must be followed by one
  // collect() on the clearing thread: a terminal state whose ring saw the flag set is then seen
  // by that collect (the ring's increment and flag load, and this store and load, cannot both
  // miss each other). Thread-safe; the callers keep the flag's owner single
  // (hierarchy::Endpoint::set_waiter_polling).
  void set_polled(bool polled);

 private:
  mutable base::AdaptivePoll poll_{kDoorbellSpinNs};
  mutable base::AdaptivePoll completion_poll_{kDoorbellSpinNs};
  bool can_dispatch_locked() const SIMPLER_REQUIRES(mu_);
  absl::StatusOr<ControlReply> control_locked(const ControlCommand& command, int64_t timeout_ns)
      SIMPLER_REQUIRES(control_mu_);
  std::optional<std::string> stop_reason_locked() const SIMPLER_REQUIRES(mu_);

  MailboxRegion* region_;
  mutable base::Mutex mu_;
  base::Mutex control_mu_;  // one control command at a time (taken before mu_)
  int32_t in_flight_ SIMPLER_GUARDED_BY(mu_) = 0;
  // Entries publish() may claim: the table's size, or both tables' during a regrant.
  uint32_t claim_limit_ SIMPLER_GUARDED_BY(mu_) = 0;
  // Which entries this side holds and their generations: the parent's own
  // record, never re-read from shared memory (the child cannot change them).
  std::vector<uint8_t> held_ SIMPLER_GUARDED_BY(mu_);
  std::vector<uint32_t> gens_ SIMPLER_GUARDED_BY(mu_);
  // Frames are used in cyclic order on both sides, so the child takes
  // requests in publication (FIFO) order.
  uint32_t next_frame_ SIMPLER_GUARDED_BY(mu_) = 0;
  std::atomic<uint32_t> controls_published_{0};
  std::atomic<uint32_t> last_control_op_{0};  // the op last published in the control frame
};

// A request the child took out of a frame: its ticket and a copy of the payload.
struct Request {
  Ticket ticket;
  std::vector<uint8_t> payload;
};

// The child's half. Thread-safe.
class MailboxChild {
 public:
  // `region` must outlive this object. Publishes this process's pid as the child's.
  explicit MailboxChild(MailboxRegion* region);

  // Takes the next published frame, if any: validates its header; for a live entry at the
  // frame's generation copies the payload out, marks the entry kAccepted and ACKs the frame (its
  // last store) and returns the request; for a frame whose entry moved on, ACKs it untouched and
  // looks at the next. Returns nullopt when no frame is published. A frame naming an index outside
  // the table, an even generation or an oversized payload stops the endpoint with the reason
  // published and returns FAILED_PRECONDITION with it; so does a stopped endpoint.
  absl::StatusOr<std::optional<Request>> take();
  // Writes the run's terminal state: code and error text (cut to kErrorTextBytes - 1 with
  // kTruncationMarker when longer; the caller logs the full text), then the state as the last
  // store to the entry, then rings the completion doorbell (waking its sleepers only while no
  // parent thread polls: MailboxHeader::parent_polling). FAILED_PRECONDITION when the ticket's
  // entry is no longer at its generation (nothing is written). After the parent stopped the
  // endpoint it may free entries whose runs it failed; a terminal state written into such an entry
  // is ignored (a stopped endpoint publishes nothing more).
  absl::Status complete(const Ticket& ticket, const absl::Status& status,
                        int64_t device_start_ns = 0, int64_t device_end_ns = 0);
  // The control command published to this child, if any (checked: an unknown op is answered
  // with INVALID_ARGUMENT by reply_control's caller).
  std::optional<ControlCommand> take_control();
  // Writes `reply` over the command and ACKs the control frame (the ACK its last store), then
  // rings the parent.
  void reply_control(const ControlReply& reply);
  // Stops the endpoint with `reason` and rings every doorbell (publish_stop).
  void stop(const std::string& reason);
  bool stopped() const;

  // As MailboxParent's, on the child doorbell.
  uint32_t doorbell() const;
  void wait(uint32_t seen, int64_t timeout_ns) const;

 private:
  mutable base::AdaptivePoll poll_{kDoorbellSpinNs};
  MailboxRegion* region_;
  mutable base::Mutex mu_;
  uint32_t next_frame_ SIMPLER_GUARDED_BY(mu_) = 0;  // frames are taken round-robin (FIFO order)
};

// Publishes `reason` as the region's stop reason unless one is published (the first stop wins)
// and rings every doorbell. Either side.
void publish_stop(MailboxRegion& region, const std::string& reason);

}  // namespace simpler::hierarchy
