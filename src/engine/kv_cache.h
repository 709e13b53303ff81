// Host-side bookkeeping of the paged KV cache: which pages of the device pool
// are free, which request owns each page, and each request's block table.
//
// The device pool itself is one tensor per layer and K/V,
// [num_pages, n_kv_heads, page_size, head_dim] (see qwen3_program.h); token t of
// a request lives in page pages()[t / page_size] at offset t % page_size, i.e.
// at slot page · page_size + offset. A page is written only by the request
// that allocated it. Full pages whose content is proven (the step that wrote
// them retired) may be entered in the pool's prefix cache and then shared,
// read-only, by later requests whose tokens start the same way
// (docs/design/prefix_cache.md; ARCHITECTURE.md, clone requests).
//
// Lifetime rule (ARCHITECTURE.md, Serving): a page may go back to the pool
// only after the last run that reads or writes it retired. Either the caller
// decides when that is and calls BlockTable::release / PagePool::free, or it
// fences the pages behind a step id (PagePool::fence, BlockTable::fence) and
// reports retired steps with PagePool::retire_through. Every page is in exactly
// one of four states, free / used / fenced / quarantined, and the counts sum to
// num_pages(); only free pages are ever handed out.
//
// Private to the engine (src/engine); the page counts and pool sizing users see are in
// simpler/engine/kv_pages.h.
#pragma once

#include <cstdint>
#include <list>
#include <optional>
#include <unordered_map>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "simpler/engine/kv_pages.h"

namespace simpler::llm {

// The four states of a page (ARCHITECTURE.md, Serving).
enum class PageState : uint8_t {
  kFree,         // may be allocated (a cached free page is evicted first)
  kUsed,         // held by one or more live requests
  kFenced,       // released by its last holder, waiting until its fence step retired
  kQuarantined,  // touched by a step whose device use is unproven; never reused
};

// The free list of a pool of `num_pages` pages of `page_size` tokens each,
// with the allocating request and the holder count of every allocated page,
// and the prefix cache: an index of full pages by (parent page, its
// generation, tokens) (docs/design/prefix_cache.md). Pages are handed out
// lowest id first among the free ones that were never used, then most
// recently freed first, and only then the least recently freed cached page
// (evicted: it leaves the index). Owned by the engine loop for the pool's
// lifetime. Thread-compatible.
class PagePool {
 public:
  // INVALID_ARGUMENT when num_pages < 0 or page_size <= 0.
  static absl::StatusOr<PagePool> create(int32_t num_pages, int32_t page_size);

  int32_t num_pages() const { return static_cast<int32_t>(owner_.size()); }
  int32_t page_size() const { return page_size_; }
  // Free pages, plain and cached (evictable).
  int32_t num_free() const { return static_cast<int32_t>(free_.size() + evictable_.size()); }
  int32_t num_used() const { return num_used_; }
  int32_t num_fenced() const { return static_cast<int32_t>(fenced_.size()); }
  int32_t num_quarantined() const { return num_quarantined_; }
  // Pages in the prefix cache's index (used, fenced or free).
  int32_t num_cached() const { return static_cast<int32_t>(index_.size()); }
  // Free pages that are cached (evicted last).
  int32_t num_evictable() const { return static_cast<int32_t>(evictable_.size()); }
  PageCounts counts() const {
    return PageCounts{num_free(), num_used(), num_fenced(), num_quarantined()};
  }
  // The highest step id passed to retire_through (0 before any).
  int64_t retired_through() const { return retired_through_; }

  // One page for `request_id`. RESOURCE_EXHAUSTED naming the request and the
  // pool's counts when no page is free.
  absl::StatusOr<int32_t> allocate(uint64_t request_id);
  // `count` pages for `request_id`, all or nothing. RESOURCE_EXHAUSTED naming
  // the request, the count asked and the pages free; INVALID_ARGUMENT when
  // count < 0.
  absl::StatusOr<std::vector<int32_t>> allocate(uint64_t request_id, int32_t count);

  // `request_id` lets go of `page`: the page is free once it has no holder
  // left. OUT_OF_RANGE for a page id outside the pool; FAILED_PRECONDITION
  // when the page is free already, is not used, or was never shared and
  // another request owns it (the message names both requests).
  absl::Status free(uint64_t request_id, int32_t page);

  // `request_id` lets go of `page` behind `step_id`: once it has no holder
  // left it is fenced and becomes free when a step with id >= the latest
  // fence any holder gave it retired (retire_through). A page whose fence
  // step retired already (e.g. 0 for a page no submitted step touched) is
  // freed at once. Errors as free().
  absl::Status fence(uint64_t request_id, int32_t page, int64_t step_id);

  // --- the prefix cache (docs/design/prefix_cache.md) ---

  // Enters the used, full `page` in the index under (`parent` at its current
  // generation, `tokens`); parent -1 for a chain's first page. Returns false
  // (and changes nothing) when an identical key is cached already under
  // another page, or the page is cached already. INVALID_ARGUMENT when
  // `tokens` is not page_size() long or `parent` is outside [-1, num_pages());
  // FAILED_PRECONDITION when `page` is not used or `parent` not allocated.
  absl::StatusOr<bool> cache(int32_t page, int32_t parent, absl::Span<const int32_t> tokens);

  // The cached page holding `tokens` after `parent` (-1: at the start), or
  // nullopt. Compares the stored key in full: never a hash collision's page.
  std::optional<int32_t> lookup(int32_t parent, absl::Span<const int32_t> tokens) const;

  // Adds `request_id` as a holder of the cached `page`: a free (evictable) or
  // fenced page becomes used again. FAILED_PRECONDITION when the page is not
  // in the index (OUT_OF_RANGE outside the pool).
  absl::Status share(uint64_t request_id, int32_t page);

  // Drops every index entry: held pages stay with their holders, cached free
  // pages become plain free pages. Returns the number of entries dropped.
  int32_t reset_cache();

  // Holders of `page` (0 unless used).
  int32_t refs(int32_t page) const;
  // Whether `page` is in the index.
  bool is_cached(int32_t page) const;

  // Records that every step with id <= `step_id` retired and frees the fenced
  // pages whose fence step is among them. Returns the number of pages freed.
  int32_t retire_through(int64_t step_id);

  // Moves a used or fenced `page` to quarantined: it stays counted and is
  // never handed out again. A quarantined page is left as it is. OUT_OF_RANGE
  // outside the pool; FAILED_PRECONDITION for a free page.
  absl::Status quarantine(int32_t page);

  // True when `page` is not free (used, fenced or quarantined); the request
  // that allocated it then is owner(page).
  bool is_allocated(int32_t page) const;
  PageState state(int32_t page) const;
  // The request that allocated a page that is not free (unspecified for a
  // free page). A shared page has other holders besides (refs()).
  uint64_t owner(int32_t page) const;

  // INTERNAL naming the page when the free list, the per-page states and the
  // counts disagree (a program bug). Linear in the pool; for tests and debug.
  absl::Status check_invariants() const;

 private:
  // The index entry of a cached page.
  struct CacheKey {
    int32_t parent = -1;
    uint64_t parent_generation = 0;
    std::vector<int32_t> tokens;
  };
  PagePool(int32_t num_pages, int32_t page_size);
  absl::Status check_owned(uint64_t request_id, int32_t page, const char* verb) const;
  // Drops one holder of a checked, used page; true when none is left.
  bool drop_holder(int32_t page);
  void make_free(int32_t page);
  int32_t take_free_page();
  void uncache(int32_t page);
  uint64_t key_hash(int32_t parent, uint64_t parent_generation,
                    absl::Span<const int32_t> tokens) const;
  absl::Status check_cache_invariants() const;

  int32_t page_size_ = 0;
  int32_t num_used_ = 0;
  int32_t num_quarantined_ = 0;
  int64_t retired_through_ = 0;
  std::vector<int32_t> free_;         // plain free pages, a stack: back() is handed out next
  std::list<int32_t> evictable_;      // cached free pages, least recently freed first
  std::vector<int32_t> fenced_;       // fenced pages, unordered
  std::vector<uint64_t> owner_;       // per page: the allocating request
  std::vector<int32_t> refs_;         // per page: holders while used
  std::vector<uint64_t> generation_;  // per page: bumped at every allocation
  std::vector<PageState> state_;      // per page
  std::vector<int64_t> fence_step_;   // per page: the latest fence a holder gave it
  std::vector<std::optional<CacheKey>> key_;  // per page, set while cached
  std::vector<bool> shared_;  // per page: cached since its allocation (many holders)
  std::vector<std::list<int32_t>::iterator> evictable_at_;  // per page, while evictable
  std::unordered_map<uint64_t, int32_t> index_;             // key hash -> page
};

// One request's block table: its pages in token order and its context length.
// Owned by the request's state in the engine loop; its pages belong to it
// until release(). Thread-compatible.
class BlockTable {
 public:
  explicit BlockTable(uint64_t request_id) : request_id_(request_id) {}

  uint64_t request_id() const { return request_id_; }
  // Tokens appended so far (= the context length after the last append).
  int64_t context_len() const { return context_len_; }
  const std::vector<int32_t>& pages() const { return pages_; }

  // Appends one token at position context_len(), allocating a page from `pool`
  // when the current page is full (or there is none), and returns its slot
  // (page · page_size + offset). RESOURCE_EXHAUSTED from the pool leaves the
  // table unchanged.
  absl::StatusOr<int32_t> append_token(PagePool& pool);

  // The slot of an already appended position. OUT_OF_RANGE outside
  // [0, context_len()).
  absl::StatusOr<int32_t> slot_of(int64_t position, int32_t page_size) const;

  // Writes pages() into row[0 .. max_blocks), padding the rest with -1.
  // OUT_OF_RANGE naming the request when it holds more than max_blocks pages.
  absl::Status fill_row(int32_t* row, int64_t max_blocks) const;

  // Appends `count` positions at once, allocating the pages they need from
  // `pool` all or nothing (RESOURCE_EXHAUSTED leaves the table unchanged);
  // INVALID_ARGUMENT when count < 0.
  absl::Status append_tokens(PagePool& pool, int64_t count);

  // Pages the next `count` appended positions would allocate.
  int64_t pages_for_append(int64_t count, int32_t page_size) const;

  // Starts an empty table with `pages`, cached pages already shared with
  // this request (PagePool::share), holding `pages.size() * page_size`
  // positions. FAILED_PRECONDITION when the table is not empty.
  absl::Status adopt_cached(absl::Span<const int32_t> pages, int32_t page_size);

  // Fences every page behind `step_id` (PagePool::fence), leaves quarantined
  // pages as they are, and resets the table to empty. The first error is
  // returned after all other pages were handled.
  absl::Status fence(PagePool& pool, int64_t step_id);

  // Returns every page to `pool` and resets the table to empty. Call only
  // after the last run reading these pages retired. Errors from
  // PagePool::free (a page not owned by this request) are returned after all
  // other pages were freed.
  absl::Status release(PagePool& pool);

 private:
  uint64_t request_id_ = 0;
  int64_t context_len_ = 0;
  std::vector<int32_t> pages_;
};

}  // namespace simpler::llm
