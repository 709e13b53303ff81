// CapturedGraphCache: a lane's captured graphs by (callable, shape key), bounded, LRU. Private
// to the runtime.
#pragma once

#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "chip/captured_graph.h"
#include "simpler/task/callable.h"
#include "simpler/worker/worker_stats.h"

namespace simpler::worker {

// At most `capacity` graphs, keyed by (callable, key); inserting one more drops the least
// recently used. The cache holds one reference per graph; a run replaying a graph holds its
// own, so dropping a graph never frees it under a run (it goes when the last run retires).
// Thread-compatible (the lane's mutex guards it).
class CapturedGraphCache {
 public:
  explicit CapturedGraphCache(int32_t capacity) : capacity_(capacity) {}

  // The graph of (`callable`, `key`), made the most recently used; null when there is none.
  std::shared_ptr<const chip::CapturedGraph> find(const task::ChipCallable* callable, uint64_t key);
  // Caches `graph` under (`callable`, graph->key()) unless a graph is already there (the first
  // capture wins), dropping the least recently used beyond the capacity. Counts a capture.
  void insert(const task::ChipCallable* callable, std::shared_ptr<const chip::CapturedGraph> graph);
  // Drops the graph of (`callable`, `key`), if any.
  void erase(const task::ChipCallable* callable, uint64_t key);
  // Drops every graph that uses device memory overlapping [address, address + bytes) at a fixed
  // address (the memory is being freed: a later allocation there must not be mistaken for it).
  void erase_using(uint64_t address, uint64_t bytes);
  // Whether every fixed range of (`callable`, `key`)'s graph was found live, in the allocation it
  // recorded, when the device's free count was `frees` (Device::free_count): while the count has
  // not moved since, they still are, and a replay's admission need not look them up again.
  // set_fixed_live_at records such a check (no-op when there is no such graph).
  bool fixed_live_at(const task::ChipCallable* callable, uint64_t key, uint64_t frees) const;
  void set_fixed_live_at(const task::ChipCallable* callable, uint64_t key, uint64_t frees);
  void count_replay() { ++replays_; }
  void count_stale_capture() { ++stale_captures_; }
  CaptureStats stats() const;

 private:
  struct Entry {
    const task::ChipCallable* callable = nullptr;
    std::shared_ptr<const chip::CapturedGraph> graph;
    uint64_t fixed_live_at = 0;  // 1 + the free count of the last check that found them live
  };
  using Key = std::pair<const task::ChipCallable*, uint64_t>;
  void drop(std::list<Entry>::iterator it);

  const int32_t capacity_;
  std::list<Entry> lru_;  // most recently used first
  std::map<Key, std::list<Entry>::iterator> index_;
  // Dropped graphs, to count those runs still hold; pruned of freed ones at each drop.
  std::vector<std::weak_ptr<const chip::CapturedGraph>> dropped_;
  uint64_t captures_ = 0;
  uint64_t replays_ = 0;
  uint64_t evictions_ = 0;
  uint64_t stale_captures_ = 0;
};

}  // namespace simpler::worker
