// libFuzzer target: one line of a prompts file through parse_prompts_line.
// Checks: no crash/UB; blank lines are skipped and only they; an accepted line holds one key and
// no NUL byte (JSON cannot: nothing may follow the value but whitespace); an accepted line's
// prompt is the JSON's "prompt" string, or its "prompt_ids" with every id equal to the JSON
// integer (ids stay 64-bit; a value that does not fit int64 must be refused, not wrapped).
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "base/fuzz_check.h"
#include "cli/prompts_file.h"
#include "nlohmann/json.hpp"

namespace {

using simpler::fuzz::check;

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view line(reinterpret_cast<const char*>(data), size);
  auto spec = simpler::llm::parse_prompts_line(line);
  const bool blank = line.find_first_not_of(" \t\r") == std::string_view::npos;
  if (!spec.ok()) {
    check(!blank, "a blank line is refused");
    return 0;
  }
  check(spec->has_value() != blank, "blank-line detection differs from \" \\t\\r\" only");
  if (blank) return 0;
  check(line.find('\0') == std::string_view::npos,
        "a line with a NUL byte accepted (bytes after the JSON value are ignored)");
  const auto j = nlohmann::json::parse(line, nullptr, false);
  check(!j.is_discarded() && j.is_object(), "accepted a line that is not a JSON object");
  check(j.size() == 1, "accepted a line with a key besides its one prompt");
  if (const auto* text = std::get_if<std::string>(&**spec)) {
    check(
        j.contains("prompt") && j["prompt"].is_string() && j["prompt"].get<std::string>() == *text,
        "prompt text differs from the JSON string");
    return 0;
  }
  const auto& ids = std::get<std::vector<int64_t>>(**spec);
  check(j.contains("prompt_ids") && j["prompt_ids"].is_array(), "ids without \"prompt_ids\"");
  const auto& array = j["prompt_ids"];
  check(array.size() == ids.size(), "id count differs from the JSON array");
  for (size_t i = 0; i < ids.size(); ++i) {
    const auto& v = array[i];
    const bool same = v.is_number_unsigned()
                          ? ids[i] >= 0 && v.get<uint64_t>() == static_cast<uint64_t>(ids[i])
                          : v.get<int64_t>() == ids[i];
    if (!same) {
      std::fprintf(stderr, "prompt_ids[%zu]: JSON %s became %lld\n", i, v.dump().c_str(),
                   static_cast<long long>(ids[i]));
    }
    check(same, "a prompt id does not equal its JSON integer (narrowed)");
  }
  return 0;
}
