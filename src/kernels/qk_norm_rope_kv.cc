// qk_norm_rope_kv (kernels.h): a token's q and k heads normalized and rotated, and its k and v
// written to the paged KV cache, in one task instead of five (two rms_norm, two rope, kv_write),
// with row_ops.h's row work: bitwise what the five kernels give, refused as they refuse.

#include "kernels/row_ops.h"
#include "simpler/kernels/kernels.h"
#include "simpler/task/arg_check.h"

namespace simpler::llm {

using task::DataType;

absl::Status qk_norm_rope_kv_kernel(const task::KernelContext& ctx) {
  task::ArgChecker c(ctx, "qk_norm_rope_kv");
  SIMPLER_RETURN_IF_ERROR(c.count(13));
  SIMPLER_RETURN_IF_ERROR(c.tensor(0, "q", DataType::kFloat32, {-1, -1, -1}));
  const int64_t rows = ctx.tensor(0).shape[0];
  const int64_t heads = ctx.tensor(0).shape[1];
  const int64_t dim = ctx.tensor(0).shape[2];
  SIMPLER_RETURN_IF_ERROR(c.tensor(1, "k", DataType::kFloat32, {rows, -1, dim}));
  const int64_t kv_heads = ctx.tensor(1).shape[1];
  SIMPLER_RETURN_IF_ERROR(c.tensor(2, "v", DataType::kFloat32, {rows, kv_heads, dim}));
  SIMPLER_RETURN_IF_ERROR(c.tensor(3, "q_norm", DataType::kFloat32, {dim}));
  SIMPLER_RETURN_IF_ERROR(c.tensor(4, "k_norm", DataType::kFloat32, {dim}));
  SIMPLER_RETURN_IF_ERROR(c.tensor(5, "positions", DataType::kInt32, {rows}));
  SIMPLER_RETURN_IF_ERROR(c.tensor(6, "slot_mapping", DataType::kInt32, {rows}));
  SIMPLER_RETURN_IF_ERROR(c.tensor(7, "q_out", DataType::kFloat32, {rows, heads, dim}));
  SIMPLER_RETURN_IF_ERROR(c.tensor(8, "k_out", DataType::kFloat32, {rows, kv_heads, dim}));
  SIMPLER_RETURN_IF_ERROR(c.tensor(9, "k_pool", DataType::kFloat32, {-1, kv_heads, -1, dim}));
  const int64_t pages = ctx.tensor(9).shape[0];
  const int64_t page_size = ctx.tensor(9).shape[2];
  SIMPLER_RETURN_IF_ERROR(
      c.tensor(10, "v_pool", DataType::kFloat32, {pages, kv_heads, page_size, dim}));
  SIMPLER_RETURN_IF_ERROR(c.scalar(11, "eps"));
  SIMPLER_RETURN_IF_ERROR(c.scalar(12, "theta"));
  const double eps = ctx.scalar_f32(11);
  const double theta = ctx.scalar_f32(12);
  SIMPLER_RETURN_IF_ERROR(row_ops::check_rope(c, dim, theta));
  const float* q = ctx.tensor(0).data<const float>();
  const float* k = ctx.tensor(1).data<const float>();
  const float* v = ctx.tensor(2).data<const float>();
  const float* q_norm = ctx.tensor(3).data<const float>();
  const float* k_norm = ctx.tensor(4).data<const float>();
  const int32_t* positions = ctx.tensor(5).data<const int32_t>();
  const int32_t* slot_mapping = ctx.tensor(6).data<const int32_t>();
  float* q_out = ctx.tensor(7).data<float>();
  float* k_out = ctx.tensor(8).data<float>();
  const row_ops::KvCache cache{
      ctx.tensor(9).data<float>(), ctx.tensor(10).data<float>(), pages, page_size, kv_heads, dim};
  const int64_t q_elems = heads * dim, kv_elems = kv_heads * dim;
  const BlockRange r = block_range(rows, ctx.block_idx, ctx.block_dim);
  if (r.begin >= r.end) return absl::OkStatus();
  row_ops::RopeAngles angles(dim, theta);
  for (int64_t b = r.begin; b < r.end; ++b) {
    SIMPLER_RETURN_IF_ERROR(angles.at_row(c, positions, b));
    float* qo = q_out + b * q_elems;
    float* ko = k_out + b * kv_elems;
    row_ops::rms_norm_rows(q + b * q_elems, q_norm, heads, dim, eps, qo);
    row_ops::rms_norm_rows(k + b * kv_elems, k_norm, kv_heads, dim, eps, ko);
    angles.rotate(qo, heads);
    angles.rotate(ko, kv_heads);
    SIMPLER_RETURN_IF_ERROR(
        row_ops::write_kv_row(c, cache, b, slot_mapping[b], ko, v + b * kv_elems));
  }
  return absl::OkStatus();
}

task::TaskArgs qk_norm_rope_kv_args(const QkNormRopeKvTensors& t, float eps, float theta) {
  task::TaskArgs a;
  a.add_tensors({t.q, t.k, t.v, t.q_norm, t.k_norm, t.positions, t.slot_mapping},
                task::ArgDirection::kIn)
      .add_tensor(t.q_out, task::ArgDirection::kOut)
      .add_tensor(t.k_out, task::ArgDirection::kOut)
      .add_tensor(t.k_pool, task::ArgDirection::kInOut)
      .add_tensor(t.v_pool, task::ArgDirection::kInOut)
      .add_scalar_f32(eps)
      .add_scalar_f32(theta);
  return a;
}

}  // namespace simpler::llm
