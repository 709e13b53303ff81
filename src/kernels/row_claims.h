// Internal to the llm kernels: the rows of an SPMD task handed out to its blocks as each becomes
// free (task::KernelContext::task_lines), instead of a fixed share per block_idx.
//
// Why: the cores of a device do not run at one pace (on a 2-vCPU VM one vCPU streams 10-20%
// slower than the other for minutes at a time, and a block started later ends later), so with
// fixed shares the task's first block to finish waits for its last; summed over a decode step of
// 341 tasks that was 1.3-3.4 ms of a 12-16 ms step (docs/design/quantized_matmul.md).
//
// How (work stealing over row ranges, the scheme of a persistent GPU kernel's atomic work
// counters): block b starts with its block_range rows and takes them from their front, an eighth
// of what is left of them at a time but at least `min_rows`, rounded up to a multiple of `align`
// rows (guided self-scheduling: few claims while much is left, small ones at the end); once its own
// are gone it takes rows from the back of the other blocks' (b + 1 first, then around), ceil(left /
// (2·block_dim)) of them at a time but at least `min_rows`, until none is left anywhere. So the
// blocks end within about a claim of min_rows of each other. Block b's line holds one word: the
// rows (or units: a claim's unit of rows) taken from the front of b's range in its low 32 bits
// and from its back in its high 32 bits,
// both 0 when the task starts; a block takes rows by a compare-and-swap on the word, so every row
// goes to exactly one block. A block's own claims touch only its own line (no line passes between
// cores until a block runs out and takes from another).
//
// One claim scheme per task: the words start at 0 once, so a kernel runs one RowClaims loop per
// block over its task's lines (a second loop would find the rows taken).
//
// Which block computes a row must not change what the kernel writes for it: the kernels that use
// this compute every output row on its own (the matmuls: each y row from its W row alone; the
// attention: each (kv head, row) pair's output from its own query and cached positions), so the
// results are bitwise those of any fixed split.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "simpler/kernels/kernels.h"
#include "simpler/task/callable.h"

namespace simpler::llm {

class RowClaims {
 public:
  // The matmuls' claim granularity (rows).
  static constexpr int64_t kMatmulAlign = 16;

  // Rows [0, n) of the task of `ctx`'s block, at least `min_rows` (> 0) a claim but the last,
  // each claim a multiple of `align` (> 0) rows but the last of a range (the matmuls take W rows 8
  // or 16 at a time, and a short group costs a whole one). With `unit` (> 0; n a multiple of it)
  // the rows go in whole units of `unit` rows — the blocks' shares too, so no claim splits a unit
  // (the matmuls' groups of interleaved W rows; the attention's tiles) — and `align` counts units.
  // Without task_lines, with one block, or with n / unit past 2^32 - 1: the block's block_range
  // (of units), once.
  RowClaims(const task::KernelContext& ctx, int64_t n, int64_t min_rows,
            int64_t align = kMatmulAlign, int64_t unit = 1)
      : lines_(ctx.task_lines),
        unit_(unit > 0 ? unit : 1),
        n_(n / unit_),
        min_rows_(std::max<int64_t>((min_rows + unit_ - 1) / unit_, 1)),
        align_(align > 0 ? align : 1),
        self_(ctx.block_idx),
        blocks_(ctx.block_dim),
        victim_(ctx.block_idx) {
    if (lines_ == nullptr || blocks_ <= 1 || n_ > kMaxRows) {
      lines_ = nullptr;
      whole_ = block_range(n_, ctx.block_idx, ctx.block_dim);
    }
  }

  // The next rows this block computes, non-empty; false when no row is left to claim. With
  // `ahead`: where the rows this block most likely computes next end (its own range's end after
  // a claim of its own rows; the claim's end after one taken from another block's back, whose
  // following rows are taken already), for a kernel's prefetch.
  bool next(BlockRange* rows, int64_t* ahead = nullptr) {
    if (!next_units(rows, ahead)) return false;
    rows->begin *= unit_;
    rows->end *= unit_;
    if (ahead != nullptr) *ahead *= unit_;
    return true;
  }

 private:
  static constexpr int64_t kMaxRows = 0xFFFFFFFFll;

  // next() in units.
  bool next_units(BlockRange* rows, int64_t* ahead) {
    if (lines_ == nullptr) {
      if (done_ || whole_.begin >= whole_.end) return false;
      done_ = true;
      *rows = whole_;
      if (ahead != nullptr) *ahead = whole_.end;
      return true;
    }
    while (victim_ < self_ + blocks_) {
      const int32_t b = victim_ % blocks_;
      const bool own = b == self_;
      if (take(b, own, rows)) {
        if (ahead != nullptr) *ahead = own ? block_range(n_, b, blocks_).end : rows->end;
        return true;
      }
      ++victim_;  // b has nothing left: the next block's rows
    }
    return false;
  }

  // Rows from block b's range: from its front (own) or its back; false when it has none left.
  bool take(int32_t b, bool own, BlockRange* rows) const {
    const BlockRange r = block_range(n_, b, blocks_);
    std::atomic<uint64_t>& word = lines_[b].word;
    uint64_t w = word.load(std::memory_order_relaxed);
    for (;;) {
      const int64_t front = static_cast<int64_t>(w & kMaxRows);
      const int64_t back = static_cast<int64_t>(w >> 32);
      const int64_t left = r.end - r.begin - front - back;
      if (left <= 0) return false;
      const int64_t share = own ? (left + 7) / 8 : (left + 2 * blocks_ - 1) / (2 * blocks_);
      const int64_t n = std::min((std::max(min_rows_, share) + align_ - 1) / align_ * align_, left);
      const uint64_t next =
          own ? w + static_cast<uint64_t>(n) : w + (static_cast<uint64_t>(n) << 32);
      if (word.compare_exchange_weak(w, next, std::memory_order_relaxed)) {
        *rows = own ? BlockRange{r.begin + front, r.begin + front + n}
                    : BlockRange{r.end - back - n, r.end - back};
        return true;
      }
    }
  }

  task::TaskLine* lines_;
  int64_t unit_, n_, min_rows_, align_;  // n_, min_rows_ and align_ in units
  int32_t self_, blocks_, victim_;
  BlockRange whole_;
  bool done_ = false;
};

}  // namespace simpler::llm
