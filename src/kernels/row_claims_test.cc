#include "kernels/row_claims.h"

#include <atomic>
#include <cstdint>
#include <thread>
#include <utility>
#include <vector>

#include "gtest/gtest.h"

namespace simpler::llm {
namespace {

task::KernelContext block(int32_t b, int32_t blocks, task::TaskLine* lines) {
  task::KernelContext ctx;
  ctx.block_idx = b;
  ctx.block_dim = blocks;
  ctx.task_lines = lines;
  return ctx;
}

std::vector<BlockRange> drain(RowClaims& claims) {
  std::vector<BlockRange> got;
  BlockRange r;
  while (claims.next(&r)) got.push_back(r);
  return got;
}

// Without lines (a device that gives none) or with one block, a block gets its block_range once.
TEST(RowClaims, WithoutLinesOrForOneBlockABlockGetsItsFixedShareOnce) {
  RowClaims none(block(1, 3, nullptr), 100, 8);
  const std::vector<BlockRange> got = drain(none);
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].begin, 33);
  EXPECT_EQ(got[0].end, 66);
  std::vector<task::TaskLine> lines(1);
  RowClaims one(block(0, 1, lines.data()), 100, 8);
  const std::vector<BlockRange> all = drain(one);
  ASSERT_EQ(all.size(), 1u);
  EXPECT_EQ(all[0].begin, 0);
  EXPECT_EQ(all[0].end, 100);
  RowClaims empty(block(0, 3, nullptr), 2, 8);  // a block whose share is empty gets nothing
  EXPECT_TRUE(drain(empty).empty());
}

// An alignment of 1 (the attention's pairs at batch 1) takes claims of any size: block 0 of 2 over
// 8 items with a minimum of 1 claims its 4 own items one at a time, then the other block's from its
// back; an alignment of 0 or less counts as 1. The matmuls' alignment (16) rounds the same claims
// up: the block's 4 items at once, then the other block's 4.
TEST(RowClaims, AClaimAlignmentOfOneClaimsItemsOneByOne) {
  using Ranges = std::vector<std::pair<int64_t, int64_t>>;
  auto claimed = [](int64_t align) {
    std::vector<task::TaskLine> lines(2);
    RowClaims claims(block(0, 2, lines.data()), 8, 1, align);
    Ranges ranges;
    for (const BlockRange& r : drain(claims)) ranges.push_back({r.begin, r.end});
    return ranges;
  };
  const Ranges one_by_one = {{0, 1}, {1, 2}, {2, 3}, {3, 4}, {7, 8}, {6, 7}, {5, 6}, {4, 5}};
  for (int64_t align : {1, 0, -3}) EXPECT_EQ(claimed(align), one_by_one) << "align " << align;
  EXPECT_EQ(claimed(RowClaims::kMatmulAlign), (Ranges{{0, 4}, {4, 8}}));
}

// With a unit (the matmuls' groups of 16 interleaved W rows, the attention's tiles), every claim
// and every block's share is whole units, though the rows split by block_range would not be: 1040
// rows in units of 16 over three blocks, in turn and on threads, each row claimed once; without
// lines, block 1's share is units 21-43 (rows 336-688), not block_range's rows 346-693.
TEST(RowClaims, AUnitMakesEveryClaimAndShareWholeUnits) {
  for (bool threads : {false, true}) {
    std::vector<task::TaskLine> lines(3);
    std::vector<std::vector<BlockRange>> got(3);
    auto run = [&](int32_t b) {
      RowClaims claims(block(b, 3, lines.data()), 1040, 64, 1, 16);
      got[b] = drain(claims);
    };
    if (threads) {
      std::vector<std::thread> ts;
      for (int32_t b = 0; b < 3; ++b) ts.emplace_back(run, b);
      for (std::thread& t : ts) t.join();
    } else {
      for (int32_t b = 0; b < 3; ++b) run(b);
    }
    std::vector<int> seen(1040, 0);
    for (const std::vector<BlockRange>& ranges : got) {
      for (const BlockRange& r : ranges) {
        EXPECT_EQ(r.begin % 16, 0) << r.begin;
        EXPECT_EQ(r.end % 16, 0) << r.end;
        for (int64_t i = r.begin; i < r.end; ++i) ++seen[static_cast<size_t>(i)];
      }
    }
    for (int v : seen) ASSERT_EQ(v, 1) << (threads ? "on threads" : "in turn");
  }
  RowClaims none(block(1, 3, nullptr), 1040, 64, 1, 16);
  const std::vector<BlockRange> share = drain(none);
  ASSERT_EQ(share.size(), 1u);
  EXPECT_EQ(share[0].begin, 336);
  EXPECT_EQ(share[0].end, 688);
}

// A block takes its own rows from their front, an eighth of what is left but at least min_rows
// at a time, then the other blocks' rows from their backs, a share of what is left each time; a
// block that comes later finds them taken.
TEST(RowClaims, ABlockTakesItsOwnRowsInChunksThenTheOthersFromTheirBacks) {
  std::vector<task::TaskLine> lines(2);
  RowClaims first(block(0, 2, lines.data()), 100, 16);
  BlockRange r;
  const std::vector<std::pair<int64_t, int64_t>> own = {{0, 16}, {16, 32}, {32, 48}, {48, 50}};
  int64_t ahead = -1;
  for (const auto& [b, e] : own) {
    ASSERT_TRUE(first.next(&r, &ahead));
    EXPECT_EQ(r.begin, b);
    EXPECT_EQ(r.end, e);
    EXPECT_EQ(ahead, 50);  // the rows it claims next: its own, up to its range's end
  }
  // block 1's 50 rows from the back: ceil(left / 4) but at least 16, then what is left
  const std::vector<std::pair<int64_t, int64_t>> stolen = {{84, 100}, {68, 84}, {52, 68}, {50, 52}};
  for (const auto& [b, e] : stolen) {
    ASSERT_TRUE(first.next(&r, &ahead));
    EXPECT_EQ(r.begin, b);
    EXPECT_EQ(r.end, e);
    EXPECT_EQ(ahead, e);  // the rows after a stolen claim are taken already
  }
  EXPECT_FALSE(first.next(&r));
  RowClaims late(block(1, 2, lines.data()), 100, 16);
  EXPECT_FALSE(late.next(&r));
}

// Guided: a block's claims of its own rows shrink as they run out (an eighth of what is left,
// rounded up to 16 rows), down to min_rows, then what is left.
TEST(RowClaims, ABlocksClaimsShrinkAsItsRowsRunOut) {
  std::vector<task::TaskLine> lines(2);
  RowClaims claims(block(0, 2, lines.data()), 1000, 16);  // block 0 owns [0, 500)
  std::vector<int64_t> sizes;
  BlockRange r;
  int64_t at = 0;
  while (claims.next(&r) && r.end <= 500) {
    EXPECT_EQ(r.begin, at);
    at = r.end;
    sizes.push_back(r.end - r.begin);
  }
  EXPECT_EQ(at, 500);
  ASSERT_GE(sizes.size(), 4u);
  EXPECT_EQ(sizes[0], 64);  // ceil(500 / 8) = 63, a multiple of 16
  EXPECT_EQ(sizes[1], 64);  // ceil(436 / 8) = 55
  EXPECT_EQ(sizes[2], 48);  // ceil(372 / 8) = 47
  for (size_t i = 1; i < sizes.size(); ++i) EXPECT_LE(sizes[i], sizes[i - 1]);
  for (size_t i = 0; i + 1 < sizes.size(); ++i) EXPECT_EQ(sizes[i] % 16, 0) << i;
  EXPECT_EQ(sizes[sizes.size() - 2], 16);
  EXPECT_LE(sizes.back(), 16);
}

// Blocks claiming in turn, one claim each round, cover every row exactly once, whichever order
// they come in (5 blocks over 1009 rows, claims of at least 7).
TEST(RowClaims, BlocksClaimingInTurnCoverEveryRowOnce) {
  const int32_t blocks = 5;
  const int64_t n = 1009;
  std::vector<task::TaskLine> lines(blocks);
  std::vector<RowClaims> claims;
  for (int32_t b = 0; b < blocks; ++b) claims.emplace_back(block(b, blocks, lines.data()), n, 7);
  std::vector<int> seen(n, 0);
  std::vector<bool> done(blocks, false);
  int finished = 0;
  for (int turn = 0; finished < blocks; ++turn) {
    const int32_t b = (turn * 3) % blocks;  // an uneven order
    if (done[b]) continue;
    BlockRange r;
    if (!claims[b].next(&r)) {
      done[b] = true;
      ++finished;
      continue;
    }
    ASSERT_LT(r.begin, r.end);
    for (int64_t i = r.begin; i < r.end; ++i) ++seen[i];
  }
  EXPECT_EQ(seen, std::vector<int>(n, 1));
}

// Blocks on threads at once (each a slower or faster "core"): every row claimed exactly once.
TEST(RowClaims, BlocksOnThreadsAtOnceClaimEveryRowExactlyOnce) {
  const int32_t blocks = 4;
  const int64_t n = 20000;
  for (int round = 0; round < 20; ++round) {
    std::vector<task::TaskLine> lines(blocks);
    std::vector<std::atomic<int>> seen(n);
    std::vector<std::thread> threads;
    for (int32_t b = 0; b < blocks; ++b) {
      threads.emplace_back([&, b] {
        RowClaims claims(block(b, blocks, lines.data()), n, 16);
        BlockRange r;
        while (claims.next(&r)) {
          for (int64_t i = r.begin; i < r.end; ++i) seen[i].fetch_add(1);
          if (b == 0) std::this_thread::yield();  // block 0 the slow one
        }
      });
    }
    for (std::thread& t : threads) t.join();
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(seen[i].load(), 1) << "row " << i;
  }
}

}  // namespace
}  // namespace simpler::llm
