#include "simpler/task/arg_check.h"

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace simpler::task {

bool tensor_matches(const Tensor& t, DataType dtype, std::span<const int64_t> dims) {
  const int rank = static_cast<int>(dims.size());
  if (t.dtype != dtype || t.rank != rank || !t.is_contiguous()) return false;
  for (int d = 0; d < rank; ++d) {
    if (dims[d] >= 0 && t.shape[d] != dims[d]) return false;
  }
  return true;
}

std::string dims_string(std::span<const int64_t> dims) {
  std::vector<std::string> s;
  for (int64_t w : dims) s.push_back(w < 0 ? std::string("*") : absl::StrCat(w));
  return absl::StrCat("[", absl::StrJoin(s, ","), "]");
}

std::string tensor_string(const Tensor& t) {
  std::vector<int64_t> s(t.shape.begin(), t.shape.begin() + t.rank);
  return absl::StrCat(std::string(name_of(t.dtype)), "[", absl::StrJoin(s, ","), "]",
                      t.is_contiguous() ? "" : " (strided)");
}

ArgChecker::ArgChecker(const KernelContext& ctx, std::string_view kernel)
    : ArgChecker(ctx.args, ctx.num_args, std::string(kernel) + ": ") {
  block_idx_ = ctx.block_idx;
  block_dim_ = ctx.block_dim;
}

absl::Status ArgChecker::error(const std::string& what) const {
  return absl::InvalidArgumentError(absl::StrCat(prefix_, what));
}

absl::Status ArgChecker::arg_error(size_t i, const char* name, const std::string& what) const {
  return error(absl::StrCat("argument ", i, " (", name, ") ", what));
}

absl::Status ArgChecker::count(size_t n) const {
  if (args_ == nullptr && num_args_ > 0) return error("argument list is null");
  if (num_args_ != n) return error(absl::StrCat("expects ", n, " arguments, got ", num_args_));
  return block();
}

absl::Status ArgChecker::at_least(size_t n) const {
  if (args_ == nullptr && num_args_ > 0) return error("argument list is null");
  if (num_args_ < n) {
    return error(absl::StrCat("expects at least ", n, " arguments, got ", num_args_));
  }
  return absl::OkStatus();
}

absl::Status ArgChecker::block() const {
  if (block_dim_ < 1 || block_idx_ < 0 || block_idx_ >= block_dim_) {
    return error(absl::StrCat("block ", block_idx_, " outside block_dim ", block_dim_));
  }
  return absl::OkStatus();
}

absl::Status ArgChecker::not_scalar(size_t i, const char* name) const {
  if (args_[i].direction == ArgDirection::kScalar) {
    return arg_error(i, name, "must be a tensor, got a scalar");
  }
  return absl::OkStatus();
}

absl::Status ArgChecker::shape(size_t i, const char* name, DataType dtype,
                               std::span<const int64_t> dims) const {
  const Tensor& t = args_[i].tensor;
  if (!tensor_matches(t, dtype, dims)) {
    return arg_error(i, name,
                     absl::StrCat("must be a contiguous ", std::string(name_of(dtype)),
                                  dims_string(dims), ", got ", tensor_string(t)));
  }
  return absl::OkStatus();
}

absl::Status ArgChecker::tensor(size_t i, const char* name, DataType dtype,
                                std::span<const int64_t> dims) const {
  if (absl::Status s = not_scalar(i, name); !s.ok()) return s;
  if (absl::Status s = shape(i, name, dtype, dims); !s.ok()) return s;
  const Tensor& t = args_[i].tensor;
  if (t.numel() > 0 && t.address == 0) return arg_error(i, name, "has a null address");
  return absl::OkStatus();
}

absl::Status ArgChecker::tagged(size_t i, const char* name, DataType dtype,
                                std::initializer_list<int64_t> dims, bool output) const {
  if (absl::Status s = not_scalar(i, name); !s.ok()) return s;
  const ArgDirection dir = args_[i].direction;
  if (dir != ArgDirection::kInOut && dir != (output ? ArgDirection::kOut : ArgDirection::kIn)) {
    return arg_error(i, name,
                     absl::StrCat("must be tagged ", output ? "OUT or INOUT" : "IN or INOUT",
                                  ", got ", std::string(name_of(dir))));
  }
  return shape(i, name, dtype, std::span<const int64_t>(dims.begin(), dims.size()));
}

absl::Status ArgChecker::input(size_t i, const char* name, DataType dtype,
                               std::initializer_list<int64_t> dims) const {
  return tagged(i, name, dtype, dims, false);
}

absl::Status ArgChecker::output(size_t i, const char* name, DataType dtype,
                                std::initializer_list<int64_t> dims) const {
  return tagged(i, name, dtype, dims, true);
}

absl::Status ArgChecker::scalar(size_t i, const char* name) const {
  if (args_[i].direction != ArgDirection::kScalar) {
    return arg_error(i, name, "must be a scalar, got a tensor");
  }
  return absl::OkStatus();
}

}  // namespace simpler::task
