#include "cli/prompts_file.h"

#include <limits>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "nlohmann/json.hpp"
#include "simpler/base/json.h"

namespace simpler::llm {

absl::StatusOr<std::optional<PromptSpec>> parse_prompts_line(std::string_view line,
                                                             std::string_view where) {
  if (line.find_first_not_of(" \t\r") == std::string_view::npos) return std::nullopt;
  const std::string at(where);
  absl::StatusOr<nlohmann::json> parsed = base::parse_json_bounded(line, at);
  if (!parsed.ok()) {
    // The parser counts lines within the text it was given, always one here: after our
    // "file:line" its "at line 1, column N" read as a second, wrong line number.
    std::string message(parsed.status().message());
    absl::StrReplaceAll({{"parse error at line 1, column ", "parse error at column "}}, &message);
    return absl::Status(parsed.status().code(), message);
  }
  const nlohmann::json& j = *parsed;
  if (!j.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(
        at, ": expected a JSON object, got ", j.type_name(), " ", base::quote_json_prefix(j, 60)));
  }
  for (const auto& [key, value] : j.items()) {
    if (key != "prompt" && key != "prompt_ids") {
      return absl::InvalidArgumentError(
          absl::StrCat(at, ": unknown key \"", key.substr(0, 40),
                       "\" (a line holds \"prompt\" or \"prompt_ids\" and nothing else)"));
    }
  }
  auto text = j.find("prompt");
  auto ids = j.find("prompt_ids");
  if (text != j.end() && ids != j.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat(at, ": give one of \"prompt\" and \"prompt_ids\", not both"));
  }
  if (text != j.end() && text->is_string()) return PromptSpec(text->get<std::string>());
  if (ids != j.end() && ids->is_array()) {
    std::vector<int64_t> out;
    out.reserve(ids->size());
    for (size_t i = 0; i < ids->size(); ++i) {
      const nlohmann::json& v = (*ids)[i];
      if (!v.is_number_integer()) {
        return absl::InvalidArgumentError(absl::StrCat(
            at, ": prompt_ids[", i, "] is not an integer: ", base::quote_json_prefix(v, 60)));
      }
      if (v.is_number_unsigned() &&
          v.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        return absl::InvalidArgumentError(
            absl::StrCat(at, ": prompt_ids[", i, "] = ", v.get<uint64_t>(), " is not a token id"));
      }
      out.push_back(v.get<int64_t>());
    }
    return PromptSpec(std::move(out));
  }
  return absl::InvalidArgumentError(
      absl::StrCat(at, ": needs \"prompt\" (string) or \"prompt_ids\" (array)"));
}

}  // namespace simpler::llm
