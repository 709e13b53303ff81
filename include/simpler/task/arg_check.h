// One checker for argument lists: a kernel's (`KernelContext`) and a run's (`TaskArgs`).
#pragma once

#include <cstdint>
#include <initializer_list>
#include <span>
#include <string>
#include <string_view>
#include <utility>

#include "absl/status/status.h"
#include "simpler/task/callable.h"
#include "simpler/task/data_type.h"
#include "simpler/task/task_args.h"
#include "simpler/task/tensor.h"

namespace simpler::task {

// True when `t` is contiguous, of `dtype`, of rank dims.size(), and every dim
// of `dims` that is not -1 equals t's.
bool tensor_matches(const Tensor& t, DataType dtype, std::span<const int64_t> dims);
inline bool tensor_matches(const Tensor& t, DataType dtype, std::initializer_list<int64_t> dims) {
  return tensor_matches(t, dtype, std::span<const int64_t>(dims.begin(), dims.size()));
}

// "[3,*]" for {3, -1}: a wanted shape, -1 dims written as "*".
std::string dims_string(std::span<const int64_t> dims);

// "f32[4,3]", or "f32[4,3] (strided)" when `t` is not contiguous.
std::string tensor_string(const Tensor& t);

// Checks an argument list against its callee's signature and names what is
// wrong. Every check returns OK or INVALID_ARGUMENT with the message
//   <prefix>argument <i> (<name>) must be ...
// for example "matmul: argument 1 (W) must be a contiguous f32[*,3], got f32[4,3]"
// (prefix "matmul: ") or "qwen3 decode run argument 6 (out_ids) must be tagged OUT
// or INOUT, got IN" (prefix "qwen3 decode run "). Checks of one argument
// assume its index is below the list's size: call count() or at_least() first.
//
// Borrows the argument array, which must outlive the checker. Immutable;
// thread-safe.
class ArgChecker {
 public:
  ArgChecker(const Arg* args, size_t num_args, std::string prefix)
      : args_(args), num_args_(num_args), prefix_(std::move(prefix)) {}
  ArgChecker(const TaskArgs& args, std::string prefix)
      : ArgChecker(args.args().data(), args.size(), std::move(prefix)) {}
  // A kernel's arguments; the prefix is "<kernel>: " and count() also checks
  // the context's block.
  ArgChecker(const KernelContext& ctx, std::string_view kernel);

  // INVALID_ARGUMENT "<prefix><what>".
  absl::Status error(const std::string& what) const;

  // "argument list is null" (a null array with a nonzero size) or
  // "expects <n> arguments, got <size>"; for a kernel context then block().
  absl::Status count(size_t n) const;
  // "expects at least <n> arguments, got <size>".
  absl::Status at_least(size_t n) const;
  // "block <idx> outside block_dim <dim>" unless 0 <= idx < dim (the kernel
  // context's block; always OK for a plain argument list).
  absl::Status block() const;

  // Argument `i` must be a tensor (any direction) that tensor_matches `dtype`
  // and `dims`, with a non-null address when it has elements. Messages:
  // "must be a tensor, got a scalar", "must be a contiguous f32[*,3], got
  // f32[4,3]" (then " (strided)" when it is not contiguous), "has a null address".
  absl::Status tensor(size_t i, const char* name, DataType dtype,
                      std::span<const int64_t> dims) const;
  absl::Status tensor(size_t i, const char* name, DataType dtype,
                      std::initializer_list<int64_t> dims) const {
    return tensor(i, name, dtype, std::span<const int64_t>(dims.begin(), dims.size()));
  }
  // Argument `i` must be a tensor tagged IN or INOUT ("must be tagged IN or
  // INOUT, got OUT") that tensor_matches `dtype` and `dims`. The address is not
  // checked: run tensors may be HOST or DEVICE and the runtime resolves them.
  absl::Status input(size_t i, const char* name, DataType dtype,
                     std::initializer_list<int64_t> dims) const;
  // As input(), for a tensor tagged OUT or INOUT.
  absl::Status output(size_t i, const char* name, DataType dtype,
                      std::initializer_list<int64_t> dims) const;
  // Argument `i` must be a scalar: "must be a scalar, got a tensor".
  absl::Status scalar(size_t i, const char* name) const;

 private:
  absl::Status arg_error(size_t i, const char* name, const std::string& what) const;
  absl::Status not_scalar(size_t i, const char* name) const;
  absl::Status shape(size_t i, const char* name, DataType dtype,
                     std::span<const int64_t> dims) const;
  absl::Status tagged(size_t i, const char* name, DataType dtype,
                      std::initializer_list<int64_t> dims, bool output) const;

  const Arg* args_;
  size_t num_args_;
  std::string prefix_;
  int32_t block_idx_ = 0;
  int32_t block_dim_ = 1;
};

}  // namespace simpler::task
