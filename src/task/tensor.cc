#include "simpler/task/tensor.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace simpler::task {

absl::StatusOr<Tensor> Tensor::contiguous(uint64_t address, std::initializer_list<int64_t> shape,
                                          DataType dtype, MemoryKind memory) {
  return contiguous(address, shape.begin(), static_cast<int32_t>(shape.size()), dtype, memory);
}

absl::StatusOr<Tensor> Tensor::contiguous(uint64_t address, const int64_t* shape, int32_t rank,
                                          DataType dtype, MemoryKind memory) {
  if (rank < 0 || rank > kMaxRank) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor rank ", rank, " outside [0, ", kMaxRank, "]"));
  }
  Tensor t;
  t.address = address;
  t.rank = rank;
  t.dtype = dtype;
  t.memory = memory;
  int64_t stride = 1;
  for (int i = rank - 1; i >= 0; --i) {
    if (shape[i] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor dimension ", i, " is negative (", shape[i], ")"));
    }
    t.shape[i] = shape[i];
    t.strides[i] = stride;
    stride *= shape[i];
  }
  return t;
}

absl::StatusOr<Tensor> Tensor::in_buffer(uint64_t buffer_address, uint64_t buffer_bytes,
                                         uint64_t offset, const int64_t* shape, int32_t rank,
                                         DataType dtype, MemoryKind memory) {
  absl::StatusOr<Tensor> t = contiguous(buffer_address + offset, shape, rank, dtype, memory);
  if (!t.ok()) return t;
  if (offset > buffer_bytes || t->span_bytes() > buffer_bytes - offset) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor ", t->debug_string(), " of ", t->span_bytes(), " bytes at offset ",
                     offset, " exceeds the ", buffer_bytes, "-byte ",
                     memory == MemoryKind::kHost ? "host" : "device", " buffer"));
  }
  return t;
}

int64_t Tensor::numel() const {
  int64_t n = 1;
  for (int i = 0; i < rank; ++i) n *= shape[i];
  return n;
}

uint64_t Tensor::span_bytes() const {
  int64_t last = 0;
  for (int i = 0; i < rank; ++i) {
    if (shape[i] == 0) return 0;  // no element (numel() == 0)
    last += (shape[i] - 1) * strides[i];
  }
  return bytes_of(dtype, static_cast<uint64_t>(last + 1));
}

bool Tensor::is_contiguous() const {
  int64_t stride = 1;
  for (int i = rank - 1; i >= 0; --i) {
    if (shape[i] != 1 && strides[i] != stride) return false;
    stride *= shape[i];
  }
  return true;
}

std::string Tensor::debug_string() const {
  std::vector<int64_t> s(shape.begin(), shape.begin() + rank);
  return absl::StrCat(std::string(name_of(dtype)), "[", absl::StrJoin(s, ","), "]@0x",
                      absl::Hex(address), memory == MemoryKind::kHost ? " (host)" : "");
}

}  // namespace simpler::task
