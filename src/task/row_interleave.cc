// Row interleaving of the K-quant dtypes (data_type.h: kQ4_K_R16, kQ6_K_R16). Apart from
// data_type.cc so that the kernels' aarch64 cross-build (scripts/test_neon.sh), which links no
// abseil, can take it: it needs nothing but the C library.
#include <cstring>

#include "simpler/task/data_type.h"

namespace simpler::task {

namespace {

// Super-block bytes of the two interleaved dtypes (block_bytes, without its table).
size_t super_block_bytes(DataType interleaved) {
  return interleaved == DataType::kQ4_K_R16 ? 144 : 210;
}

}  // namespace

int64_t interleaved_rows(DataType dtype) {
  return dtype == DataType::kQ4_K_R16 || dtype == DataType::kQ6_K_R16 ? 16 : 1;
}

DataType interleaved_of(DataType dtype) {
  return dtype == DataType::kQ4_K   ? DataType::kQ4_K_R16
         : dtype == DataType::kQ6_K ? DataType::kQ6_K_R16
                                    : dtype;
}

DataType plain_of(DataType dtype) {
  return dtype == DataType::kQ4_K_R16   ? DataType::kQ4_K
         : dtype == DataType::kQ6_K_R16 ? DataType::kQ6_K
                                        : dtype;
}

namespace {

// Copies row r of a group of 16 rows (nb super-blocks of `bytes` each) between the plain row and
// its place in the group (data_type.h's layout): into the group when kIntoGroup, else out of it.
// Dword v of super-block b sits at 64·D·b + 64·v + 4·r; its last T bytes at 64·D·nb + 16·T·b + T·r.
template <bool kIntoGroup, class G, class P>
void copy_row(size_t bytes, int64_t nb, G* group, int64_t r, P* plain) {
  const size_t dwords = bytes / 4, tail = bytes % 4, rr = static_cast<size_t>(r);
  for (size_t b = 0; b < static_cast<size_t>(nb); ++b) {
    P* row = plain + b * bytes;
    G* chunks = group + 64 * dwords * b + 4 * rr;
    G* last = group + 64 * dwords * static_cast<size_t>(nb) + 16 * tail * b + tail * rr;
    for (size_t v = 0; v < dwords; ++v) {
      if constexpr (kIntoGroup) {
        std::memcpy(chunks + 64 * v, row + 4 * v, 4);
      } else {
        std::memcpy(row + 4 * v, chunks + 64 * v, 4);
      }
    }
    if constexpr (kIntoGroup) {
      std::memcpy(last, row + 4 * dwords, tail);
    } else {
      std::memcpy(row + 4 * dwords, last, tail);
    }
  }
}

}  // namespace

void interleave_rows(DataType interleaved, const uint8_t* src, int64_t rows, int64_t row_elements,
                     uint8_t* dst) {
  const size_t bytes = super_block_bytes(interleaved);
  const int64_t nb = row_elements / 256;
  const size_t row_bytes = bytes * static_cast<size_t>(nb);
  for (int64_t r = 0; r < rows; ++r) {
    copy_row<true>(bytes, nb, dst + static_cast<size_t>(r / 16) * 16 * row_bytes, r % 16,
                   src + static_cast<size_t>(r) * row_bytes);
  }
}

void deinterleave_rows(DataType interleaved, const uint8_t* src, int64_t rows, int64_t row_elements,
                       uint8_t* dst) {
  const size_t row_bytes = super_block_bytes(interleaved) * static_cast<size_t>(row_elements / 256);
  for (int64_t r = 0; r < rows; ++r) {
    deinterleave_row(interleaved, src, r, row_elements, dst + static_cast<size_t>(r) * row_bytes);
  }
}

void deinterleave_row(DataType interleaved, const uint8_t* src, int64_t row, int64_t row_elements,
                      uint8_t* dst) {
  const size_t bytes = super_block_bytes(interleaved);
  const int64_t nb = row_elements / 256;
  const size_t row_bytes = bytes * static_cast<size_t>(nb);
  copy_row<false>(bytes, nb, src + static_cast<size_t>(row / 16) * 16 * row_bytes, row % 16, dst);
}

}  // namespace simpler::task
