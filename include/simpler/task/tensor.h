// Tensor: a typed, strided view of memory on the host or the device.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <type_traits>

#include "absl/status/statusor.h"
#include "simpler/task/data_type.h"

namespace simpler::task {

// Where a tensor's bytes live. HOST tensors are staged into run-owned device
// buffers before a run and copied back after it (OUT / INOUT only); HOST tensors of
// one run whose byte ranges overlap share one buffer, so their tasks are ordered by
// the overlap as DEVICE tensors' are.
enum class MemoryKind : uint8_t { kDevice = 0, kHost = 1 };

inline constexpr int kMaxRank = 6;
// The most elements a view built by `contiguous` or `in_buffer` may hold: 2^48, above any memory
// (x86-64 and AArch64 address 2^47 / 2^48 bytes), so its strides and spans cannot overflow.
inline constexpr int64_t kMaxTensorElements = int64_t{1} << 48;

// A view: `address` is the byte address of element [0, ..., 0] (a device
// address for kDevice, a host pointer for kHost); `shape` and `strides` are in
// elements (row-major when built by `contiguous`). Plain, trivially copyable;
// it is written as is into graph images. Does not own memory.
struct Tensor {
  uint64_t address = 0;
  int32_t rank = 0;
  DataType dtype = DataType::kFloat32;
  MemoryKind memory = MemoryKind::kDevice;
  std::array<int64_t, kMaxRank> shape{};
  std::array<int64_t, kMaxRank> strides{};

  // Row-major contiguous view. Rank above kMaxRank, a negative dimension, or a shape of
  // more than kMaxTensorElements elements is INVALID_ARGUMENT (a shape with a 0 dimension holds
  // none, whatever the others: its strides are capped at kMaxTensorElements).
  static absl::StatusOr<Tensor> contiguous(uint64_t address, std::initializer_list<int64_t> shape,
                                           DataType dtype, MemoryKind memory = MemoryKind::kDevice);
  static absl::StatusOr<Tensor> contiguous(uint64_t address, const int64_t* shape, int32_t rank,
                                           DataType dtype, MemoryKind memory = MemoryKind::kDevice);
  // Row-major contiguous view of `memory` kind at `offset` bytes into the buffer
  // [buffer_address, buffer_address + buffer_bytes). INVALID_ARGUMENT for what `contiguous`
  // refuses, and when the view does not fit the buffer ("tensor f32[16]@0x1010 of 64 bytes at
  // offset 16 exceeds the 64-byte device buffer"; "host buffer" for kHost).
  static absl::StatusOr<Tensor> in_buffer(uint64_t buffer_address, uint64_t buffer_bytes,
                                          uint64_t offset, const int64_t* shape, int32_t rank,
                                          DataType dtype, MemoryKind memory);

  // Elements (0 when a dimension is 0 or negative; saturates at INT64_MAX for a view built by
  // hand whose product overflows).
  int64_t numel() const;
  // Bytes from `address` to one past the last addressed element (0 when empty).
  // The tensor's address range is [address, address + span_bytes()). A view built by hand whose
  // last element lies 2^58 or more elements past `address` gives UINT64_MAX (no memory holds
  // it: every range check refuses it).
  uint64_t span_bytes() const;
  bool is_contiguous() const;
  template <typename T>
  T* data() const {
    return reinterpret_cast<T*>(static_cast<uintptr_t>(address));
  }
  std::string debug_string() const;
};
static_assert(std::is_trivially_copyable_v<Tensor>);
static_assert(std::is_standard_layout_v<Tensor>);

}  // namespace simpler::task
