#pragma once

#include <cstdint>

#include "simpler/kernels/kernels.h"

namespace simpler::llm {

// The lowest index of the largest value of row[0, n) (n >= 1): NaN is never chosen, and a row
// with no value above -inf gives 0 — argmax_kernel's row and the sampling kernel's greedy pick.
// Every target gives the same index; `isa` picks the instructions (kAuto: this CPU's best; a
// target the CPU lacks falls back to the scalar loop). Thread-safe.
int64_t argmax_row(const float* row, int64_t n, KernelIsa isa);

}  // namespace simpler::llm
