// Tensor names of a Qwen3 checkpoint in GGUF (llama.cpp's names, gguf-py's tensor_mapping.py)
// and in a Hugging Face directory (the names ModelConfig::tensor_names_and_shapes lists).
#pragma once

#include <string>
#include <string_view>

namespace simpler::llm {

// model.embed_tokens.weight -> token_embd.weight, model.norm.weight -> output_norm.weight,
// lm_head.weight -> output.weight, model.layers.N.<part> -> blk.N.<llama.cpp part>
// (input_layernorm -> attn_norm, self_attn.{q,k,v,o}_proj -> attn_{q,k,v,output},
// self_attn.{q,k}_norm -> attn_{q,k}_norm, post_attention_layernorm -> ffn_norm,
// mlp.{gate,up,down}_proj -> ffn_{gate,up,down}); empty for a name outside the model.
std::string gguf_tensor_name(std::string_view hf_name);

// The inverse of gguf_tensor_name; empty for a GGUF name it does not produce (a layer number
// must be decimal digits without a leading zero).
std::string hf_tensor_name(std::string_view gguf_name);

}  // namespace simpler::llm
