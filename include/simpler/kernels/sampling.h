// Sampling on the device: per-row sampling parameters, the per-request token-count state the
// penalties read, and the kernels that update that state and choose one token per row.
//
// Semantics follow vLLM's v1 sampler (vllm/v1/sample/sampler.py, ops/penalties.py,
// ops/topk_topp_sampler.py, logits processors min_p / min_tokens), in its order:
//   0. token mask (structured outputs; `masked` rows only): every token whose bit is clear in
//      the row's mask gets logit -inf before anything else reads the logits, as vLLM applies its
//      grammar bitmask to the logits before its sampler (docs/design/structured_outputs.md);
//      the raw logprobs below are then those of the masked logits;
//   1. logprobs of the RAW logits: log_softmax(logits) (vLLM's default "raw_logprobs");
//   2. min_tokens: while fewer than `min_tokens` tokens are generated, every stop id's logit
//      is -inf (vLLM MinTokensLogitsProcessor);
//   3. penalties (vLLM apply_penalties; OpenAI's definitions for presence / frequency):
//        repetition r, for tokens seen in the prompt OR the generated output:
//          l > 0 ? l / r : l · r;
//        frequency f: l −= f · count_out(t); presence p: l −= p · [count_out(t) > 0],
//      where count_out counts the request's generated tokens only;
//   4. greedy (temperature < kGreedyTemperature): the lowest index of the largest penalized
//      logit; otherwise
//   5. temperature: l /= temperature;
//   6. min_p: with q = softmax(l), keep tokens with q ≥ min_p · max(q);
//   7. top-k: keep tokens whose logit is ≥ the k-th largest logit (ties at the threshold kept,
//      as vLLM's sort-and-threshold does);
//   8. top-p: over the survivors' renormalized probabilities sorted ascending (ties by higher
//      index first), drop the tokens whose inclusive cumulative sum is ≤ 1 − top_p; the largest
//      token is always kept (vLLM apply_top_k_top_p);
//   9. draw: u = ((w0 << 32 | w1) >> 11) · 2⁻⁵³ ∈ [0, 1) from 53 bits of the row's Philox
//      output words w0, w1 (so a token's probability is resolved to 2⁻⁵³, not 2⁻²⁴: with a
//      150k-token vocabulary 24 bits would leave tiny-probability tokens undrawable);
//      the token is the first survivor, in index order, whose cumulative (unnormalized)
//      probability exceeds u · total (inverse CDF; vLLM draws with an exponential race instead,
//      which has the same distribution but not the same token for a given random number).
// Softmaxes, cumulative sums and log-sum-exp are computed in f64; inputs and outputs are f32.
//
// Randomness: Philox-4x32-10 (Salmon, Moraes, Dror, Shaw, "Parallel random numbers: as easy as
// 1, 2, 3", SC'11; constants of Random123's philox.h), key = (seed low 32 bits, seed high 32
// bits), counter = (position low, position high, choice, 0). Given its logits, parameters and
// history, the token at one position of one choice of a seeded request depends on nothing else:
// not the batch, the row, the SPMD split, the launch depth or a preemption (recompute replays
// the same positions). Clone i of a request (OpenAI `n`)
// uses choice i. Unseeded requests take distinct seeds from a `SeedAllocator`.
//
// Thread safety: every function here is pure or touches only its arguments; the kernels keep no
// state between calls (thread-safe), like those of kernels.h.
//
// Stop policy (host side, not in the kernel): a request stops on a stop id once at least
// `min_tokens` tokens are generated; `ignore_eos` disables only the model's EOS ids (the entries
// `eos_mask` marks), never the request's own stop_token_ids — as vLLM's check_stop does; see
// `stops_on`. The kernel applies the min_tokens mask to every stop id, EOS included (vLLM masks
// EOS for min_tokens even with ignore_eos).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <limits>
#include <random>
#include <type_traits>
#include <vector>

#include "absl/status/status.h"
#include "simpler/task/callable.h"
#include "simpler/task/task_args.h"
#include "simpler/task/tensor.h"

namespace simpler::llm {

// ---- Philox-4x32-10 -------------------------------------------------------------------------

struct Philox4x32Counter {
  uint32_t v[4];
};
struct Philox4x32Key {
  uint32_t v[2];
};

// Ten rounds of Philox-4x32 (Random123 philox4x32_R(10, ctr, key)): multipliers 0xD2511F53,
// 0xCD9E8D57, key bumps 0x9E3779B9, 0xBB67AE85. Pure function, thread-safe.
Philox4x32Counter philox4x32_10(Philox4x32Counter counter, Philox4x32Key key);

// The uniform in [0, 1) a row draws with: the 53 high bits of (w0 << 32 | w1), words 0 and 1
// of philox4x32_10(counter = {position, position >> 32, choice, 0}, key = {seed, seed >> 32}),
// times 2⁻⁵³. Exactly representable in f64.
double philox_uniform(uint64_t seed, uint32_t choice, int64_t position);

// Hands out distinct seeds for unseeded requests: splitmix64(base + n) for n = 0, 1, 2, …
// (splitmix64 is a bijection of 64-bit words, so 2⁶⁴ calls give distinct seeds). `base` comes
// from std::random_device unless given. Thread-compatible (one owner: the engine loop).
class SeedAllocator {
 public:
  SeedAllocator()
      : SeedAllocator((uint64_t{std::random_device{}()} << 32) ^ std::random_device{}()) {}
  explicit SeedAllocator(uint64_t base) : base_(base) {}
  uint64_t next();

 private:
  uint64_t base_;
  uint64_t n_ = 0;
};

// ---- parameters ------------------------------------------------------------------------------

inline constexpr uint32_t kSamplingParamsVersion = 3;  // 2: eos_mask, 3: masked
inline constexpr int kMaxLogprobs = 20;        // top alternatives per row (vLLM's and OpenAI's 20)
inline constexpr int kMaxSamplingStopIds = 8;  // stop ids a row can mask for min_tokens
// vLLM's _SAMPLING_EPS: a temperature below it is greedy.
inline constexpr float kGreedyTemperature = 1e-5f;

// One row's sampling parameters. Plain struct (standard layout, trivially copyable, 88 bytes):
// it travels to the device as u8 [rows, sizeof(SamplingParams)] in a tensor. Defaults are
// vLLM's (every transform off, temperature 1).
struct SamplingParams {
  uint32_t version = kSamplingParamsVersion;
  float temperature = 1.0f;         // ≥ 0, finite; < kGreedyTemperature is greedy
  float top_p = 1.0f;               // (0, 1]; 1 is off
  int32_t top_k = 0;                // ≥ -1; 0 and -1 are off (vLLM uses -1, OpenAI-style 0)
  float min_p = 0.0f;               // [0, 1]; 0 is off
  float presence_penalty = 0.0f;    // [-2, 2]; 0 is off
  float frequency_penalty = 0.0f;   // [-2, 2]; 0 is off
  float repetition_penalty = 1.0f;  // > 0, finite; 1 is off
  uint64_t seed = 0;                // Philox key; from SeedAllocator when the request has none
  // [0, kMaxLogprobs]: the sampled token's logprob and this many top alternatives
  // (OpenAI's logprobs = 0 reports the sampled token's only); -1: no logprobs at all
  // (SampleResult::logprob is 0 and the log-sum-exp over the vocabulary is skipped).
  int32_t logprobs = 0;
  int32_t min_tokens = 0;  // ≥ 0: stop ids masked while fewer are generated
  int32_t stop_ids[kMaxSamplingStopIds] = {-1, -1, -1, -1, -1, -1, -1, -1};  // -1 = unused
  uint8_t ignore_eos = 0;  // 0 / 1: host stop policy only (see stops_on)
  // Bit i set: stop_ids[i] is one of the model's EOS ids (ignore_eos disables it); clear: a
  // stop_token_id of the request's own.
  uint8_t eos_mask = 0;
  // 0 / 1: the row reads a token mask (the sample kernel's `mask` argument; step 0 above).
  uint8_t masked = 0;
  uint8_t reserved[5] = {};

  // OK, or INVALID_ARGUMENT naming the field and its value (e.g. "top_p must be in (0, 1],
  // got 0"). `vocab_size` bounds the stop ids (each -1 or in [0, vocab_size)).
  absl::Status validate(int64_t vocab_size) const;
};
static_assert(std::is_standard_layout_v<SamplingParams>);
static_assert(std::is_trivially_copyable_v<SamplingParams>);
static_assert(sizeof(SamplingParams) == 88);
static_assert(alignof(SamplingParams) == 8);

// True when generating `token` as the request's `num_generated`-th token (1-based count after
// it) ends the request: num_generated ≥ min_tokens and `token` is one of `params.stop_ids`
// that is either the request's own stop id or an EOS id (`eos_mask`) while `ignore_eos` is 0.
// Pure, thread-safe.
bool stops_on(const SamplingParams& params, int32_t token, int64_t num_generated);

// ---- per-request token counts ---------------------------------------------------------------
// Device state, i32 [slots, V], one row per live request (its slot):
//   counts[s, t] = 2 · (times t was generated) + (1 if t occurs in the prompt).
// Memory: 4 · V bytes per slot (Qwen3's V = 151936: 594 KiB per slot, 152 MiB for 256 slots).
// Written only by token_counts_kernel from committed tokens, read by sample_kernel.
inline int32_t output_count(int32_t packed) { return packed >> 1; }
inline bool in_prompt(int32_t packed) { return (packed & 1) != 0; }

enum class TokenCountsMode : uint32_t {
  kClear = 0,      // counts[slots[j], :] = 0 (ids ignored): a slot handed to a new request
  kPrompt = 1,     // counts[slots[j], ids[j]] |= 1
  kGenerated = 2,  // counts[slots[j], ids[j]] += 2
};

// ---- token_counts -----------------------------------------------------------------------------
// Args: 0 ids i32 [n] IN, 1 slots i32 [n] IN, 2 counts i32 [S, V] INOUT, 3 mode u32 SCALAR
// (TokenCountsMode). Applies entry j for j = 0 … n−1. A slot < 0 skips the entry (padding).
// INVALID_ARGUMENT naming the entry for a slot ≥ S, an id outside [0, V) (not checked for
// kClear), an unknown mode, or a count that would overflow. Single block: entries may repeat
// a slot (block_dim must be 1).
absl::Status token_counts_kernel(const task::KernelContext& ctx);
task::TaskArgs token_counts_args(const task::Tensor& ids, const task::Tensor& slots,
                                 const task::Tensor& counts, TokenCountsMode mode);

// ---- sample -------------------------------------------------------------------------------
// What the kernel reads per row besides logits and params: i32 [rows, 4] with these columns.
struct SampleRowInfo {
  int32_t slot = -1;          // row of `counts`; -1: no history (no penalties apply)
  int32_t position = 0;       // ≥ 0: sequence position of the token being chosen
  int32_t choice = 0;         // ≥ 0: clone index of the request (OpenAI `n`)
  int32_t num_generated = 0;  // ≥ 0: tokens the request generated before this one
};
static_assert(sizeof(SampleRowInfo) == 4 * sizeof(int32_t));
static_assert(std::is_standard_layout_v<SampleRowInfo>);
static_assert(std::is_trivially_copyable_v<SampleRowInfo>);

// One row's result.
struct SampleResult {
  SampleResult() {
    std::fill(std::begin(top_ids), std::end(top_ids), -1);
    std::fill(std::begin(top_logprobs), std::end(top_logprobs),
              -std::numeric_limits<float>::infinity());
  }
  int32_t id = -1;
  float logprob = 0.0f;  // log_softmax(raw logits)[id]; 0 when params.logprobs is -1
  // The params.logprobs highest raw logprobs (ties: lower id first); unused entries -1 / -inf.
  int32_t top_ids[kMaxLogprobs];
  float top_logprobs[kMaxLogprobs];
};

// Args: 0 logits f32 [R, V] IN, 1 params u8 [R, sizeof(SamplingParams)] IN, 2 rows i32 [R, 4]
// IN (SampleRowInfo), 3 counts i32 [S, V] IN, 4 out_ids i32 [R] OUT, 5 out_logprobs f32 [R] OUT,
// 6 top_ids i32 [R, kMaxLogprobs] OUT, 7 top_logprobs f32 [R, kMaxLogprobs] OUT, and optionally
// 8 mask i32 [R, mask_words(V)] IN (bit t % 32 of word t / 32 set: token t allowed; read only
// for rows with params.masked).
// Row r is sample_row(logits[r], params[r], rows[r], counts[rows[r].slot] or none, mask[r] or
// none). SPMD over rows by block_range. INVALID_ARGUMENT naming the kernel, the row and the field
// for invalid params (SamplingParams::validate), a slot ≥ S, a negative position / choice /
// num_generated, a masked row without the mask argument, a mask that allows no token ("row r:
// the token mask allows no token"), or V < 1 / V > INT32_MAX.
absl::Status sample_kernel(const task::KernelContext& ctx);
task::TaskArgs sample_args(const task::Tensor& logits, const task::Tensor& params,
                           const task::Tensor& rows, const task::Tensor& counts,
                           const task::Tensor& out_ids, const task::Tensor& out_logprobs,
                           const task::Tensor& top_ids, const task::Tensor& top_logprobs);
// The same with the mask argument (8).
task::TaskArgs sample_args(const task::Tensor& logits, const task::Tensor& params,
                           const task::Tensor& rows, const task::Tensor& counts,
                           const task::Tensor& out_ids, const task::Tensor& out_logprobs,
                           const task::Tensor& top_ids, const task::Tensor& top_logprobs,
                           const task::Tensor& mask);
// Words of one row's token mask: (vocab + 31) / 32.
inline int64_t mask_words(int64_t vocab) { return (vocab + 31) / 32; }
// True when `mask` (mask_words(vocab) words) allows at least one token below `vocab`.
bool mask_allows_any(const uint32_t* mask, int64_t vocab);

// The two kernels above as {"token_counts", "sample"}, for a program's kernel list (a fresh copy;
// they are not in llm_kernels(), so the decode program's KernelId order is unchanged).
std::vector<task::Kernel> sampling_kernels();

// ---- host math (the kernel runs exactly this per row) -------------------------------------
// `logits` f32 [vocab]; `counts` i32 [vocab] in the packed form above, or null (no history).
// Steps 2–3 of the header comment, in place: the logits the greedy pick and temperature see.
void apply_penalties(const SamplingParams& params, const int32_t* counts, int64_t num_generated,
                     float* logits, int64_t vocab);
// Steps 5–8: the survivors' probabilities (f64 [vocab], zero for dropped tokens, not
// normalized) from penalized logits; requires temperature ≥ kGreedyTemperature.
void sampling_weights(const SamplingParams& params, const float* penalized, int64_t vocab,
                      double* weights);
// All steps for one row. `params` must be valid (validate()); vocab ≥ 1; `mask` (read when
// params.masked) must allow some token (mask_allows_any). Thread-safe. Cost:
// O(V), plus for top-p a sort of the smallest window of largest tokens holding top_p of the
// mass (docs/design/sampling.md); scratch of about
// 12·V bytes (f32 penalized copy, f64 weights) per call, plus 8·S for the filters and 8·V when
// logprobs > 0.
SampleResult sample_row(const SamplingParams& params, const SampleRowInfo& row, const float* logits,
                        const int32_t* counts, int64_t vocab, const uint32_t* mask = nullptr);
// A given token scored against raw logits (prompt logprobs, vLLM's prompt_logprobs): id `token`,
// its log_softmax(logits) and the `logprobs` highest raw logprobs (ties: lower id first; unused
// entries -1 / -inf): what sample_row reports for an unmasked row that sampled `token` with
// params.logprobs = `logprobs`. Requires vocab ≥ 1, token in [0, vocab), logprobs in
// [0, kMaxLogprobs]. Thread-safe; O(V) plus a partial sort for the alternatives.
SampleResult score_row(const float* logits, int64_t vocab, int32_t token, int32_t logprobs);

}  // namespace simpler::llm
