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
  // ggml's block_q4_K (ggml-common.h): super-blocks of 256 consecutive elements along the
  // innermost dimension, each 144 bytes: d and dmin (IEEE binary16, little-endian), 12 bytes of
  // eight packed 6-bit scales and mins (ggml's get_scale_min_k4: sub-block j < 4 takes
  // scales[j] & 63 and scales[j + 4] & 63; j >= 4 takes (scales[j + 4] & 15) | (scales[j - 4] >> 6)
  // << 4 and (scales[j + 4] >> 4) | (scales[j] >> 6) << 4), then 128 bytes qs. Element 64c + l
  // (l < 32) is the low nibble of qs[32c + l], element 64c + 32 + l its high nibble; element i of
  // sub-block j = i / 32 is (d·sc_j)·q - dmin·m_j, both products exact in f32, the difference
  // rounded once. A tensor of it is [..., n] with n a multiple of 256.
  kQ4_K = 8,
  // ggml's block_q6_K: super-blocks of 256 elements in 210 bytes: ql[128] (low 4 bits), qh[64]
  // (high 2 bits), 16 int8 scales, then d (binary16). In half h (128 elements) element
  // 128h + 32c + l (c < 4, l < 32) has low bits from ql[64h + 32(c & 1) + l] (low nibble for c < 2,
  // high for c >= 2) and high bits (qh[32h + l] >> 2c) & 3; q is those 6 bits less 32, and the
  // element is d·scales[8h + 2c + l / 16]·q, exact in f32. Rows as kQ4_K.
  kQ6_K = 9,
  // kQ4_K, kQ6_K and kQ8_0 with their rows interleaved 16 at a time, so that a kernel reads 16
  // rows' blocks as vectors whose lane r is row r (docs/design/quantized_matmul.md,
  // "Row-interleaved weights"). Loaders never read them from a file: the model runner writes them
  // into device memory (interleave_rows) for the kernel targets that read them fastest. A tensor
  // of it is [m, n], m a multiple of 16 and n of the plain block's elements (256; 32 for Q8_0):
  // m / 16 groups of 16 consecutive rows, each group the 16 rows' bytes (so bytes_of is the plain
  // dtype's). In a group, with B the plain block's bytes (144, 210, 34), D = B / 4 (36, 52, 8),
  // T = B mod 4 (0, 2, 2) and nb the blocks of a row: a block's T scale bytes are set apart (Q6_K's
  // d, its last 2 bytes; Q8_0's d, its first 2) and the rest, bytes [o, o + 4·D) with o = 0 (2
  // for Q8_0), is D dwords: block column b's 16 blocks are D chunks of 64 bytes at 64·D·b, chunk
  // v holding dword v of row r's block b at [4r, 4r + 4); after the nb·D chunks, the scale bytes,
  // column b's at 64·D·nb + 16·T·b, row r's at + T·r. Element values are the plain dtype's.
  kQ4_K_R16 = 10,
  kQ6_K_R16 = 11,
  kQ8_0_R16 = 12,
};
// The highest DataType value (task arguments and graph images refuse any above it).
inline constexpr DataType kLastDataType = DataType::kQ8_0_R16;

// Elements per block: 32 for kQ8_0 and kQ4_0, 256 for kQ4_K and kQ6_K (and their interleaved
// forms), 1 for every other dtype.
int64_t block_elements(DataType dtype);
// Bytes per block: 34 for kQ8_0 (and kQ8_0_R16), 18 for kQ4_0, 144 for kQ4_K (and kQ4_K_R16), 210
// for kQ6_K (and kQ6_K_R16), size_of for every other dtype.
size_t block_bytes(DataType dtype);
// Bytes of `numel` consecutive elements (rounded up to whole blocks for a block dtype).
uint64_t bytes_of(DataType dtype, uint64_t numel);
// Bytes per element; 0 for a block dtype (kQ8_0, kQ4_0, kQ4_K, kQ6_K and the interleaved forms),
// whose bytes are block_bytes per block_elements elements (bytes_of).
size_t size_of(DataType dtype);

// Short name: "f32", "bf16", "f16", "i32", "i64", "u8", "q8_0", "q4_0", "q4_k", "q6_k",
// "q4_k_r16", "q6_k_r16", "q8_0_r16".
std::string_view name_of(DataType dtype);

// Parses a short name ("f32", ..., "q4_k", "q6_k", "q4_k_r16", "q6_k_r16", "q8_0_r16") or a
// safetensors dtype string ("F32", "BF16", "F16", "I32", "I64", "U8"; safetensors spec,
// huggingface/safetensors README). INVALID_ARGUMENT names the unknown string.
absl::StatusOr<DataType> parse_data_type(std::string_view text);

// The safetensors dtype string of `dtype` (for the block dtypes, which safetensors lacks, ggml's
// "Q8_0", "Q4_0", "Q4_K" and "Q6_K", and ours for their interleaved forms, "Q4_K_R16",
// "Q6_K_R16" and "Q8_0_R16", which no file holds).
std::string_view safetensors_name(DataType dtype);

// The `numel` elements (a multiple of block_elements(dtype)) of a block dtype stored at `src`
// (numel / block_elements whole blocks) as f32, by the formulas above, into out[0, numel). The
// same values, bit for bit, as the matmul kernels' dequantization in registers. A dtype with
// block_elements 1, or an interleaved one (whose consecutive bytes are not one row's blocks:
// deinterleave_rows first), writes nothing.
void dequantize_blocks(DataType dtype, const uint8_t* src, int64_t numel, float* out);

// Row interleaving (kQ4_K_R16, kQ6_K_R16, kQ8_0_R16 above).
// The rows of one group of an interleaved dtype.
inline constexpr int64_t kInterleavedRows = 16;
// Rows interleaved together: kInterleavedRows for kQ4_K_R16, kQ6_K_R16 and kQ8_0_R16, 1 for every
// other dtype.
int64_t interleaved_rows(DataType dtype);
// The interleaved form of a plain dtype: kQ4_K_R16 for kQ4_K, kQ6_K_R16 for kQ6_K, kQ8_0_R16 for
// kQ8_0, `dtype` itself for every other (which has none).
DataType interleaved_of(DataType dtype);
// The plain form of an interleaved dtype (kQ4_K for kQ4_K_R16, kQ6_K for kQ6_K_R16, kQ8_0 for
// kQ8_0_R16), `dtype` itself for every other.
DataType plain_of(DataType dtype);
// `rows` rows (a multiple of interleaved_rows(interleaved)) of `row_elements` elements (a multiple
// of block_elements(interleaved)) each: from the plain layout at `src` into the layout of
// `interleaved` (kQ4_K_R16, kQ6_K_R16 or kQ8_0_R16) at `dst`, and back. Both spans are
// bytes_of(interleaved, rows·row_elements) bytes and must not overlap. Preconditions (unchecked):
// the counts as said, `interleaved` one of the three.
void interleave_rows(DataType interleaved, const uint8_t* src, int64_t rows, int64_t row_elements,
                     uint8_t* dst);
void deinterleave_rows(DataType interleaved, const uint8_t* src, int64_t rows, int64_t row_elements,
                       uint8_t* dst);
// Row `row` of the interleaved tensor at `src` (rows of `row_elements` elements) in the plain
// layout, into dst[bytes_of(plain_of(interleaved), row_elements)]. Reads the row's whole group of
// 16 rows: precondition (unchecked) that the tensor holds it, i.e. a row count that is a multiple
// of 16 (the embedding kernel refuses a table of another).
void deinterleave_row(DataType interleaved, const uint8_t* src, int64_t row, int64_t row_elements,
                      uint8_t* dst);

// Scalar conversions (IEEE 754 binary16; bfloat16 = top 16 bits of binary32,
// round-to-nearest-even on the way down, NaN kept quiet).
float bf16_to_f32(uint16_t bits);
uint16_t f32_to_bf16(float value);
float f16_to_f32(uint16_t bits);
uint16_t f32_to_f16(float value);

}  // namespace simpler::task
