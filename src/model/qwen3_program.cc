#include "simpler/model/qwen3_program.h"

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "simpler/base/status.h"
#include "simpler/kernels/kernels.h"
#include "simpler/task/arg_check.h"

namespace simpler::llm {
namespace {

using task::ArgDirection;
using task::DataType;
using task::MemoryKind;
using task::TaskArgs;
using task::Tensor;

// A row-major contiguous view (shapes here are never negative).
Tensor view(uint64_t address, std::initializer_list<int64_t> shape, DataType dtype,
            MemoryKind memory = MemoryKind::kDevice) {
  Tensor t;
  t.address = address;
  t.rank = static_cast<int32_t>(shape.size());
  t.dtype = dtype;
  t.memory = memory;
  int64_t stride = 1;
  for (int i = t.rank - 1; i >= 0; --i) {
    t.shape[i] = shape.begin()[i];
    t.strides[i] = stride;
    stride *= t.shape[i];
  }
  return t;
}

// The first `rows` rows of an f32 [Bmax, ...] scratch buffer, reshaped.
Tensor rows_of(const Tensor& t, std::initializer_list<int64_t> shape) {
  return view(t.address, shape, t.dtype, t.memory);
}

// `t` must be a contiguous DEVICE tensor of `dtype` and exactly `dims`
// (-1 = any) with a non-null address.
absl::Status check_tensor(const std::string& what, const Tensor& t, DataType dtype,
                          std::initializer_list<int64_t> dims) {
  if (!task::tensor_matches(t, dtype, dims)) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " must be a contiguous ", std::string(task::name_of(dtype)),
                     task::dims_string(std::span<const int64_t>(dims.begin(), dims.size())),
                     " tensor, got ", t.debug_string(), t.is_contiguous() ? "" : " (strided)"));
  }
  if (t.memory != MemoryKind::kDevice) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " must be a DEVICE tensor, got ", t.debug_string()));
  }
  if (t.address == 0) return absl::InvalidArgumentError(absl::StrCat(what, " has a null address"));
  return absl::OkStatus();
}

// A weight matrix: f32, bf16, f16, q8_0, q4_0, q4_k or q6_k, or q4_k, q6_k or q8_0 with rows
// interleaved 16 at a time (what the matmul and embedding kernels take).
absl::Status check_matrix(const std::string& what, const Tensor& t,
                          std::initializer_list<int64_t> dims) {
  const DataType dt = t.dtype == DataType::kBFloat16 || t.dtype == DataType::kFloat16 ||
                              task::block_elements(t.dtype) > 1
                          ? t.dtype
                          : DataType::kFloat32;
  absl::Status s = check_tensor(what, t, dt, dims);
  if (!s.ok() && t.dtype != dt) {
    return absl::InvalidArgumentError(absl::StrCat(
        s.message(), " (f32, bf16, f16, q8_0, q4_0, q4_k, q6_k, q4_k_r16, q6_k_r16 or q8_0_r16)"));
  }
  return s;
}

struct NamedRange {
  std::string name;
  uint64_t begin;
  uint64_t end;
};

absl::Status check_disjoint(std::vector<NamedRange> ranges) {
  std::sort(ranges.begin(), ranges.end(),
            [](const NamedRange& a, const NamedRange& b) { return a.begin < b.begin; });
  for (size_t i = 1; i < ranges.size(); ++i) {
    if (ranges[i].begin < ranges[i - 1].end) {
      return absl::InvalidArgumentError(
          absl::StrCat(ranges[i - 1].name, " and ", ranges[i].name, " overlap"));
    }
  }
  return absl::OkStatus();
}

uint64_t align_up(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

// Scratch buffers in layout order: name, member, columns per row.
struct ScratchField {
  const char* name;
  Tensor Qwen3Scratch::*member;
  int64_t cols;
  bool per_logit_row = false;  // leading dimension max_logit_rows instead of max_batch
};

std::vector<ScratchField> scratch_fields(const Qwen3Dims& d) {
  return {
      {"hidden", &Qwen3Scratch::hidden, d.hidden_size},
      {"normed", &Qwen3Scratch::normed, d.hidden_size},
      {"q_proj", &Qwen3Scratch::q_proj, d.q_size()},
      {"k_proj", &Qwen3Scratch::k_proj, d.kv_size()},
      {"v", &Qwen3Scratch::v, d.kv_size()},
      {"q", &Qwen3Scratch::q, d.q_size()},
      {"k", &Qwen3Scratch::k, d.kv_size()},
      {"attn_out", &Qwen3Scratch::attn_out, d.q_size()},
      {"gate", &Qwen3Scratch::gate, d.intermediate_size},
      {"up", &Qwen3Scratch::up, d.intermediate_size},
      {"act", &Qwen3Scratch::act, d.intermediate_size},
      {"sel", &Qwen3Scratch::sel, d.hidden_size, true},
      {"sel_normed", &Qwen3Scratch::sel_normed, d.hidden_size, true},
      {"logits", &Qwen3Scratch::logits, d.vocab_size, true},
  };
}

// Everything a run's orchestration needs; immutable, shared by the callable's copies.
struct Program {
  Qwen3Dims dims;
  Qwen3DeviceWeights weights;
  Qwen3Scratch scratch;
  Qwen3KvPools pools;
  Qwen3ProgramOptions options;
  Tensor lm_head;
  float eps = 0;
  float theta = 0;
  float scale = 0;
};

constexpr task::KernelIndex k(KernelId id) { return static_cast<task::KernelIndex>(id); }

int32_t clamp_blocks(int64_t want, int32_t cores) {
  return static_cast<int32_t>(std::max<int64_t>(1, std::min<int64_t>(cores, want)));
}

// A decode run's arguments, checked: the tensors, B (batch rows) and n (logit rows).
struct RunArgs {
  Tensor input_ids, positions, slot_mapping, block_tables, context_lens, logit_rows, out_ids;
  std::optional<Tensor> out_logits;
  int64_t B = 0;
  int64_t n = 0;
};

// The run tensors: IN tensors, then OUT out_ids and, when present, OUT
// out_logits. Returns the index after the last tensor.
absl::StatusOr<uint32_t> check_run_tensors(const Qwen3Dims& d, const task::ArgChecker& c,
                                           const TaskArgs& args, RunArgs& r) {
  SIMPLER_RETURN_IF_ERROR(c.at_least(7));
  SIMPLER_RETURN_IF_ERROR(c.input(kQwen3InputIds, "input_ids", DataType::kInt32, {-1}));
  r.B = args[kQwen3InputIds].tensor.shape[0];
  const int64_t B = r.B;
  SIMPLER_RETURN_IF_ERROR(c.input(kQwen3Positions, "positions", DataType::kInt32, {B}));
  SIMPLER_RETURN_IF_ERROR(c.input(kQwen3SlotMapping, "slot_mapping", DataType::kInt32, {B}));
  SIMPLER_RETURN_IF_ERROR(c.input(kQwen3BlockTables, "block_tables", DataType::kInt32, {B, -1}));
  SIMPLER_RETURN_IF_ERROR(c.input(kQwen3ContextLens, "context_lens", DataType::kInt32, {B}));
  SIMPLER_RETURN_IF_ERROR(c.input(kQwen3LogitRows, "logit_rows", DataType::kInt32, {-1}));
  r.n = args[kQwen3LogitRows].tensor.shape[0];
  SIMPLER_RETURN_IF_ERROR(c.output(kQwen3OutIds, "out_ids", DataType::kInt32, {r.n}));
  r.input_ids = args[kQwen3InputIds].tensor;
  r.positions = args[kQwen3Positions].tensor;
  r.slot_mapping = args[kQwen3SlotMapping].tensor;
  r.block_tables = args[kQwen3BlockTables].tensor;
  r.context_lens = args[kQwen3ContextLens].tensor;
  r.logit_rows = args[kQwen3LogitRows].tensor;
  r.out_ids = args[kQwen3OutIds].tensor;
  uint32_t next = 7;
  if (args.size() > next && args[next].direction != ArgDirection::kScalar) {
    SIMPLER_RETURN_IF_ERROR(c.output(next, "out_logits", DataType::kFloat32, {r.n, d.vocab_size}));
    r.out_logits = args[next].tensor;
    ++next;
  }
  return next;
}

// The optional scalars B and n after the tensors must agree with the tensor shapes.
absl::Status check_run_scalars(const task::ArgChecker& c, const TaskArgs& args, uint32_t next,
                               const RunArgs& r) {
  const int64_t scalars[2] = {r.B, r.n};
  const char* scalar_names[2] = {"B", "n"};
  for (int s = 0; s < 2 && next < args.size(); ++s, ++next) {
    SIMPLER_RETURN_IF_ERROR(c.scalar(next, scalar_names[s]));
    if (args[next].scalar != static_cast<uint64_t>(scalars[s])) {
      return c.error(absl::StrCat(
          "argument ", next, " (", scalar_names[s], " = ", static_cast<int64_t>(args[next].scalar),
          ") disagrees with the tensor shapes (", scalar_names[s], " = ", scalars[s], ")"));
    }
  }
  if (next != args.size()) {
    return c.error(absl::StrCat("has ", args.size(), " arguments, at most ", next, " expected"));
  }
  return absl::OkStatus();
}

absl::StatusOr<RunArgs> check_run_args(const Program& p, const TaskArgs& args) {
  const task::ArgChecker c(args, "qwen3 decode run ");
  RunArgs r;
  SIMPLER_ASSIGN_OR_RETURN(const uint32_t next, check_run_tensors(p.dims, c, args, r));
  SIMPLER_RETURN_IF_ERROR(check_run_scalars(c, args, next, r));
  if (r.B < 1 || r.B > p.scratch.max_batch) {
    return absl::InvalidArgumentError(absl::StrCat("qwen3 decode batch of ", r.B,
                                                   " rows is outside [1, max_batch ",
                                                   p.scratch.max_batch, "]"));
  }
  if (r.n > p.scratch.max_logit_rows) {
    return absl::InvalidArgumentError(absl::StrCat("qwen3 decode asks logits for ", r.n,
                                                   " rows, more than max_logit_rows ",
                                                   p.scratch.max_logit_rows));
  }
  return r;
}

// Views of the first B rows of the scratch buffers, shaped for each kernel.
struct ScratchViews {
  Tensor hidden, normed, q_proj, q_proj3, k_proj, k_proj3, v, v3, q3, k3, attn_out, gate, up, act;
};

ScratchViews scratch_views(const Qwen3Dims& d, const Qwen3Scratch& s, int64_t B) {
  const int64_t H = d.hidden_size, I = d.intermediate_size, hd = d.head_dim;
  const int64_t nh = d.num_attention_heads, nkv = d.num_key_value_heads;
  ScratchViews v;
  v.hidden = rows_of(s.hidden, {B, H});
  v.normed = rows_of(s.normed, {B, H});
  v.q_proj = rows_of(s.q_proj, {B, nh * hd});
  v.q_proj3 = rows_of(s.q_proj, {B, nh, hd});
  v.k_proj = rows_of(s.k_proj, {B, nkv * hd});
  v.k_proj3 = rows_of(s.k_proj, {B, nkv, hd});
  v.v = rows_of(s.v, {B, nkv * hd});
  v.v3 = rows_of(s.v, {B, nkv, hd});
  v.q3 = rows_of(s.q, {B, nh, hd});
  v.k3 = rows_of(s.k, {B, nkv, hd});
  v.attn_out = rows_of(s.attn_out, {B, nh * hd});
  v.gate = rows_of(s.gate, {B, I});
  v.up = rows_of(s.up, {B, I});
  v.act = rows_of(s.act, {B, I});
  return v;
}

// Submits one decode run's tasks; lives for one orchestrate() call.
class DecodeSubmitter {
 public:
  DecodeSubmitter(const Program& p, task::OrchestrationContext& ctx, const RunArgs& r)
      : p_(p), ctx_(ctx), r_(r), cores_(std::max<int32_t>(1, ctx.num_cores())) {}

  // The embedding, every layer, then the logits head.
  absl::Status submit_all() {
    const ScratchViews v = scratch_views(p_.dims, p_.scratch, r_.B);
    SIMPLER_RETURN_IF_ERROR(submit(KernelId::kEmbedding,
                                   embedding_args(r_.input_ids, p_.weights.embed_tokens, v.hidden),
                                   1, "embedding", -1));
    for (int64_t l = 0; l < p_.dims.num_hidden_layers; ++l) {
      SIMPLER_RETURN_IF_ERROR(submit_attention(v, l));
      SIMPLER_RETURN_IF_ERROR(submit_mlp(v, l));
    }
    return submit_head(v.hidden);
  }

 private:
  absl::Status submit(KernelId id, const TaskArgs& a, int32_t block_dim, const char* what,
                      int64_t layer) {
    absl::Status s = ctx_.submit(k(id), a, block_dim);
    if (s.ok()) return s;
    return base::annotate(s, layer >= 0
                                 ? absl::StrCat("qwen3 decode layer ", layer, " ", what, ": ")
                                 : absl::StrCat("qwen3 decode ", what, ": "));
  }
  int32_t matmul_blocks(int64_t rows, int64_t out, int64_t in) const {
    const Qwen3ProgramOptions& o = p_.options;
    return clamp_blocks(std::min(out / std::max<int64_t>(1, o.min_rows_per_block),
                                 rows * out * in / std::max<int64_t>(1, o.min_macs_per_block)),
                        cores_);
  }
  // paged_attention's blocks: at most one per (row, kv head) pair, and one per
  // min_attention_macs_per_block of the most its rows can attend (the block tables' width in
  // tokens: a shape, so a captured graph keeps its split).
  int32_t attention_blocks(int64_t rows) const {
    const Qwen3Dims& d = p_.dims;
    const int64_t context = r_.block_tables.shape[1] * p_.pools.page_size();
    const int64_t macs = 2 * rows * d.num_attention_heads * d.head_dim * context;
    return clamp_blocks(
        std::min(rows * d.num_key_value_heads,
                 macs / std::max<int64_t>(1, p_.options.min_attention_macs_per_block)),
        cores_);
  }
  int32_t row_blocks(int64_t rows, int64_t cols) const {
    return clamp_blocks(
        std::min(rows, rows * cols / std::max<int64_t>(1, p_.options.min_elems_per_block)), cores_);
  }

  // input_layernorm through o_proj (added into hidden) of layer `l`.
  absl::Status submit_attention(const ScratchViews& v, int64_t l) {
    const Qwen3Dims& d = p_.dims;
    const int64_t B = r_.B, H = d.hidden_size, hd = d.head_dim;
    const int64_t nh = d.num_attention_heads, nkv = d.num_key_value_heads;
    const Qwen3LayerWeights& w = p_.weights.layers[l];
    const Qwen3KvLayerPool& pool = p_.pools.layers[l];
    SIMPLER_RETURN_IF_ERROR(submit(KernelId::kRmsNorm,
                                   rms_norm_args(v.hidden, w.input_layernorm, v.normed, p_.eps),
                                   row_blocks(B, H), "input_layernorm", l));
    // q, k and v projected as one task: one hand-off, x quantized once per weight type.
    const Tensor qkv_w[] = {w.q_proj, w.k_proj, w.v_proj};
    const Tensor qkv_y[] = {v.q_proj, v.k_proj, v.v};
    SIMPLER_RETURN_IF_ERROR(submit(KernelId::kMatmulMerged,
                                   matmul_merged_args(v.normed, qkv_w, qkv_y),
                                   matmul_blocks(B, (nh + 2 * nkv) * hd, H), "qkv_proj", l));
    // q and k normalized per head and rotated, k and v cached: one task (five before: two
    // rms_norm, two rope and kv_write, each a hand-off on the step's critical path).
    const QkNormRopeKvTensors qk{v.q_proj3,    v.k_proj3,       v.v3, w.q_norm, w.k_norm,
                                 r_.positions, r_.slot_mapping, v.q3, v.k3,     pool.k_pool,
                                 pool.v_pool};
    SIMPLER_RETURN_IF_ERROR(submit(KernelId::kQkNormRopeKv,
                                   qk_norm_rope_kv_args(qk, p_.eps, p_.theta),
                                   row_blocks(B, (nh + 2 * nkv) * hd), "qk_norm_rope_kv", l));
    SIMPLER_RETURN_IF_ERROR(
        submit(KernelId::kPagedAttention,
               paged_attention_args(v.q3, pool.k_pool, pool.v_pool, r_.block_tables,
                                    r_.context_lens, v.attn_out, p_.scale),
               attention_blocks(B), "paged_attention", l));
    return submit(KernelId::kMatmulAcc, matmul_acc_args(v.attn_out, w.o_proj, v.hidden),
                  matmul_blocks(B, H, nh * hd), "o_proj", l);
  }

  // post_attention_layernorm through down_proj (added into hidden) of layer `l`.
  absl::Status submit_mlp(const ScratchViews& v, int64_t l) {
    const int64_t B = r_.B, H = p_.dims.hidden_size, I = p_.dims.intermediate_size;
    const Qwen3LayerWeights& w = p_.weights.layers[l];
    SIMPLER_RETURN_IF_ERROR(submit(
        KernelId::kRmsNorm, rms_norm_args(v.hidden, w.post_attention_layernorm, v.normed, p_.eps),
        row_blocks(B, H), "post_attention_layernorm", l));
    // gate and up projected and act = silu(gate)·up, as one task.
    SIMPLER_RETURN_IF_ERROR(
        submit(KernelId::kMatmulSiluMul,
               matmul_silu_mul_args(v.normed, w.gate_proj, w.up_proj, v.gate, v.up, v.act),
               matmul_blocks(B, 2 * I, H), "gate_up_proj", l));
    return submit(KernelId::kMatmulAcc, matmul_acc_args(v.act, w.down_proj, v.hidden),
                  matmul_blocks(B, H, I), "down_proj", l);
  }

  // The logit rows: gather, final norm, lm_head and (when on) argmax.
  absl::Status submit_head(const Tensor& hidden) {
    const int64_t n = r_.n, H = p_.dims.hidden_size, V = p_.dims.vocab_size;
    if (n == 0) return absl::OkStatus();
    const Qwen3Scratch& s = p_.scratch;
    const Tensor sel = rows_of(s.sel, {n, H});
    const Tensor sel_normed = rows_of(s.sel_normed, {n, H});
    const Tensor logits = r_.out_logits ? *r_.out_logits : rows_of(s.logits, {n, V});
    SIMPLER_RETURN_IF_ERROR(submit(
        KernelId::kGatherRows, gather_rows_args(hidden, r_.logit_rows, sel), 1, "gather_rows", -1));
    SIMPLER_RETURN_IF_ERROR(submit(KernelId::kRmsNorm,
                                   rms_norm_args(sel, p_.weights.norm, sel_normed, p_.eps),
                                   row_blocks(n, H), "final norm", -1));
    SIMPLER_RETURN_IF_ERROR(submit(KernelId::kMatmul, matmul_args(sel_normed, p_.lm_head, logits),
                                   matmul_blocks(n, V, H), "lm_head", -1));
    if (!p_.options.argmax) return absl::OkStatus();
    return submit(KernelId::kArgmax, argmax_args(logits, r_.out_ids), clamp_blocks(n, cores_),
                  "argmax", -1);
  }

  const Program& p_;
  task::OrchestrationContext& ctx_;
  const RunArgs& r_;
  const int32_t cores_;
};

absl::Status orchestrate(const Program& p, task::OrchestrationContext& ctx, const TaskArgs& args) {
  SIMPLER_ASSIGN_OR_RETURN(const RunArgs r, check_run_args(p, args));
  return DecodeSubmitter(p, ctx, r).submit_all();
}

}  // namespace

// ---- Qwen3Dims ----------------------------------------------------------------

absl::Status Qwen3Dims::validate() const {
  const std::pair<const char*, int64_t> sizes[] = {
      {"hidden_size", hidden_size},
      {"intermediate_size", intermediate_size},
      {"num_hidden_layers", num_hidden_layers},
      {"num_attention_heads", num_attention_heads},
      {"num_key_value_heads", num_key_value_heads},
      {"head_dim", head_dim},
      {"vocab_size", vocab_size},
  };
  for (const auto& [name, value] : sizes) {
    if (value <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("Qwen3Dims.", name, " = ", value, " must be positive"));
    }
  }
  if (num_attention_heads % num_key_value_heads != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("Qwen3Dims.num_attention_heads = ", num_attention_heads,
                     " is not a multiple of num_key_value_heads = ", num_key_value_heads));
  }
  if (head_dim % 2 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("Qwen3Dims.head_dim = ", head_dim, " must be even (rotate-half RoPE)"));
  }
  if (vocab_size > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(
        absl::StrCat("Qwen3Dims.vocab_size = ", vocab_size, " does not fit i32 token ids"));
  }
  // Products of the sizes (weight elements times 4 f32 bytes) must fit 64 bits before any code
  // multiplies them.
  struct Product {
    const char* weight;
    int64_t a, b, c;
  };
  for (const Product& p : {Product{"q_proj", num_attention_heads, head_dim, hidden_size},
                           Product{"k_proj", num_key_value_heads, head_dim, hidden_size},
                           Product{"gate_proj", intermediate_size, hidden_size, 1},
                           Product{"embed_tokens", vocab_size, hidden_size, 1}}) {
    int64_t bytes = 4;
    if (__builtin_mul_overflow(bytes, p.a, &bytes) || __builtin_mul_overflow(bytes, p.b, &bytes) ||
        __builtin_mul_overflow(bytes, p.c, &bytes)) {
      return absl::InvalidArgumentError(absl::StrCat("Qwen3Dims: ", p.weight, " of ", p.a, " x ",
                                                     p.b, " x ", p.c,
                                                     " f32 elements overflows 64-bit byte sizes"));
    }
  }
  // The kernels compute in float32: check the values there.
  if (!(rms_norm_eps >= 0.0) || !std::isfinite(static_cast<float>(rms_norm_eps))) {
    return absl::InvalidArgumentError(absl::StrCat("Qwen3Dims.rms_norm_eps = ", rms_norm_eps,
                                                   " must be finite in float32 and >= 0"));
  }
  if (!(rope_theta > 0.0) || !std::isnormal(static_cast<float>(rope_theta))) {
    return absl::InvalidArgumentError(absl::StrCat("Qwen3Dims.rope_theta = ", rope_theta,
                                                   " must be positive and normal in float32"));
  }
  return absl::OkStatus();
}

Qwen3Dims Qwen3Dims::from_config(const ModelConfig& c) {
  return {.hidden_size = c.hidden_size,
          .intermediate_size = c.intermediate_size,
          .num_hidden_layers = c.num_hidden_layers,
          .num_attention_heads = c.num_attention_heads,
          .num_key_value_heads = c.num_key_value_heads,
          .head_dim = c.head_dim,
          .vocab_size = c.vocab_size,
          .rms_norm_eps = c.rms_norm_eps,
          .rope_theta = c.rope_theta,
          .tie_word_embeddings = c.tie_word_embeddings};
}

// ---- weights ----------------------------------------------------------------------

const Tensor& Qwen3DeviceWeights::lm_head_or_embed(const Qwen3Dims& dims) const {
  return dims.tie_word_embeddings ? embed_tokens : lm_head;
}

absl::Status Qwen3DeviceWeights::validate(const Qwen3Dims& d) const {
  SIMPLER_RETURN_IF_ERROR(d.validate());
  const DataType f32 = DataType::kFloat32;
  const int64_t H = d.hidden_size, I = d.intermediate_size, V = d.vocab_size;
  const int64_t q = d.q_size(), kv = d.kv_size(), hd = d.head_dim;
  const std::string prefix = "Qwen3DeviceWeights.";
  SIMPLER_RETURN_IF_ERROR(check_matrix(prefix + "embed_tokens", embed_tokens, {V, H}));
  SIMPLER_RETURN_IF_ERROR(check_tensor(prefix + "norm", norm, f32, {H}));
  if (!d.tie_word_embeddings) {
    SIMPLER_RETURN_IF_ERROR(check_matrix(prefix + "lm_head", lm_head, {V, H}));
  }
  if (static_cast<int64_t>(layers.size()) != d.num_hidden_layers) {
    return absl::InvalidArgumentError(absl::StrCat(prefix, "layers has ", layers.size(),
                                                   " entries, num_hidden_layers is ",
                                                   d.num_hidden_layers));
  }
  for (size_t i = 0; i < layers.size(); ++i) {
    const Qwen3LayerWeights& w = layers[i];
    const std::string lp = absl::StrCat(prefix, "layers[", i, "].");
    SIMPLER_RETURN_IF_ERROR(check_tensor(lp + "input_layernorm", w.input_layernorm, f32, {H}));
    SIMPLER_RETURN_IF_ERROR(check_matrix(lp + "q_proj", w.q_proj, {q, H}));
    SIMPLER_RETURN_IF_ERROR(check_matrix(lp + "k_proj", w.k_proj, {kv, H}));
    SIMPLER_RETURN_IF_ERROR(check_matrix(lp + "v_proj", w.v_proj, {kv, H}));
    SIMPLER_RETURN_IF_ERROR(check_matrix(lp + "o_proj", w.o_proj, {H, q}));
    SIMPLER_RETURN_IF_ERROR(check_tensor(lp + "q_norm", w.q_norm, f32, {hd}));
    SIMPLER_RETURN_IF_ERROR(check_tensor(lp + "k_norm", w.k_norm, f32, {hd}));
    SIMPLER_RETURN_IF_ERROR(
        check_tensor(lp + "post_attention_layernorm", w.post_attention_layernorm, f32, {H}));
    SIMPLER_RETURN_IF_ERROR(check_matrix(lp + "gate_proj", w.gate_proj, {I, H}));
    SIMPLER_RETURN_IF_ERROR(check_matrix(lp + "up_proj", w.up_proj, {I, H}));
    SIMPLER_RETURN_IF_ERROR(check_matrix(lp + "down_proj", w.down_proj, {H, I}));
  }
  return absl::OkStatus();
}

// ---- scratch ------------------------------------------------------------------------

absl::Status Qwen3Scratch::validate(const Qwen3Dims& d) const {
  SIMPLER_RETURN_IF_ERROR(d.validate());
  if (max_batch < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("Qwen3Scratch.max_batch = ", max_batch, " must be positive"));
  }
  if (max_logit_rows < 1 || max_logit_rows > max_batch) {
    return absl::InvalidArgumentError(absl::StrCat("Qwen3Scratch.max_logit_rows = ", max_logit_rows,
                                                   " must be in [1, max_batch ", max_batch, "]"));
  }
  std::vector<NamedRange> ranges;
  for (const ScratchField& f : scratch_fields(d)) {
    const Tensor& t = this->*f.member;
    const std::string name = absl::StrCat("Qwen3Scratch.", f.name);
    SIMPLER_RETURN_IF_ERROR(check_tensor(name, t, DataType::kFloat32,
                                         {f.per_logit_row ? max_logit_rows : max_batch, f.cols}));
    ranges.push_back({name, t.address, t.address + t.span_bytes()});
  }
  return check_disjoint(std::move(ranges));
}

absl::StatusOr<uint64_t> qwen3_scratch_bytes(const Qwen3Dims& dims, int64_t max_batch,
                                             int64_t max_logit_rows) {
  SIMPLER_RETURN_IF_ERROR(dims.validate());
  if (max_batch < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("scratch max_batch = ", max_batch, " must be positive"));
  }
  if (max_logit_rows == 0) max_logit_rows = max_batch;
  if (max_logit_rows < 1 || max_logit_rows > max_batch) {
    return absl::InvalidArgumentError(absl::StrCat("scratch max_logit_rows = ", max_logit_rows,
                                                   " must be in [1, max_batch ", max_batch, "]"));
  }
  uint64_t bytes = 0;
  for (const ScratchField& f : scratch_fields(dims)) {
    bytes = align_up(bytes, kQwen3ScratchAlignment);
    bytes += static_cast<uint64_t>(f.per_logit_row ? max_logit_rows : max_batch) *
             static_cast<uint64_t>(f.cols) * sizeof(float);
  }
  return align_up(bytes, kQwen3ScratchAlignment);
}

absl::StatusOr<Qwen3Scratch> layout_scratch(const Qwen3Dims& dims, int64_t max_batch,
                                            uint64_t base_address, int64_t max_logit_rows) {
  SIMPLER_RETURN_IF_ERROR(qwen3_scratch_bytes(dims, max_batch, max_logit_rows).status());
  if (max_logit_rows == 0) max_logit_rows = max_batch;
  Qwen3Scratch s;
  s.max_batch = max_batch;
  s.max_logit_rows = max_logit_rows;
  uint64_t offset = 0;
  for (const ScratchField& f : scratch_fields(dims)) {
    offset = align_up(offset, kQwen3ScratchAlignment);
    const int64_t rows = f.per_logit_row ? max_logit_rows : max_batch;
    s.*f.member = view(base_address + offset, {rows, f.cols}, DataType::kFloat32);
    offset += static_cast<uint64_t>(rows) * static_cast<uint64_t>(f.cols) * sizeof(float);
  }
  return s;
}

// ---- KV pools -------------------------------------------------------------------------

int64_t Qwen3KvPools::num_pages() const { return layers.empty() ? 0 : layers[0].k_pool.shape[0]; }

int64_t Qwen3KvPools::page_size() const { return layers.empty() ? 0 : layers[0].k_pool.shape[2]; }

absl::Status Qwen3KvPools::validate(const Qwen3Dims& d) const {
  SIMPLER_RETURN_IF_ERROR(d.validate());
  if (static_cast<int64_t>(layers.size()) != d.num_hidden_layers) {
    return absl::InvalidArgumentError(absl::StrCat("Qwen3KvPools.layers has ", layers.size(),
                                                   " entries, num_hidden_layers is ",
                                                   d.num_hidden_layers));
  }
  const int64_t pages = num_pages();
  const int64_t page_size = this->page_size();
  if (pages < 1 || page_size < 1) {
    return absl::InvalidArgumentError(absl::StrCat("Qwen3KvPools.layers[0].k_pool has ", pages,
                                                   " pages of ", page_size,
                                                   " slots; both must be positive"));
  }
  if (pages * page_size > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(absl::StrCat("Qwen3KvPools: ", pages, " pages x ", page_size,
                                                   " slots exceed i32 slot ids"));
  }
  std::vector<NamedRange> ranges;
  for (size_t i = 0; i < layers.size(); ++i) {
    for (int kv = 0; kv < 2; ++kv) {
      const Tensor& t = kv == 0 ? layers[i].k_pool : layers[i].v_pool;
      const std::string name =
          absl::StrCat("Qwen3KvPools.layers[", i, "].", kv == 0 ? "k_pool" : "v_pool");
      SIMPLER_RETURN_IF_ERROR(check_tensor(name, t, DataType::kFloat32,
                                           {pages, d.num_key_value_heads, page_size, d.head_dim}));
      ranges.push_back({name, t.address, t.address + t.span_bytes()});
    }
  }
  return check_disjoint(std::move(ranges));
}

absl::StatusOr<uint64_t> qwen3_kv_pool_bytes(const Qwen3Dims& dims, int64_t num_pages,
                                             int64_t page_size) {
  SIMPLER_RETURN_IF_ERROR(dims.validate());
  if (num_pages < 1 || page_size < 1) {
    return absl::InvalidArgumentError(absl::StrCat("KV pool of ", num_pages, " pages of ",
                                                   page_size, " slots: both must be positive"));
  }
  if (num_pages * page_size > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(absl::StrCat("KV pool of ", num_pages, " pages x ", page_size,
                                                   " slots exceeds i32 slot ids"));
  }
  const uint64_t pool = align_up(static_cast<uint64_t>(num_pages * page_size) *
                                     static_cast<uint64_t>(dims.kv_size()) * sizeof(float),
                                 kQwen3ScratchAlignment);
  return pool * 2 * static_cast<uint64_t>(dims.num_hidden_layers);
}

absl::StatusOr<Qwen3KvPools> layout_kv_pools(const Qwen3Dims& dims, int64_t num_pages,
                                             int64_t page_size, uint64_t base_address) {
  SIMPLER_ASSIGN_OR_RETURN(const uint64_t total, qwen3_kv_pool_bytes(dims, num_pages, page_size));
  const uint64_t pool = total / (2 * static_cast<uint64_t>(dims.num_hidden_layers));
  Qwen3KvPools pools;
  uint64_t offset = 0;
  for (int64_t l = 0; l < dims.num_hidden_layers; ++l) {
    Qwen3KvLayerPool layer;
    layer.k_pool =
        view(base_address + offset, {num_pages, dims.num_key_value_heads, page_size, dims.head_dim},
             DataType::kFloat32);
    offset += pool;
    layer.v_pool =
        view(base_address + offset, {num_pages, dims.num_key_value_heads, page_size, dims.head_dim},
             DataType::kFloat32);
    offset += pool;
    pools.layers.push_back(layer);
  }
  return pools;
}

// ---- run arguments and the callable ------------------------------------------------------

TaskArgs Qwen3DecodeRunArgs::to_task_args() const {
  TaskArgs a;
  a.add_tensors({input_ids, positions, slot_mapping, block_tables, context_lens, logit_rows},
                ArgDirection::kIn)
      .add_tensor(out_ids, ArgDirection::kOut);
  if (out_logits) a.add_tensor(*out_logits, ArgDirection::kOut);
  a.add_scalar_i64(input_ids.rank == 1 ? input_ids.shape[0] : 0)
      .add_scalar_i64(logit_rows.rank == 1 ? logit_rows.shape[0] : 0);
  return a;
}

int64_t qwen3_decode_task_count(const Qwen3Dims& dims, bool wants_logits) {
  return 1 + 8 * dims.num_hidden_layers + (wants_logits ? 4 : 0);
}

absl::StatusOr<task::ChipCallable> make_qwen3_decode_callable(const Qwen3Dims& dims,
                                                              const Qwen3DeviceWeights& weights,
                                                              const Qwen3Scratch& scratch,
                                                              const Qwen3KvPools& kv_pools,
                                                              const Qwen3ProgramOptions& options) {
  SIMPLER_RETURN_IF_ERROR(dims.validate());
  SIMPLER_RETURN_IF_ERROR(weights.validate(dims));
  SIMPLER_RETURN_IF_ERROR(scratch.validate(dims));
  SIMPLER_RETURN_IF_ERROR(kv_pools.validate(dims));
  if (options.name.empty()) {
    return absl::InvalidArgumentError("Qwen3ProgramOptions.name is empty");
  }
  auto program = std::make_shared<Program>();
  program->dims = dims;
  program->weights = weights;
  program->scratch = scratch;
  program->pools = kv_pools;
  program->options = options;
  program->lm_head = weights.lm_head_or_embed(dims);
  program->eps = static_cast<float>(dims.rms_norm_eps);
  program->theta = static_cast<float>(dims.rope_theta);
  program->scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(dims.head_dim)));

  task::ChipCallable callable;
  callable.name = options.name;
  callable.kernels = llm_kernels(options.kernel_isa, options.precision);
  callable.placement = options.placement;
  callable.orchestration = [program = std::shared_ptr<const Program>(program)](
                               task::OrchestrationContext& ctx, const TaskArgs& args) {
    return orchestrate(*program, ctx, args);
  };
  SIMPLER_RETURN_IF_ERROR(callable.validate());
  return callable;
}

}  // namespace simpler::llm
