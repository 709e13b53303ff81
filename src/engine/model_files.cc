#include "simpler/engine/model_files.h"

#include <algorithm>
#include <filesystem>
#include <string_view>
#include <vector>

#include "absl/strings/str_cat.h"
#include "simpler/base/status.h"
#include "simpler/model/gguf.h"

namespace simpler::llm {
namespace {

// An optional string key as a std::string ("" when absent).
absl::StatusOr<std::string> optional_string(const GgufFile& f, std::string_view key) {
  if (f.find(key) == nullptr) return std::string();
  SIMPLER_ASSIGN_OR_RETURN(std::string_view v, f.get_string(key));
  return std::string(v);
}

absl::StatusOr<std::optional<int64_t>> optional_id(const GgufFile& f, std::string_view key) {
  if (f.find(key) == nullptr) return std::optional<int64_t>();
  SIMPLER_ASSIGN_OR_RETURN(const uint64_t v, f.get_uint(key));
  return std::optional<int64_t>(static_cast<int64_t>(v));
}

}  // namespace

absl::StatusOr<Tokenizer> gguf_tokenizer(const GgufFile& file) {
  if (file.find("tokenizer.ggml.tokens") == nullptr) {
    return absl::NotFoundError(
        absl::StrCat(file.path(), ": no tokenizer (key 'tokenizer.ggml.tokens' not found)"));
  }
  GgufVocabulary v;
  v.source = file.path();
  SIMPLER_ASSIGN_OR_RETURN(v.model, optional_string(file, "tokenizer.ggml.model"));
  SIMPLER_ASSIGN_OR_RETURN(v.pre, optional_string(file, "tokenizer.ggml.pre"));
  SIMPLER_ASSIGN_OR_RETURN(std::span<const std::string_view> tokens,
                           file.get_string_array("tokenizer.ggml.tokens"));
  v.tokens.assign(tokens.begin(), tokens.end());
  SIMPLER_ASSIGN_OR_RETURN(v.token_types, file.get_int_array("tokenizer.ggml.token_type"));
  if (file.find("tokenizer.ggml.merges") != nullptr) {
    SIMPLER_ASSIGN_OR_RETURN(std::span<const std::string_view> merges,
                             file.get_string_array("tokenizer.ggml.merges"));
    v.merges.assign(merges.begin(), merges.end());
  }
  SIMPLER_ASSIGN_OR_RETURN(v.bos_token_id, optional_id(file, "tokenizer.ggml.bos_token_id"));
  SIMPLER_ASSIGN_OR_RETURN(v.eos_token_id, optional_id(file, "tokenizer.ggml.eos_token_id"));
  SIMPLER_ASSIGN_OR_RETURN(v.pad_token_id, optional_id(file, "tokenizer.ggml.padding_token_id"));
  return Tokenizer::from_gguf_vocabulary(v);
}

absl::StatusOr<ChatTemplate> gguf_chat_template(const GgufFile& file) {
  if (file.find("tokenizer.chat_template") == nullptr) {
    return absl::NotFoundError(absl::StrCat(file.path(), " has no tokenizer.chat_template"));
  }
  SIMPLER_ASSIGN_OR_RETURN(std::string_view text, file.get_string("tokenizer.chat_template"));
  absl::StatusOr<ChatTemplate> known = ChatTemplate::from_text(std::string(text));
  if (known.ok() || !absl::IsUnimplemented(known.status())) return known;
  return absl::UnimplementedError(
      absl::StrCat(file.path(),
                   ": tokenizer.chat_template differs from the chat template simpler renders "
                   "natively (its SHA-256 is ",
                   sha256_hex(text), "; Qwen3's is ", kQwen3ChatTemplateSha256, ")"));
}

std::vector<std::string> model_checkpoint_files(const std::string& model_path) {
  if (is_gguf_path(model_path)) return {model_path};
  std::vector<std::string> files;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(model_path, ec)) {
    if (e.path().extension() == ".safetensors") files.push_back(e.path().string());
  }
  std::sort(files.begin(), files.end());
  return files;
}

absl::StatusOr<Tokenizer> load_model_tokenizer(const std::string& model_path) {
  if (!is_gguf_path(model_path)) return Tokenizer::load(model_path);
  SIMPLER_ASSIGN_OR_RETURN(const GgufFile file, GgufFile::open(model_path));
  return gguf_tokenizer(file);
}

absl::StatusOr<ChatTemplate> load_model_chat_template(const std::string& model_path) {
  if (!is_gguf_path(model_path)) return ChatTemplate::load(model_path);
  SIMPLER_ASSIGN_OR_RETURN(const GgufFile file, GgufFile::open(model_path));
  return gguf_chat_template(file);
}

}  // namespace simpler::llm
