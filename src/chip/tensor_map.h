// TensorMap: dependency inference over device address ranges.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <new>
#include <type_traits>
#include <vector>

#include "absl/container/inlined_vector.h"

namespace simpler::chip {

// Tracks, for every byte range touched by the tasks of one run, the last task
// that wrote it and the tasks that read it since. `access` returns the
// dependencies a new access creates:
//   read  after write  (RAW): a reader waits for the last writer of any overlapping byte;
//   write after read   (WAR): a writer waits for every reader since the last write;
//   write after write  (WAW): a writer waits for the last writer.
// Overlap is byte-exact over [begin, end), partial overlap included; entries
// split at range boundaries. Ranges whose writer and readers have all
// finished are dropped once the map has grown to twice its size after the
// last such sweep (at least kMinSweepEntries), so it tracks about as many
// ranges as there are unfinished tasks rather than every range the run ever
// touched (the sweeps add amortized O(1) per access). The map's nodes come from
// the TensorMap's own free list (NodePool), kept across clear() and moves, and a
// range's first readers are stored in its node: a map kept from run to run
// allocates nothing per access once it has held as many ranges as a run needs.
// Thread-compatible (one orchestrating thread).
class TensorMap {
 public:
  using IsDone = std::function<bool(uint64_t task)>;

  // Records that `task` reads (write=false) or writes [begin, end) and appends
  // to `deps` the earlier tasks it must wait for (unsorted, may repeat; never
  // `task` itself, never a task for which is_done() holds).
  // `is_done` must be monotone (once true for a task, true on every later
  // call) and must never hold for `task` or any task still to finish: a
  // sweep drops ranges on its word.
  void access(uint64_t begin, uint64_t end, bool write, uint64_t task, const IsDone& is_done,
              std::vector<uint64_t>* deps);

  TensorMap() = default;
  // Moves swap the maps with their node pools (each map keeps the pool its nodes came from).
  TensorMap(TensorMap&& other) noexcept { swap(other); }
  TensorMap& operator=(TensorMap&& other) noexcept {
    swap(other);
    return *this;
  }
  TensorMap(const TensorMap&) = delete;
  TensorMap& operator=(const TensorMap&) = delete;

  void clear() {
    entries_.clear();  // the nodes go back to the pool
    sweep_at_ = kMinSweepEntries;
  }
  // Number of disjoint tracked ranges (for tests and diagnostics).
  size_t size() const { return entries_.size(); }

  static constexpr size_t kMinSweepEntries = 256;

 private:
  // Blocks of one size (the map's node) recycled through a free list; the chunks they are cut
  // from go back with the pool. Owner-thread only.
  class NodePool {
   public:
    NodePool() = default;
    NodePool(const NodePool&) = delete;
    NodePool& operator=(const NodePool&) = delete;
    // A block of `bytes`, aligned for any node; null when `bytes` is not the size the first call
    // asked for (the map's node: the caller takes such memory from the heap).
    void* allocate(size_t bytes);
    // Whether blocks of `bytes` come from this pool.
    bool holds(size_t bytes) const { return bytes == node_bytes_; }
    void deallocate(void* p) {
      auto* b = static_cast<FreeBlock*>(p);
      b->next = free_;
      free_ = b;
    }

   private:
    struct FreeBlock {
      FreeBlock* next;
    };
    static constexpr size_t kBlocksPerChunk = 256;
    size_t node_bytes_ = 0;   // what the first call asked for
    size_t block_bytes_ = 0;  // node_bytes_ rounded up to the alignment
    FreeBlock* free_ = nullptr;
    std::vector<std::unique_ptr<std::byte[]>> chunks_;
    size_t chunk_left_ = 0;  // blocks not yet handed out in chunks_.back()
  };
  // The map's allocator: single nodes from the pool, anything else from the heap. It moves and
  // swaps with its map, so a map's nodes always go back to the pool they came from.
  template <typename T>
  struct PoolAllocator {
    using value_type = T;
    using propagate_on_container_move_assignment = std::true_type;
    using propagate_on_container_swap = std::true_type;
    NodePool* pool = nullptr;
    explicit PoolAllocator(NodePool* p) : pool(p) {}
    template <typename U>
    PoolAllocator(const PoolAllocator<U>& o) : pool(o.pool) {}  // NOLINT: rebinding
    T* allocate(size_t n) {
      if (n == 1 && alignof(T) <= alignof(std::max_align_t)) {
        if (void* p = pool->allocate(sizeof(T)); p != nullptr) return static_cast<T*>(p);
      }
      return static_cast<T*>(::operator new(n * sizeof(T)));
    }
    void deallocate(T* p, size_t n) {
      if (n == 1 && alignof(T) <= alignof(std::max_align_t) && pool->holds(sizeof(T))) {
        pool->deallocate(p);
      } else {
        ::operator delete(p);
      }
    }
    template <typename U>
    bool operator==(const PoolAllocator<U>& o) const {
      return pool == o.pool;
    }
  };

  static constexpr uint64_t kNoWriter = ~uint64_t{0};
  struct Entry {
    uint64_t end = 0;
    uint64_t writer = kNoWriter;
    absl::InlinedVector<uint64_t, 2> readers;
  };
  using Entries = std::map<uint64_t, Entry, std::less<uint64_t>,
                           PoolAllocator<std::pair<const uint64_t, Entry>>>;

  void swap(TensorMap& other) noexcept {
    pool_.swap(other.pool_);
    entries_.swap(other.entries_);
    std::swap(sweep_at_, other.sweep_at_);
  }
  // Splits the entry containing `at` (if any) so that an entry starts at `at`.
  void split(uint64_t at);
  // Makes `task` a reader of `e` (once), pruning finished readers from a long list.
  static void add_reader(Entry& e, uint64_t task, const IsDone& is_done);
  // Drops ranges no unfinished task touches.
  void sweep(const IsDone& is_done);

  // Declared before entries_, destroyed after it; on the heap, so that a move leaves the
  // allocator's pointer valid.
  std::unique_ptr<NodePool> pool_ = std::make_unique<NodePool>();
  Entries entries_{Entries::allocator_type(pool_.get())};
  size_t sweep_at_ = kMinSweepEntries;  // sweep when entries_ reaches this size
};

}  // namespace simpler::chip
