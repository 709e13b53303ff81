// llama.cpp loads the checkpoint `simpler export-gguf` writes, bf16 and Q8_0, and its first-step
// logits on a fixed prompt, read through libllama's C API, agree with ours on the same file:
// relative L2 <= 1e-2 on the tiny preset for bf16 (llama.cpp's own kernels and f16/bf16
// intermediates make them differ a little, not a lot); for Q8_0 and Q4_0, where ours run
// precision int8 (the default: the activations quantized to int8 blocks as llama.cpp's matmuls
// do), <= 2e-2 and nearer than our exact path's (printed beside it); for Q4_K_M <= 3e-2 (see the
// tests for the measured figures and what is not yet explained). Built where
// scripts/build_llamacpp_peer.sh has built the peer.
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "ggml-backend.h"
#include "gtest/gtest.h"
#include "llama.h"
#include "llamacpp_peer_util.h"
#include "model/model_test_util.h"
#include "simpler/base/clock.h"
#include "simpler/engine/llm_engine.h"
#include "simpler/model/gguf_export.h"
#include "simpler/model/make_model.h"
#include "simpler/tokenizer/tokenizer.h"

namespace simpler::llm {
namespace {

// Our logits after the prompt's last position (the first output token's).
std::vector<float> our_logits(const std::string& model, const std::vector<int32_t>& prompt,
                              Precision precision = Precision::kInt8) {
  absl::StatusOr<std::vector<Logits>> l = our_first_logits(model, {prompt}, precision);
  EXPECT_TRUE(l.ok()) << l.status();
  return l.ok() ? (*l)[0] : Logits();
}

// llama.cpp's logits after the prompt's last position.
std::vector<float> llamacpp_logits(const std::string& gguf, const std::vector<int32_t>& prompt) {
  ggml_backend_load_all_from_path(SIMPLER_LLAMACPP_BIN_DIR);
  llama_backend_init();
  absl::StatusOr<std::vector<Logits>> l = llamacpp_first_logits(gguf, {prompt}, /*threads=*/2);
  llama_backend_free();
  EXPECT_TRUE(l.ok()) << l.status();
  return l.ok() ? (*l)[0] : Logits();
}

// `model_dir` exported as `type` to dir/model-NAME.gguf; its path ("" and a test failure when the
// export fails).
std::string exported(const std::string& model_dir, const std::filesystem::path& dir, GgufType type,
                     const std::string& name) {
  GgufExportOptions go;
  go.model_dir = model_dir;
  go.out_path = (dir / absl::StrCat("model-", name, ".gguf")).string();
  go.type = type;
  const absl::Status s = export_gguf(go);
  EXPECT_TRUE(s.ok()) << s;
  return s.ok() ? go.out_path : "";
}

// The tiny preset (seed 1) and its Q8_0 file, made once for the suite (each is seconds); each test
// writes its other files into a folder of its own.
class LlamaCppPeer : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    suite_dir_ = std::filesystem::temp_directory_path() /
                 ("simpler_llamacpp_test_" + std::to_string(::getpid()));
    std::filesystem::remove_all(suite_dir_);  // an earlier process of the same pid may have left it
    model_dir_ = (suite_dir_ / "model").string();
    ASSERT_TRUE(make_model(testing::tiny_model_options(model_dir_, 1)).ok());
    q8_0_file_ = exported(model_dir_, suite_dir_, GgufType::kQ8_0, "q8_0");
  }
  static void TearDownTestSuite() { std::filesystem::remove_all(suite_dir_); }
  void SetUp() override {
    ASSERT_FALSE(q8_0_file_.empty());
    dir_ = suite_dir_ / ::testing::UnitTest::GetInstance()->current_test_info()->name();
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }

  static inline std::filesystem::path suite_dir_;
  static inline std::string model_dir_, q8_0_file_;
  std::filesystem::path dir_;
};

TEST_F(LlamaCppPeer, LoadsTheExportedGgufAndItsFirstStepLogitsAgreeWithOurs) {
  const std::vector<int32_t> prompt = {9707, 11, 1879, 0, 785};  // "Hello, world!The"
  // bf16: ours on the directory (the file's bytes); Q8_0 and Q4_0: ours on the file itself.
  std::vector<float> ours_bf16, theirs_bf16;
  for (GgufType type : {GgufType::kBf16, GgufType::kQ8_0, GgufType::kQ4_0}) {
    const bool quantized = type != GgufType::kBf16;
    const char* name = type == GgufType::kBf16 ? "bf16" : type == GgufType::kQ8_0 ? "q8_0" : "q4_0";
    SCOPED_TRACE(name);
    const std::string file =
        type == GgufType::kQ8_0 ? q8_0_file_ : exported(model_dir_, dir_, type, name);
    ASSERT_FALSE(file.empty());
    const std::vector<float> ours = our_logits(quantized ? file : model_dir_, prompt);
    const std::vector<float> theirs = llamacpp_logits(file, prompt);
    ASSERT_EQ(ours.size(), theirs.size());
    ASSERT_FALSE(ours.empty());
    const double rel = relative_l2(ours, theirs);
    std::printf("llama.cpp vs simpler first-step logits (%s): relative L2 %.3g over %zu logits\n",
                name, rel, ours.size());
    if (!quantized) {
      EXPECT_LE(rel, 1e-2);
      ours_bf16 = ours;
      theirs_bf16 = theirs;
      continue;
    }
    // Ours quantize the activations to int8 blocks as llama.cpp's Q8_0 and Q4_0 matmuls do. On
    // the checkpoint of make-model's first generator that brought llama.cpp's logits from
    // 1.85e-2 (Q8_0; Q4_0 1.74e-2) of our exact path's (f32 activations) to 1.40e-2 (1.33e-2) of
    // ours; on today's (splitmix64 + Box-Muller) Q8_0 1.35e-2 and Q4_0 1.64e-2 against the
    // exact path's 1.45e-2 for Q4_0 (2026-12-05): int8 is not reliably nearer, and neither
    // reaches the bf16 file's 1e-2. The rest is llama.cpp's default f16 attention, whose small
    // moves flip its int8 activation roundings away from ours (the next test, and
    // docs/design/quantized_matmul.md). So the bound is 2e-2, both figures are printed, and
    // both files must be nearer to each other than to the bf16 model's (a block layout error
    // would put them near 1).
    const double to_bf16 = relative_l2(theirs, ours_bf16);
    const std::vector<float> ours_exact = our_logits(file, prompt, Precision::kExact);
    std::printf(
        "%s: ours against our bf16 %.3g; llama.cpp's against its bf16 %.3g and our bf16 "
        "%.3g; our exact path against llama.cpp %.3g\n",
        name, relative_l2(ours, ours_bf16), relative_l2(theirs, theirs_bf16), to_bf16,
        relative_l2(ours_exact, theirs));
    EXPECT_LE(rel, 2e-2);
    EXPECT_LE(relative_l2(ours_exact, theirs), 2e-2);
    EXPECT_LT(rel, to_bf16);
  }
}

// Why the quantized files sit 3x farther from llama.cpp than the bf16 file (1.7e-2 against 6e-3
// on 8 random prompts): llama.cpp's default attention (flash attention over an f16 K/V cache,
// softmax·V summed in f16 on the CPU) moves every activation a little, and each Q8_0 matmul
// rounds its activations to int8 steps of max|x|/127, so those small moves flip roundings and
// the flips decorrelate its int8 activations from ours. With llama.cpp's attention in f32, our
// int8 path (the same activation quantizer, the same integer sums) reproduces its logits on most
// prompts to float noise, while our exact path (f32 activations) stays ~1.7e-2 away; a prompt
// where one rounding still flips (a few ulps of other ops) lands near the exact path's figure.
// Measured 2026-12-05 on the tiny preset, seed 1, 8 prompts of 16 tokens, 2-vCPU AMD EPYC with
// AVX-512 VNNI: prompts 0, 3, 4 and 5 at 7.7e-8, the others 8e-3 to 1.8e-2, int8 mean 6.6e-3,
// exact 1.7e-2 (each prompt printed). How many prompts escape every flip depends on the CPU's
// kernels, so the test asks for one.
TEST_F(LlamaCppPeer, WithF32AttentionOurInt8PathReproducesLlamaCppsQ8_0Logits) {
  const std::string& file = q8_0_file_;
  std::mt19937_64 rng(1);
  std::uniform_int_distribution<int32_t> id(0, 151642);
  Prompts prompts(8);
  for (auto& p : prompts) {
    for (int k = 0; k < 16; ++k) p.push_back(id(rng));
  }
  absl::StatusOr<std::vector<Logits>> ours = our_first_logits(file, prompts, Precision::kInt8);
  ASSERT_TRUE(ours.ok()) << ours.status();
  absl::StatusOr<std::vector<Logits>> exact = our_first_logits(file, prompts, Precision::kExact);
  ASSERT_TRUE(exact.ok()) << exact.status();
  ggml_backend_load_all_from_path(SIMPLER_LLAMACPP_BIN_DIR);
  llama_backend_init();
  absl::StatusOr<std::vector<Logits>> theirs =
      llamacpp_first_logits(file, prompts, /*threads=*/2, LlamacppAttention{.f32_attention = true});
  llama_backend_free();
  ASSERT_TRUE(theirs.ok()) << theirs.status();
  double int8_mean = 0, exact_mean = 0, int8_min = 1;
  for (size_t i = 0; i < prompts.size(); ++i) {
    const double a = relative_l2((*ours)[i], (*theirs)[i]);
    const double b = relative_l2((*exact)[i], (*theirs)[i]);
    std::printf("prompt %zu: int8 %.3g exact %.3g\n", i, a, b);
    int8_mean += a / static_cast<double>(prompts.size());
    exact_mean += b / static_cast<double>(prompts.size());
    int8_min = std::min(int8_min, a);
  }
  std::printf("mean relative L2 against llama.cpp (f32 attention): int8 %.3g exact %.3g\n",
              int8_mean, exact_mean);
  EXPECT_LE(int8_min, 1e-5);  // at least one prompt reproduced to float noise
  EXPECT_LE(int8_mean, 0.75 * exact_mean);
}

// Q4_K_M on a model whose rows are whole super-blocks of 256 (the tiny preset at hidden 256,
// intermediate 512, 4 layers, tied: token_embd, the head, Q6_K; attn_v and ffn_down of layers 2
// and 3 Q6_K; the rest Q4_K): llama.cpp reads our Q4_K and Q6_K blocks as we do. Its K-quant
// matmuls round the activations to 8-bit blocks (Q8_K) as ours do under precision int8; its
// logits sit within 3e-2 of ours, nearer to ours on the same file than to ours on the bf16
// checkpoint (4-bit weights move those far more). Measured 2026-12-05: 2.56e-2 from ours
// (int8), 2.54e-2 from our exact path: quantizing our activations as Q8_K did not bring them
// nearer here: the gap is llama.cpp's f16 attention flipping its Q8_K roundings away from ours,
// as for Q8_0 (with its attention in f32, 5 of 8 random prompts agree to float noise:
// docs/design/quantized_matmul.md).
TEST_F(LlamaCppPeer, ReadsOurQ4_KMFileAsWeDo) {
  const MakeModelOptions mo = testing::k_quant_model_options((dir_ / "model").string(), 2, 4);
  ASSERT_TRUE(make_model(mo).ok());
  const std::string file = exported(mo.out_dir, dir_, GgufType::kQ4_K_M, "q4_k_m");
  ASSERT_FALSE(file.empty());
  const std::vector<int32_t> prompt = {9707, 11, 1879, 0, 785};  // "Hello, world!The"
  const std::vector<float> ours_bf16 = our_logits(mo.out_dir, prompt);
  const std::vector<float> ours = our_logits(file, prompt);
  const std::vector<float> ours_exact = our_logits(file, prompt, Precision::kExact);
  const std::vector<float> theirs = llamacpp_logits(file, prompt);
  ASSERT_EQ(ours.size(), theirs.size());
  ASSERT_EQ(ours.size(), ours_bf16.size());
  ASSERT_EQ(ours.size(), ours_exact.size());
  ASSERT_FALSE(ours.empty());
  const double rel = relative_l2(ours, theirs);
  const double to_bf16 = relative_l2(theirs, ours_bf16);
  std::printf(
      "llama.cpp vs simpler first-step logits (q4_k_m): relative L2 %.3g over %zu logits; ours "
      "against our bf16 %.3g; llama.cpp's against our bf16 %.3g; our exact path against "
      "llama.cpp %.3g\n",
      rel, ours.size(), relative_l2(ours, ours_bf16), to_bf16, relative_l2(ours_exact, theirs));
  EXPECT_LE(rel, 3e-2);
  EXPECT_LT(rel, to_bf16);
}

}  // namespace
}  // namespace simpler::llm
