// Compares simpler::llm::Tokenizer with the JavaScript reference tokenizer
// (@lenml/tokenizers, the transformers.js tokenizer) on real text files and
// edge cases. The reference output is produced at test time by running
// tests/tokenizer/reference.mjs with node; nothing golden is committed. A
// missing node or node_modules fails the test with the command to fix it.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "simpler/base/process.h"
#include "simpler/tokenizer/tokenizer.h"
#include "tokenizer/tokenizer_test_util.h"

namespace simpler::llm {
namespace {

using Json = nlohmann::json;

struct Case {
  std::string name;
  std::string text;
  std::vector<int32_t> ids;
  std::string decoded;
  std::string nfc;
  bool has_added_token = false;
};

std::string describe_ids(const std::vector<int32_t>& ids, size_t at) {
  std::ostringstream out;
  const size_t begin = at >= 3 ? at - 3 : 0;
  const size_t end = std::min(ids.size(), at + 4);
  out << "[";
  for (size_t i = begin; i < end; ++i) out << (i == at ? " >" : " ") << ids[i];
  out << " ] (" << ids.size() << " ids)";
  return out.str();
}

// The real tokenizer (Qwen3TokenizerFixture) and the reference's output for the same directory.
class TokenizerReferenceTest : public testing::Qwen3TokenizerFixture {
 protected:
  static void SetUpTestSuite() {
    Qwen3TokenizerFixture::SetUpTestSuite();
    auto dir = default_tokenizer_dir();
    if (!dir.ok()) {
      setup_error_ = dir.status().ToString();
      return;
    }
    const char* node_env = std::getenv("SIMPLER_NODE");
    const std::string node = node_env != nullptr && *node_env != '\0' ? node_env : "node";
    absl::StatusOr<base::ProcessResult> probe = base::run_process({node, "--version"});
    if (!probe.ok() || !probe->ok()) {
      setup_error_ = "node is not runnable (`" + node + " --version` failed: " +
                     (probe.ok() ? probe->output : probe.status().ToString()) +
                     "); install Node.js (Debian: apt-get install nodejs npm), run `npm ci` in "
                     "the repository root, or set SIMPLER_NODE";
      return;
    }
    const std::string out = SIMPLER_TOKENIZER_REFERENCE_OUT;
    std::remove(out.c_str());
    absl::StatusOr<base::ProcessResult> run = base::run_process(
        {node, SIMPLER_TOKENIZER_REFERENCE_SCRIPT, "--tokenizer-dir", *dir, "--out", out});
    if (!run.ok() || !run->ok()) {
      setup_error_ =
          "reference script " + std::string(SIMPLER_TOKENIZER_REFERENCE_SCRIPT) +
          " failed: " + (run.ok() ? run->describe() + "\n" + run->output : run.status().ToString());
      return;
    }
    std::ifstream in(out);
    Json root = Json::parse(in, nullptr, /*allow_exceptions=*/false);
    if (root.is_discarded() || !root.contains("cases")) {
      setup_error_ = "reference output " + out + " is not the expected JSON";
      return;
    }
    for (const Json& entry : root["cases"]) {
      Case c;
      c.name = entry["name"].get<std::string>();
      c.text = entry["text"].get<std::string>();
      c.ids = entry["ids"].get<std::vector<int32_t>>();
      c.decoded = entry["decoded"].get<std::string>();
      c.nfc = entry["nfc"].get<std::string>();
      c.has_added_token = entry["has_added_token"].get<bool>();
      cases_->push_back(std::move(c));
    }
  }

  void SetUp() override {
    ASSERT_NO_FATAL_FAILURE(Qwen3TokenizerFixture::SetUp());
    ASSERT_EQ(setup_error_, "") << "cannot run the reference comparison";
  }

  static inline std::string setup_error_;
  static inline std::vector<Case>* cases_ = new std::vector<Case>();
};

TEST_F(TokenizerReferenceTest, CorpusHasRealFilesAndEdgeCases) {
  int files = 0, edges = 0, randoms = 0;
  for (const Case& c : *cases_) {
    files += c.name.rfind("file:", 0) == 0;
    edges += c.name.rfind("edge:", 0) == 0;
    randoms += c.name.rfind("random:", 0) == 0;
  }
  EXPECT_GE(files, 4);
  EXPECT_GE(edges, 50);
  EXPECT_GE(randoms, 100);
}

TEST_F(TokenizerReferenceTest, IdsMatchReference) {
  int mismatches = 0;
  size_t tokens = 0;
  for (const Case& c : *cases_) {
    const std::vector<int32_t> ids = tokenizer_->encode(c.text);
    tokens += ids.size();
    if (ids == c.ids) continue;
    if (++mismatches > 10) continue;
    size_t at = 0;
    while (at < ids.size() && at < c.ids.size() && ids[at] == c.ids[at]) ++at;
    ADD_FAILURE() << c.name << ": ids differ at index " << at
                  << "\n  ours:      " << describe_ids(ids, at)
                  << "\n  reference: " << describe_ids(c.ids, at)
                  << "\n  text: " << ::testing::PrintToString(c.text.substr(0, 200));
  }
  EXPECT_EQ(mismatches, 0) << "of " << cases_->size() << " cases";
  std::printf("compared %zu cases, %zu tokens\n", cases_->size(), tokens);
}

TEST_F(TokenizerReferenceTest, DecodeMatchesReference) {
  for (const Case& c : *cases_) {
    EXPECT_EQ(tokenizer_->decode(c.ids), c.decoded) << c.name;
  }
}

TEST_F(TokenizerReferenceTest, RoundTripIsNfcOfText) {
  int checked = 0;
  for (const Case& c : *cases_) {
    // utf8proc's NFC agrees with JavaScript's String.prototype.normalize.
    EXPECT_EQ(Tokenizer::nfc(c.text), c.nfc) << c.name;
    if (c.has_added_token) continue;  // added-token text is not normalized
    EXPECT_EQ(tokenizer_->decode(tokenizer_->encode(c.text)), c.nfc) << c.name;
    ++checked;
  }
  EXPECT_GE(checked, 100);
}

}  // namespace
}  // namespace simpler::llm
