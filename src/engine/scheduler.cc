#include "engine/scheduler.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "simpler/base/status.h"

namespace simpler::llm {
namespace {

// A broken internal invariant: a program bug, not a request error.
void check_or_die(const absl::Status& status, const char* what) {
  if (status.ok()) return;
  std::fprintf(stderr, "simpler: scheduler %s: %s\n", what, status.ToString().c_str());
  std::abort();
}

}  // namespace

int64_t StepPlan::num_tokens() const {
  int64_t n = 0;
  for (const StepRow& row : rows) n += row.len;
  return n;
}

absl::StatusOr<Scheduler> Scheduler::create(const SchedulerOptions& options) {
  SIMPLER_RETURN_IF_ERROR(base::require_positive({
      {"max_num_batched_tokens", options.max_num_batched_tokens},
      {"max_num_seqs", options.max_num_seqs},
      {"max_waiting", options.max_waiting},
      {"page_size", options.page_size},
      {"max_model_len", options.max_model_len},
  }));
  auto pool = PagePool::create(options.num_pages, options.page_size);
  if (!pool.ok()) return pool.status();
  Scheduler s(options, *std::move(pool));
  for (int32_t slot = options.max_num_seqs - 1; slot >= 0; --slot) {
    s.free_state_slots_.push_back(slot);  // slot 0 is handed out first
  }
  return s;
}

int64_t Scheduler::known_tokens(const Request& r) const {
  return r.spec.prompt_len + static_cast<int64_t>(r.outputs.size());
}

int64_t Scheduler::max_pages(const Request& r) const {
  // The last sampled token is never written to the KV cache.
  return pages_needed(r.spec.prompt_len + r.spec.max_tokens - 1, options_.page_size);
}

// Once prefilled, context_len() == known_tokens() + pending - 1: the one
// position not yet written holds the token the latest step samples.
bool Scheduler::decode_ready(const Request& r) const {
  return r.prefilled && static_cast<int64_t>(r.outputs.size()) + r.pending < r.spec.max_tokens &&
         !(r.spec.host_feedback && r.pending > 0);
}

bool Scheduler::has_work(const Request& r) const { return !r.prefilled || decode_ready(r); }

absl::Status Scheduler::add(const SchedulerRequest& spec) {
  if (requests_.count(spec.id) != 0) {
    return absl::AlreadyExistsError(absl::StrCat("request ", spec.id, " is already live"));
  }
  // A finished request's rows may still be in flight: its id is reusable only
  // once they retired (rows are matched to requests by id and incarnation).
  for (const InFlightStep& step : in_flight_) {
    for (const RowRecord& row : step.rows) {
      if (row.id == spec.id) {
        return absl::FailedPreconditionError(
            absl::StrCat("request id ", spec.id, " is still used by step ", step.step_id,
                         ", which has not retired; reuse the id after it retires"));
      }
    }
  }
  if (spec.prompt_len <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("request ", spec.id, ": prompt_len ", spec.prompt_len, " must be positive"));
  }
  if (spec.max_tokens <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("request ", spec.id, ": max_tokens ", spec.max_tokens, " must be positive"));
  }
  if (spec.prompt_logits && options_.max_num_seqs < 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("request ", spec.id,
                     ": prompt logits need max_num_seqs >= 2 (a prompt position's logits "
                     "take a row of the step besides its own), got ",
                     options_.max_num_seqs));
  }
  if (!spec.prompt.empty() && static_cast<int64_t>(spec.prompt.size()) != spec.prompt_len) {
    return absl::InvalidArgumentError(absl::StrCat("request ", spec.id, ": ", spec.prompt.size(),
                                                   " prompt tokens given for prompt_len ",
                                                   spec.prompt_len));
  }
  if (spec.prompt_len > options_.max_model_len ||
      spec.max_tokens > options_.max_model_len - spec.prompt_len) {
    return absl::InvalidArgumentError(absl::StrCat(
        "request ", spec.id, " needs prompt_len ", spec.prompt_len, " + max_tokens ",
        spec.max_tokens, " positions, more than max_model_len ", options_.max_model_len));
  }
  const int64_t positions = spec.prompt_len + spec.max_tokens - 1;
  const int64_t pages = pages_needed(positions, options_.page_size);
  const int64_t usable = options_.num_pages - pool_.num_quarantined();
  if (pages > usable) {
    return absl::InvalidArgumentError(
        absl::StrCat("request ", spec.id, " needs up to ", pages, " KV pages (", positions,
                     " positions of page_size ", options_.page_size, "), more than the pool's ",
                     usable, " usable pages (", options_.num_pages, " pages, ",
                     pool_.num_quarantined(), " quarantined)"));
  }
  if (static_cast<int64_t>(waiting_.size()) >= options_.max_waiting) {
    return absl::ResourceExhaustedError(
        absl::StrCat("request ", spec.id, " refused: ", waiting_.size(),
                     " requests wait, max_waiting ", options_.max_waiting));
  }
  requests_.emplace(spec.id, Request(spec));
  waiting_.push_back(spec.id);
  return absl::OkStatus();
}

absl::Status Scheduler::abort(uint64_t id) {
  if (requests_.count(id) == 0) {
    return absl::NotFoundError(absl::StrCat("abort of request ", id, ", which is not live"));
  }
  finish(id, FinishReason::kAbort);
  return absl::OkStatus();
}

absl::Status Scheduler::fail(uint64_t id, absl::Status error) {
  if (requests_.count(id) == 0) {
    return absl::NotFoundError(absl::StrCat("fail of request ", id, ", which is not live"));
  }
  finish(id, FinishReason::kError,
         error.ok() ? absl::UnknownError(absl::StrCat("request ", id, " failed")) : error);
  return absl::OkStatus();
}

std::vector<uint64_t> Scheduler::live_ids() const {
  std::vector<uint64_t> ids;
  ids.reserve(requests_.size());
  for (const auto& [id, r] : requests_) ids.push_back(id);
  return ids;
}

absl::Status Scheduler::quarantine_error(const Request& r) const {
  return absl::ResourceExhaustedError(
      absl::StrCat("request ", r.spec.id, " needs up to ", max_pages(r),
                   " KV pages, but quarantine left ", pool_.num_pages() - pool_.num_quarantined(),
                   " of the pool's ", pool_.num_pages(), " pages usable"));
}

absl::Status Scheduler::stop(uint64_t id, int64_t keep_tokens) {
  auto it = requests_.find(id);
  if (it == requests_.end()) {
    return absl::NotFoundError(absl::StrCat("stop of request ", id, ", which is not live"));
  }
  std::vector<int32_t>& outputs = it->second.outputs;
  if (keep_tokens < 0 || keep_tokens > static_cast<int64_t>(outputs.size())) {
    return absl::InvalidArgumentError(absl::StrCat("stop of request ", id, ": keep_tokens ",
                                                   keep_tokens, " outside [0, ", outputs.size(),
                                                   "] (its retired tokens)"));
  }
  outputs.resize(keep_tokens);
  finish(id, FinishReason::kStop);
  return absl::OkStatus();
}

void Scheduler::release_state_slot(Request& r) {
  if (r.state_slot < 0) return;
  if (r.last_step <= pool_.retired_through()) {
    free_state_slots_.push_back(r.state_slot);
  } else {
    fenced_state_slots_.emplace_back(r.state_slot, r.last_step);
  }
  r.state_slot = -1;
}

void Scheduler::finish(uint64_t id, FinishReason reason, absl::Status error) {
  auto it = requests_.find(id);
  Request& r = it->second;
  check_or_die(r.table.fence(pool_, r.last_step), "fencing a finished request's pages");
  release_state_slot(r);
  if (r.running) {
    running_.erase(std::find(running_.begin(), running_.end(), id));
  } else {
    waiting_.erase(std::find(waiting_.begin(), waiting_.end(), id));
  }
  finished_.push_back(FinishedRequest{id, reason, std::move(r.outputs), std::move(error),
                                      std::max<int64_t>(r.cached_tokens, 0)});
  ++finished_count_[static_cast<int>(reason)];
  requests_.erase(it);
}

void Scheduler::preempt(uint64_t id) {
  Request& r = requests_.at(id);
  check_or_die(r.table.fence(pool_, r.last_step), "fencing a preempted request's pages");
  release_state_slot(r);
  r.table = BlockTable(id);
  r.registered = 0;
  r.registering = true;
  r.pending = 0;
  r.prefilled = false;
  ++r.incarnation;
  ++r.num_preemptions;
  r.running = false;
  running_.erase(std::find(running_.begin(), running_.end(), id));
  waiting_.push_front(id);
  ++preempted_total_;
}

int64_t Scheduler::logit_room(const Request& r, int64_t len, int64_t rows) const {
  if (!r.spec.prompt_logits || !r.outputs.empty() || r.prefilled) return len;
  // Positions below `last` want logits; a chunk reaching `last` needs none for it.
  const int64_t start = r.table.context_len(), last = r.spec.prompt_len - 1;
  if (last - start <= rows - 1) return len;
  return std::min(len, std::max<int64_t>(rows - 1, 0));
}

int64_t Scheduler::add_row(StepPlan& plan, InFlightStep& record, Request& r, int64_t len) {
  StepRow row;
  row.request_id = r.spec.id;
  row.sampling_id = r.spec.sampling_id;
  row.start = r.table.context_len();
  row.len = len;
  row.prefill = !r.prefilled;
  if (row.prefill && r.spec.prompt_logits && r.outputs.empty()) {
    row.prompt_logits =
        std::max<int64_t>(std::min(row.start + len, r.spec.prompt_len - 1) - row.start, 0);
  }
  const int64_t rows = 1 + row.prompt_logits;
  row.logits = !row.prefill || row.start + len == known_tokens(r);
  if (row.logits) r.prefilled = true;
  check_or_die(r.table.append_tokens(pool_, len), "allocating pages checked free");
  row.slots.reserve(len);
  for (int64_t p = row.start; p < row.start + len; ++p) {
    row.slots.push_back(r.table.slot_of(p, options_.page_size).value());
  }
  row.block_table = r.table.pages();
  row.state_slot = r.state_slot;
  row.fresh_state = r.fresh_state;
  r.fresh_state = false;
  if (row.logits) ++r.pending;
  r.last_step = plan.step_id;
  record.rows.push_back(
      RowRecord{r.spec.id, r.incarnation, row.logits, row.start + len, row.block_table});
  plan.rows.push_back(std::move(row));
  return rows;
}

int64_t Scheduler::available_pages() const { return pool_.num_free() + pool_.num_fenced(); }

int64_t Scheduler::free_room(const Request& r) const {
  return (static_cast<int64_t>(r.table.pages().size()) + pool_.num_free()) * options_.page_size -
         r.table.context_len();
}

// The victim is the most recently admitted request behind running_[i] that still has work
// left: one whose every token is sampled or in flight finishes at the next retire anyway, and
// preempting it would only discard its last sample and recompute it.
std::optional<uint64_t> Scheduler::victim_behind(size_t i) const {
  for (size_t j = running_.size(); j-- > i + 1;) {
    const Request& v = requests_.at(running_[j]);
    if (static_cast<int64_t>(v.outputs.size()) + v.pending < v.spec.max_tokens) {
      return running_[j];
    }
  }
  return std::nullopt;
}

// Preempt only while the pages coming free behind the fence do not cover the need: preempting
// more would not make this step any faster.
void Scheduler::preempt_behind(StepBuild& b, size_t i, int64_t need) {
  while (need > available_pages()) {
    const std::optional<uint64_t> victim = victim_behind(i);
    if (!victim.has_value()) break;
    if (decode_ready(requests_.at(*victim))) --b.later_decodes;
    preempt(*victim);
    b.preempted = true;
  }
}

bool Scheduler::schedule_running(StepBuild& b, size_t i) {
  const uint64_t id = running_[i];
  Request& r = requests_.at(id);
  const bool decode = decode_ready(r);
  if (decode) --b.later_decodes;
  if (!has_work(r)) return true;
  int64_t len = 1;
  if (!decode) {
    if (b.rows_left <= b.later_decodes || b.budget <= b.later_decodes) return true;
    len = std::min(known_tokens(r) - r.table.context_len(), b.budget - b.later_decodes);
    len = logit_room(r, len, b.rows_left - b.later_decodes);
    if (len < 1) return true;
  }
  int64_t need = r.table.pages_for_append(len, options_.page_size);
  if (!decode && need > available_pages()) {
    // A prefill chunk first shrinks to what the free pages hold: preempting
    // (and recomputing) someone is worth it only when not one more token fits.
    const int64_t room = free_room(r);
    if (room >= 1) {
      len = std::min(len, room);
      need = r.table.pages_for_append(len, options_.page_size);
    }
  }
  preempt_behind(b, i, need);
  if (need > available_pages()) {
    // Only requests with no work left are behind `id`: their samples are in
    // flight, so their pages come back (fenced, then free) at the next retires.
    if (running_.back() != id) return true;
    // `id` is the most recently admitted request now (running_.back()).
    if (max_pages(r) > pool_.num_pages() - pool_.num_quarantined()) {
      finish(id, FinishReason::kError, quarantine_error(r));  // the pool shrank below it
    } else {
      preempt(id);
      b.preempted = true;
    }
    return false;
  }
  if (need > pool_.num_free()) {
    // Wait for the fence; a prefill chunk takes what the free pages hold.
    const int64_t room = free_room(r);
    if (decode || room < 1) return true;
    len = std::min(len, room);
  }
  b.rows_left -= decode ? add_row(b.decodes, b.decode_rec, r, len)
                        : add_row(b.prefills, b.prefill_rec, r, len);
  b.budget -= len;
  return true;
}

// FCFS admission: the head of the waiting queue blocks the ones behind it.
// Running requests are capped by max_num_seqs as well (vLLM's
// max_num_running_reqs): per-request device state is sized by it, and a
// request waiting for its last sample or for fenced pages takes no row.
void Scheduler::admit_waiting(StepBuild& b) {
  while (!b.preempted && !waiting_.empty() && b.rows_left > 0 && b.budget > 0 &&
         static_cast<int64_t>(running_.size()) < options_.max_num_seqs &&
         !free_state_slots_.empty()) {
    const uint64_t id = waiting_.front();
    Request& r = requests_.at(id);
    if (max_pages(r) > pool_.num_pages() - pool_.num_quarantined()) {
      finish(id, FinishReason::kError, quarantine_error(r));
      continue;
    }
    if (!admit_front(b)) break;
  }
}

bool Scheduler::admit_front(StepBuild& b) {
  const uint64_t id = waiting_.front();
  Request& r = requests_.at(id);
  const std::vector<int32_t> hits = cached_prefix(r);
  // Another request's step in flight computes r's next page: take it from the cache once that
  // step retired instead of computing it again (n choices of one prompt).
  if (prefix_in_flight(r, hits)) return false;
  const int64_t cached = static_cast<int64_t>(hits.size()) * options_.page_size;
  const int64_t len = logit_room(r, std::min(known_tokens(r) - cached, b.budget), b.rows_left);
  if (len < 1) return false;
  // Hit pages that are free (evictable) leave the free list when shared.
  const int64_t free_hits = std::count_if(
      hits.begin(), hits.end(), [&](int32_t p) { return pool_.state(p) == PageState::kFree; });
  const int64_t need = pages_needed(cached + len, options_.page_size) -
                       static_cast<int64_t>(hits.size()) + free_hits;
  if (need > pool_.num_free()) return false;
  waiting_.pop_front();
  for (int32_t page : hits) check_or_die(pool_.share(id, page), "sharing a cached page");
  check_or_die(r.table.adopt_cached(hits, options_.page_size), "adopting cached pages");
  r.registered = static_cast<int64_t>(hits.size());
  r.registering = true;
  if (caches(r)) {
    prefix_cache_queries_ += known_tokens(r);
    prefix_cache_hits_ += cached;
  }
  if (r.cached_tokens < 0) r.cached_tokens = cached;
  r.running = true;
  r.admitted_seq = next_admitted_seq_++;
  r.state_slot = free_state_slots_.back();
  free_state_slots_.pop_back();
  r.fresh_state = true;
  running_.push_back(id);
  b.rows_left -= add_row(b.prefills, b.prefill_rec, r, len);
  b.budget -= len;
  return true;
}

// ---- prefix caching (docs/design/prefix_cache.md) ------------------------------------------

bool Scheduler::caches(const Request& r) const {
  return options_.enable_prefix_caching && !r.spec.prompt.empty();
}

int32_t Scheduler::token_at(const Request& r, int64_t position) const {
  return position < r.spec.prompt_len ? r.spec.prompt[position]
                                      : r.outputs[position - r.spec.prompt_len];
}

std::vector<int32_t> Scheduler::page_tokens(const Request& r, int64_t page) const {
  std::vector<int32_t> tokens(options_.page_size);
  for (int64_t i = 0; i < options_.page_size; ++i) {
    tokens[i] = token_at(r, page * options_.page_size + i);
  }
  return tokens;
}

// The longest chain of cached pages that starts r's known tokens, leaving at least its last
// token to compute (for its logits).
std::vector<int32_t> Scheduler::cached_prefix(const Request& r) const {
  std::vector<int32_t> pages;
  if (!caches(r) || r.spec.prompt_logits) return pages;
  const int64_t max_hits = (known_tokens(r) - 1) / options_.page_size;
  int32_t parent = -1;
  for (int64_t j = 0; j < max_hits; ++j) {
    const std::optional<int32_t> page = pool_.lookup(parent, page_tokens(r, j));
    if (!page.has_value()) break;
    pages.push_back(*page);
    parent = *page;
  }
  return pages;
}

// Whether a running request writes r's next page (after `hits`) in a step in flight, with the
// same tokens after the same cached chain, and will enter it in the cache when that step
// retires.
bool Scheduler::prefix_in_flight(const Request& r, const std::vector<int32_t>& hits) const {
  const int64_t h = static_cast<int64_t>(hits.size());
  const int64_t ps = options_.page_size;
  if (!caches(r) || r.spec.prompt_logits || (known_tokens(r) - 1) / ps <= h) return false;
  std::optional<std::vector<int32_t>> tokens;
  for (uint64_t wid : running_) {
    const Request& w = requests_.at(wid);
    if (!caches(w) || !w.registering || w.registered != h || w.table.context_len() <= h * ps ||
        known_tokens(w) < (h + 1) * ps) {
      continue;
    }
    if (h > 0 && w.table.pages()[h - 1] != hits[h - 1]) continue;
    if (!tokens.has_value()) tokens = page_tokens(r, h);
    if (page_tokens(w, h) == *tokens) return true;
  }
  return false;
}

// Enters r's pages that positions [0, written) fill, in order, each after the one before it.
void Scheduler::register_full_pages(Request& r, int64_t written) {
  if (!caches(r) || !r.registering) return;
  const std::vector<int32_t>& pages = r.table.pages();
  const int64_t full =
      std::min<int64_t>(written / options_.page_size, static_cast<int64_t>(pages.size()));
  for (; r.registered < full; ++r.registered) {
    const int64_t j = r.registered;
    absl::StatusOr<bool> entered =
        pool_.cache(pages[j], j == 0 ? -1 : pages[j - 1], page_tokens(r, j));
    check_or_die(entered.status(), "caching a full page");
    if (!*entered) {  // another page holds these tokens after the same chain
      r.registering = false;
      return;
    }
  }
}

int32_t Scheduler::reset_prefix_cache() {
  for (auto& [id, r] : requests_) r.registering = false;  // admission turns it on again
  return pool_.reset_cache();
}

std::optional<StepPlan> Scheduler::schedule() {
  if (requests_.empty()) return std::nullopt;
  StepBuild b;
  b.decodes.step_id = b.prefills.step_id = next_step_id_;
  b.budget = options_.max_num_batched_tokens;
  b.rows_left = options_.max_num_seqs;
  for (uint64_t id : running_) b.later_decodes += decode_ready(requests_.at(id)) ? 1 : 0;
  size_t i = 0;
  while (i < running_.size() && b.rows_left > 0 && b.budget > 0) {
    if (schedule_running(b, i)) ++i;
  }
  admit_waiting(b);
  if (b.decodes.rows.empty() && b.prefills.rows.empty()) return std::nullopt;
  for (StepRow& row : b.prefills.rows) b.decodes.rows.push_back(std::move(row));
  for (RowRecord& rec : b.prefill_rec.rows) b.decode_rec.rows.push_back(std::move(rec));
  b.decode_rec.step_id = next_step_id_++;
  in_flight_.push_back(std::move(b.decode_rec));
  return std::move(b.decodes);
}

absl::Status Scheduler::check_front(int64_t step_id) const {
  if (in_flight_.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("step ", step_id, " reported done, but no step is in flight"));
  }
  if (in_flight_.front().step_id != step_id) {
    return absl::FailedPreconditionError(
        absl::StrCat("step ", step_id, " reported done before step ", in_flight_.front().step_id));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<AcceptedSample>> Scheduler::on_step_retired(
    int64_t step_id, absl::Span<const RowResult> results) {
  if (absl::Status s = check_front(step_id); !s.ok()) return s;
  if (results.size() != in_flight_.front().rows.size()) {
    return absl::InvalidArgumentError(absl::StrCat("step ", step_id, " has ",
                                                   in_flight_.front().rows.size(), " rows, but ",
                                                   results.size(), " results were given"));
  }
  InFlightStep step = std::move(in_flight_.front());
  in_flight_.pop_front();
  std::vector<AcceptedSample> accepted;
  for (size_t k = 0; k < step.rows.size(); ++k) {
    const RowRecord& row = step.rows[k];
    auto it = requests_.find(row.id);
    if (it == requests_.end() || it->second.incarnation != row.incarnation) continue;
    Request& r = it->second;
    register_full_pages(r, row.end);  // their content is proven now
    if (!row.logits) continue;
    --r.pending;
    accepted.push_back(AcceptedSample{k, row.id, results[k].token,
                                      static_cast<int64_t>(r.outputs.size()), results[k].stop});
    r.outputs.push_back(results[k].token);
    if (results[k].stop) {
      finish(row.id, FinishReason::kStop);
    } else if (static_cast<int64_t>(r.outputs.size()) >= r.spec.max_tokens) {
      finish(row.id, FinishReason::kLength);
    }
  }
  free_fenced_state_slots(step_id);
  return accepted;
}

absl::Status Scheduler::on_step_failed(int64_t step_id, StepFailure failure,
                                       const absl::Status& cause) {
  if (absl::Status s = check_front(step_id); !s.ok()) return s;
  InFlightStep step = std::move(in_flight_.front());
  in_flight_.pop_front();
  if (failure == StepFailure::kUnrecoverable) {
    // Every page a row touched is fenced at or after this step or still used,
    // so none of them can have been freed yet.
    for (const RowRecord& row : step.rows) {
      for (int32_t page : row.pages) check_or_die(pool_.quarantine(page), "quarantining a page");
    }
  }
  const absl::Status error =
      cause.ok() ? absl::UnknownError(absl::StrCat("step ", step_id, " failed")) : cause;
  for (const RowRecord& row : step.rows) {
    auto it = requests_.find(row.id);
    if (it == requests_.end() || it->second.incarnation != row.incarnation) continue;
    finish(row.id, FinishReason::kError, error);
  }
  if (failure == StepFailure::kUnrecoverable) {
    // A cached page the step read may be held by requests without a row in it: their KV is
    // unproven now as well.
    for (uint64_t id : std::vector<uint64_t>(running_)) {
      const std::vector<int32_t>& pages = requests_.at(id).table.pages();
      if (std::any_of(pages.begin(), pages.end(),
                      [&](int32_t page) { return pool_.state(page) == PageState::kQuarantined; })) {
        finish(id, FinishReason::kError, error);
      }
    }
  }
  free_fenced_state_slots(step_id);
  return absl::OkStatus();
}

void Scheduler::free_fenced_state_slots(int64_t step_id) {
  pool_.retire_through(step_id);
  std::erase_if(fenced_state_slots_, [&](const std::pair<int32_t, int64_t>& f) {
    if (f.second > step_id) return false;
    free_state_slots_.push_back(f.first);
    return true;
  });
}

std::vector<FinishedRequest> Scheduler::take_finished() {
  std::vector<FinishedRequest> out;
  out.swap(finished_);
  return out;
}

SchedulerSnapshot Scheduler::snapshot() const {
  SchedulerSnapshot s;
  s.waiting = static_cast<int64_t>(waiting_.size());
  s.running = static_cast<int64_t>(running_.size());
  s.steps_in_flight = static_cast<int64_t>(in_flight_.size());
  s.preempted_total = preempted_total_;
  for (int k = 0; k < kNumFinishReasons; ++k) s.finished[k] = finished_count_[k];
  s.pages = pool_.counts();
  s.state_slots_free = static_cast<int64_t>(free_state_slots_.size());
  s.state_slots_fenced = static_cast<int64_t>(fenced_state_slots_.size());
  s.prefix_cache_queries = prefix_cache_queries_;
  s.prefix_cache_hits = prefix_cache_hits_;
  s.cached_pages = pool_.num_cached();
  return s;
}

std::optional<RequestInfo> Scheduler::find(uint64_t id) const {
  auto it = requests_.find(id);
  if (it == requests_.end()) return std::nullopt;
  const Request& r = it->second;
  RequestInfo info;
  info.running = r.running;
  info.prompt_len = r.spec.prompt_len;
  info.num_scheduled = r.table.context_len();
  info.num_preemptions = r.num_preemptions;
  info.max_tokens = r.spec.max_tokens;
  info.pending_samples = r.pending;
  info.prefilled = r.prefilled;
  info.output_tokens = r.outputs;
  info.pages = r.table.pages();
  info.cached_tokens = std::max<int64_t>(r.cached_tokens, 0);
  return info;
}

// Every held page is used with one holder per live table holding it (or quarantined), and the
// used pages are exactly the held ones.
absl::Status Scheduler::check_page_holders() const {
  std::unordered_map<int32_t, int32_t> holders;
  for (const auto& [id, r] : requests_) {
    if (!r.running && !r.table.pages().empty()) {
      return absl::InternalError(absl::StrCat("waiting request ", id, " holds pages"));
    }
    for (int32_t page : r.table.pages()) {
      if (pool_.state(page) != PageState::kUsed && pool_.state(page) != PageState::kQuarantined) {
        return absl::InternalError(
            absl::StrCat("request ", id, " holds page ", page, ", which is not used"));
      }
      ++holders[page];
    }
  }
  int64_t used = 0;
  for (const auto& [page, count] : holders) {
    if (pool_.state(page) != PageState::kUsed) continue;
    ++used;
    if (pool_.refs(page) != count) {
      return absl::InternalError(absl::StrCat("page ", page, " is held by ", count,
                                              " live requests but counts ", pool_.refs(page),
                                              " holders"));
    }
  }
  if (used != pool_.num_used()) {
    return absl::InternalError(
        absl::StrCat(used, " pages held by live requests, but ", pool_.num_used(), " used"));
  }
  return absl::OkStatus();
}

absl::Status Scheduler::check_invariants() const {
  if (absl::Status s = pool_.check_invariants(); !s.ok()) return s;
  if (running_.size() + waiting_.size() != requests_.size()) {
    return absl::InternalError(absl::StrCat(running_.size(), " running + ", waiting_.size(),
                                            " waiting requests, but ", requests_.size(), " live"));
  }
  if (absl::Status s = check_page_holders(); !s.ok()) return s;
  // State slots: free, fenced and held by running requests partition [0, max_num_seqs).
  std::vector<int> seen(options_.max_num_seqs, 0);
  for (int32_t slot : free_state_slots_) ++seen[slot];
  for (const auto& [slot, step] : fenced_state_slots_) ++seen[slot];
  for (const auto& [id, r] : requests_) {
    if (r.running != (r.state_slot >= 0)) {
      return absl::InternalError(absl::StrCat(
          "request ", id, (r.running ? " runs without" : " waits with"), " a state slot"));
    }
    if (r.state_slot >= 0) ++seen[r.state_slot];
  }
  for (int32_t slot = 0; slot < options_.max_num_seqs; ++slot) {
    if (seen[slot] != 1) {
      return absl::InternalError(absl::StrCat("state slot ", slot, " is counted ", seen[slot],
                                              " times (free, fenced, held)"));
    }
  }
  return absl::OkStatus();
}

}  // namespace simpler::llm
