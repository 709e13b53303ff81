// The Qwen3 decode program: one run = one forward step of a batch of B rows
// (one token per row), as a ChipCallable built from the kernels of kernels.h.
//
// Math follows Hugging Face transformers `modeling_qwen3.py` and the Qwen3
// model card: RMSNorm → q/k/v projections → per-head q/k RMSNorm → rotate-half
// RoPE → paged causal GQA attention (scale 1/sqrt(head_dim)) → o_proj +
// residual → RMSNorm → down(silu(gate)·up) + residual; final RMSNorm, LM head
// (embed_tokens when tied), greedy argmax on the device. No biases. Projection and
// embedding weights are f32, bf16 or f16 (computed in f32); activations and the KV cache are f32.
//
// Prefill goes through the same program: a prompt chunk is one row per position in the same
// run as the decode rows (chunked prefill); rows whose logits are not needed are left out of
// `logit_rows`.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "simpler/kernels/kernels.h"
#include "simpler/model/model_config.h"
#include "simpler/task/call_config.h"
#include "simpler/task/callable.h"
#include "simpler/task/task_args.h"
#include "simpler/task/tensor.h"

namespace simpler::llm {

// Model dimensions the program needs; field names and meanings as in
// transformers' Qwen3Config (the lead converts ModelConfig into this). Plain value.
struct Qwen3Dims {
  int64_t hidden_size = 0;           // H
  int64_t intermediate_size = 0;     // I
  int64_t num_hidden_layers = 0;     // L
  int64_t num_attention_heads = 0;   // query heads
  int64_t num_key_value_heads = 0;   // KV heads; divides num_attention_heads
  int64_t head_dim = 0;              // even; need not be H / heads
  int64_t vocab_size = 0;            // V
  double rms_norm_eps = 1e-6;        // passed to kernels as f32
  double rope_theta = 1e6;           // passed to kernels as f32
  bool tie_word_embeddings = false;  // LM head = embed_tokens

  int64_t q_size() const { return num_attention_heads * head_dim; }
  int64_t kv_size() const { return num_key_value_heads * head_dim; }

  // INVALID_ARGUMENT naming the field: a size not positive, heads not a
  // multiple of kv heads, an odd head_dim, eps < 0 or theta <= 0 (or NaN),
  // a vocabulary beyond int32 ids.
  absl::Status validate() const;

  // The dimensions a checkpoint's config.json describes (field for field;
  // Hugging Face Qwen3 names). Not validated: call validate().
  static Qwen3Dims from_config(const ModelConfig& config);
};

// Weights of one decoder layer: contiguous device tensors, shapes [out, in] for projections
// (Hugging Face names, `model.layers.{i}.` prefix). Projections are f32, bf16 or f16 (the
// checkpoint's dtype: the matmul kernels widen them in registers); norm vectors are f32.
struct Qwen3LayerWeights {
  task::Tensor input_layernorm;           // [H]
  task::Tensor q_proj;                    // [heads·head_dim, H]
  task::Tensor k_proj;                    // [kv_heads·head_dim, H]
  task::Tensor v_proj;                    // [kv_heads·head_dim, H]
  task::Tensor o_proj;                    // [H, heads·head_dim]
  task::Tensor q_norm;                    // [head_dim]
  task::Tensor k_norm;                    // [head_dim]
  task::Tensor post_attention_layernorm;  // [H]
  task::Tensor gate_proj;                 // [I, H]
  task::Tensor up_proj;                   // [I, H]
  task::Tensor down_proj;                 // [H, I]
};

// All weights as device tensors (views; the memory is owned by whoever
// uploaded them and must outlive every run of the callable). Plain value.
struct Qwen3DeviceWeights {
  task::Tensor embed_tokens;              // [V, H], f32 / bf16 / f16
  std::vector<Qwen3LayerWeights> layers;  // num_hidden_layers entries
  task::Tensor norm;                      // [H], final RMSNorm
  task::Tensor
      lm_head;  // [V, H], f32 / bf16 / f16; ignored (may be empty) when tie_word_embeddings

  // The LM head the program uses: embed_tokens when tied, lm_head otherwise.
  const task::Tensor& lm_head_or_embed(const Qwen3Dims& dims) const;

  // INVALID_ARGUMENT naming the weight ("layers[1].k_norm") whose dtype,
  // shape, contiguity, memory kind (must be DEVICE) or address is wrong.
  absl::Status validate(const Qwen3Dims& dims) const;
};

// Activation buffers of one step for up to `max_batch` rows, as f32 device
// tensors with leading dimension max_batch (runs with B < max_batch use the
// first B rows); sel, sel_normed and logits hold only the rows that want
// logits, so their leading dimension is max_logit_rows (<= max_batch: a
// chunked-prefill step has many rows but few logit rows). Reused by every run of the callable, so
// runs of one callable must execute one at a time (the device is serial at the run level,
// ARCHITECTURE.md invariant 2) — give each concurrently executing lane its own
// scratch. Memory owned by the caller; plain value.
struct Qwen3Scratch {
  int64_t max_batch = 0;
  int64_t max_logit_rows = 0;  // in [1, max_batch]
  task::Tensor hidden;         // [Bmax, H]      residual stream
  task::Tensor normed;         // [Bmax, H]      RMSNorm output
  task::Tensor q_proj;         // [Bmax, heads·hd] q before q_norm / RoPE
  task::Tensor k_proj;         // [Bmax, kv·hd]    k before k_norm / RoPE
  task::Tensor v;              // [Bmax, kv·hd]
  task::Tensor q;              // [Bmax, heads·hd] q after q_norm and RoPE
  task::Tensor k;              // [Bmax, kv·hd]    k after k_norm and RoPE
  task::Tensor attn_out;       // [Bmax, heads·hd]
  task::Tensor gate;           // [Bmax, I]
  task::Tensor up;             // [Bmax, I]
  task::Tensor act;            // [Bmax, I]      silu(gate)·up
  task::Tensor sel;            // [max_logit_rows, H]  hidden rows of logit_rows
  task::Tensor sel_normed;     // [max_logit_rows, H]  final-normed sel
  task::Tensor logits;         // [max_logit_rows, V]  used when the run has no out_logits

  // INVALID_ARGUMENT naming the buffer whose shape, dtype or address is wrong
  // for `dims` and max_batch, or when two buffers overlap.
  absl::Status validate(const Qwen3Dims& dims) const;
};

// Alignment of every buffer inside a scratch layout (bytes, relative to base).
inline constexpr uint64_t kQwen3ScratchAlignment = 64;

// Bytes of one contiguous allocation holding every Qwen3Scratch buffer for
// `dims`, `max_batch` and `max_logit_rows` (0: max_batch), each buffer aligned
// to kQwen3ScratchAlignment relative to the base. INVALID_ARGUMENT for invalid
// dims, max_batch < 1 or max_logit_rows outside [1, max_batch].
absl::StatusOr<uint64_t> qwen3_scratch_bytes(const Qwen3Dims& dims, int64_t max_batch,
                                             int64_t max_logit_rows = 0);

// Carves the Qwen3Scratch buffers out of one allocation of
// qwen3_scratch_bytes(dims, max_batch) bytes at device address
// `base_address` (should be 64-byte aligned). Errors as qwen3_scratch_bytes.
absl::StatusOr<Qwen3Scratch> layout_scratch(const Qwen3Dims& dims, int64_t max_batch,
                                            uint64_t base_address, int64_t max_logit_rows = 0);

// One layer's KV cache pools: f32 device tensors
// [num_pages, num_key_value_heads, page_size, head_dim] (a page kv head by kv head: kv_write in
// kernels.h); slot = page·page_size + offset (see kv_cache.h). Memory owned by the caller.
struct Qwen3KvLayerPool {
  task::Tensor k_pool;
  task::Tensor v_pool;
};

// KV pools of every layer; all layers share num_pages and page_size. Plain value.
struct Qwen3KvPools {
  std::vector<Qwen3KvLayerPool> layers;  // num_hidden_layers entries

  int64_t num_pages() const;  // 0 when empty
  int64_t page_size() const;  // 0 when empty

  // INVALID_ARGUMENT naming the layer and pool when a shape, dtype or memory
  // kind is wrong, the layers disagree, or two pools overlap.
  absl::Status validate(const Qwen3Dims& dims) const;
};

// Bytes of one contiguous allocation for all layers' K and V pools (each pool
// aligned to kQwen3ScratchAlignment). INVALID_ARGUMENT for invalid dims,
// num_pages < 1 or page_size < 1, or a slot count beyond int32.
absl::StatusOr<uint64_t> qwen3_kv_pool_bytes(const Qwen3Dims& dims, int64_t num_pages,
                                             int64_t page_size);
// Carves the pools out of one allocation of qwen3_kv_pool_bytes bytes at
// device address `base_address`, in order layer 0 K, layer 0 V, layer 1 K, ...
absl::StatusOr<Qwen3KvPools> layout_kv_pools(const Qwen3Dims& dims, int64_t num_pages,
                                             int64_t page_size, uint64_t base_address);

// Tuning of the decode callable.
struct Qwen3ProgramOptions {
  std::string name = "qwen3_decode";  // the callable's name
  // SPMD split of matmuls: block_dim = max(1, min(num_cores, out /
  // min_rows_per_block, B·out·in / min_macs_per_block)); so tiny projections
  // run as one block and the LM head spreads over every core.
  int64_t min_rows_per_block = 16;
  int64_t min_macs_per_block = int64_t{1} << 16;
  // Row-parallel kernels (rms_norm, qk_norm_rope_kv, silu_mul, rope, kv_write) split when a
  // block gets at least this many elements. 2^12: a qwen3-0.6b rms_norm (1,024 a row) takes two
  // blocks from 8 rows, qk_norm_rope_kv (4,096 a row) from 2 (docs/design/scheduler.md has the
  // measurements behind the value).
  int64_t min_elems_per_block = int64_t{1} << 12;
  // paged_attention splits over the (row, kv head) pairs when a block gets at least this many
  // multiply-adds at the longest context the block tables hold (2 · B · heads · head_dim ·
  // their width in tokens): below it, a second block costs more in its hand-off to another core
  // than it saves. 2^16: a batch-1 qwen3-0.6b step (16 heads of 128) splits from tables 32
  // tokens wide (docs/design/scheduler.md has the measurements behind the value).
  int64_t min_attention_macs_per_block = int64_t{1} << 16;
  task::GraphPlacement placement = task::GraphPlacement::kDefault;
  // Submit the argmax task into out_ids. A caller that samples from the
  // logits itself (the model runner) turns it off; out_ids is then untouched.
  bool argmax = true;
  // The callable's kernels are llm_kernels(kernel_isa, precision).
  KernelIsa kernel_isa = KernelIsa::kAuto;
  Precision precision = Precision::kInt8;
};

// Positions of the run arguments of the decode callable. B = shape[0] of
// input_ids, n = shape[0] of logit_rows; all i32 tensors are contiguous.
//
//   0 input_ids     i32 [B]             IN   token of each row
//   1 positions     i32 [B]             IN   its position (0-based) in its request
//   2 slot_mapping  i32 [B]             IN   KV slot the row's K/V go to; < 0 = padding row
//   3 block_tables  i32 [B, max_blocks] IN   pages of each row's request, token order
//   4 context_lens  i32 [B]             IN   tokens each row attends, incl. itself
//                                            (= position + 1; 0 for padding rows)
//   5 logit_rows    i32 [n]             IN   rows (in [0, B)) whose next token is wanted
//   6 out_ids       i32 [n]             OUT  argmax of each logit row's logits
//   7 out_logits    f32 [n, V]          OUT  optional: present (as a tensor) when the
//                                            run wants the logits themselves
//   then optionally two scalars (int64): B, n — checked against the shapes when present.
// n may be 0 (a prefill step no row of which needs logits): the final norm,
// LM head and argmax are then skipped and out_ids (shape [0]) is untouched.
// Requires 1 <= B <= scratch.max_batch and n <= scratch.max_logit_rows.
enum Qwen3RunArg : uint32_t {
  kQwen3InputIds = 0,
  kQwen3Positions = 1,
  kQwen3SlotMapping = 2,
  kQwen3BlockTables = 3,
  kQwen3ContextLens = 4,
  kQwen3LogitRows = 5,
  kQwen3OutIds = 6,
  kQwen3OutLogits = 7,
};

// The run arguments above as named fields; to_task_args() builds the TaskArgs
// in order with the documented directions (and the B, n scalars).
struct Qwen3DecodeRunArgs {
  task::Tensor input_ids;
  task::Tensor positions;
  task::Tensor slot_mapping;
  task::Tensor block_tables;
  task::Tensor context_lens;
  task::Tensor logit_rows;
  task::Tensor out_ids;
  std::optional<task::Tensor> out_logits;

  task::TaskArgs to_task_args() const;
};

// Tasks one run submits: 1 + 8 per layer, plus 4 when n > 0.
// Per layer: rms_norm, q/k/v matmul_merged (one task over the three weights),
// qk_norm_rope_kv (q/k rms_norm, q/k rope and the KV write in one task), paged_attention,
// o_proj matmul_acc (residual fused), rms_norm, gate/up matmul_silu_mul (both projections and
// silu·mul in one task), down matmul_acc (residual fused). After the layers:
// gather_rows, rms_norm, LM head matmul, argmax.
int64_t qwen3_decode_task_count(const Qwen3Dims& dims, bool wants_logits);

// Builds the decode callable. The orchestration captures dims, weights,
// scratch and pools by value (tensor views), so the memory behind them must
// outlive every run; it is reentrant and keeps no state between runs. Kernels
// are llm_kernels() (kernels.h).
//
// Dependencies: every task tags what it reads IN and what it writes OUT /
// INOUT (kv_write: pools INOUT; paged_attention: pools IN; matmul_acc: the
// residual stream INOUT), so the runtime's range-overlap inference orders the
// tasks exactly; scratch reused across layers gets WAR/WAW edges.
//
// Errors here: INVALID_ARGUMENT from validate() of dims, weights, scratch or
// pools. Errors of a run (from the orchestration): INVALID_ARGUMENT naming the
// run argument whose kind, dtype or shape is wrong, or B / n beyond the
// scratch's max_batch; kernel errors (bad token id, bad slot, ...) as in
// kernels.h.
absl::StatusOr<task::ChipCallable> make_qwen3_decode_callable(
    const Qwen3Dims& dims, const Qwen3DeviceWeights& weights, const Qwen3Scratch& scratch,
    const Qwen3KvPools& kv_pools, const Qwen3ProgramOptions& options = {});

}  // namespace simpler::llm
