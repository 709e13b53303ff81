// A FIFO of work items handed from producer threads to consumer threads.
#pragma once

#include <deque>
#include <optional>
#include <utility>

#include "simpler/base/sync.h"
#include "simpler/base/thread_annotations.h"

namespace simpler::base {

// Items come out in the order they went in; any number of producers and consumers. A consumer
// sleeps on a condition variable while the queue is empty (no spinning). close() lets consumers
// drain what is queued and then see the end. Thread-safe.
template <typename T>
class WorkQueue {
 public:
  // Queues `item`; returns false (dropping it) after close().
  bool push(T item) {
    MutexLock lock(mu_);
    if (closed_) return false;
    items_.push_back(std::move(item));
    cv_.notify_one();
    return true;
  }
  // The next item, waiting for one; nullopt once the queue is closed and empty.
  std::optional<T> pop() {
    MutexLock lock(mu_);
    while (items_.empty() && !closed_) cv_.wait(lock);
    if (items_.empty()) return std::nullopt;
    T item = std::move(items_.front());
    items_.pop_front();
    return item;
  }
  // No more pushes; consumers get what is queued, then nullopt. Idempotent.
  void close() {
    MutexLock lock(mu_);
    closed_ = true;
    cv_.notify_all();
  }

 private:
  Mutex mu_;
  CondVar cv_;
  std::deque<T> items_ SIMPLER_GUARDED_BY(mu_);
  bool closed_ SIMPLER_GUARDED_BY(mu_) = false;
};

}  // namespace simpler::base
