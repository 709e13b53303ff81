#include "simpler/model/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <set>
#include <sstream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "model/gguf_names.h"
#include "model/mapped_file.h"
#include "model/str.h"
#include "nlohmann/json.hpp"
#include "simpler/base/file.h"
#include "simpler/base/json.h"
#include "simpler/base/status.h"
#include "simpler/model/gguf.h"

namespace simpler::llm {
namespace {

using json = nlohmann::json;
using task::DataType;

constexpr std::string_view kMetadataKey = "__metadata__";

using base::os_error;

// a * b, false on overflow or negative operands.
bool checked_mul(uint64_t a, uint64_t b, uint64_t* out) {
  if (a != 0 && b > std::numeric_limits<uint64_t>::max() / a) return false;
  *out = a * b;
  return true;
}

// The dtypes to_f32 converts.
bool is_float(DataType dtype) {
  return dtype == DataType::kFloat32 || dtype == DataType::kBFloat16 ||
         dtype == DataType::kFloat16 ||
         (task::block_elements(dtype) > 1 && task::interleaved_rows(dtype) == 1);
}

struct Entry {
  DataType dtype;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // relative to the byte buffer
  uint64_t end = 0;
};

}  // namespace

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string shape_to_string(std::span<const int64_t> shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i > 0) out += ",";
    out += std::to_string(shape[i]);
  }
  out += "]";
  return out;
}

// ---------------------------------------------------------------------------------------------
// SafetensorsFile

struct SafetensorsFile::State {
  std::string path;
  MappedFile map;
  const std::byte* buffer = nullptr;  // start of the byte buffer
  std::map<std::string, Entry, std::less<>> entries;
  std::map<std::string, std::string> metadata;
};

SafetensorsFile::SafetensorsFile(std::unique_ptr<State> state) : state_(std::move(state)) {}
SafetensorsFile::SafetensorsFile(SafetensorsFile&&) noexcept = default;
SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&&) noexcept = default;
SafetensorsFile::~SafetensorsFile() = default;

namespace {

absl::Status bad_entry(const std::string& path, const std::string& name, const std::string& what) {
  return absl::InvalidArgumentError(
      absl::StrCat(path, ": malformed safetensors header: tensor '", name, "': ", what));
}

// Maps the file into `map` and reads the little-endian header length.
absl::StatusOr<uint64_t> map_safetensors(const std::string& path, MappedFile* map) {
  SIMPLER_ASSIGN_OR_RETURN(*map, MappedFile::open(path));
  const uint64_t file_size = map->bytes().size();
  if (file_size < 8) {
    return absl::DataLossError(absl::StrCat(path, ": truncated safetensors file: ", file_size,
                                            " bytes, shorter than the 8-byte header length"));
  }
  const std::byte* base = map->bytes().data();
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) {
    header_len = (header_len << 8) | static_cast<uint8_t>(base[i]);
  }
  if (header_len > kSafetensorsMaxHeaderBytes) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": header length ", header_len,
                                                   " exceeds the limit of ",
                                                   kSafetensorsMaxHeaderBytes, " bytes"));
  }
  if (header_len > file_size - 8) {
    return absl::DataLossError(absl::StrCat(path, ": truncated safetensors file: header length ",
                                            header_len, " goes beyond the end of the file (",
                                            file_size, " bytes)"));
  }
  return header_len;
}

absl::Status read_metadata(const std::string& path, const json& value,
                           std::map<std::string, std::string>& metadata) {
  if (!value.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": malformed safetensors header: __metadata__ is not an object"));
  }
  for (auto m = value.begin(); m != value.end(); ++m) {
    if (!m.value().is_string()) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": malformed safetensors header: __metadata__ value '", m.key(),
                       "' is not a string"));
    }
    metadata[m.key()] = m.value().get<std::string>();
  }
  return absl::OkStatus();
}

// The entry's shape into entry.shape; its element count, every partial product within int64.
absl::StatusOr<uint64_t> read_shape(const std::string& path, const std::string& name,
                                    const json& shape_json, Entry& entry) {
  auto bad = [&](const std::string& what) { return bad_entry(path, name, what); };
  const json* shape_it = &shape_json;
  uint64_t numel = 1;
  for (const json& d : *shape_it) {
    if (!d.is_number_unsigned()) {
      return bad(absl::StrCat("shape ", base::quote_json_prefix(*shape_it),
                              " has an element that is not a non-negative integer"));
    }
    uint64_t dim = d.get<uint64_t>();
    // Every partial product must fit int64 (TensorView::numel and the
    // kernels multiply in int64), even when a later 0 makes the total 0.
    if (dim > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) ||
        !checked_mul(numel, dim, &numel) ||
        numel > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return bad(absl::StrCat("shape ", base::quote_json_prefix(*shape_it), " overflows"));
    }
    entry.shape.push_back(static_cast<int64_t>(dim));
  }
  return numel;
}

absl::StatusOr<Entry> read_entry(const std::string& path, const std::string& name,
                                 const json& value) {
  auto bad = [&](const std::string& what) { return bad_entry(path, name, what); };
  if (!value.is_object()) return bad("entry is not an object");
  auto dtype_it = value.find("dtype");
  auto shape_it = value.find("shape");
  auto offsets_it = value.find("data_offsets");
  if (dtype_it == value.end() || !dtype_it->is_string()) {
    return bad("missing or non-string 'dtype'");
  }
  if (shape_it == value.end() || !shape_it->is_array()) {
    return bad("missing or non-array 'shape'");
  }
  if (offsets_it == value.end() || !offsets_it->is_array() || offsets_it->size() != 2) {
    return bad("'data_offsets' is not a [begin, end] pair");
  }
  Entry entry;
  const std::string dtype_text = dtype_it->get<std::string>();
  // Only the safetensors spellings are accepted in a file (not "bf16").
  bool known = false;
  for (DataType t : {DataType::kFloat32, DataType::kBFloat16, DataType::kFloat16, DataType::kInt32,
                     DataType::kInt64, DataType::kUInt8}) {
    if (dtype_text == task::safetensors_name(t)) entry.dtype = t, known = true;
  }
  if (!known) {
    return bad(absl::StrCat("unsupported dtype '", dtype_text,
                            "' (supported: F32, BF16, F16, I32, I64, U8)"));
  }
  SIMPLER_ASSIGN_OR_RETURN(const uint64_t numel, read_shape(path, name, *shape_it, entry));
  for (const json& o : *offsets_it) {
    if (!o.is_number_unsigned()) {
      return bad(absl::StrCat("data_offsets ", base::quote_json_prefix(*offsets_it),
                              " are not non-negative integers"));
    }
  }
  entry.begin = (*offsets_it)[0].get<uint64_t>();
  entry.end = (*offsets_it)[1].get<uint64_t>();
  if (entry.end < entry.begin) {
    return bad(
        absl::StrCat("data_offsets ", base::quote_json_prefix(*offsets_it), " end before begin"));
  }
  uint64_t expected = 0;
  if (!checked_mul(numel, task::size_of(entry.dtype), &expected) ||
      entry.end - entry.begin != expected) {
    return bad(absl::StrCat("data_offsets ", base::quote_json_prefix(*offsets_it), " span ",
                            entry.end - entry.begin, " bytes, but shape ",
                            shape_to_string(entry.shape), " of ", dtype_text, " needs ", expected));
  }
  return entry;
}

// The tensors must tile the byte buffer: sorted by begin, each starting where the previous
// ended, the last ending at the end of the file.
absl::Status check_tiling(const std::string& path,
                          const std::map<std::string, Entry, std::less<>>& entries,
                          uint64_t buffer_size) {
  auto bad = [&](const std::string& name, const std::string& what) {
    return bad_entry(path, name, what);
  };
  // ended, the last ending at the end of the file.
  std::vector<std::pair<const std::string*, const Entry*>> order;
  order.reserve(entries.size());
  for (const auto& [name, entry] : entries) order.emplace_back(&name, &entry);
  std::sort(order.begin(), order.end(), [](const auto& a, const auto& b) {
    if (a.second->begin != b.second->begin) return a.second->begin < b.second->begin;
    return a.second->end < b.second->end;
  });
  uint64_t cursor = 0;
  const std::string* previous = nullptr;
  for (const auto& [name, entry] : order) {
    if (entry->begin < cursor) {
      return bad(*name,
                 absl::StrCat("data_offsets [", entry->begin, ",", entry->end, "] overlap tensor '",
                              *previous, "' (ending at ", cursor, ")"));
    }
    if (entry->begin > cursor) {
      return bad(*name, absl::StrCat("data_offsets [", entry->begin, ",", entry->end,
                                     "] leave a hole in the byte buffer at [", cursor, ",",
                                     entry->begin, ")"));
    }
    if (entry->end > buffer_size) {
      return absl::DataLossError(absl::StrCat(
          path, ": truncated safetensors file: tensor '", *name, "' data_offsets [", entry->begin,
          ",", entry->end, "] go beyond the byte buffer (", buffer_size, " bytes)"));
    }
    cursor = entry->end;
    previous = name;
  }
  if (cursor != buffer_size) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": malformed safetensors file: ", buffer_size - cursor,
                     " trailing bytes after the last tensor's data"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<SafetensorsFile> SafetensorsFile::open(const std::string& path) {
  auto state = std::make_unique<State>();
  state->path = path;
  SIMPLER_ASSIGN_OR_RETURN(const uint64_t header_len, map_safetensors(path, &state->map));
  const uint64_t file_size = state->map.bytes().size();
  const std::byte* base = state->map.bytes().data();
  const uint64_t buffer_size = file_size - 8 - header_len;
  state->buffer = base + 8 + header_len;

  std::string_view header_text(reinterpret_cast<const char*>(base + 8), header_len);
  // The whole header must be one JSON value; only spaces (the spec's padding) may follow it.
  SIMPLER_ASSIGN_OR_RETURN(
      json header,
      base::parse_json_bounded(header_text, absl::StrCat(path, ": malformed safetensors header")));
  if (!header.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": malformed safetensors header: not a JSON object"));
  }
  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() == kMetadataKey) {
      SIMPLER_RETURN_IF_ERROR(read_metadata(path, it.value(), state->metadata));
      continue;
    }
    SIMPLER_ASSIGN_OR_RETURN(Entry entry, read_entry(path, it.key(), it.value()));
    state->entries.emplace(it.key(), std::move(entry));
  }
  SIMPLER_RETURN_IF_ERROR(check_tiling(path, state->entries, buffer_size));
  return SafetensorsFile(std::move(state));
}

const std::string& SafetensorsFile::path() const { return state_->path; }

std::vector<std::string> SafetensorsFile::names() const {
  std::vector<std::string> out;
  out.reserve(state_->entries.size());
  for (const auto& [name, entry] : state_->entries) out.push_back(name);
  return out;
}

size_t SafetensorsFile::size() const { return state_->entries.size(); }

bool SafetensorsFile::contains(std::string_view name) const {
  return state_->entries.find(name) != state_->entries.end();
}

absl::StatusOr<TensorView> SafetensorsFile::tensor(std::string_view name) const {
  auto it = state_->entries.find(name);
  if (it == state_->entries.end()) {
    return absl::NotFoundError(
        absl::StrCat("tensor '", str(name), "' not found in ", state_->path));
  }
  const Entry& e = it->second;
  TensorView view;
  view.name = it->first;
  view.file = state_->path;
  view.dtype = e.dtype;
  view.shape = e.shape;
  view.bytes = std::span<const std::byte>(state_->buffer + e.begin, e.end - e.begin);
  view.mapping = &state_->map;
  return view;
}

const std::map<std::string, std::string>& SafetensorsFile::metadata() const {
  return state_->metadata;
}

// ---------------------------------------------------------------------------------------------
// ModelWeights

struct ModelWeights::State {
  std::string dir;
  std::vector<SafetensorsFile> files;
  // name -> index into files
  std::map<std::string, size_t, std::less<>> where;
  // A GGUF checkpoint instead of files: the view of each tensor under the model's name
  // (hf_tensor_name, or the GGUF name where it has none); the views borrow from `gguf`.
  std::optional<GgufFile> gguf;
  std::map<std::string, TensorView, std::less<>> gguf_views;
};

ModelWeights::ModelWeights(std::unique_ptr<State> state) : state_(std::move(state)) {}
ModelWeights::ModelWeights(ModelWeights&&) noexcept = default;
ModelWeights& ModelWeights::operator=(ModelWeights&&) noexcept = default;
ModelWeights::~ModelWeights() = default;

namespace {

namespace fs = std::filesystem;
using WeightWhere = std::map<std::string, size_t, std::less<>>;

// One weight_map entry: tensor `name` in shard `value`, opened (once) into `files`.
absl::Status add_indexed_tensor(const fs::path& root, const std::string& index_name,
                                const std::string& name, const json& value,
                                std::map<std::string, size_t>& shard_index,
                                std::vector<SafetensorsFile>& files, WeightWhere& where) {
  if (!value.is_string()) {
    return absl::InvalidArgumentError(absl::StrCat(
        index_name, ": malformed index: weight_map entry for tensor '", name, "' is not a string"));
  }
  const std::string shard = value.get<std::string>();
  if (shard.empty() || fs::path(shard).has_parent_path() || shard == "." || shard == "..") {
    return absl::InvalidArgumentError(
        absl::StrCat(index_name, ": tensor '", name, "' maps to invalid shard name '", shard, "'"));
  }
  auto found = shard_index.find(shard);
  if (found == shard_index.end()) {
    const std::string shard_path = (root / shard).string();
    absl::StatusOr<SafetensorsFile> file = SafetensorsFile::open(shard_path);
    if (!file.ok()) {
      if (absl::IsNotFound(file.status())) {
        return absl::NotFoundError(absl::StrCat("shard ", shard, " (holding ", name, ") listed in ",
                                                index_name,
                                                " not found: ", file.status().message()));
      }
      return file.status();
    }
    files.push_back(*std::move(file));
    found = shard_index.emplace(shard, files.size() - 1).first;
  }
  if (!files[found->second].contains(name)) {
    return absl::InvalidArgumentError(absl::StrCat(
        index_name, ": tensor '", name, "' is mapped to ", shard, ", which has no such tensor"));
  }
  where.emplace(name, found->second);
  return absl::OkStatus();
}

// Every tensor of every shard must be the one the weight_map names: a tensor the index does
// not list, or lists in another shard, would be silently ignored.
absl::Status check_shards_listed(const std::string& index_name,
                                 const std::vector<SafetensorsFile>& files,
                                 const WeightWhere& where) {
  // not list, or lists in another shard, would be silently ignored.
  for (const SafetensorsFile& file : files) {
    const std::string shard = fs::path(file.path()).filename().string();
    for (const std::string& name : file.names()) {
      auto it = where.find(name);
      if (it == where.end()) {
        return absl::InvalidArgumentError(absl::StrCat(index_name, ": tensor '", name, "' in ",
                                                       shard, " is not listed in the weight_map"));
      }
      if (&files[it->second] != &file) {
        return absl::InvalidArgumentError(
            absl::StrCat(index_name, ": tensor '", name, "' is in both ", shard, " and ",
                         fs::path(files[it->second].path()).filename().string(),
                         " (the weight_map maps it to the latter)"));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status open_indexed(const fs::path& root, const std::string& index_name,
                          std::vector<SafetensorsFile>& files, WeightWhere& where) {
  SIMPLER_ASSIGN_OR_RETURN(std::string text,
                           base::read_regular_file(index_name, kSafetensorsMaxHeaderBytes));
  // A tensor listed twice in the weight_map is a duplicate key: refused by the parser.
  SIMPLER_ASSIGN_OR_RETURN(
      json index, base::parse_json_bounded(text, absl::StrCat(index_name, ": malformed index")));
  if (!index.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(index_name, ": malformed index: not a JSON object"));
  }
  auto map_it = index.find("weight_map");
  if (map_it == index.end() || !map_it->is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(index_name, ": malformed index: missing object 'weight_map'"));
  }
  std::map<std::string, size_t> shard_index;  // shard file name -> files index
  for (auto it = map_it->begin(); it != map_it->end(); ++it) {
    SIMPLER_RETURN_IF_ERROR(
        add_indexed_tensor(root, index_name, it.key(), it.value(), shard_index, files, where));
  }
  return check_shards_listed(index_name, files, where);
}

}  // namespace

namespace {

// Every tensor of `file` as a view under its model name; `gguf` then holds the file.
absl::Status open_gguf(GgufFile file, std::optional<GgufFile>& gguf,
                       std::map<std::string, TensorView, std::less<>>& views) {
  const std::string& path = file.path();
  for (const GgufTensorInfo& info : file.tensors()) {
    std::string name = hf_tensor_name(info.name);
    if (name.empty()) name = info.name;
    SIMPLER_ASSIGN_OR_RETURN(TensorView view, file.tensor(info.name));
    auto [it, inserted] = views.emplace(name, view);
    if (!inserted) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": tensors '", str(it->second.name),
                                                     "' and '", info.name,
                                                     "' both name the model's '", name, "'"));
    }
  }
  gguf.emplace(std::move(file));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ModelWeights> ModelWeights::open(const std::string& dir) {
  auto state = std::make_unique<State>();
  state->dir = dir;
  if (is_gguf_path(dir)) {
    SIMPLER_ASSIGN_OR_RETURN(GgufFile file, GgufFile::open(dir));
    return from_gguf(std::move(file));
  }
  const fs::path root(dir);
  const fs::path index_path = root / "model.safetensors.index.json";
  const fs::path single_path = root / "model.safetensors";
  std::error_code ec;
  if (fs::exists(index_path, ec)) {
    SIMPLER_RETURN_IF_ERROR(open_indexed(root, index_path.string(), state->files, state->where));
    return ModelWeights(std::move(state));
  }
  if (fs::exists(single_path, ec)) {
    SIMPLER_ASSIGN_OR_RETURN(SafetensorsFile file, SafetensorsFile::open(single_path.string()));
    for (const std::string& name : file.names()) state->where.emplace(name, 0);
    state->files.push_back(std::move(file));
    return ModelWeights(std::move(state));
  }
  return absl::NotFoundError(absl::StrCat("no weights in ", dir,
                                          ": neither model.safetensors nor "
                                          "model.safetensors.index.json exists"));
}

absl::StatusOr<ModelWeights> ModelWeights::from_gguf(GgufFile file) {
  auto state = std::make_unique<State>();
  state->dir = file.path();
  SIMPLER_RETURN_IF_ERROR(open_gguf(std::move(file), state->gguf, state->gguf_views));
  return ModelWeights(std::move(state));
}

const std::string& ModelWeights::dir() const { return state_->dir; }

absl::Status ModelWeights::check_tensor_set(const std::set<std::string, std::less<>>& expected,
                                            std::string_view config_summary,
                                            bool allow_unused) const {
  if (allow_unused) return absl::OkStatus();
  for (const auto& [name, view] : state_->gguf_views) {
    if (expected.count(name) != 0) continue;
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor '", name, "' in ", state_->dir, " (GGUF tensor '", str(view.name),
        "') is not used by ", str(config_summary),
        "; a checkpoint must hold exactly the model's weights (--allow-unused-tensors ignores "
        "extra ones)"));
  }
  for (const auto& [name, index] : state_->where) {
    if (expected.count(name) != 0) continue;
    const std::string file = std::filesystem::path(state_->files[index].path()).filename().string();
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor '", name, "' in ", state_->dir, " (", file, ") is not used by ",
        str(config_summary),
        "; a checkpoint must hold exactly the model's weights (--allow-unused-tensors ignores "
        "extra ones)"));
  }
  return absl::OkStatus();
}

std::vector<std::string> ModelWeights::names() const {
  std::vector<std::string> out;
  out.reserve(state_->where.size() + state_->gguf_views.size());
  for (const auto& [name, index] : state_->where) out.push_back(name);
  for (const auto& [name, view] : state_->gguf_views) out.push_back(name);
  return out;
}

bool ModelWeights::contains(std::string_view name) const {
  return state_->where.find(name) != state_->where.end() ||
         state_->gguf_views.find(name) != state_->gguf_views.end();
}

size_t ModelWeights::num_files() const { return state_->gguf ? 1 : state_->files.size(); }

bool ModelWeights::is_gguf() const { return state_->gguf.has_value(); }

const GgufFile* ModelWeights::gguf() const { return state_->gguf ? &*state_->gguf : nullptr; }

std::map<std::string, int64_t> ModelWeights::dtype_counts() const {
  std::map<std::string, int64_t> counts;
  for (const std::string& name : names()) {
    absl::StatusOr<TensorView> view = get(name);
    if (view.ok()) ++counts[std::string(task::name_of(view->dtype))];
  }
  return counts;
}

absl::StatusOr<TensorView> ModelWeights::get(std::string_view name) const {
  if (state_->gguf) {
    auto found = state_->gguf_views.find(name);
    if (found == state_->gguf_views.end()) {
      const std::string gguf_name = gguf_tensor_name(name);
      return absl::NotFoundError(
          absl::StrCat("tensor '", str(name), "' not found in ", state_->dir,
                       gguf_name.empty() ? "" : absl::StrCat(" (GGUF name '", gguf_name, "')")));
    }
    return found->second;
  }
  auto it = state_->where.find(name);
  if (it == state_->where.end()) {
    std::string files;
    for (size_t i = 0; i < state_->files.size() && i < 4; ++i) {
      if (i > 0) files += ", ";
      files += std::filesystem::path(state_->files[i].path()).filename().string();
    }
    if (state_->files.size() > 4) files += ", ...";
    return absl::NotFoundError(
        absl::StrCat("tensor '", str(name), "' not found in ", state_->dir, " (", files, ")"));
  }
  return state_->files[it->second].tensor(name);
}

absl::StatusOr<TensorView> ModelWeights::get(std::string_view name,
                                             const std::vector<int64_t>& expected_shape,
                                             const std::vector<DataType>& allowed) const {
  SIMPLER_ASSIGN_OR_RETURN(TensorView view, get(name));
  const std::string file = std::filesystem::path(std::string(view.file)).filename().string();
  if (!std::equal(view.shape.begin(), view.shape.end(), expected_shape.begin(),
                  expected_shape.end())) {
    return absl::InvalidArgumentError(absl::StrCat(str(name), " in ", file, ": shape ",
                                                   shape_to_string(view.shape), ", expected ",
                                                   shape_to_string(expected_shape)));
  }
  if (!allowed.empty() && std::find(allowed.begin(), allowed.end(), view.dtype) == allowed.end()) {
    std::string names;
    for (DataType t : allowed) {
      if (!names.empty()) names += "/";
      names += str(task::safetensors_name(t));
    }
    return absl::InvalidArgumentError(absl::StrCat(str(name), " in ", file, ": dtype ",
                                                   str(task::safetensors_name(view.dtype)),
                                                   ", expected ", names));
  }
  return view;
}

// ---------------------------------------------------------------------------------------------
// Conversion

absl::Status to_f32(const TensorView& view, std::span<float> out) {
  if (!is_float(view.dtype)) {
    return absl::InvalidArgumentError(
        absl::StrCat(str(view.name), " in ", str(view.file), ": cannot convert dtype ",
                     str(task::safetensors_name(view.dtype)),
                     " to F32 (only F32, BF16, F16, Q8_0, Q4_0, Q4_K, Q6_K)"));
  }
  const int64_t n = view.numel();
  const int64_t per = task::block_elements(view.dtype);
  if (per > 1 && n % per != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        str(view.name), " in ", str(view.file), ": ", str(task::safetensors_name(view.dtype)),
        " tensor of ", n, " elements is not whole blocks of ", per));
  }
  if (static_cast<int64_t>(out.size()) != n) {
    return absl::InvalidArgumentError(absl::StrCat(str(view.name), " in ", str(view.file),
                                                   ": destination holds ", out.size(),
                                                   " floats, tensor has ", n));
  }
  const std::byte* src = view.bytes.data();
  switch (view.dtype) {
    case DataType::kFloat32:
      if (n > 0) std::memcpy(out.data(), src, static_cast<size_t>(n) * 4);
      break;
    case DataType::kBFloat16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, src + 2 * i, 2);
        uint32_t bits = static_cast<uint32_t>(h) << 16;
        std::memcpy(&out[i], &bits, 4);
      }
      break;
    case DataType::kFloat16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, src + 2 * i, 2);
        out[i] = task::f16_to_f32(h);
      }
      break;
    case DataType::kQ8_0:  // ggml's blocks, as data_type.h says; every value exact but Q4_K's
    case DataType::kQ4_0:  // (one rounding, the kernels' too)
    case DataType::kQ4_K:
    case DataType::kQ6_K:
      task::dequantize_blocks(view.dtype, reinterpret_cast<const uint8_t*>(src), n, out.data());
      break;
    default:
      break;
  }
  return absl::OkStatus();
}

absl::Status read_bytes(const TensorView& view, uint64_t at, std::span<std::byte> out) {
  if (at > view.bytes.size() || out.size() > view.bytes.size() - at) {
    return absl::InvalidArgumentError(absl::StrCat("read of ", out.size(), " bytes at ", at,
                                                   " of tensor '", str(view.name), "' (",
                                                   view.bytes.size(), " bytes)"));
  }
  if (out.empty()) return absl::OkStatus();
  if (view.mapping != nullptr) return view.mapping->read(view.bytes.data() + at, out);
  std::memcpy(out.data(), view.bytes.data() + at, out.size());
  return absl::OkStatus();
}

void release_pages(const TensorView& view) {
  // Only the pages wholly inside the view: a neighbouring tensor may share the edge pages.
  if (view.bytes.empty()) return;
  const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const auto begin = reinterpret_cast<uintptr_t>(view.bytes.data());
  const uintptr_t first = (begin + page - 1) / page * page;
  const uintptr_t last = (begin + view.bytes.size()) / page * page;
  if (last > first) (void)::madvise(reinterpret_cast<void*>(first), last - first, MADV_DONTNEED);
}

absl::StatusOr<std::vector<float>> to_f32(const TensorView& view) {
  std::vector<float> out(is_float(view.dtype) ? static_cast<size_t>(view.numel()) : 0);
  SIMPLER_RETURN_IF_ERROR(to_f32(view, std::span<float>(out)));
  return out;
}

// ---------------------------------------------------------------------------------------------
// Writer

namespace {

// Writes all of `data` to `fd`.
absl::Status write_all(int fd, const void* data, size_t size, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (size > 0) {
    ssize_t n = ::write(fd, p, size);
    if (n < 0) {
      if (errno == EINTR) continue;
      return os_error(errno, "cannot write", path);
    }
    p += n;
    size -= static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

// Closes the file and removes it unless committed.
class TempFile {
 public:
  TempFile(int fd, std::string path) : fd_(fd), path_(std::move(path)) {}
  ~TempFile() {
    if (fd_ >= 0) ::close(fd_);
    if (!committed_) ::unlink(path_.c_str());
  }
  int fd() const { return fd_; }
  absl::Status commit(const std::string& final_path) {
    int fd = std::exchange(fd_, -1);
    if (::close(fd) != 0) return os_error(errno, "cannot close", path_);
    if (::rename(path_.c_str(), final_path.c_str()) != 0) {
      return os_error(errno, "cannot rename to", final_path);
    }
    committed_ = true;
    return absl::OkStatus();
  }

 private:
  int fd_;
  std::string path_;
  bool committed_ = false;
};

}  // namespace

namespace {

// Tensor `t`'s byte size after checking its name (against `seen`), shape and bytes.
absl::StatusOr<uint64_t> checked_source_size(const std::string& path, const TensorSource& t,
                                             std::set<std::string>& seen) {
  auto bad = [&](const std::string& what) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot write ", path, ": tensor '", t.name, "': ", what));
  };
  if (t.name.empty()) return bad("empty name");
  if (t.name == kMetadataKey) return bad("reserved name");
  if (!seen.insert(t.name).second) return bad("duplicate name");
  uint64_t numel = 1;
  for (int64_t d : t.shape) {
    if (d < 0) return bad(absl::StrCat("negative dimension in shape ", shape_to_string(t.shape)));
    if (!checked_mul(numel, static_cast<uint64_t>(d), &numel)) return bad("shape overflows");
  }
  uint64_t size = 0;
  if (!checked_mul(numel, task::size_of(t.dtype), &size)) return bad("shape overflows");
  if (t.produce) {
    if (t.bytes.data() != nullptr || !t.bytes.empty()) {
      return bad("give exactly one of bytes and produce, not both");
    }
  } else if (t.bytes.size() != size) {
    return bad(absl::StrCat(t.bytes.size(), " bytes given, shape ", shape_to_string(t.shape),
                            " of ", str(task::safetensors_name(t.dtype)), " needs ", size));
  }
  return size;
}

// The header text, padded with spaces to a multiple of 8 bytes; each tensor's size into `sizes`.
absl::StatusOr<std::string> safetensors_header(const std::string& path,
                                               std::span<const TensorSource> tensors,
                                               const std::map<std::string, std::string>& metadata,
                                               std::vector<uint64_t>& sizes) {
  json header = json::object();
  if (!metadata.empty()) {
    json meta = json::object();
    for (const auto& [k, v] : metadata) meta[k] = v;
    header[std::string(kMetadataKey)] = meta;
  }
  sizes.reserve(tensors.size());
  std::set<std::string> seen;
  uint64_t offset = 0;
  for (const TensorSource& t : tensors) {
    SIMPLER_ASSIGN_OR_RETURN(const uint64_t size, checked_source_size(path, t, seen));
    header[t.name] = {{"dtype", str(task::safetensors_name(t.dtype))},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + size}}};
    offset += size;
    sizes.push_back(size);
  }
  std::string header_text;
  try {
    header_text = header.dump();
  } catch (const json::type_error&) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cannot write ", path, ": a tensor name or metadata string is not valid UTF-8"));
  }
  while (header_text.size() % 8 != 0) header_text.push_back(' ');
  return header_text;
}

// Tensor t's `size` bytes, from t.bytes or produced in whole-element chunks of `chunk`.
absl::Status write_source(int fd, const std::string& path, const std::string& tmp_path,
                          const TensorSource& t, uint64_t size, std::vector<std::byte>& chunk) {
  if (!t.produce) {
    if (size > 0) SIMPLER_RETURN_IF_ERROR(write_all(fd, t.bytes.data(), size, tmp_path));
    return absl::OkStatus();
  }
  constexpr size_t kChunk = 4 << 20;
  if (chunk.empty()) chunk.resize(kChunk);
  // Chunks hold whole elements.
  const size_t step = kChunk - kChunk % task::size_of(t.dtype);
  for (uint64_t done = 0; done < size;) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(step, size - done));
    std::span<std::byte> part(chunk.data(), n);
    absl::Status produced = t.produce(part);
    if (!produced.ok()) {
      return base::annotate(produced,
                            absl::StrCat("writing tensor '", t.name, "' to ", path, ": "));
    }
    SIMPLER_RETURN_IF_ERROR(write_all(fd, part.data(), n, tmp_path));
    done += n;
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status write_safetensors(const std::string& path, std::span<const TensorSource> tensors,
                               const std::map<std::string, std::string>& metadata) {
  std::vector<uint64_t> sizes;
  SIMPLER_ASSIGN_OR_RETURN(const std::string header_text,
                           safetensors_header(path, tensors, metadata, sizes));
  const std::string tmp_path = path + ".tmp";
  int fd = ::open(tmp_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return os_error(errno, "cannot create", tmp_path);
  TempFile file(fd, tmp_path);

  uint8_t len_bytes[8];
  uint64_t len = header_text.size();
  for (int i = 0; i < 8; ++i) len_bytes[i] = static_cast<uint8_t>(len >> (8 * i));
  SIMPLER_RETURN_IF_ERROR(write_all(fd, len_bytes, 8, tmp_path));
  SIMPLER_RETURN_IF_ERROR(write_all(fd, header_text.data(), header_text.size(), tmp_path));
  std::vector<std::byte> chunk;
  for (size_t i = 0; i < tensors.size(); ++i) {
    SIMPLER_RETURN_IF_ERROR(write_source(fd, path, tmp_path, tensors[i], sizes[i], chunk));
  }
  return file.commit(path);
}

}  // namespace simpler::llm
