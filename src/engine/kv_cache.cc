#include "engine/kv_cache.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <limits>

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
      state_(num_pages, PageState::kFree),
      fence_step_(num_pages, 0) {
  free_.reserve(num_pages);
  for (int32_t p = num_pages - 1; p >= 0; --p) free_.push_back(p);
}

absl::StatusOr<int32_t> PagePool::allocate(uint64_t request_id) {
  if (free_.empty()) {
    return absl::ResourceExhaustedError(absl::StrCat("KV cache exhausted: request ", request_id,
                                                     " needs 1 page, 0 of ", num_pages(),
                                                     " pages free"));
  }
  const int32_t page = free_.back();
  free_.pop_back();
  owner_[page] = request_id;
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
  if (owner_[page] != request_id) {
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

void PagePool::make_free(int32_t page) {
  state_[page] = PageState::kFree;
  free_.push_back(page);
}

absl::Status PagePool::free(uint64_t request_id, int32_t page) {
  if (absl::Status s = check_owned(request_id, page, "freed"); !s.ok()) return s;
  --num_used_;
  make_free(page);
  return absl::OkStatus();
}

absl::Status PagePool::fence(uint64_t request_id, int32_t page, int64_t step_id) {
  if (absl::Status s = check_owned(request_id, page, "fenced"); !s.ok()) return s;
  --num_used_;
  if (step_id <= retired_through_) {
    make_free(page);
    return absl::OkStatus();
  }
  state_[page] = PageState::kFenced;
  fence_step_[page] = step_id;
  fenced_.push_back(page);
  return absl::OkStatus();
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
      break;
    case PageState::kFenced:
      fenced_.erase(std::find(fenced_.begin(), fenced_.end(), page));
      break;
  }
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
    if (state_[p] != PageState::kFree) {
      return absl::InternalError(absl::StrCat("page ", p, " is on the free list but not free"));
    }
  }
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

absl::Status BlockTable::fence(PagePool& pool, int64_t step_id) {
  absl::Status first;
  for (int32_t page : pages_) {
    if (pool.state(page) == PageState::kQuarantined && pool.owner(page) == request_id_) continue;
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
