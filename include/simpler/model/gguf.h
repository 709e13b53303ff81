// Reading GGUF files: the single-file checkpoint format of ggml and llama.cpp.
//
// Format (GGUF version 3, ggml's docs/gguf.md; version 2 has the same layout), little-endian:
//   magic "GGUF", u32 version, u64 tensor_count, u64 metadata_kv_count;
//   metadata_kv_count key-values: key (string), u32 value type, value;
//   tensor_count tensor infos: name (string), u32 n_dims, u64 dims[n_dims] (innermost first),
//     u32 ggml type, u64 offset (from the start of the data section, a multiple of the
//     alignment);
//   zero padding up to a multiple of the alignment (the u32 key `general.alignment`, default
//   32), then the data section, which holds every tensor's data at its offset.
// A string is a u64 byte length and that many bytes (no terminator). A value is one of u8, i8,
// u16, i16, u32, i32, u64, i64, f32, f64, bool (one byte, 0 or 1), string, or an array: u32
// element type, u64 element count, the elements.
//
// Tensor types read here, with their ggml block sizes (elements and bytes per block): F32 (1, 4),
// F16 (1, 2), BF16 (1, 2), Q4_0 (32, 18), Q8_0 (32, 34), Q4_K (256, 144), Q6_K (256, 210). Each
// gives a TensorView (the quantized ones as task::DataType::kQ8_0 / kQ4_0 / kQ4_K / kQ6_K, their
// blocks in place). Any other ggml type is refused at open.
//
// Validation at open, each failure a status whose message starts with the path:
//   DATA_LOSS          the file ends early: inside the header, a key-value, a string (a length
//                      past the end of the file), an array, a tensor info, before the data
//                      section, or inside a tensor's data
//   INVALID_ARGUMENT   not a GGUF file (magic), a version other than 2 and 3 (a big-endian file
//                      is named as such), a count larger than the bytes left could hold (tensor
//                      count, key-value count, array length), an unknown value type, a nested
//                      array, a bool that is not 0 or 1, a duplicate key, a
//                      `general.alignment` that is not a u32 power of two, a duplicate or empty
//                      tensor name, n_dims 0 or above 4, non-zero dimensions whose product (or
//                      the tensor's byte size) passes 2^63-1, an unknown ggml type, a
//                      quantized tensor whose innermost dimension is not a whole number of
//                      blocks, a misaligned offset, tensors that overlap
//   UNIMPLEMENTED      a ggml type that is known but not read here (Q5_K, IQ2_XXS, ...), naming
//                      the tensor and the type
// Nothing is allocated from a count before the count is checked against the bytes left.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "simpler/model/safetensors.h"

namespace simpler::llm {

// The alignment of the data section and of each tensor's offset when `general.alignment` is
// absent.
inline constexpr uint64_t kGgufDefaultAlignment = 32;
// Most dimensions a tensor may have (GGML_MAX_DIMS).
inline constexpr uint32_t kGgufMaxDims = 4;

// The ggml_type values (ggml/include/ggml.h) of the tensor types read here.
enum class GgmlType : uint32_t {
  kF32 = 0,
  kF16 = 1,
  kQ4_0 = 2,
  kQ8_0 = 8,
  kQ4_K = 12,
  kQ6_K = 14,
  kBF16 = 30,
};

// Block layout of a tensor type: `block_size` elements take `block_bytes` bytes, blocks run
// along the innermost dimension; `dtype` is the dtype of its TensorView (the same layout).
struct GgmlTypeTraits {
  GgmlType type;
  std::string_view name;  // ggml's name: "F32", "Q4_K", ...
  uint64_t block_size;
  uint64_t block_bytes;
  bool quantized;
  task::DataType dtype;
};

// The traits of a type read here; nullptr for any other ggml type value. Thread-safe.
const GgmlTypeTraits* ggml_type_traits(uint32_t type);
// ggml's name of any ggml type value ("Q5_K", "IQ2_XXS", ...), or "unknown ggml type N".
std::string ggml_type_name(uint32_t type);

// gguf_type of a metadata value (ggml/include/gguf.h).
enum class GgufValueType : uint32_t {
  kUint8 = 0,
  kInt8 = 1,
  kUint16 = 2,
  kInt16 = 3,
  kUint32 = 4,
  kInt32 = 5,
  kFloat32 = 6,
  kBool = 7,
  kString = 8,
  kArray = 9,
  kUint64 = 10,
  kInt64 = 11,
  kFloat64 = 12,
};

// "u32", "string", "array", ... ; "type N" for a value outside the enum.
std::string gguf_value_type_name(GgufValueType type);

// One metadata value. Borrows: the spans and string views point into the mapped file and stay
// valid while the GgufFile that produced the value is alive.
struct GgufValue {
  GgufValueType type = GgufValueType::kUint8;
  // Scalars other than strings: the value's little-endian bytes. Arrays of fixed-size
  // elements: all the elements' bytes. Empty for strings and arrays of strings.
  std::span<const std::byte> data;
  std::string_view string;  // kString
  // Arrays only: the element type, the number of elements and, for arrays of strings, each one.
  GgufValueType element_type = GgufValueType::kUint8;
  uint64_t count = 0;
  std::vector<std::string_view> strings;
};

// One tensor info, checked against the file at open.
struct GgufTensorInfo {
  std::string name;
  uint32_t type = 0;  // a ggml type with traits (ggml_type_traits is never null for it)
  // Row-major shape, outermost first: the file's dims reversed (GGUF lists the innermost, the
  // contiguous dimension, first), so a [rows, cols] matrix is dims {cols, rows} in the file.
  std::vector<int64_t> shape;
  uint64_t offset = 0;              // from the start of the data section
  std::span<const std::byte> data;  // in the mapping; bytes = numel / block_size * block_bytes
};

// One GGUF file mapped read-only (the mmap path of the safetensors reader: tensor data is never
// copied, quantized data included). Move-only; the mapping lives as long as the object and every
// view, value and info into it must not outlive it. Const methods are thread-safe (nothing
// mutates after open).
class GgufFile {
 public:
  // Maps `path` and validates the header, the key-values, the tensor infos and the tensors'
  // placement against the file size (see the errors at the top of this header). Tensor data is
  // not read. The file errors of a regular file's open (NOT_FOUND, a FIFO or directory refused).
  static absl::StatusOr<GgufFile> open(const std::string& path);

  GgufFile(GgufFile&&) noexcept;
  GgufFile& operator=(GgufFile&&) noexcept;
  ~GgufFile();

  const std::string& path() const;
  uint32_t version() const;
  uint64_t alignment() const;
  // Absolute file offset of the data section.
  uint64_t data_offset() const;

  // Keys in file order.
  const std::vector<std::string>& keys() const;
  // The value of `key`; nullptr when absent.
  const GgufValue* find(std::string_view key) const;
  // Typed reads of a key. NOT_FOUND "<path>: key 'k' not found"; INVALID_ARGUMENT
  // "<path>: key 'k' is an f32, expected a string" for another type.
  absl::StatusOr<std::string_view> get_string(std::string_view key) const;
  // Any integer type (not bool) with a value in [0, 2^63-1]; INVALID_ARGUMENT for a negative one.
  absl::StatusOr<uint64_t> get_uint(std::string_view key) const;
  // f32 or f64, widened exactly to double.
  absl::StatusOr<double> get_float(std::string_view key) const;
  // An array of strings.
  absl::StatusOr<std::span<const std::string_view>> get_string_array(std::string_view key) const;
  // An array of any integer type, each element widened to int64 (a u64 element above 2^63-1 is
  // INVALID_ARGUMENT).
  absl::StatusOr<std::vector<int64_t>> get_int_array(std::string_view key) const;

  // Tensor infos in file order.
  const std::vector<GgufTensorInfo>& tensors() const;
  // The info of `name`; nullptr when absent.
  const GgufTensorInfo* find_tensor(std::string_view name) const;
  // The view of a tensor (dtype, row-major shape, its bytes in the mapping; a quantized one's are
  // its blocks, unchanged). NOT_FOUND "tensor 'x' not found in <path>".
  absl::StatusOr<TensorView> tensor(std::string_view name) const;

 private:
  struct State;
  explicit GgufFile(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

// True when `path` names a GGUF checkpoint rather than a model directory: not a directory, and
// either a name ending in ".gguf" in any case (the file need not exist: its loader then says it
// does not) or a regular file whose first four bytes are GGUF's magic "GGUF" (ggml's
// docs/gguf.md), so a GGUF file under another name loads too. Reads at most those four bytes,
// never from a FIFO or device. Model paths (`--model`)
// go through it. Thread-safe.
bool is_gguf_path(const std::string& path);

}  // namespace simpler::llm
