// Test helper: looking into a Status's message, for the tests that check an error says what was
// wrong (EXPECT_TRUE(contains(s, "64 bytes do not fit"))).
#pragma once

#include <string_view>

#include "absl/status/status.h"

namespace simpler::testing {

// Whether `s`'s message contains `needle` (an OK status has an empty message: false unless
// `needle` is empty). Pure.
inline bool contains(const absl::Status& s, std::string_view needle) {
  const std::string_view message(s.message().data(), s.message().size());
  return message.find(needle) != std::string_view::npos;
}

}  // namespace simpler::testing
