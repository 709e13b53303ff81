// The two-thread weight upload (weight_upload.h) against a checkpoint that shrinks after it was
// opened: the copy fails naming the tensor and the file, on whichever share reads the cut bytes,
// with no thread left behind.
#include "engine/weight_upload.h"

#include <cstddef>
#include <filesystem>
#include <memory>
#include <optional>
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
    s.dtype = task::DataType::kBFloat16;
    s.offset = static_cast<uint64_t>(i) * kWeightBytes;
    s.bytes = kWeightBytes;
    slots.push_back(std::move(s));
  }
  *total = static_cast<uint64_t>(n) * kWeightBytes;
  return slots;
}

// A checkpoint of `n` raw weights written, opened and planned, and a Worker of one core.
class UploadWeights : public ::testing::Test {
 protected:
  void prepare(int n) {
    w_.reset();
    file_.reset();
    path_ = write_checkpoint(simpler::testing::test_dir("simpler_weight_upload_test"), n);
    auto file = SafetensorsFile::open(path_);
    ASSERT_TRUE(file.ok()) << file.status();
    file_.emplace(*std::move(file));
    worker::WorkerOptions o;
    o.num_cores = 1;
    w_ = std::make_unique<worker::Worker>(o);
    ASSERT_TRUE(w_->init().ok());
    slots_ = slots_of(*file_, n, &targets_, &total_);
  }
  absl::Status upload() { return upload_weights(*w_, slots_, total_, &buffers_); }

  std::string path_;
  std::optional<SafetensorsFile> file_;
  std::unique_ptr<worker::Worker> w_;
  std::vector<task::Tensor> targets_;
  uint64_t total_ = 0;
  std::vector<WeightSlot> slots_;
  std::vector<worker::DeviceBuffer> buffers_;
};

TEST_F(UploadWeights, CopiesEveryWeightIntoOneBufferAndPointsItsTargetAtIt) {
  prepare(3);
  ASSERT_TRUE(upload().ok());
  ASSERT_EQ(buffers_.size(), 1u);
  std::vector<std::byte> back(total_), want(kWeightBytes);
  ASSERT_TRUE(w_->copy_from(back.data(), buffers_[0], total_).ok());
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(read_bytes(slots_[i].view, 0, want).ok());
    EXPECT_TRUE(std::equal(want.begin(), want.end(), back.begin() + i * kWeightBytes)) << i;
    EXPECT_EQ(targets_[i].dtype, task::DataType::kBFloat16);
  }
}

// The file is cut inside its last weight's second chunk: the copy has read that weight's first
// chunk when the read fails. With 3 weights the last is the first share's (this thread's); with
// 4, the second share's (the helper thread's), where the machine has two hardware threads.
// A cut inside the first weight fails both shares.
TEST_F(UploadWeights, AFileCutDuringTheCopyFailsNamingTheTensorAndFileOnEitherShare) {
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
    prepare(c.weights);
    fs::resize_file(path_, fs::file_size(path_) - total_ + c.cut_at);
    buffers_.clear();
    const size_t threads_before = threads_now();
    const absl::Status s = upload();
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
    bool named = false;
    for (const std::string& t : c.may_name) {
      const std::string prefix =
          absl::StrCat("tensor '", t, "' of ", path_, ": ", path_, ": the file ends at byte ");
      named |= std::string(s.message()).rfind(prefix, 0) == 0;
    }
    EXPECT_TRUE(named) << s;
    EXPECT_EQ(buffers_.size(), 1u);  // the caller frees it
    // The helper thread was joined: the process is back to its threads before the call (the
    // kernel may list an exited thread a moment longer).
    EXPECT_TRUE(simpler::testing::eventually([&] { return threads_now() == threads_before; }))
        << threads_now() << " threads, " << threads_before << " before";
  }
}

// A weight planned as interleaved (WeightSlot::dtype q4_k_r16, q6_k_r16, q8_0_r16) lands in device
// memory as task::interleave_rows writes the file's rows, its target tensor of that dtype; 300
// groups of 16 rows take two or three chunks of the staging buffer (whole groups each: 1 MiB holds
// 227 groups of Q4_K, 156 of Q6_K, 120 of Q8_0); a plain weight beside it is
// copied as it is. (The file holds the blocks' bytes as bf16 tensors of the same size, their
// views retyped as a GGUF file's would be: the copy reads bytes, and safetensors has no block
// dtypes.)
TEST(UploadWeightsInterleaved, InterleavesWholeGroupsOnTheirWayIn) {
  constexpr int64_t kQRows = 4800, kQCols = 512;
  const struct {
    task::DataType file, device;
  } kinds[] = {{task::DataType::kQ4_K, task::DataType::kQ4_K_R16},
               {task::DataType::kQ6_K, task::DataType::kQ6_K_R16},
               {task::DataType::kQ8_0, task::DataType::kQ8_0_R16},
               {task::DataType::kQ4_K, task::DataType::kQ4_K}};
  std::vector<std::vector<std::byte>> data;
  std::vector<TensorSource> sources;
  for (size_t i = 0; i < std::size(kinds); ++i) {
    data.emplace_back(task::bytes_of(kinds[i].file, kQRows * kQCols));
    for (size_t k = 0; k < data[i].size(); ++k)
      data[i][k] = std::byte((k * 31 + k / 251 + i) & 0xFF);
    const auto halves = static_cast<int64_t>(data[i].size() / 2 / kQRows);
    sources.push_back(
        {absl::StrCat("q", i), task::DataType::kBFloat16, {kQRows, halves}, data[i], nullptr});
  }
  const std::string path =
      (simpler::testing::test_dir("simpler_weight_upload_interleaved") / "model.safetensors")
          .string();
  ASSERT_TRUE(write_safetensors(path, sources).ok());
  auto file = SafetensorsFile::open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  std::vector<task::Tensor> targets(std::size(kinds));
  std::vector<WeightSlot> slots;
  uint64_t total = 0;
  for (size_t i = 0; i < std::size(kinds); ++i) {
    WeightSlot s{&targets[i], {kQRows, kQCols}, file->tensor(absl::StrCat("q", i)).value()};
    s.view.dtype = kinds[i].file;  // as a GGUF file's view of these bytes would say
    s.raw = true;
    s.dtype = kinds[i].device;
    s.offset = total;
    s.bytes = data[i].size();
    total += s.bytes;
    slots.push_back(std::move(s));
  }
  worker::WorkerOptions o;
  o.num_cores = 1;
  worker::Worker w(o);
  ASSERT_TRUE(w.init().ok());
  std::vector<worker::DeviceBuffer> buffers;
  ASSERT_TRUE(upload_weights(w, slots, total, &buffers).ok());
  std::vector<std::byte> back(total);
  ASSERT_TRUE(w.copy_from(back.data(), buffers[0], total).ok());
  for (size_t i = 0; i < std::size(kinds); ++i) {
    std::vector<std::byte> want = data[i];
    if (kinds[i].device != kinds[i].file) {
      task::interleave_rows(kinds[i].device, reinterpret_cast<const uint8_t*>(data[i].data()),
                            kQRows, kQCols, reinterpret_cast<uint8_t*>(want.data()));
    }
    EXPECT_TRUE(std::equal(want.begin(), want.end(), back.begin() + slots[i].offset))
        << task::name_of(kinds[i].device);
    EXPECT_EQ(targets[i].dtype, kinds[i].device);
  }
  // a slot planned interleaved over bytes of another dtype, or rows not in whole groups, is
  // refused before any copy
  for (auto [dtype, rows] : {std::pair{task::DataType::kQ6_K_R16, kQRows},
                             std::pair{task::DataType::kQ4_K_R16, int64_t{4792}}}) {
    std::vector<WeightSlot> bad = {slots[0]};
    bad[0].dtype = dtype;
    bad[0].shape = {rows, kQCols};
    std::vector<worker::DeviceBuffer> more;
    const absl::Status s = upload_weights(w, bad, total, &more);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find("tensor 'q0'"), std::string::npos) << s;
    EXPECT_NE(s.message().find(absl::StrCat("planned as ", std::string(task::name_of(dtype)))),
              std::string::npos)
        << s;
    EXPECT_TRUE(more.empty());
  }
}

}  // namespace
}  // namespace simpler::llm
