#include "simpler/task/data_type.h"

#include <cstring>
#include <optional>

#include "Eigen/Core"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "simpler/base/enum_names.h"

namespace simpler::task {

namespace {

constexpr base::EnumNames<DataType> kShortNames = {
    {DataType::kFloat32, "f32"},       {DataType::kBFloat16, "bf16"},
    {DataType::kFloat16, "f16"},       {DataType::kInt32, "i32"},
    {DataType::kInt64, "i64"},         {DataType::kUInt8, "u8"},
    {DataType::kQ8_0, "q8_0"},         {DataType::kQ4_0, "q4_0"},
    {DataType::kQ4_K, "q4_k"},         {DataType::kQ6_K, "q6_k"},
    {DataType::kQ4_K_R16, "q4_k_r16"}, {DataType::kQ6_K_R16, "q6_k_r16"},
    {DataType::kQ8_0_R16, "q8_0_r16"}};

// safetensors spec, huggingface/safetensors README.
constexpr base::EnumNames<DataType> kSafetensorsNames = {
    {DataType::kFloat32, "F32"},       {DataType::kBFloat16, "BF16"},
    {DataType::kFloat16, "F16"},       {DataType::kInt32, "I32"},
    {DataType::kInt64, "I64"},         {DataType::kUInt8, "U8"},
    {DataType::kQ8_0, "Q8_0"},         {DataType::kQ4_0, "Q4_0"},
    {DataType::kQ4_K, "Q4_K"},         {DataType::kQ6_K, "Q6_K"},
    {DataType::kQ4_K_R16, "Q4_K_R16"}, {DataType::kQ6_K_R16, "Q6_K_R16"},
    {DataType::kQ8_0_R16, "Q8_0_R16"}};  // ggml's names for its block dtypes (ours for the
                                         // interleaved forms): not safetensors'

}  // namespace

std::string_view name_of(DataType dtype) { return kShortNames.name(dtype, "?"); }

std::string_view safetensors_name(DataType dtype) { return kSafetensorsNames.name(dtype, "?"); }

absl::StatusOr<DataType> parse_data_type(std::string_view text) {
  if (std::optional<DataType> t = kShortNames.parse(text)) return *t;
  if (std::optional<DataType> t = kSafetensorsNames.parse(text)) return *t;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown dtype '", std::string(text),
                   "' (expected f32/bf16/f16/i32/i64/u8/q8_0/q4_0/q4_k/q6_k/q4_k_r16/q6_k_r16/"
                   "q8_0_r16 "
                   "or F32/BF16/F16/I32/I64/U8)"));
}

namespace {

// Sub-block j's 6-bit scale and min of a Q4_K super-block's 12 packed bytes (ggml's
// get_scale_min_k4).
void q4_k_scale_min(const uint8_t* s, int j, int* sc, int* m) {
  if (j < 4) {
    *sc = s[j] & 63;
    *m = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
    *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

void dequantize_q4_k(const uint8_t* b, float* out) {
  uint16_t bits[2];
  std::memcpy(bits, b, sizeof(bits));
  const float d = f16_to_f32(bits[0]), dmin = f16_to_f32(bits[1]);
  for (int j = 0; j < 8; ++j) {
    int sc = 0, m = 0;
    q4_k_scale_min(b + 4, j, &sc, &m);
    const float a = d * static_cast<float>(sc);     // exact: 11 x 6 bits
    const float mm = dmin * static_cast<float>(m);  // exact
    const uint8_t* qs = b + 16 + 32 * (j / 2);
    for (int l = 0; l < 32; ++l) {
      const int q = j % 2 == 0 ? qs[l] & 15 : qs[l] >> 4;
      const float aq = a * static_cast<float>(q);  // exact: 17 x 4 bits
      out[32 * j + l] = aq - mm;                   // the one rounding
    }
  }
}

void dequantize_q6_k(const uint8_t* b, float* out) {
  uint16_t d_bits;
  std::memcpy(&d_bits, b + 208, sizeof(d_bits));
  const float d = f16_to_f32(d_bits);
  for (int i = 0; i < 256; ++i) {
    const int h = i / 128, c = i % 128 / 32, l = i % 32;
    const uint8_t lo = b[64 * h + 32 * (c & 1) + l];
    const int q =
        ((c < 2 ? lo & 15 : lo >> 4) | (((b[128 + 32 * h + l] >> (2 * c)) & 3) << 4)) - 32;
    const auto sc = static_cast<int8_t>(b[192 + 8 * h + 2 * c + l / 16]);
    // d·sc is exact (11 x 8 bits), and so is its product with q: |sc·q| <= 4096 has at most 12
    // significant bits.
    out[i] = d * static_cast<float>(sc) * static_cast<float>(q);
  }
}

}  // namespace

void dequantize_blocks(DataType dtype, const uint8_t* src, int64_t numel, float* out) {
  const int64_t per = block_elements(dtype);
  if (per == 1 || interleaved_rows(dtype) > 1) return;
  const size_t bytes = block_bytes(dtype);
  for (int64_t b = 0; b < numel / per; ++b, src += bytes, out += per) {
    if (dtype == DataType::kQ4_K) {
      dequantize_q4_k(src, out);
      continue;
    }
    if (dtype == DataType::kQ6_K) {
      dequantize_q6_k(src, out);
      continue;
    }
    uint16_t d_bits;
    std::memcpy(&d_bits, src, sizeof(d_bits));
    const float d = f16_to_f32(d_bits);
    for (int64_t i = 0; i < 32; ++i) {
      const int q = dtype == DataType::kQ8_0 ? static_cast<int8_t>(src[2 + i])
                    : i < 16                 ? (src[2 + i] & 15) - 8
                                             : (src[2 + i - 16] >> 4) - 8;
      out[i] = d * static_cast<float>(q);  // exact
    }
  }
}

float bf16_to_f32(uint16_t bits) {
  return static_cast<float>(Eigen::numext::bit_cast<Eigen::bfloat16>(bits));
}
uint16_t f32_to_bf16(float value) {
  return Eigen::numext::bit_cast<uint16_t>(Eigen::bfloat16(value));
}
float f16_to_f32(uint16_t bits) {
  return static_cast<float>(Eigen::numext::bit_cast<Eigen::half>(bits));
}
uint16_t f32_to_f16(float value) { return Eigen::numext::bit_cast<uint16_t>(Eigen::half(value)); }

}  // namespace simpler::task
