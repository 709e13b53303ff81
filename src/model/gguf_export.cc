#include "simpler/model/gguf_export.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "model/gguf_names.h"
#include "nlohmann/json.hpp"
#include "simpler/base/file.h"
#include "simpler/base/json.h"
#include "simpler/base/status.h"
#include "simpler/model/gguf.h"
#include "simpler/model/model_config.h"
#include "simpler/model/safetensors.h"
#include "simpler/task/data_type.h"

namespace simpler::llm {
namespace {

constexpr uint32_t kGgufVersion = 3;
// The file states it as general.alignment too.
constexpr uint64_t kAlignment = kGgufDefaultAlignment;
// llama_ftype (llama.h): LLAMA_FTYPE_ALL_F32, LLAMA_FTYPE_MOSTLY_Q8_0, LLAMA_FTYPE_MOSTLY_BF16.
constexpr uint32_t kFtypeF32 = 0;
constexpr uint32_t kFtypeQ8_0 = 7;
constexpr uint32_t kFtypeQ4_0 = 2;  // LLAMA_FTYPE_MOSTLY_Q4_0
constexpr uint32_t kFtypeBf16 = 32;
constexpr int64_t kQ8_0Block = 32;
constexpr int64_t kQ8_0BlockBytes = 34;
constexpr int64_t kQ4_0BlockBytes = 18;
// llama_token_type (llama.h).
constexpr int32_t kTokenNormal = 1;
constexpr int32_t kTokenControl = 3;
constexpr int32_t kTokenUserDefined = 4;
constexpr int32_t kTokenUnused = 5;

// The header being built: key-values and tensor infos, little-endian.
class Header {
 public:
  void u32(uint32_t v) { raw(&v, 4); }
  void u64(uint64_t v) { raw(&v, 8); }
  void str(std::string_view s) {
    u64(s.size());
    raw(s.data(), s.size());
  }
  void kv_u32(std::string_view key, uint32_t v) {
    begin(key, GgufValueType::kUint32);
    u32(v);
  }
  void kv_f32(std::string_view key, float v) {
    begin(key, GgufValueType::kFloat32);
    raw(&v, 4);
  }
  void kv_bool(std::string_view key, bool v) {
    begin(key, GgufValueType::kBool);
    const uint8_t b = v ? 1 : 0;
    raw(&b, 1);
  }
  void kv_str(std::string_view key, std::string_view v) {
    begin(key, GgufValueType::kString);
    str(v);
  }
  void kv_strings(std::string_view key, const std::vector<std::string>& v) {
    begin(key, GgufValueType::kArray);
    type(GgufValueType::kString);
    u64(v.size());
    for (const std::string& s : v) str(s);
  }
  void kv_i32s(std::string_view key, const std::vector<int32_t>& v) {
    begin(key, GgufValueType::kArray);
    type(GgufValueType::kInt32);
    u64(v.size());
    raw(v.data(), v.size() * sizeof(int32_t));
  }
  int64_t kv_count() const { return kv_count_; }
  const std::string& bytes() const { return bytes_; }
  void raw(const void* p, size_t n) { bytes_.append(static_cast<const char*>(p), n); }

 private:
  void type(GgufValueType t) { u32(static_cast<uint32_t>(t)); }
  void begin(std::string_view key, GgufValueType t) {
    str(key);
    type(t);
    ++kv_count_;
  }
  std::string bytes_;
  int64_t kv_count_ = 0;
};

// One tensor of the file: where it comes from and how it is written.
struct OutTensor {
  std::string name;            // llama.cpp's name
  std::string source;          // the checkpoint's name
  std::vector<int64_t> shape;  // row-major, as in the checkpoint
  GgmlType ggml_type = GgmlType::kF32;
  uint64_t bytes = 0;
  uint64_t offset = 0;  // from the start of the data section
};

uint64_t align_up(uint64_t v) { return (v + kAlignment - 1) / kAlignment * kAlignment; }

struct Vocabulary {
  std::vector<std::string> tokens;
  std::vector<int32_t> types;
  std::vector<std::string> merges;
};

// tokenizer.json's BPE vocabulary, added tokens and merges, padded to `vocab_size` ids.
absl::StatusOr<Vocabulary> read_vocabulary(const std::string& dir, int64_t vocab_size) {
  const std::string path = dir + "/tokenizer.json";
  absl::StatusOr<std::string> text = base::read_regular_file(path);
  if (!text.ok()) return text.status();
  nlohmann::json j = nlohmann::json::parse(*text, nullptr, false);
  auto bad = [&path](const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", what));
  };
  if (j.is_discarded() || !j.is_object()) return bad("not a JSON object");
  const nlohmann::json* model = j.contains("model") ? &j["model"] : nullptr;
  if (model == nullptr || !model->is_object() || model->value("type", "") != "BPE") {
    return bad("'model' is not a BPE model");
  }
  if (!model->contains("vocab") || !(*model)["vocab"].is_object()) {
    return bad("'model.vocab' is not an object");
  }
  Vocabulary v;
  v.tokens.resize(static_cast<size_t>(vocab_size));
  v.types.assign(static_cast<size_t>(vocab_size), kTokenUnused);
  std::vector<bool> named(static_cast<size_t>(vocab_size), false);
  auto put = [&](int64_t id, const std::string& text, int32_t type) -> absl::Status {
    if (id < 0 || id >= vocab_size) {
      return bad(absl::StrCat("token id ", id, " ('", text,
                              "') is outside the model's vocabulary of ", vocab_size));
    }
    v.tokens[id] = text;
    v.types[id] = type;
    named[id] = true;
    return absl::OkStatus();
  };
  for (const auto& [text, id] : (*model)["vocab"].items()) {
    if (!id.is_number_integer())
      return bad(absl::StrCat("vocab entry '", text, "' has no integer id"));
    if (absl::Status s = put(id.get<int64_t>(), text, kTokenNormal); !s.ok()) return s;
  }
  if (j.contains("added_tokens") && j["added_tokens"].is_array()) {
    for (const nlohmann::json& t : j["added_tokens"]) {
      if (!t.is_object() || !t.contains("id") || !t["id"].is_number_integer() ||
          !t.contains("content") || !t["content"].is_string()) {
        return bad("an added_tokens entry lacks an integer 'id' or a string 'content'");
      }
      const bool special = t.value("special", false);
      absl::Status s = put(t["id"].get<int64_t>(), t["content"].get<std::string>(),
                           special ? kTokenControl : kTokenUserDefined);
      if (!s.ok()) return s;
    }
  }
  for (int64_t id = 0; id < vocab_size; ++id) {
    if (!named[id]) v.tokens[id] = absl::StrCat("[PAD", id, "]");
  }
  if (!model->contains("merges") || !(*model)["merges"].is_array()) {
    return bad("'model.merges' is not an array");
  }
  for (const nlohmann::json& m : (*model)["merges"]) {
    if (m.is_string()) {
      v.merges.push_back(m.get<std::string>());
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      v.merges.push_back(absl::StrCat(m[0].get<std::string>(), " ", m[1].get<std::string>()));
    } else {
      return bad("a merges entry is neither \"a b\" nor [\"a\", \"b\"]");
    }
  }
  return v;
}

// tokenizer_config.json's "chat_template" (a string), or "" when the file or the key is absent.
absl::StatusOr<std::string> read_chat_template(const std::string& dir) {
  const std::string path = dir + "/tokenizer_config.json";
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) return std::string();
  SIMPLER_ASSIGN_OR_RETURN(std::string text, base::read_regular_file(path));
  SIMPLER_ASSIGN_OR_RETURN(nlohmann::json j, base::parse_json_bounded(text, path));
  if (!j.is_object()) return absl::InvalidArgumentError(absl::StrCat(path, ": not a JSON object"));
  auto it = j.find("chat_template");
  if (it == j.end() || it->is_null()) return std::string();
  if (!it->is_string()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path,
                     ": 'chat_template' is not a string (a list of named templates is not "
                     "written to GGUF)"));
  }
  return it->get<std::string>();
}

// Writes `t`'s data (from `view`) as its ggml type.
absl::Status write_tensor(std::ofstream& out, const OutTensor& t, const TensorView& view) {
  if ((t.ggml_type == GgmlType::kBF16 && view.dtype == task::DataType::kBFloat16) ||
      (t.ggml_type == GgmlType::kQ8_0 && view.dtype == task::DataType::kQ8_0) ||
      (t.ggml_type == GgmlType::kQ4_0 && view.dtype == task::DataType::kQ4_0)) {
    out.write(reinterpret_cast<const char*>(view.bytes.data()),
              static_cast<std::streamsize>(view.bytes.size()));
    return absl::OkStatus();
  }
  absl::StatusOr<std::vector<float>> f = to_f32(view);
  if (!f.ok()) return f.status();
  if (t.ggml_type == GgmlType::kF32) {
    out.write(reinterpret_cast<const char*>(f->data()),
              static_cast<std::streamsize>(f->size() * sizeof(float)));
    return absl::OkStatus();
  }
  if (t.ggml_type == GgmlType::kQ8_0 || t.ggml_type == GgmlType::kQ4_0) {
    const bool q8 = t.ggml_type == GgmlType::kQ8_0;
    std::vector<uint8_t> q(f->size() / kQ8_0Block * (q8 ? kQ8_0BlockBytes : kQ4_0BlockBytes));
    SIMPLER_RETURN_IF_ERROR(q8 ? quantize_row_q8_0(*f, q) : quantize_row_q4_0(*f, q));
    out.write(reinterpret_cast<const char*>(q.data()), static_cast<std::streamsize>(q.size()));
    return absl::OkStatus();
  }
  std::vector<uint16_t> h(f->size());
  for (size_t i = 0; i < f->size(); ++i) {
    h[i] = t.ggml_type == GgmlType::kF16 ? task::f32_to_f16((*f)[i]) : task::f32_to_bf16((*f)[i]);
  }
  out.write(reinterpret_cast<const char*>(h.data()),
            static_cast<std::streamsize>(h.size() * sizeof(uint16_t)));
  return absl::OkStatus();
}

// The ggml type of tensor `name` (llama.cpp's) of `shape` in a file of `type`, the LM head when
// `head` (gguf_export.h: 1-D tensors f32; quantized rows that are not whole blocks f16; a Q4_0
// file's head Q8_0).
GgmlType ggml_type_for(const std::vector<int64_t>& shape, GgufType type, bool head) {
  if (shape.size() < 2 || type == GgufType::kF32) return GgmlType::kF32;
  if (type == GgufType::kBf16) return GgmlType::kBF16;
  if (shape.back() % kQ8_0Block != 0) return GgmlType::kF16;
  return type == GgufType::kQ4_0 && !head ? GgmlType::kQ4_0 : GgmlType::kQ8_0;
}

// Bytes of `numel` elements of a ggml type written here.
uint64_t ggml_bytes(GgmlType ggml_type, uint64_t numel) {
  switch (ggml_type) {
    case GgmlType::kQ8_0:
      return numel / kQ8_0Block * kQ8_0BlockBytes;
    case GgmlType::kQ4_0:
      return numel / kQ8_0Block * kQ4_0BlockBytes;
    case GgmlType::kF16:
    case GgmlType::kBF16:
      return numel * 2;
    default:
      return numel * 4;
  }
}

void write_padding(std::ofstream& out, uint64_t written) {
  static const char kZeros[kAlignment] = {};
  out.write(kZeros, static_cast<std::streamsize>(align_up(written) - written));
}

// The output tensors of the model's weights, in order: GGUF names, types and data offsets.
absl::StatusOr<std::vector<OutTensor>> plan_tensors(const ModelConfig& config,
                                                    const ModelWeights& weights,
                                                    const GgufExportOptions& options) {
  std::vector<OutTensor> tensors;
  uint64_t offset = 0;
  for (const WeightSpec& spec : config.tensor_names_and_shapes()) {
    absl::StatusOr<TensorView> view = weights.get(spec.name, spec.shape);
    if (!view.ok()) return view.status();
    OutTensor t;
    t.name = gguf_tensor_name(spec.name);
    t.source = spec.name;
    t.shape = spec.shape;
    // The LM head: output.weight, or token_embd.weight when the embeddings are tied.
    const bool head =
        t.name == "output.weight" || (t.name == "token_embd.weight" && config.tie_word_embeddings);
    t.ggml_type = ggml_type_for(spec.shape, options.type, head);
    t.bytes = ggml_bytes(t.ggml_type, static_cast<uint64_t>(view->numel()));
    t.offset = offset;
    offset = align_up(offset + t.bytes);
    tensors.push_back(std::move(t));
  }
  return tensors;
}

// The key-value metadata: the architecture's hyper-parameters and the tokenizer.
Header metadata(const ModelConfig& c, const Vocabulary& vocab, const std::string& chat_template,
                const GgufExportOptions& options) {
  Header kv;
  kv.kv_str("general.architecture", "qwen3");
  kv.kv_str("general.name", std::filesystem::path(options.model_dir).filename().string());
  kv.kv_u32("general.alignment", kAlignment);
  kv.kv_u32("general.file_type", options.type == GgufType::kBf16   ? kFtypeBf16
                                 : options.type == GgufType::kQ8_0 ? kFtypeQ8_0
                                 : options.type == GgufType::kQ4_0 ? kFtypeQ4_0
                                                                   : kFtypeF32);
  kv.kv_u32("qwen3.context_length", static_cast<uint32_t>(c.max_position_embeddings));
  kv.kv_u32("qwen3.embedding_length", static_cast<uint32_t>(c.hidden_size));
  kv.kv_u32("qwen3.block_count", static_cast<uint32_t>(c.num_hidden_layers));
  kv.kv_u32("qwen3.feed_forward_length", static_cast<uint32_t>(c.intermediate_size));
  kv.kv_u32("qwen3.attention.head_count", static_cast<uint32_t>(c.num_attention_heads));
  kv.kv_u32("qwen3.attention.head_count_kv", static_cast<uint32_t>(c.num_key_value_heads));
  kv.kv_u32("qwen3.attention.key_length", static_cast<uint32_t>(c.head_dim));
  kv.kv_u32("qwen3.attention.value_length", static_cast<uint32_t>(c.head_dim));
  kv.kv_f32("qwen3.rope.freq_base", static_cast<float>(c.rope_theta));
  kv.kv_f32("qwen3.attention.layer_norm_rms_epsilon", static_cast<float>(c.rms_norm_eps));
  kv.kv_str("tokenizer.ggml.model", "gpt2");
  kv.kv_str("tokenizer.ggml.pre", "qwen2");
  kv.kv_strings("tokenizer.ggml.tokens", vocab.tokens);
  kv.kv_i32s("tokenizer.ggml.token_type", vocab.types);
  kv.kv_strings("tokenizer.ggml.merges", vocab.merges);
  const int64_t eos = c.eos_token_ids.empty() ? 151645 : c.eos_token_ids.front();
  const int64_t bos = c.bos_token_id.value_or(151643);
  kv.kv_u32("tokenizer.ggml.eos_token_id", static_cast<uint32_t>(eos));
  kv.kv_u32("tokenizer.ggml.bos_token_id", static_cast<uint32_t>(bos));
  kv.kv_u32("tokenizer.ggml.padding_token_id", static_cast<uint32_t>(bos));
  kv.kv_bool("tokenizer.ggml.add_bos_token", false);
  if (!chat_template.empty()) kv.kv_str("tokenizer.chat_template", chat_template);
  return kv;
}

// The file's header: magic, version, counts, the metadata `kv` and the tensor infos.
Header file_header(const Header& kv, const std::vector<OutTensor>& tensors) {
  Header head;
  head.raw("GGUF", 4);
  head.u32(kGgufVersion);
  head.u64(tensors.size());
  head.u64(static_cast<uint64_t>(kv.kv_count()));
  head.raw(kv.bytes().data(), kv.bytes().size());
  for (const OutTensor& t : tensors) {
    head.str(t.name);
    head.u32(static_cast<uint32_t>(t.shape.size()));
    for (auto d = t.shape.rbegin(); d != t.shape.rend(); ++d) head.u64(static_cast<uint64_t>(*d));
    head.u32(static_cast<uint32_t>(t.ggml_type));
    head.u64(t.offset);
  }
  return head;
}

}  // namespace

absl::Status quantize_row_q8_0(std::span<const float> x, std::span<uint8_t> out) {
  if (x.size() % kQ8_0Block != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("quantize_row_q8_0: ", x.size(), " values are not whole blocks of 32"));
  }
  if (out.size() != x.size() / kQ8_0Block * kQ8_0BlockBytes) {
    return absl::InvalidArgumentError(absl::StrCat("quantize_row_q8_0: the output holds ",
                                                   out.size(), " bytes, ", x.size() / kQ8_0Block,
                                                   " blocks need ", x.size() / kQ8_0Block * 34));
  }
  for (size_t b = 0; b < x.size() / kQ8_0Block; ++b) {
    const float* v = x.data() + b * kQ8_0Block;
    uint8_t* block = out.data() + b * kQ8_0BlockBytes;
    float amax = 0.0f;
    for (int64_t i = 0; i < kQ8_0Block; ++i) {
      if (!std::isfinite(v[i])) {
        return absl::InvalidArgumentError(absl::StrCat(
            "quantize_row_q8_0: value ", b * kQ8_0Block + i, " is ", v[i], ", not finite"));
      }
      amax = std::max(amax, std::fabs(v[i]));
    }
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    const uint16_t d_bits = task::f32_to_f16(d);
    std::memcpy(block, &d_bits, sizeof(d_bits));  // little-endian hosts only (x86-64, aarch64)
    for (int64_t i = 0; i < kQ8_0Block; ++i) {
      const float scaled = v[i] * id;
      block[2 + i] = static_cast<uint8_t>(static_cast<int8_t>(std::round(scaled)));
    }
  }
  return absl::OkStatus();
}

absl::Status quantize_row_q4_0(std::span<const float> x, std::span<uint8_t> out) {
  if (x.size() % kQ8_0Block != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("quantize_row_q4_0: ", x.size(), " values are not whole blocks of 32"));
  }
  if (out.size() != x.size() / kQ8_0Block * kQ4_0BlockBytes) {
    return absl::InvalidArgumentError(absl::StrCat("quantize_row_q4_0: the output holds ",
                                                   out.size(), " bytes, ", x.size() / kQ8_0Block,
                                                   " blocks need ", x.size() / kQ8_0Block * 18));
  }
  for (size_t b = 0; b < x.size() / kQ8_0Block; ++b) {
    const float* v = x.data() + b * kQ8_0Block;
    uint8_t* block = out.data() + b * kQ4_0BlockBytes;
    float amax = 0.0f, max = 0.0f;
    for (int64_t i = 0; i < kQ8_0Block; ++i) {
      if (!std::isfinite(v[i])) {
        return absl::InvalidArgumentError(absl::StrCat(
            "quantize_row_q4_0: value ", b * kQ8_0Block + i, " is ", v[i], ", not finite"));
      }
      if (amax < std::fabs(v[i])) {
        amax = std::fabs(v[i]);
        max = v[i];
      }
    }
    const float d = max / -8.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    const uint16_t d_bits = task::f32_to_f16(d);
    std::memcpy(block, &d_bits, sizeof(d_bits));  // little-endian hosts only (x86-64, aarch64)
    auto xi = [id](float value) {
      const float scaled = value * id + 8.5f;  // two roundings where nothing contracts them
      return std::min(15, static_cast<int>(static_cast<int8_t>(scaled)));
    };
    for (int64_t j = 0; j < kQ8_0Block / 2; ++j) {
      block[2 + j] = static_cast<uint8_t>(xi(v[j]) | xi(v[j + 16]) << 4);
    }
  }
  return absl::OkStatus();
}

absl::Status export_gguf(const GgufExportOptions& options) {
  absl::StatusOr<ModelConfig> config = ModelConfig::load(options.model_dir);
  if (!config.ok()) return config.status();
  absl::StatusOr<ModelWeights> weights = ModelWeights::open(options.model_dir);
  if (!weights.ok()) return weights.status();
  absl::StatusOr<Vocabulary> vocab = read_vocabulary(options.model_dir, config->vocab_size);
  if (!vocab.ok()) return vocab.status();
  SIMPLER_ASSIGN_OR_RETURN(const std::string chat_template, read_chat_template(options.model_dir));
  absl::StatusOr<std::vector<OutTensor>> planned = plan_tensors(*config, *weights, options);
  if (!planned.ok()) return planned.status();
  const std::vector<OutTensor>& tensors = *planned;
  const Header head = file_header(metadata(*config, *vocab, chat_template, options), tensors);

  const std::string tmp = options.out_path + ".tmp";
  std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
  auto os_error = [&](const char* what) {
    const int err = errno;
    out.close();
    std::remove(tmp.c_str());
    return absl::UnavailableError(
        absl::StrCat("export-gguf: ", what, " ", tmp, ": ", std::strerror(err)));
  };
  if (!out) return os_error("cannot open");
  out.write(head.bytes().data(), static_cast<std::streamsize>(head.bytes().size()));
  write_padding(out, head.bytes().size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const OutTensor& t = tensors[i];
    absl::StatusOr<TensorView> view = weights->get(t.source);
    if (!view.ok()) return view.status();
    if (absl::Status s = write_tensor(out, t, *view); !s.ok()) {
      out.close();
      std::remove(tmp.c_str());
      return s;
    }
    release_pages(*view);
    write_padding(out, t.bytes);
    if (!out) return os_error("cannot write");
    if (options.progress) {
      options.progress(static_cast<int64_t>(i + 1), static_cast<int64_t>(tensors.size()));
    }
  }
  out.close();
  if (!out) return os_error("cannot write");
  if (std::rename(tmp.c_str(), options.out_path.c_str()) != 0) return os_error("cannot rename");
  return absl::OkStatus();
}

}  // namespace simpler::llm
