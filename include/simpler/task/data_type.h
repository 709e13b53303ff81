// Element types of tensors.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "absl/status/statusor.h"

namespace simpler::task {

// Element type. Values are part of the graph-image format: never renumber.
enum class DataType : uint8_t {
  kFloat32 = 0,
  kBFloat16 = 1,
  kFloat16 = 2,
  kInt32 = 3,
  kInt64 = 4,
  kUInt8 = 5,
};

// Bytes per element.
size_t size_of(DataType dtype);

// Short name: "f32", "bf16", "f16", "i32", "i64", "u8".
std::string_view name_of(DataType dtype);

// Parses a short name ("f32", ...) or a safetensors dtype string ("F32", "BF16",
// "F16", "I32", "I64", "U8"; safetensors spec, huggingface/safetensors README).
// INVALID_ARGUMENT names the unknown string.
absl::StatusOr<DataType> parse_data_type(std::string_view text);

// The safetensors dtype string of `dtype`.
std::string_view safetensors_name(DataType dtype);

// Scalar conversions (IEEE 754 binary16; bfloat16 = top 16 bits of binary32,
// round-to-nearest-even on the way down, NaN kept quiet).
float bf16_to_f32(uint16_t bits);
uint16_t f32_to_bf16(float value);
float f16_to_f32(uint16_t bits);
uint16_t f32_to_f16(float value);

}  // namespace simpler::task
