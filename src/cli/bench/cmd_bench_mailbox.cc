// `simpler bench mailbox`: what the L3 hierarchy costs, measured side by side in one run — the
// bare shared-memory round trip (publish a frame, the child ACKs and writes a terminal state),
// an L3 run of one trivial task in process and thread mode, the same run on an L2 Worker, the
// marginal cost per next-level task, and the mailbox's bytes per grant.
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <optional>
#include <thread>
#include <utility>

#include "absl/functional/function_ref.h"
#include "cli/bench/bench_commands.h"
#include "cli/bench/bench_stats.h"
#include "cli/commands.h"
#include "hierarchy/mailbox.h"
#include "nlohmann/json.hpp"
#include "simpler/base/clock.h"
#include "simpler/base/status.h"
#include "simpler/hierarchy/l3_worker.h"
#include "simpler/task/callable.h"

namespace simpler::cli {

namespace {

struct Percentiles {
  double p50 = 0, p99 = 0;
};

Percentiles percentiles(const std::vector<double>& us) {
  return {percentile(us, 0.5), percentile(us, 0.99)};
}

absl::Status noop_kernel(const task::KernelContext&) { return absl::OkStatus(); }

// Stands for scalar(0) µs of device time. It yields its CPU while it waits the time out: a
// device's kernel takes no host CPU, and a spinning one here held the parent's and the child's
// host threads that the kernel placed on its CPU off it for the whole run, so run k+2 was staged
// only after run k+1 ended (docs/benchmarks-history.md, the L3 hierarchy entries: perf sched showed
// the parent's runnable thread queued behind the sim stream for 400 µs while the other CPU idled).
// The L2 lane's gap is measured with the same kernel.
absl::Status busy_kernel(const task::KernelContext& ctx) {
  const int64_t until = base::now_ns() + ctx.scalar_i64(0) * 1000;
  while (base::now_ns() < until) std::this_thread::yield();
  return absl::OkStatus();
}

task::ChipCallable busy_program() { return task::one_kernel_callable("busy", busy_kernel); }

constexpr int64_t kBusyUs = 200;  // device time of one run in the gap measurements

// p50 of the device gaps between consecutive spans.
double gap_p50(const std::vector<std::pair<int64_t, int64_t>>& spans) {
  std::vector<double> gaps;
  for (size_t i = 1; i < spans.size(); ++i) {
    gaps.push_back((spans[i].first - spans[i - 1].second) / 1e3);
  }
  return percentiles(gaps).p50;
}

// Its runs have no arguments.
task::ChipCallable noop_program() { return task::one_kernel_callable("noop", noop_kernel); }

// The bare round trip: a forked child that completes every request as soon as it takes it.
absl::StatusOr<Percentiles> bare_rtt(int iterations) {
  SIMPLER_ASSIGN_OR_RETURN(hierarchy::MailboxRegion region, hierarchy::MailboxRegion::create(1));
  const pid_t parent = getpid();
  std::fflush(nullptr);
  const pid_t pid = fork();
  if (pid < 0) return absl::InternalError("bench mailbox: fork failed");
  if (pid == 0) {
    (void)prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(1);
    hierarchy::MailboxChild child(&region);
    while (true) {
      const uint32_t seen = child.doorbell();
      absl::StatusOr<std::optional<hierarchy::Request>> r = child.take();
      if (!r.ok()) _exit(0);
      if (!r->has_value()) {
        child.wait(seen, 1'000'000'000);
        continue;
      }
      (void)child.complete((*r)->ticket, absl::OkStatus());
    }
  }
  hierarchy::MailboxParent p(&region);
  const std::vector<uint8_t> payload(64, 0);
  std::vector<double> us;
  for (int i = 0; i < iterations; ++i) {
    const int64_t t0 = base::now_ns();
    if (!p.publish(static_cast<uint64_t>(i), payload).ok()) break;
    while (true) {
      const uint32_t seen = p.completions();
      if (!p.collect().empty()) break;
      p.wait_completions(seen, 1'000'000'000);
    }
    us.push_back((base::now_ns() - t0) / 1e3);
  }
  p.stop("bench over");
  (void)waitpid(pid, nullptr, 0);
  if (static_cast<int>(us.size()) != iterations) {
    return absl::InternalError("bench mailbox: a publish was refused");
  }
  return percentiles(us);
}

// Where a one-task run's time goes, p50 of each part (µs): from submit to the task's start on
// the device, the task on the device, and from its end to the caller seeing the run done.
struct Split {
  double to_device = 0, device = 0, back = 0;
};

Split split_of(const std::vector<std::array<int64_t, 4>>& stamps) {
  std::vector<double> to, on, back;
  for (const auto& [submit, start, end, done] : stamps) {
    to.push_back((start - submit) / 1e3);
    on.push_back((end - start) / 1e3);
    back.push_back((done - end) / 1e3);
  }
  return {percentile(to, 0.5), percentile(on, 0.5), percentile(back, 0.5)};
}

// Starts one run and returns its handle.
using SubmitFn = absl::FunctionRef<absl::StatusOr<worker::RunHandle>()>;
// The device span (start ns, end ns) of a finished run's task; nullopt when it reports none.
using SpanFn = absl::FunctionRef<std::optional<std::pair<int64_t, int64_t>>(worker::RunHandle&)>;

struct RoundTrips {
  Percentiles us;
  Split split;  // of the runs that reported a span
};

// `runs` runs started by `submit`, each waited for before the next starts, after a warm-up
// tenth that is not counted.
absl::StatusOr<RoundTrips> round_trips(int runs, SubmitFn submit, SpanFn span) {
  std::vector<double> us;
  std::vector<std::array<int64_t, 4>> stamps;
  for (int i = 0; i < runs + runs / 10; ++i) {
    const int64_t t0 = base::now_ns();
    SIMPLER_ASSIGN_OR_RETURN(worker::RunHandle h, submit());
    SIMPLER_RETURN_IF_ERROR(h.wait());
    const int64_t t1 = base::now_ns();
    if (i < runs / 10) continue;
    us.push_back((t1 - t0) / 1e3);
    if (auto s = span(h)) stamps.push_back({t0, s->first, s->second, t1});
  }
  return RoundTrips{percentiles(us), split_of(stamps)};
}

// p50 of the device gaps between consecutive runs of `runs` runs started by `submit` back to
// back (each queues behind the one before). INTERNAL when a run reports no span.
absl::StatusOr<double> back_to_back_gap_p50(int runs, SubmitFn submit, SpanFn span) {
  std::vector<worker::RunHandle> hs;
  for (int i = 0; i < runs; ++i) {
    SIMPLER_ASSIGN_OR_RETURN(worker::RunHandle h, submit());
    hs.push_back(h);
  }
  std::vector<std::pair<int64_t, int64_t>> spans;
  for (worker::RunHandle& h : hs) {
    SIMPLER_RETURN_IF_ERROR(h.wait());
    std::optional<std::pair<int64_t, int64_t>> s = span(h);
    if (!s.has_value()) return absl::InternalError("bench mailbox: a run reported no task span");
    spans.push_back(*s);
  }
  return gap_p50(spans);
}

// An L3 run's span: its first task's on the child's device.
std::optional<std::pair<int64_t, int64_t>> first_task_span(worker::RunHandle& h) {
  const auto& tasks = h.result().report.tasks;
  if (tasks.empty()) return std::nullopt;
  return std::make_pair(tasks[0].start_ns, tasks[0].end_ns);
}

// How many back-to-back runs the gap measurements take.
int gap_runs(int runs) { return std::max(20, std::min(runs, 400)); }

struct L3Numbers {
  Percentiles one_task;
  Split split;
  std::map<int, double> marginal_us;  // tasks -> µs per task
  double staged_gap_us_p50 = 0;       // child 0's device gap between consecutive L3 runs
};

absl::StatusOr<L3Numbers> l3_numbers(hierarchy::ChildMode mode, int runs,
                                     const worker::WorkerOptions& child) {
  hierarchy::L3Options o;
  o.device_ids = {0, 1};
  o.child_mode = mode;
  o.child = child;
  o.host_heap_bytes = 1 << 20;
  hierarchy::L3Worker w(o);
  SIMPLER_ASSIGN_OR_RETURN(hierarchy::ChildCallable noop, w.register_callable(noop_program()));
  SIMPLER_ASSIGN_OR_RETURN(hierarchy::ChildCallable busy, w.register_callable(busy_program()));
  SIMPLER_ASSIGN_OR_RETURN(
      hierarchy::ProgramHandle busy_run,
      w.register_program({"busy_run", [busy](hierarchy::L3Context& ctx, const task::TaskArgs&) {
                            task::TaskArgs a;
                            a.add_scalar_i64(kBusyUs);
                            return ctx.submit_next_level(busy, a, 0).status();
                          }}));
  std::map<int, hierarchy::ProgramHandle> fan;
  for (int n : {1, 16, 256}) {
    SIMPLER_ASSIGN_OR_RETURN(
        fan[n], w.register_program(
                    {absl::StrCat("fan_", n),
                     [noop, n](hierarchy::L3Context& ctx, const task::TaskArgs&) -> absl::Status {
                       for (int t = 0; t < n; ++t) {
                         SIMPLER_RETURN_IF_ERROR(
                             ctx.submit_next_level(noop, {}, t % ctx.num_children()).status());
                       }
                       return absl::OkStatus();
                     }}));
  }
  SIMPLER_RETURN_IF_ERROR(w.init());
  L3Numbers out;
  auto one_task_run = [&] { return w.submit(fan[1], {}); };
  SIMPLER_ASSIGN_OR_RETURN(RoundTrips one_task, round_trips(runs, one_task_run, first_task_span));
  out.one_task = one_task.us;
  out.split = one_task.split;
  std::map<int, double> median_run_us;
  for (int n : {1, 16, 256}) {
    const int reps = std::max(5, runs / n);
    std::vector<double> t;
    for (int i = 0; i < reps; ++i) {
      const int64_t t0 = base::now_ns();
      SIMPLER_RETURN_IF_ERROR(w.run(fan[n], {}));
      t.push_back((base::now_ns() - t0) / 1e3);
    }
    median_run_us[n] = percentiles(t).p50;
  }
  // The marginal cost of a task: an N-task run's time beyond a 1-task run's, per extra task
  // (for N = 1, the 1-task run itself).
  for (int n : {1, 16, 256}) {
    out.marginal_us[n] =
        n == 1 ? median_run_us[1] : (median_run_us[n] - median_run_us[1]) / (n - 1);
  }
  // Back-to-back runs of one task on child 0: with staging, run k+1's task waits on the
  // child's lane while run k executes.
  auto staged_run = [&] { return w.submit(busy_run, {}); };
  SIMPLER_ASSIGN_OR_RETURN(out.staged_gap_us_p50,
                           back_to_back_gap_p50(gap_runs(runs), staged_run, first_task_span));
  SIMPLER_RETURN_IF_ERROR(w.close());
  return out;
}

struct L2Numbers {
  Percentiles run;
  Split split;
  double gap_us_p50 = 0;  // the lane's own device gap between consecutive runs
};

// An L2 run's span on the device.
std::optional<std::pair<int64_t, int64_t>> run_span(worker::RunHandle& h) {
  const worker::RunTiming& t = h.result().timing;
  return std::make_pair(t.device_start_ns, t.device_end_ns);
}

absl::StatusOr<L2Numbers> l2_numbers(int runs, const worker::WorkerOptions& options) {
  worker::Worker w(options);
  SIMPLER_ASSIGN_OR_RETURN(worker::CallableHandle noop, w.register_callable(noop_program()));
  SIMPLER_ASSIGN_OR_RETURN(worker::CallableHandle busy, w.register_callable(busy_program()));
  SIMPLER_RETURN_IF_ERROR(w.init());
  L2Numbers out;
  auto noop_run = [&] { return w.submit(noop, {}); };
  SIMPLER_ASSIGN_OR_RETURN(RoundTrips run, round_trips(runs, noop_run, run_span));
  out.run = run.us;
  out.split = run.split;
  task::TaskArgs a;
  a.add_scalar_i64(kBusyUs);
  auto busy_run = [&] { return w.submit(busy, a); };
  SIMPLER_ASSIGN_OR_RETURN(out.gap_us_p50,
                           back_to_back_gap_p50(gap_runs(runs), busy_run, run_span));
  SIMPLER_RETURN_IF_ERROR(w.close());
  return out;
}

}  // namespace

Runner add_bench_mailbox_command(CLI::App* bench) {
  struct State {
    CommonOptions common;
    int runs = 2000;
  };
  auto st = std::make_shared<State>();
  auto* cmd = bench->add_subcommand(
      "mailbox",
      "L3 hierarchy cost: bare shared-memory round trip, L3 run in process and thread mode, L2 "
      "run, marginal per-task cost, mailbox bytes");
  cmd->add_option("--runs", st->runs, "round trips / runs per measurement")
      ->check(int_in(10, kMaxRepeats))
      ->capture_default_str();
  // The children's defaults, set before the flags so that --help shows them and the parser's
  // checks (--run-grant against --launch-depth) see them: one core each, and depth 2 on their
  // lanes (a staged task waits on the device stream itself).
  st->common.cores = 1;
  st->common.launch_depth = 2;
  st->common.add_to(cmd);
  cmd->remove_option(cmd->get_option("--trace"));  // its runs are timed, not traced
  return [cmd, st]() -> int {
    if (!cmd->parsed()) return -1;
    const worker::WorkerOptions child = st->common.worker_options(nullptr);
    // Forks first, while this process is single-threaded.
    absl::StatusOr<Percentiles> rtt = bare_rtt(st->runs);
    if (!rtt.ok()) return fail("bench mailbox", rtt.status());
    absl::StatusOr<L3Numbers> process = l3_numbers(hierarchy::ChildMode::kProcess, st->runs, child);
    if (!process.ok()) return fail("bench mailbox (process mode)", process.status());
    absl::StatusOr<L3Numbers> thread = l3_numbers(hierarchy::ChildMode::kThread, st->runs, child);
    if (!thread.ok()) return fail("bench mailbox (thread mode)", thread.status());
    absl::StatusOr<L2Numbers> l2n = l2_numbers(st->runs, child);
    if (!l2n.ok()) return fail("bench mailbox (L2)", l2n.status());
    const Percentiles* l2 = &l2n->run;
    std::map<uint32_t, uint64_t> bytes;
    for (uint32_t g : {1u, 2u, 64u, 1024u}) bytes[g] = *hierarchy::mailbox_bytes(g);
    const double target = l2->p50 + 3 * rtt->p50;
    if (st->common.json) {
      nlohmann::json j;
      j["bare_rtt_us_p50"] = rtt->p50;
      j["bare_rtt_us_p99"] = rtt->p99;
      j["l3_run_us_p50"] = {{"process", process->one_task.p50}, {"thread", thread->one_task.p50}};
      j["l3_run_us_p99"] = {{"process", process->one_task.p99}, {"thread", thread->one_task.p99}};
      j["l2_run_us_p50"] = l2->p50;
      nlohmann::json marginal;
      for (const auto& [n, us] : process->marginal_us) marginal[std::to_string(n)] = us;
      j["marginal_us_per_task"] = marginal;
      nlohmann::json mb;
      for (const auto& [g, b] : bytes) mb[std::to_string(g)] = b;
      j["mailbox_bytes"] = mb;
      j["staged_gap_us_p50"] = process->staged_gap_us_p50;
      j["staged_gap_us_p50_thread"] = thread->staged_gap_us_p50;
      j["l2_gap_us_p50"] = l2n->gap_us_p50;
      j["target_l3_run_us_p50"] = target;
      const auto split_json = [](const Split& sp) {
        return nlohmann::json{{"to_device_us_p50", sp.to_device},
                              {"device_us_p50", sp.device},
                              {"back_us_p50", sp.back}};
      };
      j["run_split"] = {{"l3_process", split_json(process->split)},
                        {"l3_thread", split_json(thread->split)},
                        {"l2", split_json(l2n->split)}};
      print_json_line(j);
      return 0;
    }
    std::printf("bare shared-memory round trip      p50 %8.1f us   p99 %8.1f us\n", rtt->p50,
                rtt->p99);
    std::printf("L3 run, 1 task, process mode       p50 %8.1f us   p99 %8.1f us\n",
                process->one_task.p50, process->one_task.p99);
    std::printf("L3 run, 1 task, thread mode        p50 %8.1f us   p99 %8.1f us\n",
                thread->one_task.p50, thread->one_task.p99);
    std::printf("L2 run, 1 task                     p50 %8.1f us\n", l2->p50);
    std::printf("target: L3 process p50 <= L2 p50 + 3 x round trip = %.1f us: %s\n", target,
                process->one_task.p50 <= target ? "met" : "MISSED");
    std::printf(
        "where a one-task run's time goes, p50 (submit -> device start / on device / "
        "device end -> done):\n");
    for (const auto& [name, sp] : {std::pair<const char*, Split>{"L3 process", process->split},
                                   {"L3 thread", thread->split},
                                   {"L2", l2n->split}}) {
      std::printf("  %-11s %8.1f us  %8.1f us  %8.1f us\n", name, sp.to_device, sp.device, sp.back);
    }
    std::printf("marginal cost per next-level task (process mode):");
    for (const auto& [n, us] : process->marginal_us) std::printf("  %d tasks %.2f us", n, us);
    std::printf("\nmailbox bytes:");
    for (const auto& [g, b] : bytes) std::printf("  grant %u: %llu", g, (unsigned long long)b);
    std::printf(
        "\ndevice gap between consecutive runs of %lld us on one child, p50: L3 staged "
        "process %.1f us, thread %.1f us; L2 lane %.1f us (target: L3 within 2x: %s)\n",
        static_cast<long long>(kBusyUs), process->staged_gap_us_p50, thread->staged_gap_us_p50,
        l2n->gap_us_p50, process->staged_gap_us_p50 <= 2 * l2n->gap_us_p50 ? "met" : "MISSED");
    return 0;
  };
}

}  // namespace simpler::cli
