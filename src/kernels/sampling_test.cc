#include "simpler/kernels/sampling.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/kernel_test_util.h"
#include "simpler/kernels/kernels.h"

namespace simpler::llm {
namespace {

using testing::run_blocks;
using testing::view;

std::vector<float> random_logits(int64_t vocab, uint32_t seed, float scale = 2.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(static_cast<size_t>(vocab));
  for (float& x : v) x = dist(rng);
  return v;
}

// A batch for sample_kernel: R rows over vocabulary V and S count slots.
struct Batch {
  Batch(int64_t rows, int64_t vocab, int64_t slots)
      : r(rows),
        v(vocab),
        logits(static_cast<size_t>(rows * vocab)),
        params(static_cast<size_t>(rows) * sizeof(SamplingParams)),
        info(static_cast<size_t>(rows * 4)),
        counts(static_cast<size_t>(std::max<int64_t>(slots, 1) * vocab)),
        s(std::max<int64_t>(slots, 1)),
        ids(static_cast<size_t>(rows), -7),
        lp(static_cast<size_t>(rows)),
        top_ids(static_cast<size_t>(rows * kMaxLogprobs)),
        top_lp(static_cast<size_t>(rows * kMaxLogprobs)) {}

  void set_row(int64_t row, const std::vector<float>& l, const SamplingParams& p,
               const SampleRowInfo& ri) {
    std::copy(l.begin(), l.end(), logits.begin() + row * v);
    std::memcpy(params.data() + row * sizeof(SamplingParams), &p, sizeof(p));
    info[row * 4] = ri.slot;
    info[row * 4 + 1] = ri.position;
    info[row * 4 + 2] = ri.choice;
    info[row * 4 + 3] = ri.num_generated;
  }

  TaskArgs args() {
    return sample_args(view(logits, {r, v}),
                       view(params, {r, static_cast<int64_t>(sizeof(SamplingParams))}),
                       view(info, {r, 4}), view(counts, {s, v}), view(ids, {r}), view(lp, {r}),
                       view(top_ids, {r, kMaxLogprobs}), view(top_lp, {r, kMaxLogprobs}));
  }

  int64_t r, v;
  std::vector<float> logits;
  std::vector<uint8_t> params;
  std::vector<int32_t> info;
  std::vector<int32_t> counts;
  int64_t s;
  std::vector<int32_t> ids;
  std::vector<float> lp;
  std::vector<int32_t> top_ids;
  std::vector<float> top_lp;
};

// ---- chi-square machinery ---------------------------------------------------------------------
// Upper regularized incomplete gamma Q(a, x) (series for x < a + 1, Lentz continued fraction
// otherwise; Numerical Recipes 3rd ed. §6.2). The chi-square p-value of statistic X with k
// degrees of freedom is Q(k/2, X/2).
double gamma_q(double a, double x) {
  if (x <= 0.0) return 1.0;
  const double gln = std::lgamma(a);
  if (x < a + 1.0) {
    double ap = a, del = 1.0 / a, sum = del;
    for (int n = 0; n < 1000; ++n) {
      ap += 1.0;
      del *= x / ap;
      sum += del;
      if (std::abs(del) < std::abs(sum) * 1e-15) break;
    }
    return 1.0 - sum * std::exp(-x + a * std::log(x) - gln);
  }
  constexpr double kTiny = 1e-300;
  double b = x + 1.0 - a, c = 1.0 / kTiny, d = 1.0 / b, h = d;
  for (int i = 1; i < 1000; ++i) {
    const double an = -i * (i - a);
    b += 2.0;
    d = an * d + b;
    if (std::abs(d) < kTiny) d = kTiny;
    c = b + an / c;
    if (std::abs(c) < kTiny) c = kTiny;
    d = 1.0 / d;
    const double del = d * c;
    h *= del;
    if (std::abs(del - 1.0) < 1e-15) break;
  }
  return std::exp(-x + a * std::log(x) - gln) * h;
}

TEST(ChiSquare, PValueMatchesTabulatedCriticalValues) {
  // Critical values at p = 0.05 and 0.001 (NIST/SEMATECH e-Handbook, table 1.3.6.7.4).
  EXPECT_NEAR(gamma_q(1.0 / 2, 3.841 / 2), 0.05, 1e-4);
  EXPECT_NEAR(gamma_q(10.0 / 2, 18.307 / 2), 0.05, 1e-4);
  EXPECT_NEAR(gamma_q(10.0 / 2, 29.588 / 2), 0.001, 1e-5);
  EXPECT_NEAR(gamma_q(50.0 / 2, 86.661 / 2), 0.001, 1e-5);
}

// The exact distribution, written independently of sampling.cc: the full vLLM pipeline on a
// sorted copy in f64 (temperature, min_p against the max probability, top-k by threshold,
// top-p on the ascending cumulative sum).
std::vector<double> exact_probs(const std::vector<float>& logits, const SamplingParams& p) {
  const size_t v = logits.size();
  std::vector<double> x(v);
  for (size_t t = 0; t < v; ++t) x[t] = static_cast<double>(logits[t]) / p.temperature;
  auto softmax = [](const std::vector<double>& y) {
    const double m = *std::max_element(y.begin(), y.end());
    std::vector<double> q(y.size());
    double s = 0;
    for (size_t i = 0; i < y.size(); ++i) s += q[i] = std::exp(y[i] - m);
    for (double& e : q) e /= s;
    return q;
  };
  const double ninf = -std::numeric_limits<double>::infinity();
  std::vector<double> q = softmax(x);
  const double qmax = *std::max_element(q.begin(), q.end());
  for (size_t t = 0; t < v; ++t) {
    if (q[t] < p.min_p * qmax) x[t] = ninf;
  }
  if (p.top_k > 0 && static_cast<size_t>(p.top_k) < v) {
    std::vector<double> sorted = x;
    std::sort(sorted.rbegin(), sorted.rend());
    const double kth = sorted[p.top_k - 1];
    for (double& e : x) {
      if (e < kth) e = ninf;
    }
  }
  if (p.top_p < 1.0f) {
    std::vector<size_t> asc(v);
    std::iota(asc.begin(), asc.end(), size_t{0});
    std::sort(asc.begin(), asc.end(),
              [&](size_t a, size_t b) { return x[a] != x[b] ? x[a] < x[b] : a > b; });
    q = softmax(x);
    double cum = 0;
    for (size_t j = 0; j + 1 < v; ++j) {
      cum += q[asc[j]];
      if (cum <= 1.0 - p.top_p) x[asc[j]] = ninf;
    }
  }
  return softmax(x);
}

// Draws `n` tokens at positions 0 … n−1 and returns the chi-square p-value against `probs`:
// bins with expected count ≥ 5 stand alone, the rest are pooled into one bin (kept if its
// expected count is ≥ 5); a token with probability 0 that is drawn fails the test outright.
// `expected` defaults to `p` (the sampler's own parameters).
double chi_square_p_value(const std::vector<float>& logits, const SamplingParams& p, int n,
                          const SamplingParams* expected = nullptr) {
  const std::vector<double> probs = exact_probs(logits, expected ? *expected : p);
  std::vector<int64_t> hist(logits.size());
  for (int i = 0; i < n; ++i) {
    const SampleResult r =
        sample_row(p, SampleRowInfo{-1, i, 0, 0}, logits.data(), nullptr, logits.size());
    EXPECT_GT(probs[r.id], 0.0) << "token " << r.id << " has probability 0";
    ++hist[r.id];
  }
  double stat = 0, pooled_e = 0, pooled_o = 0;
  int bins = 0;
  for (size_t t = 0; t < logits.size(); ++t) {
    const double e = probs[t] * n;
    if (e >= 5.0) {
      stat += (hist[t] - e) * (hist[t] - e) / e;
      ++bins;
    } else {
      pooled_e += e;
      pooled_o += hist[t];
    }
  }
  if (pooled_e >= 5.0) {
    stat += (pooled_o - pooled_e) * (pooled_o - pooled_e) / pooled_e;
    ++bins;
  }
  EXPECT_GE(bins, 2);
  return gamma_q((bins - 1) / 2.0, stat / 2.0);
}

// ---- Philox -------------------------------------------------------------------------------------

TEST(Philox, MatchesRandom123KnownAnswerVectors) {
  // Random123 kat_vectors, philox4x32 10 (checked with an independent Python implementation).
  Philox4x32Counter a = philox4x32_10({{0, 0, 0, 0}}, {{0, 0}});
  EXPECT_THAT(a.v, ::testing::ElementsAre(0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u));
  Philox4x32Counter b = philox4x32_10({{0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu}},
                                      {{0xffffffffu, 0xffffffffu}});
  EXPECT_THAT(b.v, ::testing::ElementsAre(0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu));
  Philox4x32Counter c = philox4x32_10({{0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u}},
                                      {{0xa4093822u, 0x299f31d0u}});
  EXPECT_THAT(c.v, ::testing::ElementsAre(0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u));
}

TEST(Philox, UniformUsesTheTop53BitsOfWordsZeroAndOne) {
  const uint64_t seed = 0x0123456789abcdefull;
  const Philox4x32Counter out = philox4x32_10({{77, 0, 3, 0}}, {{0x89abcdefu, 0x01234567u}});
  const double u = philox_uniform(seed, 3, 77);
  const uint64_t bits = (static_cast<uint64_t>(out.v[0]) << 32 | out.v[1]) >> 11;
  EXPECT_EQ(u, static_cast<double>(bits) / 9007199254740992.0);
  EXPECT_GE(u, 0.0);
  EXPECT_LT(u, 1.0);
  // Finer than 2^-24: over many positions the low bits are used.
  bool below_f32_grid = false;
  for (int64_t p = 0; p < 64 && !below_f32_grid; ++p) {
    const double v = philox_uniform(seed, 0, p);
    below_f32_grid = v * 16777216.0 != static_cast<double>(static_cast<uint64_t>(v * 16777216.0));
  }
  EXPECT_TRUE(below_f32_grid);
}

TEST(SeedAllocator, HandsOutDistinctSeedsAndIsDeterministicForABase) {
  SeedAllocator a(42), b(42);
  std::set<uint64_t> seen;
  for (int i = 0; i < 10000; ++i) {
    const uint64_t s = a.next();
    EXPECT_EQ(s, b.next());
    EXPECT_TRUE(seen.insert(s).second) << "seed repeated at call " << i;
  }
  SeedAllocator fresh1, fresh2;
  EXPECT_NE(fresh1.next(), fresh2.next());
}

// ---- parameters -------------------------------------------------------------------------------

TEST(SamplingParams, DefaultsAreValidAndPlain) {
  EXPECT_TRUE(SamplingParams{}.validate(10).ok());
  EXPECT_EQ(SamplingParams{}.top_k, 0);
}

TEST(SamplingParams, ValidateNamesTheFieldAndValue) {
  struct Case {
    void (*edit)(SamplingParams&);
    const char* message;
  };
  const Case cases[] = {
      {[](SamplingParams& p) { p.temperature = -0.5f; },
       "sampling params: temperature must be finite and >= 0 (0 is greedy), got -0.5"},
      {[](SamplingParams& p) { p.temperature = std::nanf(""); },
       "sampling params: temperature must be finite and >= 0 (0 is greedy), got nan"},
      {[](SamplingParams& p) { p.top_p = 0.0f; },
       "sampling params: top_p must be in (0, 1] (1 is off), got 0"},
      {[](SamplingParams& p) { p.top_p = 1.5f; },
       "sampling params: top_p must be in (0, 1] (1 is off), got 1.5"},
      {[](SamplingParams& p) { p.top_k = -2; },
       "sampling params: top_k must be >= -1 (0 and -1 are off), got -2"},
      {[](SamplingParams& p) { p.min_p = 1.25f; },
       "sampling params: min_p must be in [0, 1] (0 is off), got 1.25"},
      {[](SamplingParams& p) { p.presence_penalty = 2.5f; },
       "sampling params: presence_penalty must be in [-2, 2] (0 is off), got 2.5"},
      {[](SamplingParams& p) { p.frequency_penalty = -3.0f; },
       "sampling params: frequency_penalty must be in [-2, 2] (0 is off), got -3"},
      {[](SamplingParams& p) { p.repetition_penalty = 0.0f; },
       "sampling params: repetition_penalty must be finite and > 0 (1 is off), got 0"},
      {[](SamplingParams& p) { p.logprobs = 21; },
       "sampling params: logprobs must be in [-1, 20], got 21"},
      {[](SamplingParams& p) { p.logprobs = -2; },
       "sampling params: logprobs must be in [-1, 20], got -2"},
      {[](SamplingParams& p) { p.min_tokens = -1; },
       "sampling params: min_tokens must be >= 0, got -1"},
      {[](SamplingParams& p) { p.stop_ids[2] = 10; },
       "sampling params: stop_ids[2] must be -1 (unused) or in [0, 10), got 10"},
      {[](SamplingParams& p) { p.ignore_eos = 2; },
       "sampling params: ignore_eos must be 0 or 1, got 2"},
      {[](SamplingParams& p) { p.version = 9; }, "sampling params: version must be 3, got 9"},
      {[](SamplingParams& p) { p.eos_mask = 4; },
       "sampling params: eos_mask must be bits only for used stop_ids (stop_ids[2] is -1), got 4"},
  };
  for (const Case& c : cases) {
    SamplingParams p;
    c.edit(p);
    const absl::Status s = p.validate(10);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.message;
    EXPECT_EQ(s.message(), c.message);
  }
  SamplingParams off;
  off.top_k = -1;
  EXPECT_TRUE(off.validate(10).ok()) << "-1 is vLLM's top_k off";
}

TEST(StopsOn, StopIdsEndTheRequestAfterMinTokensAndIgnoreEosDisablesOnlyEos) {
  SamplingParams p;
  p.stop_ids[0] = 5;  // EOS
  p.stop_ids[1] = 9;  // the request's own stop_token_id
  p.eos_mask = 1;
  p.min_tokens = 3;
  EXPECT_FALSE(stops_on(p, 5, 2));
  EXPECT_TRUE(stops_on(p, 9, 3));
  EXPECT_TRUE(stops_on(p, 5, 3));
  EXPECT_FALSE(stops_on(p, 4, 10));
  EXPECT_FALSE(stops_on(p, -1, 10)) << "-1 marks unused entries, never a stop";
  p.ignore_eos = 1;
  EXPECT_FALSE(stops_on(p, 5, 10)) << "ignore_eos disables EOS";
  EXPECT_TRUE(stops_on(p, 9, 10)) << "but not the request's own stop ids (vLLM check_stop)";
  EXPECT_FALSE(stops_on(p, 9, 2)) << "min_tokens still applies";
}

// ---- distribution ------------------------------------------------------------------------------

TEST(SampleRow, HistogramsPassChiSquareAgainstExactProbabilities) {
  const std::vector<float> logits = random_logits(64, 7, 1.5f);
  struct Setting {
    float temperature, top_p, min_p;
    int32_t top_k;
  };
  const Setting settings[] = {
      {1.0f, 1.0f, 0.0f, 0},  {0.7f, 1.0f, 0.0f, 10},  {1.3f, 0.8f, 0.0f, 0},
      {1.0f, 1.0f, 0.05f, 0}, {0.9f, 0.9f, 0.02f, 20}, {2.0f, 0.5f, 0.0f, -1},
  };
  for (const Setting& s : settings) {
    SamplingParams p;
    p.seed = 20260101;
    p.temperature = s.temperature;
    p.top_p = s.top_p;
    p.min_p = s.min_p;
    p.top_k = s.top_k;
    const double pv = chi_square_p_value(logits, p, 20000);
    EXPECT_GT(pv, 1e-3) << "temperature " << s.temperature << " top_k " << s.top_k << " top_p "
                        << s.top_p << " min_p " << s.min_p;
  }
}

TEST(SampleRow, HistogramPassesChiSquareWhenTopPCutsAWideVocabulary) {
  // 64 heads holding about half the mass and 256 tails holding the rest, each tail above the
  // (1 − top_p) / S prefilter: top-p 0.5 takes the window path and keeps about the heads.
  std::mt19937 rng(17);
  std::normal_distribution<float> noise(0.0f, 1.0f);
  std::vector<float> logits;
  for (int i = 0; i < 64; ++i) logits.push_back(std::log(0.5f / 64) + 0.2f * noise(rng));
  for (int i = 0; i < 256; ++i) logits.push_back(std::log(0.5f / 256) + 0.05f * noise(rng));
  std::shuffle(logits.begin(), logits.end(), rng);
  SamplingParams p;
  p.seed = 77;
  p.top_p = 0.5f;
  const std::vector<double> probs = exact_probs(logits, p);
  const auto support = std::count_if(probs.begin(), probs.end(), [](double q) { return q > 0; });
  EXPECT_GE(support, 60);
  EXPECT_LE(support, 70);
  EXPECT_GT(chi_square_p_value(logits, p, 20000), 1e-3);
}

TEST(SampleRow, ChiSquareRejectsASlightlyWrongTemperature) {
  const std::vector<float> logits = random_logits(64, 7, 1.5f);
  SamplingParams p;
  p.seed = 20260101;
  SamplingParams wrong = p;
  wrong.temperature = 1.1f;
  EXPECT_LT(chi_square_p_value(logits, p, 20000, &wrong), 1e-3) << "the test has power";
}

TEST(SampleRow, FiltersKeepExactlyTheSupportTheFormulasGive) {
  const std::vector<float> logits = random_logits(64, 11);
  SamplingParams p;
  p.temperature = 0.8f;
  p.top_k = 7;
  std::vector<double> w(64);
  sampling_weights(p, logits.data(), 64, w.data());
  EXPECT_EQ(std::count_if(w.begin(), w.end(), [](double x) { return x > 0; }), 7);
  p.top_k = 0;
  p.min_p = 0.5f;
  sampling_weights(p, logits.data(), 64, w.data());
  const std::vector<double> exact = exact_probs(logits, p);
  for (size_t t = 0; t < 64; ++t) EXPECT_EQ(w[t] > 0, exact[t] > 0) << "token " << t;
  // A large vocabulary, where top-p drops most tokens without sorting them.
  for (float top_p : {0.5f, 0.9f, 0.99f}) {
    const std::vector<float> big = random_logits(5000, 12, 3.0f);
    SamplingParams q;
    q.top_p = top_p;
    q.top_k = top_p < 0.9f ? 0 : 400;
    q.temperature = 0.9f;
    std::vector<double> wb(big.size());
    sampling_weights(q, big.data(), static_cast<int64_t>(big.size()), wb.data());
    const std::vector<double> eb = exact_probs(big, q);
    int64_t support = 0;
    for (size_t t = 0; t < big.size(); ++t) {
      EXPECT_EQ(wb[t] > 0, eb[t] > 0) << "top_p " << top_p << " token " << t;
      support += wb[t] > 0;
    }
    EXPECT_GT(support, 1) << "top_p " << top_p;
  }
}

TEST(SampleRow, TopKOneAndTinyTopPEqualGreedy) {
  for (uint32_t trial = 0; trial < 50; ++trial) {
    const std::vector<float> logits = random_logits(300, 100 + trial);
    SamplingParams greedy;
    greedy.temperature = 0.0f;
    const int32_t want =
        sample_row(greedy, SampleRowInfo{-1, 0, 0, 0}, logits.data(), nullptr, 300).id;
    EXPECT_EQ(want, std::max_element(logits.begin(), logits.end()) - logits.begin());
    SamplingParams k1;
    k1.top_k = 1;
    k1.seed = trial;
    SamplingParams tiny_p;
    tiny_p.top_p = 1e-6f;
    tiny_p.temperature = 1.7f;
    tiny_p.seed = trial;
    for (int32_t pos = 0; pos < 20; ++pos) {
      EXPECT_EQ(sample_row(k1, SampleRowInfo{-1, pos, 0, 0}, logits.data(), nullptr, 300).id, want);
      EXPECT_EQ(sample_row(tiny_p, SampleRowInfo{-1, pos, 0, 0}, logits.data(), nullptr, 300).id,
                want);
    }
  }
}

// ---- determinism
// ----------------------------------------------------------------------------------

TEST(SampleKernel, SameSeedChoiceAndPositionGiveTheSameTokenInAnyRowOfAnyBatch) {
  constexpr int64_t kV = 50;
  const std::vector<float> target_logits = random_logits(kV, 3, 0.5f);  // flat: many candidates
  SamplingParams target;
  target.seed = 987654321;
  target.temperature = 1.0f;
  for (int32_t pos = 0; pos < 40; ++pos) {
    const int32_t alone =
        sample_row(target, SampleRowInfo{-1, pos, 2, 0}, target_logits.data(), nullptr, kV).id;
    for (int64_t rows : {1, 3, 8}) {
      for (int64_t where = 0; where < rows; ++where) {
        Batch b(rows, kV, 1);
        for (int64_t r = 0; r < rows; ++r) {
          SamplingParams other;
          other.seed = 1000 + r;
          other.top_k = 5;
          b.set_row(r, random_logits(kV, 50 + r), other, SampleRowInfo{-1, pos + 3, 0, 0});
        }
        b.set_row(where, target_logits, target, SampleRowInfo{-1, pos, 2, 0});
        for (int32_t block_dim : {1, 2}) {
          ASSERT_TRUE(run_blocks(&sample_kernel, b.args(), block_dim).ok());
          EXPECT_EQ(b.ids[where], alone) << "position " << pos << " row " << where << " of " << rows
                                         << ", block_dim " << block_dim;
        }
      }
    }
  }
}

TEST(SampleRow, DifferentChoicesDrawFromDifferentStreams) {
  constexpr int64_t kV = 64;
  const std::vector<float> logits(kV, 0.0f);  // uniform: the token is floor(u · 64)
  SamplingParams p;
  p.seed = 5;
  int same = 0;
  for (int32_t pos = 0; pos < 1000; ++pos) {
    const int32_t a = sample_row(p, SampleRowInfo{-1, pos, 0, 0}, logits.data(), nullptr, kV).id;
    const int32_t b = sample_row(p, SampleRowInfo{-1, pos, 1, 0}, logits.data(), nullptr, kV).id;
    EXPECT_EQ(a, static_cast<int32_t>(philox_uniform(5, 0, pos) * 64));
    EXPECT_NE(philox_uniform(5, 0, pos), philox_uniform(5, 1, pos));
    same += a == b;
  }
  EXPECT_LT(same, 50) << "independent streams agree about 1000/64 ≈ 16 times";
  EXPECT_NE(philox_uniform(5, 0, 0), philox_uniform(6, 0, 0)) << "seeds key the stream";
}

// ---- penalties, min_tokens, logprobs
// --------------------------------------------------------------

TEST(ApplyPenalties, FollowVllmFormulas) {
  std::vector<float> logits = {2.0f, -1.0f, 3.0f, 0.5f, -2.0f};
  // token 0: prompt only; token 1: generated twice; token 2: prompt + generated once.
  const std::vector<int32_t> counts = {1, 4, 3, 0, 0};
  SamplingParams p;
  p.repetition_penalty = 2.0f;
  p.frequency_penalty = 0.25f;
  p.presence_penalty = 0.5f;
  apply_penalties(p, counts.data(), 3, logits.data(), 5);
  EXPECT_FLOAT_EQ(logits[0], 1.0f);                          // 2 / 2
  EXPECT_FLOAT_EQ(logits[1], -1.0f * 2 - 0.25f * 2 - 0.5f);  // negative: times r
  EXPECT_FLOAT_EQ(logits[2], 3.0f / 2 - 0.25f - 0.5f);
  EXPECT_FLOAT_EQ(logits[3], 0.5f);
  EXPECT_FLOAT_EQ(logits[4], -2.0f);
}

TEST(SampleRow, MinTokensMasksStopIdsUntilReached) {
  std::vector<float> logits = {0.0f, 1.0f, 9.0f, 8.0f};  // stop id 2 is the greedy pick
  SamplingParams p;
  p.temperature = 0.0f;
  p.stop_ids[0] = 2;
  p.min_tokens = 2;
  EXPECT_EQ(sample_row(p, SampleRowInfo{-1, 5, 0, 0}, logits.data(), nullptr, 4).id, 3);
  EXPECT_EQ(sample_row(p, SampleRowInfo{-1, 6, 0, 1}, logits.data(), nullptr, 4).id, 3);
  EXPECT_EQ(sample_row(p, SampleRowInfo{-1, 7, 0, 2}, logits.data(), nullptr, 4).id, 2);
  p.temperature = 1.0f;
  for (int32_t pos = 0; pos < 200; ++pos) {
    EXPECT_NE(sample_row(p, SampleRowInfo{-1, pos, 0, 1}, logits.data(), nullptr, 4).id, 2);
  }
}

TEST(SampleRow, LogprobsAreOfTheRawLogitsWithTopAlternatives) {
  std::vector<float> logits = {1.0f, 3.0f, 3.0f, -1.0f, 0.0f, 2.0f, 0.5f};
  SamplingParams p;
  p.temperature = 0.0f;
  p.repetition_penalty = 100.0f;  // pushes token 1 down: greedy picks token 2
  p.logprobs = 3;
  std::vector<int32_t> counts(7, 0);
  counts[1] = 1;
  const SampleResult r = sample_row(p, SampleRowInfo{0, 0, 0, 0}, logits.data(), counts.data(), 7);
  double lse = 0;
  for (float l : logits) lse += std::exp(static_cast<double>(l));
  lse = std::log(lse);
  EXPECT_EQ(r.id, 2);
  EXPECT_NEAR(r.logprob, 3.0 - lse, 1e-6);
  EXPECT_THAT(std::vector<int32_t>(std::begin(r.top_ids), std::begin(r.top_ids) + 5),
              ::testing::ElementsAre(1, 2, 5, -1, -1));
  EXPECT_NEAR(r.top_logprobs[0], 3.0 - lse, 1e-6);
  EXPECT_NEAR(r.top_logprobs[2], 2.0 - lse, 1e-6);
  EXPECT_EQ(r.top_logprobs[3], -std::numeric_limits<float>::infinity());
}

TEST(SampleRow, TwentyTopAlternativesComeInOrder) {
  std::vector<float> logits(30);
  for (int t = 0; t < 30; ++t) logits[t] = static_cast<float>((t * 7) % 30);  // a permutation
  SamplingParams p;
  p.temperature = 0.0f;
  p.logprobs = 20;
  ASSERT_TRUE(p.validate(30).ok());
  const SampleResult r = sample_row(p, SampleRowInfo{-1, 0, 0, 0}, logits.data(), nullptr, 30);
  for (int k = 0; k < 20; ++k) {
    ASSERT_GE(r.top_ids[k], 0) << k;
    EXPECT_EQ(logits[r.top_ids[k]], 29.0f - k) << "alternative " << k;
  }
}

// logprobs = -1 skips the log-sum-exp: the same token, no logprob, no alternatives; with
// penalties off the raw logits are read in place and give what a penalized copy gives.
TEST(SampleRow, NoLogprobsGivesTheSameTokens) {
  std::vector<float> logits(300);
  for (size_t i = 0; i < logits.size(); ++i) logits[i] = std::sin(0.37f * static_cast<float>(i));
  for (float temperature : {0.0f, 0.8f}) {
    for (int32_t position = 0; position < 20; ++position) {
      SamplingParams with, without;
      with.temperature = without.temperature = temperature;
      with.seed = without.seed = 5;
      with.logprobs = 0;
      without.logprobs = -1;
      const SampleRowInfo row{-1, position, 0, 0};
      const SampleResult a = sample_row(with, row, logits.data(), nullptr, 300);
      const SampleResult b = sample_row(without, row, logits.data(), nullptr, 300);
      EXPECT_EQ(a.id, b.id) << "temperature " << temperature << " position " << position;
      EXPECT_LT(a.logprob, 0.0f);
      EXPECT_EQ(b.logprob, 0.0f);
      EXPECT_EQ(b.top_ids[0], -1);
    }
  }
}

// ---- kernels ------------------------------------------------------------------------------------

TEST(SamplingKernels, ListsTokenCountsThenSample) {
  const std::vector<task::Kernel> k = sampling_kernels();
  ASSERT_EQ(k.size(), 2u);
  EXPECT_EQ(k[0].name, "token_counts");
  EXPECT_EQ(k[0].fn, &token_counts_kernel);
  EXPECT_EQ(k[1].name, "sample");
  EXPECT_EQ(k[1].fn, &sample_kernel);
}

TEST(TokenCountsKernel, RecordsPromptAndGeneratedTokensAndClearsSlots) {
  std::vector<int32_t> counts(2 * 6, 0);
  std::vector<int32_t> ids = {1, 1, 4, 2};
  std::vector<int32_t> slots = {0, 0, 1, -1};
  ASSERT_TRUE(run_blocks(&token_counts_kernel,
                         token_counts_args(view(ids, {4}), view(slots, {4}), view(counts, {2, 6}),
                                           TokenCountsMode::kPrompt),
                         1)
                  .ok());
  std::vector<int32_t> gen_ids = {1, 3, 3};
  std::vector<int32_t> gen_slots = {0, 0, 0};
  ASSERT_TRUE(run_blocks(&token_counts_kernel,
                         token_counts_args(view(gen_ids, {3}), view(gen_slots, {3}),
                                           view(counts, {2, 6}), TokenCountsMode::kGenerated),
                         1)
                  .ok());
  EXPECT_THAT(counts, ::testing::ElementsAre(0, 3, 0, 4, 0, 0, 0, 0, 0, 0, 1, 0));
  EXPECT_EQ(output_count(counts[1]), 1);
  EXPECT_TRUE(in_prompt(counts[1]));
  EXPECT_EQ(output_count(counts[3]), 2);
  std::vector<int32_t> clear_slots = {1};
  ASSERT_TRUE(run_blocks(&token_counts_kernel,
                         token_counts_args(view(gen_ids, {1}), view(clear_slots, {1}),
                                           view(counts, {2, 6}), TokenCountsMode::kClear),
                         1)
                  .ok());
  EXPECT_THAT(counts, ::testing::ElementsAre(0, 3, 0, 4, 0, 0, 0, 0, 0, 0, 0, 0));
}

TEST(TokenCountsKernel, RefusesBadSlotsIdsAndModesNamingTheEntry) {
  std::vector<int32_t> counts(2 * 6, 0);
  std::vector<int32_t> ids = {1, 6};
  std::vector<int32_t> slots = {0, 0};
  absl::Status s = run_blocks(&token_counts_kernel,
                              token_counts_args(view(ids, {2}), view(slots, {2}),
                                                view(counts, {2, 6}), TokenCountsMode::kGenerated),
                              1);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "token_counts: entry 1: token id 6 is outside the vocabulary [0, 6)");
  slots = {2, 0};
  s = run_blocks(&token_counts_kernel,
                 token_counts_args(view(ids, {2}), view(slots, {2}), view(counts, {2, 6}),
                                   TokenCountsMode::kPrompt),
                 1);
  EXPECT_EQ(s.message(), "token_counts: entry 0: slot 2 is outside [0, 2)");
  s = run_blocks(&token_counts_kernel,
                 token_counts_args(view(ids, {2}), view(slots, {2}), view(counts, {2, 6}),
                                   static_cast<TokenCountsMode>(7)),
                 1);
  EXPECT_EQ(s.message(), "token_counts: unknown mode 7");
  s = run_blocks(&token_counts_kernel,
                 token_counts_args(view(ids, {2}), view(slots, {2}), view(counts, {2, 6}),
                                   TokenCountsMode::kPrompt),
                 2);
  EXPECT_EQ(s.message(), "token_counts: needs block_dim 1, got 2");
}

TEST(SampleKernel, WritesEveryRowAndUsesTheRowsCountSlot) {
  constexpr int64_t kV = 8;
  Batch b(3, kV, 2);
  std::vector<float> l = {0, 5, 4, 0, 0, 0, 0, 0};
  SamplingParams greedy;
  greedy.temperature = 0.0f;
  greedy.repetition_penalty = 10.0f;
  greedy.logprobs = 2;
  b.counts[1 * kV + 1] = 2;  // slot 1 generated token 1 once
  b.set_row(0, l, greedy, SampleRowInfo{-1, 0, 0, 0});
  b.set_row(1, l, greedy, SampleRowInfo{1, 0, 0, 1});
  b.set_row(2, l, greedy, SampleRowInfo{0, 0, 0, 1});
  ASSERT_TRUE(run_blocks(&sample_kernel, b.args(), 2).ok());
  EXPECT_THAT(b.ids, ::testing::ElementsAre(1, 2, 1));
  EXPECT_THAT(std::vector<int32_t>(b.top_ids.begin(), b.top_ids.begin() + 5),
              ::testing::ElementsAre(1, 2, -1, -1, -1));
  EXPECT_NEAR(b.lp[1] - b.lp[0], -1.0f, 1e-6) << "logprobs stay raw: 4 − 5";
}

TEST(SampleKernel, RefusesInvalidRowsNamingTheRowAndField) {
  constexpr int64_t kV = 8;
  Batch b(2, kV, 1);
  SamplingParams ok;
  SamplingParams bad;
  bad.top_p = 0.0f;
  b.set_row(0, std::vector<float>(kV, 0.0f), ok, SampleRowInfo{-1, 0, 0, 0});
  b.set_row(1, std::vector<float>(kV, 0.0f), bad, SampleRowInfo{-1, 0, 0, 0});
  absl::Status s = run_blocks(&sample_kernel, b.args(), 1);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(),
            "sample: row 1: sampling params: top_p must be in (0, 1] (1 is off), got 0");
  b.set_row(1, std::vector<float>(kV, 0.0f), ok, SampleRowInfo{1, 0, 0, 0});
  s = run_blocks(&sample_kernel, b.args(), 1);
  EXPECT_EQ(s.message(), "sample: row 1: slot 1 is outside [-1, 1)");
  b.set_row(1, std::vector<float>(kV, 0.0f), ok, SampleRowInfo{0, -3, 0, 0});
  s = run_blocks(&sample_kernel, b.args(), 1);
  EXPECT_EQ(s.message(), "sample: row 1: position -3, choice 0 and num_generated 0 must be >= 0");
}

TEST(SampleRow, AMaskedRowNeverDrawsARefusedTokenAndKeepsTheSeededStream) {
  constexpr int64_t kV = 70;  // three mask words, the last one partial
  std::vector<float> logits(kV);
  for (int64_t t = 0; t < kV; ++t) logits[t] = static_cast<float>((t * 37) % 11) * 0.5f;
  std::vector<uint32_t> mask(mask_words(kV), 0);
  const std::vector<int32_t> allowed_ids = {3, 31, 32, 50, 69};
  for (int32_t t : allowed_ids) mask[t / 32] |= uint32_t{1} << (t % 32);
  SamplingParams p;
  p.temperature = 1.5f;
  p.top_k = 3;
  p.logprobs = 2;
  p.masked = 1;
  std::set<int32_t> seen;
  for (int pos = 0; pos < 2000; ++pos) {
    const SampleResult r =
        sample_row(p, SampleRowInfo{-1, pos, 0, 0}, logits.data(), nullptr, kV, mask.data());
    ASSERT_THAT(allowed_ids, ::testing::Contains(r.id)) << "position " << pos;
    seen.insert(r.id);
    // The same draw again (seed, choice, position): the mask keeps the stream deterministic.
    ASSERT_EQ(
        sample_row(p, SampleRowInfo{-1, pos, 0, 0}, logits.data(), nullptr, kV, mask.data()).id,
        r.id);
  }
  EXPECT_EQ(seen.size(), 3u) << "top_k 3 applies among the allowed tokens";
  // Greedy takes the best allowed token; logprobs are those of the masked logits.
  SamplingParams greedy = p;
  greedy.temperature = 0.0f;
  const SampleResult g =
      sample_row(greedy, SampleRowInfo{-1, 0, 0, 0}, logits.data(), nullptr, kV, mask.data());
  int32_t best = allowed_ids[0];
  for (int32_t t : allowed_ids) best = logits[t] > logits[best] ? t : best;
  EXPECT_EQ(g.id, best);
  double total = 0.0;
  for (int32_t t : allowed_ids) total += std::exp(static_cast<double>(logits[t] - logits[best]));
  EXPECT_NEAR(g.logprob, -std::log(total), 1e-5);
  // Without `masked` the mask is not read.
  p.masked = 0;
  bool outside = false;
  for (int pos = 0; pos < 200 && !outside; ++pos) {
    const int32_t id =
        sample_row(p, SampleRowInfo{-1, pos, 0, 0}, logits.data(), nullptr, kV, mask.data()).id;
    outside = std::find(allowed_ids.begin(), allowed_ids.end(), id) == allowed_ids.end();
  }
  EXPECT_TRUE(outside);
}

TEST(SampleKernel, MasksRowsThatAskAndRefusesAMaskThatAllowsNothing) {
  constexpr int64_t kV = 40;
  Batch b(2, kV, 1);
  std::vector<float> l(kV, 0.0f);
  l[0] = 9.0f;  // the unmasked favourite
  SamplingParams greedy;
  greedy.temperature = 0.0f;
  SamplingParams masked = greedy;
  masked.masked = 1;
  b.set_row(0, l, greedy, SampleRowInfo{-1, 0, 0, 0});
  b.set_row(1, l, masked, SampleRowInfo{-1, 0, 0, 0});
  std::vector<int32_t> mask(2 * mask_words(kV), 0);
  mask[mask_words(kV) + 1] = 1 << 3;  // row 1 allows only token 35
  auto args = [&] {
    return sample_args(view(b.logits, {2, kV}),
                       view(b.params, {2, static_cast<int64_t>(sizeof(SamplingParams))}),
                       view(b.info, {2, 4}), view(b.counts, {1, kV}), view(b.ids, {2}),
                       view(b.lp, {2}), view(b.top_ids, {2, kMaxLogprobs}),
                       view(b.top_lp, {2, kMaxLogprobs}), view(mask, {2, mask_words(kV)}));
  };
  ASSERT_TRUE(run_blocks(&sample_kernel, args(), 1).ok());
  EXPECT_THAT(b.ids, ::testing::ElementsAre(0, 35));
  mask[mask_words(kV) + 1] = 0;
  absl::Status s = run_blocks(&sample_kernel, args(), 1);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "sample: row 1: the token mask allows no token");
  s = run_blocks(&sample_kernel, b.args(), 1);  // no mask argument
  EXPECT_EQ(s.message(), "sample: row 1: masked, but no mask argument");
}

}  // namespace
}  // namespace simpler::llm

namespace simpler::llm {
namespace {

// score_row reports for a given token what sample_row reports for the same token sampled: its
// raw logprob and the same top alternatives (ties to the lower id), whatever the token's rank.
TEST(ScoreRow, AGivenTokensLogprobAndAlternativesAreThoseOfTheSampler) {
  const std::vector<float> logits = {0.5f, 2.0f, -1.0f, 2.0f, 0.25f, -3.0f, 1.5f};
  const int64_t V = static_cast<int64_t>(logits.size());
  SamplingParams greedy;
  greedy.temperature = 0.0f;
  greedy.logprobs = 3;
  const SampleResult sampled = sample_row(greedy, SampleRowInfo{}, logits.data(), nullptr, V);
  ASSERT_EQ(sampled.id, 1);
  const SampleResult scored = score_row(logits.data(), V, 1, 3);
  EXPECT_EQ(scored.id, 1);
  EXPECT_EQ(scored.logprob, sampled.logprob);
  for (int k = 0; k < kMaxLogprobs; ++k) {
    EXPECT_EQ(scored.top_ids[k], sampled.top_ids[k]) << k;
    EXPECT_EQ(scored.top_logprobs[k], sampled.top_logprobs[k]) << k;
  }
  EXPECT_EQ(scored.top_ids[0], 1);
  EXPECT_EQ(scored.top_ids[1], 3);
  EXPECT_EQ(scored.top_ids[2], 6);
  EXPECT_EQ(scored.top_ids[3], -1);
  double sum = 0;
  for (float l : logits) sum += std::exp(static_cast<double>(l) - 2.0);
  const double lse = 2.0 + std::log(sum);
  const SampleResult low = score_row(logits.data(), V, 5, 0);
  EXPECT_EQ(low.id, 5);
  EXPECT_FLOAT_EQ(low.logprob, static_cast<float>(-3.0 - lse));
  EXPECT_EQ(low.top_ids[0], -1);
}

}  // namespace
}  // namespace simpler::llm
