#include "engine/scheduler.h"

#include <cstdint>
#include <deque>
#include <functional>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace simpler::llm {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

SchedulerOptions options(int32_t budget, int32_t max_seqs, int32_t page_size, int32_t num_pages,
                         int64_t max_model_len = 4096, int32_t max_waiting = 4096) {
  SchedulerOptions o;
  o.max_num_batched_tokens = budget;
  o.max_num_seqs = max_seqs;
  o.max_waiting = max_waiting;
  o.page_size = page_size;
  o.num_pages = num_pages;
  o.max_model_len = max_model_len;
  return o;
}

// A scheduler with `o` and `requests` added in order (each must be accepted).
Scheduler scheduler_with(const SchedulerOptions& o,
                         std::initializer_list<SchedulerRequest> requests) {
  Scheduler s = Scheduler::create(o).value();
  for (const SchedulerRequest& r : requests) {
    const absl::Status added = s.add(r);
    EXPECT_TRUE(added.ok()) << "request " << r.id << ": " << added;
  }
  return s;
}

int32_t token_for(const StepRow& row) {
  return static_cast<int32_t>((row.request_id * 31 + row.start + row.len) % 1000);
}

// Checks what every plan must satisfy: budget, row cap, decodes first, slots
// inside the row's block table, no slot shared between rows, and no page
// shared between rows unless it is in the prefix cache (read-only).
void expect_well_formed(const StepPlan& plan, const SchedulerOptions& o,
                        const PagePool* pool = nullptr) {
  EXPECT_LE(plan.num_tokens(), o.max_num_batched_tokens) << "step " << plan.step_id;
  EXPECT_LE(static_cast<int64_t>(plan.rows.size()), o.max_num_seqs) << "step " << plan.step_id;
  bool seen_prefill = false;
  std::set<int32_t> slots, pages;
  std::set<uint64_t> ids;
  for (const StepRow& row : plan.rows) {
    EXPECT_TRUE(ids.insert(row.request_id).second) << "request " << row.request_id << " twice";
    if (row.prefill) seen_prefill = true;
    if (!row.prefill) {
      EXPECT_FALSE(seen_prefill) << "decode row after a prefill row in step " << plan.step_id;
      EXPECT_EQ(row.len, 1);
      EXPECT_TRUE(row.logits);
    }
    ASSERT_EQ(static_cast<int64_t>(row.slots.size()), row.len);
    for (int64_t k = 0; k < row.len; ++k) {
      const int64_t pos = row.start + k;
      const int32_t slot = row.slots[k];
      ASSERT_LT(pos / o.page_size, static_cast<int64_t>(row.block_table.size()));
      EXPECT_EQ(slot, row.block_table[pos / o.page_size] * o.page_size + pos % o.page_size);
      EXPECT_TRUE(slots.insert(slot).second) << "slot " << slot << " twice in a step";
    }
    for (int32_t page : row.block_table) {
      const bool shareable = pool != nullptr && pool->is_cached(page);
      EXPECT_TRUE(pages.insert(page).second || shareable) << "page " << page << " in two rows";
    }
  }
}

// Drives a scheduler like the engine loop would, with a runner that retires a
// step once `depth` steps are in flight (the launch depth).
class FakeRunner {
 public:
  FakeRunner(Scheduler& s, SchedulerOptions o, int depth) : s_(s), o_(o), depth_(depth) {}

  std::function<bool(const StepRow&)> stop = [](const StepRow&) { return false; };
  std::function<void(const StepPlan&)> on_plan = [](const StepPlan&) {};
  std::function<std::optional<StepFailure>(int64_t)> fail = [](int64_t) {
    return std::optional<StepFailure>();
  };
  // When set, a fake KV cache: each row writes token_of(request, position) into its slots and
  // must read exactly its own tokens at every earlier position of its block table; a row never
  // writes a page of the prefix cache, and a failed step's slots turn to garbage.
  std::function<int32_t(uint64_t, int64_t)> token_of;

  // One iteration: schedule a step when one is ready, then retire the oldest
  // step when the launch depth is reached or nothing could be scheduled.
  // False when idle (nothing scheduled and nothing retired).
  bool step() {
    std::optional<StepPlan> plan = s_.schedule();
    if (plan) {
      expect_well_formed(*plan, o_, &s_.pool());
      if (token_of) run_on_fake_kv(*plan);
      on_plan(*plan);
      plans.push_back(*plan);
      flight_.push_back(*std::move(plan));
    }
    const bool scheduled = plan.has_value();
    bool retired = false;
    if (static_cast<int>(flight_.size()) >= depth_ || (!scheduled && !flight_.empty())) {
      retire_oldest();
      retired = true;
    }
    return scheduled || retired;
  }

  void retire_oldest() {
    const StepPlan& front = flight_.front();
    if (std::optional<StepFailure> failure = fail(front.step_id)) {
      for (const StepRow& row : front.rows) {
        for (int32_t slot : row.slots) kv_[slot] = kGarbage;
      }
      EXPECT_TRUE(s_.on_step_failed(front.step_id, *failure).ok());
      flight_.pop_front();
      return;
    }
    std::vector<RowResult> results;
    for (const StepRow& row : front.rows) results.push_back(RowResult{token_for(row), stop(row)});
    EXPECT_TRUE(s_.on_step_retired(front.step_id, results).ok());
    flight_.pop_front();
  }

  int64_t run_to_idle(int64_t max_iterations) {
    int64_t n = 0;
    while (step()) {
      if (++n > max_iterations) {
        ADD_FAILURE() << "no progress after " << max_iterations << " iterations";
        break;
      }
    }
    return n;
  }

  std::deque<StepPlan>& flight() { return flight_; }
  std::vector<StepPlan> plans;

 private:
  static constexpr int32_t kGarbage = -2;

  void run_on_fake_kv(const StepPlan& plan) {
    kv_.resize(static_cast<size_t>(o_.num_pages) * o_.page_size, -1);
    for (const StepRow& row : plan.rows) {
      for (int64_t p = 0; p < row.start; ++p) {
        const int32_t slot = row.block_table[p / o_.page_size] * o_.page_size + p % o_.page_size;
        ASSERT_EQ(kv_[slot], token_of(row.request_id, p))
            << "step " << plan.step_id << " request " << row.request_id << " reads position " << p
            << " from slot " << slot;
      }
      for (int64_t k = 0; k < row.len; ++k) {
        const int32_t page = row.block_table[(row.start + k) / o_.page_size];
        EXPECT_FALSE(s_.pool().is_cached(page))
            << "request " << row.request_id << " writes cached page " << page;
        kv_[row.slots[k]] = token_of(row.request_id, row.start + k);
      }
    }
  }

  std::vector<int32_t> kv_;
  Scheduler& s_;
  SchedulerOptions o_;
  int depth_;
  std::deque<StepPlan> flight_;
};

TEST(Scheduler, CreateRejectsNonPositiveSizesNamingTheField) {
  SchedulerOptions o = options(0, 4, 16, 8);
  EXPECT_EQ(Scheduler::create(o).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(Scheduler::create(o).status().message(),
              HasSubstr("max_num_batched_tokens 0 must be positive"));
  o = options(8, 4, 16, -1);
  EXPECT_THAT(Scheduler::create(o).status().message(), HasSubstr("num_pages -1"));
}

TEST(Scheduler, BudgetAndRowCapHoldEveryStepAndDecodesComeFirst) {
  const SchedulerOptions o = options(/*budget=*/8, /*max_seqs=*/3, /*page_size=*/4, 64);
  Scheduler s = Scheduler::create(o).value();
  for (uint64_t id = 1; id <= 6; ++id) {
    ASSERT_TRUE(s.add({id, static_cast<int64_t>(3 * id), 5, id}).ok());
  }
  FakeRunner runner(s, o, /*depth=*/1);
  runner.run_to_idle(1000);
  EXPECT_EQ(s.snapshot().finished[static_cast<int>(FinishReason::kLength)], 6);
  // Step 1 admits request 1 (3 tokens) and request 2's first 5 tokens.
  ASSERT_GE(runner.plans.size(), 2u);
  const StepPlan& first = runner.plans[0];
  ASSERT_EQ(first.rows.size(), 2u);
  EXPECT_EQ(first.rows[0].request_id, 1u);
  EXPECT_EQ(first.rows[0].len, 3);
  EXPECT_TRUE(first.rows[0].logits);
  EXPECT_EQ(first.rows[1].request_id, 2u);
  EXPECT_EQ(first.rows[1].len, 5);
  EXPECT_FALSE(first.rows[1].logits);  // more prompt follows
  // Step 2: request 1 decodes first, then request 2's last prompt token, then
  // request 3's first chunk within what is left of the budget.
  const StepPlan& second = runner.plans[1];
  ASSERT_EQ(second.rows.size(), 3u);
  EXPECT_FALSE(second.rows[0].prefill);
  EXPECT_EQ(second.rows[0].request_id, 1u);
  EXPECT_EQ(second.rows[0].start, 3);
  EXPECT_EQ(second.rows[1].request_id, 2u);
  EXPECT_EQ(second.rows[1].start, 5);
  EXPECT_EQ(second.rows[1].len, 1);
  EXPECT_TRUE(second.rows[1].logits);
  EXPECT_EQ(second.rows[2].request_id, 3u);
  EXPECT_EQ(second.rows[2].len, 6);
}

TEST(Scheduler, PrefillChunksLeaveRoomForLaterDecodes) {
  // Request 1 is admitted first with a long prompt; requests 2 and 3 decode.
  // Each step still gives the decodes their rows before request 1's chunk.
  const SchedulerOptions o = options(/*budget=*/10, /*max_seqs=*/3, 4, 64);
  Scheduler s = scheduler_with(o, {{1, 2, 8}, {2, 2, 8}});
  FakeRunner runner(s, o, 1);
  ASSERT_TRUE(runner.step());  // prefill 1 and 2
  ASSERT_TRUE(s.add({3, 100, 2}).ok());
  ASSERT_TRUE(runner.step());
  const StepPlan& plan = runner.plans.back();
  ASSERT_EQ(plan.rows.size(), 3u);
  EXPECT_FALSE(plan.rows[0].prefill);
  EXPECT_FALSE(plan.rows[1].prefill);
  EXPECT_EQ(plan.rows[2].request_id, 3u);
  EXPECT_EQ(plan.rows[2].len, 8);
  EXPECT_EQ(plan.num_tokens(), 10);
}

TEST(Scheduler, RowCapRunsTheOldestRequestsFirstAndEveryoneFinishes) {
  // 5 single-token prompts, a row cap of 2: the oldest two run until they
  // finish, then the next two, then the last one; nobody is skipped.
  const SchedulerOptions o = options(64, /*max_seqs=*/2, 4, 32);
  Scheduler s = Scheduler::create(o).value();
  for (uint64_t id = 1; id <= 5; ++id) ASSERT_TRUE(s.add({id, 1, 3}).ok());
  FakeRunner runner(s, o, 1);
  runner.run_to_idle(100);
  std::vector<std::vector<uint64_t>> ids;
  for (const StepPlan& plan : runner.plans) {
    ids.emplace_back();
    for (const StepRow& row : plan.rows) ids.back().push_back(row.request_id);
  }
  const std::vector<std::vector<uint64_t>> want = {{1, 2}, {1, 2}, {1, 2}, {3, 4}, {3, 4},
                                                   {3, 4}, {5},    {5},    {5}};
  EXPECT_EQ(ids, want);
  EXPECT_EQ(s.snapshot().finished[static_cast<int>(FinishReason::kLength)], 5);
}

TEST(Scheduler, A2000TokenPromptTakesCeilOfPromptOverBudgetPrefillSteps) {
  for (int32_t budget : {256, 512, 700, 2000, 4096}) {
    const SchedulerOptions o = options(budget, 8, 16, 256);
    Scheduler s = scheduler_with(o, {{42, 2000, 3}});
    FakeRunner runner(s, o, 1);
    runner.run_to_idle(100);
    int64_t prefill_steps = 0, covered = 0;
    for (const StepPlan& plan : runner.plans) {
      ASSERT_EQ(plan.rows.size(), 1u);
      const StepRow& row = plan.rows[0];
      if (!row.prefill) continue;
      ++prefill_steps;
      EXPECT_EQ(row.start, covered);
      covered += row.len;
      EXPECT_EQ(row.logits, covered == 2000);
    }
    EXPECT_EQ(prefill_steps, (2000 + budget - 1) / budget) << "budget " << budget;
    EXPECT_EQ(covered, 2000);
    // Then max_tokens - 1 decodes (the prefill sampled the first token).
    EXPECT_EQ(static_cast<int64_t>(runner.plans.size()), prefill_steps + 2);
    EXPECT_EQ(runner.plans.back().rows[0].start, 2001);
  }
}

TEST(Scheduler, AdmissionIsFirstComeFirstServed) {
  // 6 pages of 4 tokens. Request 1 holds 4 pages, request 2 needs 4 for its
  // prompt and must wait; request 3 (1 page) arrived later and waits behind it.
  const SchedulerOptions o = options(64, 8, 4, 6);
  Scheduler s = scheduler_with(o, {{1, 16, 2}, {2, 16, 2}, {3, 2, 2}});
  FakeRunner runner(s, o, 1);
  ASSERT_TRUE(runner.step());
  ASSERT_EQ(runner.plans[0].rows.size(), 1u);
  EXPECT_EQ(runner.plans[0].rows[0].request_id, 1u);
  EXPECT_FALSE(s.find(3)->running);
  runner.run_to_idle(100);
  std::vector<uint64_t> admitted;
  for (const StepPlan& plan : runner.plans) {
    for (const StepRow& row : plan.rows) {
      if (row.start == 0) admitted.push_back(row.request_id);
    }
  }
  EXPECT_THAT(admitted, ElementsAre(1, 2, 3));
}

TEST(Scheduler, PagesOfAFinishedRequestAreFreedOnlyAfterTheFenceStepRetired) {
  const SchedulerOptions o = options(64, 8, 4, 4);
  Scheduler s = Scheduler::create(o).value();
  ASSERT_TRUE(s.add({1, 8, 8}).ok());  // 2 pages for the prompt
  std::optional<StepPlan> step1 = s.schedule();
  ASSERT_TRUE(step1.has_value());
  std::optional<StepPlan> step2 = s.schedule();  // decode at 8 reads step 1's sample
  ASSERT_TRUE(step2.has_value());
  EXPECT_EQ(step2->rows[0].start, 8);
  EXPECT_EQ(s.pool().num_used(), 3);
  // Step 1 samples a stop token: the request finishes while step 2 is in flight.
  ASSERT_TRUE(s.on_step_retired(step1->step_id, {RowResult{7, true}}).ok());
  std::vector<FinishedRequest> done = s.take_finished();
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].reason, FinishReason::kStop);
  EXPECT_THAT(done[0].output_tokens, ElementsAre(7));
  SchedulerSnapshot snap = s.snapshot();
  EXPECT_EQ(snap.pages.fenced, 3);
  EXPECT_EQ(snap.pages.free, 1);
  EXPECT_EQ(snap.pages.total(), 4);
  // A new request needing 2 pages is not admitted on fenced pages.
  ASSERT_TRUE(s.add({2, 8, 1}).ok());
  EXPECT_FALSE(s.schedule().has_value());
  ASSERT_TRUE(s.on_step_retired(step2->step_id, {RowResult{9, false}}).ok());
  EXPECT_EQ(s.snapshot().pages.free, 4);
  std::optional<StepPlan> step3 = s.schedule();
  ASSERT_TRUE(step3.has_value());
  EXPECT_EQ(step3->rows[0].request_id, 2u);
  EXPECT_TRUE(s.check_invariants().ok());
}

TEST(Scheduler, AbortFencesPagesBehindTheLastSubmittedStep) {
  const SchedulerOptions o = options(64, 8, 4, 4);
  Scheduler s = scheduler_with(o, {{1, 4, 8}, {2, 4, 8}});
  std::optional<StepPlan> step1 = s.schedule();
  ASSERT_TRUE(step1.has_value());
  ASSERT_TRUE(s.abort(1).ok());
  EXPECT_EQ(s.snapshot().pages.fenced, 1);
  EXPECT_EQ(s.abort(1).code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(s.abort(2).ok());
  ASSERT_TRUE(s.on_step_retired(step1->step_id, {RowResult{}, RowResult{}}).ok());
  SchedulerSnapshot snap = s.snapshot();
  EXPECT_EQ(snap.pages.free, 4);
  EXPECT_EQ(snap.finished[static_cast<int>(FinishReason::kAbort)], 2);
  EXPECT_FALSE(s.schedule().has_value());
  // A waiting request holds no pages; aborting it is immediate.
  ASSERT_TRUE(s.add({3, 4, 8}).ok());
  ASSERT_TRUE(s.abort(3).ok());
  EXPECT_EQ(s.snapshot().waiting, 0);
}

TEST(Scheduler, TimedOutStepQuarantinesItsPagesWhichStayCountedAndUnused) {
  const SchedulerOptions o = options(64, 8, 4, 6);
  Scheduler s = Scheduler::create(o).value();
  ASSERT_TRUE(s.add({1, 8, 4}).ok());  // pages 0, 1
  ASSERT_TRUE(s.add({2, 4, 4}).ok());  // page 2
  std::optional<StepPlan> step1 = s.schedule();
  ASSERT_TRUE(step1.has_value());
  ASSERT_TRUE(s.on_step_failed(step1->step_id, StepFailure::kUnrecoverable,
                               absl::DeadlineExceededError("run 0 did not finish"))
                  .ok());
  {
    std::vector<FinishedRequest> failed = s.take_finished();
    ASSERT_EQ(failed.size(), 2u);
    for (const FinishedRequest& f : failed) {
      EXPECT_EQ(f.reason, FinishReason::kError);
      EXPECT_EQ(f.error, absl::DeadlineExceededError("run 0 did not finish"));
    }
  }
  SchedulerSnapshot snap = s.snapshot();
  EXPECT_EQ(snap.pages.quarantined, 3);
  EXPECT_EQ(snap.pages.free, 3);
  EXPECT_EQ(snap.pages.used + snap.pages.fenced, 0);
  EXPECT_EQ(snap.finished[static_cast<int>(FinishReason::kError)], 2);
  // The quarantined pages are never handed out again.
  ASSERT_TRUE(s.add({3, 12, 1}).ok());
  std::optional<StepPlan> step2 = s.schedule();
  ASSERT_TRUE(step2.has_value());
  EXPECT_THAT(step2->rows[0].block_table, ElementsAre(3, 4, 5));
  ASSERT_TRUE(s.on_step_retired(step2->step_id, {RowResult{}}).ok());
  EXPECT_EQ(s.snapshot().pages.quarantined, 3);
  EXPECT_EQ(s.snapshot().pages.free, 3);
  // A request that no longer fits what quarantine left is refused at add,
  // with both numbers, instead of failing later.
  absl::Status no_room = s.add({4, 20, 1});
  EXPECT_EQ(no_room.code(), absl::StatusCode::kInvalidArgument) << no_room;
  EXPECT_THAT(no_room.message(), HasSubstr("needs up to 5 KV pages (20 positions of page_size 4), "
                                           "more than the pool's 3 usable pages (6 pages, 3 "
                                           "quarantined)"));
  EXPECT_FALSE(s.schedule().has_value());
  EXPECT_TRUE(s.check_invariants().ok());
}

TEST(Scheduler, AnIdIsReusableOnlyAfterItsStepsRetiredAndRunningRequestsAreCapped) {
  SchedulerOptions o = options(64, 2, 4, 16);
  Scheduler s = scheduler_with(o, {{1, 4, 8}});
  std::optional<StepPlan> step1 = s.schedule();
  ASSERT_TRUE(step1.has_value());
  ASSERT_TRUE(s.abort(1).ok());
  absl::Status reused = s.add({1, 3, 2});
  EXPECT_EQ(reused.code(), absl::StatusCode::kFailedPrecondition) << reused;
  EXPECT_THAT(reused.message(), HasSubstr("request id 1 is still used by step"));
  ASSERT_TRUE(s.on_step_retired(step1->step_id, {RowResult{}}).ok());
  EXPECT_TRUE(s.add({1, 3, 2}).ok());  // retired: the id is free again
  // max_num_seqs = 2 caps the running requests, not only the rows per step:
  // at depth 2 a request waiting for its only sample takes no row, and
  // without the cap admission would keep adding requests.
  for (uint64_t id : {2u, 3u, 4u, 5u, 6u, 7u}) ASSERT_TRUE(s.add({id, 1, 1}).ok());
  std::deque<StepPlan> in_flight;
  int64_t most_running = 0;
  while (true) {
    std::optional<StepPlan> p = s.schedule();
    if (p.has_value()) in_flight.push_back(*std::move(p));
    most_running = std::max(most_running, s.snapshot().running);
    if (in_flight.empty()) break;
    if (p.has_value() && in_flight.size() < 2) continue;
    std::vector<RowResult> results(in_flight.front().rows.size());
    ASSERT_TRUE(s.on_step_retired(in_flight.front().step_id, results).ok());
    in_flight.pop_front();
  }
  EXPECT_EQ(most_running, 2);
  EXPECT_EQ(s.snapshot().running, 0);
  EXPECT_TRUE(s.check_invariants().ok());
}

// A prefill chunk shrinks to the free pages instead of preempting (and
// recomputing) anyone, and a step that preempted admits nothing: the
// reviewer's trace (budget 8, 6 pages of 4, A: prompt 4 + 20, B: prompt 16 + 8)
// once preempted B and re-admitted it from position 0 in almost every step.
TEST(Scheduler, APrefillShrinksToTheFreePagesInsteadOfThrashing) {
  const SchedulerOptions o = options(8, 4, 4, 6);
  Scheduler s = scheduler_with(o, {{1, 4, 20}, {2, 16, 8}});
  FakeRunner runner(s, o, /*depth=*/1);
  runner.run_to_idle(500);
  const SchedulerSnapshot snap = s.snapshot();
  EXPECT_EQ(snap.running + snap.waiting, 0);
  // Neither fits beside the other at full length (6 pages each), so B yields to
  // A each time A crosses a page: 4 preemptions. Before the fix: 10.
  EXPECT_LE(snap.preempted_total, 5) << "preemption thrash";
  EXPECT_TRUE(s.check_invariants().ok());
}

// The engine learns which samples were accepted (stale rows of a request
// stopped meanwhile are not), and a stop string found later by the output
// processor finishes the request as kStop with its output cut.
TEST(Scheduler, AcceptedSamplesAreReportedAndAStopStringFinishesWithTheOutputCut) {
  const SchedulerOptions o = options(64, 4, 4, 16);
  Scheduler s = scheduler_with(o, {{1, 2, 10}, {2, 2, 10}});
  std::optional<StepPlan> a = s.schedule();  // both prefill and sample
  std::optional<StepPlan> b = s.schedule();  // both decode, in flight behind a
  ASSERT_TRUE(a.has_value() && b.has_value());
  auto ra = s.on_step_retired(a->step_id, std::vector<RowResult>(a->rows.size(), {7, false}));
  ASSERT_TRUE(ra.ok()) << ra.status();
  ASSERT_EQ(ra->size(), 2u);
  EXPECT_EQ((*ra)[0].index, 0);
  EXPECT_EQ((*ra)[0].token, 7);
  // The output processor finds a stop string ending in request 1's first token.
  ASSERT_TRUE(s.stop(1, 1).ok());
  EXPECT_EQ(s.stop(1, 1).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(s.stop(2, 5).code(), absl::StatusCode::kInvalidArgument);
  auto rb = s.on_step_retired(b->step_id, std::vector<RowResult>(b->rows.size(), {8, false}));
  ASSERT_TRUE(rb.ok());
  ASSERT_EQ(rb->size(), 1u) << "request 1's row in step b is stale";
  EXPECT_EQ((*rb)[0].request_id, 2u);
  EXPECT_EQ((*rb)[0].index, 1);
  std::vector<FinishedRequest> done = s.take_finished();
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].id, 1u);
  EXPECT_EQ(done[0].reason, FinishReason::kStop);
  EXPECT_THAT(done[0].output_tokens, ElementsAre(7));
  EXPECT_TRUE(s.check_invariants().ok());
}

// The per-request device state slot (sampling token counts) follows the same
// lifetime as pages: held while running, reused only after the last step
// that used it retired, and marked fresh on a request's first row with it.
TEST(Scheduler, AStateSlotIsReusedOnlyAfterTheFenceAndIsFreshForItsNewRequest) {
  const SchedulerOptions o = options(64, 1, 4, 16);  // one state slot
  Scheduler s = scheduler_with(o, {{1, 3, 10}, {2, 3, 10}});
  std::optional<StepPlan> a = s.schedule();
  ASSERT_TRUE(a.has_value());
  ASSERT_EQ(a->rows.size(), 1u);
  EXPECT_EQ(a->rows[0].request_id, 1u);
  EXPECT_EQ(a->rows[0].state_slot, 0);
  EXPECT_TRUE(a->rows[0].fresh_state);
  ASSERT_TRUE(s.abort(1).ok());  // step a still uses slot 0
  EXPECT_EQ(s.snapshot().state_slots_fenced, 1);
  EXPECT_FALSE(s.schedule().has_value()) << "request 2 must wait for the fenced slot";
  ASSERT_TRUE(s.on_step_retired(a->step_id, {RowResult{5, false}}).ok());
  EXPECT_EQ(s.snapshot().state_slots_free, 1);
  std::optional<StepPlan> b = s.schedule();
  ASSERT_TRUE(b.has_value());
  EXPECT_EQ(b->rows[0].request_id, 2u);
  EXPECT_EQ(b->rows[0].state_slot, 0);
  EXPECT_TRUE(b->rows[0].fresh_state);
  ASSERT_TRUE(s.on_step_retired(b->step_id, {RowResult{6, false}}).ok());
  std::optional<StepPlan> c = s.schedule();
  ASSERT_TRUE(c.has_value());
  EXPECT_FALSE(c->rows[0].fresh_state);
  EXPECT_TRUE(s.check_invariants().ok());
}

TEST(Scheduler, RecoverableStepFailureFreesItsPagesBehindTheFence) {
  const SchedulerOptions o = options(64, 8, 4, 4);
  Scheduler s = scheduler_with(o, {{1, 4, 4}});
  std::optional<StepPlan> step1 = s.schedule();
  std::optional<StepPlan> step2 = s.schedule();
  ASSERT_TRUE(step1.has_value() && step2.has_value());
  EXPECT_EQ(s.on_step_failed(step2->step_id, StepFailure::kRecoverable).code(),
            absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(s.on_step_failed(step1->step_id, StepFailure::kRecoverable).ok());
  EXPECT_EQ(s.snapshot().pages.fenced, 2);  // step 2 still writes position 4
  ASSERT_TRUE(s.on_step_retired(step2->step_id, {RowResult{}}).ok());  // ignored row
  SchedulerSnapshot snap = s.snapshot();
  EXPECT_EQ(snap.pages.free, 4);
  EXPECT_EQ(snap.pages.quarantined, 0);
  EXPECT_EQ(snap.finished[static_cast<int>(FinishReason::kError)], 1);
}

TEST(Scheduler, StepReportsOutOfOrderOrWithWrongRowCountsAreRefused) {
  const SchedulerOptions o = options(64, 8, 4, 4);
  Scheduler s = Scheduler::create(o).value();
  EXPECT_THAT(s.on_step_retired(1, {}).status().message(), HasSubstr("no step is in flight"));
  ASSERT_TRUE(s.add({1, 4, 4}).ok());
  std::optional<StepPlan> step1 = s.schedule();
  std::optional<StepPlan> step2 = s.schedule();
  absl::Status early = s.on_step_retired(step2->step_id, {RowResult{}}).status();
  EXPECT_EQ(early.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(early.message(), HasSubstr("step 2 reported done before step 1"));
  absl::Status wrong = s.on_step_retired(step1->step_id, {}).status();
  EXPECT_EQ(wrong.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(wrong.message(), HasSubstr("step 1 has 1 rows, but 0 results were given"));
}

TEST(Scheduler, PreemptionPicksTheMostRecentlyAdmittedKeepsItsTokensAndRecomputes) {
  // 4 pages of 4 tokens; requests 1 and 2 each may need 3 pages.
  const SchedulerOptions o = options(64, 8, 4, 4);
  Scheduler s = scheduler_with(o, {{1, 4, 8}, {2, 4, 8}});
  FakeRunner runner(s, o, 1);
  ASSERT_TRUE(runner.step());          // both prefill, one page each
  ASSERT_TRUE(s.add({3, 4, 1}).ok());  // waits: no page free after the next step
  std::vector<int32_t> kept;
  int64_t preempted_at = -1;
  runner.on_plan = [&](const StepPlan& plan) {
    if (preempted_at < 0 && s.snapshot().preempted_total == 1) {
      preempted_at = plan.step_id;
      std::optional<RequestInfo> two = s.find(2);
      ASSERT_TRUE(two.has_value());
      EXPECT_FALSE(two->running);
      EXPECT_EQ(two->num_preemptions, 1);
      EXPECT_TRUE(two->pages.empty());
      kept = two->output_tokens;
      EXPECT_TRUE(s.find(1)->running);
    }
  };
  runner.run_to_idle(200);
  ASSERT_GT(preempted_at, 0);
  EXPECT_EQ(s.snapshot().preempted_total, 1);
  // Request 1 crossed into its third page at position 8: step 5 (positions
  // 4..7 decode in steps 2..5, position 8 in step 6).
  EXPECT_EQ(preempted_at, 6);
  EXPECT_THAT(kept, ::testing::SizeIs(5));
  // The first re-admission is request 2's (head of the queue, before 3),
  // recomputing its prompt and kept tokens in one chunk.
  const StepRow* resumed = nullptr;
  std::vector<uint64_t> admitted;
  for (const StepPlan& plan : runner.plans) {
    if (plan.step_id <= preempted_at) continue;
    for (const StepRow& row : plan.rows) {
      if (row.start != 0) continue;
      admitted.push_back(row.request_id);
      if (row.request_id == 2 && resumed == nullptr) resumed = &row;
    }
  }
  EXPECT_THAT(admitted, ElementsAre(2, 3));
  ASSERT_NE(resumed, nullptr);
  EXPECT_TRUE(resumed->prefill);
  EXPECT_EQ(resumed->len, 4 + static_cast<int64_t>(kept.size()));
  EXPECT_TRUE(resumed->logits);
  std::vector<FinishedRequest> done = s.take_finished();
  ASSERT_EQ(done.size(), 3u);
  for (const FinishedRequest& f : done) {
    EXPECT_EQ(f.reason, FinishReason::kLength);
    if (f.id == 2) {
      ASSERT_EQ(f.output_tokens.size(), 8u);
      EXPECT_TRUE(std::equal(kept.begin(), kept.end(), f.output_tokens.begin()));
    }
  }
}

TEST(Scheduler, RunningRequestsWaitForFencedPagesInsteadOfPreemptingOthers) {
  // 3 pages of 4 tokens: requests 1, 2 and 3 take one page each for their
  // prompts; 3 is aborted while step 1 still writes its page.
  const SchedulerOptions o = options(64, 8, 4, 3);
  Scheduler s = scheduler_with(o, {{1, 4, 8}, {2, 4, 8}, {3, 4, 8}});
  std::optional<StepPlan> step1 = s.schedule();
  ASSERT_TRUE(step1.has_value());
  ASSERT_EQ(step1->rows.size(), 3u);
  ASSERT_TRUE(s.abort(3).ok());
  EXPECT_EQ(s.snapshot().pages.fenced, 1);
  // Requests 1 and 2 need a page each for position 4: the fenced page covers
  // the first need, so nobody is preempted and no step is ready.
  EXPECT_FALSE(s.schedule().has_value());
  EXPECT_EQ(s.snapshot().preempted_total, 0);
  ASSERT_TRUE(s.on_step_retired(step1->step_id, std::vector<RowResult>(3)).ok());
  // Now request 1 takes the freed page and request 2, the most recently
  // admitted, is preempted; its page was last touched by the retired step 1,
  // so it is free at once.
  std::optional<StepPlan> step2 = s.schedule();
  ASSERT_TRUE(step2.has_value());
  ASSERT_EQ(step2->rows.size(), 1u);
  EXPECT_EQ(step2->rows[0].request_id, 1u);
  EXPECT_EQ(step2->rows[0].start, 4);
  SchedulerSnapshot snap = s.snapshot();
  EXPECT_EQ(snap.preempted_total, 1);
  EXPECT_EQ(snap.waiting, 1);
  EXPECT_EQ(snap.pages.free, 1);
  std::optional<RequestInfo> two = s.find(2);
  ASSERT_TRUE(two.has_value());
  EXPECT_FALSE(two->running);
  EXPECT_EQ(two->output_tokens.size(), 1u);
  EXPECT_TRUE(s.check_invariants().ok());
}

TEST(Scheduler, NeverFittingRequestIsRefusedAtAddWithBothNumbers) {
  const SchedulerOptions o = options(64, 8, 16, 10, /*max_model_len=*/2048);
  Scheduler s = Scheduler::create(o).value();
  absl::Status long_one = s.add({7, 2000, 49});
  EXPECT_EQ(long_one.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(long_one.message(), HasSubstr("request 7 needs prompt_len 2000 + max_tokens 49 "
                                            "positions, more than max_model_len 2048"));
  absl::Status big = s.add({8, 150, 20});
  EXPECT_EQ(big.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(big.message(), HasSubstr("request 8 needs up to 11 KV pages (169 positions of "
                                       "page_size 16), more than the pool's 10 usable pages "
                                       "(10 pages, 0 quarantined)"));
  EXPECT_TRUE(s.add({9, 150, 11}).ok());  // 160 positions: exactly 10 pages
  EXPECT_THAT(s.add({10, 0, 1}).message(), HasSubstr("request 10: prompt_len 0 must be positive"));
  EXPECT_THAT(s.add({9, 1, 1}).message(), HasSubstr("request 9 is already live"));
}

TEST(Scheduler, FullWaitingQueueIsResourceExhausted) {
  const SchedulerOptions o = options(64, 8, 16, 10, 2048, /*max_waiting=*/2);
  Scheduler s = scheduler_with(o, {{1, 4, 4}, {2, 4, 4}});
  absl::Status full = s.add({3, 4, 4});
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(full.message(), HasSubstr("request 3 refused: 2 requests wait, max_waiting 2"));
  ASSERT_TRUE(s.schedule().has_value());  // both admitted
  EXPECT_TRUE(s.add({3, 4, 4}).ok());
}

TEST(Scheduler, IdenticalPromptsNeverShareAPage) {
  const SchedulerOptions o = options(64, 8, 4, 16);
  Scheduler s = Scheduler::create(o).value();
  for (uint64_t id = 1; id <= 4; ++id) ASSERT_TRUE(s.add({id, 6, 4, /*sampling_id=*/5}).ok());
  std::optional<StepPlan> plan = s.schedule();
  ASSERT_TRUE(plan.has_value());
  ASSERT_EQ(plan->rows.size(), 4u);
  expect_well_formed(*plan, o);  // no page or slot in two rows
  for (const StepRow& row : plan->rows) EXPECT_EQ(row.sampling_id, 5u);
  EXPECT_TRUE(s.check_invariants().ok());
}

// 2,000 requests against a pool that forces preemption, at launch depth 2,
// with random stops and aborts: every request finishes, pages never alias or
// leak, the four counts always sum to the pool, and the run ends in a bounded
// number of steps.
struct RandomRunResult {
  int64_t steps = 0;
  int64_t aborts = 0;
  SchedulerSnapshot snapshot;
};

// A prompt of `len` tokens that starts with one of three shared prefixes (so that prefix
// caching finds hits), then random tokens.
std::vector<int32_t> random_prompt(std::mt19937_64& rng, int64_t len) {
  const int32_t prefix = static_cast<int32_t>(rng() % 3);
  std::vector<int32_t> t(len);
  for (int64_t p = 0; p < len; ++p) {
    t[p] = p < 12 ? prefix * 100 + static_cast<int32_t>(p) : static_cast<int32_t>(rng() % 50);
  }
  return t;
}

RandomRunResult run_randomized(const SchedulerOptions& o, int depth, uint64_t seed,
                               std::function<std::optional<StepFailure>(int64_t)> fail) {
  RandomRunResult result;
  Scheduler s = Scheduler::create(o).value();
  std::mt19937_64 rng(seed);
  FakeRunner runner(s, o, depth);
  runner.fail = std::move(fail);
  runner.stop = [&](const StepRow&) { return rng() % 20 == 0; };
  // Every page a plan hands out is used by its row's request: never a fenced
  // or quarantined one; a page another request allocated only from the cache.
  runner.on_plan = [&](const StepPlan& plan) {
    for (const StepRow& row : plan.rows) {
      for (int32_t page : row.block_table) {
        EXPECT_EQ(s.pool().state(page), PageState::kUsed) << "page " << page;
        if (s.pool().owner(page) != row.request_id) {
          EXPECT_TRUE(s.pool().is_cached(page)) << "page " << page;
        }
      }
    }
  };
  std::set<uint64_t> live;
  int64_t added = 0, finished = 0, steps = 0, aborts = 0;
  std::vector<int64_t> seen_finish(2001, 0);
  std::vector<int64_t> prompt_of(2001, 0);
  std::vector<std::vector<int32_t>> prompts(2001);
  runner.token_of = [&](uint64_t id, int64_t p) {
    return p < prompt_of[id] ? prompts[id][p] : static_cast<int32_t>((id * 31 + p) % 1000);
  };
  constexpr int64_t kRequests = 2000;
  // The fake runner's token for a sampling row depends only on the request
  // and how many tokens it knows, so output k of request id is
  // (id·31 + prompt + k) mod 1000 — across preemption and recompute too. A
  // stale sample accepted, or a sample lost or duplicated, breaks the sequence.
  auto check_outputs = [&](const FinishedRequest& f) {
    for (size_t k = 0; k < f.output_tokens.size(); ++k) {
      const int64_t want =
          (static_cast<int64_t>(f.id) * 31 + prompt_of[f.id] + static_cast<int64_t>(k)) % 1000;
      if (f.output_tokens[k] != want) {
        ADD_FAILURE() << "request " << f.id << " output " << k << " is " << f.output_tokens[k]
                      << ", expected " << want;
        return;
      }
    }
  };
  for (;;) {
    // Arrivals: a few per step while the queue has room.
    for (int k = 0; k < 3 && added < kRequests; ++k) {
      const uint64_t id = static_cast<uint64_t>(added + 1);
      const int64_t prompt = 1 + static_cast<int64_t>(rng() % 32);
      const int64_t out = 1 + static_cast<int64_t>(rng() % 16);
      prompts[id] = random_prompt(rng, prompt);
      absl::Status st = s.add({id, prompt, out, 0, prompts[id]});
      if (st.code() == absl::StatusCode::kResourceExhausted) break;
      EXPECT_TRUE(st.ok()) << st;
      if (!st.ok()) return result;
      live.insert(id);
      prompt_of[id] = prompt;
      ++added;
    }
    if (!live.empty() && rng() % 10 == 0) {
      auto it = live.begin();
      std::advance(it, static_cast<int64_t>(rng() % live.size()));
      EXPECT_TRUE(s.abort(*it).ok());
      ++aborts;
    }
    const bool active = runner.step();
    ++steps;
    if (steps > 10 * kRequests) {
      ADD_FAILURE() << "livelock: " << steps << " steps";
      return result;
    }
    const absl::Status inv = s.check_invariants();
    if (!inv.ok()) {
      ADD_FAILURE() << inv << " at step " << steps;
      return result;
    }
    const SchedulerSnapshot snap = s.snapshot();
    EXPECT_EQ(snap.pages.total(), o.num_pages);
    EXPECT_LE(snap.steps_in_flight, depth);
    for (const FinishedRequest& f : s.take_finished()) {
      EXPECT_EQ(live.erase(f.id), 1u) << "request " << f.id << " finished twice";
      ++seen_finish[f.id];
      ++finished;
      check_outputs(f);
      if (f.reason == FinishReason::kLength || f.reason == FinishReason::kStop) {
        EXPECT_FALSE(f.output_tokens.empty());
      }
    }
    if (!active) {
      const SchedulerSnapshot idle = s.snapshot();
      for (uint64_t id : live) {
        std::optional<RequestInfo> info = s.find(id);
        if (info && info->running) {
          ADD_FAILURE() << "running " << id << " prompt " << info->prompt_len << " scheduled "
                        << info->num_scheduled << " outputs " << info->output_tokens.size()
                        << " pages " << info->pages.size() << " max " << info->max_tokens
                        << " pending " << info->pending_samples << " prefilled " << info->prefilled;
        }
      }
      EXPECT_TRUE(live.empty()) << live.size() << " live requests but no step at step " << steps
                                << ": waiting " << idle.waiting << " running " << idle.running
                                << " free " << idle.pages.free << " used " << idle.pages.used
                                << " fenced " << idle.pages.fenced;
      if (!live.empty() || added == kRequests) break;
    }
  }
  while (!runner.flight().empty()) runner.retire_oldest();
  for (const FinishedRequest& f : s.take_finished()) {
    live.erase(f.id);
    ++seen_finish[f.id];
    ++finished;
    check_outputs(f);
  }
  EXPECT_TRUE(live.empty());
  EXPECT_EQ(finished, kRequests);
  for (int64_t id = 1; id <= kRequests; ++id) EXPECT_EQ(seen_finish[id], 1) << "request " << id;
  EXPECT_EQ(s.snapshot().waiting + s.snapshot().running, 0);
  EXPECT_TRUE(s.check_invariants().ok());
  int64_t by_reason = 0;
  for (int64_t n : s.snapshot().finished) by_reason += n;
  EXPECT_EQ(by_reason, kRequests);
  result.steps = steps;
  result.aborts = aborts;
  result.snapshot = s.snapshot();
  return result;
}

TEST(Scheduler, RandomizedRequestsAtDepthTwoAllFinishWithoutLeaksOrAliasing) {
  const SchedulerOptions o = options(/*budget=*/48, /*max_seqs=*/16, /*page_size=*/4,
                                     /*num_pages=*/24, 4096, /*max_waiting=*/64);
  for (uint64_t seed : {20261201u, 7u, 99u}) {
    const RandomRunResult r =
        run_randomized(o, /*depth=*/2, seed, [](int64_t) { return std::optional<StepFailure>(); });
    EXPECT_GT(r.snapshot.preempted_total, 0) << "the pool should force preemption";
    EXPECT_GT(r.aborts, 0);
    EXPECT_EQ(r.snapshot.pages.free, o.num_pages) << "pages leaked";
    EXPECT_EQ(r.snapshot.finished[static_cast<int>(FinishReason::kError)], 0);
    RecordProperty("steps_seed_" + std::to_string(seed), static_cast<int>(r.steps));
    RecordProperty("preempted_seed_" + std::to_string(seed),
                   static_cast<int>(r.snapshot.preempted_total));
  }
}

// The same at depth 3 with some steps failing: recoverable failures free their
// pages behind the fence, timed-out ones quarantine theirs for good; every
// request still finishes and every page is free or quarantined at the end.
TEST(Scheduler, RandomizedRequestsWithFailingStepsQuarantineButNeverLeak) {
  const SchedulerOptions o = options(/*budget=*/48, /*max_seqs=*/16, /*page_size=*/4,
                                     /*num_pages=*/96, 4096, /*max_waiting=*/64);
  const RandomRunResult r = run_randomized(o, /*depth=*/3, 5, [](int64_t step_id) {
    if (step_id % 997 == 0 && step_id < 3000) return std::optional(StepFailure::kUnrecoverable);
    if (step_id % 101 == 0) return std::optional(StepFailure::kRecoverable);
    return std::optional<StepFailure>();
  });
  EXPECT_GT(r.snapshot.pages.quarantined, 0);
  EXPECT_EQ(r.snapshot.pages.free + r.snapshot.pages.quarantined, o.num_pages) << "pages leaked";
  EXPECT_GT(r.snapshot.finished[static_cast<int>(FinishReason::kError)], 0);
}

// The two randomized runs with prefix caching on: the fake KV cache checks that every row reads
// its own tokens at every earlier position, shared pages included, and that no row ever writes a
// cached page; pages still never leak.
TEST(SchedulerPrefixCache, RandomizedRequestsShareProvenPagesWithoutLeaksOrWrongReads) {
  SchedulerOptions o = options(/*budget=*/48, /*max_seqs=*/16, /*page_size=*/4,
                               /*num_pages=*/24, 4096, /*max_waiting=*/64);
  o.enable_prefix_caching = true;
  for (uint64_t seed : {20261205u, 11u}) {
    const RandomRunResult r =
        run_randomized(o, /*depth=*/2, seed, [](int64_t) { return std::optional<StepFailure>(); });
    EXPECT_GT(r.snapshot.preempted_total, 0) << "the pool should force preemption";
    EXPECT_GT(r.snapshot.prefix_cache_hits, 0);
    EXPECT_LT(r.snapshot.prefix_cache_hits, r.snapshot.prefix_cache_queries);
    EXPECT_EQ(r.snapshot.pages.free, o.num_pages) << "pages leaked";
    EXPECT_EQ(r.snapshot.finished[static_cast<int>(FinishReason::kError)], 0);
  }
}

TEST(SchedulerPrefixCache, RandomizedFailingStepsNeverLeakGarbageIntoTheCache) {
  SchedulerOptions o = options(/*budget=*/48, /*max_seqs=*/16, /*page_size=*/4,
                               /*num_pages=*/96, 4096, /*max_waiting=*/64);
  o.enable_prefix_caching = true;
  for (int depth : {1, 2, 4}) {
    const RandomRunResult r = run_randomized(o, depth, 5 + depth, [](int64_t step_id) {
      if (step_id == 500) return std::optional(StepFailure::kUnrecoverable);
      if (step_id % 37 == 0) return std::optional(StepFailure::kRecoverable);
      return std::optional<StepFailure>();
    });
    EXPECT_GT(r.snapshot.prefix_cache_hits, 0) << "depth " << depth;
    EXPECT_GT(r.snapshot.pages.quarantined, 0) << "depth " << depth;
    EXPECT_EQ(r.snapshot.pages.free + r.snapshot.pages.quarantined, o.num_pages)
        << "pages leaked at depth " << depth;
  }
}

SchedulerOptions caching_options(int32_t budget = 64, int32_t num_pages = 16) {
  SchedulerOptions o = options(budget, /*max_seqs=*/8, /*page_size=*/4, num_pages);
  o.enable_prefix_caching = true;
  return o;
}

std::vector<int32_t> iota_tokens(int64_t len, int32_t first = 100) {
  std::vector<int32_t> t(len);
  for (int64_t i = 0; i < len; ++i) t[i] = first + static_cast<int32_t>(i);
  return t;
}

// Runs request `id` alone to its end (one output token).
void run_alone(Scheduler& s, const SchedulerOptions& o, uint64_t id, std::vector<int32_t> prompt) {
  const int64_t len = static_cast<int64_t>(prompt.size());
  ASSERT_TRUE(s.add({id, len, 1, 0, std::move(prompt)}).ok());
  FakeRunner runner(s, o, 1);
  runner.run_to_idle(100);
  ASSERT_EQ(s.take_finished().size(), 1u);
}

TEST(SchedulerPrefixCache, ALaterPromptPrefillsOnlyWhatFollowsItsCachedFullPages) {
  const SchedulerOptions o = caching_options();
  Scheduler s = Scheduler::create(o).value();
  run_alone(s, o, 1, iota_tokens(10));  // pages [0, 4) and [4, 8) are full and cached
  EXPECT_EQ(s.snapshot().cached_pages, 2);
  std::vector<int32_t> turn2 = iota_tokens(8);
  for (int32_t t : {7, 7, 7, 7, 7}) turn2.push_back(t);  // 13 tokens: 8 cached, then 5 new
  ASSERT_TRUE(s.add({2, 13, 3, 0, turn2}).ok());
  std::optional<StepPlan> plan = s.schedule();
  ASSERT_TRUE(plan.has_value());
  ASSERT_EQ(plan->rows.size(), 1u);
  EXPECT_EQ(plan->rows[0].start, 8);
  EXPECT_EQ(plan->rows[0].len, 5);
  EXPECT_TRUE(plan->rows[0].logits);
  EXPECT_EQ(s.find(2)->cached_tokens, 8);
  const SchedulerSnapshot snap = s.snapshot();
  EXPECT_EQ(snap.prefix_cache_queries, 10 + 13);
  EXPECT_EQ(snap.prefix_cache_hits, 8);
  EXPECT_TRUE(s.check_invariants().ok());
}

TEST(SchedulerPrefixCache, AWhollyCachedPromptStillComputesItsLastPositionInItsOwnPage) {
  const SchedulerOptions o = caching_options();
  Scheduler s = Scheduler::create(o).value();
  run_alone(s, o, 1, iota_tokens(8));
  ASSERT_TRUE(s.add({2, 8, 2, 0, iota_tokens(8)}).ok());
  std::optional<StepPlan> plan = s.schedule();
  ASSERT_TRUE(plan.has_value());
  const StepRow& row = plan->rows.at(0);
  EXPECT_EQ(row.start, 4);  // one page hit: the last page is computed again, privately
  EXPECT_EQ(row.len, 4);
  EXPECT_FALSE(s.pool().is_cached(row.block_table[1]));
  EXPECT_TRUE(s.pool().is_cached(row.block_table[0]));
  EXPECT_EQ(s.find(2)->cached_tokens, 4);
}

TEST(SchedulerPrefixCache, ClonesOfOnePromptWaitForTheFirstsPagesInsteadOfComputingThem) {
  const SchedulerOptions o = caching_options();
  Scheduler s = Scheduler::create(o).value();
  for (uint64_t id = 1; id <= 3; ++id) ASSERT_TRUE(s.add({id, 10, 4, 0, iota_tokens(10)}).ok());
  std::optional<StepPlan> first = s.schedule();
  ASSERT_TRUE(first.has_value());
  ASSERT_EQ(first->rows.size(), 1u) << "the clones wait for the first one's prompt pages";
  ASSERT_TRUE(s.on_step_retired(first->step_id, {RowResult{5, false}}).ok());
  std::optional<StepPlan> second = s.schedule();
  ASSERT_TRUE(second.has_value());
  ASSERT_EQ(second->rows.size(), 3u);
  EXPECT_EQ(second->rows[0].request_id, 1u);  // its decode
  for (size_t k = 1; k < 3; ++k) {
    EXPECT_EQ(second->rows[k].start, 8);
    EXPECT_EQ(second->rows[k].len, 2);
    EXPECT_EQ(second->rows[k].block_table[0], first->rows[0].block_table[0]);
    EXPECT_EQ(second->rows[k].block_table[1], first->rows[0].block_table[1]);
  }
  EXPECT_EQ(s.pool().refs(first->rows[0].block_table[0]), 3);
  expect_well_formed(*second, o, &s.pool());
  EXPECT_TRUE(s.check_invariants().ok());
}

TEST(SchedulerPrefixCache, PagesOfAFailedStepAreNeverCached) {
  const SchedulerOptions o = caching_options();
  Scheduler s = Scheduler::create(o).value();
  ASSERT_TRUE(s.add({1, 10, 4, 0, iota_tokens(10)}).ok());
  std::optional<StepPlan> plan = s.schedule();
  ASSERT_TRUE(s.on_step_failed(plan->step_id, StepFailure::kRecoverable).ok());
  EXPECT_EQ(s.snapshot().cached_pages, 0);
  ASSERT_TRUE(s.add({2, 10, 4, 0, iota_tokens(10)}).ok());
  std::optional<StepPlan> again = s.schedule();
  ASSERT_TRUE(again.has_value());
  EXPECT_EQ(again->rows.at(0).start, 0);
  EXPECT_EQ(s.find(2)->cached_tokens, 0);
}

TEST(SchedulerPrefixCache, ATimedOutStepQuarantinesSharedPagesAndTheyLeaveTheCache) {
  const SchedulerOptions o = caching_options();
  Scheduler s = Scheduler::create(o).value();
  run_alone(s, o, 1, iota_tokens(9));
  ASSERT_EQ(s.snapshot().cached_pages, 2);
  ASSERT_TRUE(s.add({2, 9, 4, 0, iota_tokens(9)}).ok());
  std::optional<StepPlan> plan = s.schedule();
  ASSERT_EQ(plan->rows.at(0).start, 8);
  ASSERT_TRUE(s.on_step_failed(plan->step_id, StepFailure::kUnrecoverable).ok());
  EXPECT_EQ(s.snapshot().cached_pages, 0);
  EXPECT_EQ(s.snapshot().pages.quarantined, 3);
  ASSERT_TRUE(s.add({3, 9, 4, 0, iota_tokens(9)}).ok());
  EXPECT_EQ(s.schedule()->rows.at(0).start, 0);
  EXPECT_TRUE(s.check_invariants().ok());
}

TEST(SchedulerPrefixCache, ResetDropsEveryEntryAndCachingOffNeverShares) {
  const SchedulerOptions o = caching_options();
  Scheduler s = Scheduler::create(o).value();
  run_alone(s, o, 1, iota_tokens(9));
  EXPECT_EQ(s.reset_prefix_cache(), 2);
  ASSERT_TRUE(s.add({2, 9, 4, 0, iota_tokens(9)}).ok());
  EXPECT_EQ(s.schedule()->rows.at(0).start, 0);

  SchedulerOptions off = o;
  off.enable_prefix_caching = false;
  Scheduler t = Scheduler::create(off).value();
  run_alone(t, off, 1, iota_tokens(9));
  EXPECT_EQ(t.snapshot().cached_pages, 0);
  ASSERT_TRUE(t.add({2, 9, 4, 0, iota_tokens(9)}).ok());
  EXPECT_EQ(t.schedule()->rows.at(0).start, 0);
  EXPECT_EQ(t.snapshot().prefix_cache_queries, 0);
}

TEST(SchedulerPrefixCache, PromptTokensMustMatchPromptLen) {
  Scheduler s = Scheduler::create(caching_options()).value();
  const absl::Status st = s.add({1, 5, 4, 0, iota_tokens(4)});
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("request 1: 4 prompt tokens given for prompt_len 5"));
}

}  // namespace
}  // namespace simpler::llm

namespace simpler::llm {
namespace {

// One request's prefill rows, step by step.
struct PromptLogitRows {
  std::vector<std::pair<int64_t, int64_t>> chunks;  // (start, len) of its prefill rows
  std::vector<int64_t> prompt_logits;               // per prefill row
};

// A prompt-logits request's prefill chunks fit the rows its positions take (max_num_seqs - 1
// positions with logits, then the rest up to the last prompt position); every prompt position
// but the last is marked once, and its decode rows mark none.
TEST(SchedulerTest, PromptLogitsTakeARowEachAndAreMarkedOnlyUntilTheFirstToken) {
  const SchedulerOptions o = options(64, 4, 4, 64);
  SchedulerRequest want(1, 10, 3);
  want.prompt_logits = true;
  Scheduler s = scheduler_with(o, {want});
  PromptLogitRows seen;
  std::set<int64_t> marked;
  for (int step = 0; step < 3; ++step) {
    std::optional<StepPlan> plan = s.schedule();
    ASSERT_TRUE(plan.has_value());
    ASSERT_EQ(plan->rows.size(), 1u);
    const StepRow& row = plan->rows[0];
    seen.chunks.emplace_back(row.start, row.len);
    seen.prompt_logits.push_back(row.prompt_logits);
    for (int64_t k = 0; k < row.prompt_logits; ++k) {
      EXPECT_TRUE(marked.insert(row.start + k).second) << "position " << row.start + k;
    }
    ASSERT_TRUE(s.on_step_retired(plan->step_id, {RowResult{7, false}}).ok());
  }
  EXPECT_EQ(seen.chunks, (std::vector<std::pair<int64_t, int64_t>>{{0, 3}, {3, 3}, {6, 4}}));
  EXPECT_EQ(seen.prompt_logits, (std::vector<int64_t>{3, 3, 3}));
  EXPECT_EQ(marked.size(), 9u);
  // Decoding now: no more prompt logits.
  std::optional<StepPlan> decode = s.schedule();
  ASSERT_TRUE(decode.has_value());
  EXPECT_EQ(decode->rows[0].prompt_logits, 0);
  EXPECT_FALSE(decode->rows[0].prefill);
  ASSERT_TRUE(s.on_step_retired(decode->step_id, {RowResult{8, false}}).ok());

  // Refused where no step could hold a prompt position's logits beside its own row.
  Scheduler one = Scheduler::create(options(64, 1, 4, 64)).value();
  EXPECT_EQ(one.add(want),
            absl::InvalidArgumentError(
                "request 1: prompt logits need max_num_seqs >= 2 (a prompt position's logits take "
                "a row of the step besides its own), got 1"));
}

// Beside a decoding request, a prompt-logits chunk takes the rows left: two requests and
// max_num_seqs 3 leave it 2 rows, one position with logits a step (the last chunk also takes the
// last prompt position, which needs none).
TEST(SchedulerTest, PromptLogitsChunksShrinkToTheRowsTheDecodesLeave) {
  const SchedulerOptions o = options(64, 3, 4, 64);
  SchedulerRequest want(2, 5, 2);
  want.prompt_logits = true;
  Scheduler s = scheduler_with(o, {SchedulerRequest(1, 2, 10), want});
  std::vector<std::pair<int64_t, int64_t>> chunks;
  for (int step = 0; step < 6 && chunks.size() < 4; ++step) {
    std::optional<StepPlan> plan = s.schedule();
    ASSERT_TRUE(plan.has_value());
    int64_t rows = 0;
    std::vector<RowResult> results(plan->rows.size(), RowResult{5, false});
    for (const StepRow& row : plan->rows) {
      rows += 1 + row.prompt_logits;
      if (row.request_id == 2 && row.prefill) chunks.emplace_back(row.start, row.prompt_logits);
    }
    EXPECT_LE(rows, o.max_num_seqs) << "step " << plan->step_id;
    ASSERT_TRUE(s.on_step_retired(plan->step_id, results).ok());
  }
  // Step 1 admits both (request 1's prefill takes 1 row, leaving 2); then request 1 decodes.
  EXPECT_EQ(chunks, (std::vector<std::pair<int64_t, int64_t>>{{0, 1}, {1, 1}, {2, 1}, {3, 1}}));
}

}  // namespace
}  // namespace simpler::llm
