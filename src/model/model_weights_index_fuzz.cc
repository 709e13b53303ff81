// libFuzzer target: model.safetensors.index.json through ModelWeights::open. The scratch
// directory holds two valid shards, model-00001-of-00002.safetensors (tensors "a", "b") and
// model-00002-of-00002.safetensors ("c"); the input is the index.
// Checks: no crash/UB; an accepted index holds no NUL byte (JSON cannot: nothing may follow the
// value but whitespace); every tensor of accepted weights is one of the shards' and readable,
// and no more files are open than there are shards.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <set>
#include <string>
#include <string_view>

#include "base/fuzz_check.h"
#include "base/fuzz_temp_file.h"
#include "simpler/model/safetensors.h"

namespace {

using simpler::fuzz::check;

// A safetensors file of U8 tensors of 2 bytes each, named `names`.
std::string shard(std::initializer_list<const char*> names) {
  std::string header = "{";
  std::string data;
  for (const char* name : names) {
    if (header.size() > 1) header += ",";
    header += std::string("\"") + name + "\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[" +
              std::to_string(data.size()) + "," + std::to_string(data.size() + 2) + "]}";
    data += "xy";
  }
  header += "}";
  std::string out;
  for (int i = 0; i < 8; ++i) out += static_cast<char>((header.size() >> (8 * i)) & 0xff);
  return out + header + data;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  simpler::fuzz::write_scratch_file("model-00001-of-00002.safetensors", shard({"a", "b"}));
  simpler::fuzz::write_scratch_file("model-00002-of-00002.safetensors", shard({"c"}));
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using simpler::llm::ModelWeights;
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  simpler::fuzz::write_scratch_file("model.safetensors.index.json", input);
  auto weights = ModelWeights::open(simpler::fuzz::scratch_dir());
  if (!weights.ok()) return 0;
  check(input.find('\0') == std::string_view::npos,
        "an index with a NUL byte accepted (bytes after the JSON value are ignored)");
  check(weights->num_files() <= 2, "more files open than shards exist");
  static const std::set<std::string> kTensors = {"a", "b", "c"};
  for (const std::string& name : weights->names()) {
    check(kTensors.count(name) == 1, "a tensor no shard holds");
    auto view = weights->get(name);
    check(view.ok() && view->bytes.size() == 2, "an accepted tensor is not readable");
  }
  return 0;
}
