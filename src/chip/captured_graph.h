// CapturedGraph: one run's task graph, recorded once and replayed with new arguments
// (docs/design/capture_replay.md). Private to the runtime.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "chip/chip_runtime.h"
#include "simpler/task/callable.h"
#include "simpler/task/task_args.h"

namespace simpler::chip {

// What a capture is made of. The pointers must stay valid for CapturedGraph::build.
struct CaptureInput {
  const task::ChipCallable* callable = nullptr;
  uint64_t key = 0;                           // the caller's shape key, not 0
  const task::TaskArgs* submitted = nullptr;  // the run's arguments as submitted
  const task::TaskArgs* staged = nullptr;     // the same, HOST tensors replaced by their staging
  int32_t num_cores = 0;                      // what the orchestration saw as ctx.num_cores()
  uint64_t scalar_params = 0;                 // bit i: run argument i is a scalar parameter
  uint64_t run_id = 0;                        // the capturing run, for messages
  // Device::allocation_id of a fixed range: recorded with the range, so that memory freed and
  // allocated again at the same address is told apart from what the capture saw.
  std::function<absl::StatusOr<uint64_t>(uint64_t address, uint64_t bytes)> allocation_id;
};

// Two device tensor arguments i < j of a run that overlap, j's address at `delta` bytes from i's.
struct ArgOverlap {
  uint32_t i = 0;
  uint32_t j = 0;
  int64_t delta = 0;
  bool same_pair(const ArgOverlap& o) const { return i == o.i && j == o.j; }
};

// Records the orchestration again over other arguments (a scalar parameter's probe).
using Rerecord = std::function<absl::StatusOr<GraphRecording>(const task::TaskArgs& staged)>;

// A run's graph with its dependencies resolved and its arguments as slots: each task tensor
// lies inside a run argument (bound to the first that holds it, at an offset) or in fixed
// memory the orchestration captured (kept by address); each task scalar is a constant or bound
// to a run scalar parameter. Keeps the signature it was captured under (every run argument's
// direction, memory kind, dtype, shape and strides, non-parameter scalar values, the overlap
// relation of the tensor arguments of one memory kind, the core count). Immutable once built;
// shared by the runs replaying it; thread-safe.
class CapturedGraph {
 public:
  // A fixed device range some task uses, with the first task and argument naming it, and the
  // id of the allocation that held it when the graph was built (Device::allocation_id; 0 when
  // the range was no longer live by then).
  struct FixedRange {
    uint64_t begin = 0;
    uint64_t end = 0;
    uint32_t task = 0;
    uint32_t arg = 0;
    uint64_t allocation = 0;
  };

  // Builds the graph of `in` from `recording`, the capturing run's record (over in.staged).
  // Each declared scalar parameter is checked with one probe: `rerecord` over in.staged with
  // that scalar plus one must submit the same tasks, with only the task scalars that equalled
  // it now equal to it plus one. INVALID_ARGUMENT ("run R capture under capture key K of 'C':
  // ...") when a task tensor overlaps a run argument while lying inside none, or a probe shows
  // a parameter is not forwarded unchanged (naming the argument); a probe's own error.
  static absl::StatusOr<std::shared_ptr<const CapturedGraph>> build(const CaptureInput& in,
                                                                    GraphRecording recording,
                                                                    const Rerecord& rerecord);

  // Whether a run with `submitted` arguments, `num_cores` cores and `scalar_params` may replay
  // this graph (the binding contract). INVALID_ARGUMENT naming the argument and both values
  // ("argument 1: shape [8] differs from [4] captured under capture key 7 of 'chain'"), the
  // cores, or the parameter set, when not. O(n log n + overlapping pairs) in the run's n
  // arguments (and log of the fixed ranges per argument): it runs under the lane's lock.
  absl::Status check_bind(const task::TaskArgs& submitted, int32_t num_cores,
                          uint64_t scalar_params) const;
  // The tasks' arguments bound to `staged` (a run's arguments after staging, which passed
  // check_bind as submitted) into `out` (recording().args.size() entries).
  void bind(const task::TaskArgs& staged, std::vector<task::Arg>* out) const;
  // bind() into `out` that already holds this graph's bound arguments (an earlier bind()'s
  // output, unchanged since): rewrites only the entries bound to run arguments, the others
  // being the capture's. O(bound entries) instead of a copy of every argument.
  void rebind(const task::TaskArgs& staged, std::vector<task::Arg>* out) const;

  // Tasks and predecessors; recording().args holds the arguments as captured.
  const GraphRecording& recording() const { return recording_; }
  // The fixed ranges, sorted by begin, disjoint (merged); each lies in one allocation.
  const std::vector<FixedRange>& fixed() const { return fixed_; }
  uint64_t key() const { return key_; }
  const std::string& callable_name() const { return callable_name_; }
  size_t num_tasks() const { return recording_.tasks.size(); }

 private:
  CapturedGraph() = default;
  // Resolves every task argument to a slot or a fixed range.
  absl::Status resolve_slots(const CaptureInput& in);
  // The overlap relation of `submitted`'s device tensor arguments against overlaps_.
  absl::Status check_overlaps(const task::TaskArgs& submitted) const;
  absl::Status probe_parameter(const CaptureInput& in, size_t index, const Rerecord& rerecord);
  std::string where() const;  // "capture key K of 'C'"

  // One task argument bound to run argument `slot` (its address at `offset` from the slot's,
  // or its scalar value).
  struct Bound {
    uint32_t arg = 0;  // index into recording_.args
    uint32_t slot = 0;
    uint64_t offset = 0;
  };
  GraphRecording recording_;
  std::vector<Bound> bound_;
  std::vector<FixedRange> fixed_;
  std::vector<task::Arg> signature_;  // the run's arguments as submitted
  // The overlapping pairs of the run's device tensor arguments at capture, sorted by (i, j).
  std::vector<ArgOverlap> overlaps_;
  int32_t num_cores_ = 0;
  uint64_t scalar_params_ = 0;
  uint64_t key_ = 0;
  std::string callable_name_;
};

}  // namespace simpler::chip
