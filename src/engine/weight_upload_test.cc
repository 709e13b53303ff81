// The two-thread weight upload (weight_upload.h) against a checkpoint that shrinks after it was
// opened: the copy fails naming the tensor and the file, on whichever share reads the cut bytes,
// with no thread left behind.
#include "engine/weight_upload.h"

#include <cstddef>
#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/test_temp_dir.h"
#include "base/test_wait.h"
#include "gtest/gtest.h"
#include "simpler/base/thread.h"

namespace simpler::llm {
namespace {

namespace fs = std::filesystem;

// Each weight: bf16 [1024, 1280], 2.5 MiB: three chunks of the copy's 1 MiB staging buffer.
constexpr int64_t kRows = 1024, kCols = 1280;
constexpr uint64_t kWeightBytes = kRows * kCols * 2;

// The threads of this process (Linux: /proc/self/task).
size_t threads_now() {
  size_t n = 0;
  for ([[maybe_unused]] const auto& e : fs::directory_iterator("/proc/self/task")) ++n;
  return n;
}

// A checkpoint of `n` raw weights "w0".."w{n-1}", each of its own byte pattern.
std::string write_checkpoint(const fs::path& dir, int n) {
  std::vector<std::vector<std::byte>> data(n, std::vector<std::byte>(kWeightBytes));
  std::vector<TensorSource> sources;
  for (int i = 0; i < n; ++i) {
    for (uint64_t k = 0; k < kWeightBytes; ++k) data[i][k] = std::byte((k * 7 + i * 13) & 0xFF);
    sources.push_back(
        {absl::StrCat("w", i), task::DataType::kBFloat16, {kRows, kCols}, data[i], nullptr});
  }
  const std::string path = (dir / "model.safetensors").string();
  EXPECT_TRUE(write_safetensors(path, sources).ok());
  return path;
}

// The slots of every weight of `file`, in file order, one after the other in the buffer.
std::vector<WeightSlot> slots_of(const SafetensorsFile& file, int n,
                                 std::vector<task::Tensor>* targets, uint64_t* total) {
  targets->assign(n, task::Tensor{});
  std::vector<WeightSlot> slots;
  for (int i = 0; i < n; ++i) {
    WeightSlot s{&(*targets)[i], {kRows, kCols}, file.tensor(absl::StrCat("w", i)).value()};
    s.raw = true;
    s.offset = static_cast<uint64_t>(i) * kWeightBytes;
    s.bytes = kWeightBytes;
    slots.push_back(std::move(s));
  }
  *total = static_cast<uint64_t>(n) * kWeightBytes;
  return slots;
}

worker::WorkerOptions one_core() {
  worker::WorkerOptions o;
  o.num_cores = 1;
  return o;
}

TEST(UploadWeights, CopiesEveryWeightIntoOneBufferAndPointsItsTargetAtIt) {
  const fs::path dir = simpler::testing::test_dir("simpler_weight_upload_test");
  const std::string path = write_checkpoint(dir, 3);
  auto file = SafetensorsFile::open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  worker::Worker w(one_core());
  ASSERT_TRUE(w.init().ok());
  std::vector<task::Tensor> targets;
  uint64_t total = 0;
  const std::vector<WeightSlot> slots = slots_of(*file, 3, &targets, &total);
  std::vector<worker::DeviceBuffer> buffers;
  ASSERT_TRUE(upload_weights(w, slots, total, &buffers).ok());
  ASSERT_EQ(buffers.size(), 1u);
  std::vector<std::byte> back(total), want(kWeightBytes);
  ASSERT_TRUE(w.copy_from(back.data(), buffers[0], total).ok());
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(read_bytes(slots[i].view, 0, want).ok());
    EXPECT_TRUE(std::equal(want.begin(), want.end(), back.begin() + i * kWeightBytes)) << i;
    EXPECT_EQ(targets[i].dtype, task::DataType::kBFloat16);
  }
}

// The file is cut inside its last weight's second chunk: the copy has read that weight's first
// chunk when the read fails. With 3 weights the last is the first share's (this thread's); with
// 4, the second share's (the helper thread's), where the machine has two hardware threads.
// A cut inside the first weight fails both shares.
TEST(UploadWeights, AFileCutDuringTheCopyFailsNamingTheTensorAndFileOnEitherShare) {
  struct Case {
    int weights;
    uint64_t cut_at;  // bytes of the tensor data kept
    std::vector<std::string> may_name;
  };
  const Case cases[] = {
      {3, 2 * kWeightBytes + kWeightBytes / 2, {"w2"}},
      {4, 3 * kWeightBytes + kWeightBytes / 2, {"w3"}},
      {4, kWeightBytes / 2, {"w0", "w1", "w2", "w3"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(absl::StrCat(c.weights, " weights, cut at ", c.cut_at, "; ",
                              base::hardware_threads(), " hardware threads"));
    const fs::path dir = simpler::testing::test_dir("simpler_weight_upload_test");
    const std::string path = write_checkpoint(dir, c.weights);
    auto file = SafetensorsFile::open(path);
    ASSERT_TRUE(file.ok()) << file.status();
    worker::Worker w(one_core());
    ASSERT_TRUE(w.init().ok());
    std::vector<task::Tensor> targets;
    uint64_t total = 0;
    const std::vector<WeightSlot> slots = slots_of(*file, c.weights, &targets, &total);
    const uint64_t data_start = fs::file_size(path) - total;
    fs::resize_file(path, data_start + c.cut_at);
    const size_t threads_before = threads_now();
    std::vector<worker::DeviceBuffer> buffers;
    const absl::Status s = upload_weights(w, slots, total, &buffers);
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
    bool named = false;
    for (const std::string& t : c.may_name) {
      const std::string prefix =
          absl::StrCat("tensor '", t, "' of ", path, ": ", path, ": the file ends at byte ");
      named |= std::string(s.message()).rfind(prefix, 0) == 0;
    }
    EXPECT_TRUE(named) << s;
    EXPECT_EQ(buffers.size(), 1u);  // the caller frees it
    // The helper thread was joined: the process is back to its threads before the call (the
    // kernel may list an exited thread a moment longer).
    EXPECT_TRUE(simpler::testing::eventually([&] { return threads_now() == threads_before; }))
        << threads_now() << " threads, " << threads_before << " before";
  }
}

}  // namespace
}  // namespace simpler::llm
