#include "model/gguf_names.h"

#include <array>
#include <utility>

#include "absl/strings/str_cat.h"
#include "model/str.h"

namespace simpler::llm {
namespace {

// (Hugging Face part, llama.cpp part) of one layer's tensors.
constexpr std::array<std::pair<std::string_view, std::string_view>, 11> kLayerParts = {{
    {"input_layernorm.weight", "attn_norm.weight"},
    {"self_attn.q_proj.weight", "attn_q.weight"},
    {"self_attn.k_proj.weight", "attn_k.weight"},
    {"self_attn.v_proj.weight", "attn_v.weight"},
    {"self_attn.o_proj.weight", "attn_output.weight"},
    {"self_attn.q_norm.weight", "attn_q_norm.weight"},
    {"self_attn.k_norm.weight", "attn_k_norm.weight"},
    {"post_attention_layernorm.weight", "ffn_norm.weight"},
    {"mlp.gate_proj.weight", "ffn_gate.weight"},
    {"mlp.up_proj.weight", "ffn_up.weight"},
    {"mlp.down_proj.weight", "ffn_down.weight"},
}};

constexpr std::array<std::pair<std::string_view, std::string_view>, 3> kGlobal = {{
    {"model.embed_tokens.weight", "token_embd.weight"},
    {"model.norm.weight", "output_norm.weight"},
    {"lm_head.weight", "output.weight"},
}};

// `prefix`<layer>.<part> split; false when `name` does not have that form.
bool split_layer(std::string_view name, std::string_view prefix, std::string_view* layer,
                 std::string_view* part) {
  if (!name.starts_with(prefix)) return false;
  const size_t dot = name.find('.', prefix.size());
  if (dot == std::string_view::npos) return false;
  *layer = name.substr(prefix.size(), dot - prefix.size());
  *part = name.substr(dot + 1);
  if (layer->empty() || (layer->size() > 1 && (*layer)[0] == '0')) return false;
  for (char ch : *layer) {
    if (ch < '0' || ch > '9') return false;
  }
  return true;
}

}  // namespace

std::string gguf_tensor_name(std::string_view hf_name) {
  for (const auto& [hf, gguf] : kGlobal) {
    if (hf_name == hf) return str(gguf);
  }
  std::string_view layer, part;
  if (!split_layer(hf_name, "model.layers.", &layer, &part)) return "";
  for (const auto& [hf, gguf] : kLayerParts) {
    if (part == hf) return absl::StrCat("blk.", str(layer), ".", str(gguf));
  }
  return "";
}

std::string hf_tensor_name(std::string_view gguf_name) {
  for (const auto& [hf, gguf] : kGlobal) {
    if (gguf_name == gguf) return str(hf);
  }
  std::string_view layer, part;
  if (!split_layer(gguf_name, "blk.", &layer, &part)) return "";
  for (const auto& [hf, gguf] : kLayerParts) {
    if (part == gguf) return absl::StrCat("model.layers.", str(layer), ".", str(hf));
  }
  return "";
}

}  // namespace simpler::llm
