// Fuzz-target helper: one fuzz input read as two texts.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

namespace simpler::fuzz {

// A fuzz input as the texts of two files: the bytes before its first 0x01 byte and, when it has
// one, the bytes after it. JSON cannot hold a raw 0x01, so a target reading two JSON files this
// way loses no valid input.
struct TwoTexts {
  std::string_view first;
  std::optional<std::string_view> second;

  // True when neither text holds a NUL byte.
  bool free_of_nul() const {
    return first.find('\0') == std::string_view::npos &&
           (!second.has_value() || second->find('\0') == std::string_view::npos);
  }
};

inline TwoTexts split_at_0x01(const uint8_t* data, size_t size) {
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  const size_t split = input.find('\x01');
  if (split == std::string_view::npos) return {input, std::nullopt};
  return {input.substr(0, split), input.substr(split + 1)};
}

}  // namespace simpler::fuzz
