#include "engine/kv_cache.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <limits>

#include "absl/hash/hash.h"
#include "absl/strings/str_cat.h"
#include "simpler/base/status.h"

namespace simpler::llm {

int64_t pages_needed(int64_t tokens, int64_t page_size) {
  if (page_size <= 0) {
    std::fprintf(stderr, "simpler: pages_needed with page_size %lld\n",
                 static_cast<long long>(page_size));
    std::abort();
  }
  if (tokens <= 0) return 0;
  return (tokens + page_size - 1) / page_size;
}

absl::StatusOr<int32_t> default_num_pages(int64_t prompt_len, int64_t max_new_tokens,
                                          int64_t num_requests, int64_t page_size,
                                          int64_t max_position_embeddings) {
  SIMPLER_RETURN_IF_ERROR(base::require_positive(
      {{"page_size", page_size}, {"max_position_embeddings", max_position_embeddings}}));
  if (prompt_len < 0 || max_new_tokens < 0 || num_requests < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("prompt_len (", prompt_len, "), max_new_tokens (", max_new_tokens,
                     ") and num_requests (", num_requests, ") must not be negative"));
  }
  // prompt_len + max_new_tokens cannot overflow once clamped separately.
  const int64_t tokens = std::min(std::min(prompt_len, max_position_embeddings) +
                                      std::min(max_new_tokens, max_position_embeddings),
                                  max_position_embeddings);
  const int64_t per_request = pages_needed(tokens, page_size);
  if (num_requests > 0 && per_request > std::numeric_limits<int32_t>::max() / num_requests) {
    return absl::InvalidArgumentError(absl::StrCat(num_requests, " requests x ", per_request,
                                                   " pages do not fit an int32 page count"));
  }
  return static_cast<int32_t>(num_requests * per_request);
}

absl::StatusOr<PagePool> PagePool::create(int32_t num_pages, int32_t page_size) {
  if (num_pages < 0) {
    return absl::InvalidArgumentError(absl::StrCat("num_pages ", num_pages, " is negative"));
  }
  if (page_size <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("page_size ", page_size, " must be positive"));
  }
  if (static_cast<int64_t>(num_pages) * page_size > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(
        absl::StrCat(num_pages, " pages x ", page_size, " tokens exceed the int32 slot range"));
  }
  return PagePool(num_pages, page_size);
}

PagePool::PagePool(int32_t num_pages, int32_t page_size)
    : page_size_(page_size),
      owner_(num_pages, 0),
      refs_(num_pages, 0),
      generation_(num_pages, 0),
      state_(num_pages, PageState::kFree),
      fence_step_(num_pages, 0),
      key_(num_pages),
      shared_(num_pages, false),
      evictable_at_(num_pages) {
  free_.reserve(num_pages);
  for (int32_t p = num_pages - 1; p >= 0; --p) free_.push_back(p);
}

// A plain free page if there is one, else the least recently freed cached one (evicted).
int32_t PagePool::take_free_page() {
  if (!free_.empty()) {
    const int32_t page = free_.back();
    free_.pop_back();
    return page;
  }
  const int32_t page = evictable_.front();
  evictable_.pop_front();
  uncache(page);
  return page;
}

absl::StatusOr<int32_t> PagePool::allocate(uint64_t request_id) {
  if (num_free() == 0) {
    return absl::ResourceExhaustedError(absl::StrCat("KV cache exhausted: request ", request_id,
                                                     " needs 1 page, 0 of ", num_pages(),
                                                     " pages free"));
  }
  const int32_t page = take_free_page();
  owner_[page] = request_id;
  refs_[page] = 1;
  ++generation_[page];
  fence_step_[page] = 0;
  shared_[page] = false;
  state_[page] = PageState::kUsed;
  ++num_used_;
  return page;
}

absl::StatusOr<std::vector<int32_t>> PagePool::allocate(uint64_t request_id, int32_t count) {
  if (count < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("request ", request_id, " asked for a negative page count ", count));
  }
  if (count > num_free()) {
    return absl::ResourceExhaustedError(absl::StrCat("KV cache exhausted: request ", request_id,
                                                     " needs ", count, " pages, ", num_free(),
                                                     " of ", num_pages(), " pages free"));
  }
  std::vector<int32_t> pages;
  pages.reserve(count);
  for (int32_t i = 0; i < count; ++i) pages.push_back(allocate(request_id).value());
  return pages;
}

absl::Status PagePool::check_owned(uint64_t request_id, int32_t page, const char* verb) const {
  if (page < 0 || page >= num_pages()) {
    return absl::OutOfRangeError(absl::StrCat("request ", request_id, " ", verb, " page ", page,
                                              " outside the pool of ", num_pages(), " pages"));
  }
  if (state_[page] == PageState::kFree) {
    return absl::FailedPreconditionError(
        absl::StrCat("request ", request_id, " ", verb, " page ", page, ", which is already free"));
  }
  if (!shared_[page] && owner_[page] != request_id) {
    return absl::FailedPreconditionError(absl::StrCat("request ", request_id, " ", verb, " page ",
                                                      page, ", which request ", owner_[page],
                                                      " owns"));
  }
  if (state_[page] != PageState::kUsed) {
    return absl::FailedPreconditionError(
        absl::StrCat("request ", request_id, " ", verb, " page ", page, ", which is ",
                     state_[page] == PageState::kFenced ? "fenced" : "quarantined"));
  }
  return absl::OkStatus();
}

bool PagePool::drop_holder(int32_t page) {
  if (--refs_[page] > 0) return false;
  --num_used_;
  return true;
}

void PagePool::make_free(int32_t page) {
  state_[page] = PageState::kFree;
  if (key_[page].has_value()) {
    evictable_.push_back(page);
    evictable_at_[page] = std::prev(evictable_.end());
  } else {
    free_.push_back(page);
  }
}

absl::Status PagePool::free(uint64_t request_id, int32_t page) {
  if (absl::Status s = check_owned(request_id, page, "freed"); !s.ok()) return s;
  if (!drop_holder(page)) return absl::OkStatus();
  if (fence_step_[page] > retired_through_) {  // another holder fenced it behind a step
    state_[page] = PageState::kFenced;
    fenced_.push_back(page);
    return absl::OkStatus();
  }
  make_free(page);
  return absl::OkStatus();
}

absl::Status PagePool::fence(uint64_t request_id, int32_t page, int64_t step_id) {
  if (absl::Status s = check_owned(request_id, page, "fenced"); !s.ok()) return s;
  fence_step_[page] = std::max(fence_step_[page], step_id);
  if (!drop_holder(page)) return absl::OkStatus();
  if (fence_step_[page] <= retired_through_) {
    make_free(page);
    return absl::OkStatus();
  }
  state_[page] = PageState::kFenced;
  fenced_.push_back(page);
  return absl::OkStatus();
}

uint64_t PagePool::key_hash(int32_t parent, uint64_t parent_generation,
                            absl::Span<const int32_t> tokens) const {
  return absl::HashOf(parent, parent_generation, tokens);
}

absl::StatusOr<bool> PagePool::cache(int32_t page, int32_t parent,
                                     absl::Span<const int32_t> tokens) {
  if (page < 0 || page >= num_pages() || parent < -1 || parent >= num_pages()) {
    return absl::InvalidArgumentError(absl::StrCat("caching page ", page, " after page ", parent,
                                                   ": outside the pool of ", num_pages(),
                                                   " pages"));
  }
  if (static_cast<int64_t>(tokens.size()) != page_size_) {
    return absl::InvalidArgumentError(absl::StrCat("caching page ", page, " with ", tokens.size(),
                                                   " tokens; a cached page is full (", page_size_,
                                                   " tokens)"));
  }
  if (state_[page] != PageState::kUsed || (parent >= 0 && state_[parent] == PageState::kFree)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "caching page ", page, " after page ", parent, ": a cached page must be used (it is ",
        state_[page] == PageState::kFree ? "free" : "not used", ") and its parent allocated"));
  }
  if (key_[page].has_value()) return false;
  const uint64_t parent_generation = parent >= 0 ? generation_[parent] : 0;
  const uint64_t hash = key_hash(parent, parent_generation, tokens);
  if (!index_.emplace(hash, page).second) return false;
  key_[page] =
      CacheKey{parent, parent_generation, std::vector<int32_t>(tokens.begin(), tokens.end())};
  shared_[page] = true;
  return true;
}

std::optional<int32_t> PagePool::lookup(int32_t parent, absl::Span<const int32_t> tokens) const {
  if (parent < -1 || parent >= num_pages()) return std::nullopt;
  const uint64_t parent_generation = parent >= 0 ? generation_[parent] : 0;
  auto it = index_.find(key_hash(parent, parent_generation, tokens));
  if (it == index_.end()) return std::nullopt;
  const CacheKey& key = *key_[it->second];
  if (key.parent != parent || key.parent_generation != parent_generation ||
      !std::equal(key.tokens.begin(), key.tokens.end(), tokens.begin(), tokens.end())) {
    return std::nullopt;  // a hash collision
  }
  return it->second;
}

absl::Status PagePool::share(uint64_t request_id, int32_t page) {
  if (page < 0 || page >= num_pages()) {
    return absl::OutOfRangeError(absl::StrCat("request ", request_id, " shares page ", page,
                                              " outside the pool of ", num_pages(), " pages"));
  }
  if (!key_[page].has_value()) {
    return absl::FailedPreconditionError(absl::StrCat("request ", request_id, " shares page ", page,
                                                      ", which is not in the prefix cache"));
  }
  switch (state_[page]) {
    case PageState::kUsed:
      ++refs_[page];
      return absl::OkStatus();
    case PageState::kFree:
      evictable_.erase(evictable_at_[page]);
      break;
    case PageState::kFenced:
      fenced_.erase(std::find(fenced_.begin(), fenced_.end(), page));
      break;
    case PageState::kQuarantined:
      break;  // never in the index
  }
  state_[page] = PageState::kUsed;
  refs_[page] = 1;
  ++num_used_;
  return absl::OkStatus();
}

void PagePool::uncache(int32_t page) {
  if (!key_[page].has_value()) return;
  const CacheKey& key = *key_[page];
  index_.erase(key_hash(key.parent, key.parent_generation, key.tokens));
  key_[page].reset();
}

int32_t PagePool::reset_cache() {
  const int32_t dropped = num_cached();
  for (int32_t page : evictable_) free_.push_back(page);
  evictable_.clear();
  index_.clear();
  for (auto& key : key_) key.reset();
  return dropped;
}

int32_t PagePool::refs(int32_t page) const {
  return (page >= 0 && page < num_pages() && state_[page] == PageState::kUsed) ? refs_[page] : 0;
}

bool PagePool::is_cached(int32_t page) const {
  return page >= 0 && page < num_pages() && key_[page].has_value();
}

int32_t PagePool::retire_through(int64_t step_id) {
  if (step_id > retired_through_) retired_through_ = step_id;
  int32_t freed = 0;
  for (size_t i = 0; i < fenced_.size();) {
    const int32_t page = fenced_[i];
    if (fence_step_[page] <= retired_through_) {
      fenced_[i] = fenced_.back();
      fenced_.pop_back();
      make_free(page);
      ++freed;
    } else {
      ++i;
    }
  }
  return freed;
}

absl::Status PagePool::quarantine(int32_t page) {
  if (page < 0 || page >= num_pages()) {
    return absl::OutOfRangeError(
        absl::StrCat("quarantined page ", page, " outside the pool of ", num_pages(), " pages"));
  }
  switch (state_[page]) {
    case PageState::kFree:
      return absl::FailedPreconditionError(
          absl::StrCat("quarantined page ", page, ", which is free"));
    case PageState::kQuarantined:
      return absl::OkStatus();
    case PageState::kUsed:
      --num_used_;
      refs_[page] = 0;
      break;
    case PageState::kFenced:
      fenced_.erase(std::find(fenced_.begin(), fenced_.end(), page));
      break;
  }
  uncache(page);
  state_[page] = PageState::kQuarantined;
  ++num_quarantined_;
  return absl::OkStatus();
}

PageState PagePool::state(int32_t page) const {
  return (page >= 0 && page < num_pages()) ? state_[page] : PageState::kFree;
}

absl::Status PagePool::check_invariants() const {
  PageCounts c;
  for (int32_t p = 0; p < num_pages(); ++p) {
    switch (state_[p]) {
      case PageState::kFree:
        ++c.free;
        break;
      case PageState::kUsed:
        ++c.used;
        break;
      case PageState::kFenced:
        ++c.fenced;
        if (fence_step_[p] <= retired_through_) {
          return absl::InternalError(absl::StrCat("page ", p, " is fenced behind step ",
                                                  fence_step_[p], ", which retired (through ",
                                                  retired_through_, ")"));
        }
        break;
      case PageState::kQuarantined:
        ++c.quarantined;
        break;
    }
  }
  for (int32_t p : free_) {
    if (state_[p] != PageState::kFree || key_[p].has_value()) {
      return absl::InternalError(
          absl::StrCat("page ", p, " is on the free list but not a plain free page"));
    }
  }
  if (absl::Status s = check_cache_invariants(); !s.ok()) return s;
  for (int32_t p : fenced_) {
    if (state_[p] != PageState::kFenced) {
      return absl::InternalError(absl::StrCat("page ", p, " is on the fenced list but not fenced"));
    }
  }
  const PageCounts k = counts();
  if (c.free != k.free || c.used != k.used || c.fenced != k.fenced ||
      c.quarantined != k.quarantined || k.total() != num_pages()) {
    return absl::InternalError(absl::StrCat(
        "page counts free ", k.free, " used ", k.used, " fenced ", k.fenced, " quarantined ",
        k.quarantined, " disagree with the page states (", c.free, ", ", c.used, ", ", c.fenced,
        ", ", c.quarantined, ") or the pool of ", num_pages()));
  }
  return absl::OkStatus();
}

absl::Status PagePool::check_cache_invariants() const {
  for (int32_t p : evictable_) {
    if (state_[p] != PageState::kFree || !key_[p].has_value()) {
      return absl::InternalError(
          absl::StrCat("page ", p, " is on the evictable list but not a cached free page"));
    }
  }
  if (static_cast<size_t>(num_free()) + num_used_ + fenced_.size() + num_quarantined_ !=
      static_cast<size_t>(num_pages())) {
    return absl::InternalError(
        "the free, evictable, used, fenced and quarantined pages do not "
        "sum to the pool");
  }
  int32_t keyed = 0;
  for (int32_t p = 0; p < num_pages(); ++p) {
    if ((state_[p] == PageState::kUsed) != (refs_[p] > 0)) {
      return absl::InternalError(absl::StrCat("page ", p, " has ", refs_[p], " holders but is ",
                                              state_[p] == PageState::kUsed ? "" : "not ", "used"));
    }
    if (!key_[p].has_value()) continue;
    ++keyed;
    const CacheKey& k = *key_[p];
    auto it = index_.find(key_hash(k.parent, k.parent_generation, k.tokens));
    if (it == index_.end() || it->second != p || state_[p] == PageState::kQuarantined) {
      return absl::InternalError(
          absl::StrCat("cached page ", p, " is not indexed under its key", " or is quarantined"));
    }
  }
  if (keyed != num_cached()) {
    return absl::InternalError(
        absl::StrCat(num_cached(), " index entries, but ", keyed, " pages carry a key"));
  }
  return absl::OkStatus();
}

bool PagePool::is_allocated(int32_t page) const {
  return page >= 0 && page < num_pages() && state_[page] != PageState::kFree;
}

uint64_t PagePool::owner(int32_t page) const {
  return (page >= 0 && page < num_pages()) ? owner_[page] : 0;
}

absl::StatusOr<int32_t> BlockTable::append_token(PagePool& pool) {
  const int64_t page_size = pool.page_size();
  const int64_t offset = context_len_ % page_size;
  if (offset == 0 && static_cast<int64_t>(pages_.size()) * page_size <= context_len_) {
    auto page = pool.allocate(request_id_);
    if (!page.ok()) return page.status();
    pages_.push_back(*page);
  }
  const int64_t slot = static_cast<int64_t>(pages_[context_len_ / page_size]) * page_size + offset;
  ++context_len_;
  return static_cast<int32_t>(slot);
}

absl::StatusOr<int32_t> BlockTable::slot_of(int64_t position, int32_t page_size) const {
  if (position < 0 || position >= context_len_) {
    return absl::OutOfRangeError(absl::StrCat("request ", request_id_, " position ", position,
                                              " outside its context [0, ", context_len_, ")"));
  }
  if (page_size <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("page_size ", page_size, " must be positive"));
  }
  const int64_t block = position / page_size;
  if (block >= static_cast<int64_t>(pages_.size())) {
    return absl::OutOfRangeError(absl::StrCat("request ", request_id_, " position ", position,
                                              " has no page at page size ", page_size));
  }
  return static_cast<int32_t>(static_cast<int64_t>(pages_[block]) * page_size +
                              position % page_size);
}

absl::Status BlockTable::fill_row(int32_t* row, int64_t max_blocks) const {
  if (static_cast<int64_t>(pages_.size()) > max_blocks) {
    return absl::OutOfRangeError(absl::StrCat("request ", request_id_, " holds ", pages_.size(),
                                              " pages, more than the block table's ", max_blocks,
                                              " blocks"));
  }
  std::copy(pages_.begin(), pages_.end(), row);
  std::fill(row + pages_.size(), row + max_blocks, -1);
  return absl::OkStatus();
}

int64_t BlockTable::pages_for_append(int64_t count, int32_t page_size) const {
  const int64_t need =
      pages_needed(context_len_ + count, page_size) - static_cast<int64_t>(pages_.size());
  return need > 0 ? need : 0;
}

absl::Status BlockTable::append_tokens(PagePool& pool, int64_t count) {
  if (count < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("request ", request_id_, " appended a negative token count ", count));
  }
  const int64_t need = pages_for_append(count, pool.page_size());
  if (need > pool.num_free()) {
    return absl::ResourceExhaustedError(absl::StrCat("KV cache exhausted: request ", request_id_,
                                                     " needs ", need, " pages, ", pool.num_free(),
                                                     " of ", pool.num_pages(), " pages free"));
  }
  auto pages = pool.allocate(request_id_, static_cast<int32_t>(need));
  if (!pages.ok()) return pages.status();
  pages_.insert(pages_.end(), pages->begin(), pages->end());
  context_len_ += count;
  return absl::OkStatus();
}

absl::Status BlockTable::adopt_cached(absl::Span<const int32_t> pages, int32_t page_size) {
  if (!pages_.empty() || context_len_ != 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "request ", request_id_, " adopts cached pages into a table that is not empty"));
  }
  pages_.assign(pages.begin(), pages.end());
  context_len_ = static_cast<int64_t>(pages.size()) * page_size;
  return absl::OkStatus();
}

absl::Status BlockTable::fence(PagePool& pool, int64_t step_id) {
  absl::Status first;
  for (int32_t page : pages_) {
    if (pool.state(page) == PageState::kQuarantined) continue;
    absl::Status s = pool.fence(request_id_, page, step_id);
    if (!s.ok() && first.ok()) first = s;
  }
  pages_.clear();
  context_len_ = 0;
  return first;
}

absl::Status BlockTable::release(PagePool& pool) {
  absl::Status first;
  for (int32_t page : pages_) {
    absl::Status s = pool.free(request_id_, page);
    if (!s.ok() && first.ok()) first = s;
  }
  pages_.clear();
  context_len_ = 0;
  return first;
}

}  // namespace simpler::llm
