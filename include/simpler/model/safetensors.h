// Reading and writing safetensors files, and the weights of a Hugging Face model directory.
//
// Format (safetensors spec, huggingface/safetensors README): an 8-byte little-endian
// unsigned header length N, then N bytes of UTF-8 JSON
//   {"<name>": {"dtype": "BF16", "shape": [d0, d1, ...], "data_offsets": [begin, end]}, ...,
//    "__metadata__": {"<key>": "<string value>", ...}}       // "__metadata__" optional
// (the JSON may be padded with trailing spaces), then the byte buffer. Offsets are relative to
// the start of the byte buffer; the tensors cover the buffer exactly, without holes or overlap;
// each tensor's data is row-major, little-endian, numel * dtype-size bytes.
//
// Supported dtypes: F32, BF16, F16, I32, I64, U8 (task::DataType). Any other dtype string is
// refused when the file is opened.
//
// Error codes (every message names the file, and the tensor when there is one):
//   NOT_FOUND          a file, shard or tensor that does not exist
//   DATA_LOSS          the file is shorter than its header says (truncated): fewer than 8
//                      bytes, header length beyond the end of the file, or tensor data beyond it
//   INVALID_ARGUMENT   the header is not a valid safetensors header (malformed JSON, JSON
//                      nested deeper than 64 levels, anything but spaces after the JSON value,
//                      a tensor named twice, unknown dtype, bad shape, bad/overlapping/holey
//                      data_offsets, size that does not match shape and dtype, trailing bytes,
//                      header length above 100 MB), a path that is not a regular file (a FIFO
//                      is refused without blocking), or a
//                      lookup whose shape or dtype differs from what the caller expects, or a
//                      conversion of a non-float tensor
//   PERMISSION_DENIED / INTERNAL   the operating system refused to open, map or write a file
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "simpler/task/data_type.h"

namespace simpler::llm {

// Largest header accepted by the reader (the limit of the reference implementation).
inline constexpr uint64_t kSafetensorsMaxHeaderBytes = 100'000'000;

class MappedFile;  // the readers' mapped file (private)

// A read-only view of one tensor inside a mapped file. It borrows: `name`, `file`, `bytes` and
// `mapping` stay valid while the SafetensorsFile (or ModelWeights, GgufFile) that produced it is
// alive. `bytes.data()` has no alignment guarantee beyond 1; read through memcpy or to_f32, or
// copy ranges of it with read_bytes.
struct TensorView {
  std::string_view name;  // tensor name in the file
  std::string_view file;  // path of the file holding the tensor
  task::DataType dtype = task::DataType::kFloat32;
  std::vector<int64_t> shape;
  std::span<const std::byte> bytes;
  // The mapped file `bytes` lie in (set by the readers; read_bytes reads through it); nullptr
  // for a view over other memory.
  const MappedFile* mapping = nullptr;

  // Product of the dimensions (1 for a scalar, shape []).
  int64_t numel() const;
};

class GgufFile;  // gguf.h

// "[64,128]".
std::string shape_to_string(std::span<const int64_t> shape);

// One safetensors file mapped read-only. Move-only; the mapping lives as long as the object
// (and views into it must not outlive it). Const methods are thread-safe (nothing mutates after
// open).
class SafetensorsFile {
 public:
  // Maps `path` and validates the whole header against the file size (see the error codes at
  // the top of this header). The tensor data itself is not read.
  static absl::StatusOr<SafetensorsFile> open(const std::string& path);

  SafetensorsFile(SafetensorsFile&&) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&&) noexcept;
  ~SafetensorsFile();

  const std::string& path() const;
  // Tensor names, sorted.
  std::vector<std::string> names() const;
  size_t size() const;
  bool contains(std::string_view name) const;
  // The view of `name`; NOT_FOUND "tensor 'x' not found in <path>".
  absl::StatusOr<TensorView> tensor(std::string_view name) const;
  // The "__metadata__" map (empty when absent).
  const std::map<std::string, std::string>& metadata() const;

 private:
  struct State;
  explicit SafetensorsFile(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

// The weights of a model directory: a single `model.safetensors`, or the shards listed by
// `model.safetensors.index.json` ({"metadata": {...}, "weight_map": {name: shard file}}; the
// index wins when both exist). Every file is opened and validated by `open`; every tensor the
// weight_map lists must exist in its shard, be listed once, and every tensor of a shard must be
// listed in the weight_map as held by that shard. Move-only; const methods are thread-safe.
//
// A GGUF file (a path `is_gguf_path` accepts, see gguf.h) instead of a directory: every tensor is
// named by the model's name (gguf.h's mapping of llama.cpp's names: token_embd.weight is
// model.embed_tokens.weight, blk.N.attn_q.weight is model.layers.N.self_attn.q_proj.weight, ...;
// a tensor without a model name keeps its GGUF name) with its row-major shape, in its file type
// F32, F16, BF16, Q8_0, Q4_0, Q4_K or Q6_K (its blocks, task::DataType::kQ8_0 / kQ4_0 / kQ4_K /
// kQ6_K) and borrowed from the mapping like a safetensors tensor; the errors of GgufFile::open.
class ModelWeights {
 public:
  // Errors: NOT_FOUND when the directory holds neither file, or a listed shard is missing
  // ("shard model-00002-of-00002.safetensors (holding model.norm.weight) listed in
  // <dir>/model.safetensors.index.json: ... not found"); INVALID_ARGUMENT for a malformed index
  // or a tensor the index maps to a shard that lacks it; the file errors of SafetensorsFile::open.
  static absl::StatusOr<ModelWeights> open(const std::string& dir);
  // The weights of a GGUF file already opened (its metadata parsed once for the config and the
  // weights: ModelConfig::from_gguf of the same file); dir() is the file's path. Errors: those
  // open gives for a GGUF file after GgufFile::open.
  static absl::StatusOr<ModelWeights> from_gguf(GgufFile file);

  ModelWeights(ModelWeights&&) noexcept;
  ModelWeights& operator=(ModelWeights&&) noexcept;
  ~ModelWeights();

  const std::string& dir() const;
  // OK when every tensor of the checkpoint is in `expected` (or `allow_unused`); otherwise
  // INVALID_ARGUMENT naming the first other tensor and its file: "tensor 'model.layers.1.
  // input_layernorm.weight' in <dir> (model.safetensors) is not used by <config_summary>; ...".
  absl::Status check_tensor_set(const std::set<std::string, std::less<>>& expected,
                                std::string_view config_summary, bool allow_unused) const;
  // Every tensor name, sorted.
  std::vector<std::string> names() const;
  bool contains(std::string_view name) const;
  // The number of safetensors files (1 when not sharded, 1 for a GGUF file).
  size_t num_files() const;
  // True when the weights come from a GGUF file.
  bool is_gguf() const;
  // The GGUF file the weights come from (its metadata, e.g. for ModelConfig::from_gguf); nullptr
  // for safetensors. Lives as long as this object.
  const GgufFile* gguf() const;
  // How many tensors the checkpoint holds of each dtype, by short name (task::name_of: "f32",
  // "bf16", "f16", "q8_0", ...), as stored in the file: the type mix `bench load` and
  // /v1/models report.
  std::map<std::string, int64_t> dtype_counts() const;

  // The view of `name`. NOT_FOUND "tensor 'x' not found in <dir> (model.safetensors)".
  absl::StatusOr<TensorView> get(std::string_view name) const;
  // The view of `name`, checked: INVALID_ARGUMENT when the shape differs
  // ("model.layers.3.self_attn.q_proj.weight in model-00002-of-00002.safetensors: shape [64,128],
  // expected [128,128]") or the dtype is not one of `allowed` (default: the dtypes the model's
  // kernels take, F32, BF16, F16 and, from a GGUF file, Q8_0, Q4_0, Q4_K and Q6_K; empty = any
  // dtype).
  absl::StatusOr<TensorView> get(std::string_view name, const std::vector<int64_t>& expected_shape,
                                 const std::vector<task::DataType>& allowed = {
                                     task::DataType::kFloat32, task::DataType::kBFloat16,
                                     task::DataType::kFloat16, task::DataType::kQ8_0,
                                     task::DataType::kQ4_0, task::DataType::kQ4_K,
                                     task::DataType::kQ6_K}) const;

 private:
  struct State;
  explicit ModelWeights(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

// Converts a BF16/F16/F32 view to f32 values, or dequantizes a Q8_0 or Q4_0 one (d·q per element;
// exact for all five). INVALID_ARGUMENT for any other dtype, a quantized view that is not whole
// blocks of 32,
// or when `out.size() != view.numel()`. Thread-safe.
absl::Status to_f32(const TensorView& view, std::span<float> out);
absl::StatusOr<std::vector<float>> to_f32(const TensorView& view);

// Copies bytes [at, at + out.size()) of `view` to `out`. A view from a reader (`mapping` set)
// is read from its file with pread, never through the mapping: no page of the mapping is faulted
// in or becomes resident (a loader copying a checkpoint into device memory reads it this way
// through a small reused buffer: on a VM, where every page-table update is costly, several times
// faster than copying from the mapping). Other views are copied from `bytes`. INVALID_ARGUMENT
// when the range is not inside the view; the file's read errors (naming it: the OS error, or
// DATA_LOSS when it shrank after it was opened). Thread-safe.
absl::Status read_bytes(const TensorView& view, uint64_t at, std::span<std::byte> out);

// Drops the whole memory pages inside `view` from this process's resident set
// (madvise MADV_DONTNEED on the read-only private file mapping): a loader that has copied a
// tensor elsewhere calls it so that the checkpoint is not resident twice. The pages stay in the
// page cache, and the view stays valid (a later read maps them in again). Thread-safe.
void release_pages(const TensorView& view);

// One tensor for write_safetensors. Give either `bytes` (borrowed; exactly numel * dtype-size
// bytes, row-major little-endian) or `produce`, which is called with consecutive chunks of the
// tensor's bytes in order (each chunk at most a few MB) and fills them; its error aborts the
// write and is returned.
struct TensorSource {
  std::string name;
  task::DataType dtype = task::DataType::kFloat32;
  std::vector<int64_t> shape;
  std::span<const std::byte> bytes;
  std::function<absl::Status(std::span<std::byte> chunk)> produce;
};

// Writes a safetensors file: header (JSON, padded with spaces to a multiple of 8 bytes so the
// byte buffer starts 8-aligned), then the tensors' data in the order given, streamed through a
// small buffer (the whole file is never held in memory). The file is written to `path`.tmp and
// renamed to `path` on success, so a failed write never leaves a partial `path`.
// INVALID_ARGUMENT for an empty or duplicate name, the name "__metadata__", a negative dimension,
// `bytes` of the wrong size, or neither/both of `bytes` and `produce`; the OS error (naming the
// path) when the file cannot be written. Thread-compatible (distinct paths may be written
// concurrently).
absl::Status write_safetensors(const std::string& path, std::span<const TensorSource> tensors,
                               const std::map<std::string, std::string>& metadata = {});

}  // namespace simpler::llm
