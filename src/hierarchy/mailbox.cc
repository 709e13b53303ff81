#include "hierarchy/mailbox.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <ctime>

#include "absl/strings/str_cat.h"
#include "simpler/base/clock.h"
#include "simpler/base/enum_names.h"
#include "simpler/base/status.h"

namespace simpler::hierarchy {

namespace {

absl::Status errno_status(const char* call) {
  return absl::InternalError(absl::StrCat("mailbox: ", call, ": ", std::strerror(errno)));
}

// Futex on a word of the shared mapping: not FUTEX_PRIVATE, so a wait in one
// process is woken by a wake in another. The sleeper count and the word are
// both seq_cst: either the waiter sees the new value or the ringer sees the
// sleeper (no lost wake-up).
// `poll` null: sleep at once (another thread polls).
void wait_doorbell(Doorbell& d, uint32_t seen, int64_t timeout_ns, base::AdaptivePoll* poll) {
  // Polls yielding the CPU, while polling pays off: on a machine with few CPUs the thread the
  // ring is waiting for may need this one (measured: a cpu_relax spin there costs the other
  // side's hop more than the wake-up it saves; docs/benchmarks.md).
  const auto moved = [&] { return d.value.load(std::memory_order_acquire) != seen; };
  if (poll != nullptr ? poll->poll(moved, timeout_ns) : moved()) return;
  d.sleepers.fetch_add(1, std::memory_order_seq_cst);
  if (d.value.load(std::memory_order_seq_cst) == seen) {
    timespec ts{};
    ts.tv_sec = static_cast<time_t>(timeout_ns / 1'000'000'000);
    ts.tv_nsec = static_cast<long>(timeout_ns % 1'000'000'000);
    (void)syscall(SYS_futex, &d.value, FUTEX_WAIT, seen, &ts, nullptr, 0);
  }
  d.sleepers.fetch_sub(1, std::memory_order_seq_cst);
}

void wake_sleepers(Doorbell& d) {
  if (d.sleepers.load(std::memory_order_seq_cst) > 0) {
    (void)syscall(SYS_futex, &d.value, FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
  }
}

void ring(Doorbell& d) {
  d.value.fetch_add(1, std::memory_order_seq_cst);
  wake_sleepers(d);
}

// A terminal state's ring: wakes nobody while a parent thread polls the entries itself.
// Against MailboxParent::set_polled(false) (store 0, then load `value`, both seq_cst): when the
// flag's load here still reads the 1 that clear overwrites, this increment precedes that store in
// the single seq_cst order, so the parent's load of `value` reads it (or later) and, acquiring it,
// sees the entry's terminal store made before this call. (When it reads a 1 stored by a later
// set_polled(true), that window's own clear collects the run the same way.)
void ring_completion(MailboxHeader& h) {
  h.completion_doorbell.value.fetch_add(1, std::memory_order_seq_cst);
  if (h.parent_polling.load(std::memory_order_seq_cst) != 0) return;
  wake_sleepers(h.completion_doorbell);
}

std::string read_text(const char* text, uint32_t bytes, uint32_t capacity) {
  const uint32_t n = std::min(bytes, capacity - 1);  // bounds-checked: the other side wrote it
  return std::string(text, strnlen(text, n));
}

RunEntry* entries_of(void* base) {
  return reinterpret_cast<RunEntry*>(static_cast<MailboxLayout*>(base) + 1);
}

}  // namespace

namespace {
constexpr base::EnumNames<ControlOp> kControlOpNames = {{ControlOp::kMalloc, "malloc"},
                                                        {ControlOp::kFree, "free"},
                                                        {ControlOp::kCopyTo, "copy_to"},
                                                        {ControlOp::kCopyFrom, "copy_from"},
                                                        {ControlOp::kRegrant, "regrant"}};
}  // namespace

std::string control_op_name(uint32_t op) {
  return std::string(kControlOpNames.name(static_cast<ControlOp>(op), "?"));
}

bool is_terminal(EntryState s) { return s == EntryState::kCompleted || s == EntryState::kFailed; }

absl::StatusOr<uint64_t> mailbox_bytes(uint32_t grant) {
  if (grant < 1 || grant > kMaxMailboxGrant) {
    return absl::InvalidArgumentError(
        absl::StrCat("mailbox grant ", grant, " is outside [1, ", kMaxMailboxGrant, "]"));
  }
  return sizeof(MailboxLayout) + uint64_t{grant + kRequestFrames} * sizeof(RunEntry);
}

namespace {

uint64_t page_round(uint64_t bytes) {
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  return (bytes + page - 1) / page * page;
}

// The address range every mapping reserves: the largest mailbox's, so growing never moves it.
uint64_t reserve_bytes() {
  return page_round(sizeof(MailboxLayout) +
                    uint64_t{kMaxMailboxGrant + kRequestFrames} * sizeof(RunEntry));
}

}  // namespace

MailboxRegion::MailboxRegion(int fd, void* base, uint64_t mapped, uint64_t bytes,
                             uint32_t entry_count)
    : fd_(fd), base_(base), mapped_(mapped), bytes_(bytes), entry_count_(entry_count) {}

MailboxRegion::MailboxRegion(MailboxRegion&& other) noexcept
    : fd_(other.fd_),
      base_(other.base_),
      mapped_(other.mapped_),
      bytes_(other.bytes()),
      entry_count_(other.entry_count()) {
  other.fd_ = -1;
  other.base_ = nullptr;
}

MailboxRegion& MailboxRegion::operator=(MailboxRegion&& other) noexcept {
  if (this != &other) {
    reset();
    fd_ = std::exchange(other.fd_, -1);
    base_ = std::exchange(other.base_, nullptr);
    mapped_ = other.mapped_;
    bytes_.store(other.bytes());
    entry_count_.store(other.entry_count());
  }
  return *this;
}

MailboxRegion::~MailboxRegion() { reset(); }

void MailboxRegion::reset() {
  if (base_ != nullptr) (void)munmap(base_, reserve_bytes());
  if (fd_ >= 0) (void)close(fd_);
  base_ = nullptr;
  fd_ = -1;
}

void* MailboxRegion::map_reserved(int fd, uint64_t bytes) {
  void* base =
      mmap(nullptr, reserve_bytes(), PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (base == MAP_FAILED) return MAP_FAILED;
  void* got = mmap(base, page_round(bytes), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0);
  if (got == MAP_FAILED) {
    const int e = errno;
    (void)munmap(base, reserve_bytes());
    errno = e;
  }
  return got;
}

absl::Status MailboxRegion::map_to(uint64_t bytes) {
  const uint64_t want = page_round(bytes);
  if (want <= mapped_) return absl::OkStatus();
  if (want > reserve_bytes()) {
    return absl::InternalError(absl::StrCat("mailbox: ", bytes, " bytes exceed the reservation"));
  }
  void* tail = static_cast<uint8_t*>(base_) + mapped_;
  if (mmap(tail, want - mapped_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd_,
           static_cast<off_t>(mapped_)) == MAP_FAILED) {
    return errno_status("mmap");
  }
  mapped_ = want;
  return absl::OkStatus();
}

absl::Status MailboxRegion::prepare_grant(uint32_t grant) {
  SIMPLER_ASSIGN_OR_RETURN(const uint64_t need, mailbox_bytes(grant));
  struct stat st {};
  if (fstat(fd_, &st) != 0) return errno_status("fstat");
  if (static_cast<uint64_t>(st.st_size) < need && ftruncate(fd_, static_cast<off_t>(need)) != 0) {
    return errno_status("ftruncate");
  }
  SIMPLER_RETURN_IF_ERROR(map_to(need));
  // Entries past the committed table: no side reads them before the commit.
  const uint32_t from = entry_count(), to = grant + kRequestFrames;
  // Raw shared memory no side reads yet: zeroed as ftruncate leaves fresh pages.
  if (to > from) {
    std::memset(static_cast<void*>(&entries_of(base_)[from]), 0,
                uint64_t{to - from} * sizeof(RunEntry));
  }
  return absl::OkStatus();
}

absl::Status MailboxRegion::adopt_grant(uint32_t grant) {
  SIMPLER_ASSIGN_OR_RETURN(const uint64_t need, mailbox_bytes(grant));
  struct stat st {};
  if (fstat(fd_, &st) != 0) return errno_status("fstat");
  const uint64_t extent = static_cast<uint64_t>(st.st_size);
  if (extent < need) {
    return absl::FailedPreconditionError(absl::StrCat("mailbox: grant ", grant, " needs ", need,
                                                      " bytes; the region holds ", extent));
  }
  SIMPLER_RETURN_IF_ERROR(map_to(need));
  bytes_.store(need, std::memory_order_release);
  entry_count_.store(grant + kRequestFrames, std::memory_order_release);
  return absl::OkStatus();
}

RunEntry* MailboxRegion::entry(uint32_t i) const {
  if (i >= entry_count()) return nullptr;
  return &entries_of(base_)[i];
}

absl::StatusOr<MailboxRegion> MailboxRegion::create(uint32_t grant) {
  absl::StatusOr<uint64_t> bytes = mailbox_bytes(grant);
  if (!bytes.ok()) return bytes.status();
  const int fd = memfd_create("simpler-mailbox", MFD_CLOEXEC);
  if (fd < 0) return errno_status("memfd_create");
  // Owner-only, like a shm_open(..., 0600) segment: nothing else may map it.
  if (fchmod(fd, 0600) != 0 || ftruncate(fd, static_cast<off_t>(*bytes)) != 0) {
    absl::Status s = errno_status("fchmod/ftruncate");
    (void)close(fd);
    return s;
  }
  void* base = map_reserved(fd, *bytes);
  if (base == MAP_FAILED) {
    absl::Status s = errno_status("mmap");
    (void)close(fd);
    return s;
  }
  // ftruncate zero-filled it: every frame kFree, every entry kFree at generation 0.
  MailboxHeader& h = static_cast<MailboxLayout*>(base)->header;
  h.magic = kMailboxMagic;
  h.version = kMailboxVersion;
  h.grant = grant;
  h.entry_count = grant + kRequestFrames;
  h.region_bytes = *bytes;
  h.parent_pid = static_cast<int32_t>(getpid());
  return MailboxRegion(fd, base, page_round(*bytes), *bytes, grant + kRequestFrames);
}

absl::StatusOr<MailboxRegion> MailboxRegion::attach(int fd) {
  struct stat st {};
  if (fstat(fd, &st) != 0) return errno_status("fstat");
  const uint64_t extent = static_cast<uint64_t>(st.st_size);
  if (extent < sizeof(MailboxLayout)) {
    return absl::FailedPreconditionError(absl::StrCat("mailbox: the region is ", extent,
                                                      " bytes, smaller than its fixed part (",
                                                      sizeof(MailboxLayout), " bytes)"));
  }
  // Never more than the largest mailbox: the rest of an oversized file is not looked at.
  const uint64_t mapped = std::min(page_round(extent), reserve_bytes());
  void* base = map_reserved(fd, mapped);
  if (base == MAP_FAILED) return errno_status("mmap");
  const MailboxHeader& h = static_cast<MailboxLayout*>(base)->header;
  absl::Status bad;
  absl::StatusOr<uint64_t> want = mailbox_bytes(h.grant);
  if (h.magic != kMailboxMagic) {
    bad = absl::FailedPreconditionError(
        absl::StrCat("mailbox: bad magic 0x", absl::Hex(h.magic), " (not a simpler mailbox)"));
  } else if (h.version != kMailboxVersion) {
    bad = absl::FailedPreconditionError(
        absl::StrCat("mailbox: version ", h.version, ", this build speaks ", kMailboxVersion));
  } else if (!want.ok()) {
    bad = absl::FailedPreconditionError(std::string(want.status().message()));
  } else if (h.entry_count != h.grant + kRequestFrames) {
    bad = absl::FailedPreconditionError(absl::StrCat("mailbox: ", h.entry_count,
                                                     " entries for grant ", h.grant, " (want ",
                                                     h.grant + kRequestFrames, ")"));
  } else if (*want != h.region_bytes || *want > extent) {
    bad = absl::FailedPreconditionError(absl::StrCat("mailbox: grant ", h.grant, " needs ", *want,
                                                     " bytes; the header says ", h.region_bytes,
                                                     " and the mapping holds ", extent));
  }
  if (!bad.ok()) {
    (void)munmap(base, reserve_bytes());
    return bad;
  }
  // entry_count is taken once, here, after the check; later reads never trust the header.
  return MailboxRegion(fd, base, mapped, *want, h.entry_count);
}

void publish_stop(MailboxRegion& region, const std::string& reason) {
  MailboxHeader& h = region.header();
  // The first stop wins: claim the right to write the reason with a CAS on a
  // private value (2 = writing), then publish 1 after the text.
  uint32_t expected = 0;
  if (h.stopped.compare_exchange_strong(expected, 2, std::memory_order_acq_rel)) {
    const size_t n = std::min<size_t>(reason.size(), kStopReasonBytes - 1);
    std::memcpy(h.stop_reason, reason.data(), n);
    h.stop_reason[n] = '\0';
    h.stop_reason_bytes = static_cast<uint32_t>(n);
    h.stopped.store(1, std::memory_order_release);
  }
  ring(h.parent_doorbell);
  ring(h.completion_doorbell);
  ring(h.child_doorbell);
}

// ---- parent ----

MailboxParent::MailboxParent(MailboxRegion* region)
    : region_(region),
      claim_limit_(region->entry_count()),
      held_(region->entry_count(), 0),
      gens_(region->entry_count(), 0) {}

bool MailboxParent::can_dispatch() const {
  base::MutexLock lock(mu_);
  return can_dispatch_locked();
}

bool MailboxParent::can_dispatch_locked() const {
  if (region_->header().stopped.load(std::memory_order_acquire) != 0) return false;
  if (region_->frame(next_frame_).header.state.load(std::memory_order_acquire) !=
      static_cast<uint32_t>(FrameState::kFree)) {
    return false;
  }
  // Runs hold entries only below claim_limit_ (a shrink waits for those above to be collected).
  return in_flight_ < static_cast<int32_t>(claim_limit_);
}

absl::StatusOr<Ticket> MailboxParent::publish(uint64_t run_id, std::span<const uint8_t> payload) {
  if (payload.size() > kFramePayloadBytes) {
    return absl::InvalidArgumentError(absl::StrCat("mailbox: a request of ", payload.size(),
                                                   " bytes does not fit a frame (",
                                                   kFramePayloadBytes, " bytes)"));
  }
  base::MutexLock lock(mu_);
  if (std::optional<std::string> why = stop_reason_locked(); why.has_value()) {
    return absl::FailedPreconditionError(absl::StrCat("mailbox endpoint stopped: ", *why));
  }
  if (!can_dispatch_locked()) {
    return absl::ResourceExhaustedError(
        "mailbox: no free request frame or run-state entry; check can_dispatch() before "
        "publishing");
  }
  uint32_t index = 0;
  while (held_[index] != 0) ++index;  // every held entry is below claim_limit_ > in_flight_
  // Claim the entry (odd generation), then publish the frame naming it.
  RunEntry& e = *region_->entry(index);
  gens_[index] += 1;
  held_[index] = 1;
  ++in_flight_;
  e.run_id = run_id;
  e.code = 0;
  e.error_bytes = 0;
  e.device_start_ns = 0;
  e.device_end_ns = 0;
  e.state.store(static_cast<uint32_t>(EntryState::kClaimed), std::memory_order_relaxed);
  e.generation.store(gens_[index], std::memory_order_release);
  RequestFrame& f = region_->frame(next_frame_);
  f.header.entry_index = index;
  f.header.entry_generation = gens_[index];
  f.header.payload_bytes = static_cast<uint32_t>(payload.size());
  f.header.run_id = run_id;
  if (!payload.empty()) std::memcpy(f.payload, payload.data(), payload.size());
  f.header.state.store(static_cast<uint32_t>(FrameState::kPublished), std::memory_order_release);
  next_frame_ = (next_frame_ + 1) % kRequestFrames;
  ring(region_->header().child_doorbell);
  return Ticket{index, gens_[index], run_id};
}

std::vector<Completion> MailboxParent::collect() {
  std::vector<Completion> out;
  base::MutexLock lock(mu_);
  const std::optional<std::string> stopped = stop_reason_locked();
  for (uint32_t i = 0; i < held_.size(); ++i) {
    if (held_[i] == 0) continue;
    RunEntry& e = *region_->entry(i);
    const auto state = static_cast<EntryState>(e.state.load(std::memory_order_acquire));
    Completion c;
    c.ticket = Ticket{i, gens_[i], e.run_id};
    if (is_terminal(state)) {
      c.device_start_ns = e.device_start_ns;
      c.device_end_ns = e.device_end_ns;
      if (state == EntryState::kCompleted) {
        c.status = absl::OkStatus();
      } else {
        // The child wrote code and text before the state (release/acquire).
        int32_t code = e.code;
        if (code <= 0 || code > static_cast<int32_t>(absl::StatusCode::kUnauthenticated)) {
          code = static_cast<int32_t>(absl::StatusCode::kInternal);  // never OK for kFailed
        }
        c.status = absl::Status(static_cast<absl::StatusCode>(code),
                                read_text(e.error, e.error_bytes, kErrorTextBytes));
      }
    } else if (stopped.has_value()) {
      c.status = absl::UnavailableError(
          absl::StrCat("run ", e.run_id, ": mailbox endpoint stopped: ", *stopped));
    } else {
      continue;
    }
    // Free the entry: state first, then the even generation.
    e.state.store(static_cast<uint32_t>(EntryState::kFree), std::memory_order_relaxed);
    gens_[i] += 1;
    e.generation.store(gens_[i], std::memory_order_release);
    held_[i] = 0;
    --in_flight_;
    out.push_back(std::move(c));
  }
  // A publisher waiting for a free entry sleeps on this doorbell too: wake it.
  if (!out.empty()) ring(region_->header().parent_doorbell);
  return out;
}

void MailboxParent::stop(const std::string& reason) { publish_stop(*region_, reason); }

std::optional<std::string> MailboxParent::stop_reason() const {
  base::MutexLock lock(mu_);
  return stop_reason_locked();
}

std::optional<std::string> MailboxParent::stop_reason_locked() const {
  const MailboxHeader& h = region_->header();
  if (h.stopped.load(std::memory_order_acquire) != 1) return std::nullopt;
  return read_text(h.stop_reason, h.stop_reason_bytes, kStopReasonBytes);
}

int32_t MailboxParent::in_flight() const {
  base::MutexLock lock(mu_);
  return in_flight_;
}

int32_t MailboxParent::frames_in_use() const {
  int32_t n = 0;
  for (uint32_t i = 0; i < kRequestFrames; ++i) {
    if (region_->frame(i).header.state.load(std::memory_order_acquire) !=
        static_cast<uint32_t>(FrameState::kFree)) {
      ++n;
    }
  }
  return n;
}

absl::StatusOr<ControlReply> MailboxParent::control(const ControlCommand& command,
                                                    int64_t timeout_ns) {
  base::MutexLock one_at_a_time(control_mu_);
  return control_locked(command, timeout_ns);
}

absl::StatusOr<ControlReply> MailboxParent::control_locked(const ControlCommand& command,
                                                           int64_t timeout_ns) {
  const int64_t deadline = base::now_ns() + timeout_ns;
  RequestFrame& f = region_->layout().control;
  const auto stopped = [this]() -> std::optional<std::string> {
    base::MutexLock lock(mu_);
    return stop_reason_locked();
  };
  // First: every request published before this command was taken by the child.
  while (frames_in_use() > 0) {
    const uint32_t seen = doorbell();
    if (auto why = stopped(); why.has_value()) {
      return absl::FailedPreconditionError(absl::StrCat("mailbox endpoint stopped: ", *why));
    }
    if (frames_in_use() == 0) break;
    if (base::now_ns() >= deadline) {
      return absl::DeadlineExceededError("mailbox control: the child did not take its requests");
    }
    wait(seen, std::min<int64_t>(deadline - base::now_ns(), 100'000'000));
  }
  std::memcpy(f.payload, &command, sizeof(command));
  f.header.payload_bytes = sizeof(command);
  last_control_op_.store(command.op, std::memory_order_relaxed);
  controls_published_.fetch_add(1, std::memory_order_release);
  f.header.state.store(static_cast<uint32_t>(FrameState::kPublished), std::memory_order_release);
  ring(region_->header().child_doorbell);
  while (true) {
    const uint32_t seen = doorbell();
    if (f.header.state.load(std::memory_order_acquire) ==
        static_cast<uint32_t>(FrameState::kFree)) {
      break;
    }
    if (auto why = stopped(); why.has_value()) {
      return absl::FailedPreconditionError(absl::StrCat("mailbox endpoint stopped: ", *why));
    }
    if (base::now_ns() >= deadline) {
      // The command is out and the child may still act on it (or be reading the frame): what
      // it did is unknown, and the frame cannot be reused. The endpoint stops.
      const std::string why =
          absl::StrCat("control command ", control_op_name(command.op),
                       " got no reply from the child within ", timeout_ns / 1'000'000, " ms");
      publish_stop(*region_, why);
      return absl::DeadlineExceededError(absl::StrCat("mailbox control: ", why));
    }
    wait(seen, std::min<int64_t>(deadline - base::now_ns(), 100'000'000));
  }
  ControlReply reply;
  std::memcpy(&reply, f.payload, sizeof(reply));
  if (reply.code != 0) {
    int32_t code = reply.code;
    if (code < 0 || code > static_cast<int32_t>(absl::StatusCode::kUnauthenticated)) {
      code = static_cast<int32_t>(absl::StatusCode::kInternal);
    }
    return absl::Status(static_cast<absl::StatusCode>(code),
                        read_text(reply.text, reply.text_bytes, kErrorTextBytes));
  }
  return reply;
}

uint32_t MailboxParent::controls_published() const {
  return controls_published_.load(std::memory_order_acquire);
}

std::optional<ControlOp> MailboxParent::control_out() const {
  // The state first: the op stored before the command was published is then the one read.
  if (region_->layout().control.header.state.load(std::memory_order_acquire) ==
      static_cast<uint32_t>(FrameState::kFree)) {
    return std::nullopt;
  }
  return static_cast<ControlOp>(last_control_op_.load(std::memory_order_relaxed));
}

uint32_t MailboxParent::grant() const {
  base::MutexLock lock(mu_);
  return static_cast<uint32_t>(held_.size()) - kRequestFrames;
}

absl::Status MailboxParent::regrant(uint32_t grant, int64_t timeout_ns) {
  SIMPLER_RETURN_IF_ERROR(mailbox_bytes(grant).status());
  // One grant change (or control command) at a time, from the sizing to the commit.
  base::MutexLock one_at_a_time(control_mu_);
  const uint32_t count = grant + kRequestFrames;
  uint32_t old_count = 0;
  {
    base::MutexLock lock(mu_);
    if (std::optional<std::string> why = stop_reason_locked(); why.has_value()) {
      return absl::FailedPreconditionError(absl::StrCat("mailbox endpoint stopped: ", *why));
    }
    old_count = static_cast<uint32_t>(held_.size());
    for (uint32_t i = count; i < old_count; ++i) {
      if (held_[i] != 0) {
        return absl::FailedPreconditionError(
            absl::StrCat("mailbox: grant ", grant, " would drop run-state entry ", i,
                         ", which run ", region_->entry(i)->run_id, " holds; collect it first"));
      }
    }
    claim_limit_ = std::min(count, old_count);  // claims both tables hold, until the commit
  }
  const auto restore = [this, old_count] {
    base::MutexLock lock(mu_);
    claim_limit_ = old_count;
    ring(region_->header().parent_doorbell);  // a publisher may wait for an entry
  };
  // Detached: the grown file, its mapped tail and this side's new record.
  if (absl::Status s = region_->prepare_grant(grant); !s.ok()) {
    restore();
    return s;
  }
  ControlCommand c;
  c.op = static_cast<uint32_t>(ControlOp::kRegrant);
  c.grant = grant;
  if (absl::StatusOr<ControlReply> r = control_locked(c, timeout_ns); !r.ok()) {
    // The child refused (nothing adopted), or the endpoint stopped (a command without a reply
    // in time stops it: the child's table is then unknown, and nothing more is published).
    restore();
    return base::annotate(r.status(), absl::StrCat("mailbox regrant to ", grant, ": "));
  }
  // The commit: the child adopted the table; this side follows in one step.
  base::MutexLock lock(mu_);
  if (absl::Status s = region_->adopt_grant(grant); !s.ok()) {
    claim_limit_ = old_count;
    return s;
  }
  std::vector<uint8_t> held(count, 0);
  std::vector<uint32_t> gens(count, 0);
  for (uint32_t i = 0; i < std::min(count, old_count); ++i) {
    held[i] = held_[i];
    gens[i] = gens_[i];
  }
  held_.swap(held);
  gens_.swap(gens);
  claim_limit_ = count;
  MailboxHeader& h = region_->header();
  h.grant = grant;
  h.entry_count = count;
  h.region_bytes = region_->bytes();
  ring(h.parent_doorbell);  // a publisher waiting for an entry may find one now
  return absl::OkStatus();
}

uint32_t MailboxParent::doorbell() const {
  return region_->header().parent_doorbell.value.load(std::memory_order_acquire);
}

void MailboxParent::wait(uint32_t seen, int64_t timeout_ns) const {
  wait_doorbell(region_->header().parent_doorbell, seen, timeout_ns, &poll_);
}

uint32_t MailboxParent::completions() const {
  return region_->header().completion_doorbell.value.load(std::memory_order_acquire);
}

void MailboxParent::wait_completions(uint32_t seen, int64_t timeout_ns) const {
  MailboxHeader& h = region_->header();
  const bool polled = h.parent_polling.load(std::memory_order_relaxed) != 0;
  wait_doorbell(h.completion_doorbell, seen, timeout_ns, polled ? nullptr : &completion_poll_);
}

void MailboxParent::set_polled(bool polled) {
  MailboxHeader& h = region_->header();
  h.parent_polling.store(polled ? 1 : 0, std::memory_order_seq_cst);
  // Pairs with ring_completion: a terminal state whose ring saw the flag set is visible to the
  // collect() that follows.
  (void)h.completion_doorbell.value.load(std::memory_order_seq_cst);
}

// ---- child ----

MailboxChild::MailboxChild(MailboxRegion* region) : region_(region) {
  region_->header().child_pid.store(static_cast<int32_t>(getpid()), std::memory_order_release);
}

bool MailboxChild::stopped() const {
  return region_->header().stopped.load(std::memory_order_acquire) != 0;
}

void MailboxChild::stop(const std::string& reason) { publish_stop(*region_, reason); }

std::optional<ControlCommand> MailboxChild::take_control() {
  RequestFrame& f = region_->layout().control;
  if (f.header.state.load(std::memory_order_acquire) !=
      static_cast<uint32_t>(FrameState::kPublished)) {
    return std::nullopt;
  }
  ControlCommand c;
  std::memcpy(&c, f.payload, sizeof(c));  // a copy: the parent's bytes are read once
  return c;
}

void MailboxChild::reply_control(const ControlReply& reply) {
  RequestFrame& f = region_->layout().control;
  std::memcpy(f.payload, &reply, sizeof(reply));
  // The ACK: the child's last store to the control frame.
  f.header.state.store(static_cast<uint32_t>(FrameState::kFree), std::memory_order_release);
  ring(region_->header().parent_doorbell);
}

absl::StatusOr<std::optional<Request>> MailboxChild::take() {
  base::MutexLock lock(mu_);
  while (true) {
    const MailboxHeader& h = region_->header();
    if (h.stopped.load(std::memory_order_acquire) != 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("mailbox endpoint stopped: ",
                       h.stopped.load(std::memory_order_acquire) == 1
                           ? read_text(h.stop_reason, h.stop_reason_bytes, kStopReasonBytes)
                           : std::string("(reason being published)")));
    }
    RequestFrame& f = region_->frame(next_frame_);
    if (f.header.state.load(std::memory_order_acquire) !=
        static_cast<uint32_t>(FrameState::kPublished)) {
      return std::nullopt;
    }
    // Copy the header once; every field is checked before use.
    const uint32_t index = f.header.entry_index;
    const uint32_t generation = f.header.entry_generation;
    const uint32_t bytes = f.header.payload_bytes;
    const uint64_t run_id = f.header.run_id;
    std::string bad;
    RunEntry* e = region_->entry(index);
    if (e == nullptr) {
      bad = absl::StrCat("request frame ", next_frame_, " names run-state entry ", index,
                         ", outside the table of ", region_->entry_count(), " entries");
    } else if (generation % 2 == 0) {
      bad = absl::StrCat("request frame ", next_frame_, " names entry ", index,
                         " at even generation ", generation, " (a free entry)");
    } else if (bytes > kFramePayloadBytes) {
      bad = absl::StrCat("request frame ", next_frame_, " declares ", bytes,
                         " payload bytes, more than a frame holds (", kFramePayloadBytes, ")");
    }
    if (!bad.empty()) {
      publish_stop(*region_, bad);
      return absl::FailedPreconditionError(absl::StrCat("mailbox endpoint stopped: ", bad));
    }
    next_frame_ = (next_frame_ + 1) % kRequestFrames;
    if (e->generation.load(std::memory_order_acquire) != generation) {
      // A frame left over from an earlier occupant of the entry: returned
      // untouched (no entry written), the ACK its only store.
      f.header.state.store(static_cast<uint32_t>(FrameState::kFree), std::memory_order_release);
      ring(region_->header().parent_doorbell);
      continue;
    }
    Request r;
    r.ticket = Ticket{index, generation, run_id};
    r.payload.assign(f.payload, f.payload + bytes);
    e->state.store(static_cast<uint32_t>(EntryState::kAccepted), std::memory_order_release);
    // The ACK: the child's last store to this frame.
    f.header.state.store(static_cast<uint32_t>(FrameState::kFree), std::memory_order_release);
    ring(region_->header().parent_doorbell);
    return std::optional<Request>(std::move(r));
  }
}

absl::Status MailboxChild::complete(const Ticket& ticket, const absl::Status& status,
                                    int64_t device_start_ns, int64_t device_end_ns) {
  RunEntry* e = region_->entry(ticket.entry);
  if (e == nullptr || e->generation.load(std::memory_order_acquire) != ticket.generation) {
    return absl::FailedPreconditionError(absl::StrCat(
        "mailbox: run ", ticket.run_id, "'s entry ", ticket.entry, " is no longer at generation ",
        ticket.generation, "; its terminal state is not written"));
  }
  if (status.ok()) {
    e->code = 0;
    e->error_bytes = 0;
    e->error[0] = '\0';
  } else {
    std::string text(status.message());
    if (text.size() > kErrorTextBytes - 1) {
      const size_t keep = kErrorTextBytes - 1 - (sizeof(kTruncationMarker) - 1);
      text = text.substr(0, keep) + kTruncationMarker;
    }
    e->code = static_cast<int32_t>(status.code());
    std::memcpy(e->error, text.data(), text.size());
    e->error[text.size()] = '\0';
    e->error_bytes = static_cast<uint32_t>(text.size());
  }
  e->device_start_ns = device_start_ns;
  e->device_end_ns = device_end_ns;
  // The terminal state: the child's last store to this entry.
  e->state.store(static_cast<uint32_t>(status.ok() ? EntryState::kCompleted : EntryState::kFailed),
                 std::memory_order_release);
  ring_completion(region_->header());
  return absl::OkStatus();
}

uint32_t MailboxChild::doorbell() const {
  return region_->header().child_doorbell.value.load(std::memory_order_acquire);
}

void MailboxChild::wait(uint32_t seen, int64_t timeout_ns) const {
  wait_doorbell(region_->header().child_doorbell, seen, timeout_ns, &poll_);
}

}  // namespace simpler::hierarchy
