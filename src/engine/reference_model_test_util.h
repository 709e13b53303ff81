// Test utility of the engine tests: a float64 reference forward pass of a Qwen3 checkpoint
// (Hugging Face modeling_qwen3 semantics, as qwen3_program_test's reference): the logits of every
// position of a token sequence, recomputed causally in double from the checkpoint's weights
// widened to f32 then f64. Slow (O(T² · layers) matrix-vector products): for small test models.
//
// Thread safety: immutable once loaded (thread-safe).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "simpler/model/model_config.h"
#include "simpler/model/qwen3_program.h"
#include "simpler/model/safetensors.h"

namespace simpler::llm::testing {

class ReferenceModel {
 public:
  using Vec = std::vector<double>;

  // Errors of ModelConfig::load, ModelWeights::open and to_f32 (naming the tensor).
  static absl::StatusOr<ReferenceModel> load(const std::string& dir) {
    absl::StatusOr<ModelConfig> config = ModelConfig::load(dir);
    if (!config.ok()) return config.status();
    absl::StatusOr<ModelWeights> w = ModelWeights::open(dir);
    if (!w.ok()) return w.status();
    ReferenceModel m;
    m.d_ = Qwen3Dims::from_config(*config);
    auto get = [&](const std::string& name, std::vector<float>& out) -> absl::Status {
      absl::StatusOr<TensorView> v = w->get(name);
      if (!v.ok()) return v.status();
      absl::StatusOr<std::vector<float>> f = to_f32(*v);
      if (!f.ok()) return f.status();
      out = *std::move(f);
      return absl::OkStatus();
    };
    absl::Status s = get("model.embed_tokens.weight", m.embed_);
    if (s.ok()) s = get("model.norm.weight", m.norm_);
    if (s.ok() && !m.d_.tie_word_embeddings) s = get("lm_head.weight", m.lm_head_);
    for (int64_t l = 0; s.ok() && l < m.d_.num_hidden_layers; ++l) {
      const std::string p = absl::StrCat("model.layers.", l, ".");
      Layer L;
      for (auto [name, dst] : std::initializer_list<std::pair<const char*, std::vector<float>*>>{
               {"input_layernorm.weight", &L.ln1},
               {"self_attn.q_proj.weight", &L.wq},
               {"self_attn.k_proj.weight", &L.wk},
               {"self_attn.v_proj.weight", &L.wv},
               {"self_attn.o_proj.weight", &L.wo},
               {"self_attn.q_norm.weight", &L.qn},
               {"self_attn.k_norm.weight", &L.kn},
               {"post_attention_layernorm.weight", &L.ln2},
               {"mlp.gate_proj.weight", &L.wg},
               {"mlp.up_proj.weight", &L.wu},
               {"mlp.down_proj.weight", &L.wd}}) {
        if (s.ok()) s = get(p + name, *dst);
      }
      m.layers_.push_back(std::move(L));
    }
    if (!s.ok()) return s;
    return m;
  }

  const Qwen3Dims& dims() const { return d_; }

  // The logits [T][V] of every position of `tokens` (position t's predict token t + 1).
  std::vector<Vec> logits(const std::vector<int32_t>& tokens) const {
    const int64_t T = static_cast<int64_t>(tokens.size());
    const int64_t H = d_.hidden_size, I = d_.intermediate_size, hd = d_.head_dim;
    const int64_t nh = d_.num_attention_heads, nkv = d_.num_key_value_heads;
    const double eps = static_cast<float>(d_.rms_norm_eps);
    std::vector<Vec> x(T, Vec(H));
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t i = 0; i < H; ++i) x[t][i] = embed_[tokens[t] * H + i];
    }
    for (const Layer& L : layers_) {
      std::vector<Vec> q(T), k(T), v(T);
      for (int64_t t = 0; t < T; ++t) {
        Vec h = rms_norm(x[t], L.ln1.data(), eps);
        q[t] = matvec(L.wq, nh * hd, H, h);
        k[t] = matvec(L.wk, nkv * hd, H, h);
        v[t] = matvec(L.wv, nkv * hd, H, h);
        norm_rope_heads(q[t], nh, L.qn, t);
        norm_rope_heads(k[t], nkv, L.kn, t);
      }
      for (int64_t t = 0; t < T; ++t) {
        Vec attn(nh * hd, 0.0);
        for (int64_t h = 0; h < nh; ++h) attend(q, k, v, t, h, attn);
        Vec o = matvec(L.wo, H, nh * hd, attn);
        for (int64_t i = 0; i < H; ++i) x[t][i] += o[i];
      }
      for (int64_t t = 0; t < T; ++t) {
        Vec h = rms_norm(x[t], L.ln2.data(), eps);
        Vec g = matvec(L.wg, I, H, h);
        Vec u = matvec(L.wu, I, H, h);
        for (int64_t i = 0; i < I; ++i) g[i] = g[i] / (1.0 + std::exp(-g[i])) * u[i];
        Vec dn = matvec(L.wd, H, I, g);
        for (int64_t i = 0; i < H; ++i) x[t][i] += dn[i];
      }
    }
    std::vector<Vec> out;
    for (int64_t t = 0; t < T; ++t) {
      Vec h = rms_norm(x[t], norm_.data(), eps);
      out.push_back(matvec(d_.tie_word_embeddings ? embed_ : lm_head_, d_.vocab_size, H, h));
    }
    return out;
  }

  // log_softmax(logits)[token].
  static double logprob(const Vec& logits, int32_t token) {
    const double mx = *std::max_element(logits.begin(), logits.end());
    double sum = 0;
    for (double l : logits) sum += std::exp(l - mx);
    return logits[token] - mx - std::log(sum);
  }

 private:
  struct Layer {
    std::vector<float> ln1, wq, wk, wv, wo, qn, kn, ln2, wg, wu, wd;
  };

  static Vec matvec(const std::vector<float>& w, int64_t out, int64_t in, const Vec& x) {
    Vec y(out, 0.0);
    for (int64_t o = 0; o < out; ++o) {
      for (int64_t i = 0; i < in; ++i) y[o] += static_cast<double>(w[o * in + i]) * x[i];
    }
    return y;
  }

  static Vec rms_norm(const Vec& x, const float* w, double eps) {
    double ss = 0;
    for (double v : x) ss += v * v;
    const double inv = 1.0 / std::sqrt(ss / static_cast<double>(x.size()) + eps);
    Vec y(x.size());
    for (size_t i = 0; i < x.size(); ++i) y[i] = x[i] * inv * w[i];
    return y;
  }

  // Per-head RMSNorm then rotate-half RoPE at `pos`, in place on [heads · head_dim].
  void norm_rope_heads(Vec& v, int64_t heads, const std::vector<float>& w, int64_t pos) const {
    const int64_t hd = d_.head_dim;
    const double eps = static_cast<float>(d_.rms_norm_eps);
    const double theta = static_cast<float>(d_.rope_theta);
    for (int64_t h = 0; h < heads; ++h) {
      Vec head(v.begin() + h * hd, v.begin() + (h + 1) * hd);
      head = rms_norm(head, w.data(), eps);
      for (int64_t i = 0; i < hd / 2; ++i) {
        const double a = static_cast<double>(pos) * std::pow(theta, -2.0 * i / hd);
        v[h * hd + i] = head[i] * std::cos(a) - head[i + hd / 2] * std::sin(a);
        v[h * hd + i + hd / 2] = head[i + hd / 2] * std::cos(a) + head[i] * std::sin(a);
      }
    }
  }

  // Causal attention of query head h at position t, added into attn[h · head_dim ...].
  void attend(const std::vector<Vec>& q, const std::vector<Vec>& k, const std::vector<Vec>& v,
              int64_t t, int64_t h, Vec& attn) const {
    const int64_t hd = d_.head_dim;
    const int64_t g = h / (d_.num_attention_heads / d_.num_key_value_heads);
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

  Qwen3Dims d_;
  std::vector<float> embed_, norm_, lm_head_;
  std::vector<Layer> layers_;
};

}  // namespace simpler::llm::testing
