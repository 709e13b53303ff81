// Shared helpers of the llm kernel tests: kernels called directly on host
// memory (on the sim device an address is a host pointer).
#pragma once

#include <cstdint>
#include <initializer_list>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "kernels/task_names.h"
#include "simpler/kernels/kernels.h"
#include "simpler/task/callable.h"
#include "simpler/task/task_args.h"
#include "simpler/task/tensor.h"

namespace simpler::llm::testing {

// A contiguous device tensor over `data` (f32, u8 or i32 by element type).
template <typename T>
task::Tensor view(std::vector<T>& data, std::initializer_list<int64_t> shape) {
  task::DataType dtype = task::DataType::kInt32;
  if constexpr (std::is_same_v<T, float>) dtype = task::DataType::kFloat32;
  if constexpr (std::is_same_v<T, uint8_t>) dtype = task::DataType::kUInt8;
  return task::Tensor::contiguous(reinterpret_cast<uintptr_t>(data.data()), shape, dtype).value();
}

// Runs every block of a task, last block first (blocks may run in any
// order); the first block error is returned.
inline absl::Status run_blocks(task::KernelFn fn, const task::TaskArgs& args, int32_t block_dim) {
  for (int32_t b = block_dim - 1; b >= 0; --b) {
    task::KernelContext ctx;
    ctx.args = args.args().data();
    ctx.num_args = static_cast<uint32_t>(args.size());
    ctx.block_idx = b;
    ctx.block_dim = block_dim;
    absl::Status s = fn(ctx);
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

// Runs every block of a task with block_dim shared lines (task::KernelContext::task_lines, zeroed
// here), as a device does: one after another, last block first (the last then claims every
// row, its own and the others'), or with `threads` each block on its own thread at once. The
// first block error is returned; `words` (optional) gets the lines' words after the blocks ran.
inline absl::Status run_blocks_sharing_lines(task::KernelFn fn, const task::TaskArgs& args,
                                             int32_t block_dim, bool threads,
                                             std::vector<uint64_t>* words = nullptr) {
  std::vector<task::TaskLine> lines(static_cast<size_t>(block_dim));
  std::vector<absl::Status> status(static_cast<size_t>(block_dim));
  auto block = [&](int32_t b) {
    task::KernelContext ctx;
    ctx.args = args.args().data();
    ctx.num_args = static_cast<uint32_t>(args.size());
    ctx.block_idx = b;
    ctx.block_dim = block_dim;
    ctx.task_lines = lines.data();
    status[static_cast<size_t>(b)] = fn(ctx);
  };
  if (threads) {
    std::vector<std::thread> running;
    for (int32_t b = 0; b < block_dim; ++b) running.emplace_back(block, b);
    for (std::thread& t : running) t.join();
  } else {
    for (int32_t b = block_dim - 1; b >= 0; --b) block(b);
  }
  if (words != nullptr) {
    words->clear();
    for (const task::TaskLine& l : lines) words->push_back(l.word.load());
  }
  for (const absl::Status& s : status) {
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

// The matmul kernel (matmul_acc with `acc`) of every ISA path this CPU runs, at `precision`.
inline std::vector<std::pair<KernelIsa, task::KernelFn>> matmul_paths(Precision precision,
                                                                      bool acc) {
  std::vector<std::pair<KernelIsa, task::KernelFn>> paths;
  for (KernelIsa isa :
       {KernelIsa::kPortable, KernelIsa::kX86_64V3, KernelIsa::kAvx512, KernelIsa::kNeon}) {
    if (!kernel_isa_available(isa)) continue;
    const auto kernels = llm_kernels(isa, precision);
    paths.emplace_back(
        isa, kernels[static_cast<size_t>(acc ? KernelId::kMatmulAcc : KernelId::kMatmul)].fn);
  }
  return paths;
}

}  // namespace simpler::llm::testing
