#include "simpler/kernels/kernels.h"

// Eigen runs single-threaded inside a kernel: parallelism comes from SPMD blocks.
#ifndef EIGEN_DONT_PARALLELIZE
#define EIGEN_DONT_PARALLELIZE
#endif

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#endif

#include <Eigen/Core>
#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kernels/argmax_row.h"
#include "kernels/fma_exact.h"
#include "kernels/matmul_impl.h"
#include "kernels/matmul_int8.h"
#include "kernels/row_claims.h"
#include "kernels/row_ops.h"
#include "kernels/task_names.h"
#include "simpler/base/clock.h"
#include "simpler/base/enum_names.h"
#include "simpler/base/status.h"
#include "simpler/base/thread.h"
#include "simpler/task/arg_check.h"

namespace simpler::llm {
namespace {

using RowMatrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using ConstRowMap = Eigen::Map<const RowMatrix>;
using StridedRowMap = Eigen::Map<RowMatrix, Eigen::Unaligned, Eigen::OuterStride<>>;
using ConstVecMap = Eigen::Map<const Eigen::VectorXf>;
using VecMap = Eigen::Map<Eigen::VectorXf>;

using ArgCheck = task::ArgChecker;

// A kernel's arguments: the tensors it reads, then `out`, which it writes (kOut) or updates
// (kInOut).
TaskArgs reads_then(std::initializer_list<std::reference_wrapper<const Tensor>> ins,
                    const Tensor& out, ArgDirection out_dir = ArgDirection::kOut) {
  TaskArgs a;
  a.add_tensors(ins, ArgDirection::kIn).add_tensor(out, out_dir);
  return a;
}

// `isa` resolved (kAuto: the best target this CPU has), or FAILED_PRECONDITION naming `kernel`
// and what the target needs when this CPU lacks it.
absl::StatusOr<KernelIsa> available_isa(const char* kernel, KernelIsa isa) {
  isa = resolve_kernel_isa(isa);
  if (kernel_isa_available(isa)) return isa;
  return absl::FailedPreconditionError(
      absl::StrCat(kernel, ": the ", name_of(isa), " path needs ", kernel_isa_requirements(isa),
                   ", which this CPU lacks (it has ", available_kernel_isas(), ")"));
}

// The dtype argument i (weights kept in the checkpoint's dtype) is checked against: its own when
// bf16, f16 or a block dtype (q8_0, q4_0, q4_k, q6_k), else f32.
DataType weight_dtype(const KernelContext& ctx, size_t i) {
  const DataType t = ctx.args[i].tensor.dtype;
  return t == DataType::kBFloat16 || t == DataType::kFloat16 || task::block_elements(t) > 1
             ? t
             : DataType::kFloat32;
}

// A block dtype's rows must be whole blocks (of 32 for q8_0 and q4_0, of 256 for q4_k and q6_k):
// INVALID_ARGUMENT naming the argument otherwise.
absl::Status check_block_row(const ArgCheck& c, size_t i, const char* name, DataType dtype,
                             int64_t cols) {
  const int64_t per = task::block_elements(dtype);
  if (per == 1 || cols % per == 0) return absl::OkStatus();
  return c.error(absl::StrCat("argument ", i, " (", name, ") is ",
                              std::string(task::name_of(dtype)), " with rows of ", cols,
                              " weights, not a whole number of blocks of ", per));
}

// One block-dtype row of `cols` weights as f32 (task::dequantize_blocks: the matmul's values).
void dequantize_block_row(DataType dtype, const uint8_t* row, int64_t cols, float* out) {
  task::dequantize_blocks(dtype, row, cols, out);
}

// The int8-activation target's integer sums for `isa` (resolved and available): the fastest
// instructions the CPU has within it (the results are the same on every one: matmul_int8.h).
matmul_detail::Int8Dots int8_dots(KernelIsa isa) {
#if defined(__x86_64__)
  if (isa == KernelIsa::kAvx512 && matmul_detail::avx512vnni_available()) {
    return matmul_detail::int8_dots_avx512vnni();
  }
  if (isa == KernelIsa::kAvx512 || isa == KernelIsa::kX86_64V3) {
    return matmul_detail::avxvnni_available() && !matmul_detail::int8_avx2_forced()
               ? matmul_detail::int8_dots_avxvnni()
               : matmul_detail::int8_dots_avx2();
  }
#elif defined(__aarch64__)
  if (isa == KernelIsa::kNeon) return matmul_detail::int8_dots_neon();
#endif
  return matmul_detail::int8_dots_portable();
}

// The W rows [r.begin, r.end) of `full` (every W row of the task, `row_bytes` each), whose kernel
// may prefetch up to row `ahead` (RowClaims::next: the rows the block most likely claims next).
matmul_detail::Problem rows_of(const matmul_detail::Problem& full, BlockRange r, int64_t ahead,
                               int64_t row_bytes) {
  matmul_detail::Problem p = full;
  p.w = static_cast<const uint8_t*>(full.w) + r.begin * row_bytes;
  p.n = r.end - r.begin;
  p.y = full.y + r.begin;
  p.prefetch_n = ahead - r.begin;
  return p;
}

// Whether matmul_rows takes precision bf16's own path for p: bf16 W on the AVX-512 target of a
// CPU with AVX-512 BF16 (else the exact path of the target).
bool bf16_path(const matmul_detail::Problem& p, KernelIsa isa, Precision precision) {
#if defined(__x86_64__)
  return precision == Precision::kBf16 && isa == KernelIsa::kAvx512 &&
         p.wt == matmul_detail::WeightType::kBF16 && matmul_detail::avx512_bf16_available();
#else
  (void)p;
  (void)isa;
  (void)precision;
  return false;
#endif
}

// Whether that path hands p to oneDNN's GEMM (whose call costs its primitive: a block then takes
// its rows in one call).
bool uses_dnnl(const matmul_detail::Problem& p, KernelIsa isa, Precision precision) {
  return bf16_path(p, isa, precision) && p.rows >= matmul_detail::kDnnlMinRows;
}

// The fewest W rows a block claims at a time (RowClaims): about 32 KiB of W (~1.5 us at
// batch 1: Q4_K at K 1024 64 rows, Q6_K at K 3072 16), a multiple of 16 rows (the widest kernels'
// W tile), 16 to 1024 rows. A claim costs a compare-and-swap on the block's own line and the
// kernel's start on its rows, a fraction of a microsecond.
int64_t min_claim_rows(int64_t row_bytes) {
  const int64_t rows = (32 * 1024 / std::max<int64_t>(row_bytes, 1) + 15) / 16 * 16;
  return std::clamp<int64_t>(rows, 16, 1024);
}

// One matmul's rows (p) on `isa` at `precision`, but the int8 path: the exact path of its
// target, or bf16 (AVX-512 BF16 or oneDNN).
absl::Status matmul_rows(const matmul_detail::Problem& p, KernelIsa isa, Precision precision) {
#if defined(__x86_64__)
  if (uses_dnnl(p, isa, precision)) return matmul_detail::run_dnnl_bf16(p);
  if (bf16_path(p, isa, precision)) {
    matmul_detail::run_avx512_bf16(p);
    return absl::OkStatus();
  }
  if (isa == KernelIsa::kAvx512) {
    matmul_detail::run_avx512(p);
    return absl::OkStatus();
  }
  if (isa == KernelIsa::kX86_64V3) {
    matmul_detail::run_x86_64_v3(p);
    return absl::OkStatus();
  }
#elif defined(__aarch64__)
  (void)precision;  // no bf16 path here
  if (isa == KernelIsa::kNeon) {
    matmul_detail::run_neon(p);
    return absl::OkStatus();
  }
#else
  (void)precision;
#endif
  matmul_detail::run_portable(p);
  return absl::OkStatus();
}

// silu_mul's elements on `isa` (resolved and available): out[i] = silu(gate[i])·up[i], each
// element on its own, so the same bits at any offset and length (defined with silu_mul below).
void silu_mul_span(KernelIsa isa, const float* gate, const float* up, float* out, int64_t n);

// One weight of a merged matmul (matmul_merged, matmul_silu_mul): its whole problem (every W row
// against x into y) and the bytes of a W row.
struct MergedWeight {
  matmul_detail::Problem full;
  int64_t row_bytes = 0;
};

// The weights of one block of a matmul task (matmul: one; matmul_merged and matmul_silu_mul:
// several) and what they share: x, quantized once per block for each weight type on the int8
// path, so a weight's rows come out bitwise whichever task computes them. One block's object, on
// its core's thread.
class MergedMatmul {
 public:
  MergedMatmul(KernelIsa isa, Precision precision) : isa_(isa), precision_(precision) {}

  // Checks argument `wi` (a weight over x's `in` columns, name `w_name`) and argument `yi` (its
  // f32 [rows, out] output, added to with `accumulate`) and adds them.
  absl::Status add(const KernelContext& ctx, const ArgCheck& c, uint32_t wi, const char* w_name,
                   uint32_t yi, const char* y_name, bool accumulate = false) {
    const Tensor& x = ctx.tensor(0);
    const int64_t rows = x.shape[0], in = x.shape[1];
    const DataType w_dtype = weight_dtype(ctx, wi);
    SIMPLER_RETURN_IF_ERROR(c.tensor(wi, w_name, w_dtype, {-1, in}));
    SIMPLER_RETURN_IF_ERROR(check_block_row(c, wi, w_name, w_dtype, in));
    const int64_t out = ctx.tensor(wi).shape[0];
    SIMPLER_RETURN_IF_ERROR(c.tensor(yi, y_name, DataType::kFloat32, {rows, out}));
    const int64_t group = task::interleaved_rows(w_dtype);
    if (out % group != 0) {
      return c.error(absl::StrCat("argument ", wi, " (", w_name, ") is ",
                                  std::string(task::name_of(w_dtype)), " with ", out,
                                  " rows, not a whole number of groups of ", group));
    }
    MergedWeight& m = weights_[n_++];
    m.full.x = x.data<const float>();
    m.full.rows = rows;
    m.full.k = in;
    m.full.wt = matmul_detail::weight_type_of(w_dtype);
    m.full.w = ctx.tensor(wi).data<const void>();
    m.full.n = out;
    m.full.y = ctx.tensor(yi).data<float>();
    m.full.ldy = out;
    m.full.accumulate = accumulate;
    m.full.interleaved = group > 1;
    m.row_bytes = static_cast<int64_t>(task::bytes_of(w_dtype, static_cast<uint64_t>(in)));
    return absl::OkStatus();
  }

  int size() const { return n_; }
  const MergedWeight& weight(int i) const { return weights_[i]; }
  // The fewest rows a claim takes (min_claim_rows of the widest row; the whole task where a
  // weight goes to oneDNN, whose call costs its primitive).
  int64_t min_claim(int64_t total) const {
    int64_t widest = 0;
    for (int i = 0; i < n_; ++i) {
      if (uses_dnnl(weights_[i].full, isa_, precision_)) return total;
      widest = std::max(widest, weights_[i].row_bytes);
    }
    return min_claim_rows(widest);
  }

  // The claims of a task of these weights over `rows` rows in all, in units of `unit`
  // (claim_unit): at least min_claim rows, aligned to the matmul kernels' W tiles where the unit
  // is a row.
  RowClaims claims(const KernelContext& ctx, int64_t rows, int64_t unit) const {
    return RowClaims(ctx, rows, min_claim(rows), unit == 1 ? RowClaims::kMatmulAlign : 1, unit);
  }

  // The rows a claim counts in (RowClaims' unit): task::kInterleavedRows where a weight's rows
  // are interleaved (so no claim splits a group), else 1. INVALID_ARGUMENT (through `c`) when a
  // weight is interleaved and another's rows are not a whole number of groups.
  absl::StatusOr<int64_t> claim_unit(const ArgCheck& c) const {
    bool interleaved = false, whole = true;
    for (int i = 0; i < n_; ++i) {
      interleaved = interleaved || weights_[i].full.interleaved;
      whole = whole && weights_[i].full.n % task::kInterleavedRows == 0;
    }
    if (!interleaved) return 1;
    if (!whole) {
      return c.error(
          "a weight's rows are interleaved 16 at a time, so every weight of the task "
          "needs a multiple of 16 rows");
    }
    return task::kInterleavedRows;
  }

  // Rows [begin, end) of weight i into its y, prefetching up to its row `ahead`.
  absl::Status run(int i, int64_t begin, int64_t end, int64_t ahead) {
    const MergedWeight& m = weights_[i];
    const matmul_detail::Problem p = rows_of(m.full, {begin, end}, ahead, m.row_bytes);
    if (p.interleaved &&
        (begin % task::kInterleavedRows != 0 || end % task::kInterleavedRows != 0)) {
      return absl::InternalError(absl::StrCat("matmul: rows [", begin, ", ", end,
                                              ") split a group of 16 interleaved rows"));
    }
    if (precision_ != Precision::kInt8 || !matmul_detail::int8_weight_type(m.full.wt)) {
      if (!p.interleaved) return matmul_rows(p, isa_, precision_);
      absl::Status st;
      matmul_detail::run_deinterleaved(p, [&](const matmul_detail::Problem& q) {
        if (st.ok()) st = matmul_rows(q, isa_, precision_);
      });
      return st;
    }
    if (!dots_) dots_ = int8_dots(isa_);
    matmul_detail::run_int8_quantized(p, quantized_for(i), *dots_);
    return absl::OkStatus();
  }

 private:
  static constexpr int kMax = kMatmulMergedMaxWeights;

  // x quantized for weight i: the first weight of i's type to run quantizes it for the others.
  const matmul_detail::QuantizedX& quantized_for(int i) {
    if (!qx_[i]) {
      for (int j = 0; j < n_; ++j) {
        // the same weight type and layout: what a target derives from x (Int8Dots::prepare) may
        // depend on both
        if (j != i && qx_[j] && weights_[j].full.wt == weights_[i].full.wt &&
            weights_[j].full.interleaved == weights_[i].full.interleaved) {
          return *qx_[j];
        }
      }
      qx_[i] = matmul_detail::quantize_int8(weights_[i].full, *dots_);
    }
    return *qx_[i];
  }

  KernelIsa isa_;
  Precision precision_;
  std::array<MergedWeight, kMax> weights_{};
  int n_ = 0;
  std::optional<matmul_detail::Int8Dots> dots_;
  std::array<std::optional<matmul_detail::QuantizedX>, kMax> qx_;
};

absl::Status matmul_impl(const KernelContext& ctx, bool accumulate, KernelIsa isa,
                         Precision precision = Precision::kExact) {
  const char* kernel = accumulate ? "matmul_acc" : "matmul";
  ArgCheck c(ctx, kernel);
  SIMPLER_RETURN_IF_ERROR(c.count(3));
  SIMPLER_RETURN_IF_ERROR(c.tensor(0, "x", DataType::kFloat32, {-1, -1}));
  SIMPLER_ASSIGN_OR_RETURN(isa, available_isa(kernel, isa));
  MergedMatmul m(isa, precision);
  SIMPLER_RETURN_IF_ERROR(m.add(ctx, c, 1, "W", 2, "y", accumulate));
  const int64_t out = m.weight(0).full.n;
  if (out == 0 || ctx.tensor(0).shape[0] == 0) return absl::OkStatus();
  SIMPLER_ASSIGN_OR_RETURN(const int64_t unit, m.claim_unit(c));
  RowClaims claims = m.claims(ctx, out, unit);
  BlockRange r;
  int64_t ahead = 0;
  while (claims.next(&r, &ahead)) SIMPLER_RETURN_IF_ERROR(m.run(0, r.begin, r.end, ahead));
  return absl::OkStatus();
}

// matmul_merged: x, then N weights, then their N outputs; the blocks claim rows over the weights'
// rows laid end to end, a claim that spans two weights running its part of each.
absl::Status matmul_merged_impl(const KernelContext& ctx, KernelIsa isa, Precision precision) {
  ArgCheck c(ctx, "matmul_merged");
  const uint32_t args = ctx.args == nullptr ? 0 : ctx.num_args;
  if (args < 3 || args % 2 == 0 || args > 1 + 2 * kMatmulMergedMaxWeights) {
    return c.error(absl::StrCat("expects x, then 1 to ", kMatmulMergedMaxWeights,
                                " weights, then their outputs (3, 5, 7 or 9 arguments), got ",
                                args));
  }
  SIMPLER_RETURN_IF_ERROR(c.count(args));
  SIMPLER_RETURN_IF_ERROR(c.tensor(0, "x", DataType::kFloat32, {-1, -1}));
  SIMPLER_ASSIGN_OR_RETURN(isa, available_isa("matmul_merged", isa));
  const uint32_t n = (args - 1) / 2;
  static constexpr const char* kW[] = {"W0", "W1", "W2", "W3"};
  static constexpr const char* kY[] = {"y0", "y1", "y2", "y3"};
  static_assert(std::size(kW) == kMatmulMergedMaxWeights && std::size(kY) == std::size(kW));
  MergedMatmul m(isa, precision);
  int64_t total = 0;
  for (uint32_t i = 0; i < n; ++i) {
    SIMPLER_RETURN_IF_ERROR(m.add(ctx, c, 1 + i, kW[i], 1 + n + i, kY[i]));
    total += m.weight(static_cast<int>(i)).full.n;
  }
  if (total == 0 || ctx.tensor(0).shape[0] == 0) return absl::OkStatus();
  SIMPLER_ASSIGN_OR_RETURN(const int64_t unit, m.claim_unit(c));
  RowClaims claims = m.claims(ctx, total, unit);
  BlockRange r;
  int64_t ahead = 0;
  while (claims.next(&r, &ahead)) {
    int64_t first = 0;  // weight i's first row in the task's rows
    for (int i = 0; i < m.size() && first < r.end; first += m.weight(i++).full.n) {
      const int64_t rows = m.weight(i).full.n;
      const int64_t begin = std::max(r.begin, first) - first,
                    end = std::min(r.end, first + rows) - first;
      if (begin >= end) continue;
      SIMPLER_RETURN_IF_ERROR(m.run(i, begin, end, std::min(ahead - first, rows)));
    }
  }
  return absl::OkStatus();
}

// matmul_silu_mul: x, W_gate, W_up, gate, up, act; the blocks claim rows of the intermediate
// features, each claim computing its gate and up rows, then act's columns of them for every row
// of x.
absl::Status matmul_silu_mul_impl(const KernelContext& ctx, KernelIsa isa, Precision precision) {
  ArgCheck c(ctx, "matmul_silu_mul");
  SIMPLER_RETURN_IF_ERROR(c.count(6));
  SIMPLER_RETURN_IF_ERROR(c.tensor(0, "x", DataType::kFloat32, {-1, -1}));
  SIMPLER_ASSIGN_OR_RETURN(isa, available_isa("matmul_silu_mul", isa));
  MergedMatmul m(isa, precision);
  SIMPLER_RETURN_IF_ERROR(m.add(ctx, c, 1, "W_gate", 3, "gate"));
  const int64_t rows = ctx.tensor(0).shape[0], out = m.weight(0).full.n;
  SIMPLER_RETURN_IF_ERROR(c.tensor(2, "W_up", weight_dtype(ctx, 2), {out, ctx.tensor(0).shape[1]}));
  SIMPLER_RETURN_IF_ERROR(m.add(ctx, c, 2, "W_up", 4, "up"));
  SIMPLER_RETURN_IF_ERROR(c.tensor(5, "act", DataType::kFloat32, {rows, out}));
  if (out == 0 || rows == 0) return absl::OkStatus();
  const float* gate = m.weight(0).full.y;
  const float* up = m.weight(1).full.y;
  float* act = ctx.tensor(5).data<float>();
  SIMPLER_ASSIGN_OR_RETURN(const int64_t unit, m.claim_unit(c));
  RowClaims claims = m.claims(ctx, out, unit);
  BlockRange r;
  int64_t ahead = 0;
  while (claims.next(&r, &ahead)) {
    SIMPLER_RETURN_IF_ERROR(m.run(0, r.begin, r.end, ahead));
    SIMPLER_RETURN_IF_ERROR(m.run(1, r.begin, r.end, ahead));
    for (int64_t b = 0; b < rows; ++b) {
      const int64_t at = b * out + r.begin;
      silu_mul_span(isa, gate + at, up + at, act + at, r.end - r.begin);
    }
  }
  return absl::OkStatus();
}

absl::Status matmul_bf16_kernel(const KernelContext& ctx) {
  return matmul_impl(ctx, false, KernelIsa::kAuto, Precision::kBf16);
}
absl::Status matmul_acc_bf16_kernel(const KernelContext& ctx) {
  return matmul_impl(ctx, true, KernelIsa::kAuto, Precision::kBf16);
}

template <KernelIsa kIsa, Precision kPrecision = Precision::kExact>
absl::Status matmul_kernel_on(const KernelContext& ctx) {
  return matmul_impl(ctx, false, kIsa, kPrecision);
}
template <KernelIsa kIsa, Precision kPrecision = Precision::kExact>
absl::Status matmul_acc_kernel_on(const KernelContext& ctx) {
  return matmul_impl(ctx, true, kIsa, kPrecision);
}

template <KernelIsa kIsa, Precision kPrecision = Precision::kExact>
absl::Status matmul_merged_kernel_on(const KernelContext& ctx) {
  return matmul_merged_impl(ctx, kIsa, kPrecision);
}
template <KernelIsa kIsa, Precision kPrecision = Precision::kExact>
absl::Status matmul_silu_mul_kernel_on(const KernelContext& ctx) {
  return matmul_silu_mul_impl(ctx, kIsa, kPrecision);
}

absl::Status paged_attention_impl(const KernelContext& ctx, KernelIsa isa);
template <KernelIsa kIsa>
absl::Status paged_attention_kernel_on(const KernelContext& ctx) {
  return paged_attention_impl(ctx, kIsa);
}

absl::Status silu_mul_impl(const KernelContext& ctx, KernelIsa isa);
template <KernelIsa kIsa>
absl::Status silu_mul_kernel_on(const KernelContext& ctx) {
  return silu_mul_impl(ctx, kIsa);
}

absl::Status argmax_impl(const KernelContext& ctx, KernelIsa isa);
template <KernelIsa kIsa>
absl::Status argmax_kernel_on(const KernelContext& ctx) {
  return argmax_impl(ctx, kIsa);
}

// The kernels whose inner loops have a path per target, for `isa` (resolved); the matmuls of
// precision int8 too.
struct IsaKernels {
  task::KernelFn matmul, matmul_acc, paged_attention, silu_mul, argmax, matmul_int8,
      matmul_acc_int8, matmul_merged, matmul_merged_int8, matmul_silu_mul, matmul_silu_mul_int8;
};
template <KernelIsa kIsa>
constexpr IsaKernels isa_kernels() {
  return {&matmul_kernel_on<kIsa>,
          &matmul_acc_kernel_on<kIsa>,
          &paged_attention_kernel_on<kIsa>,
          &silu_mul_kernel_on<kIsa>,
          &argmax_kernel_on<kIsa>,
          &matmul_kernel_on<kIsa, Precision::kInt8>,
          &matmul_acc_kernel_on<kIsa, Precision::kInt8>,
          &matmul_merged_kernel_on<kIsa>,
          &matmul_merged_kernel_on<kIsa, Precision::kInt8>,
          &matmul_silu_mul_kernel_on<kIsa>,
          &matmul_silu_mul_kernel_on<kIsa, Precision::kInt8>};
}
IsaKernels isa_kernels(KernelIsa isa) {
  switch (isa) {
    case KernelIsa::kAvx512:
      return isa_kernels<KernelIsa::kAvx512>();
    case KernelIsa::kX86_64V3:
      return isa_kernels<KernelIsa::kX86_64V3>();
    case KernelIsa::kNeon:
      return isa_kernels<KernelIsa::kNeon>();
    case KernelIsa::kPortable:
      return isa_kernels<KernelIsa::kPortable>();
    case KernelIsa::kAuto:
      break;
  }
  return isa_kernels<KernelIsa::kAuto>();
}

constexpr KernelIsa kTargetsBestFirst[] = {KernelIsa::kAvx512, KernelIsa::kX86_64V3,
                                           KernelIsa::kNeon, KernelIsa::kPortable};

}  // namespace

BlockRange block_range(int64_t n, int32_t block_idx, int32_t block_dim) {
  if (block_dim < 1 || block_idx < 0 || block_idx >= block_dim || n <= 0) return {};
  return {n * block_idx / block_dim, n * (block_idx + 1) / block_dim};
}

namespace {

constexpr base::EnumNames<KernelIsa> kIsaNames = {{KernelIsa::kAuto, "auto"},
                                                  {KernelIsa::kPortable, "portable"},
                                                  {KernelIsa::kX86_64V3, "x86-64-v3"},
                                                  {KernelIsa::kAvx512, "avx512"},
                                                  {KernelIsa::kNeon, "neon"}};

}  // namespace

const char* name_of(KernelIsa isa) { return kIsaNames.c_name(isa, "?"); }

absl::StatusOr<KernelIsa> parse_kernel_isa(std::string_view name) {
  if (std::optional<KernelIsa> isa = kIsaNames.parse(name)) return *isa;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown kernel ISA '", std::string(name),
                   "' (expected auto, portable, x86-64-v3, avx512 or neon)"));
}

bool kernel_isa_fused(KernelIsa isa) {
  return resolve_kernel_isa(isa) != KernelIsa::kPortable || matmul_detail::portable_fused();
}

bool kernel_isa_available(KernelIsa isa) {
  switch (isa) {
    case KernelIsa::kAvx512:
      return matmul_detail::avx512_available();
    case KernelIsa::kX86_64V3:
      return matmul_detail::x86_64_v3_available();
    case KernelIsa::kNeon:
#if defined(__aarch64__)
      return matmul_detail::neon_available();
#else
      return false;  // not built into this binary
#endif
    case KernelIsa::kAuto:
    case KernelIsa::kPortable:
      break;
  }
  return true;
}

std::string available_kernel_isas() {
  std::vector<std::string> names;
  for (KernelIsa isa : kTargetsBestFirst) {
    if (kernel_isa_available(isa)) names.emplace_back(name_of(isa));
  }
  return absl::StrJoin(names, ", ");
}

const char* kernel_isa_requirements(KernelIsa isa) {
  switch (isa) {
    case KernelIsa::kAvx512:
      return "AVX-512 F, BW, VL and DQ";
    case KernelIsa::kX86_64V3:
      return "AVX2, FMA and F16C";
    case KernelIsa::kNeon:
      return "an aarch64 CPU (Advanced SIMD with FMA)";
    case KernelIsa::kAuto:
    case KernelIsa::kPortable:
      break;
  }
  return "nothing";
}

KernelIsa resolve_kernel_isa(KernelIsa isa) {
  if (isa != KernelIsa::kAuto) return isa;
  for (KernelIsa target : kTargetsBestFirst) {
    if (kernel_isa_available(target)) return target;
  }
  return KernelIsa::kPortable;
}

double measure_f32_fma_peak(KernelIsa isa, int threads, double seconds) {
  isa = resolve_kernel_isa(isa);
  if (threads <= 0) threads = base::hardware_threads();
  auto probe = [isa](int64_t iters, float seed) {
    switch (isa) {
#if defined(__x86_64__)
      case KernelIsa::kAvx512:
        return matmul_detail::fma_probe_avx512(iters, seed);
      case KernelIsa::kX86_64V3:
        return matmul_detail::fma_probe_x86_64_v3(iters, seed);
#elif defined(__aarch64__)
      case KernelIsa::kNeon:
        return matmul_detail::fma_probe_neon(iters, seed);
#endif
      default:
        return matmul_detail::fma_probe_portable(iters, seed);
    }
  };
  // Calibrate the iterations to about `seconds` on one thread.
  int64_t iters = 1 << 12;
  for (;;) {
    const int64_t t0 = base::now_ns();
    volatile float keep = probe(iters, 1.0f);
    (void)keep;
    const double s = (base::now_ns() - t0) / 1e9;
    if (s >= seconds / 4 || iters > (int64_t{1} << 40)) {
      iters = static_cast<int64_t>(iters * (seconds / std::max(s, 1e-9)));
      break;
    }
    iters *= 4;
  }
  double best = 0;
  for (int pass = 0; pass < 3; ++pass) {
    std::vector<std::thread> ts;
    std::atomic<float> sink{0};
    const int64_t t0 = base::now_ns();
    for (int t = 0; t < threads; ++t) {
      ts.emplace_back([&, t] { sink.store(probe(iters, 1.0f + t), std::memory_order_relaxed); });
    }
    for (std::thread& th : ts) th.join();
    const double s = (base::now_ns() - t0) / 1e9;
    best = std::max(best, static_cast<double>(threads) * iters * 12 * 16 * 2 / s);
  }
  return best;
}

namespace {

constexpr base::EnumNames<Precision> kPrecisionNames = {
    {Precision::kExact, "exact"}, {Precision::kBf16, "bf16"}, {Precision::kInt8, "int8"}};

}  // namespace

const char* name_of(Precision precision) { return kPrecisionNames.c_name(precision, "exact"); }

absl::StatusOr<Precision> parse_precision(std::string_view name) {
  if (std::optional<Precision> p = kPrecisionNames.parse(name)) return *p;
  return absl::InvalidArgumentError(
      absl::StrCat("precision '", std::string(name), "': expected exact, bf16 or int8"));
}

bool bf16_precision_available() {
#if defined(__x86_64__)
  return matmul_detail::avx512_bf16_available();
#else
  return false;
#endif
}

std::string describe_bf16_precision() {
  const std::string impl = matmul_detail::dnnl_bf16_implementation();
#if defined(__x86_64__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  const bool cpu_amx = __get_cpuid_count(7, 0, &a, &b, &c, &d) != 0 && (d & (1u << 24)) != 0;
#else
  const bool cpu_amx = false;
#endif
  const char* amx = !cpu_amx                                ? "this CPU has no AMX"
                    : impl.find("amx") != std::string::npos ? "AMX in use"
                                                            : "this CPU has AMX but the kernel did "
                                                              "not grant it (arch_prctl "
                                                              "ARCH_REQ_XCOMP_PERM): AVX-512 BF16 "
                                                              "instead";
  return absl::StrCat("bf16 activations: fewer than ", matmul_detail::kDnnlMinRows,
                      " rows on simpler's AVX-512 BF16 kernel, batched rows on oneDNN ", impl, " (",
                      amx, ")");
}

Precision effective_precision(KernelIsa isa, Precision precision) {
  if (precision == Precision::kBf16 &&
      (!bf16_precision_available() || resolve_kernel_isa(isa) != KernelIsa::kAvx512)) {
    return Precision::kExact;
  }
  return precision;
}

bool prefers_interleaved_weights(KernelIsa isa, Precision precision) {
  if (precision != Precision::kInt8) return false;
  const KernelIsa resolved = resolve_kernel_isa(isa);
  return kernel_isa_available(resolved) && int8_dots(resolved).interleaved;
}

std::vector<task::Kernel> llm_kernels(KernelIsa isa, Precision precision) {
  const IsaKernels on = isa_kernels(isa);
  task::KernelFn matmul = on.matmul;
  task::KernelFn matmul_acc = on.matmul_acc;
  task::KernelFn matmul_merged = on.matmul_merged;
  task::KernelFn matmul_silu_mul = on.matmul_silu_mul;
  if (effective_precision(isa, precision) == Precision::kBf16) {
    matmul = &matmul_bf16_kernel;
    matmul_acc = &matmul_acc_bf16_kernel;
    matmul_merged = &matmul_merged_kernel_on<KernelIsa::kAuto, Precision::kBf16>;
    matmul_silu_mul = &matmul_silu_mul_kernel_on<KernelIsa::kAuto, Precision::kBf16>;
  } else if (precision == Precision::kInt8) {
    matmul = on.matmul_int8;
    matmul_acc = on.matmul_acc_int8;
    matmul_merged = on.matmul_merged_int8;
    matmul_silu_mul = on.matmul_silu_mul_int8;
  }
  return {
      {"embedding", &embedding_kernel},
      {"rms_norm", &rms_norm_kernel},
      {"matmul", matmul},
      {"matmul_acc", matmul_acc},
      {"rope", &rope_kernel},
      {"kv_write", &kv_write_kernel},
      {"paged_attention", on.paged_attention},
      {"silu_mul", on.silu_mul},
      {"add", &add_kernel},
      {"gather_rows", &gather_rows_kernel},
      {"argmax", on.argmax},
      {"qk_norm_rope_kv", &qk_norm_rope_kv_kernel},
      {"matmul_merged", matmul_merged},
      {"matmul_silu_mul", matmul_silu_mul},
  };
}

// ---- embedding ----------------------------------------------------------------

absl::Status embedding_kernel(const KernelContext& ctx) {
  ArgCheck c(ctx, "embedding");
  SIMPLER_RETURN_IF_ERROR(c.count(3));
  SIMPLER_RETURN_IF_ERROR(c.tensor(0, "ids", DataType::kInt32, {-1}));
  const int64_t rows = ctx.tensor(0).shape[0];
  const DataType table_dtype = weight_dtype(ctx, 1);
  SIMPLER_RETURN_IF_ERROR(c.tensor(1, "table", table_dtype, {-1, -1}));
  const int64_t vocab = ctx.tensor(1).shape[0];
  const int64_t hidden = ctx.tensor(1).shape[1];
  SIMPLER_RETURN_IF_ERROR(check_block_row(c, 1, "table", table_dtype, hidden));
  if (vocab % task::interleaved_rows(table_dtype) != 0) {
    return c.error(absl::StrCat("argument 1 (table) is ", std::string(task::name_of(table_dtype)),
                                " with ", vocab, " rows, not a whole number of groups of ",
                                task::interleaved_rows(table_dtype)));
  }
  SIMPLER_RETURN_IF_ERROR(c.tensor(2, "out", DataType::kFloat32, {rows, hidden}));
  const int32_t* ids = ctx.tensor(0).data<const int32_t>();
  float* out = ctx.tensor(2).data<float>();
  const BlockRange r = block_range(rows, ctx.block_idx, ctx.block_dim);
  for (int64_t b = r.begin; b < r.end; ++b) {
    const int64_t id = ids[b];
    if (id < 0 || id >= vocab) {
      return c.error(absl::StrCat("token id ", id, " at row ", b, " is outside the vocabulary [0, ",
                                  vocab, ")"));
    }
    float* o = out + b * hidden;
    if (task::interleaved_rows(table_dtype) > 1) {
      thread_local std::vector<uint8_t> row;
      row.resize(task::bytes_of(table_dtype, static_cast<uint64_t>(hidden)));
      task::deinterleave_row(table_dtype, ctx.tensor(1).data<const uint8_t>(), id, hidden,
                             row.data());
      dequantize_block_row(task::plain_of(table_dtype), row.data(), hidden, o);
    } else if (task::block_elements(table_dtype) > 1) {
      dequantize_block_row(table_dtype,
                           ctx.tensor(1).data<const uint8_t>() +
                               id * task::bytes_of(table_dtype, static_cast<uint64_t>(hidden)),
                           hidden, o);
    } else if (table_dtype == DataType::kFloat32) {
      std::memcpy(o, ctx.tensor(1).data<const float>() + id * hidden, sizeof(float) * hidden);
    } else {
      const uint16_t* t = ctx.tensor(1).data<const uint16_t>() + id * hidden;
      for (int64_t i = 0; i < hidden; ++i) {
        o[i] =
            table_dtype == DataType::kBFloat16 ? task::bf16_to_f32(t[i]) : task::f16_to_f32(t[i]);
      }
    }
  }
  return absl::OkStatus();
}

TaskArgs embedding_args(const Tensor& ids, const Tensor& table, const Tensor& out) {
  return reads_then({ids, table}, out);
}

// ---- rms_norm -------------------------------------------------------------------

absl::Status rms_norm_kernel(const KernelContext& ctx) {
  ArgCheck c(ctx, "rms_norm");
  SIMPLER_RETURN_IF_ERROR(c.count(4));
  SIMPLER_RETURN_IF_ERROR(c.tensor(0, "x", DataType::kFloat32, {-1, -1}));
  const int64_t rows = ctx.tensor(0).shape[0];
  const int64_t dim = ctx.tensor(0).shape[1];
  SIMPLER_RETURN_IF_ERROR(c.tensor(1, "w", DataType::kFloat32, {dim}));
  SIMPLER_RETURN_IF_ERROR(c.tensor(2, "out", DataType::kFloat32, {rows, dim}));
  SIMPLER_RETURN_IF_ERROR(c.scalar(3, "eps"));
  const double eps = ctx.scalar_f32(3);
  const float* x = ctx.tensor(0).data<const float>();
  const float* w = ctx.tensor(1).data<const float>();
  float* out = ctx.tensor(2).data<float>();
  const BlockRange r = block_range(rows, ctx.block_idx, ctx.block_dim);
  if (r.begin < r.end) {
    row_ops::rms_norm_rows(x + r.begin * dim, w, r.end - r.begin, dim, eps, out + r.begin * dim);
  }
  return absl::OkStatus();
}

TaskArgs rms_norm_args(const Tensor& x, const Tensor& w, const Tensor& out, float eps) {
  TaskArgs a = reads_then({x, w}, out);
  a.add_scalar_f32(eps);
  return a;
}

// ---- matmul -----------------------------------------------------------------------

absl::Status matmul_kernel(const KernelContext& ctx) {
  return matmul_impl(ctx, false, KernelIsa::kAuto);
}
absl::Status matmul_acc_kernel(const KernelContext& ctx) {
  return matmul_impl(ctx, true, KernelIsa::kAuto);
}

TaskArgs matmul_args(const Tensor& x, const Tensor& w, const Tensor& y) {
  return reads_then({x, w}, y);
}

TaskArgs matmul_acc_args(const Tensor& x, const Tensor& w, const Tensor& y) {
  return reads_then({x, w}, y, ArgDirection::kInOut);
}

absl::Status matmul_merged_kernel(const KernelContext& ctx) {
  return matmul_merged_impl(ctx, KernelIsa::kAuto, Precision::kExact);
}

TaskArgs matmul_merged_args(const Tensor& x, std::span<const Tensor> ws,
                            std::span<const Tensor> ys) {
  TaskArgs a;
  a.add_tensor(x, ArgDirection::kIn);
  if (ws.size() != ys.size() || ws.empty() || ws.size() > kMatmulMergedMaxWeights) return a;
  for (const Tensor& w : ws) a.add_tensor(w, ArgDirection::kIn);
  for (const Tensor& y : ys) a.add_tensor(y, ArgDirection::kOut);
  return a;
}

absl::Status matmul_silu_mul_kernel(const KernelContext& ctx) {
  return matmul_silu_mul_impl(ctx, KernelIsa::kAuto, Precision::kExact);
}

TaskArgs matmul_silu_mul_args(const Tensor& x, const Tensor& w_gate, const Tensor& w_up,
                              const Tensor& gate, const Tensor& up, const Tensor& act) {
  TaskArgs a;
  a.add_tensors({x, w_gate, w_up}, ArgDirection::kIn)
      .add_tensors({gate, up, act}, ArgDirection::kOut);
  return a;
}

// ---- rope -------------------------------------------------------------------------

absl::Status rope_kernel(const KernelContext& ctx) {
  ArgCheck c(ctx, "rope");
  SIMPLER_RETURN_IF_ERROR(c.count(3));
  SIMPLER_RETURN_IF_ERROR(c.tensor(0, "x", DataType::kFloat32, {-1, -1, -1}));
  const Tensor& x = ctx.tensor(0);
  const int64_t rows = x.shape[0];
  const int64_t heads = x.shape[1];
  const int64_t dim = x.shape[2];
  SIMPLER_RETURN_IF_ERROR(c.tensor(1, "positions", DataType::kInt32, {rows}));
  SIMPLER_RETURN_IF_ERROR(c.scalar(2, "theta"));
  const double theta = ctx.scalar_f32(2);
  SIMPLER_RETURN_IF_ERROR(row_ops::check_rope(c, dim, theta));
  const int32_t* positions = ctx.tensor(1).data<const int32_t>();
  float* data = x.data<float>();
  const BlockRange r = block_range(rows, ctx.block_idx, ctx.block_dim);
  if (r.begin >= r.end) return absl::OkStatus();
  row_ops::RopeAngles angles(dim, theta);
  for (int64_t b = r.begin; b < r.end; ++b) {
    SIMPLER_RETURN_IF_ERROR(angles.at_row(c, positions, b));
    angles.rotate(data + b * heads * dim, heads);
  }
  return absl::OkStatus();
}

TaskArgs rope_args(const Tensor& x, const Tensor& positions, float theta) {
  TaskArgs a;
  a.add_tensor(x, ArgDirection::kInOut)
      .add_tensor(positions, ArgDirection::kIn)
      .add_scalar_f32(theta);
  return a;
}

// ---- kv_write -----------------------------------------------------------------------

absl::Status kv_write_kernel(const KernelContext& ctx) {
  ArgCheck c(ctx, "kv_write");
  SIMPLER_RETURN_IF_ERROR(c.count(5));
  SIMPLER_RETURN_IF_ERROR(c.tensor(0, "k", DataType::kFloat32, {-1, -1, -1}));
  const int64_t rows = ctx.tensor(0).shape[0];
  const int64_t n_kv = ctx.tensor(0).shape[1];
  const int64_t dim = ctx.tensor(0).shape[2];
  SIMPLER_RETURN_IF_ERROR(c.tensor(1, "v", DataType::kFloat32, {rows, n_kv, dim}));
  SIMPLER_RETURN_IF_ERROR(c.tensor(2, "slot_mapping", DataType::kInt32, {rows}));
  SIMPLER_RETURN_IF_ERROR(c.tensor(3, "k_pool", DataType::kFloat32, {-1, n_kv, -1, dim}));
  const int64_t pages = ctx.tensor(3).shape[0];
  const int64_t page_size = ctx.tensor(3).shape[2];
  SIMPLER_RETURN_IF_ERROR(c.tensor(4, "v_pool", DataType::kFloat32, {pages, n_kv, page_size, dim}));
  const row_ops::KvCache cache{
      ctx.tensor(3).data<float>(), ctx.tensor(4).data<float>(), pages, page_size, n_kv, dim};
  const float* k = ctx.tensor(0).data<const float>();
  const float* v = ctx.tensor(1).data<const float>();
  const int32_t* slot_mapping = ctx.tensor(2).data<const int32_t>();
  const BlockRange r = block_range(rows, ctx.block_idx, ctx.block_dim);
  for (int64_t b = r.begin; b < r.end; ++b) {
    SIMPLER_RETURN_IF_ERROR(row_ops::write_kv_row(c, cache, b, slot_mapping[b], k + b * n_kv * dim,
                                                  v + b * n_kv * dim));
  }
  return absl::OkStatus();
}

TaskArgs kv_write_args(const Tensor& k, const Tensor& v, const Tensor& slot_mapping,
                       const Tensor& k_pool, const Tensor& v_pool) {
  TaskArgs a;
  a.add_tensors({k, v, slot_mapping}, ArgDirection::kIn)
      .add_tensors({k_pool, v_pool}, ArgDirection::kInOut);
  return a;
}

// ---- paged_attention ------------------------------------------------------------------

namespace {

// The inner loops of paged_attention, written lane-wise (16 independent f32 lanes, then the
// fixed reduction tree of matmul_impl.h) so that the compiler vectorizes them without
// reassociating anything; built once per ISA target (see attend_tile) and picked by the
// kernel's target. Results depend on nothing but the row's own q, K, V, and are bitwise the same
// on every target.
constexpr int kLanes = 16;

__attribute__((always_inline)) inline float reduce_lanes(const float* l) {
  float s8[8], s4[4];
  for (int i = 0; i < 8; ++i) s8[i] = l[i] + l[i + 8];
  for (int i = 0; i < 4; ++i) s4[i] = s8[i] + s8[i + 4];
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

// How the attention loops multiply-add: every multiply-add of the tile is one fused
// multiply-add (written out, not left to the compiler's contraction), a hardware instruction on
// the FMA targets (inlined into functions built for them) and matmul_detail::fma_exact_scalar on
// the baseline, so every target computes the same bits.
struct HwFma {
  static float fma(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
};
struct ExactFma {
  static float fma(float a, float b, float c) { return matmul_detail::fma_exact_scalar(a, b, c); }
};

// exp_nonpositive's constants (Cephes' expf: ln 2 split into an exact high part and a low
// correction, and the polynomial's coefficients, highest first), one
// table for the scalar and the vector forms so that they stay one function.
constexpr float kExpLowest = -87.0f;  // exp(-87) is still a normal float
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f;
constexpr float kLn2Lo = -2.12194440e-4f;
constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

// exp(x) for x <= 0 (x below -87 is taken as -87: exp gives 1.6e-38 instead of a smaller
// number), to about 2 ulp: Cody-Waite range reduction by ln 2 and a degree-6 polynomial
// (Cephes expf). NaN gives NaN (a NaN score, from NaN weights or activations, spreads as the
// vector targets' arithmetic spreads it; the float-to-int conversion below never sees it).
// Branch-free, so loops over it vectorize.
template <class F>
__attribute__((always_inline)) inline float exp_nonpositive(float x) {
  const bool nan = x != x;
  x = nan ? 0.0f : (x < kExpLowest ? kExpLowest : x);
  // floor(v) for v in [-125, 0.5] without a libm call (baseline x86-64 has no rounding
  // instruction): truncation toward zero, one less where that rounded up.
  const float v = F::fma(x, kLog2e, 0.5f);
  const float t = static_cast<float>(static_cast<int32_t>(v));
  const float n = t > v ? t - 1.0f : t;
  float r = F::fma(-n, kLn2Hi, x);
  r = F::fma(-n, kLn2Lo, r);
  float p = kExpPoly[0];
  for (int k = 1; k < 6; ++k) p = F::fma(p, r, kExpPoly[k]);
  p = F::fma(p * r, r, r) + 1.0f;
  const int32_t e = static_cast<int32_t>(n) + 127;
  return nan ? std::numeric_limits<float>::quiet_NaN() : p * std::bit_cast<float>(e << 23);
}

// a += p·v over n elements (restrict parameters: the vectorizer may assume no overlap).
template <class F>
__attribute__((always_inline)) inline void axpy(float* __restrict a, const float* __restrict v,
                                                float p, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) a[i + l] = F::fma(p, v[i + l], a[i + l]);
  }
  for (; i < n; ++i) a[i] = F::fma(p, v[i], a[i]);
}

// Σ q·k in 16 lanes, then the fixed tree.
template <class F>
__attribute__((always_inline)) inline float dot_lanes(const float* __restrict q,
                                                      const float* __restrict k, int64_t n) {
  float lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) lanes[l] = F::fma(q[i + l], k[i + l], lanes[l]);
  }
  for (int l = 0; i + l < n; ++l) lanes[l] = F::fma(q[i + l], k[i + l], lanes[l]);
  return reduce_lanes(lanes);
}

// sc[t] = exp(sc[t] - m) for t < n; returns their sum (16 lanes, then the fixed tree).
template <class F>
__attribute__((always_inline)) inline float exp_shifted_sum(float* __restrict sc, float m,
                                                            int64_t n) {
  float lanes[kLanes] = {};
  int64_t t = 0;
  for (; t + kLanes <= n; t += kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      sc[t + l] = exp_nonpositive<F>(sc[t + l] - m);
      lanes[l] += sc[t + l];
    }
  }
  for (int l = 0; t + l < n; ++l) {
    sc[t + l] = exp_nonpositive<F>(sc[t + l] - m);
    lanes[l] += sc[t + l];
  }
  return reduce_lanes(lanes);
}

// Rows of one step that attend the same cached positions (a prefill chunk's rows: one request,
// one block table) go through the kernel together, at most this many at a time, so each cached
// K and V row is read once per tile instead of once per query row.
constexpr int64_t kMaxTileRows = 8;

// A tile: rows (1 ... kMaxTileRows) whose block tables agree on every block they use, and one kv
// head g: each row's `group` query heads (contiguous, dim each) attend its first lens[i]
// cached positions, read through `table` (the table of the row with the longest context).
struct AttendTile {
  int64_t rows = 0, group = 0, dim = 0, page_size = 0, n_kv = 0, g = 0, max_len = 0;
  float scale = 0;
  const int64_t* lens = nullptr;    // [rows]
  const float* const* q = nullptr;  // [rows] -> group x dim
  float* const* out = nullptr;      // [rows] -> group x dim
  const int32_t* table = nullptr;

  // fn(t, i, h, row) for each cached position t < max_len in increasing t, with its K or V row
  // of `pool`, and each query (row i, head h) that attends it (t < lens[i]), in increasing
  // (i, h): the rows found kSpan positions at a time (cached_rows: one division a span,
  // none a position).
  // Always inlined, as fn must be: into each target's tile, so fn's arithmetic is built for it.
  template <class Fn>
  __attribute__((always_inline)) void for_each_attending(const float* pool, Fn fn) const {
    constexpr int64_t kSpan = 32;
    const float* kv_rows[kSpan];
    for (int64_t t0 = 0; t0 < max_len; t0 += kSpan) {
      const int64_t n = std::min(kSpan, max_len - t0);
      cached_rows(pool, t0, n, kv_rows);
      for (int64_t t = t0; t < t0 + n; ++t) {
        for (int64_t i = 0; i < rows; ++i) {
          if (t >= lens[i]) continue;
          for (int64_t h = 0; h < group; ++h) fn(t, i, h, kv_rows[t - t0]);
        }
      }
    }
  }

  // The K or V rows (of `pool`: [pages, n_kv, page_size, dim], a kv head's positions within a
  // page contiguous) of kv head g's cached positions t0 .. t0 + n - 1 into rows[0, n), walking
  // the pages: one division for the n, not one each.
  void cached_rows(const float* pool, int64_t t0, int64_t n, const float** rows) const {
    int64_t page = t0 / page_size, at = t0 % page_size;
    const float* row = pool + kv_pool_offset(table[page], g, at, n_kv, page_size, dim);
    for (int64_t j = 0; j < n; ++j) {
      rows[j] = row;
      if (++at < page_size) {
        row += dim;
      } else if (j + 1 < n) {  // only then: the table's next entry may lie past the row's pages
        at = 0;
        row = pool + kv_pool_offset(table[++page], g, 0, n_kv, page_size, dim);
      }
    }
  }
};

#if defined(__x86_64__)
__attribute__((target("avx512f"))) inline float exp_shifted_sum16(float* sc, float m, int64_t n);
#else
inline float exp_shifted_sum16(float*, float, int64_t) { return 0.0f; }  // AVX-512 only: unused
#endif

// Each (row, head) query's softmax over its own positions, in place (max subtracted, then
// exp_shifted_sum, or its 16-lane form in the AVX-512 tile), and 1 / Σ into inv; query qi =
// row · group + head. Inlined into each caller, so it compiles for the caller's target (a
// lambda around the exp would not: it would lose the AVX-512 build's fused multiply-adds).
template <bool kVectorExp, class F = HwFma>
__attribute__((always_inline)) inline void softmax_weights(const AttendTile& s, float* scores,
                                                           float* inv) {
  for (int64_t qi = 0; qi < s.rows * s.group; ++qi) {
    const int64_t row_len = s.lens[qi / s.group];
    float* sc = scores + qi * s.max_len;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < row_len; ++t) m = sc[t] > m ? sc[t] : m;
    float sum = 0.0f;
    if (row_len > 0) {
      if constexpr (kVectorExp) {
        sum = exp_shifted_sum16(sc, m, row_len);
      } else {
        sum = exp_shifted_sum<F>(sc, m, row_len);
      }
    }
    inv[qi] = sum > 0.0f ? 1.0f / sum : 0.0f;
  }
}

// The tile's attention. Each row's arithmetic is the one-row computation exactly (scores
// scale·q·k in increasing t, the max, exp and their sum over its own positions, V accumulated
// in increasing t), so a row's result does not depend on the rows tiled with it. scores:
// rows x group x max_len scratch; acc: rows x group x (dim + 1) scratch (the accumulators, then
// each head's 1 / Σ weights).
template <class F>
__attribute__((always_inline)) inline void attend_tile_body(const AttendTile& s,
                                                            const float* k_pool,
                                                            const float* v_pool, float* scores,
                                                            float* acc) {
  const int64_t group = s.group, dim = s.dim, len = s.max_len, heads = s.rows * group;
  // Scores: scale · q_h · k_t, each cached k read once for the tile.
  s.for_each_attending(
      k_pool, [&](int64_t t, int64_t i, int64_t h, const float* k) __attribute__((always_inline)) {
        scores[(i * group + h) * len + t] = s.scale * dot_lanes<F>(s.q[i] + h * dim, k, dim);
      });
  float* inv = acc + heads * dim;
  softmax_weights<false, F>(s, scores, inv);
  // Weighted sum of V, each cached v read once for the tile.
  for (int64_t i = 0; i < heads * dim; ++i) acc[i] = 0.0f;
  s.for_each_attending(
      v_pool, [&](int64_t t, int64_t i, int64_t h, const float* v) __attribute__((always_inline)) {
        axpy<F>(acc + (i * group + h) * dim, v, scores[(i * group + h) * len + t], dim);
      });
  for (int64_t i = 0; i < s.rows; ++i) {
    for (int64_t h = 0; h < group; ++h) {
      const float* a = acc + (i * group + h) * dim;
      for (int64_t e = 0; e < dim; ++e) s.out[i][h * dim + e] = a[e] * inv[i * group + h];
    }
  }
}

// The body built once per target: AVX-512, x86-64-v3 (attend_tile_x86_64_v3 below) and the
// baseline (its fused multiply-adds computed exactly without an FMA instruction), picked by the
// kernel's target at the call (not by an ifunc: ifunc resolvers run before ThreadSanitizer's
// runtime starts).
#if defined(__x86_64__)
__attribute__((target("avx512f"))) void attend_tile_avx512(const AttendTile& s, const float* k_pool,
                                                           const float* v_pool, float* scores,
                                                           float* acc) {
  attend_tile_body<HwFma>(s, k_pool, v_pool, scores, acc);
}
#endif
#if defined(__aarch64__)
// NEON: the baseline build, where fused multiply-adds are instructions (ASIMD with FMA).
void attend_tile_neon(const AttendTile& s, const float* k_pool, const float* v_pool, float* scores,
                      float* acc) {
  attend_tile_body<HwFma>(s, k_pool, v_pool, scores, acc);
}
#endif
void attend_tile_baseline(const AttendTile& s, const float* k_pool, const float* v_pool,
                          float* scores, float* acc) {
  attend_tile_body<ExactFma>(s, k_pool, v_pool, scores, acc);
}

#if defined(__x86_64__)
// The targets' own tiles (attend_tile_avx512_dim, attend_tile_avx2_dim: head dims 16·C, C = 4, 8)
// share these two pieces.

// A head dim's worth of zeros: a tile's key rows past the context, so that a block of keys is
// always whole.
alignas(64) constexpr float kZeroKey[8 * kLanes] = {};

// The tile's outputs: each query's sum (acc, heads x dim) times its inverse softmax total (inv),
// 0 for empty rows. Inlined into each target's tile; kLanes elements at a time read into locals
// before they are written (as row_ops does), so each target vectorizes it on its own lanes.
template <int C>
__attribute__((always_inline)) inline void attend_out_dim(const AttendTile& s, const float* acc,
                                                          const float* inv) {
  constexpr int64_t dim = C * kLanes;
  const int64_t group = s.group, heads = s.rows * group;
  for (int64_t qi = 0; qi < heads; ++qi) {
    float* o = s.out[qi / group] + (qi % group) * dim;
    const float* a = acc + qi * dim;
    if (s.lens[qi / group] == 0) {
      std::fill(o, o + dim, 0.0f);
      continue;
    }
    const float f = inv[qi];
    for (int64_t e0 = 0; e0 < dim; e0 += kLanes) {
      float l[kLanes];
      for (int e = 0; e < kLanes; ++e) l[e] = a[e0 + e];
      for (int e = 0; e < kLanes; ++e) o[e0 + e] = l[e] * f;
    }
  }
}

// The AVX-512 tile for head dims of 16·C (C = 4, 8: dims 64 and 128; Qwen3 uses 128): the
// operations of attend_tile_body in the same order, so the same bits (compared on every shape
// of the kernel tests while it was written, GCC 12 -O2): each score's 16 lane sums are the same
// fused multiply-add chains over the C chunks, 16 scores (a block of keys) are reduced together
// by shuffles that perform, per key, exactly the fixed tree of reduce_lanes (s8[i] = l[i] +
// l[i+8], s4[i] = s8[i] + s8[i+4], (s4[0] + s4[2]) + (s4[1] + s4[3])), and each V element
// accumulates in increasing t; the softmax's exp runs on 16 lanes. Faster by keeping the
// accumulators in registers, by reading the keys and values where they lie in their pages and by
// the vector exp (docs/design/kernel_targets.md, "Attention tiles").

// GCC 12's AVX-512 headers build some intrinsics from _mm512_undefined_*(), which its own
// uninitialized-use warnings then report at every call site (a known false positive; as in
// matmul_avx512_common.h).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

// The 16 keys' sums of 16 lane accumulators each, in key order (the tree above per key).
__attribute__((target("avx512f"))) inline __m512 reduce16(const __m512* a) {
  __m512 s8[8], s4[4], u[2];
#pragma GCC unroll 8
  for (int m = 0; m < 8; ++m) {  // s8 of keys 2m (quarters 0, 1) and 2m+1 (quarters 2, 3)
    s8[m] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * m], a[2 * m + 1], 0x44),
                          _mm512_shuffle_f32x4(a[2 * m], a[2 * m + 1], 0xEE));
  }
#pragma GCC unroll 4
  for (int n = 0; n < 4; ++n) {  // quarter i: s4 of key 4n + i
    s4[n] = _mm512_add_ps(_mm512_shuffle_f32x4(s8[2 * n], s8[2 * n + 1], 0x88),
                          _mm512_shuffle_f32x4(s8[2 * n], s8[2 * n + 1], 0xDD));
  }
#pragma GCC unroll 2
  for (int b = 0; b < 2; ++b) {  // quarter i: s4[0]+s4[2], s4[1]+s4[3] of keys 8b+i, 8b+4+i
    u[b] = _mm512_add_ps(_mm512_shuffle_ps(s4[2 * b], s4[2 * b + 1], 0x44),
                         _mm512_shuffle_ps(s4[2 * b], s4[2 * b + 1], 0xEE));
  }
  // Element 4i + e: the sum of key 4e + i; put back in key order.
  const __m512 f =
      _mm512_add_ps(_mm512_shuffle_ps(u[0], u[1], 0x88), _mm512_shuffle_ps(u[0], u[1], 0xDD));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, f);
}

// exp_nonpositive on 16 lanes: the scalar function's operations, each multiply-add a fused one
// as written there.
__attribute__((target("avx512f"))) inline __m512 exp_nonpositive16(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(kExpLowest), x);  // x < lowest ? lowest : x (NaN stays x)
  const __m512 n =
      _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(kLog2e), _mm512_set1_ps(0.5f)),
                           _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
  for (int k = 1; k < 6; ++k) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly[k]));
  p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  const __m512i e = _mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127));
  return _mm512_mul_ps(p, _mm512_castsi512_ps(_mm512_slli_epi32(e, 23)));
}

// exp_shifted_sum on 16 lanes (the same lanes and tree).
__attribute__((target("avx512f"))) inline float exp_shifted_sum16(float* sc, float m, int64_t n) {
  const __m512 mv = _mm512_set1_ps(m);
  __m512 lanes = _mm512_setzero_ps();
  int64_t t = 0;
  for (; t + kLanes <= n; t += kLanes) {
    const __m512 v = exp_nonpositive16(_mm512_sub_ps(_mm512_loadu_ps(sc + t), mv));
    _mm512_storeu_ps(sc + t, v);
    lanes = _mm512_add_ps(lanes, v);
  }
  if (t < n) {
    const __mmask16 k = static_cast<__mmask16>((1u << (n - t)) - 1);
    const __m512 v = exp_nonpositive16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, sc + t), mv));
    _mm512_mask_storeu_ps(sc + t, k, v);
    lanes = _mm512_mask_add_ps(lanes, k, lanes, v);
  }
  alignas(64) float l[kLanes];
  _mm512_store_ps(l, lanes);
  return reduce_lanes(l);
}

// One block of (up to) 16 cached keys from t0 (n of them; key(j) the row of key j, zeros past
// n) against every query of the tile: scale·q·k into scores.
template <int C, class KeyAt>
__attribute__((target("avx512f"), always_inline)) inline void attend_score_block(
    const AttendTile& s, __m512 scale, int64_t t0, int64_t n, KeyAt key, float* scores) {
  const int64_t group = s.group, len = s.max_len, heads = s.rows * group;
  for (int64_t qi = 0; qi < heads; ++qi) {
    const int64_t row_len = s.lens[qi / group];
    if (row_len <= t0) continue;
    const float* q = s.q[qi / group] + (qi % group) * C * kLanes;
    __m512 a[kLanes];
#pragma GCC unroll 16
    for (int j = 0; j < kLanes; ++j) a[j] = _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      const __m512 qc = _mm512_loadu_ps(q + c * kLanes);
#pragma GCC unroll 16
      for (int j = 0; j < kLanes; ++j) {
        a[j] = _mm512_fmadd_ps(qc, _mm512_loadu_ps(key(j) + c * kLanes), a[j]);
      }
    }
    const __m512 sc = _mm512_mul_ps(scale, reduce16(a));
    const int64_t valid = std::min<int64_t>(n, row_len - t0);
    const __mmask16 m = valid >= kLanes ? __mmask16(0xffff) : __mmask16((1u << valid) - 1);
    _mm512_mask_storeu_ps(scores + qi * len + t0, m, sc);
  }
}

// attend_tile_avx512_dim's scores: scale·q·k for every query of the tile and cached key.
template <int C>
__attribute__((target("avx512f"))) void attend_scores_avx512_dim(const AttendTile& s,
                                                                 const float* k_pool,
                                                                 float* scores) {
  constexpr int64_t dim = C * kLanes;
  const int64_t len = s.max_len;
  const __m512 q_scale = _mm512_set1_ps(s.scale);
  // Scores, by blocks of 16 cached keys (read once for the tile's queries).
  for (int64_t t0 = 0; t0 < len; t0 += kLanes) {
    const int64_t n = std::min<int64_t>(kLanes, len - t0);
    // The block's keys, read where they are: a kv head's positions within a page are
    // contiguous (kv_write's layout), so they map onto L1 sets as a plain array does. A whole
    // block within one page is read from its first key at fixed offsets; otherwise through
    // pointers, past the context at `kZeroKey`.
    static_assert(dim <= std::size(kZeroKey));
    if (n == kLanes && t0 % s.page_size + kLanes <= s.page_size) {
      const float* k0;
      s.cached_rows(k_pool, t0, 1, &k0);
      attend_score_block<C>(
          s, q_scale, t0, n, [k0](int j) { return k0 + j * dim; }, scores);
    } else {
      const float* k[kLanes];
      s.cached_rows(k_pool, t0, n, k);
      for (int64_t j = n; j < kLanes; ++j) k[j] = kZeroKey;
      attend_score_block<C>(
          s, q_scale, t0, n, [&k](int j) { return k[j]; }, scores);
    }
  }
}

// Queries q0 .. q0 + Q - 1 of the tile (each with its weights at scores + q·len and its sum at
// acc + q·dim) over cached positions [t0, end) of a span (V rows v[t - t0]): C accumulators each
// in registers, V element by element in increasing t. Q queries at once: Q·C independent chains,
// so that the fused multiply-adds are not waiting on each other's latency (one query's C = 8
// chains of a 4-cycle latency fill the two FMA units exactly, with nothing to spare).
template <int C, int Q>
__attribute__((target("avx512f"), always_inline)) inline void attend_value_span(
    const float* const* v, int64_t t0, int64_t end, const float* scores, int64_t len, int64_t q0,
    float* acc) {
  constexpr int64_t dim = C * kLanes;
  __m512 a[Q][C];
#pragma GCC unroll 2
  for (int q = 0; q < Q; ++q) {
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      a[q][c] = t0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(acc + (q0 + q) * dim + c * kLanes);
    }
  }
  for (int64_t t = t0; t < end; ++t) {
#pragma GCC unroll 2
    for (int q = 0; q < Q; ++q) {
      const __m512 p = _mm512_set1_ps(scores[(q0 + q) * len + t]);
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) {
        a[q][c] = _mm512_fmadd_ps(p, _mm512_loadu_ps(v[t - t0] + c * kLanes), a[q][c]);
      }
    }
  }
#pragma GCC unroll 2
  for (int q = 0; q < Q; ++q) {
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + (q0 + q) * dim + c * kLanes, a[q][c]);
  }
}

// attend_tile_avx512_dim's weighted sums of V (softmax weights in `scores`) into `acc`.
template <int C>
__attribute__((target("avx512f"))) void attend_values_avx512_dim(const AttendTile& s,
                                                                 const float* v_pool,
                                                                 const float* scores, float* acc) {
  const int64_t group = s.group, len = s.max_len, heads = s.rows * group;
  // Weighted sum of V: per query, C accumulators in registers over increasing t, in spans of
  // 32 keys so the span's V rows stay in L1 across the tile's queries (read where they are, as
  // the keys); two queries at a time where they end at the same position (a row's heads).
  constexpr int64_t kSpan = 32;
  for (int64_t t0 = 0; t0 < len; t0 += kSpan) {
    const int64_t t1 = std::min(len, t0 + kSpan);
    const float* v[kSpan];
    s.cached_rows(v_pool, t0, t1 - t0, v);
    for (int64_t qi = 0; qi < heads;) {
      const int64_t end = std::min(t1, s.lens[qi / group]);
      if (end <= t0) {
        ++qi;
        continue;
      }
      if (qi + 1 < heads && std::min(t1, s.lens[(qi + 1) / group]) == end) {
        attend_value_span<C, 2>(v, t0, end, scores, len, qi, acc);
        qi += 2;
      } else {
        attend_value_span<C, 1>(v, t0, end, scores, len, qi, acc);
        ++qi;
      }
    }
  }
}

template <int C>
__attribute__((target("avx512f"))) void attend_tile_avx512_dim(const AttendTile& s,
                                                               const float* k_pool,
                                                               const float* v_pool, float* scores,
                                                               float* acc) {
  constexpr int64_t dim = C * kLanes;
  const int64_t heads = s.rows * s.group;
  attend_scores_avx512_dim<C>(s, k_pool, scores);
  float* inv = acc + heads * dim;
  softmax_weights<true>(s, scores, inv);
  attend_values_avx512_dim<C>(s, v_pool, scores, acc);
  attend_out_dim<C>(s, acc, inv);
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

// The body built for AVX2 + FMA: vectorized on 8 lanes, the same fused multiply-adds.
__attribute__((target("avx2,fma,f16c"))) void attend_tile_x86_64_v3(const AttendTile& s,
                                                                    const float* k_pool,
                                                                    const float* v_pool,
                                                                    float* scores, float* acc) {
  attend_tile_body<HwFma>(s, k_pool, v_pool, scores, acc);
}

// The AVX2 tile for head dims of 16·C (C = 4, 8), as attend_tile_avx512_dim on 8 lanes: each
// score's 16 lane sums are two vectors (lanes 0-7, 8-15) of the same fused multiply-add chains
// over the C chunks, 4 keys at a time reduced together by shuffles that perform, per key,
// exactly reduce_lanes' tree (s8 = lanes 0-7 + lanes 8-15, s4[i] = s8[i] + s8[i + 4],
// (s4[0] + s4[2]) + (s4[1] + s4[3])); each V element accumulates in increasing t in registers,
// 64 elements at a time; the softmax is attend_tile_body's. The same bits as the body (the
// kernel tests compare every target).

// 4 keys' scores (their 16 lane sums in lo[j], hi[j]): the tree of reduce_lanes per key, in key
// order.
__attribute__((target("avx2,fma,f16c"))) inline __m128 reduce4_avx2(const __m256* lo,
                                                                    const __m256* hi) {
  __m256 s8[4];
  for (int j = 0; j < 4; ++j) s8[j] = _mm256_add_ps(lo[j], hi[j]);
  // t[m]: s4 of key 2m (low 128 bits) and of key 2m + 1 (high).
  const __m256 t0 = _mm256_add_ps(_mm256_permute2f128_ps(s8[0], s8[1], 0x20),
                                  _mm256_permute2f128_ps(s8[0], s8[1], 0x31));
  const __m256 t1 = _mm256_add_ps(_mm256_permute2f128_ps(s8[2], s8[3], 0x20),
                                  _mm256_permute2f128_ps(s8[2], s8[3], 0x31));
  // u: per 128 bits, s4[0] + s4[2] and s4[1] + s4[3] of keys 0 and 2 (low), 1 and 3 (high).
  const __m256 u = _mm256_add_ps(_mm256_shuffle_ps(t0, t1, _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm256_shuffle_ps(t0, t1, _MM_SHUFFLE(3, 2, 3, 2)));
  // f: keys 0, 2 (low) and 1, 3 (high), each (s4[0] + s4[2]) + (s4[1] + s4[3]).
  const __m256 f = _mm256_add_ps(_mm256_shuffle_ps(u, u, _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm256_shuffle_ps(u, u, _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm_unpacklo_ps(_mm256_castps256_ps128(f), _mm256_extractf128_ps(f, 1));
}

template <int C>
__attribute__((target("avx2,fma,f16c"))) void attend_scores_avx2_dim(const AttendTile& s,
                                                                     const float* k_pool,
                                                                     float* scores) {
  constexpr int64_t dim = C * kLanes;
  static_assert(dim <= std::size(kZeroKey));
  constexpr int64_t kKeys = 4;
  const int64_t group = s.group, len = s.max_len, heads = s.rows * group;
  const __m128 scale = _mm_set1_ps(s.scale);
  for (int64_t t0 = 0; t0 < len; t0 += kKeys) {
    const int64_t n = std::min<int64_t>(kKeys, len - t0);
    const float* k[kKeys];
    s.cached_rows(k_pool, t0, n, k);
    for (int64_t j = n; j < kKeys; ++j) k[j] = kZeroKey;
    for (int64_t qi = 0; qi < heads; ++qi) {
      const int64_t row_len = s.lens[qi / group];
      if (row_len <= t0) continue;
      const float* q = s.q[qi / group] + (qi % group) * dim;
      __m256 lo[kKeys], hi[kKeys];
      for (int j = 0; j < kKeys; ++j) lo[j] = hi[j] = _mm256_setzero_ps();
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) {
        const __m256 qlo = _mm256_loadu_ps(q + c * kLanes);
        const __m256 qhi = _mm256_loadu_ps(q + c * kLanes + 8);
#pragma GCC unroll 4
        for (int j = 0; j < kKeys; ++j) {
          lo[j] = _mm256_fmadd_ps(qlo, _mm256_loadu_ps(k[j] + c * kLanes), lo[j]);
          hi[j] = _mm256_fmadd_ps(qhi, _mm256_loadu_ps(k[j] + c * kLanes + 8), hi[j]);
        }
      }
      alignas(16) float sc[kKeys];
      _mm_store_ps(sc, _mm_mul_ps(scale, reduce4_avx2(lo, hi)));
      const int64_t valid = std::min<int64_t>(n, row_len - t0);
      for (int64_t j = 0; j < valid; ++j) scores[qi * len + t0 + j] = sc[j];
    }
  }
}

// The weighted sums of V (softmax weights in `scores`) into acc (heads x dim): in spans of 32
// keys, so that a span's V rows stay in L1 across the tile's queries; per query and 64 elements,
// 8 accumulators in registers over increasing t. A query of an empty row gets no sum.
template <int C>
__attribute__((target("avx2,fma,f16c"))) void attend_values_avx2_dim(const AttendTile& s,
                                                                     const float* v_pool,
                                                                     const float* scores,
                                                                     float* acc) {
  constexpr int64_t dim = C * kLanes, kPart = 64, kSpan = 32;
  const int64_t group = s.group, len = s.max_len, heads = s.rows * group;
  for (int64_t t0 = 0; t0 < len; t0 += kSpan) {
    const int64_t t1 = std::min(len, t0 + kSpan);
    const float* v[kSpan];
    s.cached_rows(v_pool, t0, t1 - t0, v);
    for (int64_t qi = 0; qi < heads; ++qi) {
      const int64_t end = std::min(t1, s.lens[qi / group]);
      if (end <= t0) continue;
      const float* w = scores + qi * len;
      for (int64_t e0 = 0; e0 < dim; e0 += kPart) {
        float* out = acc + qi * dim + e0;
        __m256 a[kPart / 8];
#pragma GCC unroll 8
        for (int c = 0; c < kPart / 8; ++c) {
          a[c] = t0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(out + 8 * c);
        }
        for (int64_t t = t0; t < end; ++t) {
          const __m256 p = _mm256_set1_ps(w[t]);
#pragma GCC unroll 8
          for (int c = 0; c < kPart / 8; ++c) {
            a[c] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v[t - t0] + e0 + 8 * c), a[c]);
          }
        }
#pragma GCC unroll 8
        for (int c = 0; c < kPart / 8; ++c) _mm256_storeu_ps(out + 8 * c, a[c]);
      }
    }
  }
}

template <int C>
__attribute__((target("avx2,fma,f16c"))) void attend_tile_avx2_dim(const AttendTile& s,
                                                                   const float* k_pool,
                                                                   const float* v_pool,
                                                                   float* scores, float* acc) {
  attend_scores_avx2_dim<C>(s, k_pool, scores);
  float* inv = acc + s.rows * s.group * C * kLanes;
  softmax_weights<false, HwFma>(s, scores, inv);
  attend_values_avx2_dim<C>(s, v_pool, scores, acc);
  attend_out_dim<C>(s, acc, inv);
}
#endif  // __x86_64__

// The tile on target `isa` (resolved and available).
void attend_tile(KernelIsa isa, const AttendTile& s, const float* k_pool, const float* v_pool,
                 float* scores, float* acc) {
#if defined(__x86_64__)
  if (isa == KernelIsa::kAvx512) {
    if (s.dim == 8 * kLanes) return attend_tile_avx512_dim<8>(s, k_pool, v_pool, scores, acc);
    if (s.dim == 4 * kLanes) return attend_tile_avx512_dim<4>(s, k_pool, v_pool, scores, acc);
    return attend_tile_avx512(s, k_pool, v_pool, scores, acc);
  }
  if (isa == KernelIsa::kX86_64V3) {
    if (s.dim == 8 * kLanes) return attend_tile_avx2_dim<8>(s, k_pool, v_pool, scores, acc);
    if (s.dim == 4 * kLanes) return attend_tile_avx2_dim<4>(s, k_pool, v_pool, scores, acc);
    return attend_tile_x86_64_v3(s, k_pool, v_pool, scores, acc);
  }
#elif defined(__aarch64__)
  if (isa == KernelIsa::kNeon) return attend_tile_neon(s, k_pool, v_pool, scores, acc);
#endif
  attend_tile_baseline(s, k_pool, v_pool, scores, acc);
}

// paged_attention's arguments, checked, and its shape.
struct PagedAttention {
  int64_t rows = 0, heads = 0, dim = 0, pages = 0, page_size = 0, n_kv = 0, max_blocks = 0;
  int64_t group = 0;
  float scale = 0;
  const float* q = nullptr;
  const float* k_pool = nullptr;
  const float* v_pool = nullptr;
  const int32_t* block_tables = nullptr;
  const int32_t* context_lens = nullptr;
  float* out = nullptr;
};

// Row b's context length and the number of table blocks it uses (check_rows has checked both).
void row_extent(const PagedAttention& a, int64_t b, int64_t* len, int64_t* used) {
  *len = a.context_lens[b];
  *used = (*len + a.page_size - 1) / a.page_size;
}

// Every row's context length and the pages it reads, before any row is computed, so that a bad
// row fails every block with the same error (the lowest bad row's) and no output is written,
// whoever claims what.
absl::Status check_rows(const ArgCheck& c, const PagedAttention& a) {
  for (int64_t b = 0; b < a.rows; ++b) {
    const int64_t len = a.context_lens[b];
    if (len < 0 || len > a.max_blocks * a.page_size) {
      return c.error(absl::StrCat("context length ", len, " at row ", b, " is outside [0, ",
                                  a.max_blocks * a.page_size, "] (", a.max_blocks,
                                  " blocks x page size ", a.page_size, ")"));
    }
    int64_t used = 0, unused = 0;
    row_extent(a, b, &unused, &used);
    const int32_t* table = a.block_tables + b * a.max_blocks;
    for (int64_t blk = 0; blk < used; ++blk) {
      if (table[blk] < 0 || table[blk] >= a.pages) {
        return c.error(absl::StrCat("page id ", table[blk], " at row ", b, " block ", blk,
                                    " is outside the pool of ", a.pages, " pages"));
      }
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<PagedAttention> check_paged_attention(const ArgCheck& c, const KernelContext& ctx) {
  PagedAttention a;
  SIMPLER_RETURN_IF_ERROR(c.count(7));
  SIMPLER_RETURN_IF_ERROR(c.tensor(0, "q", DataType::kFloat32, {-1, -1, -1}));
  a.rows = ctx.tensor(0).shape[0];
  a.heads = ctx.tensor(0).shape[1];
  a.dim = ctx.tensor(0).shape[2];
  SIMPLER_RETURN_IF_ERROR(c.tensor(1, "k_pool", DataType::kFloat32, {-1, -1, -1, a.dim}));
  a.pages = ctx.tensor(1).shape[0];
  a.n_kv = ctx.tensor(1).shape[1];
  a.page_size = ctx.tensor(1).shape[2];
  SIMPLER_RETURN_IF_ERROR(
      c.tensor(2, "v_pool", DataType::kFloat32, {a.pages, a.n_kv, a.page_size, a.dim}));
  SIMPLER_RETURN_IF_ERROR(c.tensor(3, "block_tables", DataType::kInt32, {a.rows, -1}));
  a.max_blocks = ctx.tensor(3).shape[1];
  SIMPLER_RETURN_IF_ERROR(c.tensor(4, "context_lens", DataType::kInt32, {a.rows}));
  SIMPLER_RETURN_IF_ERROR(c.tensor(5, "out", DataType::kFloat32, {a.rows, a.heads * a.dim}));
  SIMPLER_RETURN_IF_ERROR(c.scalar(6, "scale"));
  if (a.n_kv <= 0 || a.heads % a.n_kv != 0) {
    return c.error(
        absl::StrCat("query heads ", a.heads, " are not a multiple of kv heads ", a.n_kv));
  }
  a.scale = ctx.scalar_f32(6);
  a.group = a.heads / a.n_kv;
  a.q = ctx.tensor(0).data<const float>();
  a.k_pool = ctx.tensor(1).data<const float>();
  a.v_pool = ctx.tensor(2).data<const float>();
  a.block_tables = ctx.tensor(3).data<const int32_t>();
  a.context_lens = ctx.tensor(4).data<const int32_t>();
  a.out = ctx.tensor(5).data<float>();
  SIMPLER_RETURN_IF_ERROR(check_rows(c, a));
  return a;
}

// The tile of kv head g starting at row b0: the consecutive rows (of pairs before `end`) that
// share their cached positions, up to kMaxTileRows; fills lens, qs and outs.
AttendTile next_tile(const PagedAttention& a, int64_t g, int64_t b0, int64_t end, int64_t* lens,
                     const float** qs, float** outs) {
  AttendTile tile{.group = a.group,
                  .dim = a.dim,
                  .page_size = a.page_size,
                  .n_kv = a.n_kv,
                  .g = g,
                  .scale = a.scale,
                  .lens = lens,
                  .q = qs,
                  .out = outs};
  const int64_t rows = a.rows, max_blocks = a.max_blocks;
  int64_t ref = -1, ref_used = 0;  // the tile's row with the longest context
  for (int64_t b = b0; tile.rows < kMaxTileRows && b < rows && g * rows + b < end; ++b) {
    int64_t len = 0, used = 0;
    row_extent(a, b, &len, &used);
    const int32_t* table = a.block_tables + b * max_blocks;
    if (ref >= 0 &&
        !std::equal(table, table + std::min(used, ref_used), a.block_tables + ref * max_blocks)) {
      break;  // other cached positions: the next tile starts here
    }
    if (ref < 0 || used > ref_used) {
      ref = b;
      ref_used = used;
    }
    tile.max_len = std::max(tile.max_len, len);
    lens[tile.rows] = len;
    qs[tile.rows] = a.q + (b * a.heads + g * a.group) * a.dim;
    outs[tile.rows] = a.out + b * a.heads * a.dim + g * a.group * a.dim;
    ++tile.rows;
  }
  tile.table = a.block_tables + ref * max_blocks;
  return tile;
}

// The K and V rows of pair `pair` (kv head pair / rows, row pair % rows) prefetched into L2, where
// they are at most kPrefetchPairPositions positions: issued before the current tile is computed,
// so that the next pair's rows, a few scattered pages at a short context, arrive while the core
// computes instead of after it. Longer contexts are left to the hardware prefetchers (the cut-off
// as measured: docs/design/kernel_targets.md, "Attention tiles").
constexpr int64_t kPrefetchPairPositions = 64;
constexpr int64_t kFloatsPerLine = 64 / sizeof(float);
constexpr int kPrefetchIntoL2 = 2;  // __builtin_prefetch's locality for L2
void prefetch_pair(const PagedAttention& a, int64_t pair) {
  if (pair >= a.rows * a.n_kv) return;
  const int64_t g = pair / a.rows, b = pair % a.rows;
  int64_t len = 0, used = 0;
  row_extent(a, b, &len, &used);
  if (len > kPrefetchPairPositions) return;
  const int32_t* table = a.block_tables + b * a.max_blocks;
  for (int64_t blk = 0; blk < used; ++blk) {
    const int64_t positions = std::min(a.page_size, len - blk * a.page_size);
    const int64_t at = kv_pool_offset(table[blk], g, 0, a.n_kv, a.page_size, a.dim);
    for (int64_t f = 0; f < positions * a.dim; f += kFloatsPerLine) {
      __builtin_prefetch(a.k_pool + at + f, 0, kPrefetchIntoL2);
      __builtin_prefetch(a.v_pool + at + f, 0, kPrefetchIntoL2);
    }
  }
}

absl::Status paged_attention_impl(const KernelContext& ctx, KernelIsa isa) {
  ArgCheck c(ctx, "paged_attention");
  SIMPLER_ASSIGN_OR_RETURN(const PagedAttention a, check_paged_attention(c, ctx));
  SIMPLER_ASSIGN_OR_RETURN(isa, available_isa("paged_attention", isa));
  // Work items are (kv head, row) pairs, kv-head-major, claimed by the blocks as each becomes
  // free (RowClaims: a block starts with its block_range; a pair at a time where there are few,
  // so that at batch 1 Qwen3's 8 kv heads spread over the cores by their pace, as the matmuls'
  // rows do; docs/design/engine.md); a claim's consecutive rows of one kv head that share their
  // cached positions form tiles. A row's result does not depend on its tile.
  // Claims of whole tiles where the rows can fill one (a prefill chunk's rows share their pages):
  // in units of a tile's rows where the rows are whole tiles, so the claims start on tiles too.
  const int64_t tile = std::min(a.rows, kMaxTileRows);
  const bool whole_tiles = a.rows % tile == 0;
  RowClaims claims(ctx, a.rows * a.n_kv, tile, whole_tiles ? 1 : tile, whole_tiles ? tile : 1);
  std::vector<float> scores, acc;
  int64_t lens[kMaxTileRows];
  const float* qs[kMaxTileRows];
  float* outs[kMaxTileRows];
  BlockRange r;
  int64_t ahead = 0;
  while (claims.next(&r, &ahead)) {
    for (int64_t pair = r.begin; pair < r.end;) {
      const AttendTile tile = next_tile(a, pair / a.rows, pair % a.rows, r.end, lens, qs, outs);
      // The pair this block most likely takes next (RowClaims::next's `ahead`), not another's.
      if (pair + tile.rows < ahead) prefetch_pair(a, pair + tile.rows);
      const size_t want_scores = static_cast<size_t>(tile.rows * a.group * tile.max_len);
      if (scores.size() < want_scores) scores.resize(want_scores);
      const size_t want_acc = static_cast<size_t>(tile.rows * a.group * (a.dim + 1));
      if (acc.size() < want_acc) acc.resize(want_acc);
      attend_tile(isa, tile, a.k_pool, a.v_pool, scores.data(), acc.data());
      pair += tile.rows;
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status paged_attention_kernel(const KernelContext& ctx) {
  return paged_attention_impl(ctx, KernelIsa::kAuto);
}

TaskArgs paged_attention_args(const Tensor& q, const Tensor& k_pool, const Tensor& v_pool,
                              const Tensor& block_tables, const Tensor& context_lens,
                              const Tensor& out, float scale) {
  TaskArgs a = reads_then({q, k_pool, v_pool, block_tables, context_lens}, out);
  a.add_scalar_f32(scale);
  return a;
}

// ---- silu_mul ---------------------------------------------------------------------------

namespace {

// out = g·σ(g)·up, σ(g) = 1 / (1 + e^-g) for g >= 0 and e^g / (1 + e^g) below it, so the exp's
// argument, -|g|, is never positive (exp_nonpositive: no overflow, no libm call), and 0 below
// g = -87 (see below). The same operations, fused multiply-adds written out, on every target,
// so the same bits on each. NaN gives NaN.
template <class F>
__attribute__((always_inline)) inline void silu_mul_body(const float* __restrict gate,
                                                         const float* __restrict up,
                                                         float* __restrict out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float g = gate[i];
    const float e = exp_nonpositive<F>(g < 0.0f ? g : -g);
    // Below -87 exp_nonpositive clamps (its e^-87 would then be far too large for a huge |g|):
    // there g·σ(g) is under 87·e^-87 = 1.4e-36 in magnitude, taken as 0.
    const float sigma = g < -87.0f ? 0.0f : (g < 0.0f ? e : 1.0f) / (1.0f + e);
    out[i] = g * sigma * up[i];
  }
}

#if defined(__x86_64__)
// silu_mul_body on 16 lanes: the same operations lane by lane (-|g| by flipping the sign as the
// scalar negation does; exp_nonpositive16; a correctly rounded division; the products in the
// same order), so the same bits; the last n % 16 elements by the scalar body. GCC -O2 leaves
// the scalar body unvectorized (its cheap cost model refuses a loop that needs a scalar
// epilogue): it took 13% of a 512-token qwen3-0.6b prefill on Zen 5, as scalar code.
__attribute__((target("avx512f"))) void silu_mul_avx512(const float* gate, const float* up,
                                                        float* out, int64_t n) {
  const __m512 zero = _mm512_setzero_ps(), one = _mm512_set1_ps(1.0f);
  const __m512 below = _mm512_set1_ps(-87.0f);
  const __m512i sign = _mm512_set1_epi32(static_cast<int32_t>(0x80000000u));
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const __m512 g = _mm512_loadu_ps(gate + i);
    const __mmask16 neg = _mm512_cmp_ps_mask(g, zero, _CMP_LT_OQ);
    const __m512 minus_g = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(g), sign));
    const __m512 e = exp_nonpositive16(_mm512_mask_blend_ps(neg, minus_g, g));
    __m512 sigma = _mm512_div_ps(_mm512_mask_blend_ps(neg, one, e), _mm512_add_ps(one, e));
    sigma = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(g, below, _CMP_LT_OQ), sigma, zero);
    _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_mul_ps(g, sigma), _mm512_loadu_ps(up + i)));
  }
  silu_mul_body<HwFma>(gate + i, up + i, out + i, n - i);
}

// exp_nonpositive on 8 lanes (AVX2 + FMA): exp_nonpositive16's operations.
__attribute__((target("avx2,fma,f16c"))) inline __m256 exp_nonpositive8(__m256 x) {
  x = _mm256_max_ps(_mm256_set1_ps(kExpLowest), x);  // x < lowest ? lowest : x (NaN stays x)
  const __m256 n = _mm256_round_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(kLog2e), _mm256_set1_ps(0.5f)),
                                   _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kExpPoly[0]);
  for (int k = 1; k < 6; ++k) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpPoly[k]));
  p = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127));
  return _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(e, 23)));
}

// silu_mul_avx512 on 8 lanes.
__attribute__((target("avx2,fma,f16c"))) void silu_mul_x86_64_v3(const float* gate, const float* up,
                                                                 float* out, int64_t n) {
  const __m256 zero = _mm256_setzero_ps(), one = _mm256_set1_ps(1.0f);
  const __m256 below = _mm256_set1_ps(-87.0f);
  const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int32_t>(0x80000000u)));
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 neg = _mm256_cmp_ps(g, zero, _CMP_LT_OQ);
    const __m256 e = exp_nonpositive8(_mm256_blendv_ps(_mm256_xor_ps(g, sign), g, neg));
    __m256 sigma = _mm256_div_ps(_mm256_blendv_ps(one, e, neg), _mm256_add_ps(one, e));
    sigma = _mm256_blendv_ps(sigma, zero, _mm256_cmp_ps(g, below, _CMP_LT_OQ));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(g, sigma), _mm256_loadu_ps(up + i)));
  }
  silu_mul_body<HwFma>(gate + i, up + i, out + i, n - i);
}
#endif
#if defined(__aarch64__)
void silu_mul_neon(const float* gate, const float* up, float* out, int64_t n) {
  silu_mul_body<HwFma>(gate, up, out, n);
}
#endif
// The baseline: its fused multiply-adds computed exactly without an FMA instruction.
void silu_mul_baseline(const float* gate, const float* up, float* out, int64_t n) {
  silu_mul_body<ExactFma>(gate, up, out, n);
}

void silu_mul_span(KernelIsa isa, const float* gate, const float* up, float* out, int64_t n) {
#if defined(__x86_64__)
  if (isa == KernelIsa::kAvx512) return silu_mul_avx512(gate, up, out, n);
  if (isa == KernelIsa::kX86_64V3) return silu_mul_x86_64_v3(gate, up, out, n);
#elif defined(__aarch64__)
  if (isa == KernelIsa::kNeon) return silu_mul_neon(gate, up, out, n);
#endif
  silu_mul_baseline(gate, up, out, n);
}

absl::Status silu_mul_impl(const KernelContext& ctx, KernelIsa isa) {
  ArgCheck c(ctx, "silu_mul");
  SIMPLER_RETURN_IF_ERROR(c.count(3));
  SIMPLER_RETURN_IF_ERROR(c.tensor(0, "gate", DataType::kFloat32, {-1, -1}));
  const int64_t rows = ctx.tensor(0).shape[0];
  const int64_t cols = ctx.tensor(0).shape[1];
  SIMPLER_RETURN_IF_ERROR(c.tensor(1, "up", DataType::kFloat32, {rows, cols}));
  SIMPLER_RETURN_IF_ERROR(c.tensor(2, "out", DataType::kFloat32, {rows, cols}));
  SIMPLER_ASSIGN_OR_RETURN(isa, available_isa("silu_mul", isa));
  const BlockRange r = block_range(rows * cols, ctx.block_idx, ctx.block_dim);
  const float* gate = ctx.tensor(0).data<const float>() + r.begin;
  const float* up = ctx.tensor(1).data<const float>() + r.begin;
  float* out = ctx.tensor(2).data<float>() + r.begin;
  silu_mul_span(isa, gate, up, out, r.end - r.begin);
  return absl::OkStatus();
}

}  // namespace

absl::Status silu_mul_kernel(const KernelContext& ctx) {
  return silu_mul_impl(ctx, KernelIsa::kAuto);
}

TaskArgs silu_mul_args(const Tensor& gate, const Tensor& up, const Tensor& out) {
  return reads_then({gate, up}, out);
}

// ---- add ------------------------------------------------------------------------------------

absl::Status add_kernel(const KernelContext& ctx) {
  ArgCheck c(ctx, "add");
  SIMPLER_RETURN_IF_ERROR(c.count(3));
  const Tensor& a = ctx.tensor(0);
  // All three are f32 of a's shape.
  const std::span<const int64_t> dims(a.shape.data(),
                                      static_cast<size_t>(std::clamp(a.rank, 0, task::kMaxRank)));
  SIMPLER_RETURN_IF_ERROR(c.tensor(0, "a", DataType::kFloat32, dims));
  SIMPLER_RETURN_IF_ERROR(c.tensor(1, "b", DataType::kFloat32, dims));
  SIMPLER_RETURN_IF_ERROR(c.tensor(2, "out", DataType::kFloat32, dims));
  const float* x = a.data<const float>();
  const float* y = ctx.tensor(1).data<const float>();
  float* out = ctx.tensor(2).data<float>();
  const BlockRange r = block_range(a.numel(), ctx.block_idx, ctx.block_dim);
  for (int64_t i = r.begin; i < r.end; ++i) out[i] = x[i] + y[i];
  return absl::OkStatus();
}

TaskArgs add_args(const Tensor& a, const Tensor& b, const Tensor& out) {
  return reads_then({a, b}, out);
}

// ---- gather_rows ------------------------------------------------------------------------------

absl::Status gather_rows_kernel(const KernelContext& ctx) {
  ArgCheck c(ctx, "gather_rows");
  SIMPLER_RETURN_IF_ERROR(c.count(3));
  SIMPLER_RETURN_IF_ERROR(c.tensor(0, "x", DataType::kFloat32, {-1, -1}));
  const int64_t rows = ctx.tensor(0).shape[0];
  const int64_t cols = ctx.tensor(0).shape[1];
  SIMPLER_RETURN_IF_ERROR(c.tensor(1, "rows", DataType::kInt32, {-1}));
  const int64_t n = ctx.tensor(1).shape[0];
  SIMPLER_RETURN_IF_ERROR(c.tensor(2, "out", DataType::kFloat32, {n, cols}));
  const float* x = ctx.tensor(0).data<const float>();
  const int32_t* index = ctx.tensor(1).data<const int32_t>();
  float* out = ctx.tensor(2).data<float>();
  const BlockRange r = block_range(n, ctx.block_idx, ctx.block_dim);
  for (int64_t j = r.begin; j < r.end; ++j) {
    const int64_t row = index[j];
    if (row < 0 || row >= rows) {
      return c.error(
          absl::StrCat("row ", row, " at index ", j, " is outside the batch [0, ", rows, ")"));
    }
    std::memcpy(out + j * cols, x + row * cols, sizeof(float) * cols);
  }
  return absl::OkStatus();
}

TaskArgs gather_rows_args(const Tensor& x, const Tensor& rows, const Tensor& out) {
  return reads_then({x, rows}, out);
}

// ---- argmax -------------------------------------------------------------------------------------

namespace {

// The lowest index of the largest value of row[0, n), NaN never chosen, 0 when no value is above
// -inf. Every target returns the same index: the vector paths take the row's maximum (a max
// that keeps its accumulator where x is NaN) and then the first index holding it.
int64_t argmax_row_baseline(const float* row, int64_t n) {
  float best = -std::numeric_limits<float>::infinity();
  int64_t best_i = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (row[i] > best) {  // strict: the lowest index wins ties; NaN never wins
      best = row[i];
      best_i = i;
    }
  }
  return best_i;
}

#if defined(__x86_64__)
// argmax_row_baseline on 8 lanes, for both x86 targets: one path, since a 16-lane copy of it
// (0.6% of a tiny-preset decode step's samples) was not worth a second body. vmaxps(x, m) is
// `x > m ? x : m`, so a NaN x leaves m; the first index whose value equals the maximum is where
// the scalar loop's strict `>` stops moving.
__attribute__((target("avx2,fma,f16c"))) int64_t argmax_row_x86_64_v3(const float* row, int64_t n) {
  const float lowest = -std::numeric_limits<float>::infinity();
  __m256 m = _mm256_set1_ps(lowest);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) m = _mm256_max_ps(_mm256_loadu_ps(row + i), m);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  float best = lowest;
  for (float v : lanes) best = v > best ? v : best;
  for (; i < n; ++i) best = row[i] > best ? row[i] : best;
  if (!(best > lowest)) return 0;
  const __m256 b = _mm256_set1_ps(best);
  for (i = 0; i + 8 <= n; i += 8) {
    const int eq = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + i), b, _CMP_EQ_OQ));
    if (eq != 0) return i + std::countr_zero(static_cast<uint32_t>(eq));
  }
  for (; row[i] != best; ++i) {
  }
  return i;
}
#endif

absl::Status argmax_impl(const KernelContext& ctx, KernelIsa isa) {
  ArgCheck c(ctx, "argmax");
  SIMPLER_RETURN_IF_ERROR(c.count(2));
  SIMPLER_RETURN_IF_ERROR(c.tensor(0, "logits", DataType::kFloat32, {-1, -1}));
  const int64_t n = ctx.tensor(0).shape[0];
  const int64_t vocab = ctx.tensor(0).shape[1];
  SIMPLER_RETURN_IF_ERROR(c.tensor(1, "ids", DataType::kInt32, {n}));
  if (vocab < 1) return c.error("logits have an empty vocabulary dimension");
  if (vocab > std::numeric_limits<int32_t>::max()) {
    return c.error(absl::StrCat("vocabulary ", vocab, " does not fit i32 ids"));
  }
  SIMPLER_ASSIGN_OR_RETURN(isa, available_isa("argmax", isa));
  const float* logits = ctx.tensor(0).data<const float>();
  int32_t* ids = ctx.tensor(1).data<int32_t>();
  const BlockRange r = block_range(n, ctx.block_idx, ctx.block_dim);
  for (int64_t j = r.begin; j < r.end; ++j) {
    ids[j] = static_cast<int32_t>(argmax_row(logits + j * vocab, vocab, isa));
  }
  return absl::OkStatus();
}

}  // namespace

int64_t argmax_row(const float* row, int64_t n, KernelIsa isa) {
  if (isa == KernelIsa::kAuto) isa = resolve_kernel_isa(isa);
#if defined(__x86_64__)
  if ((isa == KernelIsa::kAvx512 || isa == KernelIsa::kX86_64V3) && kernel_isa_available(isa)) {
    return argmax_row_x86_64_v3(row, n);
  }
#endif
  return argmax_row_baseline(row, n);
}

absl::Status argmax_kernel(const KernelContext& ctx) { return argmax_impl(ctx, KernelIsa::kAuto); }

TaskArgs argmax_args(const Tensor& logits, const Tensor& ids) { return reads_then({logits}, ids); }

}  // namespace simpler::llm

namespace simpler::llm::matmul_detail {

WeightType weight_type_of(task::DataType dtype) {
  switch (dtype) {
    case task::DataType::kBFloat16:
      return WeightType::kBF16;
    case task::DataType::kFloat16:
      return WeightType::kF16;
    case task::DataType::kQ8_0:
    case task::DataType::kQ8_0_R16:
      return WeightType::kQ8_0;
    case task::DataType::kQ4_0:
      return WeightType::kQ4_0;
    case task::DataType::kQ4_K:
    case task::DataType::kQ4_K_R16:
      return WeightType::kQ4_K;
    case task::DataType::kQ6_K:
    case task::DataType::kQ6_K_R16:
      return WeightType::kQ6_K;
    default:
      return WeightType::kF32;
  }
}

}  // namespace simpler::llm::matmul_detail
