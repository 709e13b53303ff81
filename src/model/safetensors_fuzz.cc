// libFuzzer target: a safetensors file (8-byte header length, JSON header, byte buffer) through
// SafetensorsFile::open, then every accessor and to_f32 on what it accepted.
// Checks: no crash/UB; an accepted header holds no NUL byte (JSON cannot, and the format pads
// with spaces); an accepted file's tensors tile its byte buffer and each view's size is
// numel * dtype-size.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string_view>

#include "base/fuzz_check.h"
#include "base/fuzz_temp_file.h"
#include "simpler/model/safetensors.h"

namespace {

using simpler::fuzz::check;

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace simpler::llm;
  const std::string path = simpler::fuzz::write_scratch_file(
      "model.safetensors", std::string_view(reinterpret_cast<const char*>(data), size));
  auto file = SafetensorsFile::open(path);
  if (!file.ok()) return 0;
  size_t total = 0;
  for (const std::string& name : file->names()) {
    check(file->contains(name), "names() lists a tensor contains() denies");
    auto view = file->tensor(name);
    check(view.ok(), "tensor() fails for a listed name");
    const int64_t numel = view->numel();
    check(numel >= 0, "negative numel");
    check(static_cast<uint64_t>(numel) * simpler::task::size_of(view->dtype) == view->bytes.size(),
          "view size differs from numel * dtype size");
    (void)shape_to_string(view->shape);
    total += view->bytes.size();
    if (numel <= (1 << 20)) {
      auto values = to_f32(*view);
      (void)values;
    }
  }
  for (const auto& [key, value] : file->metadata()) (void)key, (void)value;
  check(file->size() == file->names().size(), "size() differs from names()");
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | data[i];
  check(total == size - 8 - header_len, "accepted tensors do not cover the byte buffer");
  const std::string_view header(reinterpret_cast<const char*>(data) + 8, header_len);
  check(header.find('\0') == std::string_view::npos,
        "a header with a NUL byte accepted (bytes after the JSON value are ignored)");
  return 0;
}
