// Test utility of the engine tests: a Qwen3 checkpoint loaded for the float64 reference forward
// pass of model/qwen3_reference_test_util.h (the one qwen3_program_test uses): the logits of every
// position of a token sequence, from the checkpoint's weights widened to f32 then f64. Slow
// (O(T² · layers) matrix-vector products): for small test models.
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
#include "model/qwen3_reference_test_util.h"
#include "simpler/model/model_config.h"
#include "simpler/model/qwen3_program.h"
#include "simpler/model/safetensors.h"

namespace simpler::llm::testing {

class ReferenceModel {
 public:
  // Errors of ModelConfig::load, ModelWeights::open and to_f32 (naming the tensor).
  static absl::StatusOr<ReferenceModel> load(const std::string& dir) {
    absl::StatusOr<ModelConfig> config = ModelConfig::load(dir);
    if (!config.ok()) return config.status();
    absl::StatusOr<ModelWeights> w = ModelWeights::open(dir);
    if (!w.ok()) return w.status();
    ReferenceModel m;
    m.m_.dims = Qwen3Dims::from_config(*config);
    auto get = [&](const std::string& name, std::vector<float>& out) -> absl::Status {
      absl::StatusOr<TensorView> v = w->get(name);
      if (!v.ok()) return v.status();
      absl::StatusOr<std::vector<float>> f = to_f32(*v);
      if (!f.ok()) return f.status();
      out = *std::move(f);
      return absl::OkStatus();
    };
    absl::Status s = get("model.embed_tokens.weight", m.m_.embed);
    if (s.ok()) s = get("model.norm.weight", m.m_.norm);
    if (s.ok() && !m.m_.dims.tie_word_embeddings) s = get("lm_head.weight", m.m_.lm_head);
    for (int64_t l = 0; s.ok() && l < m.m_.dims.num_hidden_layers; ++l) {
      const std::string p = absl::StrCat("model.layers.", l, ".");
      HostLayer L;
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
      m.m_.layers.push_back(std::move(L));
    }
    if (!s.ok()) return s;
    return m;
  }

  const Qwen3Dims& dims() const { return m_.dims; }

  // The logits [T][V] of every position of `tokens` (position t's predict token t + 1).
  std::vector<Vec> logits(const std::vector<int32_t>& tokens) const {
    return reference_logits_from(m_, tokens, 0);
  }

  // log_softmax(logits)[token].
  static double logprob(const Vec& logits, int32_t token) {
    return reference_logprob(logits, token);
  }

 private:
  HostModel m_;
};

}  // namespace simpler::llm::testing
