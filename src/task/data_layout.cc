// The memory layout of each DataType (data_type.h): element and block sizes, and the row
// interleaving of the block dtypes (kQ4_K_R16, kQ6_K_R16, kQ8_0_R16). Apart from data_type.cc
// (names, parsing, dequantization) because it needs nothing but the C library: the kernels' aarch64
// cross-build (scripts/test_neon.sh), which links no abseil, takes it.
#include <cstring>
#include <iterator>

#include "simpler/task/data_type.h"

namespace simpler::task {

namespace {

// How a dtype lays out its elements: bytes of one element (0 for a block dtype), then elements and
// bytes of one block (1 and the element's bytes for every other dtype). One row per dtype, in the
// enum's order (checked below); the block sizes are ggml's (the formats in data_type.h).
struct Layout {
  DataType dtype;
  size_t element_bytes;
  int64_t block_elements;
  size_t block_bytes;
};

constexpr Layout kLayouts[] = {
    {DataType::kFloat32, 4, 1, 4},      {DataType::kBFloat16, 2, 1, 2},
    {DataType::kFloat16, 2, 1, 2},      {DataType::kInt32, 4, 1, 4},
    {DataType::kInt64, 8, 1, 8},        {DataType::kUInt8, 1, 1, 1},
    {DataType::kQ8_0, 0, 32, 34},       {DataType::kQ4_0, 0, 32, 18},
    {DataType::kQ4_K, 0, 256, 144},     {DataType::kQ6_K, 0, 256, 210},
    {DataType::kQ4_K_R16, 0, 256, 144}, {DataType::kQ6_K_R16, 0, 256, 210},
    {DataType::kQ8_0_R16, 0, 32, 34}};

constexpr bool rows_in_enum_order() {
  for (size_t i = 0; i < std::size(kLayouts); ++i) {
    if (static_cast<size_t>(kLayouts[i].dtype) != i) return false;
  }
  return std::size(kLayouts) == static_cast<size_t>(kLastDataType) + 1;
}
static_assert(rows_in_enum_order(), "kLayouts needs one row per DataType, in the enum's order");

// A value outside the enum (a corrupt graph image) has no bytes and blocks of one element.
constexpr Layout kUnknownLayout = {DataType::kUInt8, 0, 1, 0};

const Layout& layout_of(DataType dtype) {
  const auto i = static_cast<size_t>(dtype);
  return i < std::size(kLayouts) ? kLayouts[i] : kUnknownLayout;
}

}  // namespace

size_t size_of(DataType dtype) { return layout_of(dtype).element_bytes; }

int64_t block_elements(DataType dtype) { return layout_of(dtype).block_elements; }

size_t block_bytes(DataType dtype) { return layout_of(dtype).block_bytes; }

uint64_t bytes_of(DataType dtype, uint64_t numel) {
  const Layout& l = layout_of(dtype);
  // Every task argument's span comes here: no division for the one-element blocks.
  if (l.block_elements == 1) return numel * l.block_bytes;
  const auto per = static_cast<uint64_t>(l.block_elements);
  return (numel + per - 1) / per * l.block_bytes;
}

int64_t interleaved_rows(DataType dtype) {
  return dtype == DataType::kQ4_K_R16 || dtype == DataType::kQ6_K_R16 ||
                 dtype == DataType::kQ8_0_R16
             ? kInterleavedRows
             : 1;
}

DataType interleaved_of(DataType dtype) {
  return dtype == DataType::kQ4_K   ? DataType::kQ4_K_R16
         : dtype == DataType::kQ6_K ? DataType::kQ6_K_R16
         : dtype == DataType::kQ8_0 ? DataType::kQ8_0_R16
                                    : dtype;
}

DataType plain_of(DataType dtype) {
  return dtype == DataType::kQ4_K_R16   ? DataType::kQ4_K
         : dtype == DataType::kQ6_K_R16 ? DataType::kQ6_K
         : dtype == DataType::kQ8_0_R16 ? DataType::kQ8_0
                                        : dtype;
}

namespace {

// Copies row r of a group of 16 rows (nb blocks of `bytes` each) between the plain row and its
// place in the group (data_type.h's layout): into the group when kIntoGroup, else out of it.
// Dword v of block b (from byte `lead`: 2 for Q8_0, whose d comes first, else 0) sits at
// 64·D·b + 64·v + 4·r; the T scale bytes at 64·D·nb + 16·T·b + T·r.
template <bool kIntoGroup, class G, class P>
void copy_row(size_t bytes, size_t lead, int64_t nb, G* group, int64_t r, P* plain) {
  const size_t dwords = bytes / 4, tail = bytes % 4, rr = static_cast<size_t>(r);
  const size_t scale_at = lead == 0 ? 4 * dwords : 0;
  for (size_t b = 0; b < static_cast<size_t>(nb); ++b) {
    P* row = plain + b * bytes;
    G* chunks = group + 64 * dwords * b + 4 * rr;
    G* last =
        group + 64 * dwords * static_cast<size_t>(nb) + kInterleavedRows * tail * b + tail * rr;
    for (size_t v = 0; v < dwords; ++v) {
      if constexpr (kIntoGroup) {
        std::memcpy(chunks + 64 * v, row + lead + 4 * v, 4);
      } else {
        std::memcpy(row + lead + 4 * v, chunks + 64 * v, 4);
      }
    }
    if constexpr (kIntoGroup) {
      std::memcpy(last, row + scale_at, tail);
    } else {
      std::memcpy(row + scale_at, last, tail);
    }
  }
}

// The bytes before a block's first dword (data_type.h): Q8_0's d.
size_t lead_bytes(DataType interleaved) { return interleaved == DataType::kQ8_0_R16 ? 2 : 0; }

}  // namespace

void interleave_rows(DataType interleaved, const uint8_t* src, int64_t rows, int64_t row_elements,
                     uint8_t* dst) {
  const size_t bytes = block_bytes(interleaved);
  const int64_t nb = row_elements / block_elements(interleaved);
  const size_t row_bytes = bytes * static_cast<size_t>(nb);
  for (int64_t r = 0; r < rows; ++r) {
    copy_row<true>(bytes, lead_bytes(interleaved), nb,
                   dst + static_cast<size_t>(r / kInterleavedRows * kInterleavedRows) * row_bytes,
                   r % kInterleavedRows, src + static_cast<size_t>(r) * row_bytes);
  }
}

void deinterleave_rows(DataType interleaved, const uint8_t* src, int64_t rows, int64_t row_elements,
                       uint8_t* dst) {
  const auto row_bytes =
      static_cast<size_t>(bytes_of(interleaved, static_cast<uint64_t>(row_elements)));
  for (int64_t r = 0; r < rows; ++r) {
    deinterleave_row(interleaved, src, r, row_elements, dst + static_cast<size_t>(r) * row_bytes);
  }
}

void deinterleave_row(DataType interleaved, const uint8_t* src, int64_t row, int64_t row_elements,
                      uint8_t* dst) {
  const size_t bytes = block_bytes(interleaved);
  const int64_t nb = row_elements / block_elements(interleaved);
  const size_t row_bytes = bytes * static_cast<size_t>(nb);
  copy_row<false>(bytes, lead_bytes(interleaved), nb,
                  src + static_cast<size_t>(row / kInterleavedRows * kInterleavedRows) * row_bytes,
                  row % kInterleavedRows, dst);
}

}  // namespace simpler::task
