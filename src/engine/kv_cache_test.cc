#include "engine/kv_cache.h"

#include <set>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace simpler::llm {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(PagesNeeded, RoundsUpAndTreatsNonPositiveTokensAsZero) {
  EXPECT_EQ(pages_needed(0, 16), 0);
  EXPECT_EQ(pages_needed(-3, 16), 0);
  EXPECT_EQ(pages_needed(1, 16), 1);
  EXPECT_EQ(pages_needed(16, 16), 1);
  EXPECT_EQ(pages_needed(17, 16), 2);
}

TEST(DefaultNumPages, CoversEveryRequestUpToTheModelsPositionLimit) {
  EXPECT_EQ(default_num_pages(100, 28, 3, 16, 4096).value(), 3 * 8);
  // Clamped by max_position_embeddings: 1000 + 1000 tokens -> 1024 tokens -> 64 pages.
  EXPECT_EQ(default_num_pages(1000, 1000, 2, 16, 1024).value(), 2 * 64);
  EXPECT_EQ(default_num_pages(5, 0, 0, 16, 1024).value(), 0);
}

TEST(DefaultNumPages, RejectsBadArgumentsNamingTheField) {
  auto bad_page = default_num_pages(10, 10, 1, 0, 1024);
  EXPECT_EQ(bad_page.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad_page.status().message(), HasSubstr("page_size 0"));
  auto negative = default_num_pages(-1, 10, 1, 16, 1024);
  EXPECT_EQ(negative.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(negative.status().message(), HasSubstr("prompt_len (-1)"));
  auto huge = default_num_pages(1 << 20, 0, 1 << 20, 1, 1 << 20);
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(huge.status().message(), HasSubstr("do not fit"));
}

TEST(PagePool, CreateRejectsBadSizes) {
  EXPECT_EQ(PagePool::create(-1, 16).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(PagePool::create(4, 0).status().message(), HasSubstr("page_size 0"));
}

TEST(PagePool, AllocatesLowestPagesFirstAndReusesFreedPages) {
  PagePool pool = PagePool::create(4, 8).value();
  EXPECT_EQ(pool.num_free(), 4);
  EXPECT_EQ(pool.allocate(7).value(), 0);
  EXPECT_EQ(pool.allocate(7).value(), 1);
  EXPECT_EQ(pool.allocate(9).value(), 2);
  EXPECT_EQ(pool.num_used(), 3);
  EXPECT_TRUE(pool.is_allocated(1));
  EXPECT_EQ(pool.owner(2), 9u);
  ASSERT_TRUE(pool.free(7, 1).ok());
  EXPECT_FALSE(pool.is_allocated(1));
  EXPECT_EQ(pool.allocate(9).value(), 1);  // most recently freed first
  EXPECT_EQ(pool.allocate(9).value(), 3);
  EXPECT_EQ(pool.num_free(), 0);
}

TEST(PagePool, ExhaustionIsResourceExhaustedNamingRequestAndCounts) {
  PagePool pool = PagePool::create(2, 4).value();
  ASSERT_TRUE(pool.allocate(1).ok());
  auto many = pool.allocate(5, 2);
  EXPECT_EQ(many.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(many.status().message(), HasSubstr("request 5 needs 2 pages, 1 of 2 pages free"));
  EXPECT_EQ(pool.num_free(), 1);  // all or nothing
  ASSERT_TRUE(pool.allocate(5).ok());
  auto one = pool.allocate(6);
  EXPECT_EQ(one.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(one.status().message(), HasSubstr("request 6 needs 1 page, 0 of 2 pages free"));
}

TEST(PagePool, FreeRefusesForeignDoubleAndOutOfRangePages) {
  PagePool pool = PagePool::create(3, 4).value();
  const int32_t page = pool.allocate(1).value();
  absl::Status foreign = pool.free(2, page);
  EXPECT_EQ(foreign.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(foreign.message(), HasSubstr("request 2 freed page 0, which request 1 owns"));
  ASSERT_TRUE(pool.free(1, page).ok());
  absl::Status twice = pool.free(1, page);
  EXPECT_EQ(twice.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(twice.message(), HasSubstr("already free"));
  absl::Status outside = pool.free(1, 3);
  EXPECT_EQ(outside.code(), absl::StatusCode::kOutOfRange);
  EXPECT_THAT(outside.message(), HasSubstr("page 3 outside the pool of 3 pages"));
}

TEST(PagePool, FencedPagesAreFreedOnlyAfterTheirFenceStepRetired) {
  PagePool pool = PagePool::create(4, 4).value();
  const int32_t a = pool.allocate(1).value();
  const int32_t b = pool.allocate(1).value();
  const int32_t c = pool.allocate(2).value();
  ASSERT_TRUE(pool.fence(1, a, 5).ok());
  ASSERT_TRUE(pool.fence(1, b, 7).ok());
  EXPECT_EQ(pool.state(a), PageState::kFenced);
  EXPECT_TRUE(pool.is_allocated(a));
  PageCounts counts = pool.counts();
  EXPECT_EQ(counts.free, 1);
  EXPECT_EQ(counts.used, 1);
  EXPECT_EQ(counts.fenced, 2);
  EXPECT_EQ(counts.total(), 4);
  EXPECT_EQ(pool.retire_through(4), 0);
  EXPECT_EQ(pool.num_fenced(), 2);
  EXPECT_EQ(pool.retire_through(6), 1);
  EXPECT_EQ(pool.state(a), PageState::kFree);
  EXPECT_EQ(pool.state(b), PageState::kFenced);
  // A fence behind a step that retired already frees the page at once.
  ASSERT_TRUE(pool.fence(2, c, 3).ok());
  EXPECT_EQ(pool.state(c), PageState::kFree);
  EXPECT_EQ(pool.retire_through(7), 1);
  EXPECT_EQ(pool.num_free(), 4);
  EXPECT_TRUE(pool.check_invariants().ok());
}

TEST(PagePool, FenceRefusesFreeForeignAndFencedPages) {
  PagePool pool = PagePool::create(2, 4).value();
  const int32_t page = pool.allocate(1).value();
  absl::Status foreign = pool.fence(2, page, 1);
  EXPECT_EQ(foreign.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(foreign.message(), HasSubstr("request 2 fenced page 0, which request 1 owns"));
  ASSERT_TRUE(pool.fence(1, page, 1).ok());
  absl::Status twice = pool.fence(1, page, 2);
  EXPECT_EQ(twice.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(twice.message(), HasSubstr("request 1 fenced page 0, which is fenced"));
  absl::Status free_page = pool.fence(1, 1, 2);
  EXPECT_THAT(free_page.message(), HasSubstr("page 1, which is already free"));
}

TEST(PagePool, QuarantinedPagesAreCountedButNeverHandedOutAgain) {
  PagePool pool = PagePool::create(3, 4).value();
  const int32_t used = pool.allocate(1).value();
  const int32_t fenced = pool.allocate(1).value();
  ASSERT_TRUE(pool.fence(1, fenced, 9).ok());
  ASSERT_TRUE(pool.quarantine(used).ok());
  ASSERT_TRUE(pool.quarantine(fenced).ok());
  ASSERT_TRUE(pool.quarantine(fenced).ok());  // idempotent
  EXPECT_EQ(pool.retire_through(100), 0);
  PageCounts counts = pool.counts();
  EXPECT_EQ(counts.free, 1);
  EXPECT_EQ(counts.used, 0);
  EXPECT_EQ(counts.fenced, 0);
  EXPECT_EQ(counts.quarantined, 2);
  EXPECT_EQ(pool.allocate(3).value(), 2);
  EXPECT_EQ(pool.allocate(3).status().code(), absl::StatusCode::kResourceExhausted);
  absl::Status freed = pool.free(1, used);
  EXPECT_THAT(freed.message(), HasSubstr("request 1 freed page 0, which is quarantined"));
  EXPECT_EQ(pool.quarantine(7).code(), absl::StatusCode::kOutOfRange);
  EXPECT_TRUE(pool.check_invariants().ok());
}

TEST(BlockTable, AppendTokensAllocatesAllOrNothingAndFenceSkipsQuarantinedPages) {
  PagePool pool = PagePool::create(3, 4).value();
  BlockTable table(8);
  EXPECT_EQ(table.pages_for_append(5, 4), 2);
  ASSERT_TRUE(table.append_tokens(pool, 5).ok());
  EXPECT_EQ(table.context_len(), 5);
  EXPECT_EQ(table.pages_for_append(3, 4), 0);
  absl::Status big = table.append_tokens(pool, 8);
  EXPECT_EQ(big.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(big.message(), HasSubstr("request 8 needs 2 pages, 1 of 3 pages free"));
  EXPECT_EQ(table.context_len(), 5);
  ASSERT_TRUE(pool.quarantine(table.pages()[0]).ok());
  ASSERT_TRUE(table.fence(pool, 2).ok());
  EXPECT_EQ(table.context_len(), 0);
  EXPECT_TRUE(table.pages().empty());
  PageCounts counts = pool.counts();
  EXPECT_EQ(counts.fenced, 1);
  EXPECT_EQ(counts.quarantined, 1);
  EXPECT_EQ(counts.free, 1);
}

TEST(BlockTable, SlotsCrossPageBoundaries) {
  PagePool pool = PagePool::create(8, 4).value();
  BlockTable other(2);
  ASSERT_TRUE(other.append_token(pool).ok());  // takes page 0
  BlockTable table(1);
  std::vector<int32_t> slots;
  for (int i = 0; i < 9; ++i) slots.push_back(table.append_token(pool).value());
  EXPECT_THAT(table.pages(), ElementsAre(1, 2, 3));
  EXPECT_THAT(slots, ElementsAre(4, 5, 6, 7, 8, 9, 10, 11, 12));
  EXPECT_EQ(table.context_len(), 9);
  EXPECT_EQ(table.slot_of(8, 4).value(), 12);
  EXPECT_EQ(table.slot_of(9, 4).status().code(), absl::StatusCode::kOutOfRange);
  std::vector<int32_t> row(5, 99);
  ASSERT_TRUE(table.fill_row(row.data(), 5).ok());
  EXPECT_THAT(row, ElementsAre(1, 2, 3, -1, -1));
  absl::Status small = table.fill_row(row.data(), 2);
  EXPECT_EQ(small.code(), absl::StatusCode::kOutOfRange);
  EXPECT_THAT(small.message(), HasSubstr("request 1 holds 3 pages, more than the block table's 2"));
}

TEST(BlockTable, InterleavedRequestsNeverShareAPageOrSlot) {
  PagePool pool = PagePool::create(16, 3).value();
  std::vector<BlockTable> tables = {BlockTable(10), BlockTable(11), BlockTable(12)};
  std::set<int32_t> slots;
  for (int step = 0; step < 10; ++step) {
    for (size_t r = 0; r < tables.size(); ++r) {
      if (step >= 4 + static_cast<int>(r) * 3) continue;  // different lengths
      const int32_t slot = tables[r].append_token(pool).value();
      EXPECT_TRUE(slots.insert(slot).second) << "slot " << slot << " handed out twice";
    }
  }
  std::set<int32_t> pages;
  for (const BlockTable& t : tables) {
    for (int32_t p : t.pages()) {
      EXPECT_TRUE(pages.insert(p).second) << "page " << p << " shared";
      EXPECT_EQ(pool.owner(p), t.request_id());
    }
  }
  // Releasing one request returns exactly its pages; the others keep theirs.
  const int32_t before = pool.num_free();
  const size_t released = tables[1].pages().size();
  ASSERT_TRUE(tables[1].release(pool).ok());
  EXPECT_EQ(pool.num_free(), before + static_cast<int32_t>(released));
  EXPECT_EQ(tables[1].context_len(), 0);
  for (int32_t p : tables[0].pages()) EXPECT_TRUE(pool.is_allocated(p));
}

TEST(BlockTable, ExhaustionLeavesTheTableUnchanged) {
  PagePool pool = PagePool::create(1, 2).value();
  BlockTable table(3);
  ASSERT_TRUE(table.append_token(pool).ok());
  ASSERT_TRUE(table.append_token(pool).ok());
  auto third = table.append_token(pool);
  EXPECT_EQ(third.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(third.status().message(), HasSubstr("request 3"));
  EXPECT_EQ(table.context_len(), 2);
  EXPECT_EQ(table.pages().size(), 1u);
}

// ---- the prefix cache (docs/design/prefix_cache.md) ----

std::vector<int32_t> page_tokens(int32_t first, int32_t page_size) {
  std::vector<int32_t> t(page_size);
  for (int32_t i = 0; i < page_size; ++i) t[i] = first + i;
  return t;
}

TEST(PrefixCache, ACachedPageIsFoundOnlyUnderItsWholeKey) {
  PagePool pool = PagePool::create(4, 4).value();
  const int32_t a = pool.allocate(1).value();
  const int32_t b = pool.allocate(1).value();
  ASSERT_TRUE(pool.cache(a, -1, page_tokens(10, 4)).value());
  ASSERT_TRUE(pool.cache(b, a, page_tokens(20, 4)).value());
  EXPECT_EQ(pool.num_cached(), 2);
  EXPECT_EQ(pool.lookup(-1, page_tokens(10, 4)), a);
  EXPECT_EQ(pool.lookup(a, page_tokens(20, 4)), b);
  EXPECT_EQ(pool.lookup(-1, page_tokens(20, 4)), std::nullopt);  // the same tokens, no parent
  EXPECT_EQ(pool.lookup(b, page_tokens(20, 4)), std::nullopt);   // another parent
  EXPECT_EQ(pool.lookup(-1, page_tokens(11, 4)), std::nullopt);  // other tokens
  EXPECT_TRUE(pool.check_invariants().ok());
}

TEST(PrefixCache, CacheRefusesPartialFreeAndDuplicatePages) {
  PagePool pool = PagePool::create(4, 4).value();
  const int32_t a = pool.allocate(1).value();
  auto partial = pool.cache(a, -1, {1, 2, 3});
  EXPECT_EQ(partial.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(partial.status().message(), HasSubstr("a cached page is full (4 tokens)"));
  auto free_page = pool.cache(3, -1, page_tokens(0, 4));
  EXPECT_EQ(free_page.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(pool.cache(7, -1, page_tokens(0, 4)).status().code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(pool.cache(a, -1, page_tokens(0, 4)).value());
  EXPECT_FALSE(pool.cache(a, -1, page_tokens(0, 4)).value());  // already cached
  const int32_t twin = pool.allocate(2).value();
  EXPECT_FALSE(pool.cache(twin, -1, page_tokens(0, 4)).value());  // the key is taken
  EXPECT_FALSE(pool.is_cached(twin));
  EXPECT_EQ(pool.lookup(-1, page_tokens(0, 4)), a);
  EXPECT_TRUE(pool.check_invariants().ok());
}

// A page requests 1 and 2 both hold, cached under `tokens` with no parent.
int32_t shared_cached_page(PagePool& pool, const std::vector<int32_t>& tokens) {
  const int32_t a = pool.allocate(1).value();
  EXPECT_TRUE(pool.cache(a, -1, tokens).value());
  EXPECT_TRUE(pool.share(2, a).ok());
  return a;
}

TEST(PrefixCache, SharedPagesStayUsedUntilTheirLastHolderLetsGo) {
  PagePool pool = PagePool::create(3, 4).value();
  const int32_t a = shared_cached_page(pool, page_tokens(0, 4));
  ASSERT_FALSE(HasFailure());
  EXPECT_EQ(pool.refs(a), 2);
  ASSERT_TRUE(pool.fence(1, a, 5).ok());  // the allocating request lets go behind step 5
  EXPECT_EQ(pool.state(a), PageState::kUsed);
  ASSERT_TRUE(pool.fence(2, a, 3).ok());  // the last holder's fence is older: 5 still holds
  EXPECT_EQ(pool.state(a), PageState::kFenced);
  EXPECT_EQ(pool.retire_through(4), 0);
  EXPECT_EQ(pool.retire_through(5), 1);
  EXPECT_EQ(pool.state(a), PageState::kFree);
  EXPECT_EQ(pool.num_evictable(), 1);
  EXPECT_TRUE(pool.check_invariants().ok());
}

TEST(PrefixCache, HitsReviveFencedAndEvictablePages) {
  PagePool pool = PagePool::create(2, 4).value();
  const int32_t a = pool.allocate(1).value();
  ASSERT_TRUE(pool.cache(a, -1, page_tokens(0, 4)).value());
  ASSERT_TRUE(pool.fence(1, a, 7).ok());
  ASSERT_EQ(pool.state(a), PageState::kFenced);
  ASSERT_TRUE(pool.share(2, a).ok());  // a hit on a fenced page: used again, no longer fenced
  EXPECT_EQ(pool.state(a), PageState::kUsed);
  EXPECT_EQ(pool.num_fenced(), 0);
  EXPECT_EQ(pool.retire_through(9), 0);
  ASSERT_TRUE(pool.free(2, a).ok());
  EXPECT_EQ(pool.state(a), PageState::kFree);
  ASSERT_TRUE(pool.share(3, a).ok());  // a hit on an evictable page
  EXPECT_EQ(pool.num_free(), 1);
  EXPECT_EQ(pool.num_evictable(), 0);
  const int32_t other = pool.allocate(4).value();
  EXPECT_TRUE(pool.check_invariants().ok());
  auto not_cached = pool.share(5, other);
  EXPECT_EQ(not_cached.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(not_cached.message(), HasSubstr("not in the prefix cache"));
  EXPECT_EQ(pool.share(5, 9).code(), absl::StatusCode::kOutOfRange);
}

TEST(PrefixCache, PlainFreePagesGoFirstThenTheLeastRecentlyFreedCachedPage) {
  PagePool pool = PagePool::create(3, 4).value();
  const int32_t a = pool.allocate(1).value();
  const int32_t b = pool.allocate(1).value();
  const int32_t c = pool.allocate(1).value();
  ASSERT_TRUE(pool.cache(a, -1, page_tokens(0, 4)).value());
  ASSERT_TRUE(pool.cache(b, -1, page_tokens(4, 4)).value());
  ASSERT_TRUE(pool.free(1, b).ok());  // b is freed before a: evicted first
  ASSERT_TRUE(pool.free(1, a).ok());
  ASSERT_TRUE(pool.free(1, c).ok());
  EXPECT_EQ(pool.num_free(), 3);
  EXPECT_EQ(pool.allocate(2).value(), c);  // the plain free page
  EXPECT_EQ(pool.allocate(2).value(), b);  // evicts b
  EXPECT_EQ(pool.lookup(-1, page_tokens(4, 4)), std::nullopt);
  EXPECT_EQ(pool.lookup(-1, page_tokens(0, 4)), a);
  EXPECT_EQ(pool.num_cached(), 1);
  EXPECT_TRUE(pool.check_invariants().ok());
}

// A pool of two pages of 2 tokens, both held by request 1 and cached as one chain: a holds
// {1, 2}, b after it {3, 4}.
class PrefixCacheChain : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(pool.cache(a, -1, {1, 2}).value());
    ASSERT_TRUE(pool.cache(b, a, {3, 4}).value());
  }

  PagePool pool = PagePool::create(2, 2).value();
  const int32_t a = pool.allocate(1).value();
  const int32_t b = pool.allocate(1).value();
};

TEST_F(PrefixCacheChain, AReusedParentLeavesItsOldChildrenUnreachable) {
  ASSERT_TRUE(pool.free(1, a).ok());
  // a is evicted and reallocated (a new generation) for other tokens: b, still held and
  // cached, no longer matches a chain through a.
  EXPECT_EQ(pool.allocate(2).value(), a);
  EXPECT_EQ(pool.lookup(-1, {1, 2}), std::nullopt);
  EXPECT_EQ(pool.lookup(a, {3, 4}), std::nullopt);
  EXPECT_TRUE(pool.is_cached(b));
  EXPECT_TRUE(pool.check_invariants().ok());
}

TEST(PrefixCache, QuarantineDropsAPageFromTheCacheForEveryHolder) {
  PagePool pool = PagePool::create(2, 2).value();
  const int32_t a = shared_cached_page(pool, {1, 2});
  ASSERT_FALSE(HasFailure());
  ASSERT_TRUE(pool.quarantine(a).ok());
  EXPECT_EQ(pool.lookup(-1, {1, 2}), std::nullopt);
  EXPECT_EQ(pool.num_quarantined(), 1);
  EXPECT_EQ(pool.num_used(), 0);
  BlockTable t1(1), t2(2);
  ASSERT_TRUE(t1.adopt_cached(std::vector<int32_t>{a}, 2).ok());
  ASSERT_TRUE(t2.adopt_cached(std::vector<int32_t>{a}, 2).ok());
  EXPECT_TRUE(t1.fence(pool, 3).ok());  // both holders skip the quarantined page
  EXPECT_TRUE(t2.fence(pool, 3).ok());
  EXPECT_EQ(pool.state(a), PageState::kQuarantined);
  EXPECT_TRUE(pool.check_invariants().ok());
}

TEST_F(PrefixCacheChain, ResetKeepsHeldPagesAndFreesCachedOnes) {
  ASSERT_TRUE(pool.free(1, b).ok());
  EXPECT_EQ(pool.reset_cache(), 2);
  EXPECT_EQ(pool.num_cached(), 0);
  EXPECT_EQ(pool.num_evictable(), 0);
  EXPECT_EQ(pool.num_free(), 1);
  EXPECT_EQ(pool.state(a), PageState::kUsed);
  EXPECT_EQ(pool.lookup(-1, {1, 2}), std::nullopt);
  EXPECT_TRUE(pool.check_invariants().ok());
}

TEST(BlockTable, AdoptCachedStartsAtTheCachedPositionsAndAppendsAfterThem) {
  PagePool pool = PagePool::create(3, 2).value();
  const int32_t a = shared_cached_page(pool, {5, 6});
  ASSERT_FALSE(HasFailure());
  BlockTable t(2);
  ASSERT_TRUE(t.adopt_cached(std::vector<int32_t>{a}, 2).ok());
  EXPECT_EQ(t.context_len(), 2);
  EXPECT_EQ(t.append_token(pool).value(), 2 * 1);  // page 1, offset 0
  EXPECT_THAT(t.pages(), ElementsAre(a, 1));
  EXPECT_EQ(t.adopt_cached(std::vector<int32_t>{a}, 2).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(pool.check_invariants().ok());
}

}  // namespace
}  // namespace simpler::llm
