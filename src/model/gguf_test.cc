#include "simpler/model/gguf.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/gguf_test_util.h"
#include "model/model_test_util.h"
#include "simpler/model/model_config.h"
#include "simpler/model/safetensors.h"

namespace simpler::llm {
namespace {

using testing::GgufBuilder;
using ::testing::HasSubstr;
using testing::msg;
using testing::poke;

constexpr uint32_t kF32 = 0, kF16 = 1, kQ4_0 = 2, kQ8_0 = 8, kQ5_K = 13, kQ4_K = 12, kQ6_K = 14,
                   kBF16 = 30;

std::string floats(std::vector<float> v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * 4);
}

class GgufParserTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("gguf_parser_test_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(dir_);  // an earlier process of the same pid may have left it
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  // A small valid file: three key-values, an f32 [2,3] and a bf16 [4] tensor.
  GgufBuilder good() {
    GgufBuilder b;
    b.string("general.architecture", "test");
    b.u32("test.count", 7);
    b.strings("test.names", {"a", "bc", ""});
    b.tensor("a", {2, 3}, kF32, floats({1, 2, 3, 4, 5, 6}));
    b.tensor("b", {4}, kBF16, std::string(8, '\x3f'));
    return b;
  }

  absl::StatusOr<GgufFile> open_bytes(const std::string& bytes) {
    const std::string path = (dir_ / "model.gguf").string();
    testing::write_file(path, bytes);
    return GgufFile::open(path);
  }

  // The status of opening `bytes` with the sizeof(T) bytes at `at` overwritten by `v`.
  template <class T>
  absl::Status open_poked(const std::string& bytes, uint64_t at, T v) {
    std::string edited = bytes;
    poke<T>(edited, at, v);
    return open_bytes(edited).status();
  }

  // Expects `s` to carry `code` and a message containing `part`.
  static void expect_refused(const absl::Status& s, absl::StatusCode code, std::string_view part) {
    EXPECT_EQ(s.code(), code) << s;
    EXPECT_THAT(msg(s), HasSubstr(std::string(part)));
  }

  std::filesystem::path dir_;
};

TEST_F(GgufParserTest, ReadsKeysTensorInfosAndPlacesTheDataAfterTheAlignedInfos) {
  GgufBuilder b = good();
  const std::string bytes = b.build();
  absl::StatusOr<GgufFile> f = open_bytes(bytes);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->version(), 3u);
  EXPECT_EQ(f->alignment(), 32u);
  EXPECT_EQ(f->data_offset(), b.layout.data_at);
  EXPECT_EQ(f->data_offset() % 32, 0u);
  EXPECT_THAT(f->keys(),
              ::testing::ElementsAre("general.architecture", "test.count", "test.names"));
  EXPECT_EQ(f->get_string("general.architecture").value(), "test");
  EXPECT_EQ(f->get_uint("test.count").value(), 7u);
  std::span<const std::string_view> names = f->get_string_array("test.names").value();
  EXPECT_THAT(std::vector<std::string_view>(names.begin(), names.end()),
              ::testing::ElementsAre("a", "bc", ""));
  ASSERT_EQ(f->tensors().size(), 2u);
  const GgufTensorInfo& a = f->tensors()[0];
  EXPECT_EQ(a.name, "a");
  EXPECT_EQ(a.shape, (std::vector<int64_t>{2, 3}));  // the file holds dims {3, 2}
  EXPECT_EQ(a.offset, 0u);
  absl::StatusOr<TensorView> view = f->tensor("a");
  ASSERT_TRUE(view.ok()) << view.status();
  EXPECT_EQ(view->dtype, task::DataType::kFloat32);
  EXPECT_EQ(view->shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(to_f32(*view).value(), (std::vector<float>{1, 2, 3, 4, 5, 6}));
  const GgufTensorInfo& t = f->tensors()[1];
  EXPECT_EQ(t.offset, 32u);  // 24 bytes of "a", padded to the alignment
  EXPECT_EQ(t.data.size(), 8u);
  EXPECT_EQ(static_cast<uint64_t>(t.data.data() - a.data.data()), 32u);
  EXPECT_EQ(f->tensor("b")->dtype, task::DataType::kBFloat16);
  EXPECT_EQ(f->tensor("zz").status().code(), absl::StatusCode::kNotFound);
}

TEST_F(GgufParserTest, TypedReadsNameTheKeyAndTheTypeFound) {
  absl::StatusOr<GgufFile> f = open_bytes(good().build());
  ASSERT_TRUE(f.ok()) << f.status();
  absl::Status missing = f->get_uint("test.nope").status();
  EXPECT_EQ(missing.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(msg(missing), HasSubstr("key 'test.nope' not found"));
  absl::Status wrong = f->get_string("test.count").status();
  EXPECT_EQ(wrong.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(msg(wrong), HasSubstr("key 'test.count' is a u32, expected a string"));
  EXPECT_THAT(msg(f->get_int_array("test.names").status()),
              HasSubstr("is an array of string, expected an array of integers"));
}

TEST_F(GgufParserTest, EveryTruncationIsAnErrorAndTheHeaderOnesSayTruncated) {
  const std::string bytes = good().build();
  for (size_t n = 0; n < bytes.size(); ++n) {
    absl::StatusOr<GgufFile> f = open_bytes(bytes.substr(0, n));
    ASSERT_FALSE(f.ok()) << "prefix of " << n << " bytes accepted";
    EXPECT_TRUE(f.status().code() == absl::StatusCode::kDataLoss ||
                f.status().code() == absl::StatusCode::kInvalidArgument)
        << n << ": " << f.status();
  }
  absl::Status s = open_bytes(bytes.substr(0, 20)).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(msg(s), HasSubstr("truncated GGUF file: the key-value count at byte 16"));
  s = open_bytes(bytes.substr(0, bytes.size() - 1)).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(msg(s), HasSubstr("tensor 'b' data [32, +8) goes past the end"));
  s = open_bytes("").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
}

TEST_F(GgufParserTest, IntegersOfEveryWidthAreWidenedKeepingTheirSign) {
  GgufBuilder b;
  b.ints<uint8_t>("t.u8", 0, {0, 255});
  b.ints<int8_t>("t.i8", 1, {-128, 127});
  b.ints<uint16_t>("t.u16", 2, {65535});
  b.ints<int16_t>("t.i16", 3, {-32768, -1});
  b.ints<uint32_t>("t.u32", 4, {4294967295u});
  b.ints<int32_t>("t.i32", 5, {std::numeric_limits<int32_t>::min(), 7});
  b.ints<int64_t>("t.i64", 11, {std::numeric_limits<int64_t>::min(), -1});
  b.ints<uint64_t>("t.u64", 10, {1, (uint64_t{1} << 63) - 1, uint64_t{1} << 63});
  b.i32("t.negative", -1);
  b.u64("t.top", (uint64_t{1} << 63) - 1);
  absl::StatusOr<GgufFile> f = open_bytes(b.build());
  ASSERT_TRUE(f.ok()) << f.status();
  using Ints = std::vector<int64_t>;
  EXPECT_EQ(f->get_int_array("t.u8").value(), (Ints{0, 255}));
  EXPECT_EQ(f->get_int_array("t.i8").value(), (Ints{-128, 127}));
  EXPECT_EQ(f->get_int_array("t.u16").value(), (Ints{65535}));
  EXPECT_EQ(f->get_int_array("t.i16").value(), (Ints{-32768, -1}));
  EXPECT_EQ(f->get_int_array("t.u32").value(), (Ints{4294967295}));
  EXPECT_EQ(f->get_int_array("t.i32").value(), (Ints{-2147483648, 7}));
  EXPECT_EQ(f->get_int_array("t.i64").value(), (Ints{std::numeric_limits<int64_t>::min(), -1}));
  expect_refused(f->get_int_array("t.u64").status(), absl::StatusCode::kInvalidArgument,
                 "key 't.u64' element 2 is above 2^63-1");
  expect_refused(f->get_uint("t.negative").status(), absl::StatusCode::kInvalidArgument,
                 "key 't.negative' is outside [0, 2^63-1]");
  EXPECT_EQ(f->get_uint("t.top").value(), (uint64_t{1} << 63) - 1);
}

TEST_F(GgufParserTest, HugeCountsAreRefusedBeforeAnythingIsAllocated) {
  GgufBuilder b = good();
  const std::string bytes = b.build();
  expect_refused(open_poked(bytes, b.layout.tensor_count_at, uint64_t{1} << 62),
                 absl::StatusCode::kInvalidArgument,
                 "tensor count 4611686018427387904 is more than the");
  expect_refused(open_poked(bytes, b.layout.kv_count_at, ~uint64_t{0}),
                 absl::StatusCode::kInvalidArgument,
                 "key-value count 18446744073709551615 is more than the");
  // test.names: the array's length follows its value type (4) and element type (4).
  expect_refused(open_poked(bytes, b.layout.value_type_at["test.names"] + 8, uint64_t{1} << 40),
                 absl::StatusCode::kInvalidArgument,
                 "key 'test.names': array length 1099511627776 of string is more than the");
}

TEST_F(GgufParserTest, AStringLengthPastTheEndOfTheFileIsRefused) {
  GgufBuilder b = good();
  std::string bytes = b.build();
  poke<uint64_t>(bytes, b.layout.key_at["test.count"], uint64_t{1} << 40);
  absl::Status s = open_bytes(bytes).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(msg(s), HasSubstr("key-value 1's key at byte"));
  EXPECT_THAT(msg(s), HasSubstr("has length 1099511627776, past the end of the file"));
}

TEST_F(GgufParserTest, DimensionCountsOutsideOneToFourAreRefused) {
  GgufBuilder b = good();
  const std::string bytes = b.build();
  for (uint32_t n : {0u, 5u}) {
    expect_refused(open_poked(bytes, b.layout.n_dims_at["a"], n),
                   absl::StatusCode::kInvalidArgument,
                   "tensor 'a' has " + std::to_string(n) + " dimensions (1 to 4 allowed)");
  }
}

TEST_F(GgufParserTest, DimensionsWhoseProductOverflowsAreRefused) {
  GgufBuilder b;
  b.tensor("big", {uint64_t{1} << 32, uint64_t{1} << 32}, kF32, "");
  absl::Status s = open_bytes(b.build()).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(msg(s), HasSubstr("tensor 'big' dims [4294967296,4294967296] overflow"));
  GgufBuilder huge;
  huge.tensor("huge", {uint64_t{1} << 63}, kF32, "");
  EXPECT_THAT(msg(open_bytes(huge.build()).status()), HasSubstr("overflow"));
  // A 0 makes the element count 0, but the other dimensions' product still overflows int64
  // (TensorView::numel multiplies the row-major shape, the file's dims reversed).
  GgufBuilder zero;
  zero.tensor("zero", {uint64_t{1} << 40, uint64_t{1} << 40, 0}, kF32, "");
  EXPECT_THAT(msg(open_bytes(zero.build()).status()),
              HasSubstr("tensor 'zero' dims [0,1099511627776,1099511627776] overflow"));
  // The element count fits, its bytes do not.
  GgufBuilder bytes;
  bytes.tensor("wide", {uint64_t{1} << 62}, kF32, "");
  EXPECT_THAT(msg(open_bytes(bytes.build()).status()),
              HasSubstr("overflow: the byte size exceeds 2^63-1"));
}

TEST_F(GgufParserTest, MisalignedOverlappingAndOutOfFileTensorsAreRefused) {
  GgufBuilder b = good();
  const std::string bytes = b.build();
  const uint64_t b_offset_at = b.layout.offset_at["b"];
  expect_refused(open_poked(bytes, b_offset_at, uint64_t{4}), absl::StatusCode::kInvalidArgument,
                 "tensor 'b' offset 4 is not a multiple of the alignment 32");
  expect_refused(open_poked(bytes, b_offset_at, uint64_t{0}), absl::StatusCode::kInvalidArgument,
                 "overlaps tensor");
  expect_refused(open_poked(bytes, b_offset_at, uint64_t{1} << 40), absl::StatusCode::kDataLoss,
                 "tensor 'b' data [1099511627776, +8) goes past the end");
}

TEST_F(GgufParserTest, UnknownValueTypesNestedArraysAndBadBoolsAreRefused) {
  GgufBuilder b = good();
  const std::string bytes = b.build();
  expect_refused(open_poked(bytes, b.layout.value_type_at["test.count"], uint32_t{13}),
                 absl::StatusCode::kInvalidArgument, "key 'test.count' has unknown value type 13");
  expect_refused(open_poked(bytes, b.layout.value_type_at["test.names"] + 4, uint32_t{9}),
                 absl::StatusCode::kInvalidArgument,
                 "key 'test.names': nested arrays are not supported");
  GgufBuilder flag;
  flag.boolean("test.flag", true);
  const std::string with_bool = flag.build();  // before its layout is read
  expect_refused(open_poked(with_bool, flag.layout.value_type_at["test.flag"] + 4, uint8_t{2}),
                 absl::StatusCode::kInvalidArgument, "key 'test.flag' is bool 2, not 0 or 1");
}

TEST_F(GgufParserTest, UnknownAndUnsupportedTensorTypesNameTheTensorAndTheType) {
  GgufBuilder b = good();
  const std::string bytes = b.build();
  expect_refused(open_poked(bytes, b.layout.type_at["b"], uint32_t{77}),
                 absl::StatusCode::kInvalidArgument,
                 "tensor 'b' has unknown ggml type 77 (F32, F16,");
  expect_refused(open_poked(bytes, b.layout.type_at["b"], kQ5_K), absl::StatusCode::kUnimplemented,
                 "tensor 'b' has type Q5_K (13), which is not read here");
}

TEST_F(GgufParserTest, DuplicateKeysAndTensorNamesAreRefused) {
  GgufBuilder b;
  b.u32("test.x", 1);
  b.u32("test.x", 2);
  EXPECT_THAT(msg(open_bytes(b.build()).status()), HasSubstr("duplicate key 'test.x'"));
  GgufBuilder t;
  t.tensor("w", {4}, kF32, floats({1, 2, 3, 4}));
  t.tensor("w", {4}, kF32, floats({1, 2, 3, 4}));
  EXPECT_THAT(msg(open_bytes(t.build()).status()), HasSubstr("duplicate tensor name 'w'"));
}

TEST_F(GgufParserTest, MagicVersionAndEndiannessAreChecked) {
  const std::string bytes = good().build();
  std::string edited = bytes;
  edited[0] = 'X';
  absl::Status s = open_bytes(edited).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(msg(s), HasSubstr("not a GGUF file: magic 'XGUF', expected 'GGUF'"));
  edited = bytes;
  poke<uint32_t>(edited, 4, 1);
  EXPECT_THAT(msg(open_bytes(edited).status()),
              HasSubstr("GGUF version 1 is not supported (versions 2 and 3 are)"));
  poke<uint32_t>(edited, 4, 0x03000000);
  EXPECT_THAT(msg(open_bytes(edited).status()), HasSubstr("a big-endian GGUF file"));
  poke<uint32_t>(edited, 4, 2);
  EXPECT_TRUE(open_bytes(edited).ok());
}

TEST_F(GgufParserTest, GeneralAlignmentMovesTheDataAndMustBeAPowerOfTwo) {
  GgufBuilder b;
  b.u32("general.alignment", 64);
  b.tensor("a", {3}, kF32, floats({1, 2, 3}));
  b.tensor("b", {2}, kF16, std::string(4, '\0'));
  absl::StatusOr<GgufFile> f = open_bytes(b.build(64));
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->alignment(), 64u);
  EXPECT_EQ(f->data_offset() % 64, 0u);
  EXPECT_EQ(f->tensors()[1].offset, 64u);
  EXPECT_EQ(f->tensor("b")->dtype, task::DataType::kFloat16);
  GgufBuilder odd;
  odd.u32("general.alignment", 48);
  EXPECT_THAT(msg(open_bytes(odd.build()).status()),
              HasSubstr("general.alignment must be a u32 power of two, got 48"));
  GgufBuilder typed;
  typed.u64("general.alignment", 32);
  EXPECT_THAT(msg(open_bytes(typed.build()).status()),
              HasSubstr("general.alignment must be a u32 power of two, got u64"));
}

TEST_F(GgufParserTest, QuantizedTensorsAreSizedByTheirBlocksAndReadAsViews) {
  struct Case {
    uint32_t type;
    const char* name;
    uint64_t cols;
    size_t bytes;
  };
  // ggml's block sizes: Q4_0 and Q8_0 32 elements in 18 / 34 bytes; Q4_K and Q6_K 256 in
  // 144 / 210.
  for (const Case& c : {Case{kQ4_0, "Q4_0", 64, 2 * 2 * 18}, Case{kQ8_0, "Q8_0", 32, 2 * 34},
                        Case{kQ4_K, "Q4_K", 256, 2 * 144}, Case{kQ6_K, "Q6_K", 512, 2 * 2 * 210}}) {
    GgufBuilder b;
    b.tensor("q", {2, c.cols}, c.type, std::string(c.bytes, '\x01'));
    absl::StatusOr<GgufFile> f = open_bytes(b.build());
    ASSERT_TRUE(f.ok()) << c.name << ": " << f.status();
    EXPECT_EQ(f->tensors()[0].data.size(), c.bytes) << c.name;
    absl::StatusOr<TensorView> view = f->tensor("q");
    // Every one is read in place: its blocks, the row-major shape, its dtype.
    ASSERT_TRUE(view.ok()) << view.status();
    EXPECT_EQ(view->dtype, task::parse_data_type(c.name).value()) << c.name;
    EXPECT_EQ(view->shape, (std::vector<int64_t>{2, static_cast<int64_t>(c.cols)}));
    EXPECT_EQ(view->bytes.data(), f->tensors()[0].data.data());
    EXPECT_EQ(view->bytes.size(), c.bytes);
    // One byte short of the blocks.
    GgufBuilder short_file;
    short_file.tensor("q", {2, c.cols}, c.type, std::string(c.bytes - 1, '\x01'));
    EXPECT_EQ(open_bytes(short_file.build()).status().code(), absl::StatusCode::kDataLoss)
        << c.name;
  }
  GgufBuilder ragged;
  ragged.tensor("q", {2, 48}, kQ8_0, std::string(3 * 34, '\0'));
  EXPECT_THAT(msg(open_bytes(ragged.build()).status()),
              HasSubstr("tensor 'q' of type Q8_0 has an innermost dimension of 48, not a "
                        "multiple of its block size 32"));
  // A K type's rows are whole super-blocks of 256.
  for (const auto& [type, name] : {std::pair{kQ4_K, "Q4_K"}, std::pair{kQ6_K, "Q6_K"}}) {
    GgufBuilder ragged_k;
    ragged_k.tensor("blk.0.ffn_down.weight", {2, 384}, type, std::string(3 * 210, '\0'));
    absl::Status s = open_bytes(ragged_k.build()).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(msg(s), HasSubstr(absl::StrCat("tensor 'blk.0.ffn_down.weight' of type ", name,
                                               " has an innermost dimension of 384, not a "
                                               "multiple of its block size 256")));
  }
}

TEST(GgmlTypeTest, NamesEveryGgmlTypeAndKnowsTheBlockSizesOfTheOnesReadHere) {
  EXPECT_EQ(ggml_type_name(13), "Q5_K");
  EXPECT_EQ(ggml_type_name(16), "IQ2_XXS");
  EXPECT_EQ(ggml_type_name(4), "unknown ggml type 4");
  EXPECT_EQ(ggml_type_name(1000), "unknown ggml type 1000");
  ASSERT_NE(ggml_type_traits(14), nullptr);
  EXPECT_EQ(ggml_type_traits(14)->block_bytes, 210u);
  EXPECT_EQ(ggml_type_traits(13), nullptr);
}

// A name ending in .gguf in any case (existing or not), or any file that starts with GGUF's
// magic; not a directory, whatever its name, nor another file.
TEST_F(GgufParserTest, AGgufPathIsNamedSoOrStartsWithTheMagic) {
  EXPECT_TRUE(is_gguf_path("/x/model.gguf"));
  EXPECT_TRUE(is_gguf_path("/x/MODEL.GGUF"));
  EXPECT_FALSE(is_gguf_path("/x/model"));
  const std::string bytes = good().build();
  for (const char* name : {"model.bin", "noext"}) {
    std::ofstream((dir_ / name).string(), std::ios::binary) << bytes;
    EXPECT_TRUE(is_gguf_path((dir_ / name).string())) << name;
  }
  std::ofstream((dir_ / "notes.txt").string()) << "GGU";  // shorter than the magic
  EXPECT_FALSE(is_gguf_path((dir_ / "notes.txt").string()));
  std::ofstream((dir_ / "ggml.bin").string()) << "ggml" << bytes;
  EXPECT_FALSE(is_gguf_path((dir_ / "ggml.bin").string()));
  std::filesystem::create_directory(dir_ / "dir.gguf");
  EXPECT_FALSE(is_gguf_path((dir_ / "dir.gguf").string()));
  // A FIFO is not opened (its read would wait for a writer).
  ASSERT_EQ(::mkfifo((dir_ / "fifo").c_str(), 0600), 0);
  EXPECT_FALSE(is_gguf_path((dir_ / "fifo").string()));
}

}  // namespace
}  // namespace simpler::llm
