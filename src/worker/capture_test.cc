// Capture and replay (docs/design/capture_replay.md): each test states one part of the contract
// and the attempt to break it that the contract refuses.
#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "simpler/base/status.h"
#include "simpler/worker/worker.h"
#include "worker/worker_test_util.h"

namespace simpler::worker::testing {
namespace {

using task::ArgDirection;
using task::DataType;
using task::GraphPlacement;

int64_t* cells(const task::Tensor& t) { return t.data<int64_t>(); }

// OK, or a failure that shows the status.
::testing::AssertionResult ok(const absl::Status& s) {
  if (s.ok()) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << s;
}

// Waits at the Gate whose address is scalar(2), then out = in.
absl::Status gated_copy_kernel(const task::KernelContext& ctx) {
  reinterpret_cast<const Gate*>(static_cast<uintptr_t>(ctx.scalar_i64(2)))->wait();
  for (int64_t i = 0; i < ctx.tensor(0).numel(); ++i)
    cells(ctx.tensor(1))[i] = cells(ctx.tensor(0))[i];
  return absl::OkStatus();
}
// out = in * scalar(2).
absl::Status mul_kernel(const task::KernelContext& ctx) {
  for (int64_t i = 0; i < ctx.tensor(0).numel(); ++i) {
    cells(ctx.tensor(1))[i] = cells(ctx.tensor(0))[i] * ctx.scalar_i64(2);
  }
  return absl::OkStatus();
}
// inout += in.
absl::Status add_kernel(const task::KernelContext& ctx) {
  for (int64_t i = 0; i < ctx.tensor(0).numel(); ++i)
    cells(ctx.tensor(1))[i] += cells(ctx.tensor(0))[i];
  return absl::OkStatus();
}
// inout = 2 * inout + 1.
absl::Status twice_kernel(const task::KernelContext& ctx) {
  for (int64_t i = 0; i < ctx.tensor(0).numel(); ++i) {
    cells(ctx.tensor(0))[i] = 2 * cells(ctx.tensor(0))[i] + 1;
  }
  return absl::OkStatus();
}

// A program of one task of `kernel`, whose arguments `task_args` makes of the run's.
task::ChipCallable one_task_program(std::string name, task::Kernel kernel,
                                    task::TaskArgs (*task_args)(const task::TaskArgs&)) {
  return task::ChipCallable{
      std::move(name),
      [task_args](task::OrchestrationContext& ctx, const task::TaskArgs& args) {
        return ctx.submit(0, task_args(args));
      },
      {std::move(kernel)}};
}

constexpr int64_t kN = 8;

// The chain program over run arguments x (IN), y (OUT), tmp (INOUT), scalar scale, scalar gate
// address, and a bias buffer its orchestration captured (`bias` holds its address: memory the
// graph uses at a fixed address). Its tasks read and write through RAW, WAR, WAW and partially
// overlapping views, so a missing dependency changes the result.
struct Chain {
  std::shared_ptr<std::atomic<uint64_t>> bias = std::make_shared<std::atomic<uint64_t>>(0);

  task::ChipCallable callable(std::string name = "chain") const {
    auto bias_address = bias;
    auto orchestration = [bias_address](task::OrchestrationContext& ctx,
                                        const task::TaskArgs& args) -> absl::Status {
      const task::Tensor x = args.tensor(0), y = args.tensor(1), tmp = args.tensor(2);
      const int64_t scale = args.scalar_i64(3), gate = args.scalar_i64(4);
      const task::Tensor bias =
          *task::Tensor::contiguous(bias_address->load(), {kN}, DataType::kInt64);
      auto view = [&](int64_t from, int64_t count) {
        return *task::Tensor::contiguous(y.address + from * 8, {count}, DataType::kInt64);
      };
      task::TaskArgs t0, t1, t2, t3, t4, t5, t6;
      t0.add_tensor(x, ArgDirection::kIn).add_tensor(tmp, ArgDirection::kOut).add_scalar_i64(gate);
      t1.add_tensor(tmp, ArgDirection::kIn).add_tensor(y, ArgDirection::kOut).add_scalar_i64(scale);
      t2.add_tensor(bias, ArgDirection::kIn).add_tensor(tmp, ArgDirection::kInOut);
      t3.add_tensor(tmp, ArgDirection::kIn).add_tensor(y, ArgDirection::kInOut);
      t4.add_tensor(view(0, kN / 2), ArgDirection::kInOut);
      t5.add_tensor(view(kN / 4, kN / 2), ArgDirection::kInOut);
      t6.add_tensor(y, ArgDirection::kIn).add_tensor(tmp, ArgDirection::kOut).add_scalar_i64(scale);
      SIMPLER_RETURN_IF_ERROR(ctx.submit(0, t0));
      SIMPLER_RETURN_IF_ERROR(ctx.submit(1, t1));
      SIMPLER_RETURN_IF_ERROR(ctx.submit(2, t2));
      SIMPLER_RETURN_IF_ERROR(ctx.submit(2, t3));
      SIMPLER_RETURN_IF_ERROR(ctx.submit(3, t4));
      SIMPLER_RETURN_IF_ERROR(ctx.submit(3, t5));
      return ctx.submit(1, t6);
    };
    return task::ChipCallable{name,
                              orchestration,
                              {{"gated_copy", gated_copy_kernel},
                               {"mul", mul_kernel},
                               {"add", add_kernel},
                               {"twice", twice_kernel}}};
  }
};

// What the chain computes: y and tmp.
std::pair<std::vector<int64_t>, std::vector<int64_t>> chain_reference(
    const std::vector<int64_t>& x, const std::vector<int64_t>& bias, int64_t scale) {
  std::vector<int64_t> y(kN), tmp(kN);
  for (int64_t i = 0; i < kN; ++i) y[i] = x[i] * scale + x[i] + bias[i];
  for (int64_t i = 0; i < kN / 2; ++i) y[i] = 2 * y[i] + 1;
  for (int64_t i = kN / 4; i < kN / 4 + kN / 2; ++i) y[i] = 2 * y[i] + 1;
  for (int64_t i = 0; i < kN; ++i) tmp[i] = y[i] * scale;
  return {y, tmp};
}

// One run's buffers, x filled from `first`.
struct Buffers {
  DeviceBuffer x, y, tmp;
  std::vector<int64_t> x_host;
};

Buffers make_buffers(Worker& w, int64_t first) {
  Buffers b;
  b.x = *w.malloc(kN * 8);
  b.y = *w.malloc(kN * 8);
  b.tmp = *w.malloc(kN * 8);
  for (int64_t i = 0; i < kN; ++i) b.x_host.push_back(first + 3 * i);
  EXPECT_TRUE(w.copy_to(b.x, b.x_host.data(), kN * 8).ok());
  return b;
}

task::TaskArgs chain_args(const Buffers& b, int64_t scale, const Gate& gate) {
  task::TaskArgs a;
  a.add_tensor(*b.x.tensor({kN}, DataType::kInt64), ArgDirection::kIn)
      .add_tensor(*b.y.tensor({kN}, DataType::kInt64), ArgDirection::kOut)
      .add_tensor(*b.tmp.tensor({kN}, DataType::kInt64), ArgDirection::kInOut)
      .add_scalar_i64(scale)
      .add_scalar_i64(static_cast<int64_t>(reinterpret_cast<uintptr_t>(&gate)));
  return a;
}

std::vector<int64_t> read(Worker& w, const DeviceBuffer& b) {
  std::vector<int64_t> v(kN);
  EXPECT_TRUE(w.copy_from(v.data(), b, kN * 8).ok());
  return v;
}

// Scale (argument 3) and the gate's address (argument 4) are scalar parameters.
constexpr uint64_t kChainParams = (1u << 3) | (1u << 4);

task::CallConfig capture(uint64_t key, GraphPlacement placement, uint64_t params = kChainParams) {
  task::CallConfig c;
  c.placement = placement;
  c.capture_key = key;
  c.capture_scalar_params = params;
  return c;
}

// A worker with the chain registered and its bias allocated (bias[i] = 100 + i).
struct ChainWorker {
  explicit ChainWorker(WorkerOptions o = test_options(2)) : w(std::move(o)) {
    handle = *w.register_callable(chain.callable());
    EXPECT_TRUE(w.init().ok());
    bias_buffer = *w.malloc(kN * 8);
    for (int64_t i = 0; i < kN; ++i) bias.push_back(100 + i);
    EXPECT_TRUE(w.copy_to(bias_buffer, bias.data(), kN * 8).ok());
    chain.bias->store(bias_buffer.address);
  }
  Chain chain;
  Worker w;
  CallableHandle handle;
  DeviceBuffer bias_buffer;
  std::vector<int64_t> bias;
  Gate open_gate{true};
};

class Capture : public ::testing::TestWithParam<GraphPlacement> {};

// A Capture test on a chain worker that has captured the chain over buffers `a` (scale 3) under
// capture key 1.
class CapturedChain : public Capture {
 protected:
  void SetUp() override {
    ASSERT_TRUE(ok(c.w.run(c.handle, chain_args(a, 3, c.open_gate), capture(1, GetParam()))));
  }

  ChainWorker c;
  Buffers a = make_buffers(c.w, 1);
};

TEST_P(Capture, ReplayComputesWhatAnUncapturedRunComputes) {
  ChainWorker c;
  task::CallConfig plain;
  plain.placement = GetParam();
  Buffers a = make_buffers(c.w, 1), b = make_buffers(c.w, 50), d = make_buffers(c.w, -7);
  ASSERT_TRUE(ok(c.w.run(c.handle, chain_args(a, 3, c.open_gate), capture(1, GetParam()))));
  ASSERT_TRUE(ok(c.w.run(c.handle, chain_args(b, 5, c.open_gate), capture(1, GetParam()))));
  ASSERT_TRUE(ok(c.w.run(c.handle, chain_args(d, 5, c.open_gate), plain)));
  const auto [y, tmp] = chain_reference(b.x_host, c.bias, 5);
  EXPECT_EQ(read(c.w, a.y), chain_reference(a.x_host, c.bias, 3).first);
  EXPECT_EQ(read(c.w, b.y), y);
  EXPECT_EQ(read(c.w, b.tmp), tmp);
  EXPECT_EQ(read(c.w, d.y), chain_reference(d.x_host, c.bias, 5).first);
  const CaptureStats s = c.w.capture_stats();
  EXPECT_EQ(s.graphs, 1);
  EXPECT_EQ(s.captures, 1u);
  EXPECT_EQ(s.replays, 1u);
  EXPECT_TRUE(ok(c.w.close()));
}

TEST_P(Capture, HostInputsAreStagedAfreshForEveryReplay) {
  Worker w(test_options());
  auto affine = w.register_callable(affine_program(3));
  ASSERT_TRUE(ok(w.init()));
  task::CallConfig config = capture(9, GetParam(), /*params=*/1u << 2);
  int64_t in = 5, out = 0;
  ASSERT_TRUE(ok(w.run(*affine, affine_args(&in, &out, 1), config)));
  EXPECT_EQ(out, 16);
  in = 7;
  ASSERT_TRUE(ok(w.run(*affine, affine_args(&in, &out, 2), config)));
  EXPECT_EQ(out, 23);
  EXPECT_EQ(w.capture_stats().replays, 1u);
  EXPECT_TRUE(ok(w.close()));
}

TEST_P(CapturedChain, ABindOfAnotherShapeOrDtypeIsRefusedNamingTheArgument) {
  task::TaskArgs shorter = chain_args(a, 3, c.open_gate);
  shorter[0].tensor = *a.x.tensor({kN / 2}, DataType::kInt64);
  EXPECT_TRUE(fails_with(c.w.submit(c.handle, shorter, capture(1, GetParam())).status(),
                         absl::StatusCode::kInvalidArgument,
                         "argument 0: shape [4] differs from [8] captured under capture key 1 "
                         "of 'chain'"));
  task::TaskArgs other_dtype = chain_args(a, 3, c.open_gate);
  other_dtype[1].tensor = *a.y.tensor({kN}, DataType::kInt32);
  EXPECT_TRUE(fails_with(c.w.submit(c.handle, other_dtype, capture(1, GetParam())).status(),
                         absl::StatusCode::kInvalidArgument,
                         "argument 1: dtype i32 differs from i64 captured under capture key 1"));
  // The graph stays: a run that keeps the contract replays it.
  ASSERT_TRUE(ok(c.w.run(c.handle, chain_args(a, 4, c.open_gate), capture(1, GetParam()))));
  EXPECT_EQ(read(c.w, a.y), chain_reference(a.x_host, c.bias, 4).first);
  EXPECT_EQ(c.w.capture_stats().captures, 1u);
  EXPECT_TRUE(ok(c.w.close()));
}

TEST_P(Capture, ShapeKeyCollisionsAreRefusedAndKeysArePerCallable) {
  Chain chain;
  Worker w(test_options());
  auto first = *w.register_callable(chain.callable("first"));
  auto second = *w.register_callable(chain.callable("second"));
  ASSERT_TRUE(ok(w.init()));
  DeviceBuffer bias = *w.malloc(kN * 8);
  chain.bias->store(bias.address);
  Gate open{true};
  Buffers a = make_buffers(w, 1);
  // Scale is not declared a parameter here: it is part of the shape.
  const uint64_t gate_only = 1u << 4;
  ASSERT_TRUE(ok(w.run(first, chain_args(a, 3, open), capture(5, GetParam(), gate_only))));
  EXPECT_TRUE(fails_with(
      w.submit(first, chain_args(a, 4, open), capture(5, GetParam(), gate_only)).status(),
      absl::StatusCode::kInvalidArgument,
      "argument 3: scalar 4 differs from 3 (a scalar that is not a parameter "
      "is shape) captured under capture key 5 of 'first'"));
  EXPECT_TRUE(fails_with(w.submit(first, chain_args(a, 3, open), capture(5, GetParam())).status(),
                         absl::StatusCode::kInvalidArgument,
                         "CallConfig.capture_scalar_params 0x18 differs from 0x10"));
  // The same key of another callable is another graph.
  ASSERT_TRUE(ok(w.run(second, chain_args(a, 4, open), capture(5, GetParam(), gate_only))));
  EXPECT_EQ(w.capture_stats().captures, 2u);
  EXPECT_EQ(w.capture_stats().replays, 0u);
  EXPECT_TRUE(ok(w.close()));
}

TEST_P(CapturedChain, ChangingHowTheArgumentsOverlapIsRefused) {
  // tmp aliasing y: the captured graph has no dependency for that.
  task::TaskArgs aliased = chain_args(a, 3, c.open_gate);
  aliased[2].tensor = aliased[1].tensor;
  aliased[2].direction = ArgDirection::kInOut;
  EXPECT_TRUE(fails_with(c.w.submit(c.handle, aliased, capture(1, GetParam())).status(),
                         absl::StatusCode::kInvalidArgument, "overlaps argument 1 i64[8]"));
  // Nor may an argument overlap memory the graph uses at a fixed address (the bias).
  task::TaskArgs onto_bias = chain_args(a, 3, c.open_gate);
  onto_bias[1].tensor = *c.bias_buffer.tensor({kN}, DataType::kInt64);
  EXPECT_TRUE(fails_with(c.w.submit(c.handle, onto_bias, capture(1, GetParam())).status(),
                         absl::StatusCode::kInvalidArgument,
                         "overlaps device memory that task 2 argument 0 of the graph uses at a "
                         "fixed address"));
  EXPECT_TRUE(ok(c.w.close()));
}

TEST_P(Capture, ArgumentsThatOverlappedAtCaptureMustOverlapAtTheSameOffset) {
  ChainWorker c;
  DeviceBuffer wide = *c.w.malloc(2 * kN * 8);
  Buffers a = make_buffers(c.w, 1);
  auto at = [&](int64_t element) {
    return *task::Tensor::contiguous(wide.address + element * 8, {kN}, DataType::kInt64);
  };
  // x and y are one range at capture (partly overlapping arguments capture too:
  // PartlyOverlappingArgumentsCaptureAndReplay).
  auto args = [&](int64_t y_from) {
    task::TaskArgs t = chain_args(a, 3, c.open_gate);
    t[0].tensor = at(0);
    t[1].tensor = at(y_from);
    return t;
  };
  ASSERT_TRUE(ok(c.w.run(c.handle, args(0), capture(1, GetParam()))));
  const absl::Status elsewhere = c.w.submit(c.handle, args(2), capture(1, GetParam())).status();
  EXPECT_TRUE(fails_with(elsewhere, absl::StatusCode::kInvalidArgument,
                         "at byte offset 16, but at byte offset 0 when captured"));
  EXPECT_TRUE(contains(elsewhere, "argument 1 i64[8]@")) << elsewhere;
  EXPECT_TRUE(contains(elsewhere, "overlaps argument 0 i64[8]@")) << elsewhere;
  task::TaskArgs apart = args(0);
  apart[0].tensor = *a.x.tensor({kN}, DataType::kInt64);
  EXPECT_TRUE(fails_with(c.w.submit(c.handle, apart, capture(1, GetParam())).status(),
                         absl::StatusCode::kInvalidArgument,
                         "nowhere, but at byte offset 0 when captured"));
  // The same relation at other addresses replays.
  DeviceBuffer other = *c.w.malloc(kN * 8);
  task::TaskArgs moved = args(0);
  moved[0].tensor = *other.tensor({kN}, DataType::kInt64);
  moved[1].tensor = *other.tensor({kN}, DataType::kInt64);
  ASSERT_TRUE(ok(c.w.run(c.handle, moved, capture(1, GetParam()))));
  EXPECT_EQ(c.w.capture_stats().replays, 1u);
  EXPECT_TRUE(ok(c.w.close()));
}

// Two tasks copy the run's arguments 0 and 1 (IN) into arguments 2 and 3 (OUT); with
// `straddle`, task 0 instead reads kN cells from the middle of argument 0 (half of them past
// its end).
task::ChipCallable two_copies_program(bool straddle) {
  return task::ChipCallable{
      straddle ? "straddling_copy" : "two_copies",
      [straddle](task::OrchestrationContext& ctx, const task::TaskArgs& args) -> absl::Status {
        for (size_t i = 0; i < 2; ++i) {
          task::Tensor from = args.tensor(i);
          if (straddle && i == 0) from.address += kN / 2 * 8;
          task::TaskArgs t;
          t.add_tensor(from, ArgDirection::kIn).add_tensor(args.tensor(i + 2), ArgDirection::kOut);
          SIMPLER_RETURN_IF_ERROR(ctx.submit(0, t));
        }
        return absl::OkStatus();
      },
      {{"copy", [](const task::KernelContext& ctx) {
          for (int64_t i = 0; i < ctx.tensor(0).numel(); ++i) {
            cells(ctx.tensor(1))[i] = cells(ctx.tensor(0))[i];
          }
          return absl::OkStatus();
        }}}};
}

// Two windows of one array that overlap in part (HOST: one staging buffer holds both) capture
// and replay, on fresh inputs each time; a task tensor that overlaps a run argument while lying
// inside none is refused at capture.
TEST_P(Capture, PartlyOverlappingArgumentsCaptureAndReplay) {
  Worker w(test_options());
  auto copies = *w.register_callable(two_copies_program(false));
  auto straddling = *w.register_callable(two_copies_program(true));
  ASSERT_TRUE(ok(w.init()));
  std::vector<int64_t> x(kN + 2), out0(kN), out1(kN);
  auto host = [](int64_t* p) {
    return *task::Tensor::contiguous(reinterpret_cast<uintptr_t>(p), {kN}, DataType::kInt64,
                                     task::MemoryKind::kHost);
  };
  task::TaskArgs windows;
  windows.add_tensor(host(x.data()), ArgDirection::kIn)
      .add_tensor(host(x.data() + 2), ArgDirection::kIn)
      .add_tensor(host(out0.data()), ArgDirection::kOut)
      .add_tensor(host(out1.data()), ArgDirection::kOut);
  for (int64_t round = 0; round < 3; ++round) {  // the capture, then two replays
    for (size_t i = 0; i < x.size(); ++i) x[i] = 10 * round + static_cast<int64_t>(i);
    ASSERT_TRUE(ok(w.run(copies, windows, capture(5, GetParam(), 0))));
    for (int64_t i = 0; i < kN; ++i) {
      EXPECT_EQ(out0[i], x[i]) << round;
      EXPECT_EQ(out1[i], x[i + 2]) << round;
    }
  }
  EXPECT_EQ(w.capture_stats().replays, 2u);

  // DEVICE windows of one buffer, side by side: task 0 reads across their boundary.
  DeviceBuffer wide = *w.malloc(2 * kN * 8), o0 = *w.malloc(kN * 8), o1 = *w.malloc(kN * 8);
  auto at = [&](int64_t element) {
    return *task::Tensor::contiguous(wide.address + element * 8, {kN}, DataType::kInt64);
  };
  task::TaskArgs side_by_side;
  side_by_side.add_tensor(at(0), ArgDirection::kIn)
      .add_tensor(at(kN), ArgDirection::kIn)
      .add_tensor(*o0.tensor({kN}, DataType::kInt64), ArgDirection::kOut)
      .add_tensor(*o1.tensor({kN}, DataType::kInt64), ArgDirection::kOut);
  const absl::Status s = w.run(straddling, side_by_side, capture(6, GetParam(), 0));
  EXPECT_TRUE(fails_with(s, absl::StatusCode::kInvalidArgument, "overlaps run argument 0 i64[8]@"))
      << s;
  EXPECT_TRUE(contains(s, "without lying inside it or any other")) << s;
  EXPECT_TRUE(ok(w.close()));
}

TEST_P(Capture, ARunOfManyArgumentsCapturesAndReplaysWithItsOverlapsChecked) {
  // 4,096 device tensor arguments, every second one a view of the one before: a check over all
  // pairs would look at 8 million of them; the sweep sees 2,048 overlaps.
  constexpr int kArgs = 4096;
  Worker w(test_options());
  // One add task: the first argument into the last.
  auto sum = *w.register_callable(
      one_task_program("sum", {"add", add_kernel}, [](const task::TaskArgs& args) {
        return task::TaskArgs()
            .add_tensor(args.tensor(0), ArgDirection::kIn)
            .add_tensor(args.tensor(args.size() - 1), ArgDirection::kInOut);
      }));
  ASSERT_TRUE(ok(w.init()));
  std::vector<DeviceBuffer> bufs;
  for (int b = 0; b < 2; ++b) bufs.push_back(*w.malloc(kArgs / 2 * kN * 8));
  auto args = [&](const DeviceBuffer& buf) {
    task::TaskArgs t;
    for (int i = 0; i < kArgs; ++i) {
      const uint64_t address = buf.address + (i / 2) * kN * 8;
      t.add_tensor(*task::Tensor::contiguous(address, {kN}, DataType::kInt64),
                   i % 2 == 0 ? ArgDirection::kIn : ArgDirection::kInOut);
    }
    return t;
  };
  ASSERT_TRUE(ok(w.run(sum, args(bufs[0]), capture(1, GetParam(), 0))));
  ASSERT_TRUE(ok(w.run(sum, args(bufs[1]), capture(1, GetParam(), 0))));
  EXPECT_EQ(w.capture_stats().replays, 1u);
  task::TaskArgs shifted = args(bufs[1]);
  shifted[kArgs - 1].tensor = shifted[kArgs - 3].tensor;  // now overlaps two arguments
  const absl::Status refused = w.submit(sum, shifted, capture(1, GetParam(), 0)).status();
  EXPECT_TRUE(fails_with(refused, absl::StatusCode::kInvalidArgument,
                         "at byte offset 0, but nowhere when captured"));
  EXPECT_TRUE(contains(refused, "argument 4095 i64[8]@")) << refused;
  EXPECT_TRUE(contains(refused, "overlaps argument 4092 i64[8]@")) << refused;
  EXPECT_TRUE(ok(w.close()));
}

TEST_P(Capture, ADeclaredParameterThatDecidesTheTaskListIsRefusedAtCapture) {
  Worker w(test_options());
  std::atomic<int> counter{0};
  // count_program's scalar is the counter's address, forwarded: a true parameter. A program
  // whose scalar is its task count is not.
  auto counted = *w.register_callable(count_program(2));
  auto looping = *w.register_callable(task::ChipCallable{
      "looping",
      [](task::OrchestrationContext& ctx, const task::TaskArgs& args) -> absl::Status {
        for (int64_t i = 0; i < args.scalar_i64(1); ++i) {
          task::TaskArgs a;
          a.add_scalar_i64(args.scalar_i64(0));
          SIMPLER_RETURN_IF_ERROR(ctx.submit(0, a));
        }
        return absl::OkStatus();
      },
      {{"count", count_kernel}}});
  ASSERT_TRUE(ok(w.init()));
  ASSERT_TRUE(ok(w.run(counted, count_args(counter), capture(1, GetParam(), 1u))));
  ASSERT_TRUE(ok(w.run(counted, count_args(counter), capture(1, GetParam(), 1u))));
  EXPECT_EQ(counter.load(), 4);
  task::TaskArgs args = count_args(counter);
  args.add_scalar_i64(2);
  const absl::Status s = [&] {
    absl::StatusOr<RunHandle> r = w.submit(looping, args, capture(2, GetParam(), 0b11));
    return r.ok() ? r->wait() : r.status();
  }();
  EXPECT_TRUE(fails_with(s, absl::StatusCode::kInvalidArgument,
                         "capture under capture key 2 of 'looping': argument 1 is declared a "
                         "scalar parameter (CallConfig.capture_scalar_params) but the "
                         "orchestration submits 3 tasks with it plus one and 2 without"));
  EXPECT_EQ(w.capture_stats().captures, 1u);
  (void)w.close();
}

TEST_P(Capture, AFaultInAReplayedRunNamesTheSameTaskAndRunAsUncaptured) {
  for (const char* plan : {"run=2:task=3:kind=kernel_error", "run=2:task=5:kind=device_fault"}) {
    SCOPED_TRACE(plan);
    absl::Status uncaptured, replayed;
    for (bool capturing : {false, true}) {
      ChainWorker c(faulty_options(plan, 2));
      Buffers a = make_buffers(c.w, 1);
      task::CallConfig config =
          capture(capturing ? 3 : 0, GetParam(), capturing ? kChainParams : 0);
      ASSERT_TRUE(ok(c.w.run(c.handle, chain_args(a, 3, c.open_gate), config)));
      ASSERT_TRUE(ok(c.w.run(c.handle, chain_args(a, 4, c.open_gate), config)));
      absl::StatusOr<RunHandle> r = c.w.submit(c.handle, chain_args(a, 5, c.open_gate), config);
      ASSERT_TRUE(ok(r.status()));
      (capturing ? replayed : uncaptured) = r->wait();
      EXPECT_EQ(c.w.capture_stats().replays, capturing ? 2u : 0u);
      (void)c.w.close();
    }
    EXPECT_FALSE(replayed.ok());
    EXPECT_EQ(replayed.code(), uncaptured.code());
    EXPECT_EQ(replayed.message(), uncaptured.message());
    EXPECT_EQ(base::is_unrecoverable(replayed), base::is_unrecoverable(uncaptured));
    EXPECT_TRUE(contains(replayed, "run 2 task ")) << replayed;
  }
}

TEST_P(Capture, FreeingABufferBoundIntoAnInFlightReplayIsRefusedNamingTheRun) {
  ChainWorker c;
  Buffers a = make_buffers(c.w, 1), b = make_buffers(c.w, 2);
  ASSERT_TRUE(ok(c.w.run(c.handle, chain_args(a, 3, c.open_gate), capture(1, GetParam()))));
  Gate gate;
  RunHandle r = *c.w.submit(c.handle, chain_args(b, 3, gate), capture(1, GetParam()));
  // A slot-bound argument and the graph's fixed memory are both protected until it retires.
  EXPECT_TRUE(
      fails_with(c.w.free(b.x), absl::StatusCode::kFailedPrecondition, "is in use by run 1"));
  EXPECT_TRUE(fails_with(c.w.free(c.bias_buffer), absl::StatusCode::kFailedPrecondition,
                         "is in use by run 1"));
  gate.open();
  ASSERT_TRUE(ok(r.wait()));
  EXPECT_EQ(read(c.w, b.y), chain_reference(b.x_host, c.bias, 3).first);
  // The graph keeps no claim on what was bound into it.
  EXPECT_TRUE(ok(c.w.free(b.x)));
  EXPECT_TRUE(ok(c.w.close()));
}

TEST_P(CapturedChain, FreeingFixedMemoryOfACachedGraphDropsItAndTheNextSubmitCapturesAgain) {
  DeviceBuffer new_bias = *c.w.malloc(kN * 8);
  std::vector<int64_t> values(kN, 1000);
  ASSERT_TRUE(ok(c.w.copy_to(new_bias, values.data(), kN * 8)));
  c.chain.bias->store(new_bias.address);
  // No run uses the old bias: the free succeeds and drops the graph that names it, so memory
  // allocated there later is never mistaken for it.
  ASSERT_TRUE(ok(c.w.free(c.bias_buffer)));
  EXPECT_EQ(c.w.capture_stats().graphs, 0);
  EXPECT_EQ(c.w.capture_stats().evictions, 1u);
  ASSERT_TRUE(ok(c.w.run(c.handle, chain_args(a, 3, c.open_gate), capture(1, GetParam()))));
  EXPECT_EQ(read(c.w, a.y), chain_reference(a.x_host, values, 3).first);
  EXPECT_EQ(c.w.capture_stats().captures, 2u);
  // Freed behind the Worker (through the device): the next replay finds it dead and is refused.
  ASSERT_TRUE(ok(c.w.device().free(new_bias.address)));
  EXPECT_TRUE(fails_with(
      c.w.submit(c.handle, chain_args(a, 3, c.open_gate), capture(1, GetParam())).status(),
      absl::StatusCode::kFailedPrecondition,
      "(task 2 argument 0) at a fixed address that is no longer a live allocation"));
  EXPECT_EQ(c.w.capture_stats().graphs, 0);
  EXPECT_TRUE(ok(c.w.close()));
}

// 2 MiB: the sim device maps allocations this large, and the kernel hands the address just
// unmapped out again, so a test can allocate memory at a freed address.
constexpr uint64_t kMappedBytes = 2u << 20;

// Allocates kMappedBytes through `malloc` until one lands at `address` (at most 16 tries, the
// misses kept in `misses`); `address` on success, else the last address allocated.
template <typename Malloc>
uint64_t allocate_at(uint64_t address, Malloc malloc, std::vector<uint64_t>* misses) {
  for (int i = 0; i < 16; ++i) {
    const uint64_t got = malloc();
    if (got == address) return got;
    misses->push_back(got);
  }
  return misses->empty() ? 0 : misses->back();
}

TEST_P(Capture, FixedMemoryFreedBehindTheWorkerAndAllocatedAgainAtItsAddressIsFoundAtReplay) {
  ChainWorker c;
  device::Device& d = c.w.device();
  const uint64_t bias = *d.malloc(kMappedBytes);
  ASSERT_TRUE(ok(d.copy_to_device(bias, c.bias.data(), kN * 8)));
  c.chain.bias->store(bias);
  Buffers a = make_buffers(c.w, 1);
  ASSERT_TRUE(ok(c.w.run(c.handle, chain_args(a, 3, c.open_gate), capture(1, GetParam()))));
  // A replay finds the fixed memory live; replays after it look it up again only once the
  // device's free count moved (Device::free_count), as it does below.
  ASSERT_TRUE(ok(c.w.run(c.handle, chain_args(a, 3, c.open_gate), capture(1, GetParam()))));
  ASSERT_EQ(c.w.capture_stats().replays, 1u);
  // Freed and allocated again at the same address: a live allocation, but not the one captured.
  ASSERT_TRUE(ok(d.free(bias)));
  std::vector<uint64_t> misses;
  ASSERT_EQ(allocate_at(
                bias, [&] { return *d.malloc(kMappedBytes); }, &misses),
            bias);
  EXPECT_TRUE(fails_with(
      c.w.submit(c.handle, chain_args(a, 3, c.open_gate), capture(1, GetParam())).status(),
      absl::StatusCode::kFailedPrecondition,
      "(task 2 argument 0) at a fixed address whose allocation was freed and allocated again "
      "since the capture"));
  EXPECT_EQ(c.w.capture_stats().graphs, 0);
  // The next submit under the key captures again, over what is there now.
  const std::vector<int64_t> values(kN, 7);
  ASSERT_TRUE(ok(d.copy_to_device(bias, values.data(), kN * 8)));
  ASSERT_TRUE(ok(c.w.run(c.handle, chain_args(a, 3, c.open_gate), capture(1, GetParam()))));
  EXPECT_EQ(read(c.w, a.y), chain_reference(a.x_host, values, 3).first);
  EXPECT_EQ(c.w.capture_stats().captures, 2u);
  EXPECT_EQ(c.w.capture_stats().replays, 1u);
  EXPECT_TRUE(ok(c.w.close()));
}

TEST_P(Capture, FixedMemoryFreedWhileItsGraphIsCapturedKeepsTheGraphOutOfTheCache) {
  Chain chain;
  Worker w(test_options(2));
  CallableHandle handle = *w.register_callable(chain.callable());
  CallableHandle gate_handle = *w.register_callable(gate_program());
  ASSERT_TRUE(ok(w.init()));
  std::vector<int64_t> values(kN);
  for (int64_t i = 0; i < kN; ++i) values[i] = 100 + i;
  DeviceBuffer bias = *w.malloc(kMappedBytes);
  ASSERT_TRUE(ok(w.copy_to(bias, values.data(), kN * 8)));
  chain.bias->store(bias.address);
  Buffers a = make_buffers(w, 1);
  Gate held_gate, open{true};
  // Opened however the test ends, so no kernel is left waiting on the device.
  struct OpenAtExit {
    Gate& gate;
    ~OpenAtExit() { gate.open(); }
  } open_at_exit{held_gate};
  // The capturing run executes behind a run held at its gate (the stream runs one item at a
  // time). Host-built, its graph was built at submit over the first bias allocation;
  // device-built, its orchestration runs after the free, over the second one, which was
  // allocated after the run was submitted.
  RunHandle held = *w.submit(gate_handle, gate_args(held_gate));
  RunHandle capturing = *w.submit(handle, chain_args(a, 3, open), capture(1, GetParam()));
  // The capturing run does not hold the memory its orchestration captured: the free succeeds,
  // and the buffer allocated in its place is not what the graph may be kept over.
  ASSERT_TRUE(ok(w.free(bias)));
  std::vector<uint64_t> misses;
  ASSERT_EQ(allocate_at(
                bias.address, [&] { return w.malloc(kMappedBytes)->address; }, &misses),
            bias.address);
  for (int64_t i = 0; i < kN; ++i) values[i] = 9;
  // Through the device: Worker::copy_to would wait for the held run.
  ASSERT_TRUE(ok(w.device().copy_to_device(bias.address, values.data(), kN * 8)));
  held_gate.open();
  ASSERT_TRUE(ok(held.wait()));
  ASSERT_TRUE(ok(capturing.wait()));
  EXPECT_EQ(read(w, a.y), chain_reference(a.x_host, values, 3).first);
  CaptureStats s = w.capture_stats();
  EXPECT_EQ(s.graphs, 0);
  EXPECT_EQ(s.captures, 0u);
  EXPECT_EQ(s.stale_captures, 1u);
  // The next run under the key captures again rather than replaying a stale graph.
  ASSERT_TRUE(ok(w.run(handle, chain_args(a, 4, open), capture(1, GetParam()))));
  EXPECT_EQ(read(w, a.y), chain_reference(a.x_host, values, 4).first);
  s = w.capture_stats();
  EXPECT_EQ(s.captures, 1u);
  EXPECT_EQ(s.replays, 0u);
  EXPECT_TRUE(ok(w.close()));
}

TEST_P(Capture, EvictionWhileAReplayIsInFlightNeverFreesItsGraph) {
  WorkerOptions o = test_options(2, 3);
  o.max_captured_graphs = 1;
  ChainWorker c(o);
  Buffers a = make_buffers(c.w, 1), b = make_buffers(c.w, 2), d = make_buffers(c.w, 3);
  ASSERT_TRUE(ok(c.w.run(c.handle, chain_args(a, 3, c.open_gate), capture(1, GetParam()))));
  Gate capture_gate, replay_gate;
  RunHandle capturing =
      *c.w.submit(c.handle, chain_args(b, 4, capture_gate), capture(2, GetParam()));
  RunHandle replay = *c.w.submit(c.handle, chain_args(d, 5, replay_gate), capture(1, GetParam()));
  capture_gate.open();
  ASSERT_TRUE(ok(capturing.wait()));  // key 2 enters the cache and evicts key 1 under the replay
  CaptureStats s = c.w.capture_stats();
  EXPECT_EQ(s.graphs, 1);
  EXPECT_EQ(s.evictions, 1u);
  EXPECT_EQ(s.evicted_in_use, 1);
  replay_gate.open();
  ASSERT_TRUE(ok(replay.wait()));
  EXPECT_EQ(read(c.w, d.y), chain_reference(d.x_host, c.bias, 5).first);
  EXPECT_EQ(c.w.capture_stats().evicted_in_use, 0);
  EXPECT_TRUE(ok(c.w.close()));
}

TEST_P(Capture, ConcurrentReplaysFromTwoThreadsComputeTheirOwnResults) {
  ChainWorker c(test_options(2, 4));
  Buffers first = make_buffers(c.w, 0);
  ASSERT_TRUE(ok(c.w.run(c.handle, chain_args(first, 1, c.open_gate), capture(1, GetParam()))));
  std::vector<Buffers> bufs = {make_buffers(c.w, 10), make_buffers(c.w, 20)};
  std::vector<std::thread> threads;
  for (int t = 0; t < 2; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 20; ++i) {
        EXPECT_TRUE(
            ok(c.w.run(c.handle, chain_args(bufs[t], i, c.open_gate), capture(1, GetParam()))));
        EXPECT_EQ(read(c.w, bufs[t].y), chain_reference(bufs[t].x_host, c.bias, i).first);
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(c.w.capture_stats().replays, 40u);
  EXPECT_TRUE(ok(c.w.close()));
}

// A resource set keeps a replay's bound arguments (and host-built image) for its next replay of
// the same graph, which rewrites only what changes. With one resource set every run below
// prepares in the same set: a replay that trusted what another program's run or another graph
// left there would compute that run's result (or fail).
TEST_P(Capture, ReplaysAmongOtherRunsInOneResourceSetComputeTheirOwnResults) {
  Chain chain, other;
  Worker w(test_options(/*depth=*/1, /*grant=*/1));
  const CallableHandle first = *w.register_callable(chain.callable());
  const CallableHandle second = *w.register_callable(other.callable("other"));
  constexpr int kTwiceTasks = 3;
  const CallableHandle twice = *w.register_callable(task::ChipCallable{
      "twice",
      [](task::OrchestrationContext& ctx, const task::TaskArgs& args) -> absl::Status {
        for (int i = 0; i < kTwiceTasks; ++i) {
          task::TaskArgs a;
          a.add_tensor(args.tensor(0), ArgDirection::kInOut);
          SIMPLER_RETURN_IF_ERROR(ctx.submit(0, a));
        }
        return absl::OkStatus();
      },
      {{"twice", twice_kernel}}});
  ASSERT_TRUE(ok(w.init()));
  std::vector<int64_t> bias_host[2];
  DeviceBuffer bias[2];
  for (int g = 0; g < 2; ++g) {
    for (int64_t i = 0; i < kN; ++i) bias_host[g].push_back(100 * (g + 1) + i);
    bias[g] = *w.malloc(kN * 8);
    ASSERT_TRUE(ok(w.copy_to(bias[g], bias_host[g].data(), kN * 8)));
  }
  chain.bias->store(bias[0].address);
  other.bias->store(bias[1].address);
  Gate open{true};
  task::CallConfig plain;
  plain.placement = GetParam();
  // 'c': the chain under key 1, 'o': the other chain under key 2, 't': twice, uncaptured.
  const std::string order = "cctcoocto";
  for (size_t step = 0; step < order.size(); ++step) {
    const int64_t scale = static_cast<int64_t>(step) + 2;
    if (order[step] == 't') {
      DeviceBuffer t = *w.malloc(kN * 8);
      std::vector<int64_t> v(kN, static_cast<int64_t>(step));
      ASSERT_TRUE(ok(w.copy_to(t, v.data(), kN * 8)));
      task::TaskArgs a;
      a.add_tensor(*t.tensor({kN}, DataType::kInt64), ArgDirection::kInOut);
      ASSERT_TRUE(ok(w.run(twice, a, plain))) << step;
      for (int i = 0; i < kTwiceTasks; ++i) {
        for (int64_t& x : v) x = 2 * x + 1;
      }
      EXPECT_EQ(read(w, t), v) << "step " << step;
      continue;
    }
    const int g = order[step] == 'c' ? 0 : 1;
    Buffers b = make_buffers(w, 10 * static_cast<int64_t>(step) - 5);
    ASSERT_TRUE(
        ok(w.run(g == 0 ? first : second, chain_args(b, scale, open), capture(g + 1, GetParam()))))
        << step;
    const auto [y, tmp] = chain_reference(b.x_host, bias_host[g], scale);
    EXPECT_EQ(read(w, b.y), y) << "step " << step;
    EXPECT_EQ(read(w, b.tmp), tmp) << "step " << step;
  }
  const CaptureStats s = w.capture_stats();
  EXPECT_EQ(s.captures, 2u);
  EXPECT_EQ(s.replays, 5u);  // 7 chain runs, 2 of them captures
  EXPECT_TRUE(ok(w.close()));
}

std::string placement_name(const ::testing::TestParamInfo<GraphPlacement>& info) {
  return info.param == GraphPlacement::kHost ? "HostBuilt" : "DeviceBuilt";
}

INSTANTIATE_TEST_SUITE_P(Placements, Capture,
                         ::testing::Values(GraphPlacement::kDevice, GraphPlacement::kHost),
                         placement_name);
INSTANTIATE_TEST_SUITE_P(Placements, CapturedChain,
                         ::testing::Values(GraphPlacement::kDevice, GraphPlacement::kHost),
                         placement_name);

TEST(CaptureDeviceBuilt, ACaptureThatFailsAfterTheRunCopiesBackItsHostOutputsAndFailsTheRun) {
  Worker w(test_options());
  // Its scalar is declared a parameter but the orchestration doubles it: the probe, run when the
  // device-built capture is built after the run, refuses the graph.
  auto doubling = *w.register_callable(
      one_task_program("doubling", {"affine", affine_kernel}, [](const task::TaskArgs& args) {
        return task::TaskArgs()
            .add_tensor(args.tensor(0), ArgDirection::kIn)
            .add_tensor(args.tensor(1), ArgDirection::kOut)
            .add_scalar_i64(2 * args.scalar_i64(2));
      }));
  ASSERT_TRUE(ok(w.init()));
  int64_t in = 5, out = 0;
  RunHandle r =
      *w.submit(doubling, affine_args(&in, &out, 4), capture(1, GraphPlacement::kDevice, 1u << 2));
  const RunResult& res = r.result();
  EXPECT_TRUE(fails_with(res.status, absl::StatusCode::kInvalidArgument,
                         "run 0 capture under capture key 1 of 'doubling': argument 2 is declared "
                         "a scalar parameter (CallConfig.capture_scalar_params) but task 0 "
                         "argument 2 changes with it without being equal to it"));
  EXPECT_EQ(res.terminal_state, RunState::kFailed);
  EXPECT_EQ(out, 3 * 5 + 2 * 4);  // the run computed it; only its capture failed
  EXPECT_EQ(w.capture_stats().graphs, 0);
  (void)w.close();
}

TEST(CaptureConfig, ScalarParametersMustNameScalarsOfARunWithACaptureKey) {
  Worker w(test_options());
  auto affine = w.register_callable(affine_program());
  ASSERT_TRUE(ok(w.init()));
  int64_t in = 1, out = 0;
  task::CallConfig c;
  c.capture_scalar_params = 1u << 2;
  EXPECT_TRUE(fails_with(w.submit(*affine, affine_args(&in, &out, 1), c).status(),
                         absl::StatusCode::kInvalidArgument,
                         "CallConfig.capture_scalar_params is set without a capture_key"));
  c.capture_key = 1;
  c.capture_scalar_params = 1u;
  EXPECT_TRUE(fails_with(w.submit(*affine, affine_args(&in, &out, 1), c).status(),
                         absl::StatusCode::kInvalidArgument,
                         "CallConfig.capture_scalar_params bit 0: argument 0 is not a scalar"));
  c.capture_scalar_params = 1u << 5;
  EXPECT_TRUE(fails_with(w.submit(*affine, affine_args(&in, &out, 1), c).status(),
                         absl::StatusCode::kInvalidArgument,
                         "CallConfig.capture_scalar_params bit 5: the run has 3 arguments"));
  EXPECT_TRUE(ok(w.close()));
}

TEST(CaptureConfig, AWorkerKeepsAtLeastOneCapturedGraph) {
  WorkerOptions o = test_options();
  o.max_captured_graphs = 0;
  Worker w(o);
  EXPECT_TRUE(fails_with(w.init(), absl::StatusCode::kInvalidArgument,
                         "WorkerOptions.max_captured_graphs 0 < 1"));
}

}  // namespace
}  // namespace simpler::worker::testing
