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
  // ggml's block_q8_0 (ggml-common.h): blocks of 32 consecutive elements along the innermost
  // dimension, each 34 bytes: the scale d as IEEE binary16 (little-endian), then 32 int8 q;
  // element i of a block is d·q[i] (exact in f32). A tensor of it is [..., n] with n a multiple
  // of 32, row-major, each row n / 32 blocks.
  kQ8_0 = 6,
  // ggml's block_q4_0: blocks of 32 consecutive elements along the innermost dimension, each 18
  // bytes: the scale d as IEEE binary16 (little-endian), then 16 bytes qs; element i < 16 of a
  // block is d·((qs[i] & 15) - 8), element i + 16 is d·((qs[i] >> 4) - 8) (exact in f32). Rows
  // as kQ8_0.
  kQ4_0 = 7,
};

// Elements per block: 32 for kQ8_0 and kQ4_0, 1 for every other dtype.
int64_t block_elements(DataType dtype);
// Bytes per block: 34 for kQ8_0, 18 for kQ4_0, size_of for every other dtype.
size_t block_bytes(DataType dtype);
// Bytes of `numel` consecutive elements (rounded up to whole blocks for a block dtype).
uint64_t bytes_of(DataType dtype, uint64_t numel);
// Bytes per element; 0 for a block dtype (kQ8_0, kQ4_0), whose bytes are block_bytes per
// block_elements elements (bytes_of).
size_t size_of(DataType dtype);

// Short name: "f32", "bf16", "f16", "i32", "i64", "u8", "q8_0", "q4_0".
std::string_view name_of(DataType dtype);

// Parses a short name ("f32", ..., "q8_0", "q4_0") or a safetensors dtype string ("F32", "BF16",
// "F16", "I32", "I64", "U8"; safetensors spec, huggingface/safetensors README).
// INVALID_ARGUMENT names the unknown string.
absl::StatusOr<DataType> parse_data_type(std::string_view text);

// The safetensors dtype string of `dtype` (for kQ8_0 and kQ4_0, which safetensors lacks, ggml's
// "Q8_0" and "Q4_0").
std::string_view safetensors_name(DataType dtype);

// Scalar conversions (IEEE 754 binary16; bfloat16 = top 16 bits of binary32,
// round-to-nearest-even on the way down, NaN kept quiet).
float bf16_to_f32(uint16_t bits);
uint16_t f32_to_bf16(float value);
float f16_to_f32(uint16_t bits);
uint16_t f32_to_f16(float value);

}  // namespace simpler::task
