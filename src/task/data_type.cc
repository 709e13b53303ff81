#include "simpler/task/data_type.h"

#include <cstring>
#include <optional>

#include "Eigen/Core"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "simpler/base/enum_names.h"

namespace simpler::task {

size_t size_of(DataType dtype) {
  switch (dtype) {
    case DataType::kFloat32:
    case DataType::kInt32:
      return 4;
    case DataType::kBFloat16:
    case DataType::kFloat16:
      return 2;
    case DataType::kInt64:
      return 8;
    case DataType::kUInt8:
      return 1;
    case DataType::kQ8_0:
    case DataType::kQ4_0:
      return 0;
  }
  return 0;
}

int64_t block_elements(DataType dtype) {
  return dtype == DataType::kQ8_0 || dtype == DataType::kQ4_0 ? 32 : 1;
}

size_t block_bytes(DataType dtype) {
  return dtype == DataType::kQ8_0 ? 34 : dtype == DataType::kQ4_0 ? 18 : size_of(dtype);
}

uint64_t bytes_of(DataType dtype, uint64_t numel) {
  const uint64_t per = static_cast<uint64_t>(block_elements(dtype));
  return (numel + per - 1) / per * block_bytes(dtype);
}

namespace {

constexpr base::EnumNames<DataType> kShortNames = {
    {DataType::kFloat32, "f32"}, {DataType::kBFloat16, "bf16"}, {DataType::kFloat16, "f16"},
    {DataType::kInt32, "i32"},   {DataType::kInt64, "i64"},     {DataType::kUInt8, "u8"},
    {DataType::kQ8_0, "q8_0"},   {DataType::kQ4_0, "q4_0"}};

// safetensors spec, huggingface/safetensors README.
constexpr base::EnumNames<DataType> kSafetensorsNames = {
    {DataType::kFloat32, "F32"}, {DataType::kBFloat16, "BF16"}, {DataType::kFloat16, "F16"},
    {DataType::kInt32, "I32"},   {DataType::kInt64, "I64"},     {DataType::kUInt8, "U8"},
    {DataType::kQ8_0, "Q8_0"},   {DataType::kQ4_0, "Q4_0"}};  // ggml's names: not safetensors'

}  // namespace

std::string_view name_of(DataType dtype) { return kShortNames.name(dtype, "?"); }

std::string_view safetensors_name(DataType dtype) { return kSafetensorsNames.name(dtype, "?"); }

absl::StatusOr<DataType> parse_data_type(std::string_view text) {
  if (std::optional<DataType> t = kShortNames.parse(text)) return *t;
  if (std::optional<DataType> t = kSafetensorsNames.parse(text)) return *t;
  return absl::InvalidArgumentError(absl::StrCat("unknown dtype '", std::string(text),
                                                 "' (expected f32/bf16/f16/i32/i64/u8/q8_0/q4_0 or "
                                                 "F32/BF16/F16/I32/I64/U8)"));
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
