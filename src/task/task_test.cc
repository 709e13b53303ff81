#include <cmath>
#include <limits>

#include "gtest/gtest.h"
#include "simpler/task/call_config.h"
#include "simpler/task/callable.h"
#include "simpler/task/data_type.h"
#include "simpler/task/kernel_registry.h"
#include "simpler/task/task_args.h"
#include "simpler/task/tensor.h"

namespace simpler::task {
namespace {

TEST(DataType, SizesNamesAndSafetensorsStrings) {
  EXPECT_EQ(size_of(DataType::kFloat32), 4u);
  EXPECT_EQ(size_of(DataType::kBFloat16), 2u);
  EXPECT_EQ(size_of(DataType::kInt64), 8u);
  EXPECT_EQ(*parse_data_type("BF16"), DataType::kBFloat16);
  EXPECT_EQ(*parse_data_type("f16"), DataType::kFloat16);
  auto bad = parse_data_type("F8_E4M3");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("F8_E4M3"), std::string_view::npos);
}

TEST(DataType, HalfConversionsRoundTrip) {
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(1.5f)), 1.5f);
  EXPECT_EQ(f32_to_bf16(1.0f), 0x3F80);
  EXPECT_EQ(f16_to_f32(f32_to_f16(-2.25f)), -2.25f);
  EXPECT_EQ(f32_to_f16(1.0f), 0x3C00);
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(std::nanf("")))));
}

TEST(Tensor, ContiguousSpanAndStrides) {
  auto t = Tensor::contiguous(0x1000, {2, 3, 4}, DataType::kFloat32);
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(t->numel(), 24);
  EXPECT_EQ(t->span_bytes(), 96u);
  EXPECT_EQ(t->strides[0], 12);
  EXPECT_TRUE(t->is_contiguous());
  Tensor col = *t;
  col.shape[2] = 1;  // a column view keeps strides
  EXPECT_EQ(col.span_bytes(), (1 * 12 + 2 * 4 + 0 + 1) * 4u);
  EXPECT_FALSE(Tensor::contiguous(0, {1, 2, 3, 4, 5, 6, 7}, DataType::kUInt8).ok());
  EXPECT_FALSE(Tensor::contiguous(0, {-1}, DataType::kUInt8).ok());
}

TEST(TaskArgs, ValidateNamesTheBadArgument) {
  TaskArgs a;
  a.add_tensor(*Tensor::contiguous(0x10, {4}, DataType::kInt32), ArgDirection::kIn);
  a.add_scalar_f32(2.5f);
  EXPECT_TRUE(a.validate().ok());
  EXPECT_EQ(a.scalar_f32(1), 2.5f);
  a[0].tensor.rank = 9;
  absl::Status s = a.validate();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("argument 0"), std::string_view::npos);
}

TEST(CallConfig, ValidateRefusesNanAndNegative) {
  CallConfig c;
  EXPECT_TRUE(c.validate().ok());
  c.timeout_s = std::nan("");
  EXPECT_EQ(c.validate().code(), absl::StatusCode::kInvalidArgument);
  c.timeout_s = std::numeric_limits<double>::infinity();
  EXPECT_EQ(c.validate().code(), absl::StatusCode::kInvalidArgument);
  c.timeout_s = 1;
  c.max_cores = -1;
  EXPECT_NE(c.validate().message().find("max_cores"), std::string_view::npos);
}

absl::Status noop(const KernelContext&) { return absl::OkStatus(); }
absl::Status other(const KernelContext&) { return absl::OkStatus(); }

TEST(Callable, ValidateAndKernelLookup) {
  ChipCallable c{"prog",
                 [](OrchestrationContext&, const TaskArgs&) { return absl::OkStatus(); },
                 {{"a", noop}, {"b", other}}};
  EXPECT_TRUE(c.validate().ok());
  EXPECT_EQ(*c.kernel_index("b"), 1u);
  EXPECT_EQ(c.kernel_index("z").status().code(), absl::StatusCode::kNotFound);
  c.kernels.push_back({"a", other});
  EXPECT_NE(c.validate().message().find("appears twice"), std::string_view::npos);
}

TEST(KernelRegistry, RegistersByNameAndRefusesConflicts) {
  KernelRegistry r;
  EXPECT_TRUE(r.add("noop", noop).ok());
  EXPECT_TRUE(r.add("noop", noop).ok());
  EXPECT_EQ(r.add("noop", other).code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(r.find("missing").status().code(), absl::StatusCode::kNotFound);
  auto all = r.find_all({"noop"});
  ASSERT_TRUE(all.ok());
  EXPECT_EQ((*all)[0].fn, &noop);
}

}  // namespace
}  // namespace simpler::task
