// A model path's tokenizer, chat template and engine, for a model directory and for the GGUF
// file exported from it: the same ids, the same template, the same logits.
#include "simpler/engine/model_files.h"

#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "engine/engine_test_hooks.h"
#include "engine/engine_test_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/gguf_test_util.h"
#include "simpler/model/gguf.h"
#include "simpler/model/gguf_export.h"

namespace simpler::llm {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

// The tiny preset with Qwen3's tokenizer and its GGUF export, made once for the suite.
class ModelFilesTest : public TinyTextModelTest<ModelFilesTest> {
 public:
  static constexpr const char* kDirPrefix = "model_files_test_";

 protected:
  static void SetUpTestSuite() {
    TinyTextModelTest<ModelFilesTest>::SetUpTestSuite();
    gguf_ = new std::string(*dir_ + ".gguf");
    GgufExportOptions e;
    e.model_dir = *dir_;
    e.out_path = *gguf_;
    absl::Status exported = export_gguf(e);
    ASSERT_TRUE(exported.ok()) << exported;
  }
  static void TearDownTestSuite() {
    fs::remove(*gguf_);
    delete gguf_;
    TinyTextModelTest<ModelFilesTest>::TearDownTestSuite();
  }

  // A small file holding only tokenizer keys (and `extra` ones), opened.
  absl::StatusOr<GgufFile> small_file(testing::GgufBuilder b) {
    const std::string path = *dir_ + "/small.gguf";
    testing::write_file(path, b.build());
    return GgufFile::open(path);
  }

  static inline std::string* gguf_ = nullptr;
};

TEST_F(ModelFilesTest, TheGgufTokenizerEncodesAndDecodesAsTheDirectorysOnTheSameTexts) {
  absl::StatusOr<Tokenizer> dir_tok = load_model_tokenizer(*dir_);
  absl::StatusOr<Tokenizer> gguf_tok = load_model_tokenizer(*gguf_);
  ASSERT_TRUE(dir_tok.ok()) << dir_tok.status();
  ASSERT_TRUE(gguf_tok.ok()) << gguf_tok.status();
  EXPECT_EQ(gguf_tok->vocab_size(), dir_tok->vocab_size());
  EXPECT_EQ(gguf_tok->eos_token_id(), dir_tok->eos_token_id());
  EXPECT_EQ(gguf_tok->pad_token_id(), dir_tok->pad_token_id());
  const std::vector<std::string> texts = {
      "The quick brown fox jumps over the lazy dog.",
      "  leading spaces, trailing  \n\n\ttabs\r\n",
      "I'm sure they'll say it's 12345 or 3.14159!",
      "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
      "混合中文和English文本，标点。",
      "e\xcc\x81 vs \xc3\xa9 (NFC), emoji \xf0\x9f\x98\x80\xf0\x9f\x91\x8d\xf0\x9f\x8f\xbd",
      "def f(x):\n    return x ** 2  # code\n",
      "<tool_call>{\"a\": 1}</tool_call> <|endoftext|>",
      "",
      "\xff\xfe invalid UTF-8",
  };
  for (const std::string& text : texts) {
    SCOPED_TRACE(text);
    const std::vector<int32_t> ids = dir_tok->encode(text);
    EXPECT_EQ(gguf_tok->encode(text), ids);
    EXPECT_EQ(gguf_tok->decode(ids), dir_tok->decode(ids));
    EXPECT_EQ(gguf_tok->decode(ids, /*skip_special_tokens=*/true),
              dir_tok->decode(ids, /*skip_special_tokens=*/true));
  }
  for (int32_t id :
       {0, 1, 220, 9707, 151642, 151643, 151644, 151645, 151665, 151668, 151669, 151935}) {
    SCOPED_TRACE(id);
    EXPECT_EQ(gguf_tok->id_to_token(id), dir_tok->id_to_token(id));
    EXPECT_EQ(gguf_tok->is_special(id), dir_tok->is_special(id));
  }
}

TEST_F(ModelFilesTest, TheGgufChatTemplateIsTheOneRenderedNativelyOrRefusedSayingItDiffers) {
  absl::StatusOr<ChatTemplate> from_dir = load_model_chat_template(*dir_);
  absl::StatusOr<ChatTemplate> from_gguf = load_model_chat_template(*gguf_);
  ASSERT_TRUE(from_dir.ok()) << from_dir.status();
  ASSERT_TRUE(from_gguf.ok()) << from_gguf.status();
  EXPECT_EQ(from_gguf->name(), "qwen3");
  EXPECT_EQ(from_gguf->sha256(), from_dir->sha256());

  testing::GgufBuilder other;
  other.string("tokenizer.chat_template", "{{ messages }}");
  absl::StatusOr<GgufFile> f = small_file(std::move(other));
  ASSERT_TRUE(f.ok()) << f.status();
  absl::Status s = gguf_chat_template(*f).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("tokenizer.chat_template differs from the chat template simpler renders "
                        "natively (its SHA-256 is " +
                        sha256_hex("{{ messages }}")));
  testing::GgufBuilder none;
  f = small_file(std::move(none));
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(gguf_chat_template(*f).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(gguf_tokenizer(*f).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(ModelFilesTest, AGgufVocabularyOfAnotherKindIsRefusedNamingTheKey) {
  auto vocab = [](std::string pre, std::vector<int32_t> types) {
    testing::GgufBuilder b;
    b.string("tokenizer.ggml.model", "gpt2");
    b.string("tokenizer.ggml.pre", pre);
    b.strings("tokenizer.ggml.tokens", {"a", "b"});
    b.i32s("tokenizer.ggml.token_type", types);
    return b;
  };
  absl::StatusOr<GgufFile> f = small_file(vocab("llama-bpe", {1, 1}));
  ASSERT_TRUE(f.ok()) << f.status();
  absl::Status s = gguf_tokenizer(*f).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("tokenizer.ggml.pre 'llama-bpe' is not supported (only 'qwen2')"));
  f = small_file(vocab("qwen2", {1}));
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_THAT(std::string(gguf_tokenizer(*f).status().message()),
              HasSubstr("tokenizer.ggml.token_type holds 1 types for 2 tokens"));
  f = small_file(vocab("qwen2", {1, 6}));
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_THAT(std::string(gguf_tokenizer(*f).status().message()),
              HasSubstr("token 1 has tokenizer.ggml.token_type 6"));
}

TEST_F(ModelFilesTest, TheGgufFileGivesTheDirectorysFirstStepLogitsAndTokens) {
  std::vector<std::vector<float>> logits;
  std::vector<std::vector<int32_t>> tokens;
  for (const std::string& path : {*dir_, *gguf_}) {
    SCOPED_TRACE(path);
    std::unique_ptr<LlmEngine> e = create_test_engine(path, small_engine_options(1));
    ASSERT_NE(e, nullptr);
    RequestSpec spec = greedy({9707, 11, 1879, 0, 151643}, 6);
    auto hooks = std::make_shared<RequestHooks>();
    hooks->logits_tokens = {0};
    spec.hooks = std::move(hooks);
    absl::StatusOr<RequestId> id = e->add_request(std::move(spec));
    ASSERT_TRUE(id.ok()) << id.status();
    std::vector<int32_t> got;
    std::vector<float> first;
    while (true) {
      auto out = e->next_output(*id, base::Deadline::after(std::chrono::seconds(60)));
      ASSERT_TRUE(out.ok()) << out.status();
      got.insert(got.end(), out->token_ids.begin(), out->token_ids.end());
      if (auto it = hooks_of(*out).logits.find(0); it != hooks_of(*out).logits.end()) {
        first = it->second;
      }
      if (out->finished()) break;
    }
    EXPECT_TRUE(e->shutdown().ok());
    ASSERT_EQ(first.size(), 151936u);
    logits.push_back(std::move(first));
    tokens.push_back(std::move(got));
  }
  ASSERT_EQ(logits.size(), 2u);
  EXPECT_EQ(std::memcmp(logits[0].data(), logits[1].data(), logits[0].size() * 4), 0);
  EXPECT_EQ(tokens[1], tokens[0]);
  EXPECT_EQ(tokens[0].size(), 6u);
}

TEST_F(ModelFilesTest, CheckpointFilesAreTheGgufFileOrTheDirectorysSafetensors) {
  EXPECT_EQ(model_checkpoint_files(*gguf_), std::vector<std::string>{*gguf_});
  EXPECT_EQ(model_checkpoint_files(*dir_),
            std::vector<std::string>{(fs::path(*dir_) / "model.safetensors").string()});
}

}  // namespace
}  // namespace simpler::llm
