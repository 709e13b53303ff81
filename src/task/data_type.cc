#include "simpler/task/data_type.h"

#include <cstring>

#include "Eigen/Core"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

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
  }
  return 0;
}

std::string_view name_of(DataType dtype) {
  switch (dtype) {
    case DataType::kFloat32:
      return "f32";
    case DataType::kBFloat16:
      return "bf16";
    case DataType::kFloat16:
      return "f16";
    case DataType::kInt32:
      return "i32";
    case DataType::kInt64:
      return "i64";
    case DataType::kUInt8:
      return "u8";
  }
  return "?";
}

std::string_view safetensors_name(DataType dtype) {
  switch (dtype) {
    case DataType::kFloat32:
      return "F32";
    case DataType::kBFloat16:
      return "BF16";
    case DataType::kFloat16:
      return "F16";
    case DataType::kInt32:
      return "I32";
    case DataType::kInt64:
      return "I64";
    case DataType::kUInt8:
      return "U8";
  }
  return "?";
}

absl::StatusOr<DataType> parse_data_type(std::string_view text) {
  for (DataType t : {DataType::kFloat32, DataType::kBFloat16, DataType::kFloat16, DataType::kInt32,
                     DataType::kInt64, DataType::kUInt8}) {
    if (text == name_of(t) || text == safetensors_name(t)) return t;
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown dtype '", std::string(text),
                                                 "' (expected f32/bf16/f16/i32/i64/u8 or "
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
