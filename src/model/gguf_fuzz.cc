// libFuzzer target: a whole GGUF file through GgufFile::open, then every typed read of every
// key, every tensor view, ModelConfig::from_gguf and ModelWeights::open of what it accepted.
// Checks: no crash/UB, and nothing allocated from an unchecked count; an accepted file's tensor
// data lies inside the file at an aligned offset after the data section's start, no two
// tensors overlap, each view is the input's bytes at its offset, each F32 / F16 / BF16 view holds
// numel * dtype-size bytes; a configuration from_gguf accepts validates.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>
#include <utility>
#include <vector>

#include "base/fuzz_check.h"
#include "base/fuzz_temp_file.h"
#include "simpler/model/gguf.h"
#include "simpler/model/model_config.h"
#include "simpler/model/safetensors.h"

namespace {

using simpler::fuzz::check;
using namespace simpler::llm;

// Every typed read of every key: each one returns a status or a value, never crashes.
void read_every_key(const GgufFile& file) {
  for (const std::string& key : file.keys()) {
    check(file.find(key) != nullptr, "keys() lists a key find() denies");
    (void)file.get_string(key);
    (void)file.get_uint(key);
    (void)file.get_float(key);
    if (auto strings = file.get_string_array(key); strings.ok()) {
      for (std::string_view s : *strings) (void)s.size();
    }
    (void)file.get_int_array(key);
  }
}

void check_tensors(const GgufFile& file, const uint8_t* data, size_t size) {
  std::vector<std::pair<const std::byte*, size_t>> spans;
  for (const GgufTensorInfo& t : file.tensors()) {
    check(file.find_tensor(t.name) == &t, "find_tensor differs from tensors()");
    check(ggml_type_traits(t.type) != nullptr, "a tensor of a type without traits accepted");
    check(t.offset % file.alignment() == 0, "a misaligned tensor accepted");
    check(t.shape.size() >= 1 && t.shape.size() <= kGgufMaxDims, "n_dims outside [1, 4]");
    if (!t.data.empty()) {
      // The view is the input's bytes at data_offset + offset, inside the file.
      const uint64_t at = file.data_offset() + t.offset;
      check(at <= size && t.data.size() <= size - at, "tensor data outside the file");
      check(std::memcmp(t.data.data(), data + at, t.data.size()) == 0,
            "tensor data is not the file's bytes at its offset");
      spans.emplace_back(t.data.data(), t.data.size());
    }
    auto view = file.tensor(t.name);
    if (!view.ok()) continue;
    const int64_t numel = view->numel();
    check(numel >= 0, "negative numel");
    check(simpler::task::bytes_of(view->dtype, static_cast<uint64_t>(numel)) == view->bytes.size(),
          "view size differs from the bytes of numel elements of its dtype");
    if (numel <= (1 << 16)) (void)to_f32(*view);
  }
  std::sort(spans.begin(), spans.end());
  for (size_t i = 1; i < spans.size(); ++i) {
    check(spans[i - 1].first + spans[i - 1].second <= spans[i].first, "overlapping tensors");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = simpler::fuzz::write_scratch_file(
      "model.gguf", std::string_view(reinterpret_cast<const char*>(data), size));
  auto file = GgufFile::open(path);
  if (!file.ok()) return 0;
  check(size >= 24 && std::string_view(reinterpret_cast<const char*>(data), 4) == "GGUF",
        "a file without the magic and the counts accepted");
  read_every_key(*file);
  check_tensors(*file, data, size);
  auto config = ModelConfig::from_gguf(*file);
  if (config.ok()) check(config->validate(path).ok(), "from_gguf accepted what validate refuses");
  auto weights = ModelWeights::open(path);
  if (weights.ok()) {
    for (const std::string& name : weights->names()) check(weights->get(name).ok(), "get fails");
  }
  return 0;
}
