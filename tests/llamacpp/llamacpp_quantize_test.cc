// Our Q4_K and Q6_K quantizers (quantize_row_q4_k / quantize_row_q6_k, written from ggml's
// reference) write the same bytes as llama.cpp's own, called through ggml's public
// ggml_quantize_chunk without an importance matrix (which runs quantize_row_q4_K_ref /
// quantize_row_q6_K_ref, what llama-quantize runs for a file without one), on rows of several
// kinds: Gaussian weights at a model's scale, rows with outliers, all-positive and all-negative
// rows, a row of zeros, a constant row, and tiny values near the binary16 subnormals. Built
// where scripts/build_llamacpp_peer.sh has built the peer.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "ggml.h"
#include "gtest/gtest.h"
#include "simpler/model/gguf_export.h"

namespace simpler::llm {
namespace {

// `rows` rows of 1024 values of the kinds above, one kind per row (cycling).
std::vector<float> test_rows(int rows, uint32_t seed) {
  constexpr int kCols = 1024;
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal(0.0f, 0.02f);
  std::vector<float> x(static_cast<size_t>(rows) * kCols);
  for (int r = 0; r < rows; ++r) {
    float* row = x.data() + static_cast<size_t>(r) * kCols;
    for (int i = 0; i < kCols; ++i) {
      float v = normal(gen);
      switch (r % 7) {
        case 1:  // outliers
          if (i % 61 == 5) v *= 40.0f;
          break;
        case 2:
          v = std::fabs(v);
          break;
        case 3:
          v = -std::fabs(v) - 0.01f;
          break;
        case 4:
          v = 0.0f;
          break;
        case 5:
          v = 0.125f;
          break;
        case 6:
          v *= 1e-5f;  // scales near binary16's subnormals
          break;
        default:
          break;
      }
      row[i] = v;
    }
  }
  return x;
}

void expect_same_bytes(ggml_type type, const char* name, size_t block_bytes,
                       absl::Status (*ours)(std::span<const float>, std::span<uint8_t>)) {
  constexpr int kRows = 21, kCols = 1024;
  const std::vector<float> x = test_rows(kRows, 7);
  std::vector<uint8_t> theirs(kRows * kCols / 256 * block_bytes, 0xee);
  ASSERT_EQ(ggml_quantize_chunk(type, x.data(), theirs.data(), 0, kRows, kCols, nullptr),
            theirs.size());
  std::vector<uint8_t> mine(theirs.size(), 0x11);
  ASSERT_TRUE(ours(x, mine).ok());
  for (size_t b = 0; b < theirs.size() / block_bytes; ++b) {
    ASSERT_EQ(
        std::memcmp(mine.data() + b * block_bytes, theirs.data() + b * block_bytes, block_bytes), 0)
        << name << " super-block " << b << " (row " << b * 256 / kCols << ", kind "
        << b * 256 / kCols % 7 << ") differs from llama.cpp's";
  }
}

TEST(LlamaCppQuantizers, OurQ4_KBytesAreLlamaCpps) {
  expect_same_bytes(GGML_TYPE_Q4_K, "Q4_K", 144, &quantize_row_q4_k);
}

TEST(LlamaCppQuantizers, OurQ6_KBytesAreLlamaCpps) {
  expect_same_bytes(GGML_TYPE_Q6_K, "Q6_K", 210, &quantize_row_q6_k);
}

}  // namespace
}  // namespace simpler::llm
