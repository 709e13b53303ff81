// Compute kernels of the Qwen3 programs (f32 activations, f32 weights, f32 KV cache).
//
// Every kernel is a `task::KernelFn`: it reads its task's arguments from the
// `KernelContext`, in the order documented below, and is called once per SPMD
// block (block_idx in [0, block_dim)), possibly on several core threads at
// once. A block writes only its own part of the OUT / INOUT tensors, so the
// blocks of a task, and different tasks, never write the same bytes; a kernel
// touches no memory outside its tensor arguments but its task's shared lines
// (KernelContext::task_lines: the matmuls' row claims) and per-thread caches
// whose contents never change a result (scratch buffers, RoPE's angles), so it
// is thread-safe.
//
// Tensors must be row-major contiguous with the documented dtype and shape;
// anything else is INVALID_ARGUMENT naming the kernel and the argument. Data
// errors (a token id outside the vocabulary, a slot outside the pool, a page id
// outside the pool, a context longer than its block table) are INVALID_ARGUMENT
// naming the kernel, the row and the value. Kernels read and write
// `tensor.data<T>()` directly: on the sim device a device address is a host
// pointer.
//
// Formulas follow Hugging Face transformers `modeling_qwen3.py` (Qwen3RMSNorm,
// rotate_half RoPE, eager attention with GQA, Qwen3MLP) and the Qwen3 model
// card; weights are stored [out_features, in_features] and y = W·x.
//
// `*_args` builders below produce each kernel's TaskArgs with the directions
// the runtime needs for exact dependency inference; programs should use them.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "simpler/task/callable.h"
#include "simpler/task/task_args.h"
#include "simpler/task/tensor.h"

namespace simpler::llm {

// Position of each kernel inside `llm_kernels()` (and so inside the kernel list
// of the Qwen3 callables). Names in `llm_kernels()` are the snake_case forms.
enum class KernelId : uint32_t {
  kEmbedding = 0,   // "embedding"
  kRmsNorm,         // "rms_norm"
  kMatmul,          // "matmul"
  kMatmulAcc,       // "matmul_acc"
  kRope,            // "rope"
  kKvWrite,         // "kv_write"
  kPagedAttention,  // "paged_attention"
  kSiluMul,         // "silu_mul"
  kAdd,             // "add"
  kGatherRows,      // "gather_rows"
  kArgmax,          // "argmax"
  kQkNormRopeKv,    // "qk_norm_rope_kv"
  kMatmulMerged,    // "matmul_merged"
  kMatmulSiluMul,   // "matmul_silu_mul"
  kCount,
};

// The ISA target the hot kernels run on (matmul over f32 / bf16 / f16 / q8_0 / q4_0 weights, the
// paged attention tile and its exp), picked at run time from what the CPU has:
//   kPortable  "portable"   the compiler's vector extensions on the baseline target, any CPU; no
//                           libm call per element (where the baseline has no FMA instruction,
//                           x86-64, matmul multiplies then adds: see kernel_isa_fused);
//   kX86_64V3  "x86-64-v3"  AVX2 + FMA + F16C (x86 since Haswell / Zen);
//   kAvx512    "avx512"     AVX-512 F, BW, VL and DQ (and AVX512_BF16 for precision bf16);
//   kNeon      "neon"       aarch64 Advanced SIMD with FMA (every aarch64 CPU).
// A binary holds the targets of its architecture: the x86 ones on x86-64, neon on aarch64
// (portable on every one); a target the binary does not hold is unavailable, like one the CPU
// lacks.
// kAuto picks the best one the CPU has. Matmul and the attention tile give bitwise the same
// results on every fused target (kernel_isa_fused: the 16-lane contract of matmul_impl.h, every
// multiply-add fused), so among them the choice changes speed only.
enum class KernelIsa : uint8_t { kAuto, kPortable, kX86_64V3, kAvx512, kNeon };
const char* name_of(KernelIsa isa);  // "auto", "portable", "x86-64-v3", "avx512", "neon"
// INVALID_ARGUMENT naming the value and the accepted names.
absl::StatusOr<KernelIsa> parse_kernel_isa(std::string_view name);
// Whether this CPU can run `isa` (kAuto and kPortable always can).
bool kernel_isa_available(KernelIsa isa);
// The targets this CPU can run, best first, by name: e.g. "avx512, x86-64-v3, portable".
std::string available_kernel_isas();
// What `isa` needs of the CPU, in words (e.g. "AVX2, FMA and F16C").
const char* kernel_isa_requirements(KernelIsa isa);
// kAuto resolved for this CPU (the best target it has); other values unchanged.
KernelIsa resolve_kernel_isa(KernelIsa isa);
// Whether `isa`'s matmul fuses every lane's multiply-add (kAuto resolved first), so its results
// are bitwise those of every other fused target: true for every target but kPortable in a binary
// whose baseline has no FMA instruction (x86-64). There matmul rounds each product and then its
// sum, in the same lanes, order and tree: still batch-invariant, and within the standard bound of
// such a sum, |y - Σ x·w| <= γ(⌈K/16⌉ + 5) · Σ|x·w| with γ(n) = n·2^-24 / (1 - n·2^-24)
// (Higham, "Accuracy and Stability of Numerical Algorithms", §3.1); a fused target's bound is
// γ(⌈K/16⌉ + 4). The attention tile is fused on every target. Thread-safe.
bool kernel_isa_fused(KernelIsa isa);

// The numerics of matmul / matmul_acc. kExact: f32 activations and accumulation (weights widened
// or dequantized in registers), identical on every fused ISA path (kernel_isa_fused) and batch.
// kInt8 (the default of llm_kernels, the model runner and the CLI, `--precision int8`): over
// block-quantized weights (q8_0, q4_0, q4_k, q6_k) each x row is quantized per block to int8 as
// llama.cpp does (ggml's Q8_0 for q8_0 / q4_0 weights: blocks of 32, d = amax / 127 as binary16,
// round to nearest even; Q8_K for q4_k / q6_k: blocks of 256, d = max / -127 in f32) and dotted in
// integers (AVX-512 VNNI, AVX-VNNI, AVX2 vpmaddubsw, NEON sdot, portable), the integer sums
// combined in f32 in one fixed order (src/kernels/matmul_int8.h): bitwise the same on every ISA
// path and batch-invariant, within the x quantization's error of the exact path
// (docs/design/quantized_matmul.md); f32, bf16 and f16 weights compute as kExact. Speed against
// kExact, measured per kernel on AVX-512 (the same document): several times faster over q4_k and
// q6_k weights; over q8_0 the same at one x row and slower at 16 (there kExact is the faster
// choice, for a caller that does not need llama.cpp's numerics). kBf16 (opt in,
// `--precision bf16`): over bf16 weights, activations are rounded to bf16 (round to nearest even)
// and multiplied as bf16 with f32 accumulation — fewer than 16 rows by our AVX512_BF16 streaming
// kernel, 16 rows and more by oneDNN's bf16 GEMM (AMX where the CPU and kernel allow it, else
// AVX512_BF16) — faster, with its own tolerance (logits relative L2 against the exact path measured
// and stated in docs/benchmarks.md; tokens may differ); f32, f16 and quantized weights compute as
// kExact. Not batch-invariant: a row's result can change with the number of rows it is batched
// with.
enum class Precision : uint8_t { kExact, kBf16, kInt8 };
const char* name_of(Precision precision);  // "exact", "bf16", "int8"
// INVALID_ARGUMENT naming the value and the accepted names.
absl::StatusOr<Precision> parse_precision(std::string_view name);
// Whether this CPU runs kBf16's instructions (AVX-512 F, BW, VL, DQ and BF16); without them a
// kBf16 request falls back to kExact (the model runner says so).
bool bf16_precision_available();
// The precision that runs for a request of `precision` on `isa` here: kBf16 only where the CPU
// has the instructions and `isa` is kAvx512, else kExact; kExact and kInt8 unchanged (every
// target has both).
Precision effective_precision(KernelIsa isa, Precision precision);

// Whether the matmul kernels of `isa` (resolved) at `precision` read Q4_K, Q6_K and Q8_0 weights
// fastest with their rows interleaved 16 at a time (task::DataType::kQ4_K_R16, kQ6_K_R16,
// kQ8_0_R16): kInt8 on the x86 targets (avx512 and x86-64-v3, on every set of their integer dots:
// AVX-512 VNNI, AVX-VNNI, AVX2), whose integer sums then take 8 or 16 W rows a vector
// (docs/design/quantized_matmul.md, "Row-interleaved weights"); false for an unavailable `isa`.
// The model runner stores those weights so where this holds and every matrix's row count is a
// multiple of 16. Every target and precision reads both layouts with bitwise the same results
// (the x86 int8 kernels natively; every other path copies the rows back out a group of 16 at a
// time).
bool prefers_interleaved_weights(KernelIsa isa, Precision precision);

// What precision kBf16 runs on this machine, in words for the log: our kernel's row range and
// oneDNN's implementation for batched rows (e.g. "brg:avx512_core_amx"), and, where the CPU has
// AMX but oneDNN does not use it, that the kernel did not grant it (arch_prctl
// ARCH_REQ_XCOMP_PERM, which oneDNN requests itself); "unavailable (...)" in place of the
// implementation when oneDNN refuses the probe shape. Also sets up oneDNN's process-wide state:
// call it on the thread that builds the program, before the device threads run bf16 steps.
// Thread-safe; never fails.
std::string describe_bf16_precision();

// The f32 fused-multiply-add peak of this machine in FLOP/s, measured: `threads` threads
// (0 = every hardware thread) each run independent FMA chains in registers on `isa`'s
// instructions (kAuto: the best target the CPU has, whatever target a benchmark's kernels use)
// for about `seconds`; the best of 3 passes. The denominator of the compute-bound benchmarks
// (bench prefill) is this with kAuto.
double measure_f32_fma_peak(KernelIsa isa, int threads = 0, double seconds = 0.2);

// All kernels above, in KernelId order, matmul / matmul_acc on `isa` with `precision` (kInt8:
// int8 activations over quantized weights, exact over the others). A fresh copy. With a target
// the CPU lacks, the matmul kernels fail with FAILED_PRECONDITION when they run (naming what the
// target needs); kBf16 on a CPU without AVX512_BF16, or on a target other than kAvx512, computes
// exactly.
std::vector<task::Kernel> llm_kernels(KernelIsa isa = KernelIsa::kAuto,
                                      Precision precision = Precision::kInt8);

// The half-open range [begin, end) of `n` items that SPMD block `block_idx` of
// `block_dim` owns: contiguous, in block order, sizes differing by at most one
// (blocks beyond `n` get empty ranges).
struct BlockRange {
  int64_t begin = 0;
  int64_t end = 0;
};
BlockRange block_range(int64_t n, int32_t block_idx, int32_t block_dim);

// ---- embedding --------------------------------------------------------------
// Args: 0 ids i32 [B] IN, 1 table f32 / bf16 / f16 / q8_0 / q4_0 [V, H] IN, 2 out f32 [B, H]
// OUT. out[b, :] = table[ids[b], :] (widened to f32, or for q8_0 / q4_0 dequantized, d·q per
// element: both exact). SPMD over rows of out. An id outside [0, V) is INVALID_ARGUMENT naming
// the row and the id; a q8_0 / q4_0 table whose H is not a multiple of 32 is INVALID_ARGUMENT
// naming the argument.
absl::Status embedding_kernel(const task::KernelContext& ctx);
task::TaskArgs embedding_args(const task::Tensor& ids, const task::Tensor& table,
                              const task::Tensor& out);

// ---- rms_norm ---------------------------------------------------------------
// Args: 0 x f32 [R, D] IN, 1 w f32 [D] IN, 2 out f32 [R, D] OUT, 3 eps f32 SCALAR.
// out[r, :] = x[r, :] / sqrt(mean(x[r, :]²) + eps) · w (sum of squares in f64).
// Used for hidden rows (R = B, D = hidden) and for Qwen3's per-head q/k norm
// (R = B·heads, D = head_dim). SPMD over rows. `out` must not overlap `x`.
absl::Status rms_norm_kernel(const task::KernelContext& ctx);
task::TaskArgs rms_norm_args(const task::Tensor& x, const task::Tensor& w, const task::Tensor& out,
                             float eps);

// ---- matmul / matmul_acc ----------------------------------------------------
// Args: 0 x f32 [B, in] IN, 1 W f32 / bf16 / f16 / q8_0 / q4_0 [out, in] IN, 2 y f32 [B, out] OUT
// (matmul) or INOUT (matmul_acc).
// matmul: y = x·Wᵀ; matmul_acc: y += x·Wᵀ (residual add fused into the projection that feeds
// the residual stream). W stays in its dtype in memory and is widened to f32 in registers (q8_0 and
// q4_0, ggml's block_q8_0 / block_q4_0 as task::DataType describes them: each weight dequantized
// to d·q, exact in f32, so everything below holds for the dequantized weights; `in` must be a
// multiple of 32,
// else INVALID_ARGUMENT naming W; docs/design/quantized_matmul.md); products and sums are f32
// (fused multiply-adds over 16 lanes, then a fixed reduction tree: src/kernels/matmul_impl.h). SPMD
// over output features: with the task's shared lines the blocks claim the `out` rows of W as each
// becomes free (a block starts with its block_range and takes over what the others have not
// reached: docs/design/scheduler.md), without them block b computes y[:, r) for its block_range; in
// register tiles of up to 6 rows of x by 4 rows of W over 256 KiB chunks of W (a streaming
// matrix-vector product, 8 W rows at a time, for B = 1). Batch-invariant: every element of y is the
// same sequence of f32 operations whatever the number of rows, the tile, the chunk, the block split
// or the ISA, so a row's result never depends on the other rows of its batch. `y` must not overlap
// `x` or `W`. These two are precision kExact; llm_kernels(isa, Precision::kInt8) (the default)
// returns matmuls that quantize x per block over q8_0 / q4_0 / q4_k / q6_k weights (Precision).
absl::Status matmul_kernel(const task::KernelContext& ctx);
absl::Status matmul_acc_kernel(const task::KernelContext& ctx);
task::TaskArgs matmul_args(const task::Tensor& x, const task::Tensor& w, const task::Tensor& y);
task::TaskArgs matmul_acc_args(const task::Tensor& x, const task::Tensor& w, const task::Tensor& y);

// ---- matmul_merged / matmul_silu_mul ------------------------------------------------
// Several projections of one x as one task (vLLM's QKVParallelLinear and
// MergedColumnParallelLinear, without concatenating the weights: each keeps its own tensor and
// dtype, e.g. Q4_K_M's Q4_K q/k beside a Q6_K v), so the step hands off one task instead of one
// per weight, and each block quantizes x once for each weight type among them.
//
// matmul_merged — Args: 0 x f32 [B, in] IN; 1 .. N: W_i (any dtype matmul takes) [out_i, in] IN;
// N+1 .. 2N: y_i f32 [B, out_i] OUT; N in [1, kMatmulMergedMaxWeights]. y_i = x·W_iᵀ.
// matmul_silu_mul — Args: 0 x f32 [B, in] IN, 1 W_gate [I, in] IN, 2 W_up [I, in] IN, 3 gate f32
// [B, I] OUT, 4 up f32 [B, I] OUT, 5 act f32 [B, I] OUT. gate = x·W_gateᵀ, up = x·W_upᵀ,
// act = silu(gate)·up (silu_mul's formula).
// Every element of every output is bitwise what matmul (and silu_mul) writes for it in a task of
// its own, on the same target and precision: batch-invariant as matmul, whatever the block split.
// SPMD over output features: the blocks claim rows as matmul does (over the weights' rows laid
// end to end; matmul_silu_mul: rows of I, each claim computing its gate and up rows and then
// their act columns). A wrong argument count, dtype or shape is INVALID_ARGUMENT naming the
// argument; outputs must not overlap x, the weights or each other. As for matmul,
// llm_kernels(isa, precision) picks the precision's path; these two are precision kExact.
inline constexpr uint32_t kMatmulMergedMaxWeights = 4;
absl::Status matmul_merged_kernel(const task::KernelContext& ctx);
// ws and ys of one size in [1, kMatmulMergedMaxWeights] (else the TaskArgs hold x alone, which
// the kernel refuses: INVALID_ARGUMENT naming the count).
task::TaskArgs matmul_merged_args(const task::Tensor& x, std::span<const task::Tensor> ws,
                                  std::span<const task::Tensor> ys);
absl::Status matmul_silu_mul_kernel(const task::KernelContext& ctx);
task::TaskArgs matmul_silu_mul_args(const task::Tensor& x, const task::Tensor& w_gate,
                                    const task::Tensor& w_up, const task::Tensor& gate,
                                    const task::Tensor& up, const task::Tensor& act);

// ---- rope -------------------------------------------------------------------
// Args: 0 x f32 [B, n_heads, head_dim] INOUT, 1 positions i32 [B] IN,
// 2 theta f32 SCALAR.
// Rotate-half RoPE (halves, not interleaved), d = head_dim (even):
// f_i = theta^(-2i/d), i < d/2; a = p·f_i (computed in f64);
// x'[i] = x[i]·cos a − x[i+d/2]·sin a; x'[i+d/2] = x[i+d/2]·cos a + x[i]·sin a.
// SPMD over rows b. A negative position is INVALID_ARGUMENT.
absl::Status rope_kernel(const task::KernelContext& ctx);
task::TaskArgs rope_args(const task::Tensor& x, const task::Tensor& positions, float theta);

// ---- kv_write ---------------------------------------------------------------
// Args: 0 k f32 [B, n_kv, head_dim] IN, 1 v f32 [B, n_kv, head_dim] IN,
// 2 slot_mapping i32 [B] IN, 3 k_pool f32 [num_pages, n_kv, page_size, head_dim]
// INOUT, 4 v_pool (same shape) INOUT. The pools hold each page kv head by kv head, so one kv
// head's cached positions within a page are contiguous (vLLM's paged-attention layout of a
// block; docs/design/engine.md, "The KV cache layout").
// For each row b with slot s = slot_mapping[b] >= 0 (s = page·page_size + offset) and kv head
// g: k_pool[page, g, offset] = k[b, g], v_pool[page, g, offset] = v[b, g]. A slot < 0
// skips the row (padding). A slot >= num_pages·page_size is INVALID_ARGUMENT.
// Single block (block_dim 1) is the intended use; with more blocks each block
// writes the rows of its block_range. Two rows naming one slot: the later row wins.
absl::Status kv_write_kernel(const task::KernelContext& ctx);
// Where k_pool[page, kv_head, offset] (or v_pool's) starts in a pool of the layout above, in
// floats from the pool's start: the one formula of that layout (kv_write, qk_norm_rope_kv,
// paged_attention and readers of a pool use it). Arguments unchecked: page in [0, num_pages),
// kv_head in [0, n_kv), offset in [0, page_size).
constexpr int64_t kv_pool_offset(int64_t page, int64_t kv_head, int64_t offset, int64_t n_kv,
                                 int64_t page_size, int64_t head_dim) {
  return ((page * n_kv + kv_head) * page_size + offset) * head_dim;
}
task::TaskArgs kv_write_args(const task::Tensor& k, const task::Tensor& v,
                             const task::Tensor& slot_mapping, const task::Tensor& k_pool,
                             const task::Tensor& v_pool);

// ---- qk_norm_rope_kv -----------------------------------------------------------
// Qwen3's per-head q and k RMSNorm, RoPE on both and the KV-cache write of one step's tokens,
// in one task (the decode program's; Qwen3 model card: q_norm / k_norm before the rotation).
// Args: 0 q f32 [B, n_heads, head_dim] IN, 1 k f32 [B, n_kv, head_dim] IN, 2 v f32
// [B, n_kv, head_dim] IN (the projections), 3 q_norm f32 [head_dim] IN, 4 k_norm f32
// [head_dim] IN, 5 positions i32 [B] IN, 6 slot_mapping i32 [B] IN, 7 q_out f32
// [B, n_heads, head_dim] OUT, 8 k_out f32 [B, n_kv, head_dim] OUT, 9 k_pool f32
// [num_pages, n_kv, page_size, head_dim] INOUT, 10 v_pool (same shape) INOUT, 11 eps f32 SCALAR,
// 12 theta f32 SCALAR.
// Per row b: q_out[b, h] = rope(rms_norm(q[b, h], q_norm), positions[b]) for every head h, k_out
// likewise with k_norm, then, as kv_write, k_pool and v_pool at slot slot_mapping[b] get
// k_out[b] and v[b] (a slot < 0 skips the write). The values are bitwise what rms_norm, rope
// and kv_write give in sequence (one definition of their row arithmetic). SPMD over rows b.
// INVALID_ARGUMENT for an odd head_dim, theta <= 0, a negative position or a slot >=
// num_pages·page_size, with rope's and kv_write's messages (the rows before the bad one are
// done; the run fails).
absl::Status qk_norm_rope_kv_kernel(const task::KernelContext& ctx);
// Its tensor arguments 0-10 in order (views into device memory; qk_norm_rope_kv_args copies
// them into the TaskArgs, as every *_args does).
struct QkNormRopeKvTensors {
  task::Tensor q, k, v, q_norm, k_norm, positions, slot_mapping, q_out, k_out, k_pool, v_pool;
};
task::TaskArgs qk_norm_rope_kv_args(const QkNormRopeKvTensors& t, float eps, float theta);

// ---- paged_attention ----------------------------------------------------------
// Args: 0 q f32 [B, n_heads, head_dim] IN, 1 k_pool f32 [num_pages, n_kv,
// page_size, head_dim] IN (kv_write's layout), 2 v_pool (same shape) IN, 3 block_tables i32
// [B, max_blocks] IN, 4 context_lens i32 [B] IN, 5 out f32 [B, n_heads·head_dim]
// OUT, 6 scale f32 SCALAR (Qwen3: 1/sqrt(head_dim)).
// Decode attention of one query token per row over its paged KV cache: row b
// attends positions t in [0, context_lens[b]) (the current token's K/V already
// written), token t living at page block_tables[b, t / page_size], offset
// t % page_size. GQA: query head h reads KV head h / (n_heads / n_kv).
// out[b, h·d:(h+1)·d] = Σ_t softmax_t(scale·q_h·k_t) v_t, a numerically stable
// online softmax in f32. A context length of 0 gives zeros (padding rows).
// SPMD over (kv head, row) pairs, pair = g·B + b: with the task's shared lines the blocks claim
// pairs as each becomes free (as matmul's rows), without them block_range splits them; a row's
// result is the same whoever computes it.
// INVALID_ARGUMENT for a negative context length, one above
// max_blocks·page_size, or a page id outside [0, num_pages) among the pages
// the row reads (entries past the context are never read, so -1 padding is fine): every row is
// checked before any output is written, and the lowest bad row is named.
absl::Status paged_attention_kernel(const task::KernelContext& ctx);
task::TaskArgs paged_attention_args(const task::Tensor& q, const task::Tensor& k_pool,
                                    const task::Tensor& v_pool, const task::Tensor& block_tables,
                                    const task::Tensor& context_lens, const task::Tensor& out,
                                    float scale);

// ---- silu_mul -----------------------------------------------------------------
// Args: 0 gate f32 [B, I] IN, 1 up f32 [B, I] IN, 2 out f32 [B, I] OUT.
// out = silu(gate)·up, silu(g) = g / (1 + exp(-g)). SPMD over elements.
absl::Status silu_mul_kernel(const task::KernelContext& ctx);
task::TaskArgs silu_mul_args(const task::Tensor& gate, const task::Tensor& up,
                             const task::Tensor& out);

// ---- add ----------------------------------------------------------------------
// Args: 0 a f32 IN, 1 b f32 IN, 2 out f32 OUT, all of one shape (any rank).
// out = a + b. SPMD over elements. (The Qwen3 program fuses its residual adds
// into matmul_acc; this kernel is for programs that do not.)
absl::Status add_kernel(const task::KernelContext& ctx);
task::TaskArgs add_args(const task::Tensor& a, const task::Tensor& b, const task::Tensor& out);

// ---- gather_rows ----------------------------------------------------------------
// Args: 0 x f32 [B, H] IN, 1 rows i32 [n] IN, 2 out f32 [n, H] OUT.
// out[j, :] = x[rows[j], :]; a row outside [0, B) is INVALID_ARGUMENT. Single
// block intended; SPMD over output rows works.
absl::Status gather_rows_kernel(const task::KernelContext& ctx);
task::TaskArgs gather_rows_args(const task::Tensor& x, const task::Tensor& rows,
                                const task::Tensor& out);

// ---- argmax ---------------------------------------------------------------------
// Args: 0 logits f32 [n, V] IN, 1 ids i32 [n] OUT.
// ids[j] = the lowest index of the largest value of logits[j, :] (greedy
// sampling; NaN is never selected, an all-NaN or all -inf row gives 0). V must
// be >= 1. SPMD over rows by block_range. Every target gives the same ids (llm_kernels(isa)'s
// entry; the x86 targets find the row's maximum in AVX2 vectors, then its first index); this one
// runs on the best target of this CPU (KernelIsa::kAuto).
absl::Status argmax_kernel(const task::KernelContext& ctx);
task::TaskArgs argmax_args(const task::Tensor& logits, const task::Tensor& ids);

}  // namespace simpler::llm
