#include "simpler/model/gguf_export.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cinttypes>
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
#include "absl/strings/match.h"
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
constexpr uint32_t kFtypeQ4_0 = 2;     // LLAMA_FTYPE_MOSTLY_Q4_0
constexpr uint32_t kFtypeQ4_K_M = 15;  // LLAMA_FTYPE_MOSTLY_Q4_K_M
constexpr uint32_t kFtypeBf16 = 32;
constexpr int64_t kQ8_0Block = 32;
constexpr int64_t kQ8_0BlockBytes = 34;
constexpr int64_t kQ4_0BlockBytes = 18;
constexpr int64_t kSuperBlock = 256;
constexpr int64_t kQ4_KBlockBytes = 144;
constexpr int64_t kQ6_KBlockBytes = 210;
// ggml-quants.c's GROUP_MAX_EPS: a group whose largest magnitude is below it is all zero.
constexpr float kGroupMaxEps = 1e-15f;

// The block quantizers, defined with ggml's reference quantizers below.
struct BlockQuantizer;
const BlockQuantizer* quantizer_of(GgmlType type);
absl::Status quantize_row(const BlockQuantizer& q, std::span<const float> x, std::span<uint8_t> out,
                          size_t first_index = 0);
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
  SIMPLER_ASSIGN_OR_RETURN(const nlohmann::json j, base::parse_json_bounded(*text, path));
  auto bad = [&path](const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", what));
  };
  if (!j.is_object()) return bad("not a JSON object");
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

uint64_t ggml_bytes(GgmlType ggml_type, uint64_t numel);

// Values converted and encoded at a time: whole rows of about 1 Mi values (4 MiB of f32), so that
// a tensor is never widened in one piece (a 151936 x 1024 head would be 622 MB of f32).
constexpr int64_t kChunkValues = int64_t{1} << 20;

// Appends `f` (the values from index `first` of tensor `t`) to `out` as t's ggml type.
absl::Status write_values(std::ofstream& out, const OutTensor& t, std::span<const float> f,
                          int64_t first) {
  if (t.ggml_type == GgmlType::kF32) {
    out.write(reinterpret_cast<const char*>(f.data()),
              static_cast<std::streamsize>(f.size() * sizeof(float)));
    return absl::OkStatus();
  }
  if (const BlockQuantizer* quantizer = quantizer_of(t.ggml_type)) {
    std::vector<uint8_t> q(ggml_bytes(t.ggml_type, f.size()));
    SIMPLER_RETURN_IF_ERROR(quantize_row(*quantizer, f, q, static_cast<size_t>(first)));
    out.write(reinterpret_cast<const char*>(q.data()), static_cast<std::streamsize>(q.size()));
    return absl::OkStatus();
  }
  std::vector<uint16_t> h(f.size());
  for (size_t i = 0; i < f.size(); ++i) {
    h[i] = t.ggml_type == GgmlType::kF16 ? task::f32_to_f16(f[i]) : task::f32_to_bf16(f[i]);
  }
  out.write(reinterpret_cast<const char*>(h.data()),
            static_cast<std::streamsize>(h.size() * sizeof(uint16_t)));
  return absl::OkStatus();
}

// Writes `t`'s data (from `view`) as its ggml type: bytes of the same type as they are, else
// widened to f32 and encoded in chunks of whole rows (kChunkValues), the same bytes as the whole
// tensor in one piece (every encoding here works block by block within a row).
// CANCELLED (an empty message: export_gguf says how far it got) when `cancel` is set, checked
// before each chunk of a tensor written in another type (a large one takes seconds).
absl::Status write_tensor(std::ofstream& out, const OutTensor& t, const TensorView& view,
                          const std::atomic<bool>* cancel) {
  if ((t.ggml_type == GgmlType::kBF16 && view.dtype == task::DataType::kBFloat16) ||
      (t.ggml_type == GgmlType::kQ8_0 && view.dtype == task::DataType::kQ8_0) ||
      (t.ggml_type == GgmlType::kQ4_0 && view.dtype == task::DataType::kQ4_0)) {
    out.write(reinterpret_cast<const char*>(view.bytes.data()),
              static_cast<std::streamsize>(view.bytes.size()));
    return absl::OkStatus();
  }
  const int64_t numel = view.numel();
  const int64_t cols = view.shape.empty() ? 1 : std::max<int64_t>(1, view.shape.back());
  const int64_t chunk = std::max<int64_t>(1, kChunkValues / cols) * cols;
  std::vector<float> f;
  for (int64_t first = 0; first < numel; first += chunk) {
    if (cancel != nullptr && cancel->load()) return absl::CancelledError();
    const int64_t n = std::min(chunk, numel - first);
    TensorView part = view;
    part.shape = {n};
    part.bytes =
        view.bytes.subspan(task::bytes_of(view.dtype, first), task::bytes_of(view.dtype, n));
    f.resize(static_cast<size_t>(n));
    SIMPLER_RETURN_IF_ERROR(to_f32(part, f));
    SIMPLER_RETURN_IF_ERROR(write_values(out, t, f, first));
  }
  return absl::OkStatus();
}

// llama.cpp's use_more_bits (llama-quant.cpp): the first and last eighth of the layers and every
// third one between them.
bool use_more_bits(int64_t layer, int64_t layers) {
  return layer < layers / 8 || layer >= 7 * layers / 8 || (layer - layers / 8) % 3 == 2;
}

// The layer N of a "blk.N." tensor name, else -1.
int64_t layer_of(const std::string& name) {
  int64_t layer = -1;
  if (std::sscanf(name.c_str(), "blk.%" SCNd64 ".", &layer) != 1) return -1;
  return layer;
}

// A Q4_K_M file's type for 2-D tensor `name` (gguf_export.h): llama-quantize's choice for a dense
// model without an importance matrix, then its fallback for rows that are not whole super-blocks
// (Q6_K to Q8_0 as llama.cpp; Q4_K to Q8_0 where llama.cpp writes Q5_0, which has no kernels here).
GgmlType q4_k_m_type(const std::string& name, int64_t cols, bool head, int64_t layers) {
  GgmlType type = GgmlType::kQ4_K;
  const bool v = name.find("attn_v.weight") != std::string::npos;
  const bool down = name.find("ffn_down") != std::string::npos;
  if (head || ((v || down) && use_more_bits(layer_of(name), layers))) type = GgmlType::kQ6_K;
  if (cols % kSuperBlock != 0) type = GgmlType::kQ8_0;
  return type;
}

// The ggml type of tensor `name` (llama.cpp's) of `shape` in a file of `type`, the LM head when
// `head` (gguf_export.h: 1-D tensors f32; quantized rows that are not whole blocks f16; a Q4_0
// file's head Q6_K, or Q8_0 when its rows are not whole super-blocks; a Q4_K_M file's mix by
// q4_k_m_type).
GgmlType ggml_type_for(const std::string& name, const std::vector<int64_t>& shape, GgufType type,
                       bool head, int64_t layers) {
  if (shape.size() < 2 || type == GgufType::kF32) return GgmlType::kF32;
  if (type == GgufType::kBf16) return GgmlType::kBF16;
  if (shape.back() % kQ8_0Block != 0) return GgmlType::kF16;
  if (type == GgufType::kQ4_K_M) return q4_k_m_type(name, shape.back(), head, layers);
  if (type == GgufType::kQ4_0 && head) {
    return shape.back() % kSuperBlock == 0 ? GgmlType::kQ6_K : GgmlType::kQ8_0;
  }
  return type == GgufType::kQ4_0 ? GgmlType::kQ4_0 : GgmlType::kQ8_0;
}

// Bytes of `numel` elements of a ggml type written here.
uint64_t ggml_bytes(GgmlType ggml_type, uint64_t numel) {
  switch (ggml_type) {
    case GgmlType::kQ8_0:
      return numel / kQ8_0Block * kQ8_0BlockBytes;
    case GgmlType::kQ4_0:
      return numel / kQ8_0Block * kQ4_0BlockBytes;
    case GgmlType::kQ4_K:
      return numel / kSuperBlock * kQ4_KBlockBytes;
    case GgmlType::kQ6_K:
      return numel / kSuperBlock * kQ6_KBlockBytes;
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
    t.ggml_type = ggml_type_for(t.name, spec.shape, options.type, head, config.num_hidden_layers);
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
  kv.kv_u32("general.file_type", options.type == GgufType::kBf16     ? kFtypeBf16
                                 : options.type == GgufType::kQ8_0   ? kFtypeQ8_0
                                 : options.type == GgufType::kQ4_0   ? kFtypeQ4_0
                                 : options.type == GgufType::kQ4_K_M ? kFtypeQ4_K_M
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

// ggml's nearest_int: x rounded to the nearest integer, ties to even, by adding 1.5·2^23 (exact
// for |x| < 2^22, which every caller's value is: scaled weights are at most 64 in magnitude, or
// a scale at most 63 times larger than the largest).
int nearest_int(float x) {
  const float v = x + 12582912.0f;
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  return static_cast<int>(bits & 0x007fffffu) - 0x00400000;
}

// Every value of `x` finite, else INVALID_ARGUMENT naming `what` and the index (plus
// `first_index`, x's place in a larger tensor).
absl::Status check_finite(const char* what, std::span<const float> x, size_t first_index) {
  for (size_t i = 0; i < x.size(); ++i) {
    if (!std::isfinite(x[i])) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": value ", first_index + i, " is ", x[i], ", not finite"));
    }
  }
  return absl::OkStatus();
}

// x.size() whole blocks of `block_values`, out.size() their bytes and every value finite (named
// as check_finite names it), else INVALID_ARGUMENT (ggml's K-quant blocks of 256 are super-blocks
// in the messages).
absl::Status check_blocks(const char* what, std::span<const float> x, std::span<uint8_t> out,
                          int64_t block_values, int64_t block_bytes, size_t first_index) {
  const char* block = block_values == kSuperBlock ? "super-block" : "block";
  const auto per = static_cast<size_t>(block_values);
  if (x.size() % per != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": ", x.size(), " values are not whole ", block, "s of ", block_values));
  }
  const size_t want = x.size() / per * static_cast<size_t>(block_bytes);
  if (out.size() != want) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": the output holds ", out.size(),
                                                   " bytes, ", x.size() / per, " ", block,
                                                   "s need ", want));
  }
  return check_finite(what, x, first_index);
}

// The weighted sums of make_qkx2_quants for levels `l` of `x`.
struct LevelSums {
  float l = 0, l2 = 0, xl = 0;
};

// ggml's make_qkx2_quants for n = 32, nmax = 15, rmin = -1, rdelta = 0.1, nstep = 20, squared
// error (what quantize_row_q4_K_ref calls): an affine scale and min for the 32 values `x` with
// weights `w`, the levels L (0-15) that go with them, found by trying 21 scales around
// nmax / (max - min) and a weighted least-squares fit for each. Returns the scale; *the_min is
// the negated min (>= 0). Same float operations in the same order as the reference.
float make_qkx2_quants(const float* x, const float* w, uint8_t* L, float* the_min) {
  constexpr int kN = 32, kNmax = 15, kSteps = 20;
  constexpr float kRmin = -1.0f, kRdelta = 0.1f;
  float min = x[0], max = x[0];
  float sum_w = w[0];
  float sum_x = sum_w * x[0];
  for (int i = 1; i < kN; ++i) {
    if (x[i] < min) min = x[i];
    if (x[i] > max) max = x[i];
    sum_w += w[i];
    sum_x += w[i] * x[i];
  }
  if (min > 0) min = 0;
  if (max == min) {
    std::fill(L, L + kN, 0);
    *the_min = -min;
    return 0.0f;
  }
  float iscale = kNmax / (max - min);
  float scale = 1 / iscale;
  float best_error = 0;
  for (int i = 0; i < kN; ++i) {
    L[i] = static_cast<uint8_t>(std::clamp(nearest_int(iscale * (x[i] - min)), 0, kNmax));
    const float diff = scale * L[i] + min - x[i];
    best_error += w[i] * (diff * diff);
  }
  uint8_t aux[kN];
  for (int is = 0; is <= kSteps; ++is) {
    iscale = (kRmin + kRdelta * is + kNmax) / (max - min);
    LevelSums s;
    for (int i = 0; i < kN; ++i) {
      const int l = std::clamp(nearest_int(iscale * (x[i] - min)), 0, kNmax);
      aux[i] = static_cast<uint8_t>(l);
      s.l += w[i] * l;
      s.l2 += w[i] * l * l;
      s.xl += w[i] * l * x[i];
    }
    const float D = sum_w * s.l2 - s.l * s.l;
    if (!(D > 0)) continue;
    float this_scale = (sum_w * s.xl - sum_x * s.l) / D;
    float this_min = (s.l2 * sum_x - s.l * s.xl) / D;
    if (this_min > 0) {
      this_min = 0;
      this_scale = s.xl / s.l2;
    }
    float cur_error = 0;
    for (int i = 0; i < kN; ++i) {
      const float diff = this_scale * aux[i] + this_min - x[i];
      cur_error += w[i] * (diff * diff);
    }
    if (cur_error < best_error) {
      std::copy(aux, aux + kN, L);
      best_error = cur_error;
      scale = this_scale;
      min = this_min;
    }
  }
  *the_min = -min;
  return scale;
}

// One Q4_K super-block of x[0, 256) into `block` (quantize_row_q4_K_ref).
void quantize_q4_k_block(const float* x, uint8_t* block) {
  uint8_t L[kSuperBlock];
  float scales[8], mins[8];
  float max_scale = 0, max_min = 0;
  for (int j = 0; j < 8; ++j) {
    const float* xj = x + 32 * j;
    float sum_x2 = 0;
    for (int l = 0; l < 32; ++l) sum_x2 += xj[l] * xj[l];
    const float av_x = std::sqrt(sum_x2 / 32);
    float weights[32];
    for (int l = 0; l < 32; ++l) weights[l] = av_x + std::fabs(xj[l]);
    scales[j] = make_qkx2_quants(xj, weights, L + 32 * j, &mins[j]);
    max_scale = std::max(max_scale, scales[j]);
    max_min = std::max(max_min, mins[j]);
  }
  const float inv_scale = max_scale > 0 ? 63.f / max_scale : 0.f;
  const float inv_min = max_min > 0 ? 63.f / max_min : 0.f;
  uint8_t* sc = block + 4;
  std::fill(sc, sc + 12, 0);
  for (int j = 0; j < 8; ++j) {
    const auto ls = std::min<uint8_t>(63, static_cast<uint8_t>(nearest_int(inv_scale * scales[j])));
    const auto lm = std::min<uint8_t>(63, static_cast<uint8_t>(nearest_int(inv_min * mins[j])));
    if (j < 4) {
      sc[j] = ls;
      sc[j + 4] = lm;
    } else {  // get_scale_min_k4's packing: low 4 bits in sc[j + 4], high 2 on top of sc[j - 4],
              // sc[j]
      sc[j + 4] = static_cast<uint8_t>((ls & 0xF) | ((lm & 0xF) << 4));
      sc[j - 4] |= static_cast<uint8_t>((ls >> 4) << 6);
      sc[j] |= static_cast<uint8_t>((lm >> 4) << 6);
    }
  }
  const uint16_t d_bits = task::f32_to_f16(max_scale / 63.f);
  const uint16_t dmin_bits = task::f32_to_f16(max_min / 63.f);
  std::memcpy(block, &d_bits, 2);  // little-endian hosts only (x86-64, aarch64)
  std::memcpy(block + 2, &dmin_bits, 2);
  for (int j = 0; j < 8; ++j) {
    const int ls = j < 4 ? sc[j] & 63 : (sc[j + 4] & 0xF) | ((sc[j - 4] >> 6) << 4);
    const int lm = j < 4 ? sc[j + 4] & 63 : (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4);
    const float d = task::f16_to_f32(d_bits) * ls;
    if (d == 0) continue;  // the levels of make_qkx2_quants stay, as in the reference
    const float dm = task::f16_to_f32(dmin_bits) * lm;
    for (int i = 0; i < 32; ++i) {
      L[32 * j + i] =
          static_cast<uint8_t>(std::clamp(nearest_int((x[32 * j + i] + dm) / d), 0, 15));
    }
  }
  for (int c = 0; c < 4; ++c) {
    for (int l = 0; l < 32; ++l) {
      block[16 + 32 * c + l] = static_cast<uint8_t>(L[64 * c + l] | (L[64 * c + 32 + l] << 4));
    }
  }
}

// ggml's make_qx_quants for n = 16, nmax = 32, rmse_type 1 (weights x²), no importance weights
// (what quantize_row_q6_K_ref calls): a symmetric scale for the 16 values `x` and levels L
// (0-63, the signed level plus 32), the best of 19 scales around -32 / max by weighted least
// squares. Same float operations in the same order as the reference.
float make_qx_quants(const float* x, int8_t* L) {
  constexpr int kN = 16, kNmax = 32;
  float max = 0, amax = 0;
  for (int i = 0; i < kN; ++i) {
    const float ax = std::fabs(x[i]);
    if (ax > amax) {
      amax = ax;
      max = x[i];
    }
  }
  if (amax < kGroupMaxEps) {
    std::fill(L, L + kN, 0);
    return 0.f;
  }
  // sum(w·x·l) and sum(w·l²) at `iscale`: l the level of x in [-kNmax, kNmax), w = x². It runs
  // 19 times a group: its clamp written out (not std::clamp) and its sums in locals (not through
  // the pointers), as the ASan build (-O1) called std::clamp and checked each store, a third of
  // llm_gguf_export_test's time there.
  auto sums = [&](float iscale, float* sumlx, float* suml2) {
    float lx = 0, l2 = 0;
    for (int i = 0; i < kN; ++i) {
      int l = nearest_int(iscale * x[i]);
      l = l < -kNmax ? -kNmax : l > kNmax - 1 ? kNmax - 1 : l;
      const float w = x[i] * x[i];
      lx += w * x[i] * l;
      l2 += w * l * l;
    }
    *sumlx = lx;
    *suml2 = l2;
  };
  auto levels = [&](float iscale) {
    for (int i = 0; i < kN; ++i) {
      L[i] = static_cast<int8_t>(kNmax + std::clamp(nearest_int(iscale * x[i]), -kNmax, kNmax - 1));
    }
  };
  float iscale = -kNmax / max;
  float sumlx = 0, suml2 = 0;
  sums(iscale, &sumlx, &suml2);
  levels(iscale);
  float scale = suml2 != 0 ? sumlx / suml2 : 0.0f;
  float best = scale * sumlx;
  for (int is = -9; is <= 9; ++is) {
    if (is == 0) continue;
    iscale = -(kNmax + 0.1f * is) / max;
    sums(iscale, &sumlx, &suml2);
    if (suml2 > 0 && sumlx * sumlx > best * suml2) {
      levels(iscale);
      scale = sumlx / suml2;
      best = scale * sumlx;
    }
  }
  return scale;
}

// One Q6_K super-block of x[0, 256) into `block` (quantize_row_q6_K_ref).
void quantize_q6_k_block(const float* x, uint8_t* block) {
  int8_t L[kSuperBlock];
  float scales[16];
  float max_scale = 0, max_abs_scale = 0;
  for (int ib = 0; ib < 16; ++ib) {
    scales[ib] = make_qx_quants(x + 16 * ib, L + 16 * ib);
    if (std::fabs(scales[ib]) > max_abs_scale) {
      max_abs_scale = std::fabs(scales[ib]);
      max_scale = scales[ib];
    }
  }
  std::fill(block, block + kQ6_KBlockBytes, 0);
  if (max_abs_scale < kGroupMaxEps) return;  // all zero, d = +0 as well
  const float iscale = -128.f / max_scale;
  const uint16_t d_bits = task::f32_to_f16(1 / iscale);
  std::memcpy(block + 208, &d_bits, 2);  // little-endian hosts only (x86-64, aarch64)
  auto* sc = reinterpret_cast<int8_t*>(block + 192);
  for (int ib = 0; ib < 16; ++ib) {
    sc[ib] = static_cast<int8_t>(std::min(127, nearest_int(iscale * scales[ib])));
  }
  for (int j = 0; j < 16; ++j) {
    const float d = task::f16_to_f32(d_bits) * sc[j];
    if (d == 0) continue;  // make_qx_quants' levels stay, as in the reference
    for (int i = 0; i < 16; ++i) {
      L[16 * j + i] = static_cast<int8_t>(std::clamp(nearest_int(x[16 * j + i] / d), -32, 31) + 32);
    }
  }
  for (int h = 0; h < 2; ++h) {
    const int8_t* Lh = L + 128 * h;
    uint8_t* ql = block + 64 * h;
    uint8_t* qh = block + 128 + 32 * h;
    for (int l = 0; l < 32; ++l) {
      ql[l] = static_cast<uint8_t>((Lh[l] & 0xF) | ((Lh[l + 64] & 0xF) << 4));
      ql[l + 32] = static_cast<uint8_t>((Lh[l + 32] & 0xF) | ((Lh[l + 96] & 0xF) << 4));
      qh[l] = static_cast<uint8_t>((Lh[l] >> 4) | ((Lh[l + 32] >> 4) << 2) |
                                   ((Lh[l + 64] >> 4) << 4) | ((Lh[l + 96] >> 4) << 6));
    }
  }
}

// Stores the scale d of a Q8_0 / Q4_0 block at its start (binary16, nearest even); returns 1 / d
// in f32 (0 when d is 0), by which ggml scales the values.
float store_block_scale(float d, uint8_t* block) {
  const uint16_t d_bits = task::f32_to_f16(d);
  std::memcpy(block, &d_bits, sizeof(d_bits));  // little-endian hosts only (x86-64, aarch64)
  return d != 0.0f ? 1.0f / d : 0.0f;
}

void quantize_q8_0_block(const float* x, uint8_t* block) {
  float amax = 0.0f;
  for (int64_t i = 0; i < kQ8_0Block; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float id = store_block_scale(amax / 127.0f, block);
  for (int64_t i = 0; i < kQ8_0Block; ++i) {
    const float scaled = x[i] * id;
    block[2 + i] = static_cast<uint8_t>(static_cast<int8_t>(std::round(scaled)));
  }
}

void quantize_q4_0_block(const float* x, uint8_t* block) {
  float amax = 0.0f, max = 0.0f;
  for (int64_t i = 0; i < kQ8_0Block; ++i) {
    if (amax < std::fabs(x[i])) {
      amax = std::fabs(x[i]);
      max = x[i];
    }
  }
  const float id = store_block_scale(max / -8.0f, block);
  auto xi = [id](float value) {
    const float scaled = value * id + 8.5f;  // two roundings where nothing contracts them
    return std::min(15, static_cast<int>(static_cast<int8_t>(scaled)));
  };
  for (int64_t j = 0; j < kQ8_0Block / 2; ++j) {
    block[2 + j] = static_cast<uint8_t>(xi(x[j]) | xi(x[j + 16]) << 4);
  }
}

// ggml's reference quantizer of a block type: the values and bytes of one block and the function
// that quantizes one; `name` is its quantize_row_* function's, for messages.
struct BlockQuantizer {
  GgmlType type;
  const char* name;
  int64_t block_values;
  int64_t block_bytes;
  void (*quantize_block)(const float* x, uint8_t* block);
};

constexpr BlockQuantizer kQuantizers[] = {
    {GgmlType::kQ8_0, "quantize_row_q8_0", kQ8_0Block, kQ8_0BlockBytes, quantize_q8_0_block},
    {GgmlType::kQ4_0, "quantize_row_q4_0", kQ8_0Block, kQ4_0BlockBytes, quantize_q4_0_block},
    {GgmlType::kQ4_K, "quantize_row_q4_k", kSuperBlock, kQ4_KBlockBytes, quantize_q4_k_block},
    {GgmlType::kQ6_K, "quantize_row_q6_k", kSuperBlock, kQ6_KBlockBytes, quantize_q6_k_block}};

// The quantizer of `type`; nullptr for a type that is not block-quantized here.
const BlockQuantizer* quantizer_of(GgmlType type) {
  for (const BlockQuantizer& q : kQuantizers) {
    if (q.type == type) return &q;
  }
  return nullptr;
}

// check_blocks, then q's block function from each block of `x` into its bytes of `out`; a value
// that is not finite is named by its index plus `first_index` (x's place in a larger tensor).
absl::Status quantize_row(const BlockQuantizer& q, std::span<const float> x, std::span<uint8_t> out,
                          size_t first_index) {
  SIMPLER_RETURN_IF_ERROR(check_blocks(q.name, x, out, q.block_values, q.block_bytes, first_index));
  const auto blocks = static_cast<int64_t>(x.size()) / q.block_values;
  for (int64_t b = 0; b < blocks; ++b) {
    q.quantize_block(x.data() + b * q.block_values, out.data() + b * q.block_bytes);
  }
  return absl::OkStatus();
}

// Refusals of `out` before the checkpoint is read (export_gguf's contract): the rename at the end
// must never replace a file the model directory holds or links to (its config.json,
// generation_config.json, tokenizer files, safetensors shards, or the blob a Hugging Face
// snapshot's link points at).
absl::Status check_out_path(const std::string& out, const std::string& model_dir) {
  namespace fs = std::filesystem;
  if (out.empty()) return absl::InvalidArgumentError("the output path is empty");
  std::error_code ec;
  if (fs::is_directory(out, ec)) {
    return absl::InvalidArgumentError(absl::StrCat(out, " is a directory, not a file to write"));
  }
  const fs::path folder = fs::path(out).has_parent_path() ? fs::path(out).parent_path() : ".";
  if (!fs::is_directory(folder, ec)) {
    if (ec && ec != std::errc::no_such_file_or_directory && ec != std::errc::not_a_directory) {
      // a folder that cannot be examined (EACCES, ELOOP, ...)
      return absl::UnavailableError(
          absl::StrCat("cannot write ", out, ": ", folder.string(), ": ", ec.message()));
    }
    return absl::NotFoundError(
        absl::StrCat("cannot write ", out, ": there is no directory ", folder.string()));
  }
  const auto refused = [&](const std::string& why) {
    return absl::InvalidArgumentError(
        absl::StrCat(out, " ", why,
                     "; export-gguf never replaces a file of the model directory it reads "
                     "(write the GGUF file elsewhere, or under a new name ending in .gguf)"));
  };
  if (fs::equivalent(folder, model_dir, ec) && !absl::EndsWithIgnoreCase(out, ".gguf") &&
      !(fs::exists(out, ec) && is_gguf_path(out))) {
    return refused("lies in the model directory " + model_dir + " and is not named *.gguf");
  }
  if (!fs::exists(out, ec)) return absl::OkStatus();
  for (const fs::directory_entry& entry : fs::directory_iterator(model_dir, ec)) {
    // The checkpoint's files, not a GGUF file beside them (out's own entry among them).
    if (fs::is_regular_file(entry.path(), ec) && !is_gguf_path(entry.path().string()) &&
        fs::equivalent(out, entry.path(), ec)) {
      return refused("is the model directory's " + entry.path().filename().string() +
                     " (or the file it links to)");
    }
  }
  return absl::OkStatus();
}

// A new temporary file beside `out` for the export: "OUT.tmp.<pid>.<n>", created exclusively
// (never a file or a link already there, nor another export's) with the usual permissions
// (0666 less the umask). Its name, or UNAVAILABLE with the OS error naming it.
absl::StatusOr<std::string> create_temporary(const std::string& out) {
  static std::atomic<uint64_t> next{0};
  const std::string tmp = absl::StrCat(out, ".tmp.", ::getpid(), ".", next++);
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0666);
  if (fd < 0) {
    return absl::UnavailableError(absl::StrCat("cannot write ", out,
                                               " (creating its temporary file ", tmp, ": ",
                                               std::strerror(errno), ")"));
  }
  ::close(fd);
  return tmp;
}

}  // namespace

absl::Status quantize_row_q8_0(std::span<const float> x, std::span<uint8_t> out) {
  return quantize_row(*quantizer_of(GgmlType::kQ8_0), x, out);
}

absl::Status quantize_row_q4_0(std::span<const float> x, std::span<uint8_t> out) {
  return quantize_row(*quantizer_of(GgmlType::kQ4_0), x, out);
}

absl::Status quantize_row_q4_k(std::span<const float> x, std::span<uint8_t> out) {
  return quantize_row(*quantizer_of(GgmlType::kQ4_K), x, out);
}

absl::Status quantize_row_q6_k(std::span<const float> x, std::span<uint8_t> out) {
  return quantize_row(*quantizer_of(GgmlType::kQ6_K), x, out);
}

absl::Status export_gguf(const GgufExportOptions& options) {
  SIMPLER_RETURN_IF_ERROR(check_out_path(options.out_path, options.model_dir));
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

  SIMPLER_ASSIGN_OR_RETURN(const std::string tmp, create_temporary(options.out_path));
  std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
  auto discard = [&](absl::Status s) {  // every error: the temporary file goes
    out.close();
    std::remove(tmp.c_str());
    return s;
  };
  auto os_error = [&](const char* what) {
    const int err = errno;
    return discard(absl::UnavailableError(absl::StrCat("cannot write ", options.out_path, " (",
                                                       what, " its temporary file ", tmp, ": ",
                                                       std::strerror(err), ")")));
  };
  auto cancelled = [&](size_t done) {
    return options.cancel != nullptr && options.cancel->load()
               ? discard(absl::CancelledError(
                     absl::StrCat("cancelled after ", done, " of ", tensors.size(),
                                  " tensors; nothing was written at ", options.out_path)))
               : absl::OkStatus();
  };
  if (!out) return os_error("opening");
  out.write(head.bytes().data(), static_cast<std::streamsize>(head.bytes().size()));
  write_padding(out, head.bytes().size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    SIMPLER_RETURN_IF_ERROR(cancelled(i));
    const OutTensor& t = tensors[i];
    absl::StatusOr<TensorView> view = weights->get(t.source);
    if (!view.ok()) return discard(view.status());
    if (absl::Status s = write_tensor(out, t, *view, options.cancel); !s.ok()) {
      return absl::IsCancelled(s) ? cancelled(i) : discard(s);
    }
    release_pages(*view);
    write_padding(out, t.bytes);
    if (!out) return os_error("writing");
    if (options.progress) {
      options.progress(static_cast<int64_t>(i + 1), static_cast<int64_t>(tensors.size()));
    }
  }
  SIMPLER_RETURN_IF_ERROR(cancelled(tensors.size()));
  out.close();
  if (!out) return os_error("writing");
  if (std::rename(tmp.c_str(), options.out_path.c_str()) != 0) return os_error("renaming");
  return absl::OkStatus();
}

}  // namespace simpler::llm
