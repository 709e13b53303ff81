#include "simpler/hierarchy/tp_mlp.h"

#include <random>

#include "absl/strings/str_cat.h"
#include "simpler/base/status.h"
#include "simpler/task/callable.h"

namespace simpler::hierarchy {

namespace {

// One shard: y[b, :] = relu(x[b, :] @ w1) @ w2 with x [B, D], w1 [D, S], w2 [S, D], y [B, D].
absl::Status mlp_shard_kernel(const task::KernelContext& ctx) {
  const float* x = ctx.tensor(0).data<float>();
  const float* w1 = ctx.tensor(1).data<float>();
  const float* w2 = ctx.tensor(2).data<float>();
  float* y = ctx.tensor(3).data<float>();
  const int64_t b = ctx.tensor(0).shape[0], d = ctx.tensor(0).shape[1], s = ctx.tensor(1).shape[1];
  std::vector<float> hidden(static_cast<size_t>(s));
  for (int64_t r = 0; r < b; ++r) {
    for (int64_t j = 0; j < s; ++j) {
      float acc = 0;
      for (int64_t k = 0; k < d; ++k) acc += x[r * d + k] * w1[k * s + j];
      hidden[j] = acc > 0 ? acc : 0;
    }
    for (int64_t k = 0; k < d; ++k) {
      float acc = 0;
      for (int64_t j = 0; j < s; ++j) acc += hidden[j] * w2[j * d + k];
      y[r * d + k] = acc;
    }
  }
  return absl::OkStatus();
}

// The last argument = the sum of the others (float tensors of one shape).
absl::Status sum_partials(const task::TaskArgs& args) {
  const size_t n = args.size() - 1;
  float* out = args.tensor(n).data<float>();
  const int64_t numel = args.tensor(n).numel();
  for (int64_t i = 0; i < numel; ++i) {
    float acc = 0;
    for (size_t p = 0; p < n; ++p) acc += args.tensor(p).data<float>()[i];
    out[i] = acc;
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<TpMlp>> TpMlp::register_on(L3Worker& w, TpMlpShape shape) {
  const int32_t children = w.num_children();
  if (shape.batch <= 0 || shape.hidden <= 0 || shape.intermediate <= 0 ||
      shape.intermediate % children != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor-parallel MLP: batch ", shape.batch, ", hidden ", shape.hidden,
                     ", intermediate ", shape.intermediate,
                     ": every size must be positive and the intermediate size a multiple "
                     "of the ",
                     children, " children"));
  }
  std::unique_ptr<TpMlp> m(new TpMlp(w, shape));
  m->children_ = children;
  SIMPLER_ASSIGN_OR_RETURN(
      m->shard_, w.register_callable(task::one_kernel_callable("mlp_shard", mlp_shard_kernel)));
  SIMPLER_ASSIGN_OR_RETURN(m->sum_, w.register_sub("sum_partials", sum_partials));
  TpMlp* self = m.get();
  SIMPLER_ASSIGN_OR_RETURN(
      m->program_, w.register_program({"tp_mlp", [self](L3Context& ctx, const task::TaskArgs&) {
                                         return self->orchestrate(ctx);
                                       }}));
  return m;
}

absl::Status TpMlp::allocate() {
  const int64_t b = shape_.batch, d = shape_.hidden, h = shape_.intermediate, s = h / children_;
  SIMPLER_ASSIGN_OR_RETURN(x_, w_.create_buffer(b * d * 4));
  SIMPLER_ASSIGN_OR_RETURN(y_, w_.create_buffer(b * d * 4));
  SIMPLER_ASSIGN_OR_RETURN(w1_host_, w_.create_buffer(d * h * 4));
  SIMPLER_ASSIGN_OR_RETURN(w2_host_, w_.create_buffer(h * d * 4));
  partial_.clear();
  w1_.clear();
  w2_.clear();
  for (int32_t c = 0; c < children_; ++c) {
    SIMPLER_ASSIGN_OR_RETURN(HostBuffer p, w_.create_buffer(b * d * 4));
    partial_.push_back(p);
    SIMPLER_ASSIGN_OR_RETURN(worker::DeviceBuffer w1, w_.child_malloc(c, d * s * 4));
    SIMPLER_ASSIGN_OR_RETURN(worker::DeviceBuffer w2, w_.child_malloc(c, s * d * 4));
    w1_.push_back(w1);
    w2_.push_back(w2);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<double>> TpMlp::fill(uint32_t seed) {
  const int64_t b = shape_.batch, d = shape_.hidden, h = shape_.intermediate, s = h / children_;
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1, 1);
  std::vector<float> w1(d * h), w2(h * d);
  float* x = x_.data<float>();
  for (int64_t i = 0; i < b * d; ++i) x[i] = u(rng);
  for (float& v : w1) v = u(rng);
  for (float& v : w2) v = u(rng);
  // Each child's shards, staged in the shared heap and uploaded to its device.
  for (int32_t c = 0; c < children_; ++c) {
    float* w1s = w1_host_.data<float>();
    float* w2s = w2_host_.data<float>();
    for (int64_t k = 0; k < d; ++k) {
      for (int64_t j = 0; j < s; ++j) w1s[k * s + j] = w1[k * h + c * s + j];
    }
    for (int64_t j = 0; j < s; ++j) {
      for (int64_t k = 0; k < d; ++k) w2s[j * d + k] = w2[(c * s + j) * d + k];
    }
    SIMPLER_RETURN_IF_ERROR(w_.copy_to_child(c, w1_[c], w1_host_, d * s * 4));
    SIMPLER_RETURN_IF_ERROR(w_.copy_to_child(c, w2_[c], w2_host_, s * d * 4));
  }
  std::vector<double> ref(b * d, 0.0);
  for (int64_t r = 0; r < b; ++r) {
    for (int64_t j = 0; j < h; ++j) {
      double acc = 0;
      for (int64_t k = 0; k < d; ++k) acc += double(x[r * d + k]) * w1[k * h + j];
      if (acc <= 0) continue;
      for (int64_t k = 0; k < d; ++k) ref[r * d + k] += acc * w2[j * d + k];
    }
  }
  return ref;
}

absl::Status TpMlp::orchestrate(L3Context& ctx) {
  const int64_t b = shape_.batch, d = shape_.hidden, s = shape_.intermediate / children_;
  const auto f32 = task::DataType::kFloat32;
  task::TaskArgs sum;
  for (int32_t c = 0; c < children_; ++c) {
    SIMPLER_ASSIGN_OR_RETURN(task::Tensor x, x_.tensor({b, d}, f32));
    SIMPLER_ASSIGN_OR_RETURN(task::Tensor w1, w1_[c].tensor({d, s}, f32));
    SIMPLER_ASSIGN_OR_RETURN(task::Tensor w2, w2_[c].tensor({s, d}, f32));
    SIMPLER_ASSIGN_OR_RETURN(task::Tensor part, partial_[c].tensor({b, d}, f32));
    task::TaskArgs a;
    a.add_tensor(x, task::ArgDirection::kIn)
        .add_tensor(w1, task::ArgDirection::kIn)
        .add_tensor(w2, task::ArgDirection::kIn)
        .add_tensor(part, task::ArgDirection::kOut);
    SIMPLER_RETURN_IF_ERROR(ctx.submit_next_level(shard_, a, c).status());
    sum.add_tensor(part, task::ArgDirection::kIn);
  }
  SIMPLER_ASSIGN_OR_RETURN(task::Tensor y, y_.tensor({b, d}, f32));
  sum.add_tensor(y, task::ArgDirection::kOut);
  return ctx.submit_sub(sum_, sum).status();
}

}  // namespace simpler::hierarchy
