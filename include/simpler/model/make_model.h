// Writes a Qwen3 model directory with random weights in the real layout and names, for tests,
// benchmarks and the `simpler make-model` command.
//
// The directory holds config.json, generation_config.json, the weights (model.safetensors, or
// model-0000i-of-0000N.safetensors + model.safetensors.index.json when shards > 1) and, when a
// tokenizer directory is given, copies of its tokenizer.json and tokenizer_config.json.
//
// Weights (deterministic in the seed: each tensor draws from its own splitmix64 sequence seeded
// from the seed and the tensor's index, N(0, 1) by Box–Muller in double, rounded once to the
// dtype — every step specified in make_model.cc, so the same options give byte-identical files
// with any compiler and standard library):
//   linear [out, in], model.embed_tokens and lm_head [vocab, hidden]
//                                  N(0, 1) / sqrt(in): activations stay at unit scale, and the
//                                  logits of a unit-RMS hidden state have std ~1 (the tied
//                                  embedding still favours repeating the input token, but
//                                  greedy decoding does not lock onto one token at once)
//   norms (RMSNorm, q_norm/k_norm) 1 + N(0, 0.1)
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "simpler/model/model_config.h"
#include "simpler/task/data_type.h"

namespace simpler::llm {

// Qwen3 token ids of the real vocabulary (151936 entries).
inline constexpr int64_t kQwen3EndOfTextId = 151643;  // <|endoftext|>: bos, pad, stop
inline constexpr int64_t kQwen3ImEndId = 151645;      // <|im_end|>: eos

// Per-field overrides applied on top of a preset (unset = the preset's value).
struct ModelConfigOverrides {
  std::optional<int64_t> hidden_size;
  std::optional<int64_t> intermediate_size;
  std::optional<int64_t> num_hidden_layers;
  std::optional<int64_t> num_attention_heads;
  std::optional<int64_t> num_key_value_heads;
  std::optional<int64_t> head_dim;
  std::optional<int64_t> vocab_size;
  std::optional<int64_t> max_position_embeddings;
  std::optional<double> rope_theta;
  std::optional<double> rms_norm_eps;
  std::optional<bool> tie_word_embeddings;
};

struct MakeModelOptions {
  std::string preset = "tiny";  // "tiny" | "qwen3-0.6b"
  uint64_t seed = 0;
  task::DataType dtype = task::DataType::kBFloat16;  // kBFloat16 or kFloat32
  std::string out_dir;        // created when missing; a model make-model wrote there is replaced
  std::string tokenizer_dir;  // empty: no tokenizer files are written
  int shards = 1;             // > 1: sharded checkpoint with model.safetensors.index.json
  ModelConfigOverrides overrides;
};

// The configuration of a preset with overrides applied and validated.
//   tiny:        hidden 128, intermediate 384, 2 layers, 4 heads, 2 KV heads, head_dim 64
//                (!= hidden/heads on purpose), vocab 151936, max_position_embeddings 4096
//   qwen3-0.6b:  hidden 1024, intermediate 3072, 28 layers, 16 heads, 8 KV heads, head_dim 128,
//                vocab 151936, max_position_embeddings 40960
// Both: rope_theta 1e6, rms_norm_eps 1e-6, tied embeddings. Token ids: bos 151643,
// eos 151645 and generation stop ids [151645, 151643] when the vocabulary holds them; a smaller
// vocabulary V gets bos V-2, eos V-1 (generation stop ids [V-1, V-2]) so every id is < V.
// INVALID_ARGUMENT for an unknown preset (naming it) or a configuration that fails
// ModelConfig::validate.
absl::StatusOr<ModelConfig> preset_config(std::string_view preset,
                                          const ModelConfigOverrides& overrides = {});

// Writes the model directory described above. Progress for each tensor goes to the logger at
// info level (stderr). Errors: INVALID_ARGUMENT for a bad preset/override, a dtype other than
// bf16/f32, or shards < 1 or above the number of tensors; NOT_FOUND naming tokenizer.json or
// tokenizer_config.json when tokenizer_dir lacks it (checked before anything is written);
// FAILED_PRECONDITION when out_dir exists and is not a directory, holds a file make-model does not
// write (config.json, generation_config.json, the safetensors shards and index, the tokenizer
// files; *.gguf files and hidden files are left alone), or holds a Hugging Face checkpoint (its
// config.json has transformers_version): nothing there is changed; RESOURCE_EXHAUSTED stating both
// sizes when the weights would not fit in the space free on out_dir's file system (checked before a
// file is written); the OS error naming the path when a file cannot be written. Thread-compatible.
absl::Status make_model(const MakeModelOptions& options);

}  // namespace simpler::llm
