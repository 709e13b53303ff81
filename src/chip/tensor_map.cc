#include "chip/tensor_map.h"

#include <algorithm>

namespace simpler::chip {

void TensorMap::split(uint64_t at) {
  auto it = entries_.upper_bound(at);
  if (it == entries_.begin()) return;
  --it;
  if (it->first == at || it->second.end <= at) return;
  Entry tail = it->second;  // same writer and readers
  it->second.end = at;
  entries_.emplace(at, std::move(tail));
}

void TensorMap::sweep(const IsDone& is_done) {
  for (auto it = entries_.begin(); it != entries_.end();) {
    Entry& e = it->second;
    std::erase_if(e.readers, std::ref(is_done));
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
  split(begin);
  split(end);
  auto add_dep = [&](uint64_t t) {
    if (t != kNoWriter && t != task && !is_done(t)) deps->push_back(t);
  };
  auto it = entries_.lower_bound(begin);
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
    if (cur.readers.size() >= 8) {
      cur.readers.erase(std::remove_if(cur.readers.begin(), cur.readers.end(), std::ref(is_done)),
                        cur.readers.end());
    }
    if (cur.readers.empty() || cur.readers.back() != task) cur.readers.push_back(task);
    cursor = cur.end;
    ++it;
  }
}

}  // namespace simpler::chip
