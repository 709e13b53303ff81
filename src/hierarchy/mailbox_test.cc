#include "hierarchy/mailbox.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "base/test_status.h"
#include "base/test_wait.h"
#include "gtest/gtest.h"
#include "simpler/base/clock.h"

namespace simpler::hierarchy {
namespace {

using simpler::testing::contains;

std::vector<uint8_t> bytes_of(std::string_view s) { return {s.begin(), s.end()}; }
std::string text_of(const std::vector<uint8_t>& b) { return {b.begin(), b.end()}; }

// Parent and child halves over one region (threads of one process share the mapping).
struct Pair {
  explicit Pair(uint32_t grant)
      : region(*MailboxRegion::create(grant)), parent(&region), child(&region) {}
  MailboxRegion region;
  MailboxParent parent;
  MailboxChild child;
};

Request take_one(MailboxChild& child) {
  absl::StatusOr<std::optional<Request>> r = child.take();
  EXPECT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r.ok() && r->has_value());
  return r.ok() && r->has_value() ? std::move(**r) : Request{};
}

TEST(MailboxBytes, OnlyTheEntryTableGrowsWithTheGrantAndGrant1024FitsIn600KB) {
  const uint64_t fixed = sizeof(MailboxLayout);
  EXPECT_EQ(*mailbox_bytes(1), fixed + 3 * sizeof(RunEntry));
  EXPECT_EQ(*mailbox_bytes(64) - *mailbox_bytes(2), 62 * sizeof(RunEntry));
  EXPECT_LE(*mailbox_bytes(1024), 600u * 1000u);
  EXPECT_TRUE(contains(mailbox_bytes(0).status(), "mailbox grant 0 is outside [1, 1024]"));
  EXPECT_EQ(mailbox_bytes(1025).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MailboxRegion::create(0).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(MailboxRegion, IsOwnerOnlyAndAttachChecksTheExtentBeforeTrustingTheHeader) {
  MailboxRegion r = *MailboxRegion::create(4);
  struct stat st {};
  ASSERT_EQ(fstat(r.fd(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  EXPECT_EQ(r.entry_count(), 6u);
  EXPECT_EQ(r.entry(6), nullptr);  // outside the table: no pointer past the mapping
  {
    absl::StatusOr<MailboxRegion> ok = MailboxRegion::attach(dup(r.fd()));
    ASSERT_TRUE(ok.ok()) << ok.status();
    EXPECT_EQ(ok->entry_count(), 6u);
    EXPECT_EQ(ok->header().grant, 4u);
  }
  // Each corruption of the header, on a copy of the region, is refused naming it.
  struct Case {
    std::string what;
    void (*corrupt)(MailboxHeader&, int fd);
  };
  const Case cases[] = {
      {"bad magic", [](MailboxHeader& h, int) { h.magic = 0; }},
      {absl::StrCat("version 7, this build speaks ", kMailboxVersion),
       [](MailboxHeader& h, int) { h.version = 7; }},
      {"mailbox grant 0 is outside", [](MailboxHeader& h, int) { h.grant = 0; }},
      {"5 entries for grant 4", [](MailboxHeader& h, int) { h.entry_count = 5; }},
      {"the header says 1", [](MailboxHeader& h, int) { h.region_bytes = 1; }},
      // A grant the mapping cannot hold: the header claims more entries than exist.
      {"and the mapping holds",
       [](MailboxHeader& h, int) {
         h.grant = 1000;
         h.entry_count = 1002;
         h.region_bytes = *mailbox_bytes(1000);
       }},
      // A truncated region.
      {"smaller than its fixed part", [](MailboxHeader&, int fd) { (void)ftruncate(fd, 100); }},
  };
  for (const Case& c : cases) {
    MailboxRegion copy = *MailboxRegion::create(4);
    c.corrupt(copy.header(), copy.fd());
    absl::StatusOr<MailboxRegion> bad = MailboxRegion::attach(dup(copy.fd()));
    EXPECT_EQ(bad.status().code(), absl::StatusCode::kFailedPrecondition) << c.what;
    EXPECT_TRUE(contains(bad.status(), c.what)) << c.what << ": " << bad.status();
  }
}

TEST(Mailbox, ARunGoesOutInAFrameAndComesBackThroughItsEntry) {
  Pair p(2);
  ASSERT_TRUE(p.parent.can_dispatch());
  Ticket t = *p.parent.publish(7, bytes_of("hello"));
  EXPECT_EQ(t.generation % 2, 1u);  // odd while occupied
  EXPECT_EQ(p.region.entry(t.entry)->generation.load(), t.generation);
  EXPECT_EQ(p.parent.frames_in_use(), 1);
  Request r = take_one(p.child);
  EXPECT_EQ(text_of(r.payload), "hello");
  EXPECT_EQ(r.ticket.run_id, 7u);
  EXPECT_EQ(r.ticket.entry, t.entry);
  EXPECT_EQ(p.parent.frames_in_use(), 0);   // the frame came back before the run ended
  EXPECT_TRUE(p.parent.collect().empty());  // accepted, not terminal
  EXPECT_EQ(p.parent.in_flight(), 1);
  ASSERT_TRUE(p.child.complete(r.ticket, absl::OkStatus()).ok());
  std::vector<Completion> done = p.parent.collect();
  ASSERT_EQ(done.size(), 1u);
  EXPECT_TRUE(done[0].status.ok());
  EXPECT_EQ(done[0].ticket.run_id, 7u);
  EXPECT_EQ(p.parent.in_flight(), 0);
  EXPECT_EQ(p.region.entry(t.entry)->generation.load() % 2, 0u);  // even once free
  EXPECT_TRUE(p.parent.collect().empty());                        // collected exactly once
}

TEST(Mailbox, RequestsAreTakenInPublicationOrderAcrossBothFrames) {
  Pair p(8);
  for (uint64_t run = 0; run < 20; ++run) {
    ASSERT_TRUE(p.parent.can_dispatch());
    ASSERT_TRUE(p.parent.publish(run, bytes_of(std::to_string(run))).ok());
    if (run % 2 == 1) {  // two in the frames at once, then both taken
      for (uint64_t want = run - 1; want <= run; ++want) {
        Request r = take_one(p.child);
        EXPECT_EQ(text_of(r.payload), std::to_string(want));
        ASSERT_TRUE(p.child.complete(r.ticket, absl::OkStatus()).ok());
      }
      EXPECT_EQ(p.parent.collect().size(), 2u);
    }
  }
}

TEST(Mailbox, FullFramesOrAFullEntryTableAreBackpressureNotErrors) {
  Pair p(1);  // M = 3 entries
  ASSERT_TRUE(p.parent.publish(0, bytes_of("a")).ok());
  ASSERT_TRUE(p.parent.publish(1, bytes_of("b")).ok());
  EXPECT_FALSE(p.parent.can_dispatch());  // both frames published, none taken
  absl::StatusOr<Ticket> refused = p.parent.publish(2, bytes_of("c"));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(contains(refused.status(), "check can_dispatch()")) << refused.status();
  EXPECT_EQ(p.parent.in_flight(), 2);  // the refusal claimed nothing
  Request a = take_one(p.child);
  EXPECT_TRUE(p.parent.can_dispatch());  // the ACK returned a frame
  ASSERT_TRUE(p.parent.publish(2, bytes_of("c")).ok());
  Request b = take_one(p.child);
  Request c = take_one(p.child);
  EXPECT_FALSE(p.parent.can_dispatch());  // frames free, but all 3 entries hold runs
  EXPECT_EQ(p.parent.frames_in_use(), 0);
  ASSERT_TRUE(p.child.complete(b.ticket, absl::OkStatus()).ok());
  EXPECT_FALSE(p.parent.can_dispatch());  // terminal but not collected yet
  EXPECT_EQ(p.parent.collect().size(), 1u);
  EXPECT_TRUE(p.parent.can_dispatch());
  (void)a;
  (void)c;
}

TEST(Mailbox, AnOversizedRequestIsRefusedBeforeAnythingIsClaimed) {
  Pair p(1);
  std::vector<uint8_t> big(kFramePayloadBytes + 1);
  EXPECT_EQ(p.parent.publish(0, big).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(p.parent.in_flight(), 0);
  big.pop_back();
  ASSERT_TRUE(p.parent.publish(0, big).ok());  // exactly a frame's payload fits
  EXPECT_EQ(take_one(p.child).payload.size(), kFramePayloadBytes);
}

// A duplicated frame (a stale copy of an earlier request) names its entry at
// a generation that moved on: it is returned untouched and never served twice.
TEST(Mailbox, AStaleFrameIsReturnedUntouchedAndNotServedTwice) {
  Pair p(1);
  Ticket a = *p.parent.publish(1, bytes_of("run 1"));
  RequestFrame& f0 = p.region.frame(0);
  FrameHeader copy;
  copy.entry_index = f0.header.entry_index;
  copy.entry_generation = f0.header.entry_generation;
  copy.payload_bytes = f0.header.payload_bytes;
  copy.run_id = f0.header.run_id;
  Request r = take_one(p.child);
  ASSERT_TRUE(p.child.complete(r.ticket, absl::OkStatus()).ok());
  ASSERT_EQ(p.parent.collect().size(), 1u);
  // Run 2 reuses the entry (generation + 2) through frame 1.
  Ticket b = *p.parent.publish(2, bytes_of("run 2"));
  ASSERT_EQ(b.entry, a.entry);
  EXPECT_EQ(b.generation, a.generation + 2);
  Request r2 = take_one(p.child);
  EXPECT_EQ(text_of(r2.payload), "run 2");
  // The duplicate of run 1's frame arrives in frame 0.
  f0.header.entry_index = copy.entry_index;
  f0.header.entry_generation = copy.entry_generation;
  f0.header.payload_bytes = copy.payload_bytes;
  f0.header.run_id = copy.run_id;
  f0.header.state.store(static_cast<uint32_t>(FrameState::kPublished));
  absl::StatusOr<std::optional<Request>> dup = p.child.take();
  ASSERT_TRUE(dup.ok()) << dup.status();
  EXPECT_FALSE(dup->has_value());                                               // nothing served
  EXPECT_EQ(f0.header.state.load(), static_cast<uint32_t>(FrameState::kFree));  // returned
  const RunEntry& e = *p.region.entry(b.entry);
  EXPECT_EQ(e.state.load(), static_cast<uint32_t>(EntryState::kAccepted));  // run 2's, untouched
  EXPECT_EQ(e.run_id, 2u);
  EXPECT_FALSE(p.child.stopped());
  ASSERT_TRUE(p.child.complete(r2.ticket, absl::InternalError("run 2's own error")).ok());
  std::vector<Completion> done = p.parent.collect();
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].ticket.run_id, 2u);
  EXPECT_TRUE(contains(done[0].status, "run 2's own error"));
}

// A terminal state for a ticket whose entry moved on is refused, not written.
TEST(Mailbox, ACompletionForAnEntryThatMovedOnWritesNothing) {
  Pair p(1);
  (void)*p.parent.publish(1, bytes_of("x"));
  Request r = take_one(p.child);
  ASSERT_TRUE(p.child.complete(r.ticket, absl::OkStatus()).ok());
  ASSERT_EQ(p.parent.collect().size(), 1u);
  absl::Status again = p.child.complete(r.ticket, absl::InternalError("late"));
  EXPECT_EQ(again.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(contains(again, "is no longer at generation")) << again;
  EXPECT_EQ(p.region.entry(r.ticket.entry)->state.load(), static_cast<uint32_t>(EntryState::kFree));
}

// Headers nobody can attribute stop the endpoint with a published reason, and
// every run the parent held gets a terminal status with that cause.
TEST(Mailbox, AnUnattributableFrameStopsTheEndpointAndFailsEveryHeldRun) {
  struct Case {
    const char* reason;
    void (*corrupt)(FrameHeader&);
  };
  const Case cases[] = {
      {"names run-state entry 99, outside the table of 4 entries",
       [](FrameHeader& h) { h.entry_index = 99; }},
      {"at even generation 2 (a free entry)", [](FrameHeader& h) { h.entry_generation = 2; }},
      {"declares 4294967295 payload bytes", [](FrameHeader& h) { h.payload_bytes = 0xffffffff; }},
  };
  for (const Case& c : cases) {
    Pair p(2);
    Ticket held = *p.parent.publish(1, bytes_of("accepted first"));
    Request first = take_one(p.child);
    (void)*p.parent.publish(2, bytes_of("corrupted"));
    c.corrupt(p.region.frame(1).header);
    absl::StatusOr<std::optional<Request>> r = p.child.take();
    EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << c.reason;
    EXPECT_TRUE(contains(r.status(), c.reason)) << r.status();
    ASSERT_TRUE(p.parent.stop_reason().has_value());
    EXPECT_NE(p.parent.stop_reason()->find(c.reason), std::string::npos);
    EXPECT_FALSE(p.parent.can_dispatch());
    absl::StatusOr<Ticket> refused = p.parent.publish(3, bytes_of("after"));
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_TRUE(contains(refused.status(), c.reason)) << refused.status();
    std::vector<Completion> done = p.parent.collect();
    ASSERT_EQ(done.size(), 2u) << c.reason;  // both runs it held, one cause
    for (const Completion& d : done) {
      EXPECT_EQ(d.status.code(), absl::StatusCode::kUnavailable);
      EXPECT_TRUE(contains(d.status, "mailbox endpoint stopped: ")) << d.status;
      EXPECT_TRUE(contains(d.status, c.reason)) << d.status;
    }
    EXPECT_EQ(p.parent.in_flight(), 0);
    (void)held;
    (void)first;
  }
}

TEST(Mailbox, ALongErrorIsTruncatedWithAMarkerAndARecycledEntryCarriesItsOwnText) {
  Pair p(1);
  const std::string long_text(1000, 'e');
  (void)*p.parent.publish(1, bytes_of("a"));
  Request a = take_one(p.child);
  ASSERT_TRUE(p.child.complete(a.ticket, absl::ResourceExhaustedError(long_text)).ok());
  std::vector<Completion> done = p.parent.collect();
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].status.code(), absl::StatusCode::kResourceExhausted);
  const std::string got(done[0].status.message());
  EXPECT_EQ(got.size(), kErrorTextBytes - 1);
  EXPECT_EQ(got.substr(got.size() - std::strlen(kTruncationMarker)), kTruncationMarker);
  // The same entry, next run: a short text of its own, nothing of the old one.
  (void)*p.parent.publish(2, bytes_of("b"));
  Request b = take_one(p.child);
  ASSERT_EQ(b.ticket.entry, a.ticket.entry);
  ASSERT_TRUE(p.child.complete(b.ticket, absl::NotFoundError("short")).ok());
  done = p.parent.collect();
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].status, absl::NotFoundError("short"));
}

// What the child writes into an entry is bounds-checked by the parent: a
// length past the text buffer or a code that is not a failure cannot make it
// read past the entry or report success for a failed run.
TEST(Mailbox, TheParentBoundsEveryFieldItReadsFromAnEntry) {
  Pair p(1);
  Ticket t = *p.parent.publish(1, bytes_of("a"));
  (void)take_one(p.child);
  RunEntry& e = *p.region.entry(t.entry);
  std::memset(e.error, 'x', sizeof(e.error));  // no NUL anywhere
  e.error_bytes = 0xffffffff;
  e.code = 0;  // "OK" for a failed run
  e.state.store(static_cast<uint32_t>(EntryState::kFailed));
  std::vector<Completion> done = p.parent.collect();
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].status.code(), absl::StatusCode::kInternal);
  EXPECT_EQ(done[0].status.message().size(), kErrorTextBytes - 1);
}

// A ring that never arrives (a dropped doorbell) loses no request: the child's
// wait is bounded and it looks at the frames again — publication is a level in
// shared memory, not a pulse.
TEST(Mailbox, APublicationWhoseRingIsLostIsStillTaken) {
  Pair p(1);
  std::atomic<bool> got{false};
  std::thread child([&] {
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (!got.load() && std::chrono::steady_clock::now() < until) {
      const uint32_t seen = p.child.doorbell();
      absl::StatusOr<std::optional<Request>> r = p.child.take();
      ASSERT_TRUE(r.ok()) << r.status();
      if (r->has_value()) {
        EXPECT_EQ(text_of((*r)->payload), "quiet");
        got.store(true);
        break;
      }
      p.child.wait(seen, 20'000'000);  // 20 ms: the bound that makes a lost ring harmless
    }
  });
  // The child is asleep on its doorbell.
  ASSERT_TRUE(simpler::testing::eventually(
      [&] { return p.region.header().child_doorbell.sleepers.load() == 1; }));
  // Published by hand, exactly as MailboxParent::publish does, but without the ring.
  RunEntry& e = *p.region.entry(0);
  e.run_id = 9;
  e.state.store(static_cast<uint32_t>(EntryState::kClaimed));
  e.generation.store(1);
  RequestFrame& f = p.region.frame(0);
  f.header.entry_index = 0;
  f.header.entry_generation = 1;
  f.header.payload_bytes = 5;
  f.header.run_id = 9;
  std::memcpy(f.payload, "quiet", 5);
  const uint32_t bell = p.child.doorbell();
  f.header.state.store(static_cast<uint32_t>(FrameState::kPublished));
  child.join();
  EXPECT_TRUE(got.load());
  EXPECT_EQ(p.child.doorbell(), bell);  // nobody rang
}

// A terminal state rings the completion doorbell; while a parent thread polls the entries
// itself (set_polled) the ring wakes no sleeper — the poller collects — and once the polling
// stopped, terminal states wake the sleeper again.
TEST(Mailbox, ATerminalStateWakesTheCollectorOnlyWhileNoParentThreadPolls) {
  Pair p(2);
  std::atomic<int64_t> woke_ns{0};
  std::atomic<pid_t> collector_tid{0};
  std::thread collector([&] {
    collector_tid = static_cast<pid_t>(syscall(SYS_gettid));
    const uint32_t seen = p.parent.completions();
    p.parent.wait_completions(seen, 20'000'000'000);  // 20 s: only a ring ends it early
    woke_ns = base::now_ns();
  });
  p.parent.set_polled(true);
  const Doorbell& bell = p.region.header().completion_doorbell;
  // Asleep in the futex: counted as a sleeper and the thread's state is S (it sleeps nowhere
  // else once counted).
  const auto sleeping = [&] {
    const pid_t tid = collector_tid.load();
    if (tid == 0 || bell.sleepers.load() != 1) return false;
    std::ifstream stat("/proc/self/task/" + std::to_string(tid) + "/stat");
    std::string line;
    std::getline(stat, line);
    const size_t paren = line.rfind(')');
    return paren != std::string::npos && paren + 2 < line.size() && line[paren + 2] == 'S';
  };
  ASSERT_TRUE(simpler::testing::eventually(sleeping));
  // The ACK rings the parent doorbell, not this one; the terminal state rings this one.
  ASSERT_TRUE(p.parent.publish(1, bytes_of("one")).ok());
  Request r1 = take_one(p.child);
  const uint32_t before = p.parent.completions();
  ASSERT_TRUE(p.child.complete(r1.ticket, absl::OkStatus()).ok());
  EXPECT_EQ(p.parent.completions(), before + 1);
  // It must stay asleep: 100 ms in which a wake-up would show (a bounded wait that must time out).
  EXPECT_FALSE(simpler::testing::eventually([&] { return woke_ns.load() != 0; },
                                            std::chrono::milliseconds(100)))
      << "a terminal state woke the collector while the parent polled";
  // The thread that stops polling collects once: the run whose ring woke nobody is there.
  p.parent.set_polled(false);
  std::vector<Completion> done = p.parent.collect();
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].ticket.run_id, 1u);
  // Nobody polls now: the next terminal state wakes the sleeper at once.
  ASSERT_TRUE(p.parent.publish(2, bytes_of("two")).ok());
  Request r2 = take_one(p.child);
  const int64_t completed_ns = base::now_ns();
  ASSERT_TRUE(p.child.complete(r2.ticket, absl::OkStatus()).ok());
  collector.join();
  ASSERT_NE(woke_ns.load(), 0);
  EXPECT_LT(woke_ns.load() - completed_ns, 5'000'000'000) << "the ring did not wake it";
  done = p.parent.collect();
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].ticket.run_id, 2u);
}

TEST(Mailbox, TheFirstStopReasonWins) {
  Pair p(1);
  p.parent.stop("child 42 killed by signal 9 (Killed)");
  p.child.stop("a later reason");
  EXPECT_EQ(*p.parent.stop_reason(), "child 42 killed by signal 9 (Killed)");
  EXPECT_TRUE(p.child.stopped());
  EXPECT_TRUE(contains(p.child.take().status(), "child 42 killed by signal 9"));
}

// The parent publishes and collects from two threads while a child thread
// serves; every run comes back exactly once with its own status (TSan).
TEST(MailboxConcurrency, ManyRunsEachCompleteExactlyOnceWithTheirOwnStatus) {
  Pair p(4);
  constexpr uint64_t kRuns = 5000;
  std::atomic<bool> stop_child{false};
  std::thread child([&] {
    while (!stop_child.load()) {
      const uint32_t seen = p.child.doorbell();
      absl::StatusOr<std::optional<Request>> r = p.child.take();
      ASSERT_TRUE(r.ok()) << r.status();
      if (!r->has_value()) {
        p.child.wait(seen, 20'000'000);
        continue;
      }
      const Request& req = **r;
      const uint64_t run = req.ticket.run_id;
      ASSERT_EQ(text_of(req.payload), std::to_string(run));
      ASSERT_TRUE(p.child
                      .complete(req.ticket, run % 3 == 0 ? absl::InternalError(std::to_string(run))
                                                         : absl::OkStatus())
                      .ok());
    }
  });
  std::vector<int> seen(kRuns, 0);
  std::thread collector([&] {
    uint64_t collected = 0;
    while (collected < kRuns) {
      const uint32_t bell = p.parent.completions();
      std::vector<Completion> done = p.parent.collect();
      if (done.empty()) p.parent.wait_completions(bell, 20'000'000);
      for (const Completion& c : done) {
        const uint64_t run = c.ticket.run_id;
        ASSERT_LT(run, kRuns);
        ++seen[run];
        if (run % 3 == 0) {
          EXPECT_EQ(c.status, absl::InternalError(std::to_string(run)));
        } else {
          EXPECT_TRUE(c.status.ok()) << c.status;
        }
        ++collected;
      }
    }
  });
  for (uint64_t run = 0; run < kRuns;) {
    const uint32_t bell = p.parent.doorbell();
    if (!p.parent.can_dispatch()) {
      p.parent.wait(bell, 20'000'000);
      continue;
    }
    ASSERT_TRUE(p.parent.publish(run, bytes_of(std::to_string(run))).ok());
    ++run;
  }
  collector.join();
  stop_child.store(true);
  child.join();
  for (uint64_t run = 0; run < kRuns; ++run) ASSERT_EQ(seen[run], 1) << "run " << run;
}

}  // namespace
}  // namespace simpler::hierarchy

namespace simpler::hierarchy {
namespace {

// The child's side of grant changes over its own mapping of the region (as a process child has):
// a thread answering control commands the way serve_mailbox does.
class RegrantServer {
 public:
  explicit RegrantServer(MailboxRegion& parent_region)
      : region_(*MailboxRegion::attach(dup(parent_region.fd()))), child_(&region_) {
    thread_ = std::thread([this] {
      while (!stop_.load()) {
        const uint32_t seen = child_.doorbell();
        if (std::optional<ControlCommand> c = child_.take_control(); c.has_value()) {
          const absl::Status s = c->op == static_cast<uint32_t>(ControlOp::kRegrant)
                                     ? region_.adopt_grant(c->grant)
                                     : absl::InvalidArgumentError("not a regrant");
          ControlReply reply;
          reply.code = static_cast<int32_t>(s.code());
          const std::string text(s.message());
          std::memcpy(reply.text, text.data(), std::min<size_t>(text.size(), kErrorTextBytes - 1));
          reply.text_bytes =
              static_cast<uint32_t>(std::min<size_t>(text.size(), kErrorTextBytes - 1));
          child_.reply_control(reply);
          continue;
        }
        child_.wait(seen, 1'000'000);
      }
    });
  }
  ~RegrantServer() {
    stop_ = true;
    thread_.join();
  }
  MailboxRegion& region() { return region_; }
  MailboxChild& child() { return child_; }

 private:
  MailboxRegion region_;
  MailboxChild child_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

constexpr int64_t kRegrantTimeoutNs = 10'000'000'000;

// The parent's half over a region of `grant` and, as the child's half, a RegrantServer over its
// own mapping (a Pair whose child answers grant changes).
struct ServedPair {
  explicit ServedPair(uint32_t grant)
      : region(*MailboxRegion::create(grant)), parent(&region), server(region) {}
  MailboxRegion region;
  MailboxParent parent;
  RegrantServer server;
};

TEST(MailboxRegrant, GrowsWhileRunsAreHeldAndShrinksOnlyOnceTheEntriesAboveAreCollected) {
  ServedPair p(1);
  ASSERT_TRUE(p.parent.publish(100, bytes_of("held across the regrant")).ok());
  Request held = take_one(p.server.child());
  ASSERT_TRUE(p.parent.regrant(8, kRegrantTimeoutNs).ok());
  EXPECT_EQ(p.parent.grant(), 8u);
  EXPECT_EQ(p.region.header().grant, 8u);
  EXPECT_EQ(p.region.header().region_bytes, *mailbox_bytes(8));
  EXPECT_EQ(p.region.entry_count(), 10u);
  EXPECT_EQ(p.server.region().entry_count(), 10u);  // the child adopted the same table
  // Nine more runs: ten held at once, each in its own entry, then backpressure.
  std::vector<Request> taken{held};
  for (uint64_t run = 0; run < 9; ++run) {
    ASSERT_TRUE(p.parent.can_dispatch()) << run;
    ASSERT_TRUE(p.parent.publish(run, bytes_of("r")).ok());
    taken.push_back(take_one(p.server.child()));
  }
  EXPECT_FALSE(p.parent.can_dispatch());
  EXPECT_EQ(taken.back().ticket.entry, 9u);
  // Entries 0..2 finish; 3..9 still hold runs: the table cannot shrink below them.
  for (size_t i = 0; i < 3; ++i) {
    ASSERT_TRUE(p.server.child().complete(taken[i].ticket, absl::OkStatus()).ok());
  }
  EXPECT_EQ(p.parent.collect().size(), 3u);
  absl::Status shrink = p.parent.regrant(1, kRegrantTimeoutNs);
  EXPECT_EQ(shrink.code(), absl::StatusCode::kFailedPrecondition) << shrink;
  EXPECT_TRUE(contains(shrink, "would drop run-state entry 3, which run 2 holds")) << shrink;
  EXPECT_EQ(p.parent.grant(), 8u);  // unchanged, and still usable
  ASSERT_TRUE(p.parent.publish(50, bytes_of("after the refusal")).ok());
  taken.push_back(take_one(p.server.child()));
  for (size_t i = 3; i < taken.size(); ++i) {
    ASSERT_TRUE(p.server.child().complete(taken[i].ticket, absl::OkStatus()).ok());
  }
  std::vector<Completion> rest = p.parent.collect();
  EXPECT_EQ(rest.size(), taken.size() - 3);  // each run collected once
  ASSERT_TRUE(p.parent.regrant(1, kRegrantTimeoutNs).ok());
  EXPECT_EQ(p.region.entry_count(), 3u);
  EXPECT_EQ(p.server.region().entry_count(), 3u);
  for (uint64_t run = 200; run < 203; ++run) {
    ASSERT_TRUE(p.parent.publish(run, bytes_of("r")).ok());
    Request r = take_one(p.server.child());
    EXPECT_LT(r.ticket.entry, 3u);
  }
  EXPECT_FALSE(p.parent.can_dispatch());  // three entries at grant 1
  EXPECT_EQ(p.parent.regrant(0, kRegrantTimeoutNs).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(p.parent.regrant(1025, kRegrantTimeoutNs).code(), absl::StatusCode::kInvalidArgument);
}

// The region's bytes, the doorbells' words left out (a waiting thread moves their sleeper
// counts).
std::vector<uint8_t> snapshot(const MailboxRegion& r) {
  const auto* p = reinterpret_cast<const uint8_t*>(&r.layout());
  std::vector<uint8_t> out(p, p + r.bytes());
  for (const Doorbell* d :
       {&r.header().child_doorbell, &r.header().parent_doorbell, &r.header().completion_doorbell}) {
    const size_t at = reinterpret_cast<const uint8_t*>(d) - p;
    std::memset(out.data() + at, 0, sizeof(Doorbell));
  }
  return out;
}

TEST(MailboxRegrant, AFailedSizingLeavesThePreviousGrantAndEveryByteIntact) {
  ServedPair p(2);
  ASSERT_TRUE(p.parent.publish(7, bytes_of("in flight")).ok());
  Request held = take_one(p.server.child());
  const std::vector<uint8_t> before = snapshot(p.region);
  // The sizing fails: the file may not grow (RLIMIT_FSIZE makes ftruncate fail with EFBIG).
  struct rlimit old {};
  ASSERT_EQ(getrlimit(RLIMIT_FSIZE, &old), 0);
  struct rlimit capped = old;
  capped.rlim_cur = p.region.bytes();
  void (*old_handler)(int) = signal(SIGXFSZ, SIG_IGN);
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &capped), 0);
  absl::Status failed = p.parent.regrant(64, kRegrantTimeoutNs);
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &old), 0);
  signal(SIGXFSZ, old_handler);
  EXPECT_EQ(failed.code(), absl::StatusCode::kInternal) << failed;
  EXPECT_TRUE(contains(failed, "ftruncate")) << failed;
  EXPECT_EQ(p.parent.grant(), 2u);
  EXPECT_EQ(p.region.entry_count(), 4u);
  EXPECT_EQ(p.server.region().entry_count(), 4u);
  EXPECT_EQ(snapshot(p.region), before);  // header, frames and entries byte for byte
  // The run in flight completes and is collected as if nothing happened.
  ASSERT_TRUE(p.server.child().complete(held.ticket, absl::OkStatus()).ok());
  std::vector<Completion> done = p.parent.collect();
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].ticket.run_id, 7u);
}

TEST(MailboxRegrant, ConcurrentGrantChangesTakeTurnsAndBothSidesAgree) {
  ServedPair p(4);
  for (int round = 0; round < 20; ++round) {
    absl::Status grow, shrink;
    std::thread a([&] { grow = p.parent.regrant(8, kRegrantTimeoutNs); });
    std::thread b([&] { shrink = p.parent.regrant(2, kRegrantTimeoutNs); });
    a.join();
    b.join();
    ASSERT_TRUE(grow.ok()) << grow;
    ASSERT_TRUE(shrink.ok()) << shrink;
    const uint32_t g = p.parent.grant();
    ASSERT_TRUE(g == 8 || g == 2) << g;
    EXPECT_EQ(p.region.entry_count(), g + kRequestFrames);
    EXPECT_EQ(p.server.region().entry_count(), g + kRequestFrames);  // the child took the same
    EXPECT_EQ(p.region.header().grant, g);
  }
  // Every entry the table holds can carry a run, and no more.
  const uint32_t g = p.parent.grant();
  for (uint64_t run = 0; run < g + kRequestFrames; ++run) {
    ASSERT_TRUE(p.parent.can_dispatch()) << run;
    ASSERT_TRUE(p.parent.publish(run, bytes_of("r")).ok());
    (void)take_one(p.server.child());
  }
  EXPECT_FALSE(p.parent.can_dispatch());
}

TEST(MailboxControl, ACommandTheChildNeverAnswersStopsTheEndpoint) {
  Pair p(1);  // nobody serves the control frame
  ControlCommand c;
  c.op = static_cast<uint32_t>(ControlOp::kMalloc);
  c.device_bytes = 64;
  absl::StatusOr<ControlReply> r = p.parent.control(c, 20'000'000);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded) << r.status();
  ASSERT_TRUE(p.parent.stop_reason().has_value());
  EXPECT_NE(p.parent.stop_reason()->find("got no reply from the child within 20 ms"),
            std::string::npos)
      << *p.parent.stop_reason();
  EXPECT_FALSE(p.parent.can_dispatch());  // what the child did with it is unknown: stopped
  EXPECT_EQ(p.parent.regrant(2, 20'000'000).code(), absl::StatusCode::kFailedPrecondition);
}

TEST(MailboxRegrant, TheChildChecksTheGrantAgainstTheExtentBeforeInstallingAnything) {
  MailboxRegion region = *MailboxRegion::create(2);
  MailboxRegion child_view = *MailboxRegion::attach(dup(region.fd()));
  const std::vector<uint8_t> before = snapshot(child_view);
  // The parent never grew the file: a grant of 64 does not fit its extent.
  absl::Status refused = child_view.adopt_grant(64);
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  EXPECT_TRUE(contains(refused, absl::StrCat("grant 64 needs ", *mailbox_bytes(64),
                                             " bytes; the region holds ", *mailbox_bytes(2))))
      << refused;
  EXPECT_EQ(child_view.entry_count(), 4u);
  EXPECT_EQ(child_view.entry(4), nullptr);
  EXPECT_EQ(snapshot(child_view), before);
  EXPECT_EQ(child_view.adopt_grant(0).code(), absl::StatusCode::kInvalidArgument);
  // Once the parent sized it, the same check passes and the table is installed.
  ASSERT_TRUE(region.prepare_grant(64).ok());
  ASSERT_TRUE(child_view.adopt_grant(64).ok());
  EXPECT_EQ(child_view.entry_count(), 66u);
  ASSERT_NE(child_view.entry(65), nullptr);
  EXPECT_EQ(child_view.entry(65)->generation.load(), 0u);  // installed free
}

}  // namespace
}  // namespace simpler::hierarchy
