// Which tokenizer and chat template belong to a model path (`--model`): a model directory's
// tokenizer.json / tokenizer_config.json, or a GGUF file's `tokenizer.ggml.*` keys and
// `tokenizer.chat_template` (gguf.h). The one place the CLI's commands (generate, serve, the
// bench commands) ask, so a GGUF file works wherever a model directory does.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "simpler/tokenizer/chat_template.h"
#include "simpler/tokenizer/tokenizer.h"

namespace simpler::llm {

class GgufFile;

// The tokenizer of `model_path`: Tokenizer::load of a directory; for a GGUF file
// (is_gguf_path), gguf_tokenizer of it (with GgufFile::open's errors). Thread-safe.
absl::StatusOr<Tokenizer> load_model_tokenizer(const std::string& model_path);

// The chat template of `model_path`: ChatTemplate::load of a directory; for a GGUF file,
// gguf_chat_template of it. Thread-safe.
absl::StatusOr<ChatTemplate> load_model_chat_template(const std::string& model_path);

// The files holding the weights of `model_path`: the GGUF file itself, or the directory's
// *.safetensors files (sorted; empty when there are none). Thread-safe.
std::vector<std::string> model_checkpoint_files(const std::string& model_path);

// Tokenizer::from_gguf_vocabulary of the file's tokenizer.ggml.model, pre, tokens, token_type,
// merges and bos / eos / padding ids. NOT_FOUND naming the path when tokenizer.ggml.tokens is
// absent (the file has no tokenizer: token-id prompts still work); INVALID_ARGUMENT for a key
// of the wrong type; from_gguf_vocabulary's errors.
absl::StatusOr<Tokenizer> gguf_tokenizer(const GgufFile& file);

// The file's tokenizer.chat_template, which must be byte for byte a template rendered natively
// (ChatTemplate::from_text: Qwen3's). NOT_FOUND naming the path when the key is absent;
// UNIMPLEMENTED "<path>: tokenizer.chat_template differs from the chat template simpler
// renders natively ..." (with both SHA-256s) otherwise; chat is then unavailable, completions
// are not affected.
absl::StatusOr<ChatTemplate> gguf_chat_template(const GgufFile& file);

}  // namespace simpler::llm
