#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "gtest/gtest.h"
#include "simpler/task/arg_check.h"
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

// q8_0 is a block dtype: 32 elements in 34 bytes. A [3, 64] tensor spans 6 blocks; the task
// argument check and the buffer check count whole blocks.
TEST(DataType, Q8_0IsSizedByItsBlocks) {
  EXPECT_EQ(block_elements(DataType::kQ8_0), 32);
  EXPECT_EQ(block_bytes(DataType::kQ8_0), 34u);
  EXPECT_EQ(block_elements(DataType::kBFloat16), 1);
  EXPECT_EQ(block_bytes(DataType::kBFloat16), 2u);
  EXPECT_EQ(bytes_of(DataType::kQ8_0, 192), 6u * 34);
  EXPECT_EQ(bytes_of(DataType::kQ8_0, 33), 2u * 34);  // rounded up to whole blocks
  EXPECT_EQ(bytes_of(DataType::kFloat32, 5), 20u);
  EXPECT_EQ(name_of(DataType::kQ8_0), "q8_0");
  EXPECT_EQ(block_elements(DataType::kQ4_0), 32);
  EXPECT_EQ(block_bytes(DataType::kQ4_0), 18u);
  EXPECT_EQ(bytes_of(DataType::kQ4_0, 64), 36u);
  EXPECT_EQ(*parse_data_type("Q4_0"), DataType::kQ4_0);
  // q4_k and q6_k: super-blocks of 256 elements in 144 and 210 bytes (ggml's block_q4_K and
  // block_q6_K).
  EXPECT_EQ(block_elements(DataType::kQ4_K), 256);
  EXPECT_EQ(block_bytes(DataType::kQ4_K), 144u);
  EXPECT_EQ(block_elements(DataType::kQ6_K), 256);
  EXPECT_EQ(block_bytes(DataType::kQ6_K), 210u);
  EXPECT_EQ(bytes_of(DataType::kQ6_K, 512), 420u);
  EXPECT_EQ(size_of(DataType::kQ4_K), 0u);
  EXPECT_EQ(*parse_data_type("Q4_K"), DataType::kQ4_K);
  EXPECT_EQ(*parse_data_type("q6_k"), DataType::kQ6_K);
  EXPECT_EQ(safetensors_name(DataType::kQ6_K), "Q6_K");
  EXPECT_EQ(*parse_data_type("q8_0"), DataType::kQ8_0);
  auto t = Tensor::contiguous(0x1000, {3, 64}, DataType::kQ8_0);
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(t->span_bytes(), 6u * 34);
  TaskArgs args;
  args.add_tensor(*t, ArgDirection::kIn);
  EXPECT_TRUE(args.validate().ok());
  const int64_t shape[] = {3, 64};
  EXPECT_TRUE(
      Tensor::in_buffer(0x1000, 204, 0, shape, 2, DataType::kQ8_0, MemoryKind::kDevice).ok());
  absl::Status s =
      Tensor::in_buffer(0x1000, 203, 0, shape, 2, DataType::kQ8_0, MemoryKind::kDevice).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("of 204 bytes at offset 0 exceeds the 203-byte"),
            std::string_view::npos)
      << s;
}

// Rows interleaved 16 at a time (kQ4_K_R16, kQ6_K_R16, kQ8_0_R16): the plain dtype's sizes and
// element values, row r's block b's dword v at 64·D·b + 64·v + 4·(r mod 16) of its group (Q8_0's
// from the block's byte 2) and the scale bytes (Q6_K's last two, Q8_0's first two) after the
// group's chunks; interleave then deinterleave gives the plain bytes back, one row or all of
// them; a dtype without the form has none.
TEST(DataType, RowInterleavedFormsKeepThePlainBytesInAnotherOrder) {
  EXPECT_EQ(interleaved_rows(DataType::kQ4_K_R16), 16);
  EXPECT_EQ(interleaved_rows(DataType::kQ6_K), 1);
  EXPECT_EQ(interleaved_of(DataType::kQ4_K), DataType::kQ4_K_R16);
  EXPECT_EQ(interleaved_of(DataType::kQ6_K), DataType::kQ6_K_R16);
  EXPECT_EQ(interleaved_of(DataType::kQ8_0), DataType::kQ8_0_R16);
  EXPECT_EQ(interleaved_of(DataType::kQ4_0), DataType::kQ4_0);
  EXPECT_EQ(plain_of(DataType::kQ8_0_R16), DataType::kQ8_0);
  EXPECT_EQ(interleaved_rows(DataType::kQ8_0_R16), 16);
  EXPECT_EQ(block_elements(DataType::kQ8_0_R16), 32);
  EXPECT_EQ(block_bytes(DataType::kQ8_0_R16), 34u);
  EXPECT_EQ(*parse_data_type("q8_0_r16"), DataType::kQ8_0_R16);
  EXPECT_EQ(plain_of(DataType::kQ6_K_R16), DataType::kQ6_K);
  EXPECT_EQ(plain_of(DataType::kBFloat16), DataType::kBFloat16);
  EXPECT_EQ(bytes_of(DataType::kQ6_K_R16, 16 * 512), bytes_of(DataType::kQ6_K, 16 * 512));
  EXPECT_EQ(block_elements(DataType::kQ4_K_R16), 256);
  EXPECT_EQ(name_of(DataType::kQ4_K_R16), "q4_k_r16");
  EXPECT_EQ(*parse_data_type("q6_k_r16"), DataType::kQ6_K_R16);
  for (DataType plain : {DataType::kQ4_K, DataType::kQ6_K, DataType::kQ8_0}) {
    const DataType r16 = interleaved_of(plain);
    // two groups of 16 rows, 3 blocks a row
    const int64_t rows = 32, cols = 3 * block_elements(plain);
    const size_t bytes = bytes_of(plain, rows * cols), row_bytes = bytes / rows;
    std::vector<uint8_t> src(bytes), dst(bytes), back(bytes, 0xEE), row(row_bytes);
    for (size_t i = 0; i < bytes; ++i) src[i] = static_cast<uint8_t>(i * 131 + i / 7);
    interleave_rows(r16, src.data(), rows, cols, dst.data());
    const size_t sb = block_bytes(plain), d = sb / 4;
    const size_t lead = plain == DataType::kQ8_0 ? 2 : 0;  // the bytes before dword 0
    for (int64_t r : {0, 5, 15, 16, 31}) {
      for (int64_t b = 0; b < 3; ++b) {
        const uint8_t* group = dst.data() + r / 16 * 16 * row_bytes;
        const uint8_t* plain_sb = src.data() + r * row_bytes + b * sb;
        EXPECT_EQ(0,
                  std::memcmp(group + 64 * d * b + 64 * 7 + 4 * (r % 16), plain_sb + lead + 28, 4))
            << name_of(r16) << " row " << r << " block " << b;
        if (plain != DataType::kQ4_K) {
          const size_t scale_at = plain == DataType::kQ6_K ? 208 : 0;
          EXPECT_EQ(0,
                    std::memcmp(group + 64 * d * 3 + 32 * b + 2 * (r % 16), plain_sb + scale_at, 2))
              << "the d of " << name_of(r16) << " row " << r << " block " << b;
        }
      }
      deinterleave_row(r16, dst.data(), r, cols, row.data());
      EXPECT_EQ(0, std::memcmp(row.data(), src.data() + r * row_bytes, row_bytes)) << r;
    }
    deinterleave_rows(r16, dst.data(), rows, cols, back.data());
    EXPECT_EQ(back, src) << name_of(r16);
    std::vector<float> out(static_cast<size_t>(cols), 1.5f);
    dequantize_blocks(r16, dst.data(), cols, out.data());
    EXPECT_EQ(out[0], 1.5f) << "an interleaved dtype's bytes are not one row's blocks";
  }
  // a task argument of the last dtype validates; one past it is an unknown dtype
  auto t = Tensor::contiguous(0x1000, {16, 256}, kLastDataType);
  ASSERT_TRUE(t.ok());
  TaskArgs args;
  args.add_tensor(*t, ArgDirection::kIn);
  EXPECT_TRUE(args.validate().ok());
  Tensor past = *t;
  past.dtype = static_cast<DataType>(static_cast<uint8_t>(kLastDataType) + 1);
  TaskArgs bad;
  bad.add_tensor(past, ArgDirection::kIn);
  EXPECT_EQ(bad.validate().code(), absl::StatusCode::kInvalidArgument);
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

TEST(Tensor, AViewInABufferStartsAtTheOffsetAndMustFitWhatIsLeft) {
  const int64_t shape[] = {4, 3};
  auto t = Tensor::in_buffer(0x1000, 64, 16, shape, 2, DataType::kFloat32, MemoryKind::kHost);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->address, 0x1010u);
  EXPECT_EQ(t->memory, MemoryKind::kHost);
  EXPECT_EQ(t->span_bytes(), 48u);
  EXPECT_EQ(t->strides[0], 3);

  const int64_t sixteen[] = {16};
  auto over =
      Tensor::in_buffer(0x1000, 64, 16, sixteen, 1, DataType::kFloat32, MemoryKind::kDevice);
  EXPECT_EQ(over.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(over.status().message(),
            "tensor f32[16]@0x1010 of 64 bytes at offset 16 exceeds the 64-byte device buffer");
  const int64_t empty[] = {0};
  auto past = Tensor::in_buffer(0x1000, 64, 65, empty, 1, DataType::kUInt8, MemoryKind::kHost);
  EXPECT_EQ(past.status().message(),
            "tensor u8[0]@0x1041 (host) of 0 bytes at offset 65 exceeds the 64-byte host buffer");
  const int64_t negative[] = {-1};
  EXPECT_EQ(Tensor::in_buffer(0x1000, 64, 0, negative, 1, DataType::kUInt8, MemoryKind::kHost)
                .status()
                .message(),
            "tensor dimension 0 is negative (-1)");
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

  // A tensor added as a scalar: its kernel read the unstaged address as direction 0.
  TaskArgs b;
  b.add_scalar_i64(0).add_tensor(*Tensor::contiguous(0x10, {4}, DataType::kInt32),
                                 ArgDirection::kScalar);
  s = b.validate();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("argument 1 is a scalar carrying a tensor view"),
            std::string_view::npos)
      << s;
}

// Shapes whose element count or strides pass 2^48 are refused when built; a view built by hand
// saturates numel() and span_bytes() instead of overflowing (signed overflow, undefined: it gave
// a span of 0 bytes and a negative element count).
TEST(Tensor, HugeShapesAreRefusedOrSaturateNeverWrap) {
  for (std::initializer_list<int64_t> shape :
       {std::initializer_list<int64_t>{int64_t{1} << 62, 4}, {3, int64_t{1} << 62}}) {
    auto t = Tensor::contiguous(0x1000, shape, DataType::kFloat32);
    EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(t.status().message().find("more than 2^48 elements"), std::string_view::npos)
        << t.status();
  }
  const int64_t big[] = {int64_t{1} << 30, 4};
  EXPECT_FALSE(
      Tensor::in_buffer(0x1000, 64, 0, big, 2, DataType::kFloat32, MemoryKind::kDevice).ok());
  EXPECT_TRUE(Tensor::contiguous(0, {int64_t{1} << 24, int64_t{1} << 24}, DataType::kUInt8).ok());
  auto none = Tensor::contiguous(0x1000, {0, int64_t{1} << 40, int64_t{1} << 40}, DataType::kUInt8);
  ASSERT_TRUE(none.ok()) << none.status();  // no element, whatever the other dimensions
  EXPECT_EQ(none->numel(), 0);
  EXPECT_EQ(none->span_bytes(), 0u);

  Tensor by_hand = *Tensor::contiguous(0x1000, {2, 2}, DataType::kFloat32);
  by_hand.shape = {int64_t{1} << 62, 4};
  by_hand.strides = {4, 1};
  EXPECT_EQ(by_hand.numel(), std::numeric_limits<int64_t>::max());
  EXPECT_EQ(by_hand.span_bytes(), std::numeric_limits<uint64_t>::max());
  by_hand.shape = {3, int64_t{1} << 62};
  by_hand.strides = {int64_t{1} << 62, 1};
  EXPECT_EQ(by_hand.numel(), std::numeric_limits<int64_t>::max());
  EXPECT_EQ(by_hand.span_bytes(), std::numeric_limits<uint64_t>::max());
  // Six terms near 2^126 each (a fuzzer's mailbox frame): their 128-bit sum overflowed (UB).
  Tensor six = by_hand;
  six.rank = 6;
  six.shape.fill(std::numeric_limits<int64_t>::max());
  six.strides.fill(std::numeric_limits<int64_t>::max());
  EXPECT_EQ(six.span_bytes(), std::numeric_limits<uint64_t>::max());
  EXPECT_FALSE(six.is_contiguous());
  six.strides.fill(0);  // shapes whose product passes int64, all strides 0
  EXPECT_FALSE(six.is_contiguous());
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

TEST(CallConfig, ScalarParametersWithoutACaptureKeyAreRefused) {
  CallConfig c;
  c.capture_scalar_params = 1;
  EXPECT_EQ(c.validate(), absl::InvalidArgumentError(
                              "CallConfig.capture_scalar_params is set without a capture_key"));
  c.capture_key = 7;
  EXPECT_TRUE(c.validate().ok());
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
  c.kernels.back().name = "";
  EXPECT_NE(c.validate().message().find("kernel 2 has no name"), std::string_view::npos);
  c.kernels.pop_back();
  c.placement = static_cast<GraphPlacement>(9);  // ran device-built, silently
  EXPECT_NE(c.validate().message().find("unknown placement 9"), std::string_view::npos);
}

// Records what the orchestration submits.
class RecordingContext : public OrchestrationContext {
 public:
  absl::Status submit(KernelIndex kernel, const TaskArgs& args, int32_t block_dim) override {
    submitted.push_back({kernel, args.size(), block_dim});
    last_args = args;
    return absl::OkStatus();
  }
  int32_t num_cores() const override { return 1; }
  uint64_t run_id() const override { return 0; }

  struct Submit {
    KernelIndex kernel;
    size_t num_args;
    int32_t block_dim;
    bool operator==(const Submit&) const = default;
  };
  std::vector<Submit> submitted;
  TaskArgs last_args;
};

TEST(Callable, AOneKernelCallableSubmitsItsKernelOnceOverTheRunsArguments) {
  const ChipCallable c = one_kernel_callable("single", noop);
  EXPECT_TRUE(c.validate().ok());
  EXPECT_EQ(c.name, "single");
  ASSERT_EQ(c.kernels.size(), 1u);
  EXPECT_EQ(c.kernels[0].name, "single");
  EXPECT_EQ(c.kernels[0].fn, &noop);
  TaskArgs run;
  run.add_tensor(*Tensor::contiguous(0x40, {2}, DataType::kInt64), ArgDirection::kInOut)
      .add_scalar_i64(7);
  RecordingContext ctx;
  ASSERT_TRUE(c.orchestration(ctx, run).ok());
  EXPECT_EQ(ctx.submitted, (std::vector<RecordingContext::Submit>{{0, 2, 1}}));
  EXPECT_EQ(ctx.last_args[0].tensor.address, 0x40u);
  EXPECT_EQ(ctx.last_args.scalar_i64(1), 7);
  EXPECT_EQ(one_kernel_callable("null", nullptr).validate().message(),
            "callable 'null': kernel 'null' has no function");
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

// The one argument checker: each check's error names the argument and what was wanted and got,
// after the caller's prefix; a matching list passes every check.
TEST(ArgChecker, EachCheckNamesTheArgumentWhatWasWantedAndWhatCame) {
  TaskArgs a;
  a.add_tensor(*Tensor::contiguous(0x1000, {4, 3}, DataType::kFloat32), ArgDirection::kIn);
  a.add_tensor(*Tensor::contiguous(0x2000, {4}, DataType::kInt32), ArgDirection::kOut);
  a.add_scalar(7);
  const ArgChecker c(a, "k: ");
  EXPECT_TRUE(c.count(3).ok());
  EXPECT_TRUE(c.at_least(2).ok());
  EXPECT_TRUE(c.tensor(0, "W", DataType::kFloat32, {-1, 3}).ok());
  EXPECT_TRUE(c.input(0, "W", DataType::kFloat32, {4, 3}).ok());
  EXPECT_TRUE(c.output(1, "ids", DataType::kInt32, {4}).ok());
  EXPECT_TRUE(c.scalar(2, "n").ok());
  EXPECT_TRUE(c.block().ok());

  auto message = [](const absl::Status& s) {
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    return std::string(s.message());
  };
  EXPECT_EQ(message(c.count(2)), "k: expects 2 arguments, got 3");
  EXPECT_EQ(message(c.at_least(4)), "k: expects at least 4 arguments, got 3");
  EXPECT_EQ(message(c.tensor(0, "W", DataType::kFloat32, {-1, 4})),
            "k: argument 0 (W) must be a contiguous f32[*,4], got f32[4,3]");
  EXPECT_EQ(message(c.tensor(2, "n", DataType::kInt32, {1})),
            "k: argument 2 (n) must be a tensor, got a scalar");
  EXPECT_EQ(message(c.input(1, "ids", DataType::kInt32, {4})),
            "k: argument 1 (ids) must be tagged IN or INOUT, got OUT");
  EXPECT_EQ(message(c.output(0, "W", DataType::kFloat32, {4, 3})),
            "k: argument 0 (W) must be tagged OUT or INOUT, got IN");
  EXPECT_EQ(message(c.scalar(0, "W")), "k: argument 0 (W) must be a scalar, got a tensor");

  TaskArgs null_address;
  null_address.add_tensor(*Tensor::contiguous(0, {2}, DataType::kFloat32), ArgDirection::kIn);
  EXPECT_EQ(message(ArgChecker(null_address, "k: ").tensor(0, "x", DataType::kFloat32, {2})),
            "k: argument 0 (x) has a null address");
  EXPECT_EQ(message(ArgChecker(nullptr, 2, "k: ").count(2)), "k: argument list is null");
}

}  // namespace
}  // namespace simpler::task
