#include "simpler/task/task_args.h"

#include <cstdio>
#include <cstdlib>
#include <stdexcept>

#include "absl/strings/str_cat.h"
#include "simpler/base/enum_names.h"
#include "simpler/base/status.h"
#include "simpler/task/call_config.h"
#include "simpler/task/callable.h"

namespace simpler::task {

namespace {

constexpr base::EnumNames<ArgDirection> kDirectionNames = {{ArgDirection::kScalar, "SCALAR"},
                                                           {ArgDirection::kIn, "IN"},
                                                           {ArgDirection::kOut, "OUT"},
                                                           {ArgDirection::kInOut, "INOUT"}};

}  // namespace

std::string_view name_of(ArgDirection dir) { return kDirectionNames.name(dir, "?"); }

TaskArgs& TaskArgs::add_tensor(const Tensor& tensor, ArgDirection dir) {
  // Built in place: an Arg is ~170 bytes and this runs for every task an orchestration submits.
  Arg& a = args_.emplace_back();
  a.direction = dir;
  a.tensor = tensor;
  return *this;
}

TaskArgs& TaskArgs::add_scalar(uint64_t bits) {
  Arg a;
  a.direction = ArgDirection::kScalar;
  a.scalar = bits;
  args_.push_back(a);
  return *this;
}

static void die(const char* what, size_t i, size_t n) {
  std::fprintf(stderr, "simpler: TaskArgs::%s(%zu) on %zu arguments or wrong kind\n", what, i, n);
  std::abort();
}

const Tensor& TaskArgs::tensor(size_t i) const {
  if (i >= args_.size() || args_[i].direction == ArgDirection::kScalar) die("tensor", i, size());
  return args_[i].tensor;
}

uint64_t TaskArgs::scalar(size_t i) const {
  if (i >= args_.size() || args_[i].direction != ArgDirection::kScalar) die("scalar", i, size());
  return args_[i].scalar;
}

static float bits_to_f32(uint64_t bits) {
  uint32_t b = static_cast<uint32_t>(bits);
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

float TaskArgs::scalar_f32(size_t i) const { return bits_to_f32(scalar(i)); }
float KernelContext::scalar_f32(uint32_t i) const { return bits_to_f32(scalar(i)); }

void KernelContext::throw_bad_arg(uint32_t i, const char* kind) const {
  throw std::out_of_range(absl::StrCat(
      "KernelContext::", kind, "(", i, ") in run ", run_id, " task ", task_index, ": ",
      i >= num_args
          ? absl::StrCat("the task has ", num_args, " arguments")
          : absl::StrCat("argument ", i, " is a ",
                         args[i].direction == ArgDirection::kScalar ? "scalar" : "tensor")));
}

absl::Status validate_arg(const Arg& a, size_t i) {
  const auto d = static_cast<uint8_t>(a.direction);
  if (d > static_cast<uint8_t>(ArgDirection::kInOut)) {
    return absl::InvalidArgumentError(
        absl::StrCat("argument ", i, " has unknown direction ", static_cast<int>(d)));
  }
  if (a.direction == ArgDirection::kScalar) {
    // add_scalar leaves the view empty; add_tensor(t, kScalar) does not (its kernel would read
    // an unstaged address as a tensor argument of direction 0).
    if (a.tensor.address != 0 || a.tensor.rank != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "argument ", i, " is a scalar carrying a tensor view (", a.tensor.debug_string(),
          "): add_tensor takes kIn, kOut or kInOut; add_scalar makes a scalar"));
    }
    return absl::OkStatus();
  }
  if (a.tensor.rank < 0 || a.tensor.rank > kMaxRank) {
    return absl::InvalidArgumentError(absl::StrCat("argument ", i, " has tensor rank ",
                                                   a.tensor.rank, " outside [0, ", kMaxRank, "]"));
  }
  if (static_cast<uint8_t>(a.tensor.dtype) > static_cast<uint8_t>(kLastDataType)) {
    return absl::InvalidArgumentError(absl::StrCat("argument ", i, " has an unknown dtype"));
  }
  if (static_cast<uint8_t>(a.tensor.memory) > static_cast<uint8_t>(MemoryKind::kHost)) {
    return absl::InvalidArgumentError(absl::StrCat("argument ", i, " has an unknown memory kind"));
  }
  for (int r = 0; r < a.tensor.rank; ++r) {
    if (a.tensor.shape[r] < 0 || a.tensor.strides[r] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("argument ", i, " has a negative shape or stride in dimension ", r));
    }
  }
  // The addressed span must fit the address space: span_bytes() saturates (to UINT64_MAX) a span
  // no memory holds, so this is its 128-bit sum without overflow.
  const uint64_t span = a.tensor.span_bytes();
  if (span >= (uint64_t{1} << 62) || static_cast<unsigned __int128>(span) + a.tensor.address >
                                         (static_cast<unsigned __int128>(1) << 64)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "argument ", i, " addresses more memory than exists (shape/strides overflow)"));
  }
  return absl::OkStatus();
}

absl::Status TaskArgs::validate() const {
  for (size_t i = 0; i < args_.size(); ++i) {
    SIMPLER_RETURN_IF_ERROR(validate_arg(args_[i], i));
  }
  return absl::OkStatus();
}

absl::Status CallConfig::validate() const {
  if (max_cores < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("CallConfig.max_cores must be >= 0, got ", max_cores));
  }
  if (!(timeout_s >= 0) || timeout_s == std::numeric_limits<double>::infinity()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "CallConfig.timeout_s must be finite and >= 0 (0 = Worker default), got ", timeout_s));
  }
  if (static_cast<uint8_t>(placement) > static_cast<uint8_t>(GraphPlacement::kHost)) {
    return absl::InvalidArgumentError(
        absl::StrCat("CallConfig.placement ", static_cast<int>(placement),
                     " is not a GraphPlacement (0 default, 1 device, 2 host)"));
  }
  if (capture_scalar_params != 0 && capture_key == 0) {
    return absl::InvalidArgumentError(
        "CallConfig.capture_scalar_params is set without a capture_key");
  }
  return absl::OkStatus();
}

}  // namespace simpler::task
