#include "simpler/model/qwen3_program.h"

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "simpler/base/status.h"
#include "simpler/kernels/kernels.h"

namespace simpler::llm {
namespace {

using task::ArgDirection;
using task::DataType;
using task::MemoryKind;
using task::TaskArgs;
using task::Tensor;

std::string dims_string(const int64_t* dims, int rank) {
  std::vector<std::string> s;
  for (int i = 0; i < rank; ++i)
    s.push_back(dims[i] < 0 ? std::string("*") : absl::StrCat(dims[i]));
  return absl::StrCat("[", absl::StrJoin(s, ","), "]");
}

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
  const int rank = static_cast<int>(dims.size());
  bool ok = t.dtype == dtype && t.rank == rank && t.is_contiguous();
  for (int i = 0; ok && i < rank; ++i) {
    if (dims.begin()[i] >= 0 && t.shape[i] != dims.begin()[i]) ok = false;
  }
  if (!ok) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " must be a contiguous ", std::string(task::name_of(dtype)),
                     dims_string(dims.begin(), rank), " tensor, got ", t.debug_string(),
                     t.is_contiguous() ? "" : " (strided)"));
  }
  if (t.memory != MemoryKind::kDevice) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " must be a DEVICE tensor, got ", t.debug_string()));
  }
  if (t.address == 0) return absl::InvalidArgumentError(absl::StrCat(what, " has a null address"));
  return absl::OkStatus();
}

// A weight matrix: f32, bf16 or f16 (what the matmul and embedding kernels take).
absl::Status check_matrix(const std::string& what, const Tensor& t,
                          std::initializer_list<int64_t> dims) {
  const DataType dt = t.dtype == DataType::kBFloat16 || t.dtype == DataType::kFloat16
                          ? t.dtype
                          : DataType::kFloat32;
  absl::Status s = check_tensor(what, t, dt, dims);
  if (!s.ok() && t.dtype != dt) {
    return absl::InvalidArgumentError(absl::StrCat(s.message(), " (f32, bf16 or f16)"));
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

// Run argument `i` must be a tensor of `dtype` / `dims`, tagged IN (or INOUT)
// for inputs and OUT (or INOUT) for outputs. Run tensors may be HOST or DEVICE.
absl::Status check_run_tensor(const TaskArgs& args, uint32_t i, const char* name, DataType dtype,
                              std::initializer_list<int64_t> dims, bool output) {
  const std::string what = absl::StrCat("qwen3 decode run argument ", i, " (", name, ")");
  const task::Arg& a = args[i];
  if (a.direction == ArgDirection::kScalar) {
    return absl::InvalidArgumentError(absl::StrCat(what, " must be a tensor, got a scalar"));
  }
  const bool dir_ok = a.direction == ArgDirection::kInOut ||
                      a.direction == (output ? ArgDirection::kOut : ArgDirection::kIn);
  if (!dir_ok) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " must be tagged ", output ? "OUT or INOUT" : "IN or INOUT", ", got ",
                     std::string(task::name_of(a.direction))));
  }
  const Tensor& t = a.tensor;
  const int rank = static_cast<int>(dims.size());
  bool ok = t.dtype == dtype && t.rank == rank && t.is_contiguous();
  for (int d = 0; ok && d < rank; ++d) {
    if (dims.begin()[d] >= 0 && t.shape[d] != dims.begin()[d]) ok = false;
  }
  if (!ok) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " must be a contiguous ", std::string(task::name_of(dtype)),
                     dims_string(dims.begin(), rank), " tensor, got ", t.debug_string()));
  }
  return absl::OkStatus();
}

int32_t clamp_blocks(int64_t want, int32_t cores) {
  return static_cast<int32_t>(std::max<int64_t>(1, std::min<int64_t>(cores, want)));
}

absl::Status orchestrate(const Program& p, task::OrchestrationContext& ctx, const TaskArgs& args) {
  const Qwen3Dims& d = p.dims;
  const Qwen3ProgramOptions& o = p.options;
  // ---- run arguments ----
  if (args.size() < 7) {
    return absl::InvalidArgumentError(
        absl::StrCat("qwen3 decode run expects at least 7 arguments, got ", args.size()));
  }
  SIMPLER_RETURN_IF_ERROR(
      check_run_tensor(args, kQwen3InputIds, "input_ids", DataType::kInt32, {-1}, false));
  const int64_t B = args[kQwen3InputIds].tensor.shape[0];
  SIMPLER_RETURN_IF_ERROR(
      check_run_tensor(args, kQwen3Positions, "positions", DataType::kInt32, {B}, false));
  SIMPLER_RETURN_IF_ERROR(
      check_run_tensor(args, kQwen3SlotMapping, "slot_mapping", DataType::kInt32, {B}, false));
  SIMPLER_RETURN_IF_ERROR(
      check_run_tensor(args, kQwen3BlockTables, "block_tables", DataType::kInt32, {B, -1}, false));
  SIMPLER_RETURN_IF_ERROR(
      check_run_tensor(args, kQwen3ContextLens, "context_lens", DataType::kInt32, {B}, false));
  SIMPLER_RETURN_IF_ERROR(
      check_run_tensor(args, kQwen3LogitRows, "logit_rows", DataType::kInt32, {-1}, false));
  const int64_t n = args[kQwen3LogitRows].tensor.shape[0];
  SIMPLER_RETURN_IF_ERROR(
      check_run_tensor(args, kQwen3OutIds, "out_ids", DataType::kInt32, {n}, true));
  uint32_t next = 7;
  std::optional<Tensor> out_logits;
  if (args.size() > next && args[next].direction != ArgDirection::kScalar) {
    SIMPLER_RETURN_IF_ERROR(
        check_run_tensor(args, next, "out_logits", DataType::kFloat32, {n, d.vocab_size}, true));
    out_logits = args[next].tensor;
    ++next;
  }
  const int64_t scalars[2] = {B, n};
  const char* scalar_names[2] = {"B", "n"};
  for (int s = 0; s < 2 && next < args.size(); ++s, ++next) {
    if (args[next].direction != ArgDirection::kScalar) {
      return absl::InvalidArgumentError(absl::StrCat("qwen3 decode run argument ", next, " (",
                                                     scalar_names[s],
                                                     ") must be a scalar, got a tensor"));
    }
    if (args[next].scalar != static_cast<uint64_t>(scalars[s])) {
      return absl::InvalidArgumentError(absl::StrCat(
          "qwen3 decode run argument ", next, " (", scalar_names[s], " = ",
          static_cast<int64_t>(args[next].scalar), ") disagrees with the tensor shapes (",
          scalar_names[s], " = ", scalars[s], ")"));
    }
  }
  if (next != args.size()) {
    return absl::InvalidArgumentError(absl::StrCat("qwen3 decode run has ", args.size(),
                                                   " arguments, at most ", next, " expected"));
  }
  if (B < 1 || B > p.scratch.max_batch) {
    return absl::InvalidArgumentError(absl::StrCat(
        "qwen3 decode batch of ", B, " rows is outside [1, max_batch ", p.scratch.max_batch, "]"));
  }
  if (n > p.scratch.max_logit_rows) {
    return absl::InvalidArgumentError(absl::StrCat("qwen3 decode asks logits for ", n,
                                                   " rows, more than max_logit_rows ",
                                                   p.scratch.max_logit_rows));
  }
  const Tensor& input_ids = args[kQwen3InputIds].tensor;
  const Tensor& positions = args[kQwen3Positions].tensor;
  const Tensor& slot_mapping = args[kQwen3SlotMapping].tensor;
  const Tensor& block_tables = args[kQwen3BlockTables].tensor;
  const Tensor& context_lens = args[kQwen3ContextLens].tensor;
  const Tensor& logit_rows = args[kQwen3LogitRows].tensor;
  const Tensor& out_ids = args[kQwen3OutIds].tensor;

  const int32_t cores = std::max<int32_t>(1, ctx.num_cores());
  const int64_t H = d.hidden_size, I = d.intermediate_size, hd = d.head_dim;
  const int64_t nh = d.num_attention_heads, nkv = d.num_key_value_heads;

  auto submit = [&](KernelId id, const TaskArgs& a, int32_t block_dim, const char* what,
                    int64_t layer) -> absl::Status {
    absl::Status s = ctx.submit(k(id), a, block_dim);
    if (s.ok()) return s;
    return base::annotate(s, layer >= 0
                                 ? absl::StrCat("qwen3 decode layer ", layer, " ", what, ": ")
                                 : absl::StrCat("qwen3 decode ", what, ": "));
  };
  auto matmul_blocks = [&](int64_t rows, int64_t out, int64_t in) {
    return clamp_blocks(std::min(out / std::max<int64_t>(1, o.min_rows_per_block),
                                 rows * out * in / std::max<int64_t>(1, o.min_macs_per_block)),
                        cores);
  };
  auto row_blocks = [&](int64_t rows, int64_t cols) {
    return clamp_blocks(std::min(rows, rows * cols / std::max<int64_t>(1, o.min_elems_per_block)),
                        cores);
  };

  // Views of the first B rows of the scratch buffers.
  const Qwen3Scratch& s = p.scratch;
  const Tensor hidden = rows_of(s.hidden, {B, H});
  const Tensor normed = rows_of(s.normed, {B, H});
  const Tensor q_proj = rows_of(s.q_proj, {B, nh * hd});
  const Tensor q_proj_heads = rows_of(s.q_proj, {B * nh, hd});
  const Tensor k_proj = rows_of(s.k_proj, {B, nkv * hd});
  const Tensor k_proj_heads = rows_of(s.k_proj, {B * nkv, hd});
  const Tensor v = rows_of(s.v, {B, nkv * hd});
  const Tensor v3 = rows_of(s.v, {B, nkv, hd});
  const Tensor q_heads = rows_of(s.q, {B * nh, hd});
  const Tensor q3 = rows_of(s.q, {B, nh, hd});
  const Tensor k_heads = rows_of(s.k, {B * nkv, hd});
  const Tensor k3 = rows_of(s.k, {B, nkv, hd});
  const Tensor attn_out = rows_of(s.attn_out, {B, nh * hd});
  const Tensor gate = rows_of(s.gate, {B, I});
  const Tensor up = rows_of(s.up, {B, I});
  const Tensor act = rows_of(s.act, {B, I});

  SIMPLER_RETURN_IF_ERROR(submit(KernelId::kEmbedding,
                                 embedding_args(input_ids, p.weights.embed_tokens, hidden), 1,
                                 "embedding", -1));
  for (int64_t l = 0; l < d.num_hidden_layers; ++l) {
    const Qwen3LayerWeights& w = p.weights.layers[l];
    const Qwen3KvLayerPool& pool = p.pools.layers[l];
    SIMPLER_RETURN_IF_ERROR(submit(KernelId::kRmsNorm,
                                   rms_norm_args(hidden, w.input_layernorm, normed, p.eps),
                                   row_blocks(B, H), "input_layernorm", l));
    SIMPLER_RETURN_IF_ERROR(submit(KernelId::kMatmul, matmul_args(normed, w.q_proj, q_proj),
                                   matmul_blocks(B, nh * hd, H), "q_proj", l));
    SIMPLER_RETURN_IF_ERROR(submit(KernelId::kMatmul, matmul_args(normed, w.k_proj, k_proj),
                                   matmul_blocks(B, nkv * hd, H), "k_proj", l));
    SIMPLER_RETURN_IF_ERROR(submit(KernelId::kMatmul, matmul_args(normed, w.v_proj, v),
                                   matmul_blocks(B, nkv * hd, H), "v_proj", l));
    SIMPLER_RETURN_IF_ERROR(submit(KernelId::kRmsNorm,
                                   rms_norm_args(q_proj_heads, w.q_norm, q_heads, p.eps),
                                   row_blocks(B * nh, hd), "q_norm", l));
    SIMPLER_RETURN_IF_ERROR(submit(KernelId::kRmsNorm,
                                   rms_norm_args(k_proj_heads, w.k_norm, k_heads, p.eps),
                                   row_blocks(B * nkv, hd), "k_norm", l));
    SIMPLER_RETURN_IF_ERROR(submit(KernelId::kRope, rope_args(q3, positions, p.theta),
                                   row_blocks(B, nh * hd), "q rope", l));
    SIMPLER_RETURN_IF_ERROR(submit(KernelId::kRope, rope_args(k3, positions, p.theta),
                                   row_blocks(B, nkv * hd), "k rope", l));
    SIMPLER_RETURN_IF_ERROR(submit(KernelId::kKvWrite,
                                   kv_write_args(k3, v3, slot_mapping, pool.k_pool, pool.v_pool), 1,
                                   "kv_write", l));
    SIMPLER_RETURN_IF_ERROR(submit(KernelId::kPagedAttention,
                                   paged_attention_args(q3, pool.k_pool, pool.v_pool, block_tables,
                                                        context_lens, attn_out, p.scale),
                                   clamp_blocks(B * nkv, cores), "paged_attention", l));
    SIMPLER_RETURN_IF_ERROR(submit(KernelId::kMatmulAcc,
                                   matmul_acc_args(attn_out, w.o_proj, hidden),
                                   matmul_blocks(B, H, nh * hd), "o_proj", l));
    SIMPLER_RETURN_IF_ERROR(submit(KernelId::kRmsNorm,
                                   rms_norm_args(hidden, w.post_attention_layernorm, normed, p.eps),
                                   row_blocks(B, H), "post_attention_layernorm", l));
    SIMPLER_RETURN_IF_ERROR(submit(KernelId::kMatmul, matmul_args(normed, w.gate_proj, gate),
                                   matmul_blocks(B, I, H), "gate_proj", l));
    SIMPLER_RETURN_IF_ERROR(submit(KernelId::kMatmul, matmul_args(normed, w.up_proj, up),
                                   matmul_blocks(B, I, H), "up_proj", l));
    SIMPLER_RETURN_IF_ERROR(
        submit(KernelId::kSiluMul, silu_mul_args(gate, up, act), row_blocks(B, I), "silu_mul", l));
    SIMPLER_RETURN_IF_ERROR(submit(KernelId::kMatmulAcc, matmul_acc_args(act, w.down_proj, hidden),
                                   matmul_blocks(B, H, I), "down_proj", l));
  }
  if (n == 0) return absl::OkStatus();

  const Tensor sel = rows_of(s.sel, {n, H});
  const Tensor sel_normed = rows_of(s.sel_normed, {n, H});
  const Tensor logits = out_logits ? *out_logits : rows_of(s.logits, {n, d.vocab_size});
  SIMPLER_RETURN_IF_ERROR(submit(KernelId::kGatherRows, gather_rows_args(hidden, logit_rows, sel),
                                 1, "gather_rows", -1));
  SIMPLER_RETURN_IF_ERROR(submit(KernelId::kRmsNorm,
                                 rms_norm_args(sel, p.weights.norm, sel_normed, p.eps),
                                 row_blocks(n, H), "final norm", -1));
  SIMPLER_RETURN_IF_ERROR(submit(KernelId::kMatmul, matmul_args(sel_normed, p.lm_head, logits),
                                 matmul_blocks(n, d.vocab_size, H), "lm_head", -1));
  if (!p.options.argmax) return absl::OkStatus();
  SIMPLER_RETURN_IF_ERROR(submit(KernelId::kArgmax, argmax_args(logits, out_ids),
                                 clamp_blocks(n, cores), "argmax", -1));
  return absl::OkStatus();
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
  Qwen3Dims d;
  d.hidden_size = c.hidden_size;
  d.intermediate_size = c.intermediate_size;
  d.num_hidden_layers = c.num_hidden_layers;
  d.num_attention_heads = c.num_attention_heads;
  d.num_key_value_heads = c.num_key_value_heads;
  d.head_dim = c.head_dim;
  d.vocab_size = c.vocab_size;
  d.rms_norm_eps = c.rms_norm_eps;
  d.rope_theta = c.rope_theta;
  d.tie_word_embeddings = c.tie_word_embeddings;
  return d;
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

int64_t Qwen3KvPools::page_size() const { return layers.empty() ? 0 : layers[0].k_pool.shape[1]; }

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
                                           {pages, page_size, d.num_key_value_heads, d.head_dim}));
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
        view(base_address + offset, {num_pages, page_size, dims.num_key_value_heads, dims.head_dim},
             DataType::kFloat32);
    offset += pool;
    layer.v_pool =
        view(base_address + offset, {num_pages, page_size, dims.num_key_value_heads, dims.head_dim},
             DataType::kFloat32);
    offset += pool;
    pools.layers.push_back(layer);
  }
  return pools;
}

// ---- run arguments and the callable ------------------------------------------------------

TaskArgs Qwen3DecodeRunArgs::to_task_args() const {
  TaskArgs a;
  a.add_tensor(input_ids, ArgDirection::kIn)
      .add_tensor(positions, ArgDirection::kIn)
      .add_tensor(slot_mapping, ArgDirection::kIn)
      .add_tensor(block_tables, ArgDirection::kIn)
      .add_tensor(context_lens, ArgDirection::kIn)
      .add_tensor(logit_rows, ArgDirection::kIn)
      .add_tensor(out_ids, ArgDirection::kOut);
  if (out_logits) a.add_tensor(*out_logits, ArgDirection::kOut);
  a.add_scalar_i64(input_ids.rank == 1 ? input_ids.shape[0] : 0)
      .add_scalar_i64(logit_rows.rank == 1 ? logit_rows.shape[0] : 0);
  return a;
}

int64_t qwen3_decode_task_count(const Qwen3Dims& dims, bool wants_logits) {
  return 1 + 16 * dims.num_hidden_layers + (wants_logits ? 4 : 0);
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
