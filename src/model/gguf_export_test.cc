#include "simpler/model/gguf_export.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/mapped_file.h"
#include "model/model_test_util.h"
#include "nlohmann/json.hpp"
#include "simpler/model/make_model.h"
#include "simpler/model/model_config.h"
#include "simpler/model/safetensors.h"
#include "simpler/task/data_type.h"
#include "simpler/tokenizer/tokenizer.h"

namespace simpler::llm {
namespace {

using ::testing::HasSubstr;

// A GGUF file read back by the test's own reader of the format (ggml's docs/gguf.md, v3).
struct GgufTensor {
  std::vector<uint64_t> dims;  // innermost first
  uint32_t type = 0;
  uint64_t offset = 0;
};
struct ExportedGguf {
  uint32_t version = 0;
  std::map<std::string, std::string> strings;
  std::map<std::string, uint64_t> ints;
  std::map<std::string, float> floats;
  std::map<std::string, std::vector<std::string>> string_arrays;
  std::map<std::string, std::vector<int32_t>> int_arrays;
  std::vector<std::string> tensor_order;
  std::map<std::string, GgufTensor> tensors;
  MappedFile file;  // the file, mapped: a test touches only the pages it reads
  std::string_view bytes;
  uint64_t data_start = 0;
};

class Reader {
 public:
  explicit Reader(std::string_view b) : b_(b) {}
  template <class T>
  T get() {
    T v{};
    if (at_ + sizeof(T) > b_.size()) throw std::runtime_error("truncated");
    std::memcpy(&v, b_.data() + at_, sizeof(T));
    at_ += sizeof(T);
    return v;
  }
  std::string str() {
    const uint64_t n = get<uint64_t>();
    if (at_ + n > b_.size()) throw std::runtime_error("truncated string");
    std::string s(b_.substr(at_, n));
    at_ += n;
    return s;
  }
  uint64_t at() const { return at_; }

 private:
  std::string_view b_;
  uint64_t at_ = 0;
};

ExportedGguf read_gguf(const std::string& path) {
  ExportedGguf f;
  absl::StatusOr<MappedFile> file = MappedFile::open(path);
  if (!file.ok()) {
    ADD_FAILURE() << file.status();
    return f;
  }
  f.file = *std::move(file);
  f.bytes =
      std::string_view(reinterpret_cast<const char*>(f.file.bytes().data()), f.file.bytes().size());
  Reader r(f.bytes);
  EXPECT_EQ(r.get<uint32_t>(), 0x46554747u);  // "GGUF"
  f.version = r.get<uint32_t>();
  const uint64_t n_tensors = r.get<uint64_t>(), n_kv = r.get<uint64_t>();
  for (uint64_t i = 0; i < n_kv; ++i) {
    const std::string key = r.str();
    const uint32_t type = r.get<uint32_t>();
    switch (type) {
      case 4:
        f.ints[key] = r.get<uint32_t>();
        break;
      case 6:
        f.floats[key] = r.get<float>();
        break;
      case 7:
        f.ints[key] = r.get<uint8_t>();
        break;
      case 8:
        f.strings[key] = r.str();
        break;
      case 9: {
        const uint32_t elem = r.get<uint32_t>();
        const uint64_t n = r.get<uint64_t>();
        for (uint64_t j = 0; j < n; ++j) {
          if (elem == 8) {
            f.string_arrays[key].push_back(r.str());
          } else if (elem == 5) {
            f.int_arrays[key].push_back(r.get<int32_t>());
          } else {
            ADD_FAILURE() << key << ": array of type " << elem;
            return f;
          }
        }
        break;
      }
      default:
        ADD_FAILURE() << key << ": value type " << type;
        return f;
    }
  }
  for (uint64_t i = 0; i < n_tensors; ++i) {
    const std::string name = r.str();
    GgufTensor t;
    const uint32_t n_dims = r.get<uint32_t>();
    for (uint32_t d = 0; d < n_dims; ++d) t.dims.push_back(r.get<uint64_t>());
    t.type = r.get<uint32_t>();
    t.offset = r.get<uint64_t>();
    f.tensor_order.push_back(name);
    f.tensors[name] = t;
  }
  const uint64_t align = f.ints.count("general.alignment") ? f.ints["general.alignment"] : 32;
  f.data_start = (r.at() + align - 1) / align * align;
  return f;
}

// Makes the checkpoint of `o` with a vocabulary of 512 and a tokenizer of its own: three tokens,
// one merge and a control token, padded to 512 (a test failure when making it fails). The tests
// whose properties are each tensor's type or a quantizer's bytes, which do not depend on the
// vocabulary, export such a model: Qwen3's 151936 x 128 embeddings and head, widened and
// quantized export after export, were most of the suite's time under the sanitizers.
void make_small_vocabulary_model(MakeModelOptions o) {
  o.tokenizer_dir.clear();
  o.overrides.vocab_size = 512;
  const absl::Status made = make_model(o);
  ASSERT_TRUE(made.ok()) << made;
  const std::filesystem::path dir = o.out_dir;
  std::ofstream(dir / "tokenizer.json") << R"({"model": {"type": "BPE",
      "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": ["a b"]},
      "added_tokens": [{"id": 511, "content": "<|end|>", "special": true}]})";
  std::ofstream(dir / "tokenizer_config.json") << "{}";
}

// The suite's checkpoints serve every test of the suite (making them is much of the suite's
// time): the tiny preset with 2 layers and an untied head, with Qwen3's tokenizer and vocabulary
// (`model`) and with a vocabulary of 512 (`small`); each test writes its files into a folder of
// its own beside them.
class GgufExportTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    suite_dir_ = std::filesystem::temp_directory_path() /
                 ("simpler_gguf_test_" + std::to_string(::getpid()));
    // What an earlier process of the same pid left (killed before TearDownTestSuite) goes first:
    // a test's folder and its link to the model must be new.
    std::filesystem::remove_all(suite_dir_);
    MakeModelOptions o = testing::tiny_model_options((suite_dir_ / "model").string(), 3);
    o.overrides.num_hidden_layers = 2;
    o.overrides.tie_word_embeddings = false;  // an output.weight too
    absl::Status made = make_model(o);
    ASSERT_TRUE(made.ok()) << made;
    o.out_dir = (suite_dir_ / "small").string();
    make_small_vocabulary_model(o);
  }
  // The suite's checkpoint with a vocabulary of 512.
  static std::string small_model() { return (suite_dir_ / "small").string(); }
  static void TearDownTestSuite() { std::filesystem::remove_all(suite_dir_); }
  void SetUp() override {
    ASSERT_TRUE(std::filesystem::exists(suite_dir_ / "model" / "config.json"));
    ASSERT_TRUE(std::filesystem::exists(suite_dir_ / "small" / "config.json"));
    dir_ = suite_dir_ / ::testing::UnitTest::GetInstance()->current_test_info()->name();
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
    std::filesystem::create_directory_symlink(suite_dir_ / "model", dir_ / "model");
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  // Options exporting `model_dir` (the suite's checkpoint when empty) as `type` into dir_/`file`.
  GgufExportOptions options_for(GgufType type, const std::string& file,
                                const std::string& model_dir = "") const {
    GgufExportOptions o;
    o.model_dir = model_dir.empty() ? (dir_ / "model").string() : model_dir;
    o.out_path = (dir_ / file).string();
    o.type = type;
    return o;
  }

  // The export's temporary files beside `out` ("OUT.tmp.<pid>.<n>") that are left.
  static std::vector<std::string> temporaries(const std::string& out) {
    std::vector<std::string> left;
    const std::filesystem::path p(out);
    const std::string prefix = p.filename().string() + ".tmp";
    for (const auto& entry : std::filesystem::directory_iterator(p.parent_path())) {
      if (entry.path().filename().string().starts_with(prefix)) left.push_back(entry.path());
    }
    return left;
  }

  // Exports by `o` and reads the file back; a test failure when the export fails.
  static ExportedGguf exported(const GgufExportOptions& o) {
    const absl::Status s = export_gguf(o);
    EXPECT_TRUE(s.ok()) << s;
    return s.ok() ? read_gguf(o.out_path) : ExportedGguf{};
  }

  static inline std::filesystem::path suite_dir_;
  std::filesystem::path dir_;
};

// The file carries Qwen3's metadata as llama.cpp reads it, the whole tokenizer padded to the
// model's vocabulary, and every tensor under llama.cpp's name with the checkpoint's bytes (bf16
// as they are, the norms widened to f32), dims innermost first, each 32-byte aligned.
TEST_F(GgufExportTest, WritesQwen3MetadataTokenizerAndTensorsAsLlamaCppNamesThem) {
  GgufExportOptions o;
  o.model_dir = (dir_ / "model").string();
  o.out_path = (dir_ / "model.gguf").string();
  int64_t last_progress = 0;
  o.progress = [&last_progress](int64_t done, int64_t) { last_progress = done; };
  ASSERT_TRUE(export_gguf(o).ok());
  EXPECT_THAT(temporaries(o.out_path), ::testing::IsEmpty());
  const ExportedGguf f = read_gguf(o.out_path);
  ASSERT_FALSE(HasFailure());
  absl::StatusOr<ModelConfig> c = ModelConfig::load(o.model_dir);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(f.version, 3u);
  EXPECT_EQ(f.strings.at("general.architecture"), "qwen3");
  EXPECT_EQ(f.ints.at("general.file_type"), 32u);  // mostly bf16
  EXPECT_EQ(f.ints.at("qwen3.block_count"), 2u);
  EXPECT_EQ(f.ints.at("qwen3.embedding_length"), static_cast<uint64_t>(c->hidden_size));
  EXPECT_EQ(f.ints.at("qwen3.feed_forward_length"), static_cast<uint64_t>(c->intermediate_size));
  EXPECT_EQ(f.ints.at("qwen3.attention.head_count"), static_cast<uint64_t>(c->num_attention_heads));
  EXPECT_EQ(f.ints.at("qwen3.attention.head_count_kv"),
            static_cast<uint64_t>(c->num_key_value_heads));
  EXPECT_EQ(f.ints.at("qwen3.attention.key_length"), static_cast<uint64_t>(c->head_dim));
  EXPECT_EQ(f.ints.at("qwen3.context_length"), static_cast<uint64_t>(c->max_position_embeddings));
  EXPECT_FLOAT_EQ(f.floats.at("qwen3.rope.freq_base"), static_cast<float>(c->rope_theta));
  EXPECT_FLOAT_EQ(f.floats.at("qwen3.attention.layer_norm_rms_epsilon"),
                  static_cast<float>(c->rms_norm_eps));
  EXPECT_EQ(f.strings.at("tokenizer.ggml.model"), "gpt2");
  EXPECT_EQ(f.strings.at("tokenizer.ggml.pre"), "qwen2");
  EXPECT_EQ(f.ints.at("tokenizer.ggml.add_bos_token"), 0u);
  // tokenizer_config.json's chat template, byte for byte.
  {
    std::ifstream in(o.model_dir + "/tokenizer_config.json");
    const nlohmann::json config = nlohmann::json::parse(in);
    EXPECT_EQ(f.strings.at("tokenizer.chat_template"),
              config.at("chat_template").get<std::string>());
  }
  // Tokens: the vocabulary by id, added tokens typed, padding named; merges as "a b".
  const std::vector<std::string>& tokens = f.string_arrays.at("tokenizer.ggml.tokens");
  const std::vector<int32_t>& types = f.int_arrays.at("tokenizer.ggml.token_type");
  ASSERT_EQ(tokens.size(), static_cast<size_t>(c->vocab_size));
  ASSERT_EQ(types.size(), tokens.size());
  EXPECT_EQ(tokens[9707], "Hello");
  EXPECT_EQ(types[9707], 1);
  EXPECT_EQ(tokens[151645], "<|im_end|>");
  EXPECT_EQ(types[151645], 3);  // control
  EXPECT_EQ(tokens[151935], "[PAD151935]");
  EXPECT_EQ(types[151935], 5);  // unused
  EXPECT_EQ(f.ints.at("tokenizer.ggml.eos_token_id"), 151645u);
  ASSERT_FALSE(f.string_arrays.at("tokenizer.ggml.merges").empty());
  EXPECT_EQ(f.string_arrays.at("tokenizer.ggml.merges")[0], "Ġ Ġ");
  // Tensors: names, dims, types, offsets and bytes.
  absl::StatusOr<ModelWeights> w = ModelWeights::open(o.model_dir);
  ASSERT_TRUE(w.ok());
  const std::vector<WeightSpec> specs = c->tensor_names_and_shapes();
  EXPECT_EQ(last_progress, static_cast<int64_t>(specs.size()));
  ASSERT_EQ(f.tensors.size(), specs.size());
  const std::map<std::string, std::string> some = {
      {"model.embed_tokens.weight", "token_embd.weight"},
      {"model.norm.weight", "output_norm.weight"},
      {"lm_head.weight", "output.weight"},
      {"model.layers.1.self_attn.k_norm.weight", "blk.1.attn_k_norm.weight"},
      {"model.layers.0.self_attn.o_proj.weight", "blk.0.attn_output.weight"},
      {"model.layers.1.mlp.down_proj.weight", "blk.1.ffn_down.weight"},
      {"model.layers.0.post_attention_layernorm.weight", "blk.0.ffn_norm.weight"}};
  for (const auto& [hf, gg] : some) {
    ASSERT_TRUE(f.tensors.count(gg)) << gg;
    const GgufTensor& t = f.tensors.at(gg);
    absl::StatusOr<TensorView> v = w->get(hf);
    ASSERT_TRUE(v.ok());
    std::vector<uint64_t> want_dims(v->shape.rbegin(), v->shape.rend());
    EXPECT_EQ(t.dims, want_dims) << gg;
    EXPECT_EQ(t.offset % 32, 0u) << gg;
    const char* data = f.bytes.data() + f.data_start + t.offset;
    if (v->shape.size() == 2) {
      EXPECT_EQ(t.type, 30u) << gg;  // bf16, the checkpoint's bits
      ASSERT_LE(f.data_start + t.offset + v->bytes.size(), f.bytes.size());
      EXPECT_EQ(std::memcmp(data, v->bytes.data(), v->bytes.size()), 0) << gg;
    } else {
      EXPECT_EQ(t.type, 0u) << gg;  // norms in f32
      absl::StatusOr<std::vector<float>> want = to_f32(*v);
      ASSERT_TRUE(want.ok());
      EXPECT_EQ(std::memcmp(data, want->data(), want->size() * 4), 0) << gg;
    }
  }
}

TEST_F(GgufExportTest, F32ExportWidensEveryTensor) {
  const ExportedGguf f = exported(options_for(GgufType::kF32, "model-f32.gguf", small_model()));
  ASSERT_FALSE(HasFailure());
  EXPECT_EQ(f.ints.at("general.file_type"), 0u);
  for (const auto& [name, t] : f.tensors) EXPECT_EQ(t.type, 0u) << name;
}

// Q8_0 (llama.cpp's Q8_0 defaults): every 2-D tensor, the LM head included, is Q8_0 with the
// bytes quantize_row_q8_0 makes of the checkpoint's values; the norms stay f32; the file type is
// llama.cpp's MOSTLY_Q8_0. Loaded back, the matrices are q8_0 views of the file's blocks. On
// Qwen3's vocabulary: the export encodes a 151936 x 128 matrix in chunks of whole rows, and
// every byte equals what quantizing the whole tensor in one piece makes.
TEST_F(GgufExportTest, Q8_0ExportQuantizesEveryMatrixAndKeepsTheNormsF32) {
  const GgufExportOptions o = options_for(GgufType::kQ8_0, "model-q8_0.gguf");
  const ExportedGguf f = exported(o);
  ASSERT_FALSE(HasFailure());
  EXPECT_EQ(f.ints.at("general.file_type"), 7u);
  absl::StatusOr<ModelWeights> w = ModelWeights::open(o.model_dir);
  absl::StatusOr<ModelWeights> back = ModelWeights::open(o.out_path);
  ASSERT_TRUE(w.ok() && back.ok()) << back.status();
  const ModelConfig c = ModelConfig::load(o.model_dir).value();
  int matrices = 0;
  ASSERT_EQ(f.tensors.at("output.weight").type, 8u);
  ASSERT_EQ(f.tensors.at("token_embd.weight").type, 8u);
  for (const auto& [gg, t] : f.tensors) {
    SCOPED_TRACE(gg);
    EXPECT_EQ(t.type, t.dims.size() == 2 ? 8u : 0u);
  }
  for (const WeightSpec& spec : c.tensor_names_and_shapes()) {
    SCOPED_TRACE(spec.name);
    const TensorView v = w->get(spec.name).value();
    const std::vector<float> values = to_f32(v).value();
    const TensorView q = back->get(spec.name).value();
    if (spec.shape.size() != 2) {
      EXPECT_EQ(q.dtype, task::DataType::kFloat32);
      continue;
    }
    ++matrices;
    EXPECT_EQ(q.dtype, task::DataType::kQ8_0);
    std::vector<uint8_t> want(values.size() / 32 * 34);
    ASSERT_TRUE(quantize_row_q8_0(values, want).ok());
    ASSERT_EQ(q.bytes.size(), want.size());
    EXPECT_EQ(std::memcmp(q.bytes.data(), want.data(), want.size()), 0);
  }
  EXPECT_EQ(matrices, 2 + 2 * 7);  // token_embd, output and 7 per layer
}

// quantize_row_q8_0 against ggml's definition worked by hand: amax 127 gives d = 1 (f16 0x3c00)
// and id = 1, so q = roundf(x): halves round away from zero (2.5 -> 3, -0.5 -> -1), which
// nearest-even would not; a block of zeros has d = 0 and q = 0; a block with amax 0.5 has
// d = 0.5/127 (f16-rounded in the file, not in id), q = roundf(x · 254).
TEST(QuantizeRowQ8_0, FollowsGgmlsReferenceQuantizerWorkedByHand) {
  std::vector<float> x(96, 0.0f);
  const float first[] = {127.0f, 2.5f, -2.5f, 0.5f, -0.5f, 1.49f, -126.6f, 3.0f};
  std::copy(std::begin(first), std::end(first), x.begin());
  x[32] = 0.5f;
  x[33] = -0.2f;
  x[34] = 0.001f;
  std::vector<uint8_t> q(3 * 34);
  ASSERT_TRUE(quantize_row_q8_0(x, q).ok());
  auto d_bits = [&](int b) { return static_cast<uint16_t>(q[b * 34] | q[b * 34 + 1] << 8); };
  auto qv = [&](int b, int i) { return static_cast<int>(static_cast<int8_t>(q[b * 34 + 2 + i])); };
  EXPECT_EQ(d_bits(0), 0x3c00);  // 1.0
  const int want0[] = {127, 3, -3, 1, -1, 1, -127, 3};
  for (int i = 0; i < 8; ++i) EXPECT_EQ(qv(0, i), want0[i]) << i;
  for (int i = 8; i < 32; ++i) EXPECT_EQ(qv(0, i), 0) << i;
  EXPECT_EQ(d_bits(1), task::f32_to_f16(0.5f / 127.0f));
  EXPECT_EQ(qv(1, 0), 127);
  EXPECT_EQ(qv(1, 1), -51);  // -0.2 · 254 = -50.8 -> -51
  EXPECT_EQ(qv(1, 2), 0);    // 0.254 -> 0
  EXPECT_EQ(d_bits(2), 0);
  for (int i = 0; i < 32; ++i) EXPECT_EQ(qv(2, i), 0) << i;
  // Bad input names what is wrong.
  std::vector<uint8_t> small(33);
  absl::Status s = quantize_row_q8_0(std::span<const float>(x.data(), 31), small);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "quantize_row_q8_0: 31 values are not whole blocks of 32");
  s = quantize_row_q8_0(x, small);
  EXPECT_EQ(s.message(), "quantize_row_q8_0: the output holds 33 bytes, 3 blocks need 102");
  x[40] = std::numeric_limits<float>::quiet_NaN();
  s = quantize_row_q8_0(x, q);
  EXPECT_EQ(s.message(), "quantize_row_q8_0: value 40 is nan, not finite");
}

// Q4_0 (llama-quantize's Q4_0 file type): the projections and token_embd Q4_0 with
// quantize_row_q4_0's bytes, output Q8_0 (its rows of 128 are not whole super-blocks, so not the
// Q6_K llama.cpp writes for a head of rows of 256s), norms f32.
TEST_F(GgufExportTest, Q4_0ExportQuantizesTheMatricesAndTheHeadAsQ8_0ForRowsOf128) {
  const GgufExportOptions o = options_for(GgufType::kQ4_0, "model-q4_0.gguf", small_model());
  const ExportedGguf f = exported(o);
  ASSERT_FALSE(HasFailure());
  EXPECT_EQ(f.ints.at("general.file_type"), 2u);
  for (const auto& [gg, t] : f.tensors) {
    SCOPED_TRACE(gg);
    EXPECT_EQ(t.type, t.dims.size() != 2 ? 0u : gg == "output.weight" ? 8u : 2u);
  }
  absl::StatusOr<ModelWeights> w = ModelWeights::open(o.model_dir);
  absl::StatusOr<ModelWeights> back = ModelWeights::open(o.out_path);
  ASSERT_TRUE(w.ok() && back.ok()) << back.status();
  const std::string name = "model.layers.1.mlp.down_proj.weight";
  const std::vector<float> values = to_f32(w->get(name).value()).value();
  const TensorView q = back->get(name).value();
  EXPECT_EQ(q.dtype, task::DataType::kQ4_0);
  std::vector<uint8_t> want(values.size() / 32 * 18);
  ASSERT_TRUE(quantize_row_q4_0(values, want).ok());
  ASSERT_EQ(q.bytes.size(), want.size());
  EXPECT_EQ(std::memcmp(q.bytes.data(), want.data(), want.size()), 0);
}

// Q4_K_M (llama-quantize's mix) on a model whose rows are whole super-blocks (hidden 256,
// intermediate 512, 8 layers, tied head, a vocabulary of 512): attn_v and ffn_down Q6_K in the
// layers of use_more_bits (0, 3, 6 and 7 of 8), Q4_K in the others; token_embd (the head) Q6_K
// and every other matrix Q4_K, norms f32; general.file_type 15; each tensor's bytes are our
// quantizer's of the checkpoint's values, every byte. On the suite's tiny model (rows of 128 and
// 384, untied) every matrix falls back to Q8_0 but attn_output (rows of 256): Q4_K. A Q4_0 file
// of the wide model has a Q6_K head.
// `q` holds the bytes `quantize` makes of `source`'s values, all of them.
template <typename Quantize>
void expect_quantized_as(const TensorView& source, std::span<const std::byte> q,
                         task::DataType dtype, Quantize quantize) {
  const auto numel = static_cast<size_t>(source.numel());
  ASSERT_EQ(q.size(), task::bytes_of(dtype, numel));
  const absl::StatusOr<std::vector<float>> values = to_f32(source);
  ASSERT_TRUE(values.ok()) << values.status();
  std::vector<uint8_t> want(q.size());
  ASSERT_TRUE(quantize(*values, want).ok());
  EXPECT_EQ(std::memcmp(q.data(), want.data(), want.size()), 0);
}

TEST_F(GgufExportTest, Q4_K_MExportWritesLlamaQuantizesMix) {
  const MakeModelOptions mo = testing::k_quant_model_options((dir_ / "wide").string(), 5, 8);
  make_small_vocabulary_model(mo);
  ASSERT_FALSE(HasFailure());
  for (const bool wide : {true, false}) {
    SCOPED_TRACE(wide ? "hidden 256" : "tiny");
    const GgufExportOptions o =
        wide ? options_for(GgufType::kQ4_K_M, "wide-q4_k_m.gguf", mo.out_dir)
             : options_for(GgufType::kQ4_K_M, "tiny-q4_k_m.gguf", small_model());
    const ExportedGguf f = exported(o);
    ASSERT_FALSE(HasFailure());
    EXPECT_EQ(f.ints.at("general.file_type"), 15u);
    constexpr uint32_t kQ8_0 = 8, kQ4_K = 12, kQ6_K = 14;
    for (const auto& [gg, t] : f.tensors) {
      SCOPED_TRACE(gg);
      uint32_t want = kQ4_K;
      for (const char* layer : {"blk.0.", "blk.3.", "blk.6.", "blk.7."}) {
        if (gg.starts_with(layer) &&
            (gg.ends_with("attn_v.weight") || gg.ends_with("ffn_down.weight"))) {
          want = kQ6_K;
        }
      }
      if (gg == "token_embd.weight" && wide) want = kQ6_K;
      if (!wide && gg.find("attn_output") == std::string::npos) want = kQ8_0;
      EXPECT_EQ(t.type, t.dims.size() != 2 ? 0u : want);
    }
    absl::StatusOr<ModelWeights> w = ModelWeights::open(o.model_dir);
    absl::StatusOr<ModelWeights> back = ModelWeights::open(o.out_path);
    ASSERT_TRUE(w.ok() && back.ok()) << back.status();
    for (const WeightSpec& spec : ModelConfig::load(o.model_dir)->tensor_names_and_shapes()) {
      if (spec.shape.size() != 2) continue;
      SCOPED_TRACE(spec.name);
      const TensorView source = w->get(spec.name).value();
      const TensorView q = back->get(spec.name).value();
      switch (q.dtype) {
        case task::DataType::kQ4_K:
          expect_quantized_as(source, q.bytes, q.dtype, quantize_row_q4_k);
          break;
        case task::DataType::kQ6_K:
          expect_quantized_as(source, q.bytes, q.dtype, quantize_row_q6_k);
          break;
        default:
          ASSERT_EQ(q.dtype, task::DataType::kQ8_0);
          expect_quantized_as(source, q.bytes, q.dtype, quantize_row_q8_0);
      }
    }
  }
  // A Q4_0 file of the same model: its head, rows of 256, is Q6_K as llama.cpp writes it.
  const GgufExportOptions o = options_for(GgufType::kQ4_0, "wide-q4_0.gguf", mo.out_dir);
  const ExportedGguf f = exported(o);
  ASSERT_FALSE(HasFailure());
  EXPECT_EQ(f.tensors.at("token_embd.weight").type, 14u);
  EXPECT_EQ(f.tensors.at("blk.0.attn_v.weight").type, 2u);
  const absl::StatusOr<ModelWeights> wide = ModelWeights::open(mo.out_dir);  // owns the mapping
  ASSERT_TRUE(wide.ok()) << wide.status();
  const TensorView embd = wide->get("model.embed_tokens.weight").value();
  const absl::StatusOr<ModelWeights> q4 = ModelWeights::open(o.out_path);  // owns the mapping
  ASSERT_TRUE(q4.ok()) << q4.status();
  const TensorView head = q4->get("model.embed_tokens.weight").value();
  ASSERT_EQ(head.dtype, task::DataType::kQ6_K);
  expect_quantized_as(embd, head.bytes, head.dtype, quantize_row_q6_k);
}

// quantize_row_q4_k and quantize_row_q6_k refuse what is not whole super-blocks, an output of the
// wrong size, and values that are not finite, naming each; a block of zeros is all zero bytes
// (Q6_K: d = +0) or zero levels against a zero scale (Q4_K). Their bytes against llama.cpp's:
// tests/llamacpp/llamacpp_quantize_test.cc.
TEST(QuantizeRowQ4_KAndQ6_K, RefuseBadInputNamingItAndQuantizeZerosToZero) {
  std::vector<float> x(512, 0.0f);
  std::vector<uint8_t> q4(2 * 144, 0xff), q6(2 * 210, 0xff);
  ASSERT_TRUE(quantize_row_q4_k(x, q4).ok());
  ASSERT_TRUE(quantize_row_q6_k(x, q6).ok());
  for (uint8_t b : q6) ASSERT_EQ(b, 0);
  for (uint8_t b : q4) ASSERT_EQ(b, 0);
  absl::Status s = quantize_row_q4_k(std::span<const float>(x.data(), 300), q4);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "quantize_row_q4_k: 300 values are not whole super-blocks of 256");
  std::vector<uint8_t> small(10);
  EXPECT_EQ(quantize_row_q6_k(x, small).message(),
            "quantize_row_q6_k: the output holds 10 bytes, 2 super-blocks need 420");
  EXPECT_EQ(quantize_row_q4_k(x, small).message(),
            "quantize_row_q4_k: the output holds 10 bytes, 2 super-blocks need 288");
  x[300] = std::numeric_limits<float>::infinity();
  EXPECT_EQ(quantize_row_q6_k(x, q6).message(), "quantize_row_q6_k: value 300 is inf, not finite");
  EXPECT_EQ(quantize_row_q4_k(x, q4).message(), "quantize_row_q4_k: value 300 is inf, not finite");
}

// quantize_row_q4_0 against ggml's definition worked by hand: the value of largest magnitude is
// -16 (its sign kept), so d = -16 / -8 = 2 (f16 0x4000) and id = 0.5; each nibble is
// min(15, trunc(x · 0.5 + 8.5)): -16 -> 0, 14 -> 15 (15.5), 3 -> 10 (10), 1 -> 9 (9), -1 -> 8
// (8.0), -3 -> 7 (7.0), 0 -> 8; x[j] in the low nibble, x[j + 16] in the high one. A block of
// zeros has d = 0 / -8 = -0 (f16 0x8000, as ggml writes it) and every nibble 8.
TEST(QuantizeRowQ4_0, FollowsGgmlsReferenceQuantizerWorkedByHand) {
  std::vector<float> x(64, 0.0f);
  const float first[] = {-16.0f, 14.0f, 3.0f, 1.0f, -1.0f, -3.0f};
  std::copy(std::begin(first), std::end(first), x.begin());
  x[16] = 14.0f;
  x[17] = -16.0f;
  std::vector<uint8_t> q(2 * 18);
  ASSERT_TRUE(quantize_row_q4_0(x, q).ok());
  EXPECT_EQ(q[0] | q[1] << 8, 0x4000);  // 2.0
  auto nib = [&](int b, int i) {
    return i < 16 ? q[b * 18 + 2 + i] & 15 : q[b * 18 + 2 + i - 16] >> 4;
  };
  const int want[] = {0, 15, 10, 9, 8, 7, 8};
  for (int i = 0; i < 7; ++i) EXPECT_EQ(nib(0, i), want[i]) << i;
  EXPECT_EQ(nib(0, 16), 15);
  EXPECT_EQ(nib(0, 17), 0);
  EXPECT_EQ(q[18] | q[19] << 8, 0x8000);  // -0: 0 / -8
  for (int i = 0; i < 32; ++i) EXPECT_EQ(nib(1, i), 8) << i;
  std::vector<uint8_t> small(3);
  EXPECT_EQ(quantize_row_q4_0(x, small).message(),
            "quantize_row_q4_0: the output holds 3 bytes, 2 blocks need 36");
}

// On the suite's checkpoint with a vocabulary of 512 (the errors do not depend on the vocabulary),
// in a folder of its own whose files link to it, so that its tokenizer can be taken away.
TEST_F(GgufExportTest, AMissingTokenizerOrAnUnwritablePathIsAClearErrorAndLeavesNoFile) {
  std::filesystem::remove(dir_ / "model");
  std::filesystem::create_directory(dir_ / "model");
  for (const auto& entry : std::filesystem::directory_iterator(small_model())) {
    std::filesystem::create_symlink(entry.path(), dir_ / "model" / entry.path().filename());
  }
  GgufExportOptions o;
  o.model_dir = (dir_ / "model").string();
  o.out_path = (dir_ / "no-such-dir" / "model.gguf").string();
  absl::Status s = export_gguf(o);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  EXPECT_THAT(s.message(), HasSubstr("cannot write " + o.out_path + ": there is no directory "))
      << s;
  // A temporary file that cannot be created (its name, the output's plus ".tmp.<pid>.<n>", past
  // the 255 bytes a file name may have, which stops root too): the OS error names the path and
  // its temporary file, and nothing is left.
  o.out_path = (dir_ / (std::string(245, 'x') + ".gguf")).string();
  s = export_gguf(o);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_THAT(s.message(), HasSubstr("cannot write " + o.out_path +
                                     " (creating its temporary file " + o.out_path + ".tmp."))
      << s;
  EXPECT_THAT(s.message(), HasSubstr(": File name too long)")) << s;
  EXPECT_FALSE(std::filesystem::exists(o.out_path));
  EXPECT_THAT(temporaries(o.out_path), ::testing::IsEmpty());
  // The checkpoint less its tokenizer.
  std::filesystem::remove(dir_ / "model" / "tokenizer.json");
  o.out_path = (dir_ / "model.gguf").string();
  s = export_gguf(o);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  EXPECT_THAT(s.message(), HasSubstr("tokenizer.json")) << s;
  EXPECT_FALSE(std::filesystem::exists(o.out_path));
  // A tokenizer.json that is not the JSON object it should be: refused naming the file and the
  // fault, nested text bounded in depth, and no file left.
  const std::pair<std::string, std::string> bad_tokenizers[] = {
      {R"({"model": {"type": "BPE", "vocab": {)", "malformed JSON"},
      {std::string(100000, '[') + std::string(100000, ']'), "JSON nested deeper than 64 levels"},
      {R"({"model": {"type": "BPE", "vocab": {"a": 0, "a": 1}}})", "duplicate key 'a'"},
      {"[1, 2]", "not a JSON object"}};
  for (const auto& [text, want] : bad_tokenizers) {
    std::ofstream(dir_ / "model" / "tokenizer.json", std::ios::binary | std::ios::trunc) << text;
    s = export_gguf(o);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(s.message(), HasSubstr("tokenizer.json")) << s;
    EXPECT_THAT(s.message(), HasSubstr(want)) << s;
    EXPECT_FALSE(std::filesystem::exists(o.out_path));
  }
}

// The output path is checked before anything is read: no file the model directory holds or links
// to is ever replaced (its checkpoint would be lost), nor any name there but *.gguf (an absent
// generation_config.json or shard would be read as one), nor a directory; a GGUF file there is.
// The model directory here is a folder of links (to the suite's files, config.json to a copy: a
// Hugging Face snapshot's link to its blob), so a wrong rename would replace a link or the copy,
// not the suite's checkpoint.
TEST_F(GgufExportTest, TheOutputPathIsRefusedWhereTheExportWouldReplaceTheModelsOwnFiles) {
  std::filesystem::remove(dir_ / "model");
  std::filesystem::create_directory(dir_ / "model");
  std::filesystem::create_directory(dir_ / "blobs");
  for (const auto& entry : std::filesystem::directory_iterator(suite_dir_ / "model")) {
    std::filesystem::path target = entry.path();
    if (entry.path().filename() == "config.json") {
      target = dir_ / "blobs" / "0123abcd";
      std::filesystem::copy_file(entry.path(), target);
    }
    std::filesystem::create_symlink(target, dir_ / "model" / entry.path().filename());
  }
  const std::filesystem::path weights = dir_ / "model" / "model.safetensors";
  const auto size = std::filesystem::file_size(weights);
  const auto written = std::filesystem::last_write_time(weights);
  for (const char* file : {"model.safetensors", "config.json", "tokenizer.json",
                           "generation_config.json", "model-00002-of-00002.safetensors"}) {
    if (std::string(file) == "generation_config.json") {
      std::filesystem::remove(dir_ / "model" / file);  // optional, read when present
    }
    GgufExportOptions o = options_for(GgufType::kQ8_0, std::string("model/") + file);
    const absl::Status s = export_gguf(o);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(s.message(), HasSubstr(o.out_path + " lies in the model directory " + o.model_dir +
                                       " and is not named *.gguf"))
        << s;
    EXPECT_THAT(temporaries(o.out_path), ::testing::IsEmpty());
  }
  EXPECT_FALSE(std::filesystem::exists(dir_ / "model" / "generation_config.json"));
  EXPECT_TRUE(std::filesystem::is_symlink(weights));
  EXPECT_EQ(std::filesystem::file_size(weights), size);
  EXPECT_EQ(std::filesystem::last_write_time(weights), written);
  const std::string blob = (dir_ / "blobs" / "0123abcd").string();
  const auto blob_size = std::filesystem::file_size(blob);
  absl::Status s = export_gguf(options_for(GgufType::kQ8_0, "blobs/0123abcd"));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(),
              HasSubstr(blob + " is the model directory's config.json (or the file it links to)"))
      << s;
  EXPECT_EQ(std::filesystem::file_size(blob), blob_size);
  std::filesystem::create_directory(dir_ / "out.gguf");
  s = export_gguf(options_for(GgufType::kQ8_0, "out.gguf"));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("out.gguf is a directory, not a file to write")) << s;
  s = export_gguf(options_for(GgufType::kQ8_0, ""));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  // A GGUF file beside the checkpoint (an earlier export) is replaced, whatever its name.
  for (const char* name : {"model/q8.gguf", "model/q8.bin"}) {
    ASSERT_TRUE(export_gguf(options_for(GgufType::kQ8_0, "model/q8.gguf")).ok());
    if (std::string(name) != "model/q8.gguf") {
      std::filesystem::rename(dir_ / "model/q8.gguf", dir_ / name);
    }
    s = export_gguf(options_for(GgufType::kBf16, name));
    EXPECT_TRUE(s.ok()) << name << ": " << s;
    EXPECT_EQ(read_gguf((dir_ / name).string()).strings.at("general.architecture"), "qwen3");
  }
}

// Cancelled (GgufExportOptions::cancel, set here after the first tensor as the CLI's signal
// handler sets it): CANCELLED saying how far it got, no temporary file, and a file that was at
// the output path is as it was.
TEST_F(GgufExportTest, ACancelledExportStopsAtTheNextTensorAndLeavesNoFile) {
  GgufExportOptions o = options_for(GgufType::kQ8_0, "model.gguf");
  std::ofstream(o.out_path) << "an older file";
  std::atomic<bool> cancel{false};
  int64_t written = 0;
  o.cancel = &cancel;
  o.progress = [&](int64_t done, int64_t) {
    written = done;
    cancel.store(true);
  };
  const absl::Status s = export_gguf(o);
  EXPECT_EQ(s.code(), absl::StatusCode::kCancelled) << s;
  EXPECT_THAT(s.message(), HasSubstr("cancelled after 1 of ")) << s;
  EXPECT_THAT(s.message(), HasSubstr("nothing was written at " + o.out_path)) << s;
  EXPECT_EQ(written, 1);
  EXPECT_THAT(temporaries(o.out_path), ::testing::IsEmpty());
  std::ifstream in(o.out_path);
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(in), {}), "an older file");
}

// A value that is not finite past the export's first chunk of rows (the embedding, 151936 x 128,
// is encoded about 1 Mi values at a time) is named by its index in the whole tensor, and no file
// is left: the chunked encoding keeps the message the one-piece encoding gave.
TEST_F(GgufExportTest, ANonFiniteValueInALaterChunkIsNamedByItsIndexInTheTensor) {
  std::filesystem::remove(dir_ / "model");
  std::filesystem::create_directory(dir_ / "model");
  for (const auto& entry : std::filesystem::directory_iterator(suite_dir_ / "model")) {
    if (entry.path().filename() == "model.safetensors") {
      std::filesystem::copy_file(entry.path(), dir_ / "model" / "model.safetensors");
    } else {
      std::filesystem::create_symlink(entry.path(), dir_ / "model" / entry.path().filename());
    }
  }
  // safetensors: an 8-byte little-endian header length, the JSON header, then the data.
  const std::string st = (dir_ / "model" / "model.safetensors").string();
  std::fstream f(st, std::ios::in | std::ios::out | std::ios::binary);
  uint64_t header_len = 0;
  f.read(reinterpret_cast<char*>(&header_len), sizeof(header_len));
  std::string header(header_len, '\0');
  f.read(header.data(), static_cast<std::streamsize>(header_len));
  const nlohmann::json index = nlohmann::json::parse(header);
  const nlohmann::json& t = index.at("model.embed_tokens.weight");
  ASSERT_EQ(t.at("dtype"), "BF16");
  constexpr uint64_t kIndex = 1500000;  // in the second chunk of 8192 rows of 128
  f.seekp(static_cast<std::streamoff>(8 + header_len + t.at("data_offsets")[0].get<uint64_t>() +
                                      2 * kIndex));
  const uint16_t bf16_nan = 0x7fc0;
  f.write(reinterpret_cast<const char*>(&bf16_nan), sizeof(bf16_nan));
  f.close();
  const GgufExportOptions o = options_for(GgufType::kQ8_0, "model-q8_0.gguf");
  const absl::Status s = export_gguf(o);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("value 1500000 is nan, not finite")) << s;
  EXPECT_FALSE(std::filesystem::exists(o.out_path));
}

}  // namespace
}  // namespace simpler::llm
