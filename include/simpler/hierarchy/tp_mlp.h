// The example L3 program (ARCHITECTURE.md "L3"): a tensor-parallel MLP, y = relu(x @ W1) @ W2,
// across the children of an L3Worker. W1 [hidden, intermediate] is split by columns and W2
// [intermediate, hidden] by rows, one shard per child, kept in that child's device memory
// (uploaded once by fill()); each child computes a partial y from x (shared host heap); a host
// sub-task sums the partials into y. All tensors float32, row-major.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "simpler/hierarchy/l3_worker.h"

namespace simpler::hierarchy {

struct TpMlpShape {
  int64_t batch = 4;
  int64_t hidden = 16;
  int64_t intermediate = 32;  // a multiple of the number of children
};

// Not thread-safe; must outlive every run of its program. The L3Worker must outlive it.
class TpMlp {
 public:
  // Registers the shard callable ("mlp_shard"), the sum sub-task and the program ("tp_mlp") on
  // `w`, before w.init(). INVALID_ARGUMENT for a non-positive size, or an intermediate size
  // that the children do not divide; the registration errors of L3Worker.
  static absl::StatusOr<std::unique_ptr<TpMlp>> register_on(L3Worker& w, TpMlpShape shape);

  // After w.init(): x, the partials and y in the shared host heap; the weight shards in the
  // children's device memory. The heap needs (batch x hidden x (children + 2) + 2 x hidden x
  // intermediate) x 4 bytes, plus alignment.
  absl::Status allocate();
  // Fills x and the weights from `seed` (uniform in [-1, 1)), uploads each child's shards, and
  // returns the float64 reference y [batch, hidden]. Only between runs (copy_to_child's rule).
  absl::StatusOr<std::vector<double>> fill(uint32_t seed);

  ProgramHandle program() const { return program_; }
  // y [batch, hidden] after a run.
  const float* y() const { return y_.data<float>(); }
  const TpMlpShape& shape() const { return shape_; }

 private:
  TpMlp(L3Worker& w, TpMlpShape shape) : w_(w), shape_(shape) {}
  absl::Status orchestrate(L3Context& ctx);

  L3Worker& w_;
  const TpMlpShape shape_;
  int32_t children_ = 0;
  ChildCallable shard_;
  SubHandle sum_;
  ProgramHandle program_;
  HostBuffer x_, y_, w1_host_, w2_host_;
  std::vector<HostBuffer> partial_;
  std::vector<worker::DeviceBuffer> w1_, w2_;  // per child
};

}  // namespace simpler::hierarchy
