#include "worker/captured_graph_cache.h"

#include <algorithm>

namespace simpler::worker {

std::shared_ptr<const chip::CapturedGraph> CapturedGraphCache::find(
    const task::ChipCallable* callable, uint64_t key) {
  auto it = index_.find({callable, key});
  if (it == index_.end()) return nullptr;
  lru_.splice(lru_.begin(), lru_, it->second);
  return it->second->graph;
}

void CapturedGraphCache::insert(const task::ChipCallable* callable,
                                std::shared_ptr<const chip::CapturedGraph> graph) {
  const Key key{callable, graph->key()};
  if (index_.contains(key)) return;
  lru_.push_front({callable, std::move(graph)});
  index_.emplace(key, lru_.begin());
  ++captures_;
  while (static_cast<int32_t>(lru_.size()) > capacity_) drop(std::prev(lru_.end()));
}

bool CapturedGraphCache::fixed_live_at(const task::ChipCallable* callable, uint64_t key,
                                       uint64_t frees) const {
  auto it = index_.find({callable, key});
  return it != index_.end() && it->second->fixed_live_at == frees + 1;
}

void CapturedGraphCache::set_fixed_live_at(const task::ChipCallable* callable, uint64_t key,
                                           uint64_t frees) {
  auto it = index_.find({callable, key});
  if (it != index_.end()) it->second->fixed_live_at = frees + 1;
}

void CapturedGraphCache::erase(const task::ChipCallable* callable, uint64_t key) {
  auto it = index_.find({callable, key});
  if (it != index_.end()) drop(it->second);
}

void CapturedGraphCache::erase_using(uint64_t address, uint64_t bytes) {
  for (auto it = lru_.begin(); it != lru_.end();) {
    const auto& fixed = it->graph->fixed();
    const bool uses = std::any_of(fixed.begin(), fixed.end(), [&](const auto& r) {
      return r.begin < address + bytes && address < r.end;
    });
    auto next = std::next(it);
    if (uses) drop(it);
    it = next;
  }
}

void CapturedGraphCache::drop(std::list<Entry>::iterator it) {
  std::erase_if(dropped_, [](const auto& w) { return w.expired(); });
  dropped_.push_back(it->graph);
  index_.erase({it->callable, it->graph->key()});
  lru_.erase(it);
  ++evictions_;
}

CaptureStats CapturedGraphCache::stats() const {
  CaptureStats s;
  s.graphs = static_cast<int32_t>(lru_.size());
  s.captures = captures_;
  s.replays = replays_;
  s.evictions = evictions_;
  s.stale_captures = stale_captures_;
  s.evicted_in_use = static_cast<int32_t>(
      std::count_if(dropped_.begin(), dropped_.end(), [](const auto& w) { return !w.expired(); }));
  return s;
}

}  // namespace simpler::worker
