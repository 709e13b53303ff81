#include "engine/model_runner.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <functional>
#include <optional>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "engine/kv_cache.h"
#include "engine/weight_upload.h"
#include "simpler/base/clock.h"
#include "simpler/base/log.h"
#include "simpler/base/status.h"
#include "simpler/base/thread.h"
#include "simpler/kernels/kernels.h"
#include "simpler/model/gguf.h"
#include "simpler/model/safetensors.h"

namespace simpler::llm {

using task::ArgDirection;
using task::DataType;
using task::MemoryKind;
using task::Tensor;

// What one chip holds for the step program, built on that chip's worker (load_chip_state):
// by create() for a runner with its own worker, by the child setup on an L3 child.
struct ChipState {
  bool ready = false;
  std::vector<worker::DeviceBuffer> buffers;  // weights and scratch
  worker::DeviceBuffer kv_buffer, feed_ids, argmax_ids, last_ids, counts;
  Qwen3Scratch scratch;
  Qwen3KvPools kv_pools;
  task::ChipCallable decode;  // the decode program over this chip's weights, scratch and pool
  int64_t max_num_seqs = 0, vocab_size = 0;

  std::vector<worker::DeviceBuffer> all_buffers() const {
    std::vector<worker::DeviceBuffer> out = buffers;
    for (const worker::DeviceBuffer& b : {feed_ids, argmax_ids, last_ids, counts, kv_buffer}) {
      out.push_back(b);
    }
    return out;
  }
};

// The step callable is registered before the worker's init (with its kernel table) and reads
// the chip's state, filled after init, through this holder: one state per chip (a process
// child fills only its own copy).
struct Qwen3ModelRunner::Holder {
  std::vector<ChipState> chips;
};

namespace {

// Step run arguments (host tensors only; see the header comment for the task order):
//   0 host_ids      i32 [B]     IN     token of prefill positions (known on the host)
//   1 src_slots     i32 [B]     IN     >= 0: take the token from last_ids[src_slots[i]]
//   2 clear_slots   i32 [c0]    IN     slots handed to a new request: cleared first
//   3 prompt_ids    i32 [c1]    IN     committed kPrompt ...
//   4 prompt_slots  i32 [c1]    IN     ... into these slots
//   5 gen_ids       i32 [c2]    IN     committed kGenerated (kept outputs on recompute) ...
//   6 gen_slots     i32 [c2]    IN     ... into these slots
//   7 params        u8  [ns, sizeof(SamplingParams)] IN    (ns = 0: no device sampling)
//   8 sample_rows   i32 [ns, 4] IN     SampleRowInfo
//   9 sample_slots  i32 [ns]    IN     state slot of each logit row
//  10 out_ids       i32 [ns]    OUT    sampled ids
//  11 out_logprobs  f32 [ns]    OUT
//  12 top_ids       i32 [ns, kMaxLogprobs] OUT
//  13 top_logprobs  f32 [ns, kMaxLogprobs] OUT
//  14 positions     i32 [B]     IN     the decode program's (qwen3_program.h) ...
//  15 slot_mapping  i32 [B]     IN
//  16 block_tables  i32 [B, max_blocks] IN
//  17 context_lens  i32 [B]     IN
//  18 logit_rows    i32 [n]     IN
//  19 out_logits    f32 [n, V]  OUT    read back; [0] when not (the chip's scratch then)
//  20 mask          i32 [nm, W]  IN    token masks (W = mask_words(V)); nm = ns when a logit row
//                                      is masked (SamplingParams::masked), else 0
//  21 score_ids     i32 [np]    IN     prompt positions scored: the token each scores ...
//  22 score_k       i32 [np]    IN     ... and its top alternatives; their logits are the last
//                                      np of the n logit rows (StepRow::prompt_logits)
//  23 score_logprobs     f32 [np] OUT
//  24 score_top_ids      i32 [np, kMaxLogprobs] OUT
//  25 score_top_logprobs f32 [np, kMaxLogprobs] OUT
//  26 chip          scalar             the chip state's index (the L3 child)
// The chip's state supplies the rest: last_ids and counts (INOUT), the decode program's
// input_ids (token_feedback's output) and out_ids, and its logits scratch.
enum StepArg : size_t {
  kHostIds = 0,
  kSrcSlots,
  kClearSlots,
  kPromptIds,
  kPromptSlots,
  kGenIds,
  kGenSlots,
  kParams,
  kSampleRows,
  kSampleSlots,
  kOutIds,
  kOutLogprobs,
  kTopIds,
  kTopLogprobs,
  kPositions,
  kSlotMapping,
  kBlockTables,
  kContextLens,
  kLogitRows,
  kOutLogits,
  kMask,
  kScoreIds,
  kScoreK,
  kScoreLogprobs,
  kScoreTopIds,
  kScoreTopLogprobs,
  kChip,
  kNumStepArgs,
};

// input_ids[i] = src[i] >= 0 ? last_ids[src[i]] : host[i].
// args: 0 host_ids IN, 1 src_slots IN, 2 last_ids IN, 3 input_ids OUT.
absl::Status token_feedback_kernel(const task::KernelContext& ctx) {
  const int32_t* host = ctx.tensor(0).data<int32_t>();
  const int32_t* src = ctx.tensor(1).data<int32_t>();
  const Tensor& last = ctx.tensor(2);
  int32_t* out = ctx.tensor(3).data<int32_t>();
  const int64_t rows = ctx.tensor(3).shape[0];
  for (int64_t i = 0; i < rows; ++i) {
    if (src[i] >= last.shape[0]) {
      return absl::InvalidArgumentError(
          absl::StrCat("token_feedback: row ", i, " reads slot ", src[i], " of ", last.shape[0]));
    }
    out[i] = src[i] >= 0 ? last.data<int32_t>()[src[i]] : host[i];
  }
  return absl::OkStatus();
}

// last_ids[slots[j]] = ids[j]. args: 0 ids IN [n], 1 slots IN [n], 2 last_ids INOUT [S].
absl::Status token_scatter_kernel(const task::KernelContext& ctx) {
  const int64_t n = ctx.tensor(0).shape[0];
  const int32_t* ids = ctx.tensor(0).data<int32_t>();
  const int32_t* slots = ctx.tensor(1).data<int32_t>();
  const Tensor& last = ctx.tensor(2);
  for (int64_t j = 0; j < n; ++j) {
    if (slots[j] < 0) continue;
    if (slots[j] >= last.shape[0]) {
      return absl::InvalidArgumentError(absl::StrCat("token_scatter: entry ", j, " writes slot ",
                                                     slots[j], " of ", last.shape[0]));
    }
    last.data<int32_t>()[slots[j]] = ids[j];
  }
  return absl::OkStatus();
}

// Prompt logprobs: row r is score_row(logits[r], V, ids[r], k[r]) (sampling.h). SPMD over rows.
// args: 0 logits f32 [np, V] IN, 1 ids i32 [np] IN, 2 k i32 [np] IN, 3 logprobs f32 [np] OUT,
// 4 top_ids i32 [np, kMaxLogprobs] OUT, 5 top_logprobs f32 [np, kMaxLogprobs] OUT.
absl::Status prompt_logprobs_kernel(const task::KernelContext& ctx) {
  const Tensor& logits = ctx.tensor(0);
  const int64_t V = logits.shape[1];
  const int32_t* ids = ctx.tensor(1).data<int32_t>();
  const int32_t* k = ctx.tensor(2).data<int32_t>();
  const BlockRange br = block_range(logits.shape[0], ctx.block_idx, ctx.block_dim);
  for (int64_t r = br.begin; r < br.end; ++r) {
    if (ids[r] < 0 || ids[r] >= V || k[r] < 0 || k[r] > kMaxLogprobs) {
      return absl::InvalidArgumentError(absl::StrCat("prompt_logprobs: row ", r, " scores token ",
                                                     ids[r], " with ", k[r],
                                                     " alternatives; the vocabulary has ", V));
    }
    const SampleResult s = score_row(logits.data<float>() + r * V, V, ids[r], k[r]);
    ctx.tensor(3).data<float>()[r] = s.logprob;
    std::copy(std::begin(s.top_ids), std::end(s.top_ids),
              ctx.tensor(4).data<int32_t>() + r * kMaxLogprobs);
    std::copy(std::begin(s.top_logprobs), std::end(s.top_logprobs),
              ctx.tensor(5).data<float>() + r * kMaxLogprobs);
  }
  return absl::OkStatus();
}

// Kernel indices relative to the end of llm_kernels().
enum ExtraKernel : uint32_t {
  kTokenCounts = 0,
  kSample,
  kTokenFeedback,
  kTokenScatter,
  kPromptLogprobs
};

std::vector<task::Kernel> step_kernels(KernelIsa isa, Precision precision) {
  std::vector<task::Kernel> k = llm_kernels(isa, precision);
  for (task::Kernel& s : sampling_kernels()) k.push_back(std::move(s));  // token_counts, sample
  k.push_back({"token_feedback", token_feedback_kernel});
  k.push_back({"token_scatter", token_scatter_kernel});
  k.push_back({"prompt_logprobs", prompt_logprobs_kernel});
  return k;
}

// Rows [from, from + rows) of the logits [n, V] (a contiguous view).
absl::StatusOr<Tensor> logit_rows_view(const Tensor& logits, int64_t from, int64_t rows) {
  const int64_t V = logits.shape[1];
  return Tensor::contiguous(logits.address + static_cast<uint64_t>(from * V) * sizeof(float),
                            {rows, V}, DataType::kFloat32, logits.memory);
}

// The sample task's arguments (the first ns logit rows): with the mask argument when the step
// carries masks.
absl::StatusOr<task::TaskArgs> sample_task_args(const task::TaskArgs& program,
                                                const task::TaskArgs& args, const Tensor& counts) {
  SIMPLER_ASSIGN_OR_RETURN(const Tensor logits, logit_rows_view(program.tensor(kQwen3OutLogits), 0,
                                                                args.tensor(kOutIds).numel()));
  if (args.tensor(kMask).numel() > 0) {
    return sample_args(logits, args.tensor(kParams), args.tensor(kSampleRows), counts,
                       args.tensor(kOutIds), args.tensor(kOutLogprobs), args.tensor(kTopIds),
                       args.tensor(kTopLogprobs), args.tensor(kMask));
  }
  return sample_args(logits, args.tensor(kParams), args.tensor(kSampleRows), counts,
                     args.tensor(kOutIds), args.tensor(kOutLogprobs), args.tensor(kTopIds),
                     args.tensor(kTopLogprobs));
}

// The step program's arguments are the kNumStepArgs of StepArg, on a chip and through L3 alike.
absl::Status check_step_arg_count(const task::TaskArgs& args) {
  if (args.size() == kNumStepArgs) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("qwen3_step takes ", kNumStepArgs, " arguments, got ", args.size()));
}

// The prompt_logprobs task over the last np logit rows, when the step scores prompt positions.
absl::Status submit_prompt_logprobs(task::OrchestrationContext& ctx, task::KernelIndex base,
                                    const task::TaskArgs& program, const task::TaskArgs& args) {
  const int64_t np = args.tensor(kScoreIds).numel();
  if (np == 0) return absl::OkStatus();
  const Tensor& logits = program.tensor(kQwen3OutLogits);
  SIMPLER_ASSIGN_OR_RETURN(const Tensor scored, logit_rows_view(logits, logits.shape[0] - np, np));
  task::TaskArgs a;
  a.add_tensor(scored, ArgDirection::kIn)
      .add_tensor(args.tensor(kScoreIds), ArgDirection::kIn)
      .add_tensor(args.tensor(kScoreK), ArgDirection::kIn)
      .add_tensor(args.tensor(kScoreLogprobs), ArgDirection::kOut)
      .add_tensor(args.tensor(kScoreTopIds), ArgDirection::kOut)
      .add_tensor(args.tensor(kScoreTopLogprobs), ArgDirection::kOut);
  return ctx.submit(base + kPromptLogprobs, a,
                    static_cast<int32_t>(std::clamp<int64_t>(np, 1, 64)));
}

absl::Status orchestrate_step(const Qwen3ModelRunner::Holder& holder,
                              task::OrchestrationContext& ctx, const task::TaskArgs& args) {
  SIMPLER_RETURN_IF_ERROR(check_step_arg_count(args));
  const int64_t chip = args.scalar(kChip);
  if (chip < 0 || chip >= static_cast<int64_t>(holder.chips.size()) || !holder.chips[chip].ready) {
    return absl::FailedPreconditionError(
        absl::StrCat("qwen3_step: chip ", chip, " has no model loaded here"));
  }
  const ChipState& c = holder.chips[chip];
  const task::ChipCallable& decode = c.decode;
  const auto base = static_cast<task::KernelIndex>(decode.kernels.size());
  const int64_t S = c.max_num_seqs, V = c.vocab_size;
  SIMPLER_ASSIGN_OR_RETURN(const Tensor counts, c.counts.tensor({S, V}, DataType::kInt32));
  SIMPLER_ASSIGN_OR_RETURN(const Tensor last_ids, c.last_ids.tensor({S}, DataType::kInt32));
  if (args.tensor(kClearSlots).numel() > 0) {
    SIMPLER_RETURN_IF_ERROR(ctx.submit(
        base + kTokenCounts, token_counts_args(args.tensor(kClearSlots), args.tensor(kClearSlots),
                                               counts, TokenCountsMode::kClear)));
  }
  if (args.tensor(kPromptIds).numel() > 0) {
    SIMPLER_RETURN_IF_ERROR(ctx.submit(
        base + kTokenCounts, token_counts_args(args.tensor(kPromptIds), args.tensor(kPromptSlots),
                                               counts, TokenCountsMode::kPrompt)));
  }
  if (args.tensor(kGenIds).numel() > 0) {
    SIMPLER_RETURN_IF_ERROR(ctx.submit(
        base + kTokenCounts, token_counts_args(args.tensor(kGenIds), args.tensor(kGenSlots), counts,
                                               TokenCountsMode::kGenerated)));
  }
  const int64_t B = args.tensor(kPositions).numel();
  const int64_t n = args.tensor(kLogitRows).numel();
  Qwen3DecodeRunArgs ra;
  SIMPLER_ASSIGN_OR_RETURN(ra.input_ids, c.feed_ids.tensor({B}, DataType::kInt32));
  ra.positions = args.tensor(kPositions);
  ra.slot_mapping = args.tensor(kSlotMapping);
  ra.block_tables = args.tensor(kBlockTables);
  ra.context_lens = args.tensor(kContextLens);
  ra.logit_rows = args.tensor(kLogitRows);
  SIMPLER_ASSIGN_OR_RETURN(ra.out_ids, c.argmax_ids.tensor({n}, DataType::kInt32));
  if (args.tensor(kOutLogits).numel() > 0) {
    ra.out_logits = args.tensor(kOutLogits);
  } else {
    SIMPLER_ASSIGN_OR_RETURN(
        ra.out_logits, Tensor::contiguous(c.scratch.logits.address, {n, V}, DataType::kFloat32,
                                          MemoryKind::kDevice));
  }
  const task::TaskArgs program = ra.to_task_args();
  task::TaskArgs fb;
  fb.add_tensor(args.tensor(kHostIds), ArgDirection::kIn)
      .add_tensor(args.tensor(kSrcSlots), ArgDirection::kIn)
      .add_tensor(last_ids, ArgDirection::kIn)
      .add_tensor(program.tensor(kQwen3InputIds), ArgDirection::kOut);
  SIMPLER_RETURN_IF_ERROR(ctx.submit(base + kTokenFeedback, fb));
  SIMPLER_RETURN_IF_ERROR(decode.orchestration(ctx, program));
  SIMPLER_RETURN_IF_ERROR(submit_prompt_logprobs(ctx, base, program, args));
  const Tensor& out_ids = args.tensor(kOutIds);
  const int64_t ns = out_ids.numel();
  if (ns == 0) return absl::OkStatus();  // no logit rows, or host sampling
  const int32_t blocks = static_cast<int32_t>(std::clamp<int64_t>(ns, 1, 64));
  SIMPLER_ASSIGN_OR_RETURN(task::TaskArgs sample, sample_task_args(program, args, counts));
  SIMPLER_RETURN_IF_ERROR(ctx.submit(base + kSample, sample, blocks));
  SIMPLER_RETURN_IF_ERROR(ctx.submit(
      base + kTokenCounts,
      token_counts_args(out_ids, args.tensor(kSampleSlots), counts, TokenCountsMode::kGenerated)));
  task::TaskArgs scatter;
  scatter.add_tensor(out_ids, ArgDirection::kIn)
      .add_tensor(args.tensor(kSampleSlots), ArgDirection::kIn)
      .add_tensor(last_ids, ArgDirection::kInOut);
  return ctx.submit(base + kTokenScatter, scatter);
}

task::ChipCallable step_callable(std::shared_ptr<const Qwen3ModelRunner::Holder> holder,
                                 KernelIsa isa, Precision precision) {
  return task::ChipCallable{"qwen3_step",
                            [holder](task::OrchestrationContext& ctx, const task::TaskArgs& args) {
                              return orchestrate_step(*holder, ctx, args);
                            },
                            step_kernels(isa, precision)};
}

// The host math of token_counts_kernel for one entry.
void apply_count(std::vector<int32_t>& counts, int32_t id, TokenCountsMode mode) {
  if (mode == TokenCountsMode::kPrompt) counts[id] |= 1;
  if (mode == TokenCountsMode::kGenerated) counts[id] += 2;
}

}  // namespace

namespace {

absl::Status validate_runner_options(const RunnerOptions& options) {
  SIMPLER_RETURN_IF_ERROR(base::require_positive({
      {"page_size", options.page_size},
      {"num_pages", options.num_pages},
      {"max_num_seqs", options.max_num_seqs},
      {"max_num_batched_tokens", options.max_num_batched_tokens},
  }));
  if (options.max_num_batched_tokens < options.max_num_seqs) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_num_batched_tokens ", options.max_num_batched_tokens, " is below max_num_seqs ",
        options.max_num_seqs, ": a step could not hold one decode row of every running request"));
  }
  if (!kernel_isa_available(options.kernel_isa)) {
    return absl::FailedPreconditionError(
        absl::StrCat("kernel ISA ", name_of(options.kernel_isa), " needs ",
                     kernel_isa_requirements(options.kernel_isa), ", which this CPU lacks (it has ",
                     available_kernel_isas(), ")"));
  }
  return absl::OkStatus();
}

// The options a runner runs with: precision bf16 falls back to exact (said in the log) where the
// CPU lacks AVX512_BF16 or the portable ISA was asked for.
RunnerOptions effective_options(const RunnerOptions& options) {
  RunnerOptions o = options;
  if (effective_precision(o.kernel_isa, o.precision) != o.precision) {
    SIMPLER_LOG_WARN(
        "precision bf16 needs AVX-512 BF16 and the avx512 kernels ({}); running the exact path",
        bf16_precision_available() ? "another kernel ISA was asked" : "this CPU lacks them");
    o.precision = Precision::kExact;
  }
  return o;
}

// How a weight sits in device memory: 2-D weights (projections, embeddings) in their checkpoint
// dtype (f32, bf16, f16, or a block dtype, q8_0, q4_0, q4_k, q6_k: blocks as in the file), the
// rest (norm vectors) widened to f32.
bool kept_in_checkpoint_dtype(const TensorView& view, const std::vector<int64_t>& shape) {
  return shape.size() == 2 &&
         (view.dtype == DataType::kFloat32 || view.dtype == DataType::kBFloat16 ||
          view.dtype == DataType::kFloat16 || task::block_elements(view.dtype) > 1);
}

// Byte alignment of each weight in the chip's weights buffer (a cache line; the buffer itself is
// 2 MiB-aligned by the sim device).
constexpr uint64_t kWeightAlignment = 64;

// Every weight of the decode program (shapes and dtypes checked by ModelWeights::get), its
// target in `wt` (whose layers are sized here), its device dtype (with `interleave`, Q4_K, Q6_K
// and Q8_0 weights as kQ4_K_R16, kQ6_K_R16, kQ8_0_R16), in the order of its bytes
// in the checkpoint (the copy then reads the files front to back), each at a
// kWeightAlignment-aligned offset of one buffer; `total` is that buffer's size.
absl::StatusOr<std::vector<WeightSlot>> plan_weights(const ModelWeights& weights,
                                                     const Qwen3Dims& d, Qwen3DeviceWeights& wt,
                                                     bool interleave, uint64_t* total) {
  const int64_t H = d.hidden_size, I = d.intermediate_size, V = d.vocab_size;
  // A task that runs several weights (q/k/v, gate/up) claims whole groups of rows of all of them
  // once one is interleaved: every matrix's rows are whole groups, or none is interleaved.
  for (int64_t rows : {H, I, V, d.q_size(), d.kv_size()}) {
    interleave = interleave && rows % task::kInterleavedRows == 0;
  }
  std::vector<WeightSlot> slots;
  auto add = [&](const std::string& name, std::vector<int64_t> shape,
                 Tensor* target) -> absl::Status {
    SIMPLER_ASSIGN_OR_RETURN(TensorView view, weights.get(name, shape));
    WeightSlot s{target, std::move(shape), view};
    s.raw = kept_in_checkpoint_dtype(view, s.shape);
    s.bytes = s.raw ? view.bytes.size() : static_cast<uint64_t>(view.numel()) * 4;
    s.dtype = view.dtype;
    if (s.raw && interleave) s.dtype = task::interleaved_of(view.dtype);
    slots.push_back(std::move(s));
    return absl::OkStatus();
  };
  wt.layers.resize(d.num_hidden_layers);
  SIMPLER_RETURN_IF_ERROR(add("model.embed_tokens.weight", {V, H}, &wt.embed_tokens));
  for (int64_t l = 0; l < d.num_hidden_layers; ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".");
    Qwen3LayerWeights& lw = wt.layers[l];
    for (auto [name, shape, target] :
         std::initializer_list<std::tuple<const char*, std::vector<int64_t>, Tensor*>>{
             {"input_layernorm.weight", {H}, &lw.input_layernorm},
             {"self_attn.q_proj.weight", {d.q_size(), H}, &lw.q_proj},
             {"self_attn.k_proj.weight", {d.kv_size(), H}, &lw.k_proj},
             {"self_attn.v_proj.weight", {d.kv_size(), H}, &lw.v_proj},
             {"self_attn.o_proj.weight", {H, d.q_size()}, &lw.o_proj},
             {"self_attn.q_norm.weight", {d.head_dim}, &lw.q_norm},
             {"self_attn.k_norm.weight", {d.head_dim}, &lw.k_norm},
             {"post_attention_layernorm.weight", {H}, &lw.post_attention_layernorm},
             {"mlp.gate_proj.weight", {I, H}, &lw.gate_proj},
             {"mlp.up_proj.weight", {I, H}, &lw.up_proj},
             {"mlp.down_proj.weight", {H, I}, &lw.down_proj}}) {
      SIMPLER_RETURN_IF_ERROR(add(p + name, std::move(shape), target));
    }
  }
  SIMPLER_RETURN_IF_ERROR(add("model.norm.weight", {H}, &wt.norm));
  if (!d.tie_word_embeddings) SIMPLER_RETURN_IF_ERROR(add("lm_head.weight", {V, H}, &wt.lm_head));
  std::stable_sort(slots.begin(), slots.end(), [](const WeightSlot& a, const WeightSlot& b) {
    return std::less<const std::byte*>()(a.view.bytes.data(), b.view.bytes.data());
  });
  uint64_t offset = 0;
  for (WeightSlot& s : slots) {
    s.offset = (offset + kWeightAlignment - 1) / kWeightAlignment * kWeightAlignment;
    offset = s.offset + s.bytes;
  }
  *total = std::max<uint64_t>(offset, 1);
  return slots;
}

// Loads the model onto a chip: the weights of `weights` (projections and embeddings in their
// checkpoint dtype, read from the file into one device buffer; norm vectors widened to f32),
// scratch, the KV pool, token counts and last ids, and the decode program over them. Runs where the
// chip's worker is (an L3 child's setup runs it in the child).
absl::Status load_chip_state(worker::Worker& w, const ModelWeights& weights,
                             const RunnerOptions& options, const Qwen3Dims& d, ChipState* c) {
  if (options.precision == Precision::kBf16) {
    // Also sets up oneDNN here, before the device threads run the first bf16 step.
    SIMPLER_LOG_INFO("precision bf16: {}", describe_bf16_precision());
  }
  const int64_t V = d.vocab_size;
  Qwen3DeviceWeights wt;
  SIMPLER_LOG_INFO("loading {} layers from {}", d.num_hidden_layers, weights.dir());
  uint64_t weight_bytes = 0;
  SIMPLER_ASSIGN_OR_RETURN(
      const std::vector<WeightSlot> slots,
      plan_weights(weights, d, wt,
                   prefers_interleaved_weights(options.kernel_isa, options.precision),
                   &weight_bytes));
  SIMPLER_RETURN_IF_ERROR(upload_weights(w, slots, weight_bytes, &c->buffers));
  const int64_t max_rows = options.max_num_batched_tokens;
  const int64_t seqs = options.max_num_seqs;
  SIMPLER_ASSIGN_OR_RETURN(uint64_t scratch_bytes, qwen3_scratch_bytes(d, max_rows, seqs));
  SIMPLER_ASSIGN_OR_RETURN(worker::DeviceBuffer scratch_buf, w.malloc(scratch_bytes));
  c->buffers.push_back(scratch_buf);
  SIMPLER_ASSIGN_OR_RETURN(c->scratch, layout_scratch(d, max_rows, scratch_buf.address, seqs));
  SIMPLER_ASSIGN_OR_RETURN(c->feed_ids, w.malloc(max_rows * 4));
  SIMPLER_ASSIGN_OR_RETURN(c->argmax_ids, w.malloc(seqs * 4));
  SIMPLER_ASSIGN_OR_RETURN(c->last_ids, w.malloc(seqs * 4));
  SIMPLER_ASSIGN_OR_RETURN(c->counts, w.malloc(static_cast<uint64_t>(seqs) * V * 4));
  SIMPLER_ASSIGN_OR_RETURN(uint64_t kv_bytes,
                           qwen3_kv_pool_bytes(d, options.num_pages, options.page_size));
  SIMPLER_ASSIGN_OR_RETURN(c->kv_buffer, w.malloc(kv_bytes));
  SIMPLER_ASSIGN_OR_RETURN(
      c->kv_pools, layout_kv_pools(d, options.num_pages, options.page_size, c->kv_buffer.address));
  Qwen3ProgramOptions popts;
  popts.argmax = false;  // the step program samples from the logits
  popts.kernel_isa = options.kernel_isa;
  popts.precision = options.precision;
  SIMPLER_ASSIGN_OR_RETURN(c->decode,
                           make_qwen3_decode_callable(d, wt, c->scratch, c->kv_pools, popts));
  if (c->decode.kernels.size() != llm_kernels().size()) {
    return absl::InternalError("decode program kernel table differs from llm_kernels()");
  }
  c->max_num_seqs = seqs;
  c->vocab_size = V;
  c->ready = true;
  return absl::OkStatus();
}

}  // namespace

StepInFlight::~StepInFlight() {
  // The run stages into the vectors above (or the shared-heap buffer): they must outlive it.
  if (handle_.valid()) (void)handle_.wait();
  if (release_staging_) release_staging_();
}

absl::StatusOr<ModelWeights> Qwen3ModelRunner::load_model_info(const std::string& model_dir) {
  // A GGUF file is parsed once, for the config and the weights.
  std::optional<GgufFile> gguf;
  if (is_gguf_path(model_dir)) {
    SIMPLER_ASSIGN_OR_RETURN(gguf, GgufFile::open(model_dir));
    SIMPLER_ASSIGN_OR_RETURN(config_, ModelConfig::from_gguf(*gguf));
  } else {
    SIMPLER_ASSIGN_OR_RETURN(config_, ModelConfig::load(model_dir));
  }
  dims_ = Qwen3Dims::from_config(config_);
  // Where the configuration came from, for messages: the GGUF file or the directory's config.json.
  const std::string source = gguf ? model_dir : model_dir + "/config.json";
  SIMPLER_RETURN_IF_ERROR(base::annotate(dims_.validate(), absl::StrCat(source, ": ")));
  SIMPLER_ASSIGN_OR_RETURN(ModelWeights weights, gguf ? ModelWeights::from_gguf(std::move(*gguf))
                                                      : ModelWeights::open(model_dir));
  std::set<std::string, std::less<>> expected;
  for (const WeightSpec& spec : config_.tensor_names_and_shapes()) expected.insert(spec.name);
  SIMPLER_RETURN_IF_ERROR(weights.check_tensor_set(
      expected,
      absl::StrCat(source, " (num_hidden_layers ", config_.num_hidden_layers,
                   ", tie_word_embeddings ", config_.tie_word_embeddings ? "true" : "false", ")"),
      options_.allow_unused_tensors));
  // Bytes a step streams: every weight as it sits in device memory (kept_in_checkpoint_dtype),
  // but the embedding table only when it is also the LM head (a step reads one row of it
  // otherwise).
  uint64_t streamed = 0;
  for (const WeightSpec& spec : config_.tensor_names_and_shapes()) {
    if (spec.name == "model.embed_tokens.weight" && !config_.tie_word_embeddings) continue;
    SIMPLER_ASSIGN_OR_RETURN(TensorView view, weights.get(spec.name, spec.shape));
    uint64_t numel = 1;
    for (int64_t e : spec.shape) numel *= static_cast<uint64_t>(e);
    streamed += kept_in_checkpoint_dtype(view, spec.shape) ? view.bytes.size() : numel * 4;
  }
  weight_bytes_per_step_ = streamed;
  return weights;
}

void Qwen3ModelRunner::init_host_sampling() {
  if (!options_.host_sampling) return;
  host_counts_.resize(options_.max_num_seqs);
  host_last_ids_.assign(options_.max_num_seqs, 0);
}

absl::StatusOr<std::unique_ptr<Qwen3ModelRunner>> Qwen3ModelRunner::create(
    const std::string& model_dir, const RunnerOptions& options) {
  SIMPLER_RETURN_IF_ERROR(validate_runner_options(options));
  std::unique_ptr<Qwen3ModelRunner> r(new Qwen3ModelRunner());
  r->options_ = effective_options(options);
  SIMPLER_ASSIGN_OR_RETURN(const ModelWeights weights, r->load_model_info(model_dir));
  r->worker_ = std::make_unique<worker::Worker>(options.worker);
  r->holder_ = std::make_shared<Holder>();
  r->holder_->chips.resize(1);
  SIMPLER_ASSIGN_OR_RETURN(
      r->step_, r->worker_->register_callable(
                    step_callable(r->holder_, r->options_.kernel_isa, r->options_.precision)));
  SIMPLER_RETURN_IF_ERROR(r->worker_->init());
  SIMPLER_RETURN_IF_ERROR(
      load_chip_state(*r->worker_, weights, r->options_, r->dims_, &r->holder_->chips[0]));
  for (const worker::DeviceBuffer& b : r->bound_buffers()) {
    SIMPLER_RETURN_IF_ERROR(r->worker_->bind(r->step_, b));
  }
  r->init_host_sampling();
  return r;
}

absl::StatusOr<std::unique_ptr<Qwen3DataParallel>> Qwen3DataParallel::prepare(
    hierarchy::L3Worker& l3, const std::string& model_dir, const RunnerOptions& options) {
  SIMPLER_RETURN_IF_ERROR(validate_runner_options(options));
  std::unique_ptr<Qwen3DataParallel> dp(new Qwen3DataParallel());
  dp->l3_ = &l3;
  dp->model_dir_ = model_dir;
  dp->options_ = effective_options(options);
  if (dp->options_.capture) {
    dp->options_.capture = false;
    dp->capture_off_reason_ =
        "steps on L3 children are not captured (capture keys do not cross "
        "the L3 mailbox)";
    SIMPLER_LOG_WARN("--capture on: {}; data parallel steps run uncaptured",
                     dp->capture_off_reason_);
  }
  dp->info_.reset(new Qwen3ModelRunner());
  dp->info_->options_ = dp->options_;
  // The children open the checkpoint themselves (a process child in its own address space).
  SIMPLER_RETURN_IF_ERROR(dp->info_->load_model_info(model_dir).status());
  dp->holder_ = std::make_shared<Qwen3ModelRunner::Holder>();
  dp->holder_->chips.resize(l3.num_children());
  SIMPLER_ASSIGN_OR_RETURN(hierarchy::ChildCallable step,
                           l3.register_callable(step_callable(dp->holder_, dp->options_.kernel_isa,
                                                              dp->options_.precision)));
  SIMPLER_ASSIGN_OR_RETURN(
      dp->program_,
      l3.register_program(hierarchy::L3Program{
          "qwen3_step",
          [step](hierarchy::L3Context& ctx, const task::TaskArgs& args) -> absl::Status {
            SIMPLER_RETURN_IF_ERROR(check_step_arg_count(args));
            const int64_t chip = args.scalar(kChip);
            if (chip < 0 || chip >= ctx.num_children()) {
              return absl::InvalidArgumentError(absl::StrCat(
                  "qwen3_step: chip ", chip, " outside [0, ", ctx.num_children(), ")"));
            }
            return ctx.submit_next_level(step, args, static_cast<int32_t>(chip)).status();
          }}));
  std::shared_ptr<Qwen3ModelRunner::Holder> holder = dp->holder_;
  const Qwen3Dims dims = dp->info_->dims_;
  SIMPLER_RETURN_IF_ERROR(
      l3.register_child_setup([holder, model_dir, options = dp->options_, dims](
                                  int32_t child, worker::Worker& w) -> absl::Status {
        SIMPLER_ASSIGN_OR_RETURN(const ModelWeights weights, ModelWeights::open(model_dir));
        return load_chip_state(w, weights, options, dims, &holder->chips[child]);
      }));
  return dp;
}

absl::StatusOr<std::unique_ptr<Qwen3ModelRunner>> Qwen3DataParallel::runner(int32_t child) {
  if (l3_->describe_children().empty()) {
    return absl::FailedPreconditionError("Qwen3DataParallel::runner before the L3 worker's init()");
  }
  if (child < 0 || child >= l3_->num_children()) {
    return absl::InvalidArgumentError(
        absl::StrCat("child ", child, " outside [0, ", l3_->num_children(), ")"));
  }
  std::unique_ptr<Qwen3ModelRunner> r(new Qwen3ModelRunner());
  r->options_ = options_;
  r->config_ = info_->config_;
  r->dims_ = info_->dims_;
  r->weight_bytes_per_step_ = info_->weight_bytes_per_step_;
  r->holder_ = holder_;
  r->chip_ = child;
  r->l3_ = l3_;
  r->l3_step_ = program_;
  r->init_host_sampling();
  return r;
}

std::vector<worker::DeviceBuffer> Qwen3ModelRunner::bound_buffers() const {
  if (!worker_) return {};
  return holder_->chips[0].all_buffers();
}

// One host tensor of a step's run, in argument order (see StepArg).
struct Qwen3ModelRunner::HostArg {
  void* data;
  uint64_t bytes;
  std::vector<int64_t> shape;
  DataType dtype;
  ArgDirection direction;
};

absl::Status Qwen3ModelRunner::check_host_step_collected() {
  if (!options_.host_sampling || !host_step_pending_) return absl::OkStatus();
  // A step whose run failed is never collected; it no longer holds the
  // host-side sampling state.
  if (host_pending_run_.done() && !host_pending_run_.result().status.ok()) {
    host_step_pending_ = false;
    host_pending_run_ = worker::RunHandle();
    return absl::OkStatus();
  }
  return absl::FailedPreconditionError(
      "host sampling: the previous step must be collected before the next is submitted");
}

absl::Status Qwen3ModelRunner::check_row(const StepPlan& plan, size_t i, const RowInput& in) const {
  const StepRow& row = plan.rows[i];
  if (in.tokens == nullptr || (row.logits && in.params == nullptr)) {
    return absl::InvalidArgumentError(
        absl::StrCat("step ", plan.step_id, " row ", i, ": no tokens or sampling parameters"));
  }
  const int64_t known = static_cast<int64_t>(in.tokens->size());
  if (row.len < 1 || row.start < 0 || static_cast<int64_t>(row.slots.size()) != row.len ||
      (row.prefill && row.start + row.len > known) || row.state_slot < 0 ||
      row.state_slot >= options_.max_num_seqs) {
    return absl::InvalidArgumentError(absl::StrCat(
        "step ", plan.step_id, " row ", i, " (request ", row.request_id, ", positions [", row.start,
        ", ", row.start + row.len, "), state slot ", row.state_slot, ") does not fit its ", known,
        " known tokens or the runner's limits"));
  }
  if (row.prompt_logits != 0 &&
      (row.prompt_logits < 0 || !row.prefill || row.prompt_logits > row.len ||
       row.start + row.prompt_logits > in.prompt_len - 1 || in.prompt_logprobs < 0 ||
       in.prompt_logprobs > kMaxLogprobs)) {
    return absl::InvalidArgumentError(
        absl::StrCat("step ", plan.step_id, " row ", i, " asks logits of ", row.prompt_logits,
                     " prompt positions from ", row.start, " with ", in.prompt_logprobs,
                     " alternatives: past the prompt's last position but one (", in.prompt_len - 2,
                     ") or outside [0, ", kMaxLogprobs, "] alternatives"));
  }
  if (row.logits && in.params->masked != 0 &&
      (in.mask == nullptr ||
       static_cast<int64_t>(in.mask->size()) != mask_words(dims_.vocab_size))) {
    return absl::InvalidArgumentError(absl::StrCat("step ", plan.step_id, " row ", i,
                                                   ": masked, but its token mask does not have ",
                                                   mask_words(dims_.vocab_size), " words"));
  }
  return absl::OkStatus();
}

void Qwen3ModelRunner::add_fresh_state(StepInFlight& st, const StepRow& row, const RowInput& in) {
  const int64_t known = static_cast<int64_t>(in.tokens->size());
  st.clear_slots.push_back(row.state_slot);
  for (int64_t p = 0; p < known; ++p) {
    if (p < in.prompt_len) {
      st.prompt_ids.push_back((*in.tokens)[p]);
      st.prompt_slots.push_back(row.state_slot);
    } else {
      st.gen_ids.push_back((*in.tokens)[p]);
      st.gen_slots.push_back(row.state_slot);
    }
  }
  if (!options_.host_sampling) return;
  std::vector<int32_t>& c = host_counts_[row.state_slot];
  c.assign(dims_.vocab_size, 0);
  for (int64_t p = 0; p < known; ++p) {
    apply_count(c, (*in.tokens)[p],
                p < in.prompt_len ? TokenCountsMode::kPrompt : TokenCountsMode::kGenerated);
  }
}

void Qwen3ModelRunner::add_positions(StepInFlight& st, const StepRow& row, const RowInput& in,
                                     int64_t max_blocks) const {
  for (int64_t k = 0; k < row.len; ++k) {
    const int64_t pos = row.start + k;
    if (row.prefill) {
      st.host_ids.push_back((*in.tokens)[pos]);
      st.src_slots.push_back(-1);
    } else if (options_.host_sampling) {
      st.host_ids.push_back(host_last_ids_[row.state_slot]);
      st.src_slots.push_back(-1);
    } else {
      st.host_ids.push_back(0);
      st.src_slots.push_back(row.state_slot);
    }
    st.positions.push_back(static_cast<int32_t>(pos));
    st.slot_mapping.push_back(row.slots[k]);
    st.context_lens.push_back(static_cast<int32_t>(pos + 1));
    for (int64_t b = 0; b < max_blocks; ++b) {
      st.block_tables.push_back(
          b < static_cast<int64_t>(row.block_table.size()) ? row.block_table[b] : 0);
    }
  }
}

void Qwen3ModelRunner::add_logit_row(StepInFlight& st, size_t i, const StepRow& row,
                                     const RowInput& in) {
  const int64_t pos = row.start + row.len;  // the position of the token sampled
  st.logit_rows.push_back(static_cast<int32_t>(st.positions.size() - 1));
  st.row_of_logit_.push_back(i);
  st.want_logits_.push_back(in.want_logits ? 1 : 0);
  st.logit_state_slot_.push_back(row.state_slot);
  st.params.push_back(*in.params);
  st.mask_src_.push_back(in.params->masked != 0 ? in.mask : nullptr);
  SampleRowInfo info;
  info.slot = row.state_slot;
  info.position = static_cast<int32_t>(pos);
  info.choice = in.choice;
  info.num_generated = static_cast<int32_t>(pos - in.prompt_len);
  st.rows.push_back(info);
  st.sample_slots.push_back(row.state_slot);
}

void Qwen3ModelRunner::add_score_rows(StepInFlight& st, size_t i, const StepRow& row,
                                      const RowInput& in, int64_t first,
                                      std::vector<int32_t>& logit_rows) {
  for (int64_t k = 0; k < row.prompt_logits; ++k) {
    const int64_t pos = row.start + k;
    logit_rows.push_back(static_cast<int32_t>(first + k));
    st.score_ids.push_back((*in.tokens)[pos + 1]);
    st.score_k.push_back(in.prompt_logprobs);
    st.score_of_.emplace_back(i, pos);
  }
}

absl::Status Qwen3ModelRunner::size_outputs(StepInFlight& st, bool any_logits_wanted) const {
  const int64_t B = static_cast<int64_t>(st.positions.size());
  const int64_t n = static_cast<int64_t>(st.logit_rows.size());
  const int64_t np = static_cast<int64_t>(st.score_ids.size());
  st.score_logprobs.assign(np, 0.0f);
  st.score_top_ids.assign(np * kMaxLogprobs, -1);
  st.score_top_logprobs.assign(np * kMaxLogprobs, 0.0f);
  if (B > options_.max_num_batched_tokens || n > options_.max_num_seqs) {
    return absl::InvalidArgumentError(absl::StrCat(
        "step ", st.step_id_, " has ", B, " positions and ", n, " logit rows; the runner holds ",
        options_.max_num_batched_tokens, " and ", options_.max_num_seqs));
  }
  const bool host = options_.host_sampling;
  const int64_t ns = host ? 0 : n - np;  // rows sampled on the device
  st.out_ids.assign(ns, -1);
  st.out_logprobs.assign(ns, 0.0f);
  st.top_ids.assign(ns * kMaxLogprobs, -1);
  st.top_logprobs.assign(ns * kMaxLogprobs, 0.0f);
  if (any_logits_wanted) st.logits.assign(n * dims_.vocab_size, 0.0f);
  const int64_t W = mask_words(dims_.vocab_size);
  const bool any_mask = std::any_of(st.mask_src_.begin(), st.mask_src_.end(),
                                    [](const std::vector<uint32_t>* m) { return m != nullptr; });
  if (any_mask && host) {
    for (const std::vector<uint32_t>* m : st.mask_src_) {
      st.host_masks_.push_back(m != nullptr ? *m : std::vector<uint32_t>());
    }
  } else if (any_mask) {
    st.masks.assign(ns * W, 0);
    for (int64_t j = 0; j < ns; ++j) {
      if (st.mask_src_[j] != nullptr) {
        std::memcpy(st.masks.data() + j * W, st.mask_src_[j]->data(), W * sizeof(uint32_t));
      }
    }
  }
  st.mask_src_.clear();
  if (host) {
    st.host_params_ = std::move(st.params);
    st.host_rows_ = std::move(st.rows);
    st.params.clear();
    st.rows.clear();
  }
  return absl::OkStatus();
}

std::vector<Qwen3ModelRunner::HostArg> Qwen3ModelRunner::host_args(StepInFlight& s,
                                                                   int64_t max_blocks,
                                                                   int64_t vocab_size) {
  const int64_t B = static_cast<int64_t>(s.positions.size());
  const int64_t n = static_cast<int64_t>(s.logit_rows.size());
  const int64_t ns = static_cast<int64_t>(s.out_ids.size());
  const int64_t c0 = static_cast<int64_t>(s.clear_slots.size());
  const int64_t c1 = static_cast<int64_t>(s.prompt_ids.size());
  const int64_t c2 = static_cast<int64_t>(s.gen_ids.size());
  std::vector<HostArg> args;
  auto add = [&args]<typename T>(std::vector<T>& v, std::vector<int64_t> shape, DataType dtype,
                                 ArgDirection dir) {
    if (v.capacity() == 0) v.reserve(1);  // a valid address even for an empty tensor
    args.push_back({v.data(), v.size() * sizeof(T), std::move(shape), dtype, dir});
  };
  const int64_t sp = static_cast<int64_t>(sizeof(SamplingParams));
  add(s.host_ids, {B}, DataType::kInt32, ArgDirection::kIn);
  add(s.src_slots, {B}, DataType::kInt32, ArgDirection::kIn);
  add(s.clear_slots, {c0}, DataType::kInt32, ArgDirection::kIn);
  add(s.prompt_ids, {c1}, DataType::kInt32, ArgDirection::kIn);
  add(s.prompt_slots, {c1}, DataType::kInt32, ArgDirection::kIn);
  add(s.gen_ids, {c2}, DataType::kInt32, ArgDirection::kIn);
  add(s.gen_slots, {c2}, DataType::kInt32, ArgDirection::kIn);
  add(s.params, {ns, sp}, DataType::kUInt8, ArgDirection::kIn);
  add(s.rows, {ns, 4}, DataType::kInt32, ArgDirection::kIn);
  add(s.sample_slots, {ns}, DataType::kInt32, ArgDirection::kIn);
  add(s.out_ids, {ns}, DataType::kInt32, ArgDirection::kOut);
  add(s.out_logprobs, {ns}, DataType::kFloat32, ArgDirection::kOut);
  add(s.top_ids, {ns, kMaxLogprobs}, DataType::kInt32, ArgDirection::kOut);
  add(s.top_logprobs, {ns, kMaxLogprobs}, DataType::kFloat32, ArgDirection::kOut);
  add(s.positions, {B}, DataType::kInt32, ArgDirection::kIn);
  add(s.slot_mapping, {B}, DataType::kInt32, ArgDirection::kIn);
  add(s.block_tables, {B, max_blocks}, DataType::kInt32, ArgDirection::kIn);
  add(s.context_lens, {B}, DataType::kInt32, ArgDirection::kIn);
  add(s.logit_rows, {n}, DataType::kInt32, ArgDirection::kIn);
  if (s.logits.empty()) {
    add(s.logits, {0}, DataType::kFloat32, ArgDirection::kOut);  // the chip's scratch
  } else {
    add(s.logits, {n, vocab_size}, DataType::kFloat32, ArgDirection::kOut);
  }
  const int64_t nm = s.masks.empty() ? 0 : ns;
  add(s.masks, {nm, mask_words(vocab_size)}, DataType::kInt32, ArgDirection::kIn);
  const int64_t np = static_cast<int64_t>(s.score_ids.size());
  add(s.score_ids, {np}, DataType::kInt32, ArgDirection::kIn);
  add(s.score_k, {np}, DataType::kInt32, ArgDirection::kIn);
  add(s.score_logprobs, {np}, DataType::kFloat32, ArgDirection::kOut);
  add(s.score_top_ids, {np, kMaxLogprobs}, DataType::kInt32, ArgDirection::kOut);
  add(s.score_top_logprobs, {np, kMaxLogprobs}, DataType::kFloat32, ArgDirection::kOut);
  return args;
}

absl::Status Qwen3ModelRunner::stage_on_l3(StepInFlight& s, std::vector<HostArg>& args) {
  constexpr uint64_t kAlign = 64;
  uint64_t total = 0;
  for (const HostArg& h : args) total += (h.bytes + kAlign - 1) / kAlign * kAlign + kAlign;
  SIMPLER_ASSIGN_OR_RETURN(hierarchy::HostBuffer buf, l3_->create_buffer(total));
  hierarchy::L3Worker* l3 = l3_;
  s.release_staging_ = [l3, buf] { (void)l3->free_buffer(buf); };
  const uint64_t staging_base = buf.address;
  uint64_t off = 0;
  for (HostArg& h : args) {
    void* dst = reinterpret_cast<void*>(static_cast<uintptr_t>(staging_base + off));
    if (h.direction == ArgDirection::kIn) {
      if (h.bytes > 0) std::memcpy(dst, h.data, h.bytes);
    } else if (h.bytes > 0) {
      s.copy_back_.push_back({h.data, dst, h.bytes});
    }
    h.data = dst;
    off += (h.bytes + kAlign - 1) / kAlign * kAlign + kAlign;
  }
  return absl::OkStatus();
}

absl::Status Qwen3ModelRunner::launch(StepInFlight& s, const std::vector<HostArg>& args) {
  task::TaskArgs a;
  for (const HostArg& h : args) {
    SIMPLER_ASSIGN_OR_RETURN(
        Tensor t,
        Tensor::contiguous(reinterpret_cast<uintptr_t>(h.data), h.shape.data(),
                           static_cast<int32_t>(h.shape.size()), h.dtype, MemoryKind::kHost));
    a.add_tensor(t, h.direction);
  }
  a.add_scalar(chip_);
  task::CallConfig config;
  config.capture_key = capture_key(s, args);
  s.submit_ns_ = base::now_ns();
  if (l3_ != nullptr) {
    SIMPLER_ASSIGN_OR_RETURN(s.handle_, l3_->submit(l3_step_, a));
  } else {
    SIMPLER_ASSIGN_OR_RETURN(s.handle_, worker_->submit(step_, a, config));
  }
  if (options_.host_sampling) {
    host_step_pending_ = true;
    host_pending_run_ = s.handle_;
  }
  return absl::OkStatus();
}

bool Qwen3ModelRunner::captured(const StepInFlight& s) const {
  if (!options_.capture || l3_ != nullptr) return false;
  // Token-count commits carry a prompt's length: a key per prompt length would only churn the
  // cache.
  return s.clear_slots.empty() && s.prompt_ids.empty() && s.gen_ids.empty();
}

namespace {

// The bucket of a step with `rows` rows (positions or sampled rows), at most `cap`: the next power
// of two (1, 2, 4, ..., 32, 64, ...: never twice the rows or more), or `cap` itself where that
// power exceeds it (a prefill chunk's budget); 0 stays 0, and a count at or above the cap stays as
// it is (size_outputs refuses what exceeds the runner's limits).
int64_t row_bucket(int64_t rows, int64_t cap) {
  if (rows <= 0 || rows >= cap) return rows;
  return std::min(static_cast<int64_t>(std::bit_ceil(static_cast<uint64_t>(rows))), cap);
}

}  // namespace

void Qwen3ModelRunner::pad_to_bucket(StepInFlight& st, int64_t max_blocks, int64_t np) const {
  const auto B = static_cast<int64_t>(st.positions.size());
  const int64_t padded_b = row_bucket(B, options_.max_num_batched_tokens);
  for (int64_t k = B; k < padded_b; ++k) {
    st.host_ids.push_back(0);
    st.src_slots.push_back(-1);  // token 0 from the host, not last_ids
    st.positions.push_back(0);
    st.slot_mapping.push_back(-1);  // kv_write skips it: no KV slot is written
    st.context_lens.push_back(0);   // paged attention reads no page: a zero row
    st.block_tables.insert(st.block_tables.end(), max_blocks, 0);
  }
  // Sampled rows so far (the prompt positions' score rows are appended after them).
  const auto ns = static_cast<int64_t>(st.logit_rows.size());
  const int64_t padded_ns = row_bucket(ns, options_.max_num_seqs - np);
  SamplingParams greedy;
  greedy.temperature = 0.0f;
  greedy.logprobs = -1;  // no log-sum-exp over the vocabulary
  for (int64_t j = ns; j < padded_ns; ++j) {
    st.logit_rows.push_back(static_cast<int32_t>(padded_b - 1));
    st.params.push_back(greedy);
    st.rows.push_back(SampleRowInfo{});  // slot -1: no token counts read
    st.sample_slots.push_back(-1);       // token_counts and token_scatter skip it
    st.mask_src_.push_back(nullptr);
  }
}

uint64_t Qwen3ModelRunner::capture_key(const StepInFlight& s, const std::vector<HostArg>& args) {
  if (!captured(s)) return 0;
  std::vector<int64_t> shapes;
  for (const HostArg& h : args) {
    shapes.push_back(static_cast<int64_t>(h.shape.size()));
    shapes.insert(shapes.end(), h.shape.begin(), h.shape.end());
  }
  const auto [it, added] = capture_keys_.emplace(std::move(shapes), capture_keys_.size() + 1);
  return it->second;
}

absl::StatusOr<std::unique_ptr<StepInFlight>> Qwen3ModelRunner::submit(
    const StepPlan& plan, std::span<const RowInput> inputs) {
  if (inputs.size() != plan.rows.size()) {
    return absl::InvalidArgumentError(absl::StrCat("step ", plan.step_id, " has ", plan.rows.size(),
                                                   " rows but ", inputs.size(), " row inputs"));
  }
  SIMPLER_RETURN_IF_ERROR(check_host_step_collected());
  std::unique_ptr<StepInFlight> st(new StepInFlight());
  st->step_id_ = plan.step_id;
  st->host_logits_ = options_.host_sampling;
  int64_t max_blocks = 1;
  for (const StepRow& row : plan.rows) {
    max_blocks = std::max<int64_t>(max_blocks, static_cast<int64_t>(row.block_table.size()));
  }
  // Captured steps: one graph per power of two of block-table width, not one per width (the
  // entries past a row's table are 0 and never read: its context length says where it ends).
  if (options_.capture && l3_ == nullptr) max_blocks = std::bit_ceil<uint64_t>(max_blocks);
  bool any_logits_wanted = options_.host_sampling;
  std::vector<int32_t> score_rows;  // logit rows of prompt positions, after the sampled ones
  for (size_t i = 0; i < plan.rows.size(); ++i) {
    const StepRow& row = plan.rows[i];
    SIMPLER_RETURN_IF_ERROR(check_row(plan, i, inputs[i]));
    if (row.fresh_state) add_fresh_state(*st, row, inputs[i]);
    const int64_t first = static_cast<int64_t>(st->positions.size());
    add_positions(*st, row, inputs[i], max_blocks);
    add_score_rows(*st, i, row, inputs[i], first, score_rows);
    if (row.logits) {
      add_logit_row(*st, i, row, inputs[i]);
      any_logits_wanted = any_logits_wanted || inputs[i].want_logits;
    }
  }
  if (captured(*st)) pad_to_bucket(*st, max_blocks, static_cast<int64_t>(score_rows.size()));
  st->logit_rows.insert(st->logit_rows.end(), score_rows.begin(), score_rows.end());
  SIMPLER_RETURN_IF_ERROR(size_outputs(*st, any_logits_wanted));
  std::vector<HostArg> args = host_args(*st, max_blocks, dims_.vocab_size);
  // A runner on an L3 child stages them in one shared-heap buffer (the only host memory the
  // child sees), 64-byte aligned each; its own worker reads the vectors where they are.
  if (l3_ != nullptr) SIMPLER_RETURN_IF_ERROR(stage_on_l3(*st, args));
  SIMPLER_RETURN_IF_ERROR(launch(*st, args));
  return st;
}

absl::StatusOr<std::vector<RowSample>> Qwen3ModelRunner::collect(StepInFlight& step) {
  const int64_t V = dims_.vocab_size;
  const int64_t n = static_cast<int64_t>(step.row_of_logit_.size());
  std::vector<RowSample> out(n);
  // Staged in the shared heap (a runner on an L3 child): the run's outputs come back first.
  for (const StepInFlight::CopyBack& c : step.copy_back_) std::memcpy(c.dst, c.src, c.bytes);
  step.copy_back_.clear();
  if (step.host_logits_) {
    host_step_pending_ = false;
    host_pending_run_ = worker::RunHandle();
  }
  for (int64_t j = 0; j < n; ++j) {
    RowSample& rs = out[j];
    rs.row = step.row_of_logit_[j];
    const float* logits = step.logits.empty() ? nullptr : step.logits.data() + j * V;
    if (step.host_logits_) {
      // Host sampling: the kernel's math on the host, with the host's counts.
      const int32_t slot = step.logit_state_slot_[j];
      std::vector<int32_t>& counts = host_counts_[slot];
      const uint32_t* mask = step.host_masks_.empty() || step.host_masks_[j].empty()
                                 ? nullptr
                                 : step.host_masks_[j].data();
      if (mask != nullptr && !mask_allows_any(mask, V)) {
        return absl::InvalidArgumentError(absl::StrCat("step run ", step.handle_.id().value,
                                                       ": the token mask of row ", rs.row,
                                                       " allows no token"));
      }
      rs.sample =
          sample_row(step.host_params_[j], step.host_rows_[j], logits, counts.data(), V, mask);
      if (rs.sample.id >= 0 && rs.sample.id < V) {
        apply_count(counts, rs.sample.id, TokenCountsMode::kGenerated);
        host_last_ids_[slot] = rs.sample.id;
      }
    } else {
      rs.sample.id = step.out_ids[j];
      rs.sample.logprob = step.out_logprobs[j];
      for (int k = 0; k < kMaxLogprobs; ++k) {
        rs.sample.top_ids[k] = step.top_ids[j * kMaxLogprobs + k];
        rs.sample.top_logprobs[k] = step.top_logprobs[j * kMaxLogprobs + k];
      }
    }
    if (rs.sample.id < 0 || rs.sample.id >= V) {
      return absl::InternalError(absl::StrCat("step run ", step.handle_.id().value,
                                              " sampled token id ", rs.sample.id, " for row ",
                                              rs.row, ", outside the vocabulary [0, ", V, ")"));
    }
    if (step.want_logits_[j] && logits != nullptr) rs.logits.assign(logits, logits + V);
  }
  collect_prompt_logprobs(step);
  return out;
}

void Qwen3ModelRunner::collect_prompt_logprobs(StepInFlight& step) {
  step.prompt_results_.clear();
  for (size_t j = 0; j < step.score_of_.size(); ++j) {
    PromptLogprob p;
    p.row = step.score_of_[j].first;
    p.position = step.score_of_[j].second;
    p.score.id = step.score_ids[j];
    p.score.logprob = step.score_logprobs[j];
    for (int k = 0; k < kMaxLogprobs; ++k) {
      p.score.top_ids[k] = step.score_top_ids[j * kMaxLogprobs + k];
      p.score.top_logprobs[k] = step.score_top_logprobs[j * kMaxLogprobs + k];
    }
    step.prompt_results_.push_back(std::move(p));
  }
}

absl::StatusOr<Qwen3ModelRunner::Kv> Qwen3ModelRunner::read_kv(int32_t slot) {
  if (!worker_) {
    return absl::FailedPreconditionError(
        "read_kv: the KV pool of a runner on an L3 child is in the child's memory");
  }
  const ChipState& c = holder_->chips[0];
  const int64_t slots = static_cast<int64_t>(options_.num_pages) * options_.page_size;
  if (slot < 0 || slot >= slots) {
    return absl::InvalidArgumentError(
        absl::StrCat("KV slot ", slot, " outside the pool's [0, ", slots, ")"));
  }
  // The pools hold a page kv head by kv head ([pages, n_kv, page_size, head_dim]): the slot's row
  // is one head_dim run per kv head.
  const int64_t heads = dims_.num_key_value_heads, hd = dims_.head_dim, ps = c.kv_pools.page_size();
  const uint64_t run_bytes = static_cast<uint64_t>(hd) * sizeof(float);
  Kv kv;
  for (int64_t l = 0; l < dims_.num_hidden_layers; ++l) {
    std::vector<float> k(heads * hd), v(heads * hd);
    for (int64_t h = 0; h < heads; ++h) {
      const uint64_t run_off =
          static_cast<uint64_t>(kv_pool_offset(slot / ps, h, slot % ps, heads, ps, hd)) *
          sizeof(float);
      const uint64_t k_off = c.kv_pools.layers[l].k_pool.address - c.kv_buffer.address + run_off;
      const uint64_t v_off = c.kv_pools.layers[l].v_pool.address - c.kv_buffer.address + run_off;
      SIMPLER_RETURN_IF_ERROR(worker_->copy_from(k.data() + h * hd, c.kv_buffer, run_bytes, k_off));
      SIMPLER_RETURN_IF_ERROR(worker_->copy_from(v.data() + h * hd, c.kv_buffer, run_bytes, v_off));
    }
    kv.k.push_back(std::move(k));
    kv.v.push_back(std::move(v));
  }
  return kv;
}

absl::Status Qwen3ModelRunner::close(const base::Deadline& deadline) {
  if (!worker_) return absl::OkStatus();
  return worker_->close(deadline);
}

Qwen3ModelRunner::~Qwen3ModelRunner() { (void)close(); }

}  // namespace simpler::llm
