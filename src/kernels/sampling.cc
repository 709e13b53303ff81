#include "simpler/kernels/sampling.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/argmax_row.h"
#include "kernels/task_names.h"
#include "simpler/base/status.h"
#include "simpler/kernels/kernels.h"
#include "simpler/task/arg_check.h"

namespace simpler::llm {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline uint32_t mulhi(uint32_t a, uint32_t b) {
  return static_cast<uint32_t>((static_cast<uint64_t>(a) * b) >> 32);
}

// Finite and within [lo, hi].
bool in_range(float v, float lo, float hi) { return std::isfinite(v) && v >= lo && v <= hi; }

}  // namespace

// ---- Philox ---------------------------------------------------------------------------------

Philox4x32Counter philox4x32_10(Philox4x32Counter c, Philox4x32Key k) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
  constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      k.v[0] += kW0;
      k.v[1] += kW1;
    }
    const uint32_t hi0 = mulhi(kM0, c.v[0]), lo0 = kM0 * c.v[0];
    const uint32_t hi1 = mulhi(kM1, c.v[2]), lo1 = kM1 * c.v[2];
    c = {{hi1 ^ c.v[1] ^ k.v[0], lo1, hi0 ^ c.v[3] ^ k.v[1], lo0}};
  }
  return c;
}

double philox_uniform(uint64_t seed, uint32_t choice, int64_t position) {
  const uint64_t p = static_cast<uint64_t>(position);
  const Philox4x32Counter out =
      philox4x32_10({{static_cast<uint32_t>(p), static_cast<uint32_t>(p >> 32), choice, 0u}},
                    {{static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)}});
  const uint64_t bits = (static_cast<uint64_t>(out.v[0]) << 32 | out.v[1]) >> 11;
  return static_cast<double>(bits) * 0x1.0p-53;
}

uint64_t SeedAllocator::next() {
  // splitmix64 (Steele, Lea, Flood, "Fast splittable pseudorandom number generators", 2014).
  uint64_t z = base_ + 0x9E3779B97F4A7C15ull * ++n_;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// ---- parameters -----------------------------------------------------------------------------

absl::Status SamplingParams::validate(int64_t vocab_size) const {
  auto bad = [](const char* field, auto value, const char* rule) {
    return absl::InvalidArgumentError(
        absl::StrCat("sampling params: ", field, " must be ", rule, ", got ", value));
  };
  if (version != kSamplingParamsVersion) {
    return bad("version", version, absl::StrCat(kSamplingParamsVersion).c_str());
  }
  if (!(std::isfinite(temperature) && temperature >= 0.0f)) {
    return bad("temperature", temperature, "finite and >= 0 (0 is greedy)");
  }
  if (!(std::isfinite(top_p) && top_p > 0.0f && top_p <= 1.0f)) {
    return bad("top_p", top_p, "in (0, 1] (1 is off)");
  }
  if (top_k < -1) return bad("top_k", top_k, ">= -1 (0 and -1 are off)");
  if (!in_range(min_p, 0.0f, 1.0f)) return bad("min_p", min_p, "in [0, 1] (0 is off)");
  if (!in_range(presence_penalty, -2.0f, 2.0f)) {
    return bad("presence_penalty", presence_penalty, "in [-2, 2] (0 is off)");
  }
  if (!in_range(frequency_penalty, -2.0f, 2.0f)) {
    return bad("frequency_penalty", frequency_penalty, "in [-2, 2] (0 is off)");
  }
  if (!(std::isfinite(repetition_penalty) && repetition_penalty > 0.0f)) {
    return bad("repetition_penalty", repetition_penalty, "finite and > 0 (1 is off)");
  }
  if (logprobs < -1 || logprobs > kMaxLogprobs) {
    return bad("logprobs", logprobs, absl::StrCat("in [-1, ", kMaxLogprobs, "]").c_str());
  }
  if (min_tokens < 0) return bad("min_tokens", min_tokens, ">= 0");
  for (int i = 0; i < kMaxSamplingStopIds; ++i) {
    if (stop_ids[i] < -1 || (stop_ids[i] >= 0 && stop_ids[i] >= vocab_size)) {
      return bad(absl::StrCat("stop_ids[", i, "]").c_str(), stop_ids[i],
                 absl::StrCat("-1 (unused) or in [0, ", vocab_size, ")").c_str());
    }
  }
  if (ignore_eos > 1) return bad("ignore_eos", static_cast<int>(ignore_eos), "0 or 1");
  if (masked > 1) return bad("masked", static_cast<int>(masked), "0 or 1");
  for (int i = 0; i < kMaxSamplingStopIds; ++i) {
    if (((eos_mask >> i) & 1) != 0 && stop_ids[i] < 0) {
      return bad("eos_mask", static_cast<int>(eos_mask),
                 absl::StrCat("bits only for used stop_ids (stop_ids[", i, "] is -1)").c_str());
    }
  }
  return absl::OkStatus();
}

bool stops_on(const SamplingParams& params, int32_t token, int64_t num_generated) {
  if (num_generated < params.min_tokens || token < 0) return false;
  for (int i = 0; i < kMaxSamplingStopIds; ++i) {
    if (params.stop_ids[i] != token) continue;
    const bool eos = ((params.eos_mask >> i) & 1) != 0;
    if (eos && params.ignore_eos != 0) continue;  // ignore_eos disables EOS ids only
    return true;
  }
  return false;
}

// ---- host math ------------------------------------------------------------------------------

void apply_penalties(const SamplingParams& p, const int32_t* counts, int64_t num_generated,
                     float* logits, int64_t vocab) {
  if (num_generated < p.min_tokens) {
    for (int32_t id : p.stop_ids) {
      if (id >= 0 && id < vocab) logits[id] = kNegInf;
    }
  }
  if (counts == nullptr) return;
  const bool rep = p.repetition_penalty != 1.0f;
  const bool freq = p.frequency_penalty != 0.0f;
  const bool pres = p.presence_penalty != 0.0f;
  if (!rep && !freq && !pres) return;
  for (int64_t t = 0; t < vocab; ++t) {
    const int32_t packed = counts[t];
    if (packed == 0) continue;
    const int32_t n = output_count(packed);
    float l = logits[t];
    if (rep) l = l > 0.0f ? l / p.repetition_penalty : l * p.repetition_penalty;
    if (freq) l -= p.frequency_penalty * static_cast<float>(n);
    if (pres && n > 0) l -= p.presence_penalty;
    logits[t] = l;
  }
}

namespace {

// "Weight descending, ties by lower index first" (so ascending order puts the higher index
// first, as a stable ascending sort of the reversed order would).
struct WeightOrder {
  const double* w;
  bool operator()(int64_t a, int64_t b) const { return w[a] != w[b] ? w[a] > w[b] : a < b; }
};

// Unnormalized probabilities exp(l/T − max), then the min_p cut. False (every weight 0) when
// no logit is finite.
bool temperature_weights(const SamplingParams& p, const float* penalized, int64_t vocab,
                         double* w) {
  const double inv_t = 1.0 / static_cast<double>(p.temperature);
  double max_l = -std::numeric_limits<double>::infinity();
  for (int64_t t = 0; t < vocab; ++t) {
    const double l = static_cast<double>(penalized[t]) * inv_t;
    if (l > max_l) max_l = l;  // NaN never wins
  }
  if (!std::isfinite(max_l)) {  // nothing finite: every weight 0 (the caller picks greedily)
    std::fill(w, w + vocab, 0.0);
    return false;
  }
  // Unnormalized probabilities exp(l − max); max weight is 1.
  for (int64_t t = 0; t < vocab; ++t) {
    const double l = static_cast<double>(penalized[t]) * inv_t;
    w[t] = std::isnan(l) ? 0.0 : std::exp(l - max_l);
  }
  // min_p: q ≥ min_p · max(q), i.e. w ≥ min_p (max w = 1).
  if (p.min_p > 0.0f) {
    const double thr = static_cast<double>(p.min_p);
    for (int64_t t = 0; t < vocab; ++t) {
      if (w[t] < thr) w[t] = 0.0;
    }
  }
  return true;
}

// top_k over the survivors in `order`: zeroes and drops those below the k-th largest weight.
void cut_top_k(const SamplingParams& p, double* w, std::vector<int64_t>& order) {
  if (static_cast<int64_t>(order.size()) <= p.top_k) return;
  // The k-th largest weight (exp is monotone: the k-th largest logit); ties with it stay.
  std::nth_element(order.begin(), order.begin() + (p.top_k - 1), order.end(), WeightOrder{w});
  const double kth = w[order[p.top_k - 1]];
  auto kept_end =
      std::partition(order.begin(), order.end(), [&](int64_t t) { return w[t] >= kth; });
  for (auto it = kept_end; it != order.end(); ++it) w[*it] = 0.0;
  order.erase(kept_end, order.end());
}

// top_p over the (non-empty) survivors in `order`: zeroes the smallest tokens while their
// ascending inclusive cumulative probability is ≤ 1 − top_p.
void cut_top_p(const SamplingParams& p, double* w, std::vector<int64_t>& order) {
  const WeightOrder before{w};
  double total = 0.0;
  for (int64_t t : order) total += w[t];
  // Ascending inclusive cumulative sum from the smallest; drop while it is ≤ 1 − top_p.
  const double limit = 1.0 - static_cast<double>(p.top_p);
  // Tokens with probability below limit / n (n survivors) are the smallest ones and together
  // hold less than `limit`, so every prefix sum over them is ≤ limit: they are dropped without
  // sorting (with real vocabularies, nearly all of them). The largest token is never among them.
  const double small = limit / static_cast<double>(order.size()) * total;
  auto big_end =
      std::partition(order.begin(), order.end(), [&](int64_t t) { return w[t] >= small; });
  double cum = 0.0;  // their sum starts the cumulative sum (in partition order, not sorted)
  for (auto it = big_end; it != order.end(); ++it) {
    cum += w[*it] / total;
    w[*it] = 0.0;
  }
  order.erase(big_end, order.end());
  // The kept tokens are a top set: grow a window of the largest m tokens (selection, not a
  // sort) until it holds at least top_p of the mass; then the ascending sum at the largest
  // token outside it is ≤ 1 − top_p, so everything outside is dropped, and only the window is
  // sorted.
  const double need = static_cast<double>(p.top_p) * total;
  for (size_t m = 256; m < order.size(); m *= 4) {
    std::nth_element(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(m - 1), order.end(),
                     before);
    double top_mass = 0.0;
    for (size_t j = 0; j < m; ++j) top_mass += w[order[j]];
    if (top_mass < need) continue;
    for (size_t j = m; j < order.size(); ++j) {
      cum += w[order[j]] / total;
      w[order[j]] = 0.0;
    }
    order.resize(m);
    break;
  }
  std::sort(order.begin(), order.end(), before);
  for (size_t j = order.size(); j-- > 1;) {  // j = 0 (the largest) is always kept
    cum += w[order[j]] / total;
    if (cum > limit) break;
    w[order[j]] = 0.0;
  }
}

// log Σ exp(logits) in f64 over the non-NaN logits (the max itself when none is finite).
double log_sum_exp(const float* logits, int64_t vocab) {
  double max_raw = -std::numeric_limits<double>::infinity();
  for (int64_t t = 0; t < vocab; ++t) {
    max_raw = std::max(max_raw, static_cast<double>(logits[t]));
  }
  double sum = 0.0;
  if (std::isfinite(max_raw)) {
    for (int64_t t = 0; t < vocab; ++t) {
      if (!std::isnan(logits[t])) sum += std::exp(static_cast<double>(logits[t]) - max_raw);
    }
  }
  return std::isfinite(max_raw) ? max_raw + std::log(sum) : max_raw;
}

// The sampled token of the penalized logits `pen`: a weighted draw at temperature, else (or
// when no finite logit survived) the first largest.
int64_t choose_token(const SamplingParams& p, const SampleRowInfo& row, const float* pen,
                     int64_t vocab) {
  if (p.temperature >= kGreedyTemperature) {
    std::vector<double> w(static_cast<size_t>(vocab));
    sampling_weights(p, pen, vocab, w.data());
    double total = 0.0;
    for (double x : w) total += x;
    if (total > 0.0) {
      const double u = philox_uniform(p.seed, static_cast<uint32_t>(row.choice), row.position);
      const double target = u * total;
      double cum = 0.0;
      int64_t last = -1;
      for (int64_t t = 0; t < vocab; ++t) {
        if (w[t] <= 0.0) continue;
        cum += w[t];
        last = t;
        if (cum > target) break;
      }
      return last;  // rounding can leave cum ≤ target at the end: the last survivor
    }
  }
  // greedy, or no finite logit survived: the lowest index of the largest logit (NaN never)
  return argmax_row(pen, vocab, KernelIsa::kAuto);
}

// The top p.logprobs raw logits (NaN lowest, ties by lower index) with their logprobs.
void fill_top_logprobs(const SamplingParams& p, const float* logits, int64_t vocab, double lse,
                       SampleResult& r) {
  const int n = std::min<int64_t>(p.logprobs, vocab);
  std::vector<int64_t> idx(static_cast<size_t>(vocab));
  std::iota(idx.begin(), idx.end(), int64_t{0});
  auto key = [&](int64_t t) { return std::isnan(logits[t]) ? kNegInf : logits[t]; };
  std::partial_sort(idx.begin(), idx.begin() + n, idx.end(), [&](int64_t a, int64_t b) {
    return key(a) != key(b) ? key(a) > key(b) : a < b;
  });
  for (int j = 0; j < n; ++j) {
    r.top_ids[j] = static_cast<int32_t>(idx[j]);
    r.top_logprobs[j] = static_cast<float>(static_cast<double>(logits[idx[j]]) - lse);
  }
}

}  // namespace

void sampling_weights(const SamplingParams& p, const float* penalized, int64_t vocab, double* w) {
  if (!temperature_weights(p, penalized, vocab, w)) return;
  const bool top_k_on = p.top_k > 0 && p.top_k < vocab;
  const bool top_p_on = p.top_p < 1.0f;
  if (!top_k_on && !top_p_on) return;
  // Survivors, in index order.
  std::vector<int64_t> order;
  order.reserve(static_cast<size_t>(vocab));
  for (int64_t t = 0; t < vocab; ++t) {
    if (w[t] > 0.0) order.push_back(t);
  }
  if (top_k_on) cut_top_k(p, w, order);
  if (!top_p_on || order.empty()) return;
  cut_top_p(p, w, order);
}

bool mask_allows_any(const uint32_t* mask, int64_t vocab) {
  for (int64_t w = 0; w < mask_words(vocab); ++w) {
    const int64_t bits = std::min<int64_t>(32, vocab - w * 32);
    const uint32_t live = bits == 32 ? ~uint32_t{0} : (uint32_t{1} << bits) - 1;
    if ((mask[w] & live) != 0) return true;
  }
  return false;
}

SampleResult sample_row(const SamplingParams& p, const SampleRowInfo& row, const float* logits,
                        const int32_t* counts, int64_t vocab, const uint32_t* mask) {
  SampleResult r;
  // 0. The token mask: refused tokens' logits are -inf from here on.
  std::vector<float> masked_copy;
  if (p.masked != 0 && mask != nullptr) {
    masked_copy.assign(logits, logits + vocab);
    for (int64_t t = 0; t < vocab; ++t) {
      if (((mask[t >> 5] >> (t & 31)) & 1) == 0) masked_copy[t] = kNegInf;
    }
    logits = masked_copy.data();
  }
  // 1. Raw logprobs: log_softmax in f64 (not computed at all for logprobs = -1).
  const double lse = p.logprobs >= 0 ? log_sum_exp(logits, vocab) : 0.0;
  // 2–3. Penalties on a copy, when any applies (otherwise the raw logits are read as they are).
  const bool mask_stops = row.num_generated < p.min_tokens;
  const bool penalize =
      counts != nullptr &&
      (p.repetition_penalty != 1.0f || p.frequency_penalty != 0.0f || p.presence_penalty != 0.0f);
  std::vector<float> pen_copy;
  const float* pen = logits;
  if (mask_stops || penalize) {
    pen_copy.assign(logits, logits + vocab);
    apply_penalties(p, counts, row.num_generated, pen_copy.data(), vocab);
    pen = pen_copy.data();
  }
  const int64_t chosen = choose_token(p, row, pen, vocab);
  r.id = static_cast<int32_t>(chosen);
  r.logprob =
      p.logprobs >= 0 ? static_cast<float>(static_cast<double>(logits[chosen]) - lse) : 0.0f;
  if (p.logprobs > 0) fill_top_logprobs(p, logits, vocab, lse, r);
  return r;
}

SampleResult score_row(const float* logits, int64_t vocab, int32_t token, int32_t logprobs) {
  SampleResult r;
  const double lse = log_sum_exp(logits, vocab);
  r.id = token;
  r.logprob = static_cast<float>(static_cast<double>(logits[token]) - lse);
  SamplingParams p;
  p.logprobs = logprobs;
  if (logprobs > 0) fill_top_logprobs(p, logits, vocab, lse, r);
  return r;
}

std::vector<task::Kernel> sampling_kernels() {
  return {{"token_counts", &token_counts_kernel}, {"sample", &sample_kernel}};
}

// ---- token_counts kernel --------------------------------------------------------------------

absl::Status token_counts_kernel(const KernelContext& ctx) {
  constexpr const char* kName = "token_counts";
  const task::ArgChecker c(ctx, kName);
  SIMPLER_RETURN_IF_ERROR(c.count(4));
  SIMPLER_RETURN_IF_ERROR(c.tensor(0, "ids", DataType::kInt32, {-1}));
  const int64_t n = ctx.tensor(0).shape[0];
  SIMPLER_RETURN_IF_ERROR(c.tensor(1, "slots", DataType::kInt32, {n}));
  SIMPLER_RETURN_IF_ERROR(c.tensor(2, "counts", DataType::kInt32, {-1, -1}));
  SIMPLER_RETURN_IF_ERROR(c.scalar(3, "mode"));
  if (ctx.block_dim != 1) {
    return c.error(absl::StrCat("needs block_dim 1, got ", ctx.block_dim));
  }
  const int64_t slots_n = ctx.tensor(2).shape[0];
  const int64_t vocab = ctx.tensor(2).shape[1];
  const uint64_t mode = ctx.scalar(3);
  if (mode > static_cast<uint64_t>(TokenCountsMode::kGenerated)) {
    return c.error(absl::StrCat("unknown mode ", mode));
  }
  const int32_t* ids = ctx.tensor(0).data<const int32_t>();
  const int32_t* slots = ctx.tensor(1).data<const int32_t>();
  int32_t* counts = ctx.tensor(2).data<int32_t>();
  for (int64_t j = 0; j < n; ++j) {
    const int64_t s = slots[j];
    if (s < 0) continue;
    if (s >= slots_n) {
      return c.error(absl::StrCat("entry ", j, ": slot ", s, " is outside [0, ", slots_n, ")"));
    }
    int32_t* row = counts + s * vocab;
    if (mode == static_cast<uint64_t>(TokenCountsMode::kClear)) {
      std::memset(row, 0, sizeof(int32_t) * static_cast<size_t>(vocab));
      continue;
    }
    const int64_t id = ids[j];
    if (id < 0 || id >= vocab) {
      return c.error(absl::StrCat("entry ", j, ": token id ", id, " is outside the vocabulary [0, ",
                                  vocab, ")"));
    }
    if (mode == static_cast<uint64_t>(TokenCountsMode::kPrompt)) {
      row[id] |= 1;
    } else {
      if (row[id] > std::numeric_limits<int32_t>::max() - 2) {
        return c.error(
            absl::StrCat("entry ", j, ": count of token ", id, " in slot ", s, " would overflow"));
      }
      row[id] += 2;
    }
  }
  return absl::OkStatus();
}

TaskArgs token_counts_args(const Tensor& ids, const Tensor& slots, const Tensor& counts,
                           TokenCountsMode mode) {
  TaskArgs a;
  a.add_tensors({ids, slots}, ArgDirection::kIn)
      .add_tensor(counts, ArgDirection::kInOut)
      .add_scalar(static_cast<uint64_t>(mode));
  return a;
}

// ---- sample kernel --------------------------------------------------------------------------

absl::Status sample_kernel(const KernelContext& ctx) {
  constexpr const char* kName = "sample";
  const task::ArgChecker c(ctx, kName);
  const bool has_mask = ctx.num_args == 9;
  SIMPLER_RETURN_IF_ERROR(c.count(has_mask ? 9 : 8));
  SIMPLER_RETURN_IF_ERROR(c.tensor(0, "logits", DataType::kFloat32, {-1, -1}));
  const int64_t rows = ctx.tensor(0).shape[0];
  const int64_t vocab = ctx.tensor(0).shape[1];
  constexpr int64_t kParamBytes = sizeof(SamplingParams);
  SIMPLER_RETURN_IF_ERROR(c.tensor(1, "params", DataType::kUInt8, {rows, kParamBytes}));
  SIMPLER_RETURN_IF_ERROR(c.tensor(2, "rows", DataType::kInt32, {rows, 4}));
  SIMPLER_RETURN_IF_ERROR(c.tensor(3, "counts", DataType::kInt32, {-1, vocab}));
  SIMPLER_RETURN_IF_ERROR(c.tensor(4, "out_ids", DataType::kInt32, {rows}));
  SIMPLER_RETURN_IF_ERROR(c.tensor(5, "out_logprobs", DataType::kFloat32, {rows}));
  SIMPLER_RETURN_IF_ERROR(c.tensor(6, "top_ids", DataType::kInt32, {rows, kMaxLogprobs}));
  SIMPLER_RETURN_IF_ERROR(c.tensor(7, "top_logprobs", DataType::kFloat32, {rows, kMaxLogprobs}));
  if (has_mask) {
    SIMPLER_RETURN_IF_ERROR(c.tensor(8, "mask", DataType::kInt32, {rows, mask_words(vocab)}));
  }
  if (vocab < 1) return c.error("logits have an empty vocabulary dimension");
  if (vocab > std::numeric_limits<int32_t>::max()) {
    return c.error(absl::StrCat("vocabulary ", vocab, " does not fit i32 ids"));
  }
  const int64_t slots_n = ctx.tensor(3).shape[0];
  const float* logits = ctx.tensor(0).data<const float>();
  const uint8_t* params = ctx.tensor(1).data<const uint8_t>();
  const int32_t* info = ctx.tensor(2).data<const int32_t>();
  const int32_t* counts = ctx.tensor(3).data<const int32_t>();
  int32_t* out_ids = ctx.tensor(4).data<int32_t>();
  float* out_lp = ctx.tensor(5).data<float>();
  int32_t* top_ids = ctx.tensor(6).data<int32_t>();
  float* top_lp = ctx.tensor(7).data<float>();
  const BlockRange br = block_range(rows, ctx.block_idx, ctx.block_dim);
  for (int64_t r = br.begin; r < br.end; ++r) {
    SamplingParams p;
    std::memcpy(&p, params + r * kParamBytes, sizeof(p));  // the tensor is only byte-aligned
    if (absl::Status s = p.validate(vocab); !s.ok()) {
      return c.error(absl::StrCat("row ", r, ": ", s.message()));
    }
    SampleRowInfo ri{info[r * 4], info[r * 4 + 1], info[r * 4 + 2], info[r * 4 + 3]};
    if (ri.slot < -1 || ri.slot >= slots_n) {
      return c.error(
          absl::StrCat("row ", r, ": slot ", ri.slot, " is outside [-1, ", slots_n, ")"));
    }
    if (ri.position < 0 || ri.choice < 0 || ri.num_generated < 0) {
      return c.error(absl::StrCat("row ", r, ": position ", ri.position, ", choice ", ri.choice,
                                  " and num_generated ", ri.num_generated, " must be >= 0"));
    }
    const uint32_t* mask = nullptr;
    if (p.masked != 0) {
      if (!has_mask) return c.error(absl::StrCat("row ", r, ": masked, but no mask argument"));
      mask = reinterpret_cast<const uint32_t*>(ctx.tensor(8).data<const int32_t>()) +
             r * mask_words(vocab);
      if (!mask_allows_any(mask, vocab)) {
        return c.error(absl::StrCat("row ", r, ": the token mask allows no token"));
      }
    }
    const SampleResult res = sample_row(
        p, ri, logits + r * vocab, ri.slot >= 0 ? counts + ri.slot * vocab : nullptr, vocab, mask);
    out_ids[r] = res.id;
    out_lp[r] = res.logprob;
    std::copy(std::begin(res.top_ids), std::end(res.top_ids), top_ids + r * kMaxLogprobs);
    std::copy(std::begin(res.top_logprobs), std::end(res.top_logprobs), top_lp + r * kMaxLogprobs);
  }
  return absl::OkStatus();
}

TaskArgs sample_args(const Tensor& logits, const Tensor& params, const Tensor& rows,
                     const Tensor& counts, const Tensor& out_ids, const Tensor& out_logprobs,
                     const Tensor& top_ids, const Tensor& top_logprobs) {
  TaskArgs a;
  a.add_tensors({logits, params, rows, counts}, ArgDirection::kIn)
      .add_tensors({out_ids, out_logprobs, top_ids, top_logprobs}, ArgDirection::kOut);
  return a;
}

TaskArgs sample_args(const Tensor& logits, const Tensor& params, const Tensor& rows,
                     const Tensor& counts, const Tensor& out_ids, const Tensor& out_logprobs,
                     const Tensor& top_ids, const Tensor& top_logprobs, const Tensor& mask) {
  TaskArgs a =
      sample_args(logits, params, rows, counts, out_ids, out_logprobs, top_ids, top_logprobs);
  a.add_tensor(mask, ArgDirection::kIn);
  return a;
}

}  // namespace simpler::llm
