#include "chip/captured_graph.h"

#include <algorithm>
#include <limits>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "simpler/base/status.h"

namespace simpler::chip {

namespace {

bool is_tensor(const task::Arg& a) { return a.direction != task::ArgDirection::kScalar; }

// A device tensor argument of a run (what the fixed-range check covers).
bool is_device_range(const task::Arg& a) {
  return is_tensor(a) && a.tensor.memory == task::MemoryKind::kDevice && a.tensor.span_bytes() > 0;
}

// A tensor argument that takes part in the overlap relation: a non-empty one, DEVICE or HOST
// (HOST tensors that overlap share one staging buffer, so their device views overlap as theirs
// do; pairs are only of one memory kind).
bool is_range(const task::Arg& a) { return is_tensor(a) && a.tensor.span_bytes() > 0; }

bool overlaps(uint64_t b1, uint64_t e1, uint64_t b2, uint64_t e2) { return b1 < e2 && b2 < e1; }

std::string dims(const task::Tensor& t, const std::array<int64_t, task::kMaxRank>& d) {
  return absl::StrCat("[", absl::StrJoin(d.begin(), d.begin() + t.rank, ", "), "]");
}

bool same_layout(const task::Tensor& a, const task::Tensor& b) {
  return a.rank == b.rank && a.dtype == b.dtype && a.memory == b.memory &&
         std::equal(a.shape.begin(), a.shape.begin() + a.rank, b.shape.begin()) &&
         std::equal(a.strides.begin(), a.strides.begin() + a.rank, b.strides.begin());
}

// How the tensor of run argument `i` as submitted differs from `captured`; empty when it does
// not.
std::string layout_difference(size_t i, const task::Tensor& t, const task::Tensor& captured) {
  const std::string arg = absl::StrCat("argument ", i, ": ");
  if (t.memory != captured.memory) {
    auto kind = [](task::MemoryKind m) { return m == task::MemoryKind::kHost ? "HOST" : "DEVICE"; };
    return absl::StrCat(arg, "memory ", kind(t.memory), " differs from ", kind(captured.memory));
  }
  if (t.dtype != captured.dtype) {
    return absl::StrCat(arg, "dtype ", std::string(task::name_of(t.dtype)), " differs from ",
                        std::string(task::name_of(captured.dtype)));
  }
  if (t.rank != captured.rank ||
      !std::equal(t.shape.begin(), t.shape.begin() + t.rank, captured.shape.begin())) {
    return absl::StrCat(arg, "shape ", dims(t, t.shape), " differs from ",
                        dims(captured, captured.shape));
  }
  if (!std::equal(t.strides.begin(), t.strides.begin() + t.rank, captured.strides.begin())) {
    return absl::StrCat(arg, "strides ", dims(t, t.strides), " differ from ",
                        dims(captured, captured.strides));
  }
  return {};
}

// The overlapping pairs among the device tensor arguments of `args`, sorted by (i, j): a sweep
// over the arguments sorted by address, so O(n log n + pairs). Stops once it has found more
// than `limit` pairs (then *truncated is set and the pairs are some of them).
std::vector<ArgOverlap> overlapping_pairs(const std::vector<task::Arg>& args, size_t limit,
                                          bool* truncated) {
  struct Interval {
    uint64_t begin = 0;
    uint64_t end = 0;
    uint32_t arg = 0;
    task::MemoryKind memory = task::MemoryKind::kDevice;
  };
  std::vector<Interval> by_begin;
  for (uint32_t i = 0; i < args.size(); ++i) {
    if (!is_range(args[i])) continue;
    const task::Tensor& t = args[i].tensor;
    by_begin.push_back({t.address, t.address + t.span_bytes(), i, t.memory});
  }
  std::sort(by_begin.begin(), by_begin.end(), [](const Interval& x, const Interval& y) {
    if (x.memory != y.memory) return x.memory < y.memory;
    return x.begin != y.begin ? x.begin < y.begin : x.arg < y.arg;
  });
  std::vector<ArgOverlap> pairs;
  *truncated = false;
  for (size_t k = 0; k < by_begin.size() && !*truncated; ++k) {
    // Every later interval that begins before this one ends overlaps it (spans are not empty).
    for (size_t m = k + 1; m < by_begin.size() && by_begin[m].memory == by_begin[k].memory &&
                           by_begin[m].begin < by_begin[k].end;
         ++m) {
      if (pairs.size() == limit) {
        *truncated = true;
        break;
      }
      const Interval& x = by_begin[k];
      const Interval& y = by_begin[m];
      const Interval& a = x.arg < y.arg ? x : y;
      const Interval& b = x.arg < y.arg ? y : x;
      pairs.push_back({a.arg, b.arg, static_cast<int64_t>(b.begin - a.begin)});
    }
  }
  std::sort(pairs.begin(), pairs.end(), [](const ArgOverlap& x, const ArgOverlap& y) {
    return x.i != y.i ? x.i < y.i : x.j < y.j;
  });
  return pairs;
}

}  // namespace

std::string CapturedGraph::where() const {
  return absl::StrCat("capture key ", key_, " of '", callable_name_, "'");
}

absl::StatusOr<std::shared_ptr<const CapturedGraph>> CapturedGraph::build(
    const CaptureInput& in, GraphRecording recording, const Rerecord& rerecord) {
  std::shared_ptr<CapturedGraph> g(new CapturedGraph());
  g->recording_ = std::move(recording);
  g->recording_.link_successors();                 // a replay releases successors from these lists
  g->recording_.compute_job_shapes(*in.callable);  // and starts its jobs with these keys
  g->key_ = in.key;
  g->callable_name_ = in.callable->name;
  g->num_cores_ = in.num_cores;
  g->scalar_params_ = in.scalar_params;
  g->signature_ = in.submitted->args();
  const size_t n = g->signature_.size();
  bool truncated = false;
  g->overlaps_ = overlapping_pairs(g->signature_, std::numeric_limits<size_t>::max(), &truncated);
  auto prefix = [&] {
    return absl::StrCat("run ", in.run_id, " capture under ", g->where(), ": ");
  };
  if (absl::Status s = g->resolve_slots(in); !s.ok()) return base::annotate(s, prefix());
  for (size_t i = 0; i < n && i < 64; ++i) {
    if ((in.scalar_params >> i & 1) == 0) continue;
    if (absl::Status s = g->probe_parameter(in, i, rerecord); !s.ok()) {
      return base::annotate(s, prefix());
    }
  }
  return std::shared_ptr<const CapturedGraph>(std::move(g));
}

absl::Status CapturedGraph::resolve_slots(const CaptureInput& in) {
  const task::TaskArgs& run = *in.staged;
  for (uint32_t t = 0; t < recording_.tasks.size(); ++t) {
    const GraphImageTask& task = recording_.tasks[t];
    for (uint32_t k = 0; k < task.num_args; ++k) {
      const uint32_t index = task.args_begin + k;
      const task::Arg& a = recording_.args[index];
      if (!is_tensor(a) || a.tensor.span_bytes() == 0) continue;
      const uint64_t b = a.tensor.address;
      const uint64_t e = b + a.tensor.span_bytes();
      // Bound to the first run argument that holds it; other run arguments it overlaps keep
      // their offsets to that one at every replay (the overlap pairs), so its place in them
      // does too. One it overlaps while no argument holds it could not be bound.
      std::optional<uint32_t> holder, straddled;
      for (uint32_t i = 0; i < run.size() && !holder; ++i) {
        if (!is_tensor(run[i]) || run[i].tensor.span_bytes() == 0) continue;
        const uint64_t rb = run[i].tensor.address;
        const uint64_t re = rb + run[i].tensor.span_bytes();
        if (rb <= b && e <= re) {
          holder = i;
          bound_.push_back({index, i, b - rb});
        } else if (!straddled && overlaps(b, e, rb, re)) {
          straddled = i;
        }
      }
      if (holder) continue;
      if (straddled) {
        const uint32_t i = *straddled;
        return absl::InvalidArgumentError(absl::StrCat(
            "task ", t, " argument ", k, " ", a.tensor.debug_string(), " overlaps run argument ", i,
            " ", run[i].tensor.debug_string(), " without lying inside it or any other"));
      }
      fixed_.push_back({b, e, t, k});
    }
  }
  std::sort(fixed_.begin(), fixed_.end(),
            [](const FixedRange& x, const FixedRange& y) { return x.begin < y.begin; });
  std::vector<FixedRange> merged;
  for (const FixedRange& r : fixed_) {
    if (!merged.empty() && r.begin < merged.back().end) {
      merged.back().end = std::max(merged.back().end, r.end);
    } else {
      merged.push_back(r);
    }
  }
  fixed_ = std::move(merged);
  for (FixedRange& r : fixed_) {
    absl::StatusOr<uint64_t> id =
        in.allocation_id ? in.allocation_id(r.begin, r.end - r.begin) : absl::StatusOr<uint64_t>(0);
    r.allocation = id.ok() ? *id : 0;  // 0: freed already; the lane never keeps such a graph
  }
  return absl::OkStatus();
}

absl::Status CapturedGraph::probe_parameter(const CaptureInput& in, size_t index,
                                            const Rerecord& rerecord) {
  const task::TaskArgs& run = *in.staged;
  auto refuse = [&](const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat(
        "argument ", index,
        " is declared a scalar parameter (CallConfig.capture_scalar_params) but ", why));
  };
  if (index >= run.size() || is_tensor(run[index])) return refuse("it is not a scalar");
  task::TaskArgs probe = run;
  const uint64_t value = run[index].scalar;
  probe[index].scalar = value + 1;
  SIMPLER_ASSIGN_OR_RETURN(GraphRecording other, rerecord(probe));
  const GraphRecording& mine = recording_;
  if (other.tasks.size() != mine.tasks.size()) {
    return refuse(absl::StrCat("the orchestration submits ", other.tasks.size(),
                               " tasks with it plus one and ", mine.tasks.size(),
                               " without: it decides the task list"));
  }
  for (uint32_t t = 0; t < mine.tasks.size(); ++t) {
    const GraphImageTask& x = mine.tasks[t];
    const GraphImageTask& y = other.tasks[t];
    if (x.kernel != y.kernel || x.block_dim != y.block_dim || x.num_args != y.num_args ||
        x.num_preds != y.num_preds ||
        !std::equal(mine.preds.begin() + x.preds_begin,
                    mine.preds.begin() + x.preds_begin + x.num_preds,
                    other.preds.begin() + y.preds_begin)) {
      return refuse(absl::StrCat("task ", t, " changes with it: it decides the task list"));
    }
    for (uint32_t k = 0; k < x.num_args; ++k) {
      const task::Arg& a = mine.args[x.args_begin + k];
      const task::Arg& b = other.args[y.args_begin + k];
      const std::string at = absl::StrCat("task ", t, " argument ", k);
      if (a.direction != b.direction) return refuse(at + " changes kind with it");
      if (is_tensor(a)) {
        if (a.tensor.address != b.tensor.address || !same_layout(a.tensor, b.tensor)) {
          return refuse(at + "'s tensor changes with it");
        }
        continue;
      }
      if (a.scalar == b.scalar) continue;
      if (a.scalar != value || b.scalar != value + 1) {
        return refuse(at + " changes with it without being equal to it");
      }
      const uint32_t arg = x.args_begin + k;
      const bool taken = std::any_of(bound_.begin(), bound_.end(),
                                     [arg](const Bound& bd) { return bd.arg == arg; });
      if (taken) return refuse(at + " also changes with another parameter");
      bound_.push_back({arg, static_cast<uint32_t>(index), 0});
    }
  }
  return absl::OkStatus();
}

absl::Status CapturedGraph::check_bind(const task::TaskArgs& submitted, int32_t num_cores,
                                       uint64_t scalar_params) const {
  const std::string captured = absl::StrCat(" captured under ", where());
  auto refuse = [&](const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat(what, captured));
  };
  const size_t n = signature_.size();
  if (submitted.size() != n) {
    return refuse(absl::StrCat("the run has ", submitted.size(), " arguments; the graph has ", n));
  }
  if (scalar_params != scalar_params_) {
    return refuse(absl::StrCat("CallConfig.capture_scalar_params 0x", absl::Hex(scalar_params),
                               " differs from 0x", absl::Hex(scalar_params_)));
  }
  if (num_cores != num_cores_) {
    return refuse(absl::StrCat("the run may use ", num_cores, " cores, not the ", num_cores_));
  }
  for (size_t i = 0; i < n; ++i) {
    const task::Arg& a = submitted[i];
    const task::Arg& s = signature_[i];
    if (a.direction != s.direction) {
      return refuse(absl::StrCat("argument ", i, ": direction ",
                                 std::string(task::name_of(a.direction)), " differs from ",
                                 std::string(task::name_of(s.direction))));
    }
    if (!is_tensor(a)) {
      if ((scalar_params >> i & 1) == 0 && a.scalar != s.scalar) {
        return refuse(absl::StrCat("argument ", i, ": scalar ", a.scalar, " differs from ",
                                   s.scalar, " (a scalar that is not a parameter is shape)"));
      }
      continue;
    }
    if (std::string d = layout_difference(i, a.tensor, s.tensor); !d.empty()) return refuse(d);
  }
  SIMPLER_RETURN_IF_ERROR(check_overlaps(submitted));
  for (size_t i = 0; i < n; ++i) {
    if (!is_device_range(submitted[i])) continue;
    const task::Tensor& a = submitted[i].tensor;
    const uint64_t e = a.address + a.span_bytes();
    auto it = std::upper_bound(fixed_.begin(), fixed_.end(), a.address,
                               [](uint64_t x, const FixedRange& r) { return x < r.begin; });
    if (it != fixed_.begin() && std::prev(it)->end > a.address) --it;
    if (it != fixed_.end() && overlaps(a.address, e, it->begin, it->end)) {
      return refuse(absl::StrCat(
          "argument ", i, " ", a.debug_string(), " overlaps device memory that task ", it->task,
          " argument ", it->arg, " of the graph uses at a fixed address 0x", absl::Hex(it->begin)));
    }
  }
  return absl::OkStatus();
}

absl::Status CapturedGraph::check_overlaps(const task::TaskArgs& submitted) const {
  // One pair more than captured is enough to know the relation differs.
  bool truncated = false;
  const std::vector<ArgOverlap> now =
      overlapping_pairs(submitted.args(), overlaps_.size() + 1, &truncated);
  auto by_pair = [](const ArgOverlap& x, const ArgOverlap& y) {
    return x.i != y.i ? x.i < y.i : x.j < y.j;
  };
  // The first pair (in (i, j) order) that overlaps now and not then, then and not now, or at
  // another offset; when truncated, the first found now that was not captured.
  const ArgOverlap* extra = nullptr;
  const ArgOverlap* missing = nullptr;
  const ArgOverlap* moved = nullptr;
  const ArgOverlap* was = nullptr;
  auto it = overlaps_.begin();
  for (const ArgOverlap& p : now) {
    it = std::lower_bound(it, overlaps_.end(), p, by_pair);
    if (it == overlaps_.end() || !it->same_pair(p)) {
      extra = &p;
      break;
    }
    if (it->delta != p.delta) {
      moved = &p;
      was = &*it;
      break;
    }
  }
  if (extra == nullptr && moved == nullptr && !truncated && now.size() != overlaps_.size()) {
    // Every pair of now was captured at its offset, and some captured pair is gone.
    for (size_t k = 0; k < overlaps_.size(); ++k) {
      if (k >= now.size() || !now[k].same_pair(overlaps_[k])) {
        missing = &overlaps_[k];
        break;
      }
    }
  }
  if (extra == nullptr && moved == nullptr && missing == nullptr) return absl::OkStatus();
  const ArgOverlap& p = extra != nullptr ? *extra : moved != nullptr ? *moved : *missing;
  const task::Tensor& a = submitted[p.i].tensor;
  const task::Tensor& b = submitted[p.j].tensor;
  const std::string then = extra != nullptr
                               ? std::string("nowhere")
                               : absl::StrCat("at byte offset ", (was != nullptr ? *was : p).delta);
  const std::string sooner =
      missing != nullptr ? std::string("nowhere") : absl::StrCat("at byte offset ", p.delta);
  return absl::InvalidArgumentError(absl::StrCat(
      "argument ", p.j, " ", b.debug_string(), " overlaps argument ", p.i, " ", a.debug_string(),
      " ", sooner, ", but ", then,
      " when captured (the dependencies were inferred from that) captured under ", where()));
}

void CapturedGraph::bind(const task::TaskArgs& staged, std::vector<task::Arg>* out) const {
  out->assign(recording_.args.begin(), recording_.args.end());
  rebind(staged, out);
}

void CapturedGraph::rebind(const task::TaskArgs& staged, std::vector<task::Arg>* out) const {
  for (const Bound& b : bound_) {
    task::Arg& o = (*out)[b.arg];
    const task::Arg& s = staged[b.slot];
    if (is_tensor(o)) {
      o.tensor.address = s.tensor.address + b.offset;
      o.tensor.memory = task::MemoryKind::kDevice;
    } else {
      o.scalar = s.scalar;
    }
  }
}

}  // namespace simpler::chip
