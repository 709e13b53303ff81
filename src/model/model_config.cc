#include "simpler/model/model_config.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "model/str.h"
#include "nlohmann/json.hpp"
#include "simpler/base/file.h"
#include "simpler/base/json.h"
#include "simpler/base/status.h"
#include "simpler/model/gguf.h"

namespace simpler::llm {
namespace {

using json = nlohmann::json;

const char* type_name(const json& v) { return v.type_name(); }

// A bounded quote of an offending value for a message.
std::string quote(const json& v) { return base::quote_json_prefix(v, 80); }

absl::Status field_error(std::string_view source, std::string_view field, std::string_view what) {
  return absl::InvalidArgumentError(
      absl::StrCat(str(source), ": field '", str(field), "': ", str(what)));
}

// Reads an integer field. Absent (or null) leaves `out` alone and returns false in `present`.
absl::Status read_int(const json& j, std::string_view source, const char* field, int64_t* out,
                      bool required) {
  auto it = j.find(field);
  if (it == j.end() || it->is_null()) {
    if (required) {
      return absl::InvalidArgumentError(
          absl::StrCat(str(source), ": missing required field '", field, "'"));
    }
    return absl::OkStatus();
  }
  if (!it->is_number_integer()) {
    return field_error(source, field,
                       absl::StrCat("must be an integer, got ", type_name(*it), " ", quote(*it)));
  }
  if (it->is_number_unsigned() &&
      it->get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
    return field_error(source, field,
                       absl::StrCat(it->get<uint64_t>(), " is above the largest integer accepted, ",
                                    std::numeric_limits<int64_t>::max()));
  }
  *out = it->get<int64_t>();
  return absl::OkStatus();
}

// A field that `is_kind` accepts, read as T ("must be <expected>, got ..." otherwise); absent
// or null leaves *out as it is.
template <typename T, typename IsKind>
absl::Status read_scalar(const json& j, std::string_view source, const char* field, IsKind is_kind,
                         const char* expected, T* out) {
  auto it = j.find(field);
  if (it == j.end() || it->is_null()) return absl::OkStatus();
  if (!is_kind(*it)) {
    return field_error(
        source, field,
        absl::StrCat("must be ", expected, ", got ", type_name(*it), " ", quote(*it)));
  }
  *out = it->get<T>();
  return absl::OkStatus();
}

absl::Status read_double(const json& j, std::string_view source, const char* field, double* out) {
  return read_scalar(
      j, source, field, [](const json& v) { return v.is_number(); }, "a number", out);
}

absl::Status read_bool(const json& j, std::string_view source, const char* field, bool* out) {
  return read_scalar(
      j, source, field, [](const json& v) { return v.is_boolean(); }, "true or false", out);
}

absl::Status read_string(const json& j, std::string_view source, const char* field,
                         std::string* out) {
  return read_scalar(
      j, source, field, [](const json& v) { return v.is_string(); }, "a string", out);
}

// eos_token_id: an integer or a list of integers (or absent/null).
absl::Status read_ids(const json& j, std::string_view source, const char* field,
                      std::vector<int64_t>* out) {
  auto it = j.find(field);
  if (it == j.end() || it->is_null()) return absl::OkStatus();
  auto too_big = [&](const json& v) {
    return v.is_number_unsigned() &&
           v.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
  };
  if (it->is_number_integer()) {
    if (too_big(*it)) {
      return field_error(source, field,
                         absl::StrCat("token id ", it->get<uint64_t>(), " is out of range"));
    }
    out->push_back(it->get<int64_t>());
    return absl::OkStatus();
  }
  if (it->is_array()) {
    for (const json& v : *it) {
      if (v.is_number_integer() && too_big(v)) {
        return field_error(source, field,
                           absl::StrCat("token id ", v.get<uint64_t>(), " is out of range"));
      }
      if (!v.is_number_integer()) {
        return field_error(
            source, field,
            absl::StrCat("must be an integer or a list of integers, got ", quote(*it)));
      }
      out->push_back(v.get<int64_t>());
    }
    return absl::OkStatus();
  }
  return field_error(source, field,
                     absl::StrCat("must be an integer or a list of integers, got ", type_name(*it),
                                  " ", quote(*it)));
}

absl::StatusOr<json> parse_object(std::string_view text, std::string_view source) {
  SIMPLER_ASSIGN_OR_RETURN(json j, base::parse_json_bounded(text, source));
  if (!j.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(str(source), ": not a JSON object"));
  }
  return j;
}

// The whole file (a regular file of at most 64 MB), or NOT_FOUND / the error naming it.
absl::StatusOr<std::string> read_file(const std::string& path) {
  return base::read_regular_file(path, uint64_t{64} << 20);
}

// ModelConfig::parse's steps, in order.

// architectures and model_type, which must name Qwen3.
absl::Status read_architecture(const json& j, std::string_view src, ModelConfig& c) {
  if (auto it = j.find("architectures"); it != j.end() && !it->is_null()) {
    if (!it->is_array()) {
      return field_error(src, "architectures", "must be a list of strings");
    }
    for (const json& a : *it) {
      if (!a.is_string()) return field_error(src, "architectures", "must be a list of strings");
      c.architectures.push_back(a.get<std::string>());
    }
  }
  SIMPLER_RETURN_IF_ERROR(read_string(j, src, "model_type", &c.model_type));
  const bool qwen3_arch = std::find(c.architectures.begin(), c.architectures.end(),
                                    "Qwen3ForCausalLM") != c.architectures.end();
  if (!qwen3_arch && c.model_type != "qwen3") {
    std::string names;
    for (const std::string& a : c.architectures) {
      absl::StrAppend(&names, names.empty() ? "" : ", ", a);
    }
    return absl::InvalidArgumentError(absl::StrCat(
        str(src), ": unknown architecture [", names, "] (model_type '", c.model_type,
        "'): expected architectures containing \"Qwen3ForCausalLM\" or model_type \"qwen3\""));
  }
  return absl::OkStatus();
}

// The sizes, head_dim (from them when absent), the numerics and the special token ids.
absl::Status read_dimensions(const json& j, std::string_view src, ModelConfig& c) {
  SIMPLER_RETURN_IF_ERROR(read_int(j, src, "hidden_size", &c.hidden_size, true));
  SIMPLER_RETURN_IF_ERROR(read_int(j, src, "intermediate_size", &c.intermediate_size, true));
  SIMPLER_RETURN_IF_ERROR(read_int(j, src, "num_hidden_layers", &c.num_hidden_layers, true));
  SIMPLER_RETURN_IF_ERROR(read_int(j, src, "num_attention_heads", &c.num_attention_heads, true));
  SIMPLER_RETURN_IF_ERROR(read_int(j, src, "num_key_value_heads", &c.num_key_value_heads, true));
  SIMPLER_RETURN_IF_ERROR(read_int(j, src, "vocab_size", &c.vocab_size, true));
  c.head_dim = -1;
  SIMPLER_RETURN_IF_ERROR(read_int(j, src, "head_dim", &c.head_dim, false));
  if (c.head_dim == -1) {
    if (c.hidden_size <= 0 || c.num_attention_heads <= 0 ||
        c.hidden_size % c.num_attention_heads != 0) {
      return field_error(src, "head_dim",
                         absl::StrCat("absent, and hidden_size ", c.hidden_size,
                                      " is not a positive multiple of num_attention_heads ",
                                      c.num_attention_heads));
    }
    c.head_dim = c.hidden_size / c.num_attention_heads;
  }
  SIMPLER_RETURN_IF_ERROR(
      read_int(j, src, "max_position_embeddings", &c.max_position_embeddings, false));
  SIMPLER_RETURN_IF_ERROR(read_double(j, src, "rms_norm_eps", &c.rms_norm_eps));
  SIMPLER_RETURN_IF_ERROR(read_double(j, src, "rope_theta", &c.rope_theta));
  SIMPLER_RETURN_IF_ERROR(read_bool(j, src, "tie_word_embeddings", &c.tie_word_embeddings));
  SIMPLER_RETURN_IF_ERROR(read_ids(j, src, "eos_token_id", &c.eos_token_ids));
  int64_t bos = -1;
  if (j.contains("bos_token_id") && !j["bos_token_id"].is_null()) {
    SIMPLER_RETURN_IF_ERROR(read_int(j, src, "bos_token_id", &bos, true));
    c.bos_token_id = bos;
  }
  SIMPLER_RETURN_IF_ERROR(read_string(j, src, "torch_dtype", &c.torch_dtype));
  return absl::OkStatus();
}

// What the engine does not implement: another activation, attention biases, sliding-window
// attention, rope scaling.
absl::Status check_unsupported(const json& j, std::string_view src) {
  std::string hidden_act = "silu";
  SIMPLER_RETURN_IF_ERROR(read_string(j, src, "hidden_act", &hidden_act));
  if (hidden_act != "silu") {
    return field_error(src, "hidden_act",
                       absl::StrCat("unsupported activation '", hidden_act, "' (only silu)"));
  }
  bool flag = false;
  SIMPLER_RETURN_IF_ERROR(read_bool(j, src, "attention_bias", &flag));
  if (flag) return field_error(src, "attention_bias", "unsupported: attention biases");
  SIMPLER_RETURN_IF_ERROR(read_bool(j, src, "use_sliding_window", &flag));
  if (flag) return field_error(src, "use_sliding_window", "unsupported: sliding-window attention");
  if (auto it = j.find("rope_scaling"); it != j.end() && !it->is_null()) {
    return field_error(src, "rope_scaling",
                       absl::StrCat("unsupported: only null, got ", quote(*it)));
  }
  return absl::OkStatus();
}

// generation_config.json's eos_token_id, each inside the vocabulary.
absl::Status read_generation_config(std::string_view generation_config_json,
                                    std::string_view generation_name, ModelConfig& c) {
  if (!generation_config_json.empty()) {
    SIMPLER_ASSIGN_OR_RETURN(json g, parse_object(generation_config_json, generation_name));
    SIMPLER_RETURN_IF_ERROR(
        read_ids(g, generation_name, "eos_token_id", &c.generation_eos_token_ids));
    for (int64_t id : c.generation_eos_token_ids) {
      if (id < 0 || id >= c.vocab_size) {
        return field_error(
            generation_name, "eos_token_id",
            absl::StrCat("token id ", id, " is outside [0, vocab_size ", c.vocab_size, ")"));
      }
    }
  }
  return absl::OkStatus();
}

// ModelConfig::validate's checks.

absl::Status check_positive(std::string_view source, const char* field, int64_t v) {
  if (v <= 0) return field_error(source, field, absl::StrCat("must be positive, got ", v));
  return absl::OkStatus();
}

struct Factor {
  const char* name;
  int64_t value;
};

// Weight sizes in f32 bytes (the engine's device copy) must fit 64 bits: the products are
// checked before any code multiplies them.
absl::Status check_f32_bytes_fit(std::string_view source, const char* tensor,
                                 std::initializer_list<Factor> factors) {
  int64_t bytes = 4;
  std::string spelled;
  for (const Factor& f : factors) {
    absl::StrAppend(&spelled, spelled.empty() ? "" : " x ", f.name, " ", f.value);
  }
  for (const Factor& f : factors) {
    if (__builtin_mul_overflow(bytes, f.value, &bytes)) {
      return field_error(
          source, factors.begin()[factors.size() - 1].name,
          absl::StrCat(tensor, " of ", spelled, " f32 elements overflows 64-bit byte sizes"));
    }
  }
  return absl::OkStatus();
}

// The kernels compute in float32: the values must be positive, finite and normal there.
absl::Status check_float32_normal(std::string_view source, const char* field, double v) {
  const float f = static_cast<float>(v);
  if (!(v > 0.0) || !std::isfinite(v) || !std::isnormal(f)) {
    return field_error(
        source, field,
        absl::StrCat("must be positive and within float32's normal range [",
                     std::numeric_limits<float>::min(), ", ", std::numeric_limits<float>::max(),
                     "] (the kernels compute in float32), got ", v));
  }
  return absl::OkStatus();
}

// Hugging Face's "eos_token_id": one id as a number, several as a list, none left out.
void set_eos_token_id(json& j, const std::vector<int64_t>& ids) {
  if (ids.size() == 1) {
    j["eos_token_id"] = ids[0];
  } else if (!ids.empty()) {
    j["eos_token_id"] = ids;
  }
}

}  // namespace

absl::StatusOr<ModelConfig> ModelConfig::parse(std::string_view config_json,
                                               std::string_view generation_config_json,
                                               std::string_view config_name,
                                               std::string_view generation_name) {
  SIMPLER_ASSIGN_OR_RETURN(json j, parse_object(config_json, config_name));
  const std::string_view src = config_name;
  ModelConfig c;
  c.architectures.clear();
  c.model_type.clear();

  // Architecture first: a file for another model fails with that, not a missing field.
  SIMPLER_RETURN_IF_ERROR(read_architecture(j, src, c));
  SIMPLER_RETURN_IF_ERROR(read_dimensions(j, src, c));
  SIMPLER_RETURN_IF_ERROR(check_unsupported(j, src));
  SIMPLER_RETURN_IF_ERROR(read_generation_config(generation_config_json, generation_name, c));
  SIMPLER_RETURN_IF_ERROR(c.validate(src));
  return c;
}

absl::Status ModelConfig::validate(std::string_view source) const {
  SIMPLER_RETURN_IF_ERROR(check_positive(source, "hidden_size", hidden_size));
  SIMPLER_RETURN_IF_ERROR(check_positive(source, "intermediate_size", intermediate_size));
  SIMPLER_RETURN_IF_ERROR(check_positive(source, "num_hidden_layers", num_hidden_layers));
  SIMPLER_RETURN_IF_ERROR(check_positive(source, "num_attention_heads", num_attention_heads));
  SIMPLER_RETURN_IF_ERROR(check_positive(source, "num_key_value_heads", num_key_value_heads));
  SIMPLER_RETURN_IF_ERROR(check_positive(source, "head_dim", head_dim));
  SIMPLER_RETURN_IF_ERROR(check_positive(source, "vocab_size", vocab_size));
  SIMPLER_RETURN_IF_ERROR(
      check_positive(source, "max_position_embeddings", max_position_embeddings));
  SIMPLER_RETURN_IF_ERROR(check_f32_bytes_fit(source, "q_proj",
                                              {{"hidden_size", hidden_size},
                                               {"num_attention_heads", num_attention_heads},
                                               {"head_dim", head_dim}}));
  SIMPLER_RETURN_IF_ERROR(check_f32_bytes_fit(source, "k_proj",
                                              {{"hidden_size", hidden_size},
                                               {"num_key_value_heads", num_key_value_heads},
                                               {"head_dim", head_dim}}));
  SIMPLER_RETURN_IF_ERROR(check_f32_bytes_fit(
      source, "mlp.gate_proj",
      {{"hidden_size", hidden_size}, {"intermediate_size", intermediate_size}}));
  SIMPLER_RETURN_IF_ERROR(check_f32_bytes_fit(
      source, "embed_tokens", {{"hidden_size", hidden_size}, {"vocab_size", vocab_size}}));
  if (num_attention_heads % num_key_value_heads != 0) {
    return field_error(source, "num_key_value_heads",
                       absl::StrCat(num_key_value_heads, " does not divide num_attention_heads ",
                                    num_attention_heads));
  }
  if (head_dim % 2 != 0) {
    return field_error(source, "head_dim",
                       absl::StrCat("must be even for rotary embeddings, got ", head_dim));
  }
  SIMPLER_RETURN_IF_ERROR(check_float32_normal(source, "rms_norm_eps", rms_norm_eps));
  SIMPLER_RETURN_IF_ERROR(check_float32_normal(source, "rope_theta", rope_theta));
  for (int64_t id : eos_token_ids) {
    if (id < 0 || id >= vocab_size) {
      return field_error(
          source, "eos_token_id",
          absl::StrCat("token id ", id, " is outside [0, vocab_size ", vocab_size, ")"));
    }
  }
  if (bos_token_id.has_value() && (*bos_token_id < 0 || *bos_token_id >= vocab_size)) {
    return field_error(
        source, "bos_token_id",
        absl::StrCat("token id ", *bos_token_id, " is outside [0, vocab_size ", vocab_size, ")"));
  }
  return absl::OkStatus();
}

absl::StatusOr<ModelConfig> ModelConfig::load(const std::string& dir) {
  namespace fs = std::filesystem;
  if (is_gguf_path(dir)) {
    SIMPLER_ASSIGN_OR_RETURN(const GgufFile file, GgufFile::open(dir));
    return from_gguf(file);
  }
  std::error_code ec;
  if (fs::exists(dir, ec) && !fs::is_directory(dir, ec)) {
    return absl::InvalidArgumentError(
        absl::StrCat("model directory '", dir, "' is a file, not a directory"));
  }
  const std::string config_path = (fs::path(dir) / "config.json").string();
  const std::string generation_path = (fs::path(dir) / "generation_config.json").string();
  SIMPLER_ASSIGN_OR_RETURN(std::string config_text, read_file(config_path));
  std::string generation_text;
  if (fs::exists(generation_path, ec)) {
    SIMPLER_ASSIGN_OR_RETURN(generation_text, read_file(generation_path));
    if (generation_text.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(generation_path, ": malformed JSON"));
    }
  }
  return parse(config_text, generation_text, config_path, generation_path);
}

absl::Status ModelConfig::check_request(std::span<const int64_t> prompt,
                                        int64_t max_new_tokens) const {
  if (prompt.empty()) return absl::InvalidArgumentError("empty prompt");
  for (int64_t id : prompt) {
    if (id < 0 || id >= vocab_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("token id ", id, " outside the vocabulary [0, ", vocab_size, ")"));
    }
  }
  if (max_new_tokens < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_new_tokens must be >= 1, got ", max_new_tokens));
  }
  const int64_t length = static_cast<int64_t>(prompt.size());
  if (length > max_position_embeddings || max_new_tokens > max_position_embeddings - length) {
    return absl::InvalidArgumentError(
        absl::StrCat("prompt of ", length, " tokens + ", max_new_tokens,
                     " new tokens exceeds max_position_embeddings ", max_position_embeddings));
  }
  return absl::OkStatus();
}

std::vector<int64_t> ModelConfig::stop_ids() const {
  std::vector<int64_t> out;
  for (const auto* list : {&eos_token_ids, &generation_eos_token_ids}) {
    for (int64_t id : *list) {
      if (std::find(out.begin(), out.end(), id) == out.end()) out.push_back(id);
    }
  }
  return out;
}

std::vector<WeightSpec> ModelConfig::tensor_names_and_shapes() const {
  const int64_t H = hidden_size, I = intermediate_size, V = vocab_size, hd = head_dim;
  std::vector<WeightSpec> out;
  out.push_back({"model.embed_tokens.weight", {V, H}});
  for (int64_t i = 0; i < num_hidden_layers; ++i) {
    const std::string p = absl::StrCat("model.layers.", i, ".");
    out.push_back({p + "input_layernorm.weight", {H}});
    out.push_back({p + "self_attn.q_proj.weight", {q_size(), H}});
    out.push_back({p + "self_attn.k_proj.weight", {kv_size(), H}});
    out.push_back({p + "self_attn.v_proj.weight", {kv_size(), H}});
    out.push_back({p + "self_attn.o_proj.weight", {H, q_size()}});
    out.push_back({p + "self_attn.q_norm.weight", {hd}});
    out.push_back({p + "self_attn.k_norm.weight", {hd}});
    out.push_back({p + "post_attention_layernorm.weight", {H}});
    out.push_back({p + "mlp.gate_proj.weight", {I, H}});
    out.push_back({p + "mlp.up_proj.weight", {I, H}});
    out.push_back({p + "mlp.down_proj.weight", {H, I}});
  }
  out.push_back({"model.norm.weight", {H}});
  if (!tie_word_embeddings) out.push_back({"lm_head.weight", {V, H}});
  return out;
}

std::string ModelConfig::to_config_json() const {
  // The keys of Qwen3's config.json (Hugging Face's Qwen3Config), written sorted.
  json j = {{"architectures", architectures},
            {"attention_bias", false},
            {"attention_dropout", 0.0},
            {"head_dim", head_dim},
            {"hidden_act", "silu"},
            {"hidden_size", hidden_size},
            {"initializer_range", 0.02},
            {"intermediate_size", intermediate_size},
            {"max_position_embeddings", max_position_embeddings},
            {"max_window_layers", num_hidden_layers},
            {"model_type", model_type},
            {"num_attention_heads", num_attention_heads},
            {"num_hidden_layers", num_hidden_layers},
            {"num_key_value_heads", num_key_value_heads},
            {"rms_norm_eps", rms_norm_eps},
            {"rope_scaling", nullptr},
            {"rope_theta", rope_theta},
            {"sliding_window", nullptr},
            {"tie_word_embeddings", tie_word_embeddings},
            {"use_cache", true},
            {"use_sliding_window", false},
            {"vocab_size", vocab_size}};
  if (bos_token_id.has_value()) j["bos_token_id"] = *bos_token_id;
  set_eos_token_id(j, eos_token_ids);
  if (!torch_dtype.empty()) j["torch_dtype"] = torch_dtype;
  return base::dump_replacing(j, 2) + "\n";
}

std::string ModelConfig::to_generation_config_json() const {
  json j = json::object();
  if (bos_token_id.has_value()) j["bos_token_id"] = *bos_token_id;
  set_eos_token_id(j, generation_eos_token_ids.empty() ? eos_token_ids : generation_eos_token_ids);
  if (bos_token_id.has_value()) j["pad_token_id"] = *bos_token_id;
  return j.dump(2) + "\n";
}

}  // namespace simpler::llm
