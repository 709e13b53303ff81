#include "chip/chip_runtime.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "simpler/base/status.h"

namespace simpler::chip {
namespace {

using task::ArgDirection;
using task::DataType;
using task::Tensor;

class ChipRuntimeTest : public ::testing::Test {
 protected:
  void SetUp() override { make_device(4, {}); }
  void make_device(int cores, device::FaultPlan faults) {
    if (dev_) dev_->close();
    device::SimDeviceOptions o;
    o.num_cores = cores;
    o.faults = std::move(faults);
    dev_ = std::move(device::create_sim_device(o)).value();
    stream_ = *dev_->create_stream();
  }
  absl::Status run(const task::ChipCallable& c, uint64_t run_id = 0, ChipOptions opt = {},
                   int32_t max_cores = 0) {
    report_ = RunReport{};
    task::TaskArgs none;
    auto rec = stream_->launch(run_id, [&](device::ExecContext& ctx) {
      return execute_run(ctx, c, none, opt, max_cores, true, &report_);
    });
    EXPECT_TRUE(rec.ok());
    (*rec)->done.wait(base::Deadline::forever());
    return (*rec)->done.status();
  }
  Tensor buffer(int64_t n) {
    uint64_t a = *dev_->malloc(n * 4);
    return *Tensor::contiguous(a, {n}, DataType::kInt32);
  }
  // `c` recorded on the host (no arguments, 4 cores), its ranges checked by the device.
  absl::StatusOr<GraphRecording> record_on_host(const task::ChipCallable& c) {
    return record_graph(c, task::TaskArgs{}, ChipOptions{}, 4, 0,
                        [this](uint64_t a, uint64_t b) { return dev_->check_range(a, b); });
  }
  std::unique_ptr<device::Device> dev_;
  device::Stream* stream_ = nullptr;
  RunReport report_;
};

// out[0] = in[0] + 1 (with a short busy loop so concurrency shows).
absl::Status inc(const task::KernelContext& ctx) {
  const int32_t v = ctx.tensor(0).data<int32_t>()[0];
  volatile int spin = 0;
  for (int i = 0; i < 2000; ++i) spin = spin + 1;
  ctx.tensor(1).data<int32_t>()[0] = v + 1;
  return absl::OkStatus();
}

// Writes block_idx into its element.
absl::Status spmd_fill(const task::KernelContext& ctx) {
  ctx.tensor(0).data<int32_t>()[ctx.block_idx] = ctx.block_idx * 10;
  return absl::OkStatus();
}

absl::Status fails(const task::KernelContext&) {
  return absl::InvalidArgumentError("bad tile shape");
}

// One task of kernel 0 of `kernels` with `t` as its OUT argument, in `block_dim` blocks.
task::ChipCallable one_out_task(std::string name, Tensor t, std::vector<task::Kernel> kernels,
                                int32_t block_dim = 1) {
  return {std::move(name),
          [t, block_dim](task::OrchestrationContext& ctx, const task::TaskArgs&) {
            task::TaskArgs a;
            a.add_tensor(t, ArgDirection::kOut);
            return ctx.submit(0, a, block_dim);
          },
          std::move(kernels)};
}

// `steps` rounds of one inc task per buffer of `bufs`, each buffer in -> out on itself: a chain
// of RAW dependencies per buffer, the chains independent.
task::ChipCallable inc_chains(std::string name, std::vector<Tensor> bufs, int steps,
                              std::vector<task::Kernel> kernels = {{"inc", inc}}) {
  return {std::move(name),
          [bufs = std::move(bufs), steps](task::OrchestrationContext& ctx, const task::TaskArgs&) {
            for (int step = 0; step < steps; ++step) {
              for (const Tensor& b : bufs) {
                task::TaskArgs a;
                a.add_tensor(b, ArgDirection::kIn).add_tensor(b, ArgDirection::kOut);
                SIMPLER_RETURN_IF_ERROR(ctx.submit(0, a));
              }
            }
            return absl::OkStatus();
          },
          std::move(kernels)};
}

TEST_F(ChipRuntimeTest, ChainOfRawDependenciesRunsInOrder) {
  Tensor b = buffer(1);
  ASSERT_TRUE(run(inc_chains("chain", {b}, 200)).ok());
  EXPECT_EQ(b.data<int32_t>()[0], 200);
  EXPECT_EQ(report_.tasks_completed, 200u);
  ASSERT_EQ(report_.tasks.size(), 200u);
  for (size_t i = 1; i < report_.tasks.size(); ++i) {
    EXPECT_GE(report_.tasks[i].start_ns, report_.tasks[i - 1].end_ns);
  }
}

TEST_F(ChipRuntimeTest, WarIsRespected) {
  // Task 0 reads x into y; task 1 overwrites x. y must hold the old x + 1.
  Tensor x = buffer(1), y = buffer(1);
  x.data<int32_t>()[0] = 41;
  task::ChipCallable c{"war",
                       [&](task::OrchestrationContext& ctx, const task::TaskArgs&) {
                         task::TaskArgs a, b;
                         a.add_tensor(x, ArgDirection::kIn).add_tensor(y, ArgDirection::kOut);
                         b.add_tensor(y, ArgDirection::kIn).add_tensor(x, ArgDirection::kOut);
                         SIMPLER_RETURN_IF_ERROR(ctx.submit(0, a));
                         return ctx.submit(0, b);
                       },
                       {{"inc", inc}}};
  ASSERT_TRUE(run(c).ok());
  EXPECT_EQ(y.data<int32_t>()[0], 42);
  EXPECT_EQ(x.data<int32_t>()[0], 43);
}

TEST_F(ChipRuntimeTest, SpmdTaskRunsEveryBlock) {
  Tensor b = buffer(37);
  ASSERT_TRUE(run(one_out_task("spmd", b, {{"fill", spmd_fill}}, 37)).ok());
  for (int i = 0; i < 37; ++i) EXPECT_EQ(b.data<int32_t>()[i], i * 10);
}

// Counts its block on its task's shared line 0 (out[block] = the count before it, -1 without
// lines) and on its own line (out[block_dim + block] = the count before it, which no other block
// touches): the lines KernelContext::task_lines promises, block_dim of them.
absl::Status count_on_lines(const task::KernelContext& ctx) {
  int32_t* out = ctx.tensor(0).data<int32_t>();
  if (ctx.task_lines == nullptr) {
    out[ctx.block_idx] = -1;
    return absl::OkStatus();
  }
  volatile int spin = 0;  // long enough that a task's blocks overlap another task's
  for (int i = 0; i < 5000; ++i) spin = spin + 1;
  out[ctx.block_idx] = static_cast<int32_t>(ctx.task_lines[0].word.fetch_add(1));
  if (ctx.block_idx > 0) {
    out[ctx.block_dim + ctx.block_idx] =
        static_cast<int32_t>(ctx.task_lines[ctx.block_idx].word.fetch_add(7));
  }
  return absl::OkStatus();
}

// `tasks` independent tasks of count_on_lines, task i writing bufs[i] in block_dim[i] blocks.
task::ChipCallable line_counting(std::vector<Tensor> bufs, std::vector<int32_t> block_dims) {
  return {"lines",
          [bufs, block_dims](task::OrchestrationContext& ctx, const task::TaskArgs&) {
            for (size_t i = 0; i < bufs.size(); ++i) {
              task::TaskArgs a;
              a.add_tensor(bufs[i], ArgDirection::kOut);
              SIMPLER_RETURN_IF_ERROR(ctx.submit(0, a, block_dims[i]));
            }
            return absl::OkStatus();
          },
          {{"count_on_lines", count_on_lines}}};
}

// Writes into every line of its task, then fails in block 0: its run stops dispatching with some
// of the task's 8 blocks never started, so the task never gives its lines back.
absl::Status dirty_lines_then_fail(const task::KernelContext& ctx) {
  for (int32_t i = 0; i < ctx.block_dim; ++i) ctx.task_lines[i].word.store(0xBAD);
  if (ctx.block_idx == 0) return absl::InternalError("block 0 fails after dirtying its lines");
  return absl::OkStatus();
}

// Every block of a task of several blocks sees the same block_dim lines, zero when its first block
// starts: the blocks' counts on line 0 are 0..block_dim-1 once each, and each block's own line
// was 0. Tasks running at once get their own lines and a task after them lines zeroed again
// (24 tasks on 4 cores reuse them); a one-block task sees none; a run after one that failed with
// a task's lines written and not given back (some of its blocks never ran) gets zeroed lines.
// Orchestrated and replayed.
TEST_F(ChipRuntimeTest, TheBlocksOfATaskShareTheirOwnZeroedLines) {
  std::vector<Tensor> bufs;
  std::vector<int32_t> dims;
  for (int i = 0; i < 24; ++i) {
    dims.push_back(i % 6 == 5 ? 1 : 2 + i % 5);
    bufs.push_back(buffer(2 * dims.back()));
  }
  const task::ChipCallable c = line_counting(bufs, dims);
  auto check = [&](const char* how) {
    for (size_t i = 0; i < bufs.size(); ++i) {
      const int32_t* out = bufs[i].data<int32_t>();
      if (dims[i] == 1) {
        EXPECT_EQ(out[0], -1) << how << ": task " << i << " of one block has lines";
        continue;
      }
      std::vector<int32_t> counts(out, out + dims[i]);
      std::sort(counts.begin(), counts.end());
      for (int32_t b = 0; b < dims[i]; ++b) {
        EXPECT_EQ(counts[b], b) << how << ": task " << i << ", " << dims[i] << " blocks";
      }
      for (int32_t b = 1; b < dims[i]; ++b) {
        EXPECT_EQ(out[dims[i] + b], 0) << how << ": task " << i << ", block " << b;
      }
    }
  };
  const task::ChipCallable fails =
      one_out_task("fails", buffer(1), {{"dirty_lines_then_fail", dirty_lines_then_fail}}, 8);
  for (int round = 0; round < 3; ++round) {  // a run after another reuses the kept lines
    if (round == 1) {
      ASSERT_FALSE(run(fails).ok());
    }
    for (const Tensor& b : bufs) std::fill_n(b.data<int32_t>(), b.shape[0], -9);
    ASSERT_TRUE(run(c).ok());
    check("orchestrated");
  }
  auto replay = [&](const task::ChipCallable& callable) -> absl::Status {
    absl::StatusOr<GraphRecording> g = record_on_host(callable);
    if (!g.ok()) return g.status();
    g->link_successors();
    auto rec = stream_->launch(9, [&](device::ExecContext& ctx) {
      return execute_recorded(ctx, callable, *g, g->args.data(), ChipOptions{}, 0, true, &report_);
    });
    if (!rec.ok()) return rec.status();
    (*rec)->done.wait(base::Deadline::forever());
    return (*rec)->done.status();
  };
  for (int round = 0; round < 3; ++round) {
    if (round == 1) {
      ASSERT_FALSE(replay(fails).ok());
    }
    for (const Tensor& b : bufs) std::fill_n(b.data<int32_t>(), b.shape[0], -9);
    const absl::Status replayed = replay(c);
    ASSERT_TRUE(replayed.ok()) << replayed;
    check("replayed");
  }
}

// Each block of an SPMD task is timed on its own core (RunReport::blocks): every block once, its
// core's blocks one after another, and the task's timing spanning its blocks' first start to
// their last end.
TEST_F(ChipRuntimeTest, EveryBlockOfAnSpmdTaskIsTimedOnTheCoreThatRanIt) {
  Tensor b = buffer(37);
  ASSERT_TRUE(run(one_out_task("spmd", b, {{"fill", spmd_fill}}, 37)).ok());
  ASSERT_EQ(report_.tasks.size(), 1u);
  ASSERT_EQ(report_.blocks.size(), 37u);
  std::vector<int> seen(37, 0);
  std::map<int32_t, std::vector<BlockTiming>> by_core;
  int64_t first_start = INT64_MAX, last_end = 0;
  for (const BlockTiming& t : report_.blocks) {
    ASSERT_GE(t.block, 0);
    ASSERT_LT(t.block, 37);
    ++seen[static_cast<size_t>(t.block)];
    EXPECT_EQ(t.task, 0u);
    EXPECT_EQ(t.kernel, 0u);
    EXPECT_EQ(t.block_dim, 37);
    EXPECT_GE(t.core, 0);
    EXPECT_LT(t.core, 4);
    EXPECT_LE(t.start_ns, t.end_ns);
    first_start = std::min(first_start, t.start_ns);
    last_end = std::max(last_end, t.end_ns);
    by_core[t.core].push_back(t);
  }
  EXPECT_EQ(seen, std::vector<int>(37, 1));
  EXPECT_EQ(report_.tasks[0].start_ns, first_start);
  EXPECT_EQ(report_.tasks[0].end_ns, last_end);
  for (auto& [core, blocks] : by_core) {  // a core runs one block at a time
    std::sort(blocks.begin(), blocks.end(),
              [](const BlockTiming& x, const BlockTiming& y) { return x.start_ns < y.start_ns; });
    for (size_t i = 1; i < blocks.size(); ++i) {
      EXPECT_GE(blocks[i].start_ns, blocks[i - 1].end_ns)
          << "core " << core << ", blocks " << blocks[i - 1].block << " and " << blocks[i].block;
    }
  }
}

TEST_F(ChipRuntimeTest, RingBackpressureKeepsResultsExact) {
  // 16 independent chains of 64 through a 4-slot ring.
  std::vector<Tensor> bufs;
  for (int i = 0; i < 16; ++i) bufs.push_back(buffer(1));
  ChipOptions opt;
  opt.ring_capacity = 4;
  ASSERT_TRUE(run(inc_chains("ring", bufs, 64), 0, opt).ok());
  for (auto& b : bufs) EXPECT_EQ(b.data<int32_t>()[0], 64);
}

TEST_F(ChipRuntimeTest, RunsOnOneStreamEachStartFromAFreshGraph) {
  // The scheduler thread keeps its executor storage between runs: a large run
  // that grew the ring, a failed run, a run with a smaller ring capacity and a
  // plain chain, one after another on the same stream, each give exact results
  // and number their tasks from 0.
  auto chains = [](const std::vector<Tensor>& bufs, int steps) {
    return inc_chains("chains", bufs, steps, {{"inc", inc}, {"fails", fails}});
  };
  auto expect_fresh_numbering = [&](uint64_t tasks) {
    ASSERT_EQ(report_.tasks.size(), tasks);
    std::vector<bool> seen(tasks, false);
    for (const auto& t : report_.tasks) {
      ASSERT_LT(t.task, tasks);
      seen[t.task] = true;
    }
    EXPECT_EQ(std::count(seen.begin(), seen.end(), true), static_cast<int64_t>(tasks));
  };
  std::vector<Tensor> wide;
  for (int i = 0; i < 64; ++i) wide.push_back(buffer(1));
  auto big = chains(wide, 40);  // 2560 tasks: the ring grows
  ASSERT_TRUE(run(big, 1).ok());
  for (auto& b : wide) EXPECT_EQ(b.data<int32_t>()[0], 40);
  expect_fresh_numbering(2560);

  Tensor f = buffer(1);
  task::ChipCallable failing{
      "failing",
      [&](task::OrchestrationContext& ctx, const task::TaskArgs&) {
        for (int i = 0; i < 10; ++i) {
          task::TaskArgs a;
          a.add_tensor(f, ArgDirection::kIn).add_tensor(f, ArgDirection::kOut);
          SIMPLER_RETURN_IF_ERROR(ctx.submit(i == 5 ? 1 : 0, a));
        }
        return absl::OkStatus();
      },
      {{"inc", inc}, {"fails", fails}}};
  EXPECT_FALSE(run(failing, 2).ok());

  std::vector<Tensor> narrow;
  for (int i = 0; i < 3; ++i) narrow.push_back(buffer(1));
  ChipOptions small;
  small.ring_capacity = 4;
  auto through_small_ring = chains(narrow, 20);
  ASSERT_TRUE(run(through_small_ring, 3, small).ok());
  for (auto& b : narrow) EXPECT_EQ(b.data<int32_t>()[0], 20);
  expect_fresh_numbering(60);

  std::vector<Tensor> one{buffer(1)};
  auto chain = chains(one, 7);
  ASSERT_TRUE(run(chain, 4).ok());
  EXPECT_EQ(one[0].data<int32_t>()[0], 7);
  expect_fresh_numbering(7);
}

TEST_F(ChipRuntimeTest, TaskThatCanNeverFitFailsAtOnce) {
  Tensor b = buffer(1);
  ChipOptions opt;
  opt.max_task_args = 4;
  std::atomic<int> submitted_after{0};
  task::ChipCallable c{"oversize",
                       [&](task::OrchestrationContext& ctx, const task::TaskArgs&) {
                         task::TaskArgs a;
                         for (int i = 0; i < 6; ++i) a.add_tensor(b, ArgDirection::kIn);
                         absl::Status s = ctx.submit(0, a);
                         if (s.ok()) submitted_after++;
                         return s;
                       },
                       {{"inc", inc}}};
  absl::Status s = run(c, 7, opt);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(
      s.message().find("run 7 task 0 (kernel 'inc') has 6 arguments; a task ring slot holds 4"),
      std::string_view::npos)
      << s.message();
  EXPECT_EQ(submitted_after.load(), 0);
}

TEST_F(ChipRuntimeTest, TensorOutsideLiveAllocationIsRefusedAtSubmit) {
  Tensor b = buffer(4);
  Tensor bad = b;
  bad.shape[0] = 5;
  absl::Status s = run(one_out_task("oob", bad, {{"fill", spmd_fill}}), 2);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("run 2 task 0 (kernel 'fill') argument 0"), std::string_view::npos)
      << s.message();
  EXPECT_NE(s.message().find("overruns allocation"), std::string_view::npos);
}

TEST_F(ChipRuntimeTest, KernelErrorNamesRunTaskAndKernel) {
  Tensor b = buffer(1);
  task::ChipCallable c{"err",
                       [&](task::OrchestrationContext& ctx, const task::TaskArgs&) {
                         task::TaskArgs a;
                         a.add_tensor(b, ArgDirection::kIn).add_tensor(b, ArgDirection::kOut);
                         SIMPLER_RETURN_IF_ERROR(ctx.submit(0, a));
                         SIMPLER_RETURN_IF_ERROR(ctx.submit(1, a));
                         // Later submits see the failure (or succeed before it lands).
                         for (int i = 0; i < 50; ++i) {
                           absl::Status s = ctx.submit(0, a);
                           if (!s.ok()) return s;
                         }
                         return absl::OkStatus();
                       },
                       {{"inc", inc}, {"matmul", fails}}};
  absl::Status s = run(c, 5);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("run 5 task 1 (kernel 'matmul') block 0: bad tile shape"),
            std::string_view::npos)
      << s.message();
  EXPECT_FALSE(base::is_unrecoverable(s));
  EXPECT_EQ(b.data<int32_t>()[0], 1);  // nothing after the failed task ran
}

TEST_F(ChipRuntimeTest, InjectedDeviceFaultIsUnrecoverableAndAttributed) {
  make_device(2, *device::FaultPlan::parse("run=3:task=2:kind=device_fault:code=507018"));
  const task::ChipCallable c = inc_chains("fault", {buffer(1)}, 5);
  EXPECT_TRUE(run(c, 2).ok());
  absl::Status s = run(c, 3);
  EXPECT_TRUE(base::is_unrecoverable(s));
  EXPECT_NE(s.message().find("run 3 task 2 (kernel 'inc')"), std::string_view::npos);
  EXPECT_NE(s.message().find("507018"), std::string_view::npos);
}

TEST_F(ChipRuntimeTest, OrchestrationErrorAndBadKernelIndex) {
  task::ChipCallable c{"orch",
                       [&](task::OrchestrationContext& ctx, const task::TaskArgs&) {
                         return ctx.submit(9, task::TaskArgs{});
                       },
                       {{"inc", inc}}};
  absl::Status s = run(c, 1);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("kernel index 9 out of range"), std::string_view::npos);
}

TEST_F(ChipRuntimeTest, MaxCoresLimitsTheCoresUsed) {
  Tensor b = buffer(64);
  task::ChipCallable c{"spmd",
                       [&](task::OrchestrationContext& ctx, const task::TaskArgs&) {
                         EXPECT_EQ(ctx.num_cores(), 2);
                         task::TaskArgs a;
                         a.add_tensor(b, ArgDirection::kOut);
                         return ctx.submit(0, a, 64);
                       },
                       {{"fill", spmd_fill}}};
  ASSERT_TRUE(run(c, 0, {}, 2).ok());
  for (auto& t : report_.tasks) EXPECT_LT(t.core, 2);
}

// ---- host-built graphs ----

class HostBuiltGraphTest : public ChipRuntimeTest {
 protected:
  absl::StatusOr<std::vector<uint8_t>> build(const task::ChipCallable& c, uint64_t run_id = 0,
                                             ChipOptions opt = {}) {
    return build_graph_image(c, task::TaskArgs{}, opt, 4, run_id,
                             [this](uint64_t a, uint64_t b) { return dev_->check_range(a, b); });
  }
  absl::Status execute(const task::ChipCallable& c, const std::vector<uint8_t>& image,
                       uint64_t run_id = 0) {
    uint64_t buf = *dev_->malloc(image.size());
    EXPECT_TRUE(dev_->copy_to_device(buf, image.data(), image.size()).ok());
    report_ = RunReport{};
    auto rec = stream_->launch(run_id, [&](device::ExecContext& ctx) {
      return execute_graph_image(ctx, c, buf, image.size(), {}, 0, true, &report_);
    });
    (*rec)->done.wait(base::Deadline::forever());
    return (*rec)->done.status();
  }
  task::ChipCallable chain(Tensor b, int n) { return inc_chains("chain", {b}, n); }
};

TEST_F(HostBuiltGraphTest, ImageExecutesWithTheSameDependencies) {
  Tensor b = buffer(1);
  auto c = chain(b, 300);
  auto image = build(c);
  ASSERT_TRUE(image.ok()) << image.status();
  EXPECT_EQ(b.data<int32_t>()[0], 0);  // building ran nothing
  ASSERT_TRUE(execute(c, *image).ok());
  EXPECT_EQ(b.data<int32_t>()[0], 300);
  EXPECT_EQ(report_.tasks_completed, 300u);
}

TEST_F(HostBuiltGraphTest, CorruptedImagesAreRefusedNamingTheField) {
  Tensor b = buffer(1);
  auto c = chain(b, 3);
  auto image = *build(c, 5);
  auto expect_bad = [&](std::vector<uint8_t> img, const std::string& needle, uint64_t run = 5) {
    absl::Status s = execute(c, img, run);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(std::string(s.message()).find(needle), std::string::npos) << s.message();
  };
  auto hdr = [](std::vector<uint8_t>& img) {
    return reinterpret_cast<GraphImageHeader*>(img.data());
  };
  {
    auto img = image;
    hdr(img)->magic = 0;
    expect_bad(img, "bad magic");
  }
  {
    auto img = image;
    hdr(img)->version = 9;
    expect_bad(img, "version 9");
  }
  expect_bad(image, "built for run 5", 6);
  {
    auto img = image;
    auto* tasks = reinterpret_cast<GraphImageTask*>(img.data() + hdr(img)->tasks_offset);
    tasks[1].kernel = 7;
    expect_bad(img, "kernel index 7 out of range");
  }
  {
    auto img = image;
    auto* preds = reinterpret_cast<uint32_t*>(img.data() + hdr(img)->preds_offset);
    preds[0] = 2;  // task 1's predecessor made a later task
    expect_bad(img, "not earlier");
  }
  {
    auto img = image;
    hdr(img)->num_args = 1000;
    expect_bad(img, "outside the image");
  }
  EXPECT_EQ(b.data<int32_t>()[0], 0);  // nothing executed
}

TEST_F(HostBuiltGraphTest, RunThatCanNeverFitItsImageFailsAtOnce) {
  Tensor b = buffer(1);
  ChipOptions opt;
  opt.max_graph_tasks = 10;
  int submitted = 0;
  task::ChipCallable c{"big",
                       [&](task::OrchestrationContext& ctx, const task::TaskArgs&) {
                         for (int i = 0; i < 100; ++i) {
                           task::TaskArgs a;
                           a.add_tensor(b, ArgDirection::kInOut);
                           SIMPLER_RETURN_IF_ERROR(ctx.submit(0, a));
                           ++submitted;
                         }
                         return absl::OkStatus();
                       },
                       {{"inc", inc}}};
  auto image = build(c, 3, opt);
  ASSERT_FALSE(image.ok());
  EXPECT_EQ(image.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(std::string(image.status().message()).find("run 3 task 10: the run needs more than 10"),
            std::string::npos)
      << image.status();
  EXPECT_EQ(submitted, 10);
}

TEST_F(HostBuiltGraphTest, SubmitTimeErrorsAreFoundOnTheHost) {
  Tensor b = buffer(1);
  Tensor bad = b;
  bad.shape[0] = 2;
  auto image = build(one_out_task("oob", bad, {{"inc", inc}}), 4);
  ASSERT_FALSE(image.ok());
  EXPECT_NE(std::string(image.status().message()).find("run 4 task 0 (kernel 'inc') argument 0"),
            std::string::npos)
      << image.status();
}

absl::Status touch(const task::KernelContext&) { return absl::OkStatus(); }

// 400 tasks reading or writing pseudo-random, partially overlapping ranges of one buffer: the
// dependency patterns RAW, WAR, WAW and partial overlap, most tasks finished before later ones
// are submitted.
task::ChipCallable overlapping_ranges(Tensor buf) {
  return {"ranges",
          [buf](task::OrchestrationContext& ctx, const task::TaskArgs&) {
            uint64_t x = 12345;
            for (int i = 0; i < 400; ++i) {
              x = x * 6364136223846793005ull + 1442695040888963407ull;
              const int64_t from = static_cast<int64_t>((x >> 33) % 60);
              const int64_t count = 1 + static_cast<int64_t>((x >> 13) % 8);
              Tensor t = *Tensor::contiguous(buf.address + from * 4, {count}, DataType::kInt32);
              task::TaskArgs a;
              a.add_tensor(t, (x >> 7) % 3 == 0 ? ArgDirection::kIn : ArgDirection::kInOut);
              SIMPLER_RETURN_IF_ERROR(ctx.submit(0, a));
            }
            return absl::OkStatus();
          },
          {{"touch", touch}}};
}

// A capture on the device records what the host recorder infers, finished predecessors
// included: the TensorMap forgets nothing while it captures.
TEST_F(ChipRuntimeTest, ADeviceCaptureRecordsEveryPredecessorTheHostRecorderInfers) {
  const task::ChipCallable c = overlapping_ranges(buffer(68));
  task::TaskArgs none;
  GraphRecording captured;
  auto rec = stream_->launch(0, [&](device::ExecContext& ctx) {
    return execute_run(ctx, c, none, ChipOptions{}, 0, false, &report_, &captured);
  });
  ASSERT_TRUE(rec.ok());
  (*rec)->done.wait(base::Deadline::forever());
  ASSERT_TRUE((*rec)->done.status().ok()) << (*rec)->done.status();
  absl::StatusOr<GraphRecording> host = record_on_host(c);
  ASSERT_TRUE(host.ok()) << host.status();
  ASSERT_EQ(captured.tasks.size(), 400u);
  EXPECT_EQ(captured.preds, host->preds);
  size_t with_preds = 0;
  for (size_t i = 0; i < captured.tasks.size(); ++i) {
    EXPECT_EQ(captured.tasks[i].preds_begin, host->tasks[i].preds_begin) << "task " << i;
    EXPECT_EQ(captured.tasks[i].num_preds, host->tasks[i].num_preds) << "task " << i;
    with_preds += captured.tasks[i].num_preds > 0;
  }
  EXPECT_GT(with_preds, 300u);
}

// Linking inverts the predecessor lists (each successor list sorted), and a linked recording
// replays with its dependencies: three RAW chains of 50 increments each end at 50, every task run.
TEST_F(ChipRuntimeTest, ALinkedRecordingReplaysBehindItsSuccessorLists) {
  std::vector<Tensor> bufs = {buffer(1), buffer(1), buffer(1)};
  const task::ChipCallable c = inc_chains("chains", bufs, 50);
  absl::StatusOr<GraphRecording> g = record_on_host(c);
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_FALSE(g->linked());
  g->link_successors();
  ASSERT_TRUE(g->linked());
  std::vector<std::vector<uint32_t>> succs(g->tasks.size());
  for (uint32_t i = 0; i < g->tasks.size(); ++i) {
    for (uint32_t k = 0; k < g->tasks[i].num_preds; ++k) {
      succs[g->preds[g->tasks[i].preds_begin + k]].push_back(i);
    }
  }
  for (uint32_t i = 0; i < g->tasks.size(); ++i) {
    EXPECT_EQ(std::vector<uint32_t>(g->succs.begin() + g->succ_begin[i],
                                    g->succs.begin() + g->succ_begin[i + 1]),
              succs[i])
        << "task " << i;
  }
  auto rec = stream_->launch(7, [&](device::ExecContext& ctx) {
    return execute_recorded(ctx, c, *g, g->args.data(), ChipOptions{}, 0, true, &report_);
  });
  ASSERT_TRUE(rec.ok());
  (*rec)->done.wait(base::Deadline::forever());
  ASSERT_TRUE((*rec)->done.status().ok()) << (*rec)->done.status();
  for (const Tensor& b : bufs) EXPECT_EQ(b.data<int32_t>()[0], 50);
  EXPECT_EQ(report_.tasks_submitted, 150u);
  EXPECT_EQ(report_.tasks_completed, 150u);
  EXPECT_EQ(report_.tasks.size(), 150u);
  EXPECT_EQ(report_.blocks.size(), 150u);  // one block each
}

// Two cores whose jobs complete only at blocking waits, core 0's before core 1's (then in start
// order), without running them: the order in which cores come back idle is the test's.
class CoresInOrderContext final : public device::ExecContext {
 public:
  explicit CoresInOrderContext(const device::Device& dev) : dev_(dev) {}
  int32_t num_cores() const override { return 2; }
  uint64_t run_id() const override { return 1; }
  void start(int32_t core, const device::CoreJob& job) override {
    started.push_back({core, job.task_index});
    pending_.push_back({core, job.tag, job.task_index, job.block_idx, absl::OkStatus(), 1, 2});
  }
  bool next_completion(device::CoreCompletion* out, bool block) override {
    if (!block || pending_.empty()) return false;
    auto first = std::min_element(pending_.begin(), pending_.end(),
                                  [](const auto& a, const auto& b) { return a.core < b.core; });
    *out = *first;
    pending_.erase(first);
    return true;
  }
  bool aborted() const override { return false; }
  absl::Status check_range(uint64_t address, uint64_t bytes) const override {
    return dev_.check_range(address, bytes);
  }
  std::vector<std::pair<int32_t, uint32_t>> started;  // (core, task) in start order

 private:
  const device::Device& dev_;
  std::vector<device::CoreCompletion> pending_;
};

// a += 1 (task 0) beside b += 1 (task 1), then a join (task 2: c = a + 1, reading b) and `chain`
// incs of c behind it.
task::ChipCallable join_then_chain(Tensor a, Tensor b, Tensor c, int chain) {
  return {"join",
          [a, b, c, chain](task::OrchestrationContext& ctx, const task::TaskArgs&) {
            task::TaskArgs t;
            t.add_tensor(a, ArgDirection::kIn).add_tensor(a, ArgDirection::kOut);
            SIMPLER_RETURN_IF_ERROR(ctx.submit(0, t));
            t.clear();
            t.add_tensor(b, ArgDirection::kIn).add_tensor(b, ArgDirection::kOut);
            SIMPLER_RETURN_IF_ERROR(ctx.submit(0, t));
            t.clear();
            t.add_tensor(a, ArgDirection::kIn).add_tensor(c, ArgDirection::kOut);
            t.add_tensor(b, ArgDirection::kIn);
            SIMPLER_RETURN_IF_ERROR(ctx.submit(0, t));
            for (int i = 0; i < chain; ++i) {
              t.clear();
              t.add_tensor(c, ArgDirection::kIn).add_tensor(c, ArgDirection::kOut);
              SIMPLER_RETURN_IF_ERROR(ctx.submit(0, t));
            }
            return absl::OkStatus();
          },
          {{"inc", inc}}};
}

// A task that becomes ready when every core is idle runs on core 0 (the core the sim device's
// scheduler thread stands in for), not on the core that came back last: after two independent
// tasks on cores 0 and 1, core 1's completing last, the join and the chain behind it run on core
// 0, orchestrated and replayed alike. (Taking the last freed core kept them on core 1, where the
// sim device hands each task longer than its scheduler keeps to core 1's thread.)
TEST_F(ChipRuntimeTest, ATaskReadyWhenEveryCoreIsIdleRunsOnTheSchedulersCore) {
  Tensor a = buffer(1), b = buffer(1), c = buffer(1);
  const task::ChipCallable prog = join_then_chain(a, b, c, 3);
  const std::vector<std::pair<int32_t, uint32_t>> expected = {{0, 0}, {1, 1}, {0, 2},
                                                              {0, 3}, {0, 4}, {0, 5}};
  {
    CoresInOrderContext ctx(*dev_);
    ASSERT_TRUE(execute_run(ctx, prog, task::TaskArgs{}, ChipOptions{}, 0, false, &report_).ok());
    EXPECT_EQ(ctx.started, expected) << "orchestrated";
  }
  absl::StatusOr<GraphRecording> g =
      record_graph(prog, task::TaskArgs{}, ChipOptions{}, 2, 0,
                   [this](uint64_t x, uint64_t n) { return dev_->check_range(x, n); });
  ASSERT_TRUE(g.ok()) << g.status();
  g->link_successors();
  CoresInOrderContext ctx(*dev_);
  report_ = RunReport{};
  ASSERT_TRUE(
      execute_recorded(ctx, prog, *g, g->args.data(), ChipOptions{}, 0, false, &report_).ok());
  EXPECT_EQ(ctx.started, expected) << "replayed";
}

// Forwards to a device's context and records the shape key each started job carries beside the
// one the device would compute for it.
class ShapeRecordingContext final : public device::ExecContext {
 public:
  explicit ShapeRecordingContext(device::ExecContext& inner) : inner_(inner) {}
  int32_t num_cores() const override { return inner_.num_cores(); }
  uint64_t run_id() const override { return inner_.run_id(); }
  int32_t core_queue_depth() const override { return inner_.core_queue_depth(); }
  void start(int32_t core, const device::CoreJob& job) override {
    carried.push_back(job.shape);
    computed.push_back(device::job_shape_key(job.fn, job.args, job.num_args, job.block_dim));
    inner_.start(core, job);
  }
  bool next_completion(device::CoreCompletion* out, bool block) override {
    return inner_.next_completion(out, block);
  }
  bool aborted() const override { return inner_.aborted(); }
  absl::Status check_range(uint64_t address, uint64_t bytes) const override {
    return inner_.check_range(address, bytes);
  }
  std::vector<uint64_t> carried;
  std::vector<uint64_t> computed;

 private:
  device::ExecContext& inner_;
};

// A linked recording with its shape keys computed starts every job with the key the device would
// compute (bound to other buffers of the same shapes), and computes the same results; one
// without them leaves the key to the device (0).
TEST_F(ChipRuntimeTest, ARecordingsJobsCarryTheShapeKeysTheDeviceWouldCompute) {
  std::vector<Tensor> bufs = {buffer(1), buffer(3)};
  const task::ChipCallable c = inc_chains("chains", bufs, 4);
  absl::StatusOr<GraphRecording> g = record_on_host(c);
  ASSERT_TRUE(g.ok()) << g.status();
  g->link_successors();
  for (bool with_shapes : {false, true}) {
    SCOPED_TRACE(with_shapes ? "with shape keys" : "without");
    if (with_shapes) g->compute_job_shapes(c);
    EXPECT_EQ(g->job_shapes.size(), with_shapes ? g->tasks.size() : 0u);
    // The same graph over two other buffers of the recorded shapes.
    std::vector<Tensor> other = {buffer(1), buffer(3)};
    std::vector<task::Arg> bound = g->args;
    for (task::Arg& a : bound)
      a.tensor.address = other[a.tensor.address == bufs[0].address ? 0 : 1].address;
    std::vector<uint64_t> carried, computed;
    auto rec = stream_->launch(3, [&](device::ExecContext& ctx) {
      ShapeRecordingContext shapes(ctx);
      absl::Status s =
          execute_recorded(shapes, c, *g, bound.data(), ChipOptions{}, 0, false, &report_);
      carried = shapes.carried;
      computed = shapes.computed;
      return s;
    });
    ASSERT_TRUE(rec.ok());
    (*rec)->done.wait(base::Deadline::forever());
    ASSERT_TRUE((*rec)->done.status().ok()) << (*rec)->done.status();
    EXPECT_EQ(other[0].data<int32_t>()[0], 4);
    EXPECT_EQ(other[1].data<int32_t>()[0], 4);
    ASSERT_EQ(carried.size(), 8u);
    EXPECT_NE(computed[0], computed[1]);  // the buffers' spans differ
    for (size_t i = 0; i < carried.size(); ++i) {
      EXPECT_NE(computed[i], 0u);
      EXPECT_EQ(carried[i], with_shapes ? computed[i] : 0u) << "job " << i;
    }
  }
}

}  // namespace
}  // namespace simpler::chip
