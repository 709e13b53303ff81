// A std::string_view as a std::string, for absl::StrCat: Debian's abseil has its own
// absl::string_view, which does not convert from std::string_view.
#pragma once

#include <string>
#include <string_view>

namespace simpler::llm {

inline std::string str(std::string_view s) { return std::string(s); }

}  // namespace simpler::llm
