#include "model/gguf_names.h"

#include <array>
#include <string>
#include <string_view>

#include "absl/strings/str_cat.h"
#include "model/str.h"

namespace simpler::llm {
namespace {

// The two naming schemes; a NamePair holds one name in each, indexed by its scheme.
enum Scheme { kHf = 0, kGguf = 1 };
using NamePair = std::array<std::string_view, 2>;

// The prefix of a layer's tensor names, <prefix><layer>.<part>, in each scheme.
constexpr NamePair kLayerPrefix = {"model.layers.", "blk."};

// (Hugging Face part, llama.cpp part) of one layer's tensors.
constexpr std::array<NamePair, 11> kLayerParts = {{
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

constexpr std::array<NamePair, 3> kGlobal = {{
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

// `name`, a tensor name in scheme `from`, in the other scheme; "" when it names no known tensor.
std::string rename(std::string_view name, Scheme from) {
  const Scheme to = from == kHf ? kGguf : kHf;
  for (const NamePair& global : kGlobal) {
    if (name == global[from]) return str(global[to]);
  }
  std::string_view layer, part;
  if (!split_layer(name, kLayerPrefix[from], &layer, &part)) return "";
  for (const NamePair& parts : kLayerParts) {
    if (part == parts[from]) {
      return absl::StrCat(str(kLayerPrefix[to]), str(layer), ".", str(parts[to]));
    }
  }
  return "";
}

}  // namespace

std::string gguf_tensor_name(std::string_view hf_name) { return rename(hf_name, kHf); }

std::string hf_tensor_name(std::string_view gguf_name) { return rename(gguf_name, kGguf); }

}  // namespace simpler::llm
