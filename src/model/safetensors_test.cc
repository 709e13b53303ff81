#include "simpler/model/safetensors.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/test_temp_dir.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/model_test_util.h"

namespace simpler::llm {
namespace {

namespace fs = std::filesystem;
using task::DataType;
using ::testing::HasSubstr;

// A fresh directory per test.
fs::path safetensors_dir() { return simpler::testing::test_dir("simpler_safetensors_test"); }

// Writes 8-byte length + header + buffer, with `length` overriding the real header length.
void write_raw(const fs::path& path, const std::string& header, const std::string& buffer,
               std::optional<uint64_t> length = std::nullopt) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  uint64_t n = length.value_or(header.size());
  for (int i = 0; i < 8; ++i) out.put(static_cast<char>((n >> (8 * i)) & 0xff));
  out << header << buffer;
}

template <typename T>
std::span<const std::byte> as_bytes(const std::vector<T>& v) {
  return std::as_bytes(std::span<const T>(v));
}

using testing::msg;

TEST(SafetensorsRoundTrip, EveryDtypeReadsBackBytesShapesAndMetadata) {
  const fs::path dir = safetensors_dir();
  const std::vector<float> f32 = {1.0f, -2.5f, 3.25f, 0.0f, 1e-3f, 7.0f};
  std::vector<uint16_t> bf16, f16;
  for (float v : f32) bf16.push_back(task::f32_to_bf16(v)), f16.push_back(task::f32_to_f16(v));
  const std::vector<int32_t> i32 = {1, -2, 3};
  const std::vector<int64_t> i64 = {1ll << 40, -5};
  const std::vector<uint8_t> u8 = {0, 255, 7, 9, 11};

  std::vector<TensorSource> tensors(6);
  tensors[0] = {"a.f32", DataType::kFloat32, {2, 3}, as_bytes(f32), nullptr};
  tensors[1] = {"b.bf16", DataType::kBFloat16, {3, 2}, as_bytes(bf16), nullptr};
  tensors[2] = {"c.f16", DataType::kFloat16, {6}, as_bytes(f16), nullptr};
  tensors[3] = {"d.i32", DataType::kInt32, {3}, as_bytes(i32), nullptr};
  tensors[4] = {"e.i64", DataType::kInt64, {1, 2}, as_bytes(i64), nullptr};
  tensors[5] = {"f.u8", DataType::kUInt8, {5}, as_bytes(u8), nullptr};
  const std::string path = (dir / "t.safetensors").string();
  ASSERT_TRUE(write_safetensors(path, tensors, {{"format", "pt"}}).ok());
  EXPECT_FALSE(fs::exists(path + ".tmp"));

  auto file = SafetensorsFile::open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(file->size(), 6u);
  EXPECT_EQ(file->metadata().at("format"), "pt");
  for (const TensorSource& t : tensors) {
    auto view = file->tensor(t.name);
    ASSERT_TRUE(view.ok()) << view.status();
    EXPECT_EQ(view->dtype, t.dtype) << t.name;
    EXPECT_EQ(view->shape, t.shape) << t.name;
    EXPECT_EQ(view->name, t.name);
    EXPECT_EQ(view->file, path);
    ASSERT_EQ(view->bytes.size(), t.bytes.size());
    EXPECT_EQ(std::memcmp(view->bytes.data(), t.bytes.data(), t.bytes.size()), 0) << t.name;
  }
  for (const char* name : {"a.f32", "b.bf16", "c.f16"}) {
    auto values = to_f32(*file->tensor(name));
    ASSERT_TRUE(values.ok()) << values.status();
    for (size_t i = 0; i < f32.size(); ++i) {
      const float tol = std::string(name) == "a.f32" ? 0.0f : std::abs(f32[i]) * 1e-2f;
      EXPECT_NEAR((*values)[i], f32[i], tol) << name << "[" << i << "]";
    }
  }
  // The header is padded so the byte buffer starts 8-aligned.
  std::ifstream in(path, std::ios::binary);
  uint64_t header_len = 0;
  in.read(reinterpret_cast<char*>(&header_len), 8);
  EXPECT_EQ(header_len % 8, 0u);
}

TEST(SafetensorsRoundTrip, ProducerIsCalledWithConsecutiveChunks) {
  const fs::path dir = safetensors_dir();
  const int64_t n = 3 << 20;  // 12 MB of f32: several chunks
  int64_t next = 0;
  TensorSource t;
  t.name = "big";
  t.dtype = DataType::kFloat32;
  t.shape = {n};
  t.produce = [&](std::span<std::byte> chunk) {
    EXPECT_EQ(chunk.size() % 4, 0u);
    for (size_t i = 0; i < chunk.size() / 4; ++i) {
      float v = static_cast<float>(next++);
      std::memcpy(chunk.data() + 4 * i, &v, 4);
    }
    return absl::OkStatus();
  };
  const std::string path = (dir / "big.safetensors").string();
  ASSERT_TRUE(write_safetensors(path, std::span<const TensorSource>(&t, 1)).ok());
  EXPECT_EQ(next, n);
  auto file = SafetensorsFile::open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  auto values = to_f32(*file->tensor("big"));
  ASSERT_TRUE(values.ok());
  EXPECT_EQ((*values)[0], 0.0f);
  EXPECT_EQ((*values)[n - 1], static_cast<float>(n - 1));
}

TEST(SafetensorsWriter, ProducerErrorAbortsAndLeavesNoFile) {
  const fs::path dir = safetensors_dir();
  TensorSource t{"x", DataType::kFloat32, {4}, {}, [](std::span<std::byte>) {
                   return absl::InternalError("boom");
                 }};
  const std::string path = (dir / "x.safetensors").string();
  absl::Status s = write_safetensors(path, std::span<const TensorSource>(&t, 1));
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
  EXPECT_THAT(msg(s), HasSubstr("writing tensor 'x'"));
  EXPECT_THAT(msg(s), HasSubstr("boom"));
  EXPECT_FALSE(fs::exists(path));
  EXPECT_FALSE(fs::exists(path + ".tmp"));
}

TEST(SafetensorsWriter, RefusesWrongByteCountAndDuplicateNames) {
  const fs::path dir = safetensors_dir();
  const std::vector<float> v = {1, 2, 3};
  std::vector<TensorSource> wrong = {{"w", DataType::kFloat32, {4}, as_bytes(v), nullptr}};
  absl::Status s = write_safetensors((dir / "a.safetensors").string(), wrong);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(msg(s), HasSubstr("tensor 'w'"));
  EXPECT_THAT(msg(s), HasSubstr("12 bytes given"));
  std::vector<TensorSource> dup = {{"d", DataType::kFloat32, {3}, as_bytes(v), nullptr},
                                   {"d", DataType::kFloat32, {3}, as_bytes(v), nullptr}};
  s = write_safetensors((dir / "b.safetensors").string(), dup);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(msg(s), HasSubstr("tensor 'd': duplicate name"));
}

TEST(SafetensorsWriter, RefusesANameThatIsNotUtf8InsteadOfThrowing) {
  const fs::path dir = safetensors_dir();
  const std::vector<float> v = {1};
  std::vector<TensorSource> t = {{"w\xff", DataType::kFloat32, {1}, as_bytes(v), nullptr}};
  const std::string path = (dir / "a.safetensors").string();
  absl::Status s = write_safetensors(path, t);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(msg(s),
            "cannot write " + path + ": a tensor name or metadata string is not valid UTF-8");
}

TEST(SafetensorsOpen, MissingFileIsNotFound) {
  const fs::path dir = safetensors_dir();
  auto file = SafetensorsFile::open((dir / "nope.safetensors").string());
  EXPECT_EQ(file.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(msg(file.status()), HasSubstr("nope.safetensors"));
}

TEST(SafetensorsOpen, FileShorterThanLengthPrefixIsDataLoss) {
  const fs::path dir = safetensors_dir();
  const fs::path path = dir / "short.safetensors";
  std::ofstream(path, std::ios::binary) << "abc";
  auto file = SafetensorsFile::open(path.string());
  EXPECT_EQ(file.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(msg(file.status()), HasSubstr(path.string()));
  EXPECT_THAT(msg(file.status()), HasSubstr("truncated"));
}

TEST(SafetensorsOpen, TruncatedDataIsDataLossNamingTensor) {
  const fs::path dir = safetensors_dir();
  const std::vector<float> v(16, 1.0f);
  std::vector<TensorSource> t = {{"first", DataType::kFloat32, {4}, {}, nullptr},
                                 {"second", DataType::kFloat32, {12}, {}, nullptr}};
  t[0].bytes = std::as_bytes(std::span<const float>(v.data(), 4));
  t[1].bytes = std::as_bytes(std::span<const float>(v.data() + 4, 12));
  const fs::path path = dir / "t.safetensors";
  ASSERT_TRUE(write_safetensors(path.string(), t).ok());
  fs::resize_file(path, fs::file_size(path) - 10);
  auto file = SafetensorsFile::open(path.string());
  EXPECT_EQ(file.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(msg(file.status()), HasSubstr(path.string()));
  EXPECT_THAT(msg(file.status()), HasSubstr("tensor 'second'"));
}

// A file whose length prefix, header or byte buffer is malformed, and how SafetensorsFile::open
// refuses it: the code, and the parts of the message after the file's path, which it starts with.
struct MalformedFile {
  const char* name;  // the test's name and the file's stem
  std::string header;
  std::string buffer = "";
  std::optional<uint64_t> length = std::nullopt;  // the length prefix, when not the header's
  absl::StatusCode code = absl::StatusCode::kOk;
  std::vector<std::string> message_parts = {};
};

class SafetensorsMalformedFileTest : public ::testing::TestWithParam<MalformedFile> {};

TEST_P(SafetensorsMalformedFileTest, IsRefusedNamingFileAndFault) {
  const MalformedFile& c = GetParam();
  const fs::path path = safetensors_dir() / (std::string(c.name) + ".safetensors");
  write_raw(path, c.header, c.buffer, c.length);
  auto file = SafetensorsFile::open(path.string());
  ASSERT_FALSE(file.ok());
  EXPECT_EQ(file.status().code(), c.code) << file.status();
  EXPECT_THAT(msg(file.status()), ::testing::StartsWith(path.string()));
  for (const std::string& part : c.message_parts) EXPECT_THAT(msg(file.status()), HasSubstr(part));
}

INSTANTIATE_TEST_SUITE_P(
    SafetensorsOpen, SafetensorsMalformedFileTest,
    ::testing::Values(
        MalformedFile{.name = "HeaderLengthBeyondFileIsDataLoss",
                      .header = "{}",
                      .length = 4096,
                      .code = absl::StatusCode::kDataLoss,
                      .message_parts = {"header length 4096 goes beyond the end"}},
        MalformedFile{.name = "HeaderLengthAboveLimitIsInvalid",
                      .header = "{}",
                      .length = 1ull << 40,
                      .code = absl::StatusCode::kInvalidArgument,
                      .message_parts = {"exceeds the limit"}},
        MalformedFile{.name = "MalformedJsonIsInvalid",
                      .header = "{\"x\": {\"dtype\": ",
                      .code = absl::StatusCode::kInvalidArgument,
                      .message_parts = {": malformed safetensors header: malformed JSON: "}},
        MalformedFile{
            .name = "UnknownDtypeIsInvalidNamingTensor",
            .header = R"({"w": {"dtype": "F8_E4M3", "shape": [2], "data_offsets": [0, 2]}})",
            .buffer = std::string(2, '\0'),
            .code = absl::StatusCode::kInvalidArgument,
            .message_parts = {"tensor 'w'", "F8_E4M3"}},
        MalformedFile{
            .name = "SizeNotMatchingShapeIsInvalid",
            .header = R"({"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 12]}})",
            .buffer = std::string(12, '\0'),
            .code = absl::StatusCode::kInvalidArgument,
            .message_parts = {"tensor 'w'", "needs 16"}},
        MalformedFile{.name = "NegativeShapeIsInvalid",
                      .header = R"({"w": {"dtype": "U8", "shape": [-1], "data_offsets": [0, 0]}})",
                      .code = absl::StatusCode::kInvalidArgument,
                      .message_parts = {"tensor 'w'", "shape"}},
        MalformedFile{.name = "DataOffsetsOutOfRangeIsDataLossNamingTensor",
                      .header = R"({"w": {"dtype": "U8", "shape": [64], "data_offsets": [0, 64]}})",
                      .buffer = std::string(8, '\0'),
                      .code = absl::StatusCode::kDataLoss,
                      .message_parts = {"tensor 'w' data_offsets [0,64] go beyond"}},
        // A zero dimension makes the element count 0, but the partial products before it must
        // still fit int64 (numel() and the kernels multiply in int64).
        MalformedFile{.name = "AShapeWhosePartialProductOverflowsInt64IsRefused",
                      .header = R"({"w": {"dtype": "U8", "shape": [2147483648, 2147483648, 2, 0], )"
                                R"("data_offsets": [0, 0]}})",
                      .code = absl::StatusCode::kInvalidArgument,
                      .message_parts = {"overflows"}},
        MalformedFile{.name = "OverlappingDataOffsetsAreInvalidNamingBothTensors",
                      .header = R"({"a": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]}, )"
                                R"("b": {"dtype": "U8", "shape": [8], "data_offsets": [4, 12]}})",
                      .buffer = std::string(12, '\0'),
                      .code = absl::StatusCode::kInvalidArgument,
                      .message_parts = {"tensor 'b'", "overlap tensor 'a'"}},
        MalformedFile{.name = "HoleInByteBufferIsInvalid",
                      .header = R"({"a": {"dtype": "U8", "shape": [4], "data_offsets": [4, 8]}})",
                      .buffer = std::string(8, '\0'),
                      .code = absl::StatusCode::kInvalidArgument,
                      .message_parts = {"tensor 'a'", "hole"}}),
    [](const ::testing::TestParamInfo<MalformedFile>& info) { return info.param.name; });

TEST(SafetensorsOpen, MissingTensorIsNotFoundNamingFile) {
  const fs::path dir = safetensors_dir();
  const std::vector<float> v = {1, 2};
  std::vector<TensorSource> t = {{"present", DataType::kFloat32, {2}, as_bytes(v), nullptr}};
  const std::string path = (dir / "m.safetensors").string();
  ASSERT_TRUE(write_safetensors(path, t).ok());
  auto file = SafetensorsFile::open(path);
  ASSERT_TRUE(file.ok());
  auto view = file->tensor("absent");
  EXPECT_EQ(view.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(msg(view.status()), "tensor 'absent' not found in " + path);
}

TEST(ReadBytes, ReadsRangesOfATensorFromItsFileAndRefusesRangesOutsideIt) {
  const fs::path dir = safetensors_dir();
  std::vector<uint8_t> data(5000);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<uint8_t>(i * 7 + 3);
  const std::vector<uint8_t> other = {1, 2, 3};
  std::vector<TensorSource> t = {{"a", DataType::kUInt8, {3}, as_bytes(other), nullptr},
                                 {"b", DataType::kUInt8, {5000}, as_bytes(data), nullptr}};
  const std::string path = (dir / "r.safetensors").string();
  ASSERT_TRUE(write_safetensors(path, t).ok());
  auto file = SafetensorsFile::open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  const TensorView view = file->tensor("b").value();
  ASSERT_NE(view.mapping, nullptr);
  std::vector<std::byte> out(data.size());
  ASSERT_TRUE(read_bytes(view, 0, out).ok());
  EXPECT_EQ(std::memcmp(out.data(), data.data(), data.size()), 0);
  std::vector<std::byte> part(100);
  ASSERT_TRUE(read_bytes(view, 4900, part).ok());
  EXPECT_EQ(std::memcmp(part.data(), data.data() + 4900, part.size()), 0);
  EXPECT_TRUE(read_bytes(view, 5000, std::span<std::byte>()).ok());
  absl::Status past = read_bytes(view, 4901, part);
  EXPECT_EQ(past.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(msg(past), "read of 100 bytes at 4901 of tensor 'b' (5000 bytes)");
  // A view over plain memory is copied from its bytes.
  TensorView plain = view;
  plain.mapping = nullptr;
  plain.bytes = as_bytes(other);
  std::vector<std::byte> two(2);
  ASSERT_TRUE(read_bytes(plain, 1, two).ok());
  EXPECT_EQ(static_cast<uint8_t>(two[0]), 2);
  EXPECT_EQ(static_cast<uint8_t>(two[1]), 3);
}

TEST(ReadBytes, AFileThatShrankAfterItWasOpenedIsDataLossNamingIt) {
  const fs::path dir = safetensors_dir();
  const std::vector<uint8_t> data(64, 9);
  std::vector<TensorSource> t = {{"a", DataType::kUInt8, {64}, as_bytes(data), nullptr}};
  const std::string path = (dir / "s.safetensors").string();
  ASSERT_TRUE(write_safetensors(path, t).ok());
  auto file = SafetensorsFile::open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  const TensorView view = file->tensor("a").value();
  const uint64_t end = fs::file_size(path);
  fs::resize_file(path, end - 16);
  std::vector<std::byte> out(64);
  absl::Status shrank = read_bytes(view, 0, out);
  EXPECT_EQ(shrank.code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(msg(shrank), absl::StrCat(path, ": the file ends at byte ", end - 16,
                                      ", before the 16 bytes still to read (it shrank after it "
                                      "was opened)"));
}

TEST(ToF32, RefusesIntegerDtypeAndWrongDestinationSize) {
  const fs::path dir = safetensors_dir();
  const std::vector<int32_t> i = {1, 2};
  const std::vector<float> f = {1, 2};
  std::vector<TensorSource> t = {{"ints", DataType::kInt32, {2}, as_bytes(i), nullptr},
                                 {"floats", DataType::kFloat32, {2}, as_bytes(f), nullptr}};
  const std::string path = (dir / "c.safetensors").string();
  ASSERT_TRUE(write_safetensors(path, t).ok());
  auto file = SafetensorsFile::open(path);
  ASSERT_TRUE(file.ok());
  auto ints = to_f32(*file->tensor("ints"));
  EXPECT_EQ(ints.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(msg(ints.status()), HasSubstr("ints in " + path));
  std::vector<float> small(1);
  absl::Status s = to_f32(*file->tensor("floats"), std::span<float>(small));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(msg(s), HasSubstr("floats in " + path));
}

// --- ModelWeights ---------------------------------------------------------------------------

// Writes a safetensors file of the f32 tensors `t` (name, rows), each [rows, 128] of 0.5.
void write_shard(const fs::path& path, const std::vector<std::pair<std::string, int64_t>>& t) {
  std::vector<std::vector<float>> values;
  values.reserve(t.size());  // the sources point into it
  std::vector<TensorSource> sources;
  for (const auto& [name, rows] : t) {
    values.emplace_back(static_cast<size_t>(rows * 128), 0.5f);
    sources.push_back({name, DataType::kFloat32, {rows, 128}, as_bytes(values.back()), nullptr});
  }
  ASSERT_TRUE(write_safetensors(path.string(), sources).ok());
}

void write_index(const fs::path& dir, const std::string& weight_map_json) {
  std::ofstream(dir / "model.safetensors.index.json")
      << R"({"metadata": {"total_size": 0}, "weight_map": )" << weight_map_json << "}";
}

TEST(ModelWeights, ShardedLookupFindsEachTensorInItsShard) {
  const fs::path dir = safetensors_dir();
  write_shard(dir / "model-00001-of-00002.safetensors", {{"a.weight", 128}});
  write_shard(dir / "model-00002-of-00002.safetensors", {{"b.weight", 64}});
  write_index(dir, R"({"a.weight": "model-00001-of-00002.safetensors",
                       "b.weight": "model-00002-of-00002.safetensors"})");
  auto weights = ModelWeights::open(dir.string());
  ASSERT_TRUE(weights.ok()) << weights.status();
  EXPECT_EQ(weights->num_files(), 2u);
  EXPECT_EQ(weights->names(), (std::vector<std::string>{"a.weight", "b.weight"}));
  auto b = weights->get("b.weight", {64, 128});
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_THAT(std::string(b->file), HasSubstr("model-00002-of-00002.safetensors"));
}

TEST(ModelWeights, WrongShapeNamesTensorFileAndBothShapes) {
  const fs::path dir = safetensors_dir();
  const std::string name = "model.layers.3.self_attn.q_proj.weight";
  write_shard(dir / "model-00001-of-00002.safetensors", {{"x", 1}});
  write_shard(dir / "model-00002-of-00002.safetensors", {{name, 64}});
  write_index(dir, R"({"x": "model-00001-of-00002.safetensors", ")" + name +
                       R"(": "model-00002-of-00002.safetensors"})");
  auto weights = ModelWeights::open(dir.string());
  ASSERT_TRUE(weights.ok()) << weights.status();
  auto view = weights->get(name, {128, 128});
  EXPECT_EQ(view.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(msg(view.status()),
            "model.layers.3.self_attn.q_proj.weight in model-00002-of-00002.safetensors: shape "
            "[64,128], expected [128,128]");
}

TEST(ModelWeights, WrongDtypeNamesTensorFileAndAllowedDtypes) {
  const fs::path dir = safetensors_dir();
  write_shard(dir / "model.safetensors", {{"model.norm.weight", 2}});
  auto weights = ModelWeights::open(dir.string());
  ASSERT_TRUE(weights.ok()) << weights.status();
  auto view = weights->get("model.norm.weight", {2, 128}, {DataType::kBFloat16});
  EXPECT_EQ(view.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(msg(view.status()), "model.norm.weight in model.safetensors: dtype F32, expected BF16");
}

TEST(ModelWeights, MissingTensorNamesDirectoryAndFile) {
  const fs::path dir = safetensors_dir();
  write_shard(dir / "model.safetensors", {{"a", 1}});
  auto weights = ModelWeights::open(dir.string());
  ASSERT_TRUE(weights.ok());
  auto view = weights->get("lm_head.weight");
  EXPECT_EQ(view.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(msg(view.status()),
            "tensor 'lm_head.weight' not found in " + dir.string() + " (model.safetensors)");
}

TEST(ModelWeights, MissingShardIsNotFoundNamingShardAndIndex) {
  const fs::path dir = safetensors_dir();
  write_shard(dir / "model-00001-of-00002.safetensors", {{"a", 1}});
  write_index(dir, R"({"a": "model-00001-of-00002.safetensors",
                       "model.norm.weight": "model-00002-of-00002.safetensors"})");
  auto weights = ModelWeights::open(dir.string());
  EXPECT_EQ(weights.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(msg(weights.status()),
              HasSubstr("shard model-00002-of-00002.safetensors (holding model.norm.weight)"));
  EXPECT_THAT(msg(weights.status()), HasSubstr("model.safetensors.index.json"));
}

TEST(ModelWeights, IndexNamingTensorAbsentFromShardIsInvalid) {
  const fs::path dir = safetensors_dir();
  write_shard(dir / "model-00001-of-00001.safetensors", {{"a", 1}});
  write_index(dir, R"({"ghost": "model-00001-of-00001.safetensors"})");
  auto weights = ModelWeights::open(dir.string());
  EXPECT_EQ(weights.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(msg(weights.status()), HasSubstr("tensor 'ghost' is mapped to "
                                               "model-00001-of-00001.safetensors"));
}

TEST(ModelWeights, MalformedIndexIsInvalid) {
  const fs::path dir = safetensors_dir();
  std::ofstream(dir / "model.safetensors.index.json") << "{\"weight_map\": [";
  auto weights = ModelWeights::open(dir.string());
  EXPECT_EQ(weights.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(msg(weights.status()), HasSubstr("model.safetensors.index.json: malformed index"));
}

TEST(ModelWeights, EmptyDirectoryIsNotFound) {
  const fs::path dir = safetensors_dir();
  auto weights = ModelWeights::open(dir.string());
  EXPECT_EQ(weights.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(msg(weights.status()), HasSubstr(dir.string()));
}

// --- Bad input ------------------------------------------------------------------------------

std::string deep(int depth) { return std::string(depth, '[') + std::string(depth, ']'); }

// Writes `header` and `buffer` to `path` and returns why SafetensorsFile::open refuses the file;
// the refusal must be INVALID_ARGUMENT.
std::string refusal(const fs::path& path, const std::string& header, const std::string& buffer) {
  write_raw(path, header, buffer);
  auto file = SafetensorsFile::open(path.string());
  EXPECT_EQ(file.status().code(), absl::StatusCode::kInvalidArgument) << file.status();
  return msg(file.status());
}

TEST(SafetensorsBadInput, DeeplyNestedShapeOrOffsetsAreRefusedWithoutCrashing) {
  const fs::path dir = safetensors_dir();
  const fs::path path = dir / "deep.safetensors";
  EXPECT_EQ(refusal(path,
                    R"({"x": {"dtype": "F32", "shape": )" + deep(100000) +
                        R"(, "data_offsets": [0, 4]}})",
                    std::string(4, '\0')),
            path.string() +
                ": malformed safetensors header: JSON nested deeper than 64 "
                "levels at /x/shape");
  EXPECT_THAT(
      refusal(path,
              R"({"x": {"dtype": "F32", "shape": [1], "data_offsets": )" + deep(100000) + "}}",
              std::string(4, '\0')),
      HasSubstr("JSON nested deeper than 64 levels at /x/data_offsets"));
}

TEST(SafetensorsBadInput, ANestedShapeWithinTheDepthBoundIsQuotedShort) {
  const fs::path dir = safetensors_dir();
  const fs::path path = dir / "nested.safetensors";
  const std::string refused = refusal(
      path, R"({"x": {"dtype": "F32", "shape": )" + deep(50) + R"(, "data_offsets": [0, 4]}})",
      std::string(4, '\0'));
  EXPECT_THAT(refused, HasSubstr("tensor 'x': shape [[[["));
  EXPECT_LT(refused.size(), path.string().size() + 200);
}

TEST(SafetensorsBadInput, HeaderFollowedByNulAndGarbageIsRefused) {
  const fs::path dir = safetensors_dir();
  const fs::path path = dir / "trailing.safetensors";
  const std::string json = R"({"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}})";
  EXPECT_EQ(refusal(path, json + std::string("\0garbage", 8), std::string(4, '\0')),
            path.string() +
                ": malformed safetensors header: malformed JSON: NUL byte at "
                "offset " +
                std::to_string(json.size()));
  // Space padding (the spec's) is fine.
  write_raw(path, json + "      ", std::string(4, '\0'));
  EXPECT_TRUE(SafetensorsFile::open(path.string()).ok());
}

TEST(SafetensorsBadInput, AFifoIsRefusedWithoutBlocking) {
  const fs::path dir = safetensors_dir();
  const fs::path path = dir / "model.safetensors";
  ASSERT_EQ(::mkfifo(path.c_str(), 0600), 0);
  auto file = SafetensorsFile::open(path.string());
  ASSERT_EQ(file.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(msg(file.status()), path.string() + " is not a regular file (a FIFO)");
  auto weights = ModelWeights::open(dir.string());
  EXPECT_EQ(weights.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(SafetensorsBadInput, AnIndexListingATensorTwiceIsRefused) {
  const fs::path dir = safetensors_dir();
  write_shard(dir / "model-00001-of-00002.safetensors", {{"a", 1}});
  write_shard(dir / "model-00002-of-00002.safetensors", {{"b", 1}});
  write_index(dir, R"({"a": "model-00001-of-00002.safetensors",
                       "b": "model-00002-of-00002.safetensors",
                       "a": "model-00002-of-00002.safetensors"})");
  auto weights = ModelWeights::open(dir.string());
  ASSERT_EQ(weights.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(msg(weights.status()), (dir / "model.safetensors.index.json").string() +
                                       ": malformed index: duplicate key 'a' in the object at "
                                       "/weight_map");
}

TEST(SafetensorsBadInput, AShardTensorTheIndexDoesNotListOrListsElsewhereIsRefused) {
  const fs::path dir = safetensors_dir();
  write_shard(dir / "model-00001-of-00002.safetensors", {{"a", 1}, {"extra", 1}});
  write_shard(dir / "model-00002-of-00002.safetensors", {{"b", 1}});
  write_index(dir, R"({"a": "model-00001-of-00002.safetensors",
                       "b": "model-00002-of-00002.safetensors"})");
  const std::string index = (dir / "model.safetensors.index.json").string();
  auto weights = ModelWeights::open(dir.string());
  ASSERT_EQ(weights.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(msg(weights.status()), index +
                                       ": tensor 'extra' in model-00001-of-00002.safetensors is "
                                       "not listed in the weight_map");
  write_shard(dir / "model-00001-of-00002.safetensors", {{"a", 1}, {"b", 1}});
  weights = ModelWeights::open(dir.string());
  ASSERT_EQ(weights.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(msg(weights.status()), index +
                                       ": tensor 'b' is in both model-00001-of-00002.safetensors "
                                       "and model-00002-of-00002.safetensors (the weight_map "
                                       "maps it to the latter)");
}

TEST(SafetensorsBadInput, ATensorOutsideTheExpectedSetIsRefusedUnlessAllowed) {
  const fs::path dir = safetensors_dir();
  write_shard(dir / "model.safetensors", {{"a", 1}, {"lm_head.weight", 1}});
  auto weights = ModelWeights::open(dir.string());
  ASSERT_TRUE(weights.ok()) << weights.status();
  const std::set<std::string, std::less<>> expected = {"a"};
  absl::Status s = weights->check_tensor_set(expected, "config.json (tied)", false);
  ASSERT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(msg(s), "tensor 'lm_head.weight' in " + dir.string() +
                        " (model.safetensors) is not used by config.json (tied); a checkpoint "
                        "must hold exactly the model's weights (--allow-unused-tensors ignores "
                        "extra ones)");
  EXPECT_TRUE(weights->check_tensor_set(expected, "config.json", true).ok());
  EXPECT_TRUE(weights->check_tensor_set({"a", "lm_head.weight"}, "config.json", false).ok());
}

}  // namespace
}  // namespace simpler::llm
