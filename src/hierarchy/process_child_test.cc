// What only a process child can do: die. Its parent fails every run it held, naming the child and
// the signal, promptly; a parent that dies takes its children with it; a process that already
// runs threads is refused a fork.
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <fstream>
#include <future>
#include <thread>

#include "gtest/gtest.h"
#include "hierarchy/endpoint.h"
#include "simpler/device/fault_plan.h"
#include "worker/worker_test_util.h"

namespace simpler::hierarchy {
namespace {

using worker::RunHandle;
using worker::testing::contains;
using worker::testing::sleep_program;

RunRequest sleep_request(int64_t us) {
  RunRequest r;
  r.callable = "sleep";
  r.args.add_scalar_i64(us);
  return r;
}

ChildSpec sleep_spec(const std::string& faults = "") {
  ChildSpec spec;
  spec.index = 2;
  spec.options = worker::testing::test_options(2);
  if (!faults.empty()) spec.options.faults = *device::FaultPlan::parse(faults);
  spec.callables.push_back(sleep_program());
  return spec;
}

// ThreadSanitizer runs a background thread of its own: no fork is safe there (and
// start_process_child refuses it, as AProcessRunningThreadsIsRefusedAFork checks).
class ProcessChild : public ::testing::Test {
 protected:
  void SetUp() override {
    if (process_thread_count() != 1) {
      GTEST_SKIP() << "this process already runs " << process_thread_count()
                   << " threads (a sanitizer's): process children cannot be forked";
    }
  }
};

// Whether `pid` is gone (no such process, or a zombie nobody reaped yet).
bool gone(pid_t pid) {
  if (kill(pid, 0) != 0) return true;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  std::getline(stat, line);
  const size_t close_paren = line.rfind(')');
  return close_paren == std::string::npos || line.substr(close_paren + 2, 1) == "Z";
}

TEST_F(ProcessChild, ASigkilledChildFailsEveryRunItHeldNamingTheSignal) {
  auto e = *start_process_child(sleep_spec("run=1:task=0:kind=process_kill"));
  std::vector<RunHandle> hs;
  // Run 0 first: its result is out before run 1's task kills the process
  // (a run still unreported when the child dies fails like the others).
  hs.push_back(*e->submit(sleep_request(20'000)));
  EXPECT_TRUE(hs[0].wait().ok());
  // Run 1 is accepted (the child lives until it runs); runs 2 and 3 race its death: each is
  // either accepted and then failed, or refused at submit, naming the signal either way.
  hs.push_back(*e->submit(sleep_request(20'000)));
  for (int i = 2; i < 4; ++i) {
    absl::StatusOr<RunHandle> h = e->submit(sleep_request(20'000));
    if (h.ok()) {
      hs.push_back(*std::move(h));
      continue;
    }
    EXPECT_EQ(h.status().code(), absl::StatusCode::kFailedPrecondition) << h.status();
    EXPECT_TRUE(contains(h.status(), "killed by signal 9 (Killed)")) << h.status();
  }
  const auto t0 = std::chrono::steady_clock::now();
  for (size_t i = 1; i < hs.size(); ++i) {
    absl::Status s = hs[i].wait(10.0);
    EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << i << ": " << s;
    EXPECT_TRUE(contains(s, "child 2 (process ")) << s;
    EXPECT_TRUE(contains(s, "killed by signal 9 (Killed)")) << s;
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(3));
  absl::StatusOr<RunHandle> after = e->submit(sleep_request(1));
  EXPECT_EQ(after.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(contains(after.status(), "killed by signal 9")) << after.status();
  EXPECT_FALSE(e->can_dispatch());
  EXPECT_TRUE(e->close().ok());  // every error was delivered by wait()
}

TEST_F(ProcessChild, AChildKilledWhileIdleRefusesLaterSubmitsNamingIt) {
  auto e = *start_process_child(sleep_spec());
  ASSERT_TRUE(e->submit(sleep_request(1))->wait().ok());
  const std::string who = e->describe();  // "child 2 (process N)"
  const pid_t pid = std::stoi(who.substr(who.find("process ") + 8));
  ASSERT_EQ(kill(pid, SIGTERM), 0);
  absl::Status refused;  // submits go on succeeding until the endpoint sees the death
  EXPECT_TRUE(simpler::testing::eventually([&] {
    absl::StatusOr<RunHandle> h = e->submit(sleep_request(1));
    refused = h.ok() ? h->wait(5.0) : h.status();
    return !refused.ok();
  }));
  EXPECT_TRUE(contains(refused, "killed by signal 15 (Terminated)")) << refused;
  (void)e->close();
}

TEST_F(ProcessChild, AChildWhoseWorkerCannotStartStopsTheEndpointSayingWhy) {
  ChildSpec spec = sleep_spec();
  spec.options.launch_depth = 0;  // refused by the child's Worker::init
  spec.grant = 2;
  auto e = *start_process_child(spec);
  absl::StatusOr<RunHandle> h = e->submit(sleep_request(1));
  absl::Status s = h.ok() ? h->wait(10.0) : h.status();
  EXPECT_TRUE(contains(s, "could not start its worker")) << s;
  EXPECT_TRUE(contains(s, "launch_depth 0")) << s;
  (void)e->close();
}

TEST_F(ProcessChild, AProcessRunningThreadsIsRefusedAFork) {
  std::promise<void> stop;
  std::thread other([done = stop.get_future()] { done.wait(); });  // a second thread, blocked
  absl::StatusOr<std::unique_ptr<Endpoint>> e = start_process_child(sleep_spec());
  stop.set_value();
  other.join();
  EXPECT_EQ(e.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(contains(e.status(), "forked from a single-threaded point")) << e.status();
  EXPECT_TRUE(contains(e.status(), "runs 2 threads")) << e.status();
}

// The parent (an intermediate process here) is SIGKILLed: its child follows
// within a few seconds instead of serving an endpoint nobody reads.
TEST_F(ProcessChild, AChildDiesWithItsParent) {
  int fds[2];
  ASSERT_EQ(pipe(fds), 0);
  const pid_t parent = fork();
  ASSERT_GE(parent, 0);
  if (parent == 0) {
    close(fds[0]);
    absl::StatusOr<std::unique_ptr<Endpoint>> e = start_process_child(sleep_spec());
    pid_t child = -1;
    if (e.ok()) {
      const std::string who = (*e)->describe();
      child = std::stoi(who.substr(who.find("process ") + 8));
    }
    (void)!write(fds[1], &child, sizeof(child));
    pause();  // until SIGKILLed
    _exit(0);
  }
  close(fds[1]);
  pid_t child = -1;
  ASSERT_EQ(read(fds[0], &child, sizeof(child)), static_cast<ssize_t>(sizeof(child)));
  close(fds[0]);
  ASSERT_GT(child, 0);
  EXPECT_FALSE(gone(child));
  ASSERT_EQ(kill(parent, SIGKILL), 0);
  int status = 0;
  ASSERT_EQ(waitpid(parent, &status, 0), parent);
  EXPECT_TRUE(simpler::testing::eventually([&] { return gone(child); }, std::chrono::seconds(5)))
      << "child " << child << " outlived its parent";
  if (!gone(child)) kill(child, SIGKILL);
}

}  // namespace
}  // namespace simpler::hierarchy
