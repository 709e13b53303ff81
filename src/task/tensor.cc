#include "simpler/task/tensor.h"

#include <algorithm>
#include <limits>

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
  // A shape with a 0 dimension holds no element whatever the others are: its strides are capped
  // instead of refused.
  const bool empty = std::find(shape, shape + rank, 0) != shape + rank;
  int64_t stride = 1;
  for (int i = rank - 1; i >= 0; --i) {
    if (shape[i] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor dimension ", i, " is negative (", shape[i], ")"));
    }
    t.shape[i] = shape[i];
    t.strides[i] = stride;
    const bool over =
        __builtin_mul_overflow(stride, shape[i], &stride) || stride > kMaxTensorElements;
    if (over && empty) {
      stride = kMaxTensorElements;
    } else if (over) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor shape [", absl::StrJoin(shape, shape + rank, ", "),
                       "] holds more than 2^48 elements (no memory holds it)"));
    }
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
  // In 128 bits: a view built by hand may hold any shape (saturated, never wrapped).
  __int128 n = 1;
  for (int i = 0; i < rank; ++i) {
    if (shape[i] <= 0) return 0;
    n = std::min<__int128>(n * shape[i], std::numeric_limits<int64_t>::max());
  }
  return static_cast<int64_t>(n);
}

uint64_t Tensor::span_bytes() const {
  // In 128 bits, as numel(): a span past 2^58 elements saturates to UINT64_MAX, which no memory
  // holds, so the range checks refuse it.
  // Each term is below 2^127 / 4 in magnitude and the sum is clamped to 2^125 after each, so the
  // sum of a hand-built view's six terms cannot overflow either.
  constexpr __int128 kCap = __int128{1} << 58;
  constexpr __int128 kBound = __int128{1} << 125;
  for (int i = 0; i < rank; ++i) {
    if (shape[i] == 0) return 0;  // no element (numel() == 0)
  }
  __int128 last = 0;
  for (int i = 0; i < rank; ++i) {
    last += (static_cast<__int128>(shape[i]) - 1) * strides[i];
    last = std::clamp(last, -kBound, kBound);
  }
  if (last < 0) last = 0;
  if (last >= kCap) return std::numeric_limits<uint64_t>::max();
  return bytes_of(dtype, static_cast<uint64_t>(last + 1));
}

bool Tensor::is_contiguous() const {
  __int128 stride = 1;  // 128 bits, saturated: a hand-built shape's product may pass int64
  for (int i = rank - 1; i >= 0; --i) {
    if (shape[i] != 1 && strides[i] != stride) return false;
    constexpr __int128 kBound = __int128{1} << 63;  // past any int64 stride; no product overflows
    stride = std::clamp<__int128>(stride * shape[i], -kBound, kBound);
  }
  return true;
}

std::string Tensor::debug_string() const {
  std::vector<int64_t> s(shape.begin(), shape.begin() + rank);
  return absl::StrCat(std::string(name_of(dtype)), "[", absl::StrJoin(s, ","), "]@0x",
                      absl::Hex(address), memory == MemoryKind::kHost ? " (host)" : "");
}

}  // namespace simpler::task
