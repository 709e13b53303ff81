// A Qwen3 checkpoint as a GGUF file: the config and the weights ModelConfig::load and
// ModelWeights::open read from it, against the model directory it was exported from and
// against small files built key by key.
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <set>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/gguf_test_util.h"
#include "model/model_test_util.h"
#include "simpler/model/gguf.h"
#include "simpler/model/gguf_export.h"
#include "simpler/model/make_model.h"
#include "simpler/model/model_config.h"
#include "simpler/model/safetensors.h"
#include "simpler/tokenizer/tokenizer.h"

namespace simpler::llm {
namespace gguf_model_test {
namespace {

namespace fs = std::filesystem;
using testing::GgufBuilder;
using ::testing::HasSubstr;
using testing::msg;

constexpr uint32_t kF32 = 0, kQ4_0 = 2, kQ8_0 = 8, kQ4_K = 12, kQ6_K = 14;

fs::path scratch(const std::string& name) {
  fs::path dir = fs::temp_directory_path() / (name + "_" + std::to_string(::getpid()));
  fs::remove_all(dir);  // what an earlier process of the same pid left, killed before its teardown
  fs::create_directories(dir);
  return dir;
}

// The tiny preset (bf16, Qwen3's tokenizer) and its GGUF export, made once for the suite.
class GgufModelTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    root_ = new fs::path(scratch("gguf_model_test"));
    absl::StatusOr<std::string> tok = default_tokenizer_dir();
    ASSERT_TRUE(tok.ok()) << tok.status();
    MakeModelOptions o;
    o.preset = "tiny";
    o.seed = 5;
    o.out_dir = (*root_ / "tiny").string();
    o.tokenizer_dir = *tok;
    ASSERT_TRUE(make_model(o).ok());
    GgufExportOptions e;
    e.model_dir = o.out_dir;
    e.out_path = (*root_ / "tiny.gguf").string();
    absl::Status exported = export_gguf(e);
    ASSERT_TRUE(exported.ok()) << exported;
  }
  static void TearDownTestSuite() {
    fs::remove_all(*root_);
    delete root_;
  }
  static std::string dir() { return (*root_ / "tiny").string(); }
  static std::string gguf() { return (*root_ / "tiny.gguf").string(); }

  static fs::path* root_;
};
fs::path* GgufModelTest::root_ = nullptr;

TEST_F(GgufModelTest, TheExportedFileLoadsWithTheDirectorysConfig) {
  absl::StatusOr<ModelConfig> from_dir = ModelConfig::load(dir());
  absl::StatusOr<ModelConfig> from_gguf = ModelConfig::load(gguf());
  ASSERT_TRUE(from_dir.ok()) << from_dir.status();
  ASSERT_TRUE(from_gguf.ok()) << from_gguf.status();
  EXPECT_EQ(testing::shape_of(*from_gguf), testing::shape_of(*from_dir));
  // GGUF stores both as f32, the precision the kernels compute in.
  EXPECT_EQ(static_cast<float>(from_gguf->rms_norm_eps),
            static_cast<float>(from_dir->rms_norm_eps));
  EXPECT_EQ(static_cast<float>(from_gguf->rope_theta), static_cast<float>(from_dir->rope_theta));
  EXPECT_EQ(from_gguf->tie_word_embeddings, from_dir->tie_word_embeddings);
  EXPECT_EQ(from_gguf->eos_token_ids, from_dir->eos_token_ids);
  EXPECT_EQ(from_gguf->bos_token_id, from_dir->bos_token_id);
  const std::vector<int64_t> a = from_gguf->stop_ids(), b = from_dir->stop_ids();
  EXPECT_EQ(std::set<int64_t>(a.begin(), a.end()), std::set<int64_t>(b.begin(), b.end()));
  EXPECT_EQ(from_gguf->tensor_names_and_shapes().size(),
            from_dir->tensor_names_and_shapes().size());
}

TEST_F(GgufModelTest, AnOpenedFileGivesTheConfigAndTheWeightsWithoutASecondParse) {
  absl::StatusOr<GgufFile> file = GgufFile::open(gguf());
  ASSERT_TRUE(file.ok()) << file.status();
  absl::StatusOr<ModelConfig> config = ModelConfig::from_gguf(*file);
  ASSERT_TRUE(config.ok()) << config.status();
  const size_t tensors = file->tensors().size();
  absl::StatusOr<ModelWeights> weights = ModelWeights::from_gguf(std::move(*file));
  ASSERT_TRUE(weights.ok()) << weights.status();
  EXPECT_EQ(weights->dir(), gguf());
  ASSERT_NE(weights->gguf(), nullptr);
  EXPECT_EQ(weights->gguf()->tensors().size(), tensors);
  EXPECT_EQ(weights->names(), ModelWeights::open(gguf()).value().names());
  EXPECT_EQ(ModelWeights::open(dir()).value().gguf(), nullptr);
}

TEST_F(GgufModelTest, TheExportedWeightsAreBitwiseTheDirectorysUnderTheirModelNames) {
  absl::StatusOr<ModelWeights> d = ModelWeights::open(dir());
  absl::StatusOr<ModelWeights> g = ModelWeights::open(gguf());
  ASSERT_TRUE(d.ok()) << d.status();
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_TRUE(g->is_gguf());
  EXPECT_FALSE(d->is_gguf());
  EXPECT_EQ(g->names(), d->names());
  const ModelConfig config = ModelConfig::load(dir()).value();
  for (const WeightSpec& spec : config.tensor_names_and_shapes()) {
    SCOPED_TRACE(spec.name);
    absl::StatusOr<TensorView> dv = d->get(spec.name, spec.shape);
    absl::StatusOr<TensorView> gv = g->get(spec.name, spec.shape);
    ASSERT_TRUE(dv.ok()) << dv.status();
    ASSERT_TRUE(gv.ok()) << gv.status();
    if (spec.shape.size() == 2) {  // matrices keep their bf16 bytes; norm vectors widen to f32
      EXPECT_EQ(gv->dtype, dv->dtype);
      ASSERT_EQ(gv->bytes.size(), dv->bytes.size());
      EXPECT_EQ(std::memcmp(gv->bytes.data(), dv->bytes.data(), dv->bytes.size()), 0);
      // What a loader reads from the file (pread, not the mapping) is the same bytes.
      std::vector<std::byte> read(gv->bytes.size());
      ASSERT_TRUE(read_bytes(*gv, 0, read).ok());
      EXPECT_EQ(std::memcmp(read.data(), dv->bytes.data(), read.size()), 0);
    }
    const std::vector<float> df = to_f32(*dv).value(), gf = to_f32(*gv).value();
    ASSERT_EQ(gf.size(), df.size());
    EXPECT_EQ(std::memcmp(gf.data(), df.data(), df.size() * 4), 0);
  }
  std::set<std::string, std::less<>> expected;
  for (const WeightSpec& spec : config.tensor_names_and_shapes()) expected.insert(spec.name);
  EXPECT_TRUE(g->check_tensor_set(expected, "the tiny preset", false).ok());
  expected.erase("model.norm.weight");
  absl::Status extra = g->check_tensor_set(expected, "the tiny preset", false);
  EXPECT_EQ(extra.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(msg(extra), HasSubstr("tensor 'model.norm.weight' in " + gguf() +
                                    " (GGUF tensor 'output_norm.weight') is not used by the "
                                    "tiny preset"));
  absl::Status missing = g->get("model.layers.9.mlp.up_proj.weight").status();
  EXPECT_EQ(missing.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(msg(missing), HasSubstr("(GGUF name 'blk.9.ffn_up.weight')"));
}

// A one-layer Qwen3 GGUF of f32 tensors: hidden 4, 2 heads of dim 2, 1 KV head, vocab 6.
GgufBuilder small_qwen3(bool untied, uint32_t embd_type = kF32) {
  GgufBuilder b;
  b.string("general.architecture", "qwen3");
  b.u32("qwen3.block_count", 1);
  b.u32("qwen3.context_length", 64);
  b.u32("qwen3.embedding_length", 4);
  b.u32("qwen3.feed_forward_length", 8);
  b.u32("qwen3.attention.head_count", 2);
  b.u32("qwen3.attention.head_count_kv", 1);
  b.u32("qwen3.attention.key_length", 2);
  b.f32("qwen3.attention.layer_norm_rms_epsilon", 1e-5f);
  b.f32("qwen3.rope.freq_base", 5e5f);
  b.u32("tokenizer.ggml.eos_token_id", 5);
  auto f32 = [&](const char* name, std::vector<uint64_t> shape) {
    uint64_t n = 1;
    for (uint64_t d : shape) n *= d;
    b.tensor(name, shape, kF32, std::string(n * 4, '\0'));
  };
  if (embd_type == kQ8_0) {
    b.tensor("token_embd.weight", {6, 32}, kQ8_0, std::string(6 * 34, '\0'));
  } else {
    f32("token_embd.weight", {6, 4});
  }
  f32("blk.0.attn_norm.weight", {4});
  f32("blk.0.attn_q.weight", {4, 4});
  f32("blk.0.attn_k.weight", {2, 4});
  f32("blk.0.attn_v.weight", {2, 4});
  f32("blk.0.attn_output.weight", {4, 4});
  f32("blk.0.attn_q_norm.weight", {2});
  f32("blk.0.attn_k_norm.weight", {2});
  f32("blk.0.ffn_norm.weight", {4});
  f32("blk.0.ffn_gate.weight", {8, 4});
  f32("blk.0.ffn_up.weight", {8, 4});
  f32("blk.0.ffn_down.weight", {4, 8});
  f32("output_norm.weight", {4});
  if (untied) f32("output.weight", {6, 4});
  return b;
}

class GgufQwen3KeysTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = scratch(std::string("gguf_keys_test_") +
                   ::testing::UnitTest::GetInstance()->current_test_info()->name());
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string write(GgufBuilder b, const std::string& name = "m.gguf") {
    const std::string path = (dir_ / name).string();
    testing::write_file(path, b.build());
    return path;
  }
  fs::path dir_;
};

TEST_F(GgufQwen3KeysTest, TheQwen3KeysGiveTheConfigAndOutputWeightUntiesTheHead) {
  const std::string tied = write(small_qwen3(false), "tied.gguf");
  absl::StatusOr<ModelConfig> c = ModelConfig::load(tied);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(testing::shape_of(*c), (nlohmann::json{{"hidden_size", 4},
                                                   {"intermediate_size", 8},
                                                   {"num_hidden_layers", 1},
                                                   {"num_attention_heads", 2},
                                                   {"num_key_value_heads", 1},
                                                   {"head_dim", 2},
                                                   {"vocab_size", 6},
                                                   {"max_position_embeddings", 64}}));
  EXPECT_EQ(static_cast<float>(c->rms_norm_eps), 1e-5f);
  EXPECT_EQ(c->rope_theta, 5e5);
  EXPECT_TRUE(c->tie_word_embeddings);
  EXPECT_EQ(c->eos_token_ids, (std::vector<int64_t>{5}));
  absl::StatusOr<ModelWeights> w = ModelWeights::open(tied);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_FALSE(w->contains("lm_head.weight"));
  EXPECT_EQ(w->get("model.layers.0.mlp.down_proj.weight")->shape, (std::vector<int64_t>{4, 8}));
  const std::string untied = write(small_qwen3(true), "untied.gguf");
  EXPECT_FALSE(ModelConfig::load(untied)->tie_word_embeddings);
  EXPECT_TRUE(ModelWeights::open(untied)->contains("lm_head.weight"));
}

TEST_F(GgufQwen3KeysTest, AnotherArchitectureOrAMissingKeyIsRefusedNamingIt) {
  GgufBuilder llama;
  llama.string("general.architecture", "llama");
  absl::Status s = ModelConfig::load(write(llama)).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(msg(s), HasSubstr("general.architecture is 'llama'; only 'qwen3' is supported"));
  GgufBuilder bare;
  bare.string("general.architecture", "qwen3");
  s = ModelConfig::load(write(bare)).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(msg(s), HasSubstr("key 'qwen3.block_count' not found (a Qwen3 GGUF file needs it)"));
  GgufBuilder none;
  EXPECT_THAT(msg(ModelConfig::load(write(none)).status()), HasSubstr("general.architecture: "));
  GgufBuilder partial = small_qwen3(false);
  partial.u32("qwen3.rope.dimension_count", 1);
  EXPECT_THAT(msg(ModelConfig::load(write(partial)).status()),
              HasSubstr("key 'qwen3.rope.dimension_count' is 1, but the head dimension "
                        "(key_length) is 2"));
  GgufBuilder vocab = small_qwen3(false);
  vocab.strings("tokenizer.ggml.tokens", {"a", "b"});
  EXPECT_THAT(msg(ModelConfig::load(write(vocab)).status()),
              HasSubstr("tokenizer.ggml.tokens holds 2 tokens, but token_embd.weight has 6 rows"));
}

// Q8_0 tensors load as q8_0 views of the file's blocks (the model's shape checks apply to them
// as to any tensor); a 1-D Q8_0 tensor (a norm) dequantizes through to_f32, as the loader widens
// norms; Q4_0, Q4_K and Q6_K ones likewise, each worked by hand.
TEST_F(GgufQwen3KeysTest, QuantizedTensorsLoadInPlaceAndDequantizeByTheirBlockFormulas) {
  absl::StatusOr<ModelWeights> w = ModelWeights::open(write(small_qwen3(false, kQ8_0)));
  ASSERT_TRUE(w.ok()) << w.status();
  absl::StatusOr<TensorView> embd = w->get("model.embed_tokens.weight", {6, 32});
  ASSERT_TRUE(embd.ok()) << embd.status();
  EXPECT_EQ(embd->dtype, task::DataType::kQ8_0);
  EXPECT_EQ(embd->bytes.size(), 6u * 34);
  absl::Status shape = w->get("model.embed_tokens.weight", {6, 4}).status();
  EXPECT_EQ(shape.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(msg(shape), HasSubstr("model.embed_tokens.weight in m.gguf: shape [6,32], expected "
                                    "[6,4]"));
  EXPECT_THAT(
      msg(w->get("model.embed_tokens.weight", {6, 32}, {task::DataType::kBFloat16}).status()),
      HasSubstr("dtype Q8_0, expected BF16"));
  // A Q8_0 norm: one block, d = 0.5 (f16 0x3800), q = -3, 0, 1, 2, ... dequantizes to d·q.
  GgufBuilder norm = small_qwen3(false);
  std::string block = std::string("\x00\x38", 2);
  for (int i = 0; i < 32; ++i) block.push_back(static_cast<char>(i == 0 ? -3 : i - 1));
  norm.tensor("blk.0.extra_norm.weight", {32}, kQ8_0, block);
  absl::StatusOr<ModelWeights> n = ModelWeights::open(write(norm, "norm.gguf"));
  ASSERT_TRUE(n.ok()) << n.status();
  const std::vector<float> values = to_f32(n->get("blk.0.extra_norm.weight").value()).value();
  ASSERT_EQ(values.size(), 32u);
  EXPECT_EQ(values[0], -1.5f);
  EXPECT_EQ(values[1], 0.0f);
  EXPECT_EQ(values[31], 15.0f);
  // A Q4_0 one likewise: d = 0.5, bytes 0x80, 0x0f, ...: low nibbles first, each less 8.
  GgufBuilder q4 = small_qwen3(false);
  std::string q4_block = std::string("\x00\x38", 2);
  for (int i = 0; i < 16; ++i) q4_block.push_back(static_cast<char>(i == 0 ? 0x80 : 0x0f));
  q4.tensor("blk.0.q4_norm.weight", {32}, kQ4_0, q4_block);
  absl::StatusOr<ModelWeights> q4w = ModelWeights::open(write(q4, "q4.gguf"));
  ASSERT_TRUE(q4w.ok()) << q4w.status();
  const std::vector<float> q4v = to_f32(q4w->get("blk.0.q4_norm.weight").value()).value();
  ASSERT_EQ(q4v.size(), 32u);
  EXPECT_EQ(q4v[0], -4.0f);   // 0x80 & 15 = 0: (0 - 8) · 0.5
  EXPECT_EQ(q4v[1], 3.5f);    // 15 - 8
  EXPECT_EQ(q4v[16], 0.0f);   // 0x80 >> 4 = 8
  EXPECT_EQ(q4v[17], -4.0f);  // 0
  // A Q4_K one, worked by hand: d = 0.5, dmin = 0.25; sub-block 0 scale 3, min 5; sub-block 1
  // scale 2, min 4; sub-block 4 (packed: low bits in scales[8], high bits in the top two bits of
  // scales[0] and scales[4]) scale 17, min 2.
  GgufBuilder q4k = small_qwen3(false);
  std::string k4(144, '\0');
  k4[0] = 0x00, k4[1] = 0x38, k4[2] = 0x00, k4[3] = 0x34;
  k4[4 + 0] = 0x43, k4[4 + 1] = 2, k4[4 + 4] = 5, k4[4 + 5] = 4, k4[4 + 8] = 0x21;
  k4[16 + 0] = 0x7a;   // weight 0: 10 (low nibble), weight 32: 7 (high nibble)
  k4[16 + 64] = 0x03;  // weight 128 (sub-block 4): 3
  q4k.tensor("blk.0.q4k_norm.weight", {256}, kQ4_K, k4);
  // A Q6_K one: d = 0.5 (the last two bytes), scales[0] = -2, scales[4] = 1; weight 0 is ql[0]'s
  // low nibble 5 with qh[0]'s bits 0-1 (2) above it: 37 - 32 = 5; weight 64 is ql[0]'s high
  // nibble 0 with qh[0]'s bits 4-5 (0): -32.
  std::string k6(210, '\0');
  k6[0] = 0x05, k6[128] = 0x02, k6[192] = static_cast<char>(-2), k6[196] = 1;
  k6[208] = 0x00, k6[209] = 0x38;
  q4k.tensor("blk.0.q6k_norm.weight", {256}, kQ6_K, k6);
  absl::StatusOr<ModelWeights> kw = ModelWeights::open(write(q4k, "q4k.gguf"));
  ASSERT_TRUE(kw.ok()) << kw.status();
  const std::vector<float> k4v = to_f32(kw->get("blk.0.q4k_norm.weight").value()).value();
  ASSERT_EQ(k4v.size(), 256u);
  EXPECT_EQ(k4v[0], 13.75f);   // 0.5·3·10 - 0.25·5
  EXPECT_EQ(k4v[1], -1.25f);   // q 0
  EXPECT_EQ(k4v[32], 6.0f);    // 0.5·2·7 - 0.25·4
  EXPECT_EQ(k4v[128], 25.0f);  // 0.5·17·3 - 0.25·2
  const std::vector<float> k6v = to_f32(kw->get("blk.0.q6k_norm.weight").value()).value();
  ASSERT_EQ(k6v.size(), 256u);
  EXPECT_EQ(k6v[0], -5.0f);    // 0.5·-2·5
  EXPECT_EQ(k6v[64], -16.0f);  // 0.5·1·-32
  EXPECT_EQ(k6v[1], 32.0f);    // 0.5·-2·-32
}

TEST_F(GgufQwen3KeysTest, AMissingFileIsNotFoundAndADirectoryNamedGgufIsAModelDirectory) {
  EXPECT_EQ(ModelConfig::load((dir_ / "none.gguf").string()).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(ModelWeights::open((dir_ / "none.gguf").string()).status().code(),
            absl::StatusCode::kNotFound);
  fs::create_directories(dir_ / "d.gguf");
  absl::Status s = ModelConfig::load((dir_ / "d.gguf").string()).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(msg(s), HasSubstr("config.json"));
}

}  // namespace
}  // namespace gguf_model_test
}  // namespace simpler::llm
