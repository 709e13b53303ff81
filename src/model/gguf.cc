#include "simpler/model/gguf.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string_view>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "model/gguf_names.h"
#include "model/mapped_file.h"
#include "model/str.h"
#include "simpler/base/status.h"

namespace simpler::llm {
namespace {

constexpr uint64_t kInt64Max = static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
// Smallest encodings: a key-value is a key length (8), a value type (4) and a value of at least
// one byte; a tensor info is a name length (8), n_dims (4), one dimension (8), a type (4) and an
// offset (8); a string is its length (8).
constexpr uint64_t kMinKvBytes = 13;
constexpr uint64_t kMinTensorInfoBytes = 32;
constexpr uint64_t kMinStringBytes = 8;

constexpr std::array<GgmlTypeTraits, 7> kTraits = {{
    {GgmlType::kF32, "F32", 1, 4, false, task::DataType::kFloat32},
    {GgmlType::kF16, "F16", 1, 2, false, task::DataType::kFloat16},
    {GgmlType::kQ4_0, "Q4_0", 32, 18, true, task::DataType::kQ4_0},
    {GgmlType::kQ8_0, "Q8_0", 32, 34, true, task::DataType::kQ8_0},
    {GgmlType::kQ4_K, "Q4_K", 256, 144, true, task::DataType::kQ4_K},
    {GgmlType::kQ6_K, "Q6_K", 256, 210, true, task::DataType::kQ6_K},
    {GgmlType::kBF16, "BF16", 1, 2, false, task::DataType::kBFloat16},
}};

// ggml's type names by value (ggml/include/ggml.h); empty where a value was removed.
constexpr std::array<std::string_view, 43> kGgmlNames = {
    "F32",     "F16",   "Q4_0",   "Q4_1",  "",      "",       "Q5_0", "Q5_1",    "Q8_0",
    "Q8_1",    "Q2_K",  "Q3_K",   "Q4_K",  "Q5_K",  "Q6_K",   "Q8_K", "IQ2_XXS", "IQ2_XS",
    "IQ3_XXS", "IQ1_S", "IQ4_NL", "IQ3_S", "IQ2_S", "IQ4_XS", "I8",   "I16",     "I32",
    "I64",     "F64",   "IQ1_M",  "BF16",  "",      "",       "",     "TQ1_0",   "TQ2_0",
    "",        "",      "",       "MXFP4", "NVFP4", "Q1_0",   "Q2_0",
};

// Byte size of a fixed-size value type; 0 for string, array and unknown types.
uint64_t scalar_size(GgufValueType type) {
  switch (type) {
    case GgufValueType::kUint8:
    case GgufValueType::kInt8:
    case GgufValueType::kBool:
      return 1;
    case GgufValueType::kUint16:
    case GgufValueType::kInt16:
      return 2;
    case GgufValueType::kUint32:
    case GgufValueType::kInt32:
    case GgufValueType::kFloat32:
      return 4;
    case GgufValueType::kUint64:
    case GgufValueType::kInt64:
    case GgufValueType::kFloat64:
      return 8;
    default:
      return 0;
  }
}

bool known_value_type(uint32_t type) {
  return type <= static_cast<uint32_t>(GgufValueType::kFloat64);
}

bool is_integer(GgufValueType type) {
  return type != GgufValueType::kBool && type != GgufValueType::kFloat32 &&
         type != GgufValueType::kFloat64 && scalar_size(type) != 0;
}

// An integer element of `type` at `p`, widened; false when it does not fit int64 or `type` is not
// an integer type. The element's bytes are little-endian, as are the hosts the reader runs on.
bool read_integer(GgufValueType type, const std::byte* p, int64_t* out) {
  if (!is_integer(type)) return false;
  const uint64_t size = scalar_size(type);
  uint64_t bits = 0;
  std::memcpy(&bits, p, size);
  const bool is_signed = type == GgufValueType::kInt8 || type == GgufValueType::kInt16 ||
                         type == GgufValueType::kInt32 || type == GgufValueType::kInt64;
  if (is_signed) {
    // Sign-extends the element's top bit (the shift right is arithmetic).
    const uint64_t unused = 64 - 8 * size;
    *out = static_cast<int64_t>(bits << unused) >> unused;
    return true;
  }
  *out = static_cast<int64_t>(bits);
  return bits <= kInt64Max;
}

// Bounds-checked little-endian reads over the mapped file.
class Cursor {
 public:
  Cursor(std::span<const std::byte> bytes, const std::string& path) : bytes_(bytes), path_(path) {}

  uint64_t at() const { return at_; }
  uint64_t left() const { return bytes_.size() - at_; }

  absl::Status need(uint64_t n, std::string_view what) const {
    if (n <= left()) return absl::OkStatus();
    return absl::DataLossError(absl::StrCat(path_, ": truncated GGUF file: ", str(what),
                                            " at byte ", at_, " needs ", n, " bytes, ", left(),
                                            " left"));
  }
  std::span<const std::byte> take(uint64_t n) {  // after need(n)
    std::span<const std::byte> out = bytes_.subspan(at_, n);
    at_ += n;
    return out;
  }
  template <class T>
  absl::StatusOr<T> read(std::string_view what) {
    SIMPLER_RETURN_IF_ERROR(need(sizeof(T), what));
    T v;
    std::memcpy(&v, take(sizeof(T)).data(), sizeof(T));
    return v;
  }
  absl::StatusOr<std::string_view> string(std::string_view what) {
    SIMPLER_ASSIGN_OR_RETURN(const uint64_t n, read<uint64_t>(what));
    if (n > left()) {
      return absl::DataLossError(
          absl::StrCat(path_, ": truncated GGUF file: ", str(what), " at byte ", at_ - 8,
                       " has length ", n, ", past the end of the file (", left(), " bytes left)"));
    }
    std::span<const std::byte> s = take(n);
    return std::string_view(reinterpret_cast<const char*>(s.data()), s.size());
  }

 private:
  std::span<const std::byte> bytes_;
  const std::string& path_;
  uint64_t at_ = 0;
};

}  // namespace

const GgmlTypeTraits* ggml_type_traits(uint32_t type) {
  for (const GgmlTypeTraits& t : kTraits) {
    if (static_cast<uint32_t>(t.type) == type) return &t;
  }
  return nullptr;
}

std::string ggml_type_name(uint32_t type) {
  if (type < kGgmlNames.size() && !kGgmlNames[type].empty()) return str(kGgmlNames[type]);
  return absl::StrCat("unknown ggml type ", type);
}

std::string gguf_value_type_name(GgufValueType type) {
  static constexpr std::array<std::string_view, 13> kNames = {
      "u8",   "i8",     "u16",   "i16", "u32", "i32", "f32",
      "bool", "string", "array", "u64", "i64", "f64"};
  const auto v = static_cast<uint32_t>(type);
  return v < kNames.size() ? str(kNames[v]) : absl::StrCat("type ", v);
}

bool is_gguf_path(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) return false;
  if (path.size() > 5 && absl::EndsWithIgnoreCase(path, ".gguf")) return true;
  // Any other name: a regular file (not a FIFO or device, whose read could block) that starts
  // with GGUF's magic.
  if (!std::filesystem::is_regular_file(path, ec)) return false;
  std::ifstream file(path, std::ios::binary);
  std::array<char, 4> magic{};
  return file.read(magic.data(), magic.size()) && std::string_view(magic.data(), 4) == "GGUF";
}

// ---------------------------------------------------------------------------------------------
// GgufFile

namespace {

// What open reads from the file.
struct Parsed {
  uint32_t version = 0;
  uint64_t alignment = kGgufDefaultAlignment;
  uint64_t data_offset = 0;
  std::vector<std::string> keys;
  std::map<std::string, GgufValue, std::less<>> values;
  std::vector<GgufTensorInfo> tensors;
  std::map<std::string, size_t, std::less<>> tensor_index;
};

}  // namespace

struct GgufFile::State : Parsed {
  MappedFile map;
};

GgufFile::GgufFile(std::unique_ptr<State> state) : state_(std::move(state)) {}
GgufFile::GgufFile(GgufFile&&) noexcept = default;
GgufFile& GgufFile::operator=(GgufFile&&) noexcept = default;
GgufFile::~GgufFile() = default;

namespace {

absl::Status invalid(const std::string& path, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(path, ": ", what));
}

// The elements of an array value (after its key and type): element type, count, elements.
absl::Status read_array(Cursor& c, const std::string& path, const std::string& key,
                        GgufValue& value) {
  SIMPLER_ASSIGN_OR_RETURN(const uint32_t element, c.read<uint32_t>("an array's element type"));
  if (!known_value_type(element)) {
    return invalid(path, absl::StrCat("key '", key, "': array of unknown value type ", element));
  }
  value.element_type = static_cast<GgufValueType>(element);
  if (value.element_type == GgufValueType::kArray) {
    return invalid(path, absl::StrCat("key '", key, "': nested arrays are not supported"));
  }
  SIMPLER_ASSIGN_OR_RETURN(value.count, c.read<uint64_t>("an array's length"));
  const uint64_t size = scalar_size(value.element_type);
  const uint64_t min_bytes = size != 0 ? size : kMinStringBytes;
  if (value.count > c.left() / min_bytes) {
    return invalid(path, absl::StrCat("key '", key, "': array length ", value.count, " of ",
                                      gguf_value_type_name(value.element_type),
                                      " is more than the ", c.left(), " bytes left could hold"));
  }
  if (size != 0) {
    value.data = c.take(value.count * size);
    if (value.element_type == GgufValueType::kBool) {
      for (uint64_t i = 0; i < value.count; ++i) {
        if (static_cast<uint8_t>(value.data[i]) > 1) {
          return invalid(path, absl::StrCat("key '", key, "': element ", i, " is bool ",
                                            static_cast<int>(value.data[i]), ", not 0 or 1"));
        }
      }
    }
    return absl::OkStatus();
  }
  value.strings.reserve(value.count);
  for (uint64_t i = 0; i < value.count; ++i) {
    SIMPLER_ASSIGN_OR_RETURN(std::string_view s,
                             c.string(absl::StrCat("key '", key, "' string ", i)));
    value.strings.push_back(s);
  }
  return absl::OkStatus();
}

absl::StatusOr<GgufValue> read_value(Cursor& c, const std::string& path, const std::string& key) {
  SIMPLER_ASSIGN_OR_RETURN(const uint32_t type, c.read<uint32_t>("a value type"));
  if (!known_value_type(type)) {
    return invalid(path, absl::StrCat("key '", key, "' has unknown value type ", type));
  }
  GgufValue value;
  value.type = static_cast<GgufValueType>(type);
  if (value.type == GgufValueType::kString) {
    SIMPLER_ASSIGN_OR_RETURN(value.string, c.string(absl::StrCat("key '", key, "' value")));
    return value;
  }
  if (value.type == GgufValueType::kArray) {
    SIMPLER_RETURN_IF_ERROR(read_array(c, path, key, value));
    return value;
  }
  const uint64_t size = scalar_size(value.type);
  SIMPLER_RETURN_IF_ERROR(c.need(size, absl::StrCat("key '", key, "' value")));
  value.data = c.take(size);
  if (value.type == GgufValueType::kBool && static_cast<uint8_t>(value.data[0]) > 1) {
    return invalid(path, absl::StrCat("key '", key, "' is bool ", static_cast<int>(value.data[0]),
                                      ", not 0 or 1"));
  }
  return value;
}

// Magic, version and the two counts.
absl::Status read_header(Cursor& c, const std::string& path, uint32_t* version,
                         uint64_t* tensor_count, uint64_t* kv_count) {
  SIMPLER_RETURN_IF_ERROR(c.need(4, "the magic"));
  std::span<const std::byte> magic = c.take(4);
  if (std::memcmp(magic.data(), "GGUF", 4) != 0) {
    std::string shown;
    for (std::byte b : magic) {
      const char ch = static_cast<char>(b);
      shown += ch >= 0x20 && ch < 0x7f ? std::string(1, ch)
                                       : absl::StrCat("\\x", absl::Hex(ch & 0xff, absl::kZeroPad2));
    }
    return invalid(path, absl::StrCat("not a GGUF file: magic '", shown, "', expected 'GGUF'"));
  }
  SIMPLER_ASSIGN_OR_RETURN(*version, c.read<uint32_t>("the version"));
  if (*version == 0x02000000 || *version == 0x03000000) {
    return invalid(path, "a big-endian GGUF file; only little-endian files are read");
  }
  if (*version != 2 && *version != 3) {
    return invalid(
        path, absl::StrCat("GGUF version ", *version, " is not supported (versions 2 and 3 are)"));
  }
  SIMPLER_ASSIGN_OR_RETURN(*tensor_count, c.read<uint64_t>("the tensor count"));
  SIMPLER_ASSIGN_OR_RETURN(*kv_count, c.read<uint64_t>("the key-value count"));
  if (*kv_count > c.left() / kMinKvBytes) {
    return invalid(path, absl::StrCat("key-value count ", *kv_count, " is more than the ", c.left(),
                                      " bytes left could hold"));
  }
  return absl::OkStatus();
}

absl::Status read_metadata(Cursor& c, const std::string& path, uint64_t kv_count, Parsed& s) {
  s.keys.reserve(kv_count);
  for (uint64_t i = 0; i < kv_count; ++i) {
    SIMPLER_ASSIGN_OR_RETURN(std::string_view key_view,
                             c.string(absl::StrCat("key-value ", i, "'s key")));
    std::string key(key_view);
    SIMPLER_ASSIGN_OR_RETURN(GgufValue value, read_value(c, path, key));
    if (!s.values.emplace(key, std::move(value)).second) {
      return invalid(path, absl::StrCat("duplicate key '", key, "'"));
    }
    s.keys.push_back(std::move(key));
  }
  if (auto it = s.values.find("general.alignment"); it != s.values.end()) {
    uint32_t a = 0;
    if (it->second.type == GgufValueType::kUint32) std::memcpy(&a, it->second.data.data(), 4);
    if (it->second.type != GgufValueType::kUint32 || a == 0 || (a & (a - 1)) != 0) {
      return invalid(
          path, absl::StrCat("general.alignment must be a u32 power of two, got ",
                             a == 0 ? gguf_value_type_name(it->second.type) : std::to_string(a)));
    }
    s.alignment = a;
  }
  return absl::OkStatus();
}

// n_dims, dims and type of `t` (its row-major shape and type); returns its data's byte size.
absl::StatusOr<uint64_t> read_dims(Cursor& c, const std::string& path, GgufTensorInfo& t) {
  SIMPLER_ASSIGN_OR_RETURN(const uint32_t n_dims,
                           c.read<uint32_t>(absl::StrCat("tensor '", t.name, "' n_dims")));
  if (n_dims == 0 || n_dims > kGgufMaxDims) {
    return invalid(path, absl::StrCat("tensor '", t.name, "' has ", n_dims, " dimensions (1 to ",
                                      kGgufMaxDims, " allowed)"));
  }
  std::vector<uint64_t> dims(n_dims);
  // The product of the non-zero dimensions must fit int64: then every partial product does, in
  // the file's order and in the reversed order TensorView::numel multiplies in, even when a 0
  // makes the element count 0.
  uint64_t nonzero = 1;
  bool overflow = false, empty = false;
  for (uint32_t d = 0; d < n_dims; ++d) {
    SIMPLER_ASSIGN_OR_RETURN(dims[d], c.read<uint64_t>(absl::StrCat("tensor '", t.name, "' dims")));
    if (dims[d] == 0) {
      empty = true;
      continue;
    }
    if (dims[d] > kInt64Max || nonzero > kInt64Max / dims[d]) overflow = true;
    if (!overflow) nonzero *= dims[d];
  }
  const uint64_t numel = empty ? 0 : nonzero;
  std::string shown = "[";
  for (uint32_t d = 0; d < n_dims; ++d) absl::StrAppend(&shown, d ? "," : "", dims[d]);
  shown += "]";
  if (overflow) {
    return invalid(path, absl::StrCat("tensor '", t.name, "' dims ", shown,
                                      " overflow: the element count exceeds 2^63-1"));
  }
  SIMPLER_ASSIGN_OR_RETURN(const uint32_t type,
                           c.read<uint32_t>(absl::StrCat("tensor '", t.name, "' type")));
  const GgmlTypeTraits* traits = ggml_type_traits(type);
  if (traits == nullptr) {
    constexpr const char* kRead = "F32, F16, BF16, Q8_0, Q4_0, Q4_K and Q6_K";
    const std::string name = ggml_type_name(type);
    if (name.starts_with("unknown")) {  // "unknown ggml type N"
      return invalid(
          path, absl::StrCat("tensor '", t.name, "' has ", name, " (", kRead, " are read here)"));
    }
    return absl::UnimplementedError(absl::StrCat(path, ": tensor '", t.name, "' has type ", name,
                                                 " (", type, "), which is not read here (", kRead,
                                                 " are)"));
  }
  t.type = type;
  if (dims[0] % traits->block_size != 0) {
    return invalid(path, absl::StrCat("tensor '", t.name, "' of type ", str(traits->name),
                                      " has an innermost dimension of ", dims[0],
                                      ", not a multiple of its block size ", traits->block_size));
  }
  const uint64_t blocks = numel / traits->block_size;
  if (blocks > kInt64Max / traits->block_bytes) {
    return invalid(path,
                   absl::StrCat("tensor '", t.name, "' dims ", shown, " of ", str(traits->name),
                                " overflow: the byte size exceeds 2^63-1"));
  }
  for (auto d = dims.rbegin(); d != dims.rend(); ++d) t.shape.push_back(static_cast<int64_t>(*d));
  return blocks * traits->block_bytes;
}

absl::Status read_tensor_infos(Cursor& c, const std::string& path, uint64_t tensor_count, Parsed& s,
                               std::vector<uint64_t>& sizes) {
  if (tensor_count > c.left() / kMinTensorInfoBytes) {
    return invalid(path, absl::StrCat("tensor count ", tensor_count, " is more than the ", c.left(),
                                      " bytes left could hold"));
  }
  s.tensors.reserve(tensor_count);
  sizes.reserve(tensor_count);
  for (uint64_t i = 0; i < tensor_count; ++i) {
    GgufTensorInfo t;
    SIMPLER_ASSIGN_OR_RETURN(std::string_view name,
                             c.string(absl::StrCat("tensor info ", i, "'s name")));
    t.name = std::string(name);
    if (t.name.empty()) return invalid(path, absl::StrCat("tensor info ", i, " has an empty name"));
    SIMPLER_ASSIGN_OR_RETURN(const uint64_t size, read_dims(c, path, t));
    sizes.push_back(size);
    SIMPLER_ASSIGN_OR_RETURN(t.offset,
                             c.read<uint64_t>(absl::StrCat("tensor '", t.name, "' offset")));
    if (t.offset % s.alignment != 0) {
      return invalid(path, absl::StrCat("tensor '", t.name, "' offset ", t.offset,
                                        " is not a multiple of the alignment ", s.alignment));
    }
    if (!s.tensor_index.emplace(t.name, s.tensors.size()).second) {
      return invalid(path, absl::StrCat("duplicate tensor name '", t.name, "'"));
    }
    s.tensors.push_back(std::move(t));
  }
  return absl::OkStatus();
}

// Places every tensor's data in the data section: inside the file, and no two overlapping.
absl::Status place_tensors(const std::string& path, std::span<const std::byte> file,
                           const std::vector<uint64_t>& sizes, Parsed& s) {
  const uint64_t data_size = s.data_offset <= file.size() ? file.size() - s.data_offset : 0;
  for (size_t i = 0; i < s.tensors.size(); ++i) {
    GgufTensorInfo& t = s.tensors[i];
    if (sizes[i] == 0) continue;
    if (s.data_offset > file.size() || t.offset > data_size || sizes[i] > data_size - t.offset) {
      return absl::DataLossError(absl::StrCat(path, ": truncated GGUF file: tensor '", t.name,
                                              "' data [", t.offset, ", +", sizes[i],
                                              ") goes past the end of the data section (",
                                              data_size, " bytes from byte ", s.data_offset, ")"));
    }
    t.data = file.subspan(s.data_offset + t.offset, sizes[i]);
  }
  std::vector<size_t> order;
  for (size_t i = 0; i < s.tensors.size(); ++i) {
    if (sizes[i] != 0) order.push_back(i);
  }
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t b) { return s.tensors[a].offset < s.tensors[b].offset; });
  for (size_t k = 1; k < order.size(); ++k) {
    const GgufTensorInfo& prev = s.tensors[order[k - 1]];
    const GgufTensorInfo& cur = s.tensors[order[k]];
    if (prev.offset + sizes[order[k - 1]] > cur.offset) {
      return invalid(path, absl::StrCat("tensor '", cur.name, "' data at offset ", cur.offset,
                                        " overlaps tensor '", prev.name, "' [", prev.offset, ", ",
                                        prev.offset + sizes[order[k - 1]], ")"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<GgufFile> GgufFile::open(const std::string& path) {
  auto s = std::make_unique<State>();
  SIMPLER_ASSIGN_OR_RETURN(s->map, MappedFile::open(path));
  const std::span<const std::byte> file = s->map.bytes();
  Cursor c(file, path);
  uint64_t tensor_count = 0, kv_count = 0;
  SIMPLER_RETURN_IF_ERROR(read_header(c, path, &s->version, &tensor_count, &kv_count));
  SIMPLER_RETURN_IF_ERROR(read_metadata(c, path, kv_count, *s));
  std::vector<uint64_t> sizes;
  SIMPLER_RETURN_IF_ERROR(read_tensor_infos(c, path, tensor_count, *s, sizes));
  s->data_offset = (c.at() + s->alignment - 1) / s->alignment * s->alignment;
  SIMPLER_RETURN_IF_ERROR(place_tensors(path, file, sizes, *s));
  return GgufFile(std::move(s));
}

const std::string& GgufFile::path() const { return state_->map.path(); }
uint32_t GgufFile::version() const { return state_->version; }
uint64_t GgufFile::alignment() const { return state_->alignment; }
uint64_t GgufFile::data_offset() const { return state_->data_offset; }
const std::vector<std::string>& GgufFile::keys() const { return state_->keys; }
const std::vector<GgufTensorInfo>& GgufFile::tensors() const { return state_->tensors; }

const GgufValue* GgufFile::find(std::string_view key) const {
  auto it = state_->values.find(key);
  return it == state_->values.end() ? nullptr : &it->second;
}

const GgufTensorInfo* GgufFile::find_tensor(std::string_view name) const {
  auto it = state_->tensor_index.find(name);
  return it == state_->tensor_index.end() ? nullptr : &state_->tensors[it->second];
}

namespace {

absl::StatusOr<const GgufValue*> typed(const GgufFile& f, std::string_view key,
                                       std::string_view expected, bool (*ok)(const GgufValue&)) {
  const GgufValue* v = f.find(key);
  if (v == nullptr) {
    return absl::NotFoundError(absl::StrCat(f.path(), ": key '", str(key), "' not found"));
  }
  if (!ok(*v)) {
    std::string got = gguf_value_type_name(v->type);
    if (v->type == GgufValueType::kArray) {
      absl::StrAppend(&got, " of ", gguf_value_type_name(v->element_type));
    }
    return absl::InvalidArgumentError(
        absl::StrCat(f.path(), ": key '", str(key), "' is ",
                     std::string_view("aeif").find(got[0]) == std::string_view::npos ? "a " : "an ",
                     got, ", expected ", str(expected)));
  }
  return v;
}

}  // namespace

absl::StatusOr<std::string_view> GgufFile::get_string(std::string_view key) const {
  SIMPLER_ASSIGN_OR_RETURN(const GgufValue* v,
                           typed(*this, key, "a string", [](const GgufValue& v) {
                             return v.type == GgufValueType::kString;
                           }));
  return v->string;
}

absl::StatusOr<uint64_t> GgufFile::get_uint(std::string_view key) const {
  SIMPLER_ASSIGN_OR_RETURN(
      const GgufValue* v,
      typed(*this, key, "an integer", [](const GgufValue& v) { return is_integer(v.type); }));
  int64_t out = 0;
  if (!read_integer(v->type, v->data.data(), &out) || out < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(path(), ": key '", str(key), "' is outside [0, 2^63-1]"));
  }
  return static_cast<uint64_t>(out);
}

absl::StatusOr<double> GgufFile::get_float(std::string_view key) const {
  SIMPLER_ASSIGN_OR_RETURN(
      const GgufValue* v, typed(*this, key, "an f32 or f64", [](const GgufValue& v) {
        return v.type == GgufValueType::kFloat32 || v.type == GgufValueType::kFloat64;
      }));
  if (v->type == GgufValueType::kFloat32) {
    float f;
    std::memcpy(&f, v->data.data(), 4);
    return static_cast<double>(f);
  }
  double d;
  std::memcpy(&d, v->data.data(), 8);
  return d;
}

absl::StatusOr<std::span<const std::string_view>> GgufFile::get_string_array(
    std::string_view key) const {
  SIMPLER_ASSIGN_OR_RETURN(
      const GgufValue* v, typed(*this, key, "an array of string", [](const GgufValue& v) {
        return v.type == GgufValueType::kArray && v.element_type == GgufValueType::kString;
      }));
  return std::span<const std::string_view>(v->strings);
}

absl::StatusOr<std::vector<int64_t>> GgufFile::get_int_array(std::string_view key) const {
  SIMPLER_ASSIGN_OR_RETURN(const GgufValue* v,
                           typed(*this, key, "an array of integers", [](const GgufValue& v) {
                             return v.type == GgufValueType::kArray && is_integer(v.element_type);
                           }));
  const uint64_t size = scalar_size(v->element_type);
  std::vector<int64_t> out(v->count);
  for (uint64_t i = 0; i < v->count; ++i) {
    if (!read_integer(v->element_type, v->data.data() + i * size, &out[i])) {
      return absl::InvalidArgumentError(
          absl::StrCat(path(), ": key '", str(key), "' element ", i, " is above 2^63-1"));
    }
  }
  return out;
}

absl::StatusOr<TensorView> GgufFile::tensor(std::string_view name) const {
  const GgufTensorInfo* t = find_tensor(name);
  if (t == nullptr) {
    return absl::NotFoundError(absl::StrCat("tensor '", str(name), "' not found in ", path()));
  }
  const GgmlTypeTraits* traits = ggml_type_traits(t->type);
  TensorView view;
  view.dtype = traits->dtype;
  view.name = t->name;
  view.file = path();
  view.shape = t->shape;
  view.bytes = t->data;
  view.mapping = &state_->map;
  return view;
}

}  // namespace simpler::llm
