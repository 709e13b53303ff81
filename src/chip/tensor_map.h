// TensorMap: dependency inference over device address ranges.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <vector>

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
// touched (the sweeps add amortized O(1) per access). Thread-compatible (one
// orchestrating thread).
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

  void clear() {
    entries_.clear();
    sweep_at_ = kMinSweepEntries;
  }
  // Number of disjoint tracked ranges (for tests and diagnostics).
  size_t size() const { return entries_.size(); }

  static constexpr size_t kMinSweepEntries = 256;

 private:
  static constexpr uint64_t kNoWriter = ~uint64_t{0};
  struct Entry {
    uint64_t end = 0;
    uint64_t writer = kNoWriter;
    std::vector<uint64_t> readers;
  };
  // Splits the entry containing `at` (if any) so that an entry starts at `at`.
  void split(uint64_t at);
  // Drops ranges no unfinished task touches.
  void sweep(const IsDone& is_done);

  std::map<uint64_t, Entry> entries_;
  size_t sweep_at_ = kMinSweepEntries;  // sweep when entries_ reaches this size
};

}  // namespace simpler::chip
