// The shared fixture of the tests that need the real Qwen3 tokenizer.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "gtest/gtest.h"
#include "simpler/tokenizer/tokenizer.h"

namespace simpler::llm::testing {

// The real Qwen3 tokenizer (default_tokenizer_dir()), loaded once per test process by the first
// suite that needs it and shared by the others (a load takes ~1 s, ~9 s under ASan); a test
// fails with the load error when it cannot be loaded.
class Qwen3TokenizerFixture : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (tokenizer_ != nullptr || !load_error_.empty()) return;
    auto dir = default_tokenizer_dir();
    if (!dir.ok()) {
      load_error_ = dir.status().ToString();
      return;
    }
    auto tokenizer = Tokenizer::load(*dir);
    if (!tokenizer.ok()) {
      load_error_ = tokenizer.status().ToString();
      return;
    }
    tokenizer_ = std::make_unique<Tokenizer>(*std::move(tokenizer));
  }
  void SetUp() override { ASSERT_NE(tokenizer_, nullptr) << load_error_; }

  static const Tokenizer& tok() { return *tokenizer_; }
  static int32_t id(const std::string& token) {
    auto found = tokenizer_->token_to_id(token);
    EXPECT_TRUE(found.has_value()) << token;
    return found.value_or(-1);
  }

  static inline std::string load_error_;
  static inline std::unique_ptr<Tokenizer> tokenizer_;
};

}  // namespace simpler::llm::testing
