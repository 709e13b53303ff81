// Attacks on LlmEngine (docs/design/engine.md): aborts racing steps, preemption
// storms, slow consumers and re-entrant callbacks, faults mid-prefill and
// mid-decode at every launch depth, shutdown racing callers, stop strings with
// min_tokens and n > 1. Whatever happens, every choice of every accepted
// request ends with exactly one final event, the tokens it delivered add up
// to its completion_tokens, the KV page states sum to the pool and a healthy
// engine has every page free after shutdown.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <filesystem>
#include <functional>
#include <limits>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "base/sanitizers.h"
#include "base/test_status.h"
#include "base/test_wait.h"
#include "engine/engine_test_hooks.h"
#include "engine/engine_test_util.h"
#include "gtest/gtest.h"
#include "simpler/device/fault_plan.h"
#include "simpler/engine/llm_engine.h"
#include "simpler/model/make_model.h"
#include "simpler/tokenizer/detokenizer.h"
#include "simpler/tokenizer/tokenizer.h"

namespace simpler::llm {
namespace {

// Shuts down once the steps still in flight have finished (every choice has ended, so the drain
// ends with them). shutdown()'s default poll deadline gives those early-enqueued steps only the
// loop's 2 s grace before the close cancels them and quarantines their pages, and ThreadSanitizer
// on a loaded 2-vCPU machine overran it (2 of 4 pages left held, once in 7 runs).
absl::Status drained_shutdown(LlmEngine& e) {
  return e.shutdown(base::Deadline::after(std::chrono::seconds(60)));
}

using namespace std::chrono_literals;

// Sanitizer builds run 5-20x slower: the heaviest loops shrink there.
constexpr bool kSanitized = SIMPLER_SANITIZED;

constexpr int64_t kSoloTokens = 48;  // tokens of every reference run

using simpler::testing::contains;

// Waits, at most a second, until `e` has run another step: the pause of a caller the engine
// refused for lack of room (room comes with its progress). An engine that stopped taking steps
// ends it at the bound; the caller's next attempt says why.
void await_a_step(LlmEngine& e) {
  const int64_t steps = e.metrics().steps_total;
  (void)simpler::testing::eventually([&] { return e.metrics().steps_total > steps; }, 1s);
}

bool is_prefix(const std::vector<int32_t>& a, const std::vector<int32_t>& b) {
  return a.size() <= b.size() && std::equal(a.begin(), a.end(), b.begin());
}

double seconds_since(int64_t t0_ns) { return (base::now_ns() - t0_ns) / 1e9; }

// Everything one choice delivered.
struct ChoiceLog {
  std::vector<int32_t> tokens;
  std::string text;
  int finals = 0;
  OutputFinish finish = OutputFinish::kNone;
  absl::Status error;
  int64_t completion_tokens = -1;
};

// Everything one request delivered, in delivery order per choice.
struct RequestLog {
  RequestId id = 0;
  std::vector<ChoiceLog> choices;
  int bad_events = 0;  // a wrong id or index, or an event after its choice's final
  absl::Status read_error;

  RequestLog() = default;
  RequestLog(RequestId rid, int n) : id(rid), choices(n) {}
  void add(const RequestOutput& out) {
    if (out.id != id || out.index < 0 || out.index >= static_cast<int>(choices.size())) {
      ++bad_events;
      return;
    }
    ChoiceLog& c = choices[out.index];
    if (c.finals > 0) ++bad_events;
    c.tokens.insert(c.tokens.end(), out.token_ids.begin(), out.token_ids.end());
    c.text += out.text;
    if (out.finished()) {
      ++c.finals;
      c.finish = out.finish;
      c.error = out.error;
      c.completion_tokens = out.completion_tokens;
    }
  }
  bool complete() const {
    for (const ChoiceLog& c : choices) {
      if (c.finals == 0) return false;
    }
    return true;
  }
};

// Reads every event of a request until each of its n choices delivered its
// final event; afterwards the request must be NOT_FOUND (nothing left over).
RequestLog read_all(LlmEngine& e, RequestId id, int n, std::chrono::seconds timeout = 60s) {
  RequestLog log(id, n);
  while (!log.complete()) {
    auto out = e.next_output(id, base::Deadline::after(timeout));
    if (!out.ok()) {
      log.read_error = out.status();
      return log;
    }
    log.add(*out);
  }
  auto extra = e.next_output(id, base::Deadline::poll());
  if (extra.status().code() != absl::StatusCode::kNotFound) ++log.bad_events;
  return log;
}

// Exactly one final event per choice, nothing after it, and the tokens
// delivered are the completion_tokens the final event reports.
void expect_well_formed(const RequestLog& log) {
  EXPECT_TRUE(log.read_error.ok()) << "request " << log.id << ": " << log.read_error;
  EXPECT_EQ(log.bad_events, 0) << "request " << log.id;
  for (size_t i = 0; i < log.choices.size(); ++i) {
    const ChoiceLog& c = log.choices[i];
    EXPECT_EQ(c.finals, 1) << "request " << log.id << " choice " << i;
    EXPECT_NE(c.finish, OutputFinish::kNone) << "request " << log.id << " choice " << i;
    EXPECT_EQ(static_cast<int64_t>(c.tokens.size()), c.completion_tokens)
        << "request " << log.id << " choice " << i << " (" << finish_reason_name(c.finish) << ", "
        << c.error << "): the tokens delivered differ from completion_tokens";
  }
}

// Events delivered to on_output callbacks, by request id (a callback may run
// before add_request returned the id).
class Sink {
 public:
  std::function<void(const RequestOutput&)> callback(
      int n, std::function<void(const RequestOutput&)> then = nullptr) {
    return [this, n, then](const RequestOutput& out) {
      if (then) then(out);  // before the event counts as seen: waiters see its effects
      {
        std::lock_guard<std::mutex> l(mu_);
        auto it = logs_.try_emplace(out.id, out.id, n).first;
        it->second.add(out);
        if (std::this_thread::get_id() != callback_thread_ &&
            callback_thread_ != std::thread::id()) {
          ++foreign_threads_;
        }
        callback_thread_ = std::this_thread::get_id();
      }
      cv_.notify_all();
    };
  }
  // Waits until every listed request delivered all its finals.
  bool wait_complete(const std::vector<RequestId>& ids, std::chrono::seconds timeout = 60s) {
    std::unique_lock<std::mutex> l(mu_);
    return cv_.wait_for(l, timeout, [&] {
      for (RequestId id : ids) {
        auto it = logs_.find(id);
        if (it == logs_.end() || !it->second.complete()) return false;
      }
      return true;
    });
  }
  RequestLog get(RequestId id) {
    std::lock_guard<std::mutex> l(mu_);
    auto it = logs_.find(id);
    return it == logs_.end() ? RequestLog(id, 1) : it->second;
  }
  int foreign_threads() {
    std::lock_guard<std::mutex> l(mu_);
    return foreign_threads_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<RequestId, RequestLog> logs_;
  std::thread::id callback_thread_;
  int foreign_threads_ = 0;  // callbacks seen on more than one thread
};

// greedy()'s request, sampled instead (temperature 0.8, top_k 40) with RNG seed `seed`.
RequestSpec seeded(std::vector<int32_t> prompt, int64_t max_tokens, uint64_t seed, int n = 1) {
  RequestSpec s = greedy(std::move(prompt), max_tokens, n);
  s.sampling.temperature = 0.8f;
  s.sampling.top_k = 40;
  s.sampling.presence_penalty = 0.4f;
  s.sampling.seed = seed;
  return s;
}

// A small model (vocab 512) and the greedy tokens of a fixed prompt set, run
// alone, made once per test binary.
class LlmEngineStressTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::string(test_model_dir("simpler_llm_engine_stress_"));
    ASSERT_TRUE(make_model(small_test_model_options(*dir_, 5)).ok());
    prompts_ = new std::vector<std::vector<int32_t>>(random_prompts(12, 24, 21, /*max_id=*/500));
    solo_ = new std::vector<std::vector<int32_t>>();
    auto e = LlmEngine::create(*dir_, options(1, 256, 64, 1));
    ASSERT_TRUE(e.ok()) << e.status();
    for (const auto& p : *prompts_) {
      const RequestId id = (*e)->add_request(greedy(p, kSoloTokens)).value();
      const RequestLog log = read_all(**e, id, 1);
      ASSERT_EQ(log.choices[0].finish, OutputFinish::kLength);
      solo_->push_back(log.choices[0].tokens);
    }
    ASSERT_TRUE((*e)->shutdown().ok());
  }
  static void TearDownTestSuite() {
    std::filesystem::remove_all(*dir_);
    delete dir_;
    delete prompts_;
    delete solo_;
  }

  static EngineOptions options(int depth, int pages = 256, int budget = 64, int seqs = 16,
                               int page_size = 4) {
    return small_engine_options(depth, pages, budget, seqs, page_size);
  }
  static EngineOptions with_faults(EngineOptions eo, const std::string& plan) {
    eo.runner.worker.faults = device::FaultPlan::parse(plan).value();
    return eo;
  }

  static std::unique_ptr<LlmEngine> engine(const EngineOptions& eo) {
    return create_test_engine(*dir_, eo);
  }

  static const std::vector<int32_t>& prompt(size_t i) { return (*prompts_)[i % prompts_->size()]; }
  static const std::vector<int32_t>& solo(size_t i) { return (*solo_)[i % solo_->size()]; }
  static std::vector<int32_t> solo(size_t i, int64_t max_tokens) {
    return std::vector<int32_t>(solo(i).begin(), solo(i).begin() + max_tokens);
  }

  // A greedy choice of prompt i: finished by max_tokens with exactly its solo
  // tokens, or aborted with a strict prefix of them.
  static void expect_solo_or_aborted_prefix(const ChoiceLog& c, size_t i, int64_t max_tokens) {
    if (c.finish == OutputFinish::kLength) {
      EXPECT_EQ(c.tokens, solo(i, max_tokens)) << "prompt " << i;
    } else {
      EXPECT_EQ(c.finish, OutputFinish::kAbort) << "prompt " << i << ": " << c.error;
      EXPECT_LT(static_cast<int64_t>(c.tokens.size()), max_tokens) << "prompt " << i;
      EXPECT_TRUE(is_prefix(c.tokens, solo(i))) << "prompt " << i;
    }
  }

  // After a healthy shutdown: every page free, the finish counters sum to
  // the choices that ended.
  static void expect_clean_after_shutdown(LlmEngine& e, int64_t choices) {
    const EngineMetrics m = e.metrics();
    EXPECT_EQ(m.kv_pages.total(), m.kv_pages_total);
    EXPECT_EQ(m.kv_pages.free, m.kv_pages_total) << "pages leaked";
    EXPECT_EQ(m.requests_running + m.requests_waiting, 0);
    EXPECT_EQ(m.requests_finished_stop + m.requests_finished_length + m.requests_finished_abort +
                  m.requests_finished_error,
              choices);
  }

  // The engine's invariants hold, it shuts down cleanly, and all `choices` choices finished
  // without leaking a page.
  static void expect_invariants_then_clean_shutdown(LlmEngine& e, int64_t choices) {
    const absl::Status violation = EngineTestAccess::invariant_violation(e);
    EXPECT_TRUE(violation.ok()) << violation;
    EXPECT_TRUE(e.shutdown().ok());
    expect_clean_after_shutdown(e, choices);
  }

  static std::string* dir_;
  static std::vector<std::vector<int32_t>>* prompts_;
  static std::vector<std::vector<int32_t>>* solo_;
};
std::string* LlmEngineStressTest::dir_ = nullptr;
std::vector<std::vector<int32_t>>* LlmEngineStressTest::prompts_ = nullptr;
std::vector<std::vector<int32_t>>* LlmEngineStressTest::solo_ = nullptr;

// Options out of range are refused by create (naming the option), never a
// crash or an engine that hangs.
TEST_F(LlmEngineStressTest, BadOptionsAreRefusedByCreateNamingTheOption) {
  struct Bad {
    const char* needle;
    std::function<void(EngineOptions&)> set;
  };
  const std::vector<Bad> bad = {
      {"max_waiting", [](EngineOptions& o) { o.max_waiting = 0; }},
      {"max_buffered_outputs", [](EngineOptions& o) { o.max_buffered_outputs = -1; }},
      {"num_pages", [](EngineOptions& o) { o.runner.num_pages = 0; }},
      {"page_size", [](EngineOptions& o) { o.runner.page_size = 0; }},
      {"max_num_seqs", [](EngineOptions& o) { o.runner.max_num_seqs = 0; }},
      {"max_num_batched_tokens", [](EngineOptions& o) { o.runner.max_num_batched_tokens = 2; }},
      {"launch_depth", [](EngineOptions& o) { o.runner.worker.launch_depth = 0; }},
  };
  for (const Bad& b : bad) {
    SCOPED_TRACE(b.needle);
    EngineOptions eo = options(1);
    b.set(eo);
    auto e = LlmEngine::create(*dir_, eo);
    ASSERT_FALSE(e.ok());
    EXPECT_EQ(e.status().code(), absl::StatusCode::kInvalidArgument) << e.status();
    EXPECT_TRUE(contains(e.status(), b.needle)) << e.status();
  }
}

// ---- aborts racing steps -------------------------------------------------------------------

TEST_F(LlmEngineStressTest, AbortRightAfterAddEndsEveryChoiceOnceAtEveryDepth) {
  const int kRequests = kSanitized ? 10 : 36;
  for (int depth : {1, 2, 4}) {
    SCOPED_TRACE(::testing::Message() << "depth " << depth);
    auto e = engine(options(depth, 128, 32, 8));
    EngineTestAccess::set_check_invariants(*e, true);
    std::vector<std::pair<RequestId, int>> ids;
    int64_t choices = 0;
    for (int i = 0; i < kRequests; ++i) {
      const int n = 1 + i % 3;
      const RequestId id = e->add_request(greedy(prompt(i), kSoloTokens, n)).value();
      // Nothing of it can have finished yet: the abort is accepted.
      ASSERT_TRUE(e->abort(id).ok()) << "request " << i;
      ids.emplace_back(id, n);
      choices += n;
    }
    for (size_t i = 0; i < ids.size(); ++i) {
      const RequestLog log = read_all(*e, ids[i].first, ids[i].second);
      expect_well_formed(log);
      for (const ChoiceLog& c : log.choices) {
        EXPECT_EQ(c.finish, OutputFinish::kAbort) << "request " << i;
        EXPECT_TRUE(c.error.ok()) << c.error;
        EXPECT_TRUE(is_prefix(c.tokens, solo(i))) << "request " << i;
      }
      // Finished and read: NOT_FOUND for abort and next_output alike.
      EXPECT_EQ(e->abort(ids[i].first).code(), absl::StatusCode::kNotFound);
      EXPECT_EQ(e->next_output(ids[i].first, base::Deadline::poll()).status().code(),
                absl::StatusCode::kNotFound);
    }
    expect_invariants_then_clean_shutdown(*e, choices);
    EXPECT_EQ(e->metrics().requests_finished_abort, choices);
  }
}

// Several threads abort random requests (some several times) at random
// moments while others add and read them; a tight pool preempts meanwhile.
// Unaborted greedy choices get their solo tokens.
TEST_F(LlmEngineStressTest, AbortsFromSeveralThreadsAtRandomMomentsWhileStepsRun) {
  const int kRequests = kSanitized ? 16 : 128;
  // Depth 2 and 4, and host sampling (one step at a time, logits read back).
  for (int depth : {2, 4, 0}) {
    SCOPED_TRACE(::testing::Message()
                 << "depth " << depth << (depth == 0 ? " (host sampling)" : ""));
    EngineOptions eo = options(std::max(depth, 1), 48, 16, 8);
    eo.runner.host_sampling = depth == 0;
    auto e = engine(eo);
    EngineTestAccess::set_check_invariants(*e, true);
    struct Req {
      RequestId id = 0;
      int n = 1;
      int64_t max_tokens = 0;
      size_t prompt = 0;
      std::atomic<int> abort_ok{0}, abort_not_found{0};
    };
    std::vector<Req> reqs(kRequests);
    std::atomic<int> added{0};
    std::mt19937 main_rng(depth);
    for (int i = 0; i < kRequests; ++i) {
      reqs[i].n = i % 4 == 0 ? 3 : 1;
      reqs[i].max_tokens = std::uniform_int_distribution<int>(4, kSoloTokens)(main_rng);
      reqs[i].prompt = i;
    }
    std::atomic<bool> stop_metrics{false};
    std::thread metrics_reader([&] {
      while (!stop_metrics.load()) {
        const EngineMetrics m = e->metrics();
        EXPECT_EQ(m.kv_pages.total(), m.kv_pages_total);
        EXPECT_LE(m.requests_running, 8);
        simpler::testing::spin_for(200us);  // jitter: samples fall anywhere in a step
      }
    });
    std::vector<std::thread> aborters;
    for (int t = 0; t < 3; ++t) {
      aborters.emplace_back([&, t] {
        std::mt19937 rng(100 * depth + t);
        // From the first request on (thread start-up under a sanitizer on a loaded machine can
        // outlast every attempt otherwise).
        added.wait(0, std::memory_order_acquire);
        for (int k = 0; k < kRequests / 2; ++k) {
          simpler::testing::spin_for(  // jitter: the abort lands at a random moment
              std::chrono::microseconds(std::uniform_int_distribution<int>(0, 2000)(rng)));
          const int have = added.load(std::memory_order_acquire);
          if (have == 0) continue;
          Req& r = reqs[std::uniform_int_distribution<int>(0, have - 1)(rng)];
          const absl::Status s = e->abort(r.id);
          if (s.ok()) {
            ++r.abort_ok;
          } else {
            EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
            ++r.abort_not_found;
          }
        }
      });
    }
    std::vector<RequestLog> logs(kRequests);
    std::vector<std::thread> readers;
    for (int t = 0; t < 2; ++t) {
      readers.emplace_back([&, t] {
        for (int i = t; i < kRequests; i += 2) {
          for (int v; (v = added.load(std::memory_order_acquire)) <= i;) {
            added.wait(v, std::memory_order_acquire);
          }
          logs[i] = read_all(*e, reqs[i].id, reqs[i].n);
        }
      });
    }
    for (int i = 0; i < kRequests; ++i) {
      reqs[i].id =
          e->add_request(greedy(prompt(reqs[i].prompt), reqs[i].max_tokens, reqs[i].n)).value();
      added.store(i + 1, std::memory_order_release);
      added.notify_all();
      simpler::testing::spin_for(  // jitter: the next request arrives at a random moment
          std::chrono::microseconds(std::uniform_int_distribution<int>(0, 1000)(main_rng)));
    }
    for (auto& t : aborters) t.join();
    for (auto& t : readers) t.join();
    stop_metrics.store(true);
    metrics_reader.join();
    int64_t choices = 0, aborted = 0;
    for (int i = 0; i < kRequests; ++i) {
      SCOPED_TRACE(::testing::Message() << "request " << i);
      const RequestLog& log = logs[i];
      expect_well_formed(log);
      choices += reqs[i].n;
      for (const ChoiceLog& c : log.choices) {
        expect_solo_or_aborted_prefix(c, reqs[i].prompt, reqs[i].max_tokens);
        aborted += c.finish == OutputFinish::kAbort ? 1 : 0;
        // Never aborted: it ran to max_tokens.
        if (reqs[i].abort_ok.load() == 0) {
          EXPECT_EQ(c.finish, OutputFinish::kLength);
        }
      }
    }
    EXPECT_GT(aborted, 0);
    expect_invariants_then_clean_shutdown(*e, choices);
    EXPECT_EQ(e->metrics().requests_finished_abort, aborted);
  }
}

// Four seeded choices, aborted once each has streamed a few tokens: each ends
// once with kAbort, its tokens a prefix of the same request run to the end.
TEST_F(LlmEngineStressTest, AbortOfAMultiChoiceRequestMidWayEndsEveryChoiceOnce) {
  for (int depth : {1, 4}) {
    SCOPED_TRACE(::testing::Message() << "depth " << depth);
    auto e = engine(options(depth, 256, 32, 8));
    const RequestSpec spec = seeded(prompt(3), kSoloTokens, 77, 4);
    const RequestLog full = read_all(*e, e->add_request(spec).value(), 4);
    expect_well_formed(full);
    const RequestId id = e->add_request(spec).value();
    RequestLog log(id, 4);
    auto enough = [&] {
      for (const ChoiceLog& c : log.choices) {
        if (c.tokens.size() < 3) return false;
      }
      return true;
    };
    while (!enough() && !log.complete()) {
      auto out = e->next_output(id, base::Deadline::after(60s));
      ASSERT_TRUE(out.ok()) << out.status();
      log.add(*out);
    }
    ASSERT_TRUE(e->abort(id).ok());
    while (!log.complete()) {
      auto out = e->next_output(id, base::Deadline::after(60s));
      ASSERT_TRUE(out.ok()) << out.status();
      log.add(*out);
    }
    EXPECT_EQ(e->next_output(id, base::Deadline::poll()).status().code(),
              absl::StatusCode::kNotFound);
    expect_well_formed(log);
    for (int k = 0; k < 4; ++k) {
      const ChoiceLog& c = log.choices[k];
      EXPECT_EQ(c.finish, OutputFinish::kAbort) << "choice " << k;
      EXPECT_LT(c.tokens.size(), static_cast<size_t>(kSoloTokens)) << "choice " << k;
      EXPECT_TRUE(is_prefix(c.tokens, full.choices[k].tokens)) << "choice " << k;
    }
    EXPECT_EQ(e->abort(id).code(), absl::StatusCode::kNotFound);
    EXPECT_TRUE(e->shutdown().ok());
    expect_clean_after_shutdown(*e, 8);
  }
}

// A request whose final event was delivered but not read yet is finished:
// abort is NOT_FOUND and changes nothing (the final still says length).
TEST_F(LlmEngineStressTest, AbortAfterTheFinalEventIsNotFoundEvenBeforeItIsRead) {
  auto e = engine(options(2, 256, 64, 8));
  const RequestId a = e->add_request(greedy(prompt(0), 2, 2)).value();
  const RequestId b = e->add_request(greedy(prompt(1), 40)).value();
  // The output thread delivers in loop order: once b streamed 8 tokens,
  // a's two finals (emitted at most two steps in) are queued.
  RequestLog lb(b, 1);
  while (lb.choices[0].tokens.size() < 8) {
    auto out = e->next_output(b, base::Deadline::after(60s));
    ASSERT_TRUE(out.ok()) << out.status();
    lb.add(*out);
  }
  EXPECT_EQ(e->abort(a).code(), absl::StatusCode::kNotFound);
  const RequestLog la = read_all(*e, a, 2);
  expect_well_formed(la);
  for (const ChoiceLog& c : la.choices) {
    EXPECT_EQ(c.finish, OutputFinish::kLength);
    EXPECT_EQ(c.tokens, solo(0, 2));
  }
  EXPECT_EQ(e->abort(a).code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(e->abort(b).ok());
  while (!lb.complete()) {
    auto out = e->next_output(b, base::Deadline::after(60s));
    ASSERT_TRUE(out.ok()) << out.status();
    lb.add(*out);
  }
  expect_well_formed(lb);
  EXPECT_EQ(lb.choices[0].finish, OutputFinish::kAbort);
  EXPECT_TRUE(e->shutdown().ok());
  expect_clean_after_shutdown(*e, 3);
}

// ---- preemption storms ---------------------------------------------------------------------

// A pool that holds about two requests, many long seeded and greedy requests
// (some n = 2) at depth 2 and 4, with aborts: every unaborted choice gets
// exactly the tokens it gets alone, page invariants hold at every step.
TEST_F(LlmEngineStressTest, PreemptionStormsKeepTokensAndPagesAtDepth2And4) {
  const int kRequests = kSanitized ? 8 : 32;
  std::vector<RequestSpec> specs;
  for (int i = 0; i < kRequests; ++i) {
    RequestSpec s =
        i % 2 == 0 ? seeded(prompt(i), 40, 500 + i, i % 4 == 0 ? 2 : 1) : greedy(prompt(i), 40);
    specs.push_back(std::move(s));
  }
  // References: each alone.
  std::vector<RequestLog> ref;
  {
    auto e = engine(options(1, 256, 64, 2));
    for (const RequestSpec& s : specs) {
      ref.push_back(read_all(*e, e->add_request(s).value(), s.n));
      expect_well_formed(ref.back());
    }
    EXPECT_TRUE(e->shutdown().ok());
  }
  for (int depth : {2, 4}) {
    SCOPED_TRACE(::testing::Message() << "depth " << depth);
    // A request needs up to (24 + 40) / 4 = 16 pages.
    auto e = engine(options(depth, 24, 32, 8));
    EngineTestAccess::set_check_invariants(*e, true);
    std::vector<RequestId> ids;
    for (const RequestSpec& s : specs) ids.push_back(e->add_request(s).value());
    const std::set<size_t> abort_at = {3, static_cast<size_t>(kRequests / 2 + 1),
                                       static_cast<size_t>(kRequests - 1)};
    std::thread aborter([&] {
      for (size_t i : abort_at) {
        simpler::testing::spin_for(3ms);  // jitter: the aborts land while steps run
        const absl::Status s = e->abort(ids[i]);
        EXPECT_TRUE(s.ok() || s.code() == absl::StatusCode::kNotFound) << s;
      }
    });
    std::vector<RequestLog> logs(ids.size());
    std::thread reader([&] {
      for (size_t i = 1; i < ids.size(); i += 2) logs[i] = read_all(*e, ids[i], specs[i].n);
    });
    for (size_t i = 0; i < ids.size(); i += 2) logs[i] = read_all(*e, ids[i], specs[i].n);
    reader.join();
    aborter.join();
    int64_t choices = 0;
    for (size_t i = 0; i < ids.size(); ++i) {
      SCOPED_TRACE(::testing::Message() << "request " << i);
      expect_well_formed(logs[i]);
      choices += specs[i].n;
      for (int k = 0; k < specs[i].n; ++k) {
        const ChoiceLog& c = logs[i].choices[k];
        if (abort_at.count(i) && c.finish == OutputFinish::kAbort) {
          EXPECT_TRUE(is_prefix(c.tokens, ref[i].choices[k].tokens)) << "choice " << k;
        } else {
          EXPECT_EQ(c.finish, OutputFinish::kLength) << "choice " << k << ": " << c.error;
          EXPECT_EQ(c.tokens, ref[i].choices[k].tokens) << "choice " << k;
        }
      }
    }
    EXPECT_GT(e->metrics().preemptions_total, 0);
    expect_invariants_then_clean_shutdown(*e, choices);
  }
}

// ---- slow consumers and callbacks ----------------------------------------------------------

// Consumers that read nothing until every request finished, one undelivered
// output allowed: each choice either ran to its end with every token
// delivered, or was aborted as a consumer that fell behind — never "length"
// with tokens missing.
TEST_F(LlmEngineStressTest, ANeverReadingConsumerLosesNoTokenOfAChoiceThatEndsNormally) {
  const int kRequests = kSanitized ? 8 : 24;
  for (int depth : {1, 4}) {
    SCOPED_TRACE(::testing::Message() << "depth " << depth);
    EngineOptions eo = options(depth, 256, 64, 16);
    eo.max_buffered_outputs = 1;
    auto e = engine(eo);
    std::vector<RequestId> ids;
    std::vector<int64_t> max_tokens;
    std::vector<int> ns;
    int64_t choices = 0;
    for (int i = 0; i < kRequests; ++i) {
      max_tokens.push_back(2 + i % 5);
      ns.push_back(i % 3 == 0 ? 2 : 1);
      ids.push_back(e->add_request(greedy(prompt(i), max_tokens.back(), ns.back())).value());
      choices += ns.back();
    }
    // Wait until every choice finished without reading anything.
    ASSERT_TRUE(simpler::testing::eventually(
        [&] {
          const EngineMetrics m = e->metrics();
          return m.requests_finished_length + m.requests_finished_abort + m.requests_finished_stop +
                     m.requests_finished_error >=
                 choices;
        },
        60s))
        << "requests did not finish";
    int64_t fell_behind = 0;
    for (size_t i = 0; i < ids.size(); ++i) {
      SCOPED_TRACE(::testing::Message() << "request " << i);
      const RequestLog log = read_all(*e, ids[i], ns[i]);
      expect_well_formed(log);
      for (const ChoiceLog& c : log.choices) {
        if (c.finish == OutputFinish::kLength) {
          EXPECT_EQ(c.tokens, solo(i, max_tokens[i]));
        } else {
          EXPECT_EQ(c.finish, OutputFinish::kAbort);
          EXPECT_EQ(c.error.code(), absl::StatusCode::kResourceExhausted) << c.error;
          EXPECT_TRUE(contains(c.error, "consumer fell behind")) << c.error;
          EXPECT_TRUE(is_prefix(c.tokens, solo(i))) << "delivered tokens are not in order";
          ++fell_behind;
        }
      }
    }
    EXPECT_GT(fell_behind, 0);
    EXPECT_TRUE(e->shutdown().ok());
    expect_clean_after_shutdown(*e, choices);
    EXPECT_EQ(e->metrics().requests_finished_abort, fell_behind)
        << "the finish counters disagree with the final events";
  }
}

// Slow callbacks that add requests, abort their own request and read metrics
// from the output thread: nothing deadlocks, every request (children
// included) ends once, abort of a request whose last final is being
// delivered is NOT_FOUND, next_output of a callback request is NOT_FOUND.
TEST_F(LlmEngineStressTest, SlowCallbacksThatCallBackIntoTheEngineDeadlockNothing) {
  const int kParents = kSanitized ? 6 : 16;
  auto e = engine(options(2, 256, 32, 8));
  Sink sink;
  std::mutex children_mu;
  std::vector<std::pair<RequestId, size_t>> children;  // id, prompt
  std::atomic<int> callback_errors{0};
  std::vector<RequestId> parents(kParents);
  std::vector<std::atomic<int>> seen(kParents);
  for (int i = 0; i < kParents; ++i) {
    RequestSpec s = greedy(prompt(i), 12);
    s.on_output = sink.callback(1, [&, i](const RequestOutput& out) {
      simpler::testing::spin_for(300us);  // slow: a consumer busy for 300 µs
      const EngineMetrics m = e->metrics();
      if (m.kv_pages.total() != m.kv_pages_total) ++callback_errors;
      if (e->next_output(out.id, base::Deadline::poll()).status().code() !=
          absl::StatusCode::kNotFound) {
        ++callback_errors;
      }
      const int tokens = seen[i] += static_cast<int>(out.token_ids.size());
      if (i % 2 == 0 && !out.finished() && tokens == static_cast<int>(out.token_ids.size())) {
        // First tokens: add a child request from the callback.
        RequestSpec c = greedy(prompt(i + 5), 6);
        c.on_output = sink.callback(1);
        auto id = e->add_request(std::move(c));
        if (!id.ok()) {
          ++callback_errors;
        } else {
          std::lock_guard<std::mutex> l(children_mu);
          children.emplace_back(*id, i + 5);
        }
      }
      if (i % 3 == 1 && !out.finished() && tokens >= 3 &&
          tokens - static_cast<int>(out.token_ids.size()) < 3) {
        if (!e->abort(out.id).ok()) ++callback_errors;  // still running: accepted
      }
      if (out.finished() && e->abort(out.id).code() != absl::StatusCode::kNotFound) {
        ++callback_errors;
      }
    });
    parents[i] = e->add_request(std::move(s)).value();
  }
  ASSERT_TRUE(sink.wait_complete(parents));
  std::vector<std::pair<RequestId, size_t>> kids;
  {
    std::lock_guard<std::mutex> l(children_mu);
    kids = children;
  }
  std::vector<RequestId> kid_ids;
  for (const auto& [id, p] : kids) kid_ids.push_back(id);
  ASSERT_TRUE(sink.wait_complete(kid_ids));
  EXPECT_EQ(callback_errors.load(), 0);
  EXPECT_EQ(kids.size(), static_cast<size_t>((kParents + 1) / 2));
  for (int i = 0; i < kParents; ++i) {
    SCOPED_TRACE(::testing::Message() << "parent " << i);
    const RequestLog log = sink.get(parents[i]);
    expect_well_formed(log);
    const ChoiceLog& c = log.choices[0];
    if (i % 3 == 1) {
      // The loop runs ahead of the slow callbacks: the request may have
      // reached max_tokens before the abort from its third token's callback
      // arrived (abort() is then OK and changes nothing).
      expect_solo_or_aborted_prefix(c, i, 12);
      EXPECT_GE(c.tokens.size(), 3u);
    } else {
      EXPECT_EQ(c.finish, OutputFinish::kLength);
      EXPECT_EQ(c.tokens, solo(i, 12));
    }
    EXPECT_EQ(e->next_output(parents[i], base::Deadline::poll()).status().code(),
              absl::StatusCode::kNotFound);
  }
  for (const auto& [id, p] : kids) {
    const RequestLog log = sink.get(id);
    expect_well_formed(log);
    EXPECT_EQ(log.choices[0].finish, OutputFinish::kLength);
    EXPECT_EQ(log.choices[0].tokens, solo(p, 6));
  }
  EXPECT_EQ(sink.foreign_threads(), 0) << "callbacks ran on more than one thread";
  EXPECT_TRUE(e->shutdown().ok());
  expect_clean_after_shutdown(*e, kParents + static_cast<int64_t>(kids.size()));
}

// A callback that would wait for the output thread it runs on (shutdown, or
// next_output of a request with nothing queued) gets FAILED_PRECONDITION
// instead of a deadlock or a crash; the engine goes on.
TEST_F(LlmEngineStressTest, ACallbackThatWouldWaitForItsOwnThreadGetsAnError) {
  auto e = engine(options(2));
  Sink sink;
  std::atomic<int> shutdown_code{-1}, next_code{-1};
  std::atomic<RequestId> inner{0};
  RequestSpec s = greedy(prompt(0), 4);
  s.on_output = sink.callback(1, [&](const RequestOutput& out) {
    if (!out.finished()) return;
    shutdown_code = static_cast<int>(e->shutdown().code());
    // A queued request added here has no event yet: only this thread delivers them.
    auto id = e->add_request(greedy(prompt(1), 6));
    if (!id.ok()) return;
    inner = *id;
    next_code = static_cast<int>(e->next_output(*id).status().code());
  });
  const RequestId outer = e->add_request(std::move(s)).value();
  ASSERT_TRUE(sink.wait_complete({outer}));
  const RequestLog lo = sink.get(outer);
  expect_well_formed(lo);
  EXPECT_EQ(lo.choices[0].tokens, solo(0, 4));
  EXPECT_EQ(shutdown_code.load(), static_cast<int>(absl::StatusCode::kFailedPrecondition));
  EXPECT_EQ(next_code.load(), static_cast<int>(absl::StatusCode::kFailedPrecondition));
  ASSERT_NE(inner.load(), 0u);
  const RequestLog li = read_all(*e, inner.load(), 1);
  expect_well_formed(li);
  EXPECT_EQ(li.choices[0].tokens, solo(1, 6));
  EXPECT_TRUE(e->shutdown().ok());
  expect_clean_after_shutdown(*e, 2);
}

// n choices wait together: more than max_waiting can never be queued, which
// is a bad request, not a full queue to retry later.
TEST_F(LlmEngineStressTest, MoreChoicesThanTheWaitingQueueHoldsIsAnInvalidArgument) {
  EngineOptions eo = options(1, 256, 64, 8);
  eo.max_waiting = 2;
  auto e = engine(eo);
  auto r = e->add_request(greedy(prompt(0), 4, 3));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_TRUE(contains(r.status(), "n 3 exceeds max_waiting 2")) << r.status();
  const RequestLog ok = read_all(*e, e->add_request(greedy(prompt(0), 4, 2)).value(), 2);
  expect_well_formed(ok);
  for (const ChoiceLog& c : ok.choices) EXPECT_EQ(c.tokens, solo(0, 4));
  EXPECT_EQ(e->metrics().requests_refused, 1);
  EXPECT_TRUE(e->shutdown().ok());
}

// max_tokens near INT64_MAX must be refused by add_request with the
// numbers, not overflow the length check and fail later in the loop.
TEST_F(LlmEngineStressTest, AHugeMaxTokensIsRefusedAtAddNotFailedLater) {
  auto e = engine(options(1));
  for (int64_t mt : {std::numeric_limits<int64_t>::max(), std::numeric_limits<int64_t>::max() - 3,
                     std::numeric_limits<int64_t>::max() / 2 + 7}) {
    SCOPED_TRACE(::testing::Message() << "max_tokens " << mt);
    auto r = e->add_request(greedy(prompt(0), mt));
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
    EXPECT_TRUE(contains(r.status(), "exceeds max_position_embeddings")) << r.status();
  }
  EXPECT_EQ(e->metrics().requests_refused, 3);
  EXPECT_TRUE(e->shutdown().ok());
  expect_clean_after_shutdown(*e, 0);
}

// Gauges are current when a consumer holds a final event: a choice that
// ended reading max_tokens no longer runs and its pages are free (nothing
// else is live), and choices aborted before they ran no longer count against
// max_waiting.
TEST_F(LlmEngineStressTest, MetricsAndTheWaitingCountAreCurrentWhenTheFinalEventIsRead) {
  const int kRounds = kSanitized ? 5 : 20;
  for (int depth : {1, 2}) {
    SCOPED_TRACE(::testing::Message() << "depth " << depth);
    EngineOptions eo = options(depth, 512, 32, 4);
    eo.max_waiting = 2;
    auto e = engine(eo);
    for (int round = 0; round < kRounds; ++round) {
      SCOPED_TRACE(::testing::Message() << "round " << round);
      const RequestLog done = read_all(*e, e->add_request(greedy(prompt(round), 3)).value(), 1);
      expect_well_formed(done);
      EXPECT_EQ(done.choices[0].finish, OutputFinish::kLength);
      EngineMetrics m = e->metrics();
      EXPECT_EQ(m.requests_running + m.requests_waiting, 0);
      EXPECT_EQ(m.kv_pages.free, m.kv_pages_total);
      // Two requests aborted at once fill max_waiting until they end. 900 tokens each (the pool
      // holds both): neither can end on its own before the loop takes its abort at its next step.
      const RequestId a = e->add_request(greedy(prompt(round + 1), 900)).value();
      const RequestId b = e->add_request(greedy(prompt(round + 2), 900)).value();
      ASSERT_TRUE(e->abort(a).ok());
      ASSERT_TRUE(e->abort(b).ok());
      for (RequestId id : {a, b}) {
        const RequestLog aborted = read_all(*e, id, 1);
        expect_well_formed(aborted);
        EXPECT_EQ(aborted.choices[0].finish, OutputFinish::kAbort) << "request " << id;
      }
      auto c = e->add_request(greedy(prompt(round), 2, 2));
      ASSERT_TRUE(c.ok()) << c.status() << " (nothing waits any more)";
      expect_well_formed(read_all(*e, *c, 2));
    }
    EXPECT_TRUE(e->shutdown().ok());
    expect_clean_after_shutdown(*e, 5 * kRounds);
  }
}

// ---- faults mid-prefill and mid-decode -------------------------------------------------------

// Two requests decode (max_num_seqs 2) when a kernel of run 5 (step 6) fails;
// two more wait. The first request had a row in that step: it fails with the
// run's error; the waiting ones never had a row there and are served; the
// engine stays healthy. At depth 1, 2 and 4.
TEST_F(LlmEngineStressTest, AKernelErrorMidDecodeFailsOnlyTheRequestsOfItsStep) {
  for (int depth : {1, 2, 4}) {
    SCOPED_TRACE(::testing::Message() << "depth " << depth);
    auto e = engine(with_faults(options(depth, 256, 64, 2), "run=5:task=3:kind=kernel_error"));
    std::vector<RequestId> ids;
    for (int i = 0; i < 4; ++i) ids.push_back(e->add_request(greedy(prompt(i), 30)).value());
    std::vector<RequestLog> logs;
    for (int i = 0; i < 4; ++i) {
      logs.push_back(read_all(*e, ids[i], 1));
      expect_well_formed(logs.back());
    }
    int failed = 0;
    for (int i = 0; i < 4; ++i) {
      SCOPED_TRACE(::testing::Message() << "request " << i);
      const ChoiceLog& c = logs[i].choices[0];
      if (i == 0) {
        EXPECT_EQ(c.finish, OutputFinish::kError);  // in every step from step 1
      }
      if (i >= 2) {
        EXPECT_EQ(c.finish, OutputFinish::kLength);  // admitted after the failure
      }
      if (c.finish == OutputFinish::kError) {
        ++failed;
        EXPECT_EQ(c.error.code(), absl::StatusCode::kInternal) << c.error;
        EXPECT_TRUE(contains(c.error, "run 5 task 3")) << c.error;
        EXPECT_TRUE(contains(c.error, "kernel reported failure")) << c.error;
        EXPECT_TRUE(is_prefix(c.tokens, solo(i)));
        EXPECT_LT(c.tokens.size(), 30u);
      } else {
        EXPECT_EQ(c.finish, OutputFinish::kLength) << c.error;
        EXPECT_EQ(c.tokens, solo(i, 30));
      }
    }
    EXPECT_TRUE(e->health().ok()) << e->health();
    const RequestLog later = read_all(*e, e->add_request(greedy(prompt(7), 8, 2)).value(), 2);
    expect_well_formed(later);
    for (const ChoiceLog& c : later.choices) EXPECT_EQ(c.tokens, solo(7, 8));
    EXPECT_EQ(e->metrics().requests_finished_error, failed);
    EXPECT_TRUE(e->shutdown().ok());
    expect_clean_after_shutdown(*e, 6);
  }
}

// A 60-token prompt prefilled in chunks of 8 (the whole budget): a kernel error
// in run 2 (its third chunk) fails it with no token; the requests queued
// behind it are served.
TEST_F(LlmEngineStressTest, AKernelErrorMidPrefillFailsThatRequestAndTheQueueIsServed) {
  std::vector<int32_t> longp;
  for (int k = 0; k < 60; ++k) longp.push_back((k * 37 + 11) % 500);
  for (int depth : {1, 2, 4}) {
    SCOPED_TRACE(::testing::Message() << "depth " << depth);
    auto e = engine(with_faults(options(depth, 256, 8, 2), "run=2:task=2:kind=kernel_error"));
    const RequestId a = e->add_request(greedy(longp, 4)).value();
    const RequestId b = e->add_request(greedy(prompt(1), 6)).value();
    const RequestId c = e->add_request(greedy(prompt(2), 6, 2)).value();
    const RequestLog la = read_all(*e, a, 1), lb = read_all(*e, b, 1), lc = read_all(*e, c, 2);
    expect_well_formed(la);
    expect_well_formed(lb);
    expect_well_formed(lc);
    EXPECT_EQ(la.choices[0].finish, OutputFinish::kError);
    EXPECT_TRUE(la.choices[0].tokens.empty());
    EXPECT_TRUE(contains(la.choices[0].error, "run 2 task 2")) << la.choices[0].error;
    EXPECT_EQ(lb.choices[0].finish, OutputFinish::kLength) << lb.choices[0].error;
    EXPECT_EQ(lb.choices[0].tokens, solo(1, 6));
    for (const ChoiceLog& ch : lc.choices) {
      EXPECT_EQ(ch.finish, OutputFinish::kLength) << ch.error;
      EXPECT_EQ(ch.tokens, solo(2, 6));
    }
    EXPECT_TRUE(e->health().ok());
    EXPECT_TRUE(e->shutdown().ok());
    expect_clean_after_shutdown(*e, 4);
  }
}

// Host sampling runs one step at a time and collects each step's logits
// before the next: a step whose kernel failed is never collected, and the
// engine must still submit the next one. Its requests fail; later ones run.
TEST_F(LlmEngineStressTest, AKernelErrorWithHostSamplingLeavesTheEngineServing) {
  EngineOptions eo = with_faults(options(1, 256, 64, 4), "run=3:task=2:kind=kernel_error");
  eo.runner.host_sampling = true;
  auto e = engine(eo);
  const RequestLog a = read_all(*e, e->add_request(greedy(prompt(0), 10)).value(), 1);
  expect_well_formed(a);
  EXPECT_EQ(a.choices[0].finish, OutputFinish::kError);
  EXPECT_TRUE(contains(a.choices[0].error, "run 3 task 2")) << a.choices[0].error;
  EXPECT_TRUE(is_prefix(a.choices[0].tokens, solo(0)));
  EXPECT_TRUE(e->health().ok());
  for (int i = 1; i < 4; ++i) {
    const RequestLog later = read_all(*e, e->add_request(greedy(prompt(i), 8, 2)).value(), 2);
    expect_well_formed(later);
    for (const ChoiceLog& c : later.choices) {
      EXPECT_EQ(c.finish, OutputFinish::kLength) << "request " << i << ": " << c.error;
      EXPECT_EQ(c.tokens, solo(i, 8)) << "request " << i;
    }
  }
  EXPECT_EQ(e->metrics().requests_finished_error, 1);
  EXPECT_TRUE(e->shutdown().ok());
  expect_clean_after_shutdown(*e, 7);
}

// Unrecoverable faults (device fault mid-decode and mid-prefill, a hang past
// the operation timeout, a refused launch) at depth 1, 2 and 4: every live
// request, waiting ones included, fails once with the cause naming the run;
// new requests are refused with it; the page states sum to the pool;
// shutdown returns the cause, in bounded time, twice.
TEST_F(LlmEngineStressTest, UnrecoverableFaultsFailEveryRequestWithTheCauseAtEveryDepth) {
  std::vector<int32_t> longp;
  for (int k = 0; k < 60; ++k) longp.push_back((k * 13 + 5) % 500);
  struct Case {
    const char* name;
    const char* plan;
    bool long_prompt;
    std::vector<std::string> needles;
  };
  std::vector<Case> cases = {
      {"device fault mid-decode",
       "run=6:task=2:kind=device_fault",
       false,
       {"run 6", "device fault"}},
      {"device fault mid-prefill",
       "run=1:task=1:kind=device_fault",
       true,
       {"run 1", "device fault"}},
      {"hang past the operation timeout",
       "run=4:task=2:kind=hang",
       false,
       {"run 4", "did not finish within the operation timeout"}},
      {"refused launch", "run=3:task=0:kind=launch_refused", false, {"run 3"}},
  };
  const std::vector<int> depths = kSanitized ? std::vector<int>{1, 4} : std::vector<int>{1, 2, 4};
  for (const Case& cs : cases) {
    for (int depth : depths) {
      SCOPED_TRACE(::testing::Message() << cs.name << ", depth " << depth);
      EngineOptions eo = with_faults(options(depth, 256, 8, 2), cs.plan);
      eo.runner.worker.operation_timeout_s = 0.5;
      auto e = engine(eo);
      std::vector<std::pair<RequestId, int>> ids;
      int64_t choices = 0;
      for (int i = 0; i < 6; ++i) {
        const int n = i == 4 ? 2 : 1;
        RequestSpec s = greedy(cs.long_prompt && i == 0 ? longp : prompt(i), 40, n);
        absl::StatusOr<RequestId> id = e->add_request(std::move(s));
        if (!id.ok()) {
          // The fault came before this request (an early run, on a slow machine): the engine
          // is already unhealthy and refuses it, naming the cause.
          EXPECT_TRUE(contains(id.status(), "unhealthy")) << id.status();
          for (const std::string& needle : cs.needles) {
            EXPECT_TRUE(contains(id.status(), needle)) << id.status() << " lacks " << needle;
          }
          continue;
        }
        ids.emplace_back(*id, n);
        choices += n;
      }
      for (const auto& [id, n] : ids) {
        const RequestLog log = read_all(*e, id, n);
        expect_well_formed(log);
        for (const ChoiceLog& c : log.choices) {
          EXPECT_EQ(c.finish, OutputFinish::kError) << "request " << id;
          for (const std::string& needle : cs.needles) {
            EXPECT_TRUE(contains(c.error, needle)) << c.error << " lacks " << needle;
          }
        }
      }
      const absl::Status health = e->health();
      EXPECT_FALSE(health.ok());
      auto refused = e->add_request(greedy(prompt(0), 2));
      ASSERT_FALSE(refused.ok());
      EXPECT_EQ(refused.status().code(), health.code()) << refused.status();
      EXPECT_TRUE(contains(refused.status(), std::string(health.message()))) << refused.status();
      ASSERT_FALSE(ids.empty()) << "the first request is added before any run";
      EXPECT_EQ(e->abort(ids[0].first).code(), absl::StatusCode::kNotFound);
      const int64_t t0 = base::now_ns();
      const absl::Status s1 = e->shutdown(base::Deadline::after(1s));
      const absl::Status s2 = e->shutdown();
      EXPECT_LT(seconds_since(t0), 10.0);
      EXPECT_EQ(s1, health);
      EXPECT_EQ(s2, health);
      const EngineMetrics m = e->metrics();
      EXPECT_FALSE(m.healthy);
      EXPECT_EQ(m.kv_pages.total(), m.kv_pages_total);
      EXPECT_EQ(m.kv_pages.used + m.kv_pages.fenced, 0) << "pages still held after shutdown";
      EXPECT_EQ(m.requests_finished_error, choices);
    }
  }
}

// Faults while shutdown drains: an unrecoverable one fails every live
// request and is what shutdown returns; a recoverable one fails its step's
// requests, the rest finish, and shutdown is OK.
TEST_F(LlmEngineStressTest, FaultsDuringTheShutdownDrainAreReportedOnce) {
  struct Case {
    const char* plan;
    bool fatal;
  };
  for (const Case cs : {Case{"run=30:task=2:kind=device_fault", true},
                        Case{"run=30:task=2:kind=kernel_error", false}}) {
    for (int depth : {1, 4}) {
      SCOPED_TRACE(::testing::Message() << cs.plan << ", depth " << depth);
      auto e = engine(with_faults(options(depth, 256, 64, 8), cs.plan));
      std::vector<std::pair<RequestId, int>> ids;
      for (int i = 0; i < 4; ++i) {
        ids.emplace_back(e->add_request(greedy(prompt(i), 40, i == 1 ? 2 : 1)).value(),
                         i == 1 ? 2 : 1);
      }
      auto first = e->next_output(ids[0].first, base::Deadline::after(60s));
      ASSERT_TRUE(first.ok()) << first.status();
      const int64_t t0 = base::now_ns();
      const absl::Status s = e->shutdown(base::Deadline::after(30s));  // run 30 fails meanwhile
      EXPECT_LT(seconds_since(t0), 15.0);
      if (cs.fatal) {
        EXPECT_FALSE(s.ok());
        EXPECT_TRUE(contains(s, "run 30")) << s;
        EXPECT_EQ(s, e->health());
      } else {
        EXPECT_TRUE(s.ok()) << s;
        EXPECT_TRUE(e->health().ok());
      }
      int failed = 0;
      for (size_t k = 0; k < ids.size(); ++k) {
        RequestLog log(ids[k].first, ids[k].second);
        if (k == 0) log.add(*first);
        while (!log.complete()) {
          auto out = e->next_output(ids[k].first, base::Deadline::after(5s));
          ASSERT_TRUE(out.ok()) << out.status();
          log.add(*out);
        }
        expect_well_formed(log);
        for (const ChoiceLog& c : log.choices) {
          if (c.finish == OutputFinish::kError) {
            ++failed;
            EXPECT_TRUE(contains(c.error, "run 30")) << c.error;
            EXPECT_TRUE(is_prefix(c.tokens, solo(k)));
          } else {
            EXPECT_FALSE(cs.fatal) << "request " << k << " survived a device fault";
            EXPECT_EQ(c.finish, OutputFinish::kLength) << c.error;
            EXPECT_EQ(c.tokens, solo(k, 40));
          }
        }
      }
      EXPECT_GT(failed, 0);
      if (cs.fatal) {
        EXPECT_EQ(failed, 5);
      }
      const EngineMetrics m = e->metrics();
      EXPECT_EQ(m.kv_pages.total(), m.kv_pages_total);
      EXPECT_EQ(m.kv_pages.used + m.kv_pages.fenced, 0);
      EXPECT_EQ(m.requests_finished_error, failed);
    }
  }
}

// Adds from several threads racing a device fault: every accepted request
// (including ones the loop sees only after the engine turned unhealthy) ends
// once with the fault's cause; every refused one names it.
TEST_F(LlmEngineStressTest, AddsRacingAnUnrecoverableFaultEndOnceWithItsCause) {
  for (int depth : {1, 4}) {
    SCOPED_TRACE(::testing::Message() << "depth " << depth);
    auto e = engine(with_faults(options(depth, 256, 32, 8), "run=15:task=2:kind=device_fault"));
    std::mutex mu;
    std::vector<std::pair<RequestId, int>> accepted;
    std::atomic<int> refused{0}, wrong_refusal{0};
    std::vector<std::thread> adders;
    // The adders keep adding until the fault's refusals come (not for a fixed count: on a
    // loaded machine under TSan 1,200 adds could all finish before the engine reaches run 15).
    const int64_t give_up_ns = base::now_ns() + 90'000'000'000;
    for (int t = 0; t < 3; ++t) {
      adders.emplace_back([&, t] {
        for (int i = 0; refused.load() < 30 && base::now_ns() < give_up_ns; ++i) {
          const int n = (i + t) % 4 == 0 ? 2 : 1;
          auto id = e->add_request(greedy(prompt(i + t), 6, n));
          if (id.ok()) {
            std::lock_guard<std::mutex> l(mu);
            accepted.emplace_back(*id, n);
          } else if (id.status().code() == absl::StatusCode::kResourceExhausted) {
            await_a_step(*e);  // full: room comes with the engine's progress
          } else {
            ++refused;
            if (!contains(id.status(), "device fault")) ++wrong_refusal;
          }
          simpler::testing::spin_for(100us);  // jitter between adds
        }
      });
    }
    for (auto& t : adders) t.join();
    EXPECT_GT(refused.load(), 0) << "no add was refused with the fault's cause within 90 s";
    EXPECT_EQ(wrong_refusal.load(), 0);
    int64_t choices = 0, failed = 0;
    for (const auto& [id, n] : accepted) {
      const RequestLog log = read_all(*e, id, n);
      expect_well_formed(log);
      choices += n;
      for (const ChoiceLog& c : log.choices) {
        if (c.finish == OutputFinish::kError) {
          ++failed;
          EXPECT_TRUE(contains(c.error, "run 15")) << c.error;
          EXPECT_TRUE(contains(c.error, "device fault")) << c.error;
        } else {
          EXPECT_EQ(c.finish, OutputFinish::kLength) << c.error;  // finished before the fault
        }
      }
    }
    EXPECT_GT(failed, 0);
    EXPECT_FALSE(e->shutdown().ok());
    const EngineMetrics m = e->metrics();
    EXPECT_EQ(m.kv_pages.total(), m.kv_pages_total);
    EXPECT_EQ(m.kv_pages.used + m.kv_pages.fenced, 0);
    EXPECT_EQ(m.requests_finished_error, failed);
    EXPECT_EQ(m.requests_finished_error + m.requests_finished_length, choices);
  }
}

// ---- shutdown racing callers -----------------------------------------------------------------

// Threads add (to queues and callbacks), abort and read while two threads
// shut down (one with a short drain, one at once): both return OK in bounded
// time, adds after it are FAILED_PRECONDITION, every accepted request ends
// once per choice and no page is left behind.
TEST_F(LlmEngineStressTest, ShutdownRacingAddsAbortsAndReadersEndsEveryRequestOnce) {
  const int kRounds = kSanitized ? 3 : 16;
  for (int round = 0; round < kRounds; ++round) {
    SCOPED_TRACE(::testing::Message() << "round " << round);
    auto e = engine(options(round % 2 == 0 ? 2 : 4, 128, 32, 8));
    Sink sink;
    struct Added {
      RequestId id;
      int n;
      size_t prompt;
      int64_t max_tokens;
      bool callback;
    };
    std::mutex mu;
    std::vector<Added> added;
    std::deque<Added> to_read;
    std::atomic<int> adders_left{3};
    std::condition_variable readable;  // to_read got a request, or the last adder ended
    std::atomic<int> unexpected{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < 3; ++t) {
      threads.emplace_back([&, t] {
        std::mt19937 rng(round * 10 + t);
        for (int i = 0;; ++i) {
          const size_t p = static_cast<size_t>(t * 1000 + i);
          const int n = i % 5 == 0 ? 2 : 1;
          const int64_t mt = 2 + (i * 7 + t) % 30;
          RequestSpec s = greedy(prompt(p), mt, n);
          const bool cb = (i + t) % 3 == 0;
          if (cb) s.on_output = sink.callback(n);
          auto id = e->add_request(std::move(s));
          if (!id.ok()) {
            if (id.status().code() == absl::StatusCode::kFailedPrecondition) break;
            if (id.status().code() != absl::StatusCode::kResourceExhausted) ++unexpected;
            await_a_step(*e);  // full: room comes with the engine's progress
            continue;
          }
          {
            std::lock_guard<std::mutex> l(mu);
            added.push_back({*id, n, p, mt, cb});
            if (!cb) to_read.push_back(added.back());
          }
          readable.notify_one();
          simpler::testing::spin_for(  // jitter between adds
              std::chrono::microseconds(std::uniform_int_distribution<int>(0, 400)(rng)));
        }
        {
          std::lock_guard<std::mutex> l(mu);
          --adders_left;
        }
        readable.notify_all();
      });
    }
    threads.emplace_back([&] {  // aborter
      std::mt19937 rng(round);
      while (adders_left.load() > 0) {
        RequestId id = 0;
        {
          std::lock_guard<std::mutex> l(mu);
          if (!added.empty()) {
            id = added[std::uniform_int_distribution<size_t>(0, added.size() - 1)(rng)].id;
          }
        }
        if (id != 0) {
          const absl::Status s = e->abort(id);
          if (!s.ok() && s.code() != absl::StatusCode::kNotFound) ++unexpected;
        }
        simpler::testing::spin_for(500us);  // jitter between aborts
      }
    });
    std::vector<RequestLog> read_logs;
    std::vector<Added> read_added;
    for (int t = 0; t < 2; ++t) {
      threads.emplace_back([&] {  // readers
        while (true) {
          std::optional<Added> a;
          {
            std::unique_lock<std::mutex> l(mu);
            readable.wait(l, [&] { return !to_read.empty() || adders_left.load() == 0; });
            if (to_read.empty()) return;
            a = to_read.front();
            to_read.pop_front();
          }
          RequestLog log = read_all(*e, a->id, a->n);
          std::lock_guard<std::mutex> l(mu);
          read_logs.push_back(std::move(log));
          read_added.push_back(*a);
        }
      });
    }
    // Shut down once a number of requests (growing with the round) went in, while more come.
    ASSERT_TRUE(simpler::testing::eventually([&] {
      std::lock_guard<std::mutex> l(mu);
      return added.size() >= static_cast<size_t>(2 + 3 * round);
    }));
    const int64_t t0 = base::now_ns();
    absl::Status s2;
    std::thread second([&] { s2 = e->shutdown(base::Deadline::poll()); });
    const absl::Status s1 = e->shutdown(base::Deadline::after(std::chrono::milliseconds(30)));
    second.join();
    EXPECT_LT(seconds_since(t0), 15.0);
    EXPECT_TRUE(s1.ok()) << s1;
    EXPECT_TRUE(s2.ok()) << s2;
    for (auto& t : threads) t.join();
    EXPECT_EQ(unexpected.load(), 0);
    EXPECT_EQ(e->add_request(greedy(prompt(0), 2)).status().code(),
              absl::StatusCode::kFailedPrecondition);
    int64_t choices = 0;
    for (const Added& a : added) choices += a.n;
    ASSERT_GT(added.size(), 0u);
    for (size_t k = 0; k < read_logs.size(); ++k) {
      expect_well_formed(read_logs[k]);
      for (const ChoiceLog& c : read_logs[k].choices) {
        expect_solo_or_aborted_prefix(c, read_added[k].prompt, read_added[k].max_tokens);
      }
    }
    for (const Added& a : added) {
      if (!a.callback) continue;
      const RequestLog log = sink.get(a.id);
      EXPECT_TRUE(log.complete()) << "callback request " << a.id << " never got its finals";
      expect_well_formed(log);
      for (const ChoiceLog& c : log.choices) {
        expect_solo_or_aborted_prefix(c, a.prompt, a.max_tokens);
      }
      EXPECT_EQ(e->abort(a.id).code(), absl::StatusCode::kNotFound);
    }
    expect_clean_after_shutdown(*e, choices);
  }
}

// Destroying an engine without shutdown, with requests running, unread
// queues and callbacks: returns promptly and every callback request got its
// finals (shutdown(0) aborts them).
TEST_F(LlmEngineStressTest, DestructorWithoutShutdownAndUnreadQueuesReturnsPromptly) {
  Sink sink;
  std::vector<std::pair<RequestId, int>> cb_ids;
  {
    auto e = engine(options(4, 64, 16, 8));
    for (int i = 0; i < 12; ++i) {
      const int n = i % 4 == 0 ? 2 : 1;
      RequestSpec s = greedy(prompt(i), 40, n);
      if (i % 2 == 0) s.on_output = sink.callback(n);
      const RequestId id = e->add_request(std::move(s)).value();
      if (i % 2 == 0) cb_ids.emplace_back(id, n);
    }
    // With requests running: the engine has taken steps.
    ASSERT_TRUE(simpler::testing::eventually([&] { return e->metrics().steps_total >= 2; }));
    const int64_t t0 = base::now_ns();
    e.reset();
    EXPECT_LT(seconds_since(t0), 10.0);
  }
  for (const auto& [id, n] : cb_ids) {
    const RequestLog log = sink.get(id);
    EXPECT_EQ(log.choices.size(), static_cast<size_t>(n));
    EXPECT_TRUE(log.complete()) << "request " << id;
    expect_well_formed(log);
  }
}

// A step that never finishes (an injected hang, the operation timeout far
// away) when shutdown's drain deadline passes: shutdown still returns in
// bounded time, every request ends once (aborted by the shutdown) and the
// engine is not made unhealthy by the cancellation.
TEST_F(LlmEngineStressTest, ShutdownWithAHungStepReturnsInBoundedTime) {
  auto e = engine(with_faults(options(2, 128, 32, 8), "run=4:task=2:kind=hang"));
  std::vector<RequestId> ids;
  for (int i = 0; i < 3; ++i) ids.push_back(e->add_request(greedy(prompt(i), 40)).value());
  // Wait until the engine is stuck at the hung step (tokens stop coming).
  RequestLog first(ids[0], 1);
  while (first.choices[0].tokens.size() < 2) {
    auto out = e->next_output(ids[0], base::Deadline::after(60s));
    ASSERT_TRUE(out.ok()) << out.status();
    first.add(*out);
  }
  const int64_t t0 = base::now_ns();
  const absl::Status s = e->shutdown(base::Deadline::after(50ms));
  EXPECT_LT(seconds_since(t0), 15.0);
  EXPECT_TRUE(e->health().ok()) << e->health();
  (void)s;  // the Worker's close may report the cancelled step
  while (!first.complete()) {
    auto out = e->next_output(ids[0], base::Deadline::after(5s));
    ASSERT_TRUE(out.ok()) << out.status();
    first.add(*out);
  }
  expect_well_formed(first);
  EXPECT_EQ(first.choices[0].finish, OutputFinish::kAbort);
  for (size_t i = 1; i < ids.size(); ++i) {
    const RequestLog log = read_all(*e, ids[i], 1, 5s);
    expect_well_formed(log);
    EXPECT_EQ(log.choices[0].finish, OutputFinish::kAbort);
  }
  const EngineMetrics m = e->metrics();
  EXPECT_EQ(m.kv_pages.total(), m.kv_pages_total);
  EXPECT_EQ(m.kv_pages.used + m.kv_pages.fenced, 0)
      << "after shutdown a page is free or quarantined; the snapshot is stale";
  EXPECT_EQ(m.requests_running + m.requests_waiting, 0);
}

// ---- stop strings (the real tokenizer) -------------------------------------------------------

class LlmEngineStressTextTest : public TinyTextModelTest<LlmEngineStressTextTest> {
 public:
  static constexpr const char* kDirPrefix = "simpler_llm_engine_stress_text_";

 protected:
  static std::unique_ptr<LlmEngine> engine(int depth, int32_t max_buffered = 4096) {
    EngineOptions eo = small_engine_options(depth, 64, 64, 4, 16);
    eo.max_buffered_outputs = max_buffered;
    eo.tokenizer = tokenizer_;
    return create_test_engine(*dir_, eo);
  }
};

// What a stop string does to `tokens` (each token's text delta from an
// IncrementalDetokenizer) with min_tokens: no match may end inside the text
// of the first min_tokens - 1 tokens; the first match found after a token
// cuts the text before it and keeps the tokens up to that one.
struct Expected {
  bool stopped = false;
  int64_t keep = 0;
  std::string text;
};
Expected expected_stop(const std::vector<std::string>& deltas, const std::string& stop,
                       int64_t min_tokens) {
  Expected x;
  std::string text;
  size_t unarmed = 0;
  for (size_t k = 0; k < deltas.size(); ++k) {
    text += deltas[k];
    const int64_t generated = static_cast<int64_t>(k) + 1;
    if (generated < min_tokens) {
      unarmed = text.size();
      continue;
    }
    const size_t from = unarmed >= stop.size() ? unarmed - stop.size() + 1 : 0;
    const size_t at = text.find(stop, from);
    if (at != std::string::npos) {
      x.stopped = true;
      x.keep = generated;
      x.text = text.substr(0, at);
      return x;
    }
  }
  x.keep = static_cast<int64_t>(deltas.size());
  x.text = text;
  return x;
}

// Stop strings with min_tokens 0, 3 and 7 and n = 3 greedy choices: every
// choice stops where the reference says (or runs to length), with the text
// cut before the stop string and completion_tokens = the tokens delivered.
TEST_F(LlmEngineStressTextTest, StopStringsWithMinTokensAndSeveralChoicesCutEveryChoiceAlike) {
  const int64_t kTokens = kSanitized ? 12 : 20;
  auto e = engine(2);
  const std::vector<int64_t> mins =
      kSanitized ? std::vector<int64_t>{0, 4} : std::vector<int64_t>{0, 3, 7};
  int tested_stops = 0;
  for (int64_t min_tokens : mins) {
    SCOPED_TRACE(::testing::Message() << "min_tokens " << min_tokens);
    RequestSpec base;
    base.prompt_ids = tokenizer_->encode("The quick brown fox");
    base.max_tokens = kTokens;
    base.sampling.temperature = 0;
    base.sampling.ignore_eos = true;
    base.sampling.min_tokens = static_cast<int32_t>(min_tokens);
    const RequestLog plain = read_all(*e, e->add_request(base).value(), 1);
    expect_well_formed(plain);
    ASSERT_EQ(plain.choices[0].tokens.size(), static_cast<size_t>(kTokens));
    std::vector<std::string> deltas;
    IncrementalDetokenizer detok(tokenizer_);
    for (int32_t t : plain.choices[0].tokens) {
      deltas.push_back(detok.push(std::span<const int32_t>(&t, 1)));
    }
    // Stop strings: the first character of the 2nd, 5th and 9th token's text.
    std::set<std::string> stops;
    for (size_t k : {1, 4, 8}) {
      if (k < deltas.size() && !deltas[k].empty()) {
        const unsigned char c0 = static_cast<unsigned char>(deltas[k][0]);
        const size_t len = c0 < 0x80 ? 1 : (c0 >> 5) == 6 ? 2 : (c0 >> 4) == 14 ? 3 : 4;
        stops.insert(deltas[k].substr(0, len));
      }
    }
    ASSERT_FALSE(stops.empty()) << "every token's text was empty";
    for (const std::string& stop : stops) {
      SCOPED_TRACE(::testing::Message() << "stop '" << stop << "'");
      const Expected x = expected_stop(deltas, stop, min_tokens);
      tested_stops += x.stopped ? 1 : 0;
      RequestSpec spec = base;
      spec.n = 3;
      spec.sampling.stop = {stop};
      const RequestLog log = read_all(*e, e->add_request(spec).value(), 3);
      expect_well_formed(log);
      for (int k = 0; k < 3; ++k) {
        const ChoiceLog& c = log.choices[k];
        EXPECT_EQ(c.finish, x.stopped ? OutputFinish::kStop : OutputFinish::kLength)
            << "choice " << k;
        EXPECT_EQ(c.text, x.text) << "choice " << k;
        EXPECT_EQ(c.completion_tokens, x.keep) << "choice " << k;
        EXPECT_EQ(c.tokens, std::vector<int32_t>(plain.choices[0].tokens.begin(),
                                                 plain.choices[0].tokens.begin() + x.keep))
            << "choice " << k;
      }
    }
  }
  EXPECT_GT(tested_stops, 0);
  EXPECT_TRUE(drained_shutdown(*e).ok());
  const EngineMetrics m = e->metrics();
  EXPECT_EQ(m.kv_pages.free, m.kv_pages_total);
}

// Seeded choices (each its own stream, so each stops somewhere else) on a
// pool that preempts, at depth 4, min_tokens 6: every choice stops where the
// reference says for its own tokens, with the text cut and completion_tokens
// = the tokens delivered.
TEST_F(LlmEngineStressTextTest, SeededChoicesStopEachAtTheirOwnStopStringUnderPreemption) {
  const int64_t kTokens = kSanitized ? 10 : 18;
  RequestSpec base;
  base.prompt_ids = tokenizer_->encode(
      "Once upon a time, in a small village by the sea, there lived an old fisherman");
  base.prompt_ids.resize(11);  // one page holds it and the first 5 tokens
  base.max_tokens = kTokens;
  base.n = 3;
  base.sampling.temperature = 1.0f;
  base.sampling.top_k = 50;
  base.sampling.seed = 1234;
  base.sampling.ignore_eos = true;
  base.sampling.min_tokens = 6;
  RequestLog plain;
  {
    auto e = engine(1);
    plain = read_all(*e, e->add_request(base).value(), 3);
    EXPECT_TRUE(e->shutdown().ok());
  }
  expect_well_formed(plain);
  std::vector<std::vector<std::string>> deltas(3);
  std::set<std::string> stops;
  for (int k = 0; k < 3; ++k) {
    ASSERT_EQ(plain.choices[k].tokens.size(), static_cast<size_t>(kTokens));
    IncrementalDetokenizer detok(tokenizer_);
    for (int32_t t : plain.choices[k].tokens) {
      deltas[k].push_back(detok.push(std::span<const int32_t>(&t, 1)));
    }
    deltas[k].back() += detok.finish();
    // One stop string from each choice's text: the first character of its 10th token's text.
    const std::string& d = deltas[k][9];
    if (!d.empty()) {
      const unsigned char c0 = static_cast<unsigned char>(d[0]);
      stops.insert(d.substr(0, c0 < 0x80 ? 1 : (c0 >> 5) == 6 ? 2 : (c0 >> 4) == 14 ? 3 : 4));
    }
  }
  ASSERT_FALSE(stops.empty());
  RequestSpec spec = base;
  spec.sampling.stop.assign(stops.begin(), stops.end());
  // The earliest match of any of the stop strings, per choice.
  std::vector<Expected> want(3);
  for (int k = 0; k < 3; ++k) {
    want[k].keep = kTokens + 1;
    for (const std::string& st : stops) {
      const Expected x = expected_stop(deltas[k], st, 6);
      if (x.stopped && (x.keep < want[k].keep ||
                        (x.keep == want[k].keep && x.text.size() < want[k].text.size()))) {
        want[k] = x;
      }
    }
    if (!want[k].stopped) want[k] = expected_stop(deltas[k], stops.begin()->c_str(), kTokens + 1);
  }
  // 4 pages of 16 tokens: the three choices of an 11-token prompt start with
  // a page each and need a second one each by their 6th token.
  EngineOptions eo;
  eo.runner.worker.num_cores = 2;
  eo.runner.worker.launch_depth = 4;
  eo.runner.worker.faults.emplace();
  eo.runner.num_pages = 4;
  eo.runner.max_num_seqs = 4;
  eo.runner.max_num_batched_tokens = 64;
  eo.tokenizer = tokenizer_;
  auto e = LlmEngine::create(*dir_, eo).value();
  EngineTestAccess::set_check_invariants(*e, true);
  const RequestLog log = read_all(*e, e->add_request(spec).value(), 3);
  expect_well_formed(log);
  for (int k = 0; k < 3; ++k) {
    SCOPED_TRACE(::testing::Message() << "choice " << k);
    const ChoiceLog& c = log.choices[k];
    EXPECT_EQ(c.finish, want[k].stopped ? OutputFinish::kStop : OutputFinish::kLength);
    EXPECT_EQ(c.text, want[k].text);
    EXPECT_EQ(c.completion_tokens, want[k].keep);
    EXPECT_EQ(c.tokens, std::vector<int32_t>(plain.choices[k].tokens.begin(),
                                             plain.choices[k].tokens.begin() + want[k].keep));
  }
  EXPECT_TRUE(EngineTestAccess::invariant_violation(*e).ok())
      << EngineTestAccess::invariant_violation(*e);
  EXPECT_TRUE(drained_shutdown(*e).ok());
  const EngineMetrics m = e->metrics();
  EXPECT_GT(m.preemptions_total, 0);
  EXPECT_EQ(m.kv_pages.free, m.kv_pages_total);
  int64_t stopped = 0;
  for (const Expected& w : want) stopped += w.stopped ? 1 : 0;
  EXPECT_GT(stopped, 0);
  EXPECT_EQ(m.requests_finished_stop, stopped);
  EXPECT_EQ(m.requests_finished_length, 3 - stopped);
}

// Stop strings with a consumer that reads nothing until every choice ended
// (one undelivered output allowed for the request's three choices): each
// choice ends as the reference says with every token and the cut text
// delivered, or as aborted for falling behind with completion_tokens = the
// tokens it did deliver — never "stop" with a token missing.
TEST_F(LlmEngineStressTextTest, StopStringsWithAConsumerThatFellBehind) {
  const int64_t kTokens = kSanitized ? 8 : 14;
  RequestSpec base;
  base.prompt_ids = tokenizer_->encode("The quick brown fox");
  base.max_tokens = kTokens;
  base.sampling.temperature = 0;
  base.sampling.ignore_eos = true;
  RequestLog plain;
  {
    auto e = engine(2);
    plain = read_all(*e, e->add_request(base).value(), 1);
    EXPECT_TRUE(e->shutdown().ok());
  }
  expect_well_formed(plain);
  std::vector<std::string> deltas;
  IncrementalDetokenizer detok(tokenizer_);
  for (int32_t t : plain.choices[0].tokens) {
    deltas.push_back(detok.push(std::span<const int32_t>(&t, 1)));
  }
  deltas.back() += detok.finish();
  const std::string& d = deltas[kTokens / 2];
  ASSERT_FALSE(d.empty());
  const unsigned char c0 = static_cast<unsigned char>(d[0]);
  const std::string stop = d.substr(0, c0 < 0x80         ? 1
                                       : (c0 >> 5) == 6  ? 2
                                       : (c0 >> 4) == 14 ? 3
                                                         : 4);
  const Expected want = expected_stop(deltas, stop, 0);
  ASSERT_TRUE(want.stopped);
  for (int depth : {1, 4}) {
    SCOPED_TRACE(::testing::Message() << "depth " << depth);
    auto e = engine(depth, /*max_buffered=*/1);
    RequestSpec spec = base;
    spec.n = 3;
    spec.sampling.stop = {stop};
    const RequestId id = e->add_request(spec).value();
    ASSERT_TRUE(simpler::testing::eventually(
        [&] {
          const EngineMetrics m = e->metrics();
          return m.requests_finished_stop + m.requests_finished_length +
                     m.requests_finished_abort >=
                 3;
        },
        60s));
    const RequestLog log = read_all(*e, id, 3);
    expect_well_formed(log);
    int aborted = 0;
    for (int k = 0; k < 3; ++k) {
      SCOPED_TRACE(::testing::Message() << "choice " << k);
      const ChoiceLog& c = log.choices[k];
      if (c.finish == OutputFinish::kAbort) {
        ++aborted;
        EXPECT_EQ(c.error.code(), absl::StatusCode::kResourceExhausted) << c.error;
        EXPECT_TRUE(is_prefix(c.tokens, plain.choices[0].tokens));
      } else {
        EXPECT_EQ(c.finish, OutputFinish::kStop) << c.error;
        EXPECT_EQ(c.text, want.text);
        EXPECT_EQ(c.completion_tokens, want.keep);
      }
    }
    EXPECT_GT(aborted, 0);
    EXPECT_TRUE(drained_shutdown(*e).ok());
    const EngineMetrics m = e->metrics();
    EXPECT_EQ(m.requests_finished_abort, aborted);
    EXPECT_EQ(m.requests_finished_stop, 3 - aborted);
    EXPECT_EQ(m.kv_pages.free, m.kv_pages_total);
  }
}

}  // namespace
}  // namespace simpler::llm
