// The Qwen3 model configuration: config.json (+ generation_config.json) of a Hugging Face model
// directory, and the list of weights that configuration implies.
//
// Fields follow transformers' Qwen3Config (huggingface.co/docs/transformers/model_doc/qwen3) and
// the Qwen3 model cards (e.g. Qwen/Qwen3-0.6B config.json).
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace simpler::llm {

class GgufFile;

// One expected weight tensor: its name in the checkpoint and its shape ([out, in] for linear
// layers).
struct WeightSpec {
  std::string name;
  std::vector<int64_t> shape;
};

// A validated Qwen3 configuration. A plain value; thread-compatible.
//
// config.json fields read (others, such as "use_cache", are ignored):
//   required   hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
//              num_key_value_heads, vocab_size (positive integers), and either "architectures"
//              containing "Qwen3ForCausalLM" or "model_type": "qwen3"
//   optional   head_dim (default hidden_size / num_attention_heads; need not equal it),
//              rms_norm_eps (1e-6), rope_theta (10000), max_position_embeddings (32768),
//              tie_word_embeddings (false, as in Qwen3Config; Qwen3-0.6B sets true),
//              eos_token_id (integer or list of integers), bos_token_id (integer or null),
//              torch_dtype (string), hidden_act (must be "silu"), attention_bias (must be
//              false), rope_scaling (must be null), use_sliding_window (must be false)
// generation_config.json, when present: eos_token_id (integer or list) adds stop ids; other
// fields are ignored.
//
// Errors name the file and the field:
//   NOT_FOUND         config.json is missing
//   INVALID_ARGUMENT  malformed JSON (also: nested deeper than 64 levels, bytes after the
//                     value, a duplicate key; see base/json.h); a file that is not a regular file
//                     (a FIFO is refused without blocking) or a model directory that is a file;
//                     a missing required field; a field of the wrong type or out of range (an
//                     integer above 2^63-1; rms_norm_eps or rope_theta outside float32's positive
//                     normal range, the kernels' precision; weight sizes whose f32 bytes overflow
//                     64 bits); num_key_value_heads not dividing num_attention_heads; an odd
//                     head_dim (rotate-half RoPE needs pairs); a token id outside [0, vocab_size);
//                     an unsupported feature (hidden_act, attention_bias, rope_scaling, sliding
//                     window); "unknown architecture [...]" when neither architectures nor
//                     model_type names Qwen3
struct ModelConfig {
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;
  int64_t head_dim = 0;
  int64_t vocab_size = 0;
  int64_t max_position_embeddings = 32768;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  bool tie_word_embeddings = false;
  std::vector<int64_t> eos_token_ids;             // from config.json
  std::optional<int64_t> bos_token_id;            // from config.json
  std::vector<int64_t> generation_eos_token_ids;  // from generation_config.json
  std::string torch_dtype;                        // "" when absent
  std::string model_type = "qwen3";
  std::vector<std::string> architectures = {"Qwen3ForCausalLM"};

  // Reads `dir`/config.json and, when present, `dir`/generation_config.json; or, when `dir` is a
  // GGUF file (is_gguf_path: a path ending in ".gguf"), from_gguf of that file (with
  // GgufFile::open's errors).
  static absl::StatusOr<ModelConfig> load(const std::string& dir);

  // The configuration of a Qwen3 GGUF file (llama.cpp's keys; `general.architecture` must be
  // "qwen3", anything else is INVALID_ARGUMENT naming it):
  //   required   qwen3.block_count, context_length, embedding_length, feed_forward_length,
  //              attention.head_count, attention.layer_norm_rms_epsilon; the tensor
  //              token_embd.weight [vocab, embedding_length], whose rows are vocab_size
  //   optional   qwen3.attention.head_count_kv (default head_count), attention.key_length
  //              (head_dim; default embedding_length / head_count), attention.value_length and
  //              rope.dimension_count (must equal head_dim), rope.freq_base (rope_theta,
  //              default 10000), rope.scaling.type (must be "none"); tokenizer.ggml.tokens (its
  //              length must be vocab_size), bos_token_id, eos_token_id (eos_token_ids)
  // tie_word_embeddings is true when the tensor output.weight is absent. The stop ids beyond
  // eos (generation_eos_token_ids) are llama.cpp's end-of-generation set: eot_token_id,
  // eom_token_id and the control tokens (token_type 3) spelled <|im_end|>, <|endoftext|>,
  // <|eot_id|>, <|end|>, <end_of_turn>, <|eom_id|>, <EOT>, _<EOT>, <|end▁of▁sentence|>.
  // Values then pass `validate`, with the file's path as the source. Errors: INVALID_ARGUMENT
  // naming the path and the key.
  static absl::StatusOr<ModelConfig> from_gguf(const GgufFile& file);

  // Parses the text of a config.json and (unless empty) a generation_config.json. The names are
  // used in error messages.
  static absl::StatusOr<ModelConfig> parse(
      std::string_view config_json, std::string_view generation_config_json = {},
      std::string_view config_name = "config.json",
      std::string_view generation_name = "generation_config.json");

  // Checks the invariants listed above on the current field values (used by parse and before
  // writing). `source` names the file in messages.
  absl::Status validate(std::string_view source = "config.json") const;

  // OK when a request of `prompt` plus up to `max_new_tokens` generated tokens fits this model,
  // checked before anything is sized for it. INVALID_ARGUMENT otherwise: an empty prompt
  // ("empty prompt"), an id outside the vocabulary ("token id 10000000000 outside the
  // vocabulary [0, 151936)"), max_new_tokens < 1, or more tokens than the model has positions
  // ("prompt of 5000 tokens + 32 new tokens exceeds max_position_embeddings 4096").
  absl::Status check_request(std::span<const int64_t> prompt, int64_t max_new_tokens) const;

  // Stop token ids: eos_token_ids then generation_eos_token_ids, without duplicates.
  std::vector<int64_t> stop_ids() const;

  int64_t q_size() const { return num_attention_heads * head_dim; }
  int64_t kv_size() const { return num_key_value_heads * head_dim; }

  // Every weight this configuration needs, in checkpoint order: model.embed_tokens.weight
  // [V,H]; per layer i, model.layers.{i}.input_layernorm.weight [H],
  // self_attn.q_proj.weight [nh*hd,H], k_proj [nkv*hd,H], v_proj [nkv*hd,H], o_proj [H,nh*hd],
  // q_norm [hd], k_norm [hd], post_attention_layernorm [H], mlp.gate_proj [I,H], up_proj [I,H],
  // down_proj [H,I]; model.norm.weight [H]; lm_head.weight [V,H] unless tie_word_embeddings.
  std::vector<WeightSpec> tensor_names_and_shapes() const;

  // config.json text for this configuration (Hugging Face layout, 2-space indented).
  std::string to_config_json() const;
  // generation_config.json text (bos, eos = generation_eos_token_ids or eos_token_ids).
  std::string to_generation_config_json() const;
};

}  // namespace simpler::llm
