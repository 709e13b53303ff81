// ModelConfig of a Qwen3 GGUF file: the `qwen3.*` keys of llama.cpp's converter.
#include <array>
#include <string>
#include <string_view>

#include "absl/strings/str_cat.h"
#include "model/str.h"
#include "simpler/base/status.h"
#include "simpler/model/gguf.h"
#include "simpler/model/model_config.h"

namespace simpler::llm {
namespace {

// Control tokens llama.cpp also stops on when the vocabulary names them (llama-vocab.cpp's
// end-of-generation texts; Qwen3's are <|im_end|> and <|endoftext|>).
constexpr std::array<std::string_view, 9> kEndOfGenerationTexts = {
    "<|eot_id|>",    "<|im_end|>",    "<|end|>",
    "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
    "<EOT>",         "_<EOT>",        "<|end\xe2\x96\x81of\xe2\x96\x81sentence|>",
};
constexpr int64_t kTokenTypeControl = 3;

// A required key as int64 (INVALID_ARGUMENT naming the key when it is missing).
absl::StatusOr<int64_t> required_int(const GgufFile& f, const std::string& key) {
  absl::StatusOr<uint64_t> v = f.get_uint(key);
  if (absl::IsNotFound(v.status())) {
    return absl::InvalidArgumentError(
        absl::StrCat(f.path(), ": key '", key, "' not found (a Qwen3 GGUF file needs it)"));
  }
  if (!v.ok()) return v.status();
  return static_cast<int64_t>(*v);
}

// An optional key as int64, `fallback` when absent.
absl::StatusOr<int64_t> optional_int(const GgufFile& f, const std::string& key, int64_t fallback) {
  if (f.find(key) == nullptr) return fallback;
  SIMPLER_ASSIGN_OR_RETURN(const uint64_t v, f.get_uint(key));
  return static_cast<int64_t>(v);
}

absl::Status read_dimensions(const GgufFile& f, ModelConfig& c) {
  SIMPLER_ASSIGN_OR_RETURN(c.num_hidden_layers, required_int(f, "qwen3.block_count"));
  SIMPLER_ASSIGN_OR_RETURN(c.max_position_embeddings, required_int(f, "qwen3.context_length"));
  SIMPLER_ASSIGN_OR_RETURN(c.hidden_size, required_int(f, "qwen3.embedding_length"));
  SIMPLER_ASSIGN_OR_RETURN(c.intermediate_size, required_int(f, "qwen3.feed_forward_length"));
  SIMPLER_ASSIGN_OR_RETURN(c.num_attention_heads, required_int(f, "qwen3.attention.head_count"));
  SIMPLER_ASSIGN_OR_RETURN(c.num_key_value_heads,
                           optional_int(f, "qwen3.attention.head_count_kv", c.num_attention_heads));
  const int64_t fallback_head_dim =
      c.num_attention_heads > 0 ? c.hidden_size / c.num_attention_heads : 0;
  SIMPLER_ASSIGN_OR_RETURN(c.head_dim,
                           optional_int(f, "qwen3.attention.key_length", fallback_head_dim));
  for (const char* key : {"qwen3.attention.value_length", "qwen3.rope.dimension_count"}) {
    SIMPLER_ASSIGN_OR_RETURN(const int64_t v, optional_int(f, key, c.head_dim));
    if (v != c.head_dim) {
      return absl::InvalidArgumentError(absl::StrCat(
          f.path(), ": key '", key, "' is ", v, ", but the head dimension (key_length) is ",
          c.head_dim, ": only full-width rotary Qwen3 attention is supported"));
    }
  }
  absl::StatusOr<double> eps = f.get_float("qwen3.attention.layer_norm_rms_epsilon");
  if (absl::IsNotFound(eps.status())) {
    return absl::InvalidArgumentError(
        absl::StrCat(f.path(),
                     ": key 'qwen3.attention.layer_norm_rms_epsilon' not found (a "
                     "Qwen3 GGUF file needs it)"));
  }
  SIMPLER_ASSIGN_OR_RETURN(c.rms_norm_eps, std::move(eps));
  if (f.find("qwen3.rope.freq_base") != nullptr) {
    SIMPLER_ASSIGN_OR_RETURN(c.rope_theta, f.get_float("qwen3.rope.freq_base"));
  }
  if (f.find("qwen3.rope.scaling.type") != nullptr) {
    SIMPLER_ASSIGN_OR_RETURN(std::string_view scaling, f.get_string("qwen3.rope.scaling.type"));
    if (scaling != "none") {
      return absl::InvalidArgumentError(absl::StrCat(f.path(), ": qwen3.rope.scaling.type '",
                                                     str(scaling), "' is not supported"));
    }
  }
  return absl::OkStatus();
}

// vocab_size from token_embd.weight ([vocab, hidden]), checked against tokenizer.ggml.tokens;
// tied embeddings when output.weight is absent.
absl::Status read_vocabulary_size(const GgufFile& f, ModelConfig& c) {
  const GgufTensorInfo* embd = f.find_tensor("token_embd.weight");
  if (embd == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(f.path(), ": tensor 'token_embd.weight' not found"));
  }
  if (embd->shape.size() != 2 || embd->shape[1] != c.hidden_size) {
    return absl::InvalidArgumentError(
        absl::StrCat(f.path(), ": tensor 'token_embd.weight' has shape ",
                     shape_to_string(embd->shape), ", expected [vocab, ", c.hidden_size, "]"));
  }
  c.vocab_size = embd->shape[0];
  if (f.find("tokenizer.ggml.tokens") != nullptr) {
    SIMPLER_ASSIGN_OR_RETURN(std::span<const std::string_view> tokens,
                             f.get_string_array("tokenizer.ggml.tokens"));
    if (static_cast<int64_t>(tokens.size()) != c.vocab_size) {
      return absl::InvalidArgumentError(
          absl::StrCat(f.path(), ": tokenizer.ggml.tokens holds ", tokens.size(),
                       " tokens, but token_embd.weight has ", c.vocab_size, " rows"));
    }
  }
  c.tie_word_embeddings = f.find_tensor("output.weight") == nullptr;
  return absl::OkStatus();
}

// bos / eos from tokenizer.ggml.*; the stop ids as llama.cpp computes its end-of-generation set:
// eos, eot and eom ids, and the control tokens named by kEndOfGenerationTexts.
absl::Status read_special_ids(const GgufFile& f, ModelConfig& c) {
  if (f.find("tokenizer.ggml.bos_token_id") != nullptr) {
    SIMPLER_ASSIGN_OR_RETURN(const uint64_t bos, f.get_uint("tokenizer.ggml.bos_token_id"));
    c.bos_token_id = static_cast<int64_t>(bos);
  }
  if (f.find("tokenizer.ggml.eos_token_id") != nullptr) {
    SIMPLER_ASSIGN_OR_RETURN(const uint64_t eos, f.get_uint("tokenizer.ggml.eos_token_id"));
    c.eos_token_ids = {static_cast<int64_t>(eos)};
  }
  for (const char* key : {"tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"}) {
    if (f.find(key) == nullptr) continue;
    SIMPLER_ASSIGN_OR_RETURN(const uint64_t id, f.get_uint(key));
    c.generation_eos_token_ids.push_back(static_cast<int64_t>(id));
  }
  if (f.find("tokenizer.ggml.tokens") != nullptr &&
      f.find("tokenizer.ggml.token_type") != nullptr) {
    SIMPLER_ASSIGN_OR_RETURN(std::span<const std::string_view> tokens,
                             f.get_string_array("tokenizer.ggml.tokens"));
    SIMPLER_ASSIGN_OR_RETURN(std::vector<int64_t> types,
                             f.get_int_array("tokenizer.ggml.token_type"));
    for (size_t id = 0; id < tokens.size() && id < types.size(); ++id) {
      if (types[id] != kTokenTypeControl) continue;
      for (std::string_view text : kEndOfGenerationTexts) {
        if (tokens[id] == text) c.generation_eos_token_ids.push_back(static_cast<int64_t>(id));
      }
    }
  }
  for (int64_t id : c.generation_eos_token_ids) {
    if (id >= c.vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat(
          f.path(), ": stop token id ", id, " is outside [0, vocab_size ", c.vocab_size, ")"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ModelConfig> ModelConfig::from_gguf(const GgufFile& file) {
  absl::StatusOr<std::string_view> arch = file.get_string("general.architecture");
  if (!arch.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(file.path(), ": general.architecture: ", arch.status().message()));
  }
  if (*arch != "qwen3") {
    return absl::InvalidArgumentError(absl::StrCat(file.path(), ": general.architecture is '",
                                                   str(*arch), "'; only 'qwen3' is supported"));
  }
  ModelConfig c;
  SIMPLER_RETURN_IF_ERROR(read_dimensions(file, c));
  SIMPLER_RETURN_IF_ERROR(read_vocabulary_size(file, c));
  SIMPLER_RETURN_IF_ERROR(read_special_ids(file, c));
  SIMPLER_RETURN_IF_ERROR(c.validate(file.path()));
  return c;
}

}  // namespace simpler::llm
