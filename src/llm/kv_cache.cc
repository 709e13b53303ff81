#include "simpler/llm/kv_cache.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <limits>

#include "absl/strings/str_cat.h"

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
  if (page_size <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("page_size ", page_size, " must be positive"));
  }
  if (max_position_embeddings <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_position_embeddings ", max_position_embeddings, " must be positive"));
  }
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
    : page_size_(page_size), owner_(num_pages, 0), allocated_(num_pages, false) {
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
  allocated_[page] = true;
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

absl::Status PagePool::free(uint64_t request_id, int32_t page) {
  if (page < 0 || page >= num_pages()) {
    return absl::OutOfRangeError(absl::StrCat("request ", request_id, " freed page ", page,
                                              " outside the pool of ", num_pages(), " pages"));
  }
  if (!allocated_[page]) {
    return absl::FailedPreconditionError(
        absl::StrCat("request ", request_id, " freed page ", page, ", which is already free"));
  }
  if (owner_[page] != request_id) {
    return absl::FailedPreconditionError(absl::StrCat("request ", request_id, " freed page ", page,
                                                      ", which request ", owner_[page], " owns"));
  }
  allocated_[page] = false;
  free_.push_back(page);
  return absl::OkStatus();
}

bool PagePool::is_allocated(int32_t page) const {
  return page >= 0 && page < num_pages() && allocated_[page];
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
