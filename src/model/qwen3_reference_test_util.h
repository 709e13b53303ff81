// Test utility of the model and engine tests: the float64 reference forward pass of Qwen3
// (Hugging Face modeling_qwen3 semantics: RMSNorm, q/k head norms, rotate-half RoPE, causal GQA
// attention, SiLU-gated MLP, tied or separate LM head) over weights held on the host as f32, the
// values widened to f64. Slow (O(T² · layers) matrix-vector products): for small test models.
//
// Thread safety: the functions are pure; a HostModel is a plain value.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "simpler/model/qwen3_program.h"

namespace simpler::llm::testing {

// One decoder layer's weights, row-major [out, in] as in the checkpoint.
struct HostLayer {
  std::vector<float> ln1, wq, wk, wv, wo, qn, kn, ln2, wg, wu, wd;
};
// A whole model's weights; lm_head is empty when dims.tie_word_embeddings.
struct HostModel {
  Qwen3Dims dims;
  std::vector<float> embed, norm, lm_head;
  std::vector<HostLayer> layers;
};

using Vec = std::vector<double>;

inline Vec reference_matvec(const std::vector<float>& w, int64_t out, int64_t in, const Vec& x) {
  Vec y(out, 0.0);
  for (int64_t o = 0; o < out; ++o) {
    for (int64_t i = 0; i < in; ++i) y[o] += static_cast<double>(w[o * in + i]) * x[i];
  }
  return y;
}

inline Vec reference_rms_norm(const Vec& x, const float* w, double eps) {
  double ss = 0;
  for (double v : x) ss += v * v;
  const double inv = 1.0 / std::sqrt(ss / static_cast<double>(x.size()) + eps);
  Vec y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = x[i] * inv * w[i];
  return y;
}

namespace reference_detail {

// Per-head RMSNorm then rotate-half RoPE at `pos`, in place on [heads · head_dim].
inline void norm_rope_heads(const Qwen3Dims& d, Vec& v, int64_t heads, const std::vector<float>& w,
                            int64_t pos) {
  const int64_t hd = d.head_dim;
  const double eps = static_cast<float>(d.rms_norm_eps);
  const double theta = static_cast<float>(d.rope_theta);
  for (int64_t h = 0; h < heads; ++h) {
    Vec head(v.begin() + h * hd, v.begin() + (h + 1) * hd);
    head = reference_rms_norm(head, w.data(), eps);
    for (int64_t i = 0; i < hd / 2; ++i) {
      const double a = static_cast<double>(pos) * std::pow(theta, -2.0 * i / hd);
      v[h * hd + i] = head[i] * std::cos(a) - head[i + hd / 2] * std::sin(a);
      v[h * hd + i + hd / 2] = head[i + hd / 2] * std::cos(a) + head[i] * std::sin(a);
    }
  }
}

// Causal attention of query head h at position t, added into attn[h · head_dim ...].
inline void attend(const Qwen3Dims& d, const std::vector<Vec>& q, const std::vector<Vec>& k,
                   const std::vector<Vec>& v, int64_t t, int64_t h, Vec& attn) {
  const int64_t hd = d.head_dim;
  const int64_t g = h / (d.num_attention_heads / d.num_key_value_heads);
  Vec s(t + 1);
  double mx = -INFINITY;
  for (int64_t u = 0; u <= t; ++u) {
    double dot = 0;
    for (int64_t i = 0; i < hd; ++i) dot += q[t][h * hd + i] * k[u][g * hd + i];
    s[u] = dot / std::sqrt(static_cast<double>(hd));
    mx = std::max(mx, s[u]);
  }
  double sum = 0;
  for (double& e : s) sum += (e = std::exp(e - mx));
  for (int64_t u = 0; u <= t; ++u) {
    for (int64_t i = 0; i < hd; ++i) attn[h * hd + i] += s[u] / sum * v[u][g * hd + i];
  }
}

// One decoder layer over the hidden states x [T][hidden], in place.
inline void layer(const Qwen3Dims& d, const HostLayer& L, std::vector<Vec>& x) {
  const int64_t T = static_cast<int64_t>(x.size());
  const int64_t H = d.hidden_size, I = d.intermediate_size, hd = d.head_dim;
  const int64_t nh = d.num_attention_heads, nkv = d.num_key_value_heads;
  const double eps = static_cast<float>(d.rms_norm_eps);
  std::vector<Vec> q(T), k(T), v(T);
  for (int64_t t = 0; t < T; ++t) {
    Vec h = reference_rms_norm(x[t], L.ln1.data(), eps);
    q[t] = reference_matvec(L.wq, nh * hd, H, h);
    k[t] = reference_matvec(L.wk, nkv * hd, H, h);
    v[t] = reference_matvec(L.wv, nkv * hd, H, h);
    norm_rope_heads(d, q[t], nh, L.qn, t);
    norm_rope_heads(d, k[t], nkv, L.kn, t);
  }
  for (int64_t t = 0; t < T; ++t) {
    Vec attn(nh * hd, 0.0);
    for (int64_t h = 0; h < nh; ++h) attend(d, q, k, v, t, h, attn);
    Vec o = reference_matvec(L.wo, H, nh * hd, attn);
    for (int64_t i = 0; i < H; ++i) x[t][i] += o[i];
  }
  for (int64_t t = 0; t < T; ++t) {
    Vec h = reference_rms_norm(x[t], L.ln2.data(), eps);
    Vec g = reference_matvec(L.wg, I, H, h);
    Vec u = reference_matvec(L.wu, I, H, h);
    for (int64_t i = 0; i < I; ++i) g[i] = g[i] / (1.0 + std::exp(-g[i])) * u[i];
    Vec dn = reference_matvec(L.wd, H, I, g);
    for (int64_t i = 0; i < H; ++i) x[t][i] += dn[i];
  }
}

}  // namespace reference_detail

// The logits [vocab] of positions first_position..T-1 of `tokens` (position t's predict token
// t + 1), recomputing the whole causal forward pass; by default the last position only.
inline std::vector<Vec> reference_logits_from(const HostModel& m,
                                              const std::vector<int32_t>& tokens,
                                              int64_t first_position) {
  const Qwen3Dims& d = m.dims;
  const int64_t T = static_cast<int64_t>(tokens.size());
  const int64_t H = d.hidden_size;
  std::vector<Vec> x(T, Vec(H));
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t i = 0; i < H; ++i) x[t][i] = m.embed[tokens[t] * H + i];
  }
  for (const HostLayer& L : m.layers) reference_detail::layer(d, L, x);
  std::vector<Vec> out;
  const double eps = static_cast<float>(d.rms_norm_eps);
  for (int64_t t = first_position; t < T; ++t) {
    Vec h = reference_rms_norm(x[t], m.norm.data(), eps);
    out.push_back(
        reference_matvec(d.tie_word_embeddings ? m.embed : m.lm_head, d.vocab_size, H, h));
  }
  return out;
}

// The logits of the last position of `tokens`.
inline Vec reference_logits(const HostModel& m, const std::vector<int32_t>& tokens) {
  return reference_logits_from(m, tokens, static_cast<int64_t>(tokens.size()) - 1).back();
}

// log_softmax(logits)[token].
inline double reference_logprob(const Vec& logits, int32_t token) {
  const double mx = *std::max_element(logits.begin(), logits.end());
  double sum = 0;
  for (double l : logits) sum += std::exp(l - mx);
  return logits[token] - mx - std::log(sum);
}

}  // namespace simpler::llm::testing
