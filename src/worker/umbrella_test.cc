// simpler/simpler.h on its own is enough to write and run a program.
#include "gtest/gtest.h"
#include "simpler/simpler.h"

namespace {

absl::Status add_one(const simpler::task::KernelContext& ctx) {
  ctx.tensor(0).data<int32_t>()[0] += 1;
  return absl::OkStatus();
}

TEST(Umbrella, AProgramRunsThroughTheUmbrellaHeaderAlone) {
  using namespace simpler;
  worker::WorkerOptions o{};
  o.num_cores = 1;
  o.faults = device::FaultPlan{};  // no injected faults, whatever the environment says
  worker::Worker w(o);
  auto h = w.register_callable(
      task::ChipCallable{"add_one",
                         [](task::OrchestrationContext& ctx, const task::TaskArgs& args) {
                           task::TaskArgs a;
                           a.add_tensor(args.tensor(0), task::ArgDirection::kInOut);
                           return ctx.submit(0, a);
                         },
                         {{"add_one", add_one}}});
  ASSERT_TRUE(h.ok()) << h.status();
  ASSERT_TRUE(w.init().ok());
  int32_t cell = 41;
  task::TaskArgs args;
  args.add_tensor(*task::Tensor::contiguous(reinterpret_cast<uintptr_t>(&cell), {1},
                                            task::DataType::kInt32, task::MemoryKind::kHost),
                  task::ArgDirection::kInOut);
  ASSERT_TRUE(w.run(*h, args).ok());
  EXPECT_EQ(cell, 42);
  EXPECT_TRUE(w.close().ok());
}

}  // namespace
