#include "hierarchy/run_request.h"

#include <cstring>

#include "base/test_status.h"
#include "gtest/gtest.h"

namespace simpler::hierarchy {
namespace {

using simpler::testing::contains;

RunRequest sample() {
  RunRequest r;
  r.callable = "mlp_shard";
  r.config.max_cores = 3;
  r.config.timeout_s = 2.5;
  r.config.placement = task::GraphPlacement::kHost;
  r.config.task_timing = false;
  task::Tensor t = *task::Tensor::contiguous(0x1000, {4, 8}, task::DataType::kBFloat16);
  t.memory = task::MemoryKind::kHost;
  r.args.add_tensor(t, task::ArgDirection::kIn)
      .add_scalar_i64(-7)
      .add_tensor(*task::Tensor::contiguous(0x2000, {16}, task::DataType::kFloat32),
                  task::ArgDirection::kOut);
  return r;
}

TEST(RunRequest, RoundTripsEveryField) {
  const RunRequest in = sample();
  std::vector<uint8_t> bytes = *encode_run_request(in);
  absl::StatusOr<RunRequest> out = decode_run_request(bytes);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->callable, "mlp_shard");
  EXPECT_EQ(out->config.max_cores, 3);
  EXPECT_EQ(out->config.timeout_s, 2.5);
  EXPECT_EQ(out->config.placement, task::GraphPlacement::kHost);
  EXPECT_FALSE(out->config.task_timing);
  ASSERT_EQ(out->args.size(), 3u);
  EXPECT_EQ(out->args.tensor(0).address, 0x1000u);
  EXPECT_EQ(out->args.tensor(0).memory, task::MemoryKind::kHost);
  EXPECT_EQ(out->args.tensor(0).dtype, task::DataType::kBFloat16);
  EXPECT_EQ(out->args.tensor(0).shape[1], 8);
  EXPECT_EQ(out->args.tensor(0).strides[0], 8);
  EXPECT_EQ(out->args.scalar_i64(1), -7);
  EXPECT_EQ(out->args[2].direction, task::ArgDirection::kOut);
  EXPECT_EQ(out->args.tensor(2).span_bytes(), 64u);
}

TEST(RunRequest, EveryTruncationIsRefusedNamingWhereItStopped) {
  const std::vector<uint8_t> bytes = *encode_run_request(sample());
  for (size_t n = 0; n < bytes.size(); ++n) {
    absl::StatusOr<RunRequest> r = decode_run_request({bytes.data(), n});
    ASSERT_FALSE(r.ok()) << "accepted " << n << " of " << bytes.size() << " bytes";
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(contains(r.status(), "run request: ")) << r.status();
  }
  std::vector<uint8_t> longer = bytes;
  longer.push_back(0);
  EXPECT_TRUE(contains(decode_run_request(longer).status(), "1 trailing bytes"));
}

TEST(RunRequest, BadFieldsAreRefusedNamingThem) {
  const std::vector<uint8_t> good = *encode_run_request(sample());
  auto mutate = [&](size_t at, uint8_t v) {
    std::vector<uint8_t> b = good;
    b[at] = v;
    return decode_run_request(b).status();
  };
  EXPECT_TRUE(contains(mutate(0, 0), "bad magic"));
  EXPECT_TRUE(contains(mutate(4, 9), "version 9"));
  EXPECT_TRUE(contains(mutate(6, 0), "callable name of 0 bytes"));
  const size_t config = 8 + 9;  // after the name
  EXPECT_TRUE(contains(mutate(config + 12, 7), "unknown graph placement 7"));
  EXPECT_TRUE(contains(mutate(config + 13, 2), "task_timing 2"));
  const size_t count = config + 14;
  EXPECT_TRUE(contains(mutate(count + 3, 0x7f), "arguments do not fit"));
  const size_t arg0 = count + 4;
  EXPECT_TRUE(contains(mutate(arg0, 9), "unknown direction 9"));
  EXPECT_TRUE(contains(mutate(arg0 + 1, 5), "unknown memory kind"));
  EXPECT_TRUE(contains(mutate(arg0 + 2, 77), "unknown dtype"));
  EXPECT_TRUE(contains(mutate(arg0 + 3, 7), "has rank 7"));
  // A scalar (argument 1) that claims a rank would decode to an argument its encoding cannot
  // reproduce (the fuzzer's find: fuzz/mailbox_frame_fuzz/crashes/).
  const size_t arg1 = arg0 + 4 + 16 + 2 * 2 * 8;
  EXPECT_TRUE(contains(mutate(arg1 + 3, 1), "argument 1 is a scalar with rank 1"));
  // A negative timeout in the config.
  std::vector<uint8_t> b = good;
  const double negative = -1;
  std::memcpy(b.data() + config + 4, &negative, 8);
  EXPECT_TRUE(contains(decode_run_request(b).status(), "config: "))
      << decode_run_request(b).status();
}

TEST(RunRequest, EncodeRefusesNamesThatCannotCross) {
  RunRequest r = sample();
  r.callable = "";
  EXPECT_EQ(encode_run_request(r).status().code(), absl::StatusCode::kInvalidArgument);
  r.callable = std::string(kMaxCallableNameBytes + 1, 'n');
  EXPECT_TRUE(contains(encode_run_request(r).status(), "callable name of 256 bytes"));
}

}  // namespace
}  // namespace simpler::hierarchy
