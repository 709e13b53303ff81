// Arguments of a run or a task: tensors tagged by direction, and scalars.
#pragma once

#include <cstdint>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "simpler/task/tensor.h"

namespace simpler::task {

// How a task uses an argument. Values are part of the graph-image format.
enum class ArgDirection : uint8_t { kScalar = 0, kIn = 1, kOut = 2, kInOut = 3 };

std::string_view name_of(ArgDirection dir);

// One argument: a tensor with direction IN / OUT / INOUT, or a 64-bit scalar.
// Plain, trivially copyable.
struct Arg {
  ArgDirection direction = ArgDirection::kScalar;
  Tensor tensor{};
  uint64_t scalar = 0;
};
static_assert(std::is_trivially_copyable_v<Arg>);

// INVALID_ARGUMENT naming argument `index` when its direction, rank, dtype or
// memory kind is unknown, a shape or stride is negative, its addressed span
// overflows, or it is a scalar with a tensor view (add_tensor with kScalar). Used by
// TaskArgs::validate and by the runtime on every task.
absl::Status validate_arg(const Arg& arg, size_t index);

// Ordered argument list, in the callee's signature order. Value type,
// thread-compatible.
class TaskArgs {
 public:
  // `dir` must be kIn, kOut or kInOut (kScalar is refused by validate()).
  TaskArgs& add_tensor(const Tensor& tensor, ArgDirection dir);
  // add_tensor of each of `tensors` in order, all with direction `dir`.
  TaskArgs& add_tensors(std::initializer_list<std::reference_wrapper<const Tensor>> tensors,
                        ArgDirection dir) {
    for (const Tensor& t : tensors) add_tensor(t, dir);
    return *this;
  }
  TaskArgs& add_scalar(uint64_t bits);
  // Appends an argument as is.
  TaskArgs& add(const Arg& arg) {
    args_.push_back(arg);
    return *this;
  }
  TaskArgs& add_scalar_i64(int64_t v) { return add_scalar(static_cast<uint64_t>(v)); }
  TaskArgs& add_scalar_f32(float v) {
    uint32_t b;
    std::memcpy(&b, &v, 4);
    return add_scalar(b);
  }

  size_t size() const { return args_.size(); }
  void clear() { args_.clear(); }  // removes every argument; keeps the capacity
  const Arg& operator[](size_t i) const { return args_[i]; }
  Arg& operator[](size_t i) { return args_[i]; }
  const std::vector<Arg>& args() const { return args_; }

  // The i-th argument's tensor / scalar; an out-of-range index or a kind
  // mismatch aborts (a program bug, not a runtime condition).
  const Tensor& tensor(size_t i) const;
  uint64_t scalar(size_t i) const;
  int64_t scalar_i64(size_t i) const { return static_cast<int64_t>(scalar(i)); }
  float scalar_f32(size_t i) const;

  // INVALID_ARGUMENT naming the argument index when a direction is unknown,
  // a scalar slot is tagged as tensor or a tensor rank is out of range.
  absl::Status validate() const;

 private:
  std::vector<Arg> args_;
};

}  // namespace simpler::task
