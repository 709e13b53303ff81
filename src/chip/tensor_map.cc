#include "chip/tensor_map.h"

#include <algorithm>
#include <iterator>

namespace simpler::chip {

void* TensorMap::NodePool::allocate(size_t bytes) {
  if (node_bytes_ == 0) {
    constexpr size_t kAlign = alignof(std::max_align_t);
    node_bytes_ = bytes;
    block_bytes_ = (std::max(bytes, sizeof(FreeBlock)) + kAlign - 1) / kAlign * kAlign;
  }
  if (bytes != node_bytes_) return nullptr;
  if (free_ != nullptr) {
    FreeBlock* b = free_;
    free_ = b->next;
    return b;
  }
  if (chunk_left_ == 0) {
    // operator new[] aligns for any fundamental type (max_align_t).
    chunks_.emplace_back(new std::byte[block_bytes_ * kBlocksPerChunk]);
    chunk_left_ = kBlocksPerChunk;
  }
  return chunks_.back().get() + block_bytes_ * (kBlocksPerChunk - chunk_left_--);
}

void TensorMap::split(uint64_t at) {
  auto it = entries_.upper_bound(at);
  if (it == entries_.begin()) return;
  --it;
  if (it->first == at || it->second.end <= at) return;
  Entry tail = it->second;  // same writer and readers
  it->second.end = at;
  entries_.emplace(at, std::move(tail));
}

void TensorMap::add_reader(Entry& e, uint64_t task, const IsDone& is_done) {
  if (e.readers.size() >= 8) {
    e.readers.erase(std::remove_if(e.readers.begin(), e.readers.end(), std::ref(is_done)),
                    e.readers.end());
  }
  if (e.readers.empty() || e.readers.back() != task) e.readers.push_back(task);
}

void TensorMap::sweep(const IsDone& is_done) {
  // Usually every tracked range is finished (independent tasks that ran as they were submitted):
  // then the map is emptied whole, with no rebalancing erase per node.
  const bool all_done = std::all_of(entries_.begin(), entries_.end(), [&](const auto& kv) {
    const Entry& e = kv.second;
    return (e.writer == kNoWriter || is_done(e.writer)) &&
           std::all_of(e.readers.begin(), e.readers.end(), std::ref(is_done));
  });
  if (all_done) {
    entries_.clear();
    sweep_at_ = kMinSweepEntries;
    return;
  }
  for (auto it = entries_.begin(); it != entries_.end();) {
    Entry& e = it->second;
    e.readers.erase(std::remove_if(e.readers.begin(), e.readers.end(), std::ref(is_done)),
                    e.readers.end());
    if (e.readers.empty() && (e.writer == kNoWriter || is_done(e.writer))) {
      it = entries_.erase(it);
    } else {
      ++it;
    }
  }
  sweep_at_ = std::max(kMinSweepEntries, 2 * entries_.size());
}

void TensorMap::access(uint64_t begin, uint64_t end, bool write, uint64_t task,
                       const IsDone& is_done, std::vector<uint64_t>* deps) {
  if (end <= begin) return;
  // Before this access adds entries: a range a finished task left behind
  // creates no dependency, so dropping it changes no answer.
  if (entries_.size() >= sweep_at_) sweep(is_done);
  auto add_dep = [&](uint64_t t) {
    if (t != kNoWriter && t != task && !is_done(t)) deps->push_back(t);
  };
  // Two cases take one lookup and no split (ranges are disjoint, so nothing else overlaps):
  // [begin, end) is exactly one tracked range (a buffer written and read whole, again), or it
  // overlaps none (a range touched for the first time).
  auto it = entries_.lower_bound(begin);
  if (it != entries_.end() && it->first == begin && it->second.end == end) {
    Entry& cur = it->second;
    add_dep(cur.writer);
    if (write) {
      for (uint64_t r : cur.readers) add_dep(r);
      cur.writer = task;
      cur.readers.clear();
      return;
    }
    add_reader(cur, task, is_done);
    return;
  }
  if ((it == entries_.end() || it->first >= end) &&
      (it == entries_.begin() || std::prev(it)->second.end <= begin)) {
    Entry e;
    e.end = end;
    if (write) {
      e.writer = task;
    } else {
      e.readers.push_back(task);
    }
    entries_.emplace_hint(it, begin, std::move(e));
    return;
  }
  split(begin);
  split(end);
  it = entries_.lower_bound(begin);
  uint64_t cursor = begin;
  if (write) {
    // Collect WAW and WAR, then replace [begin, end) by one entry written by `task`.
    while (it != entries_.end() && it->first < end) {
      add_dep(it->second.writer);
      for (uint64_t r : it->second.readers) add_dep(r);
      it = entries_.erase(it);
    }
    Entry e;
    e.end = end;
    e.writer = task;
    entries_.emplace(begin, std::move(e));
    return;
  }
  // Read: RAW on every overlapping writer; become a reader; fill gaps.
  while (cursor < end) {
    if (it == entries_.end() || it->first >= end) {
      Entry e;
      e.end = end;
      e.readers.push_back(task);
      entries_.emplace(cursor, std::move(e));
      break;
    }
    if (it->first > cursor) {
      Entry e;
      e.end = it->first;
      e.readers.push_back(task);
      entries_.emplace(cursor, std::move(e));
    }
    Entry& cur = it->second;
    add_dep(cur.writer);
    add_reader(cur, task, is_done);
    cursor = cur.end;
    ++it;
  }
}

}  // namespace simpler::chip
