#include "simpler/llm/prompts_file.h"

#include "absl/status/status.h"
#include "nlohmann/json.hpp"

namespace simpler::llm {

absl::StatusOr<std::optional<PromptSpec>> parse_prompts_line(std::string_view line) {
  if (line.find_first_not_of(" \t\r") == std::string_view::npos) return std::nullopt;
  auto j = nlohmann::json::parse(line, nullptr, false);
  if (j.is_discarded() || !j.is_object()) {
    return absl::InvalidArgumentError("not a JSON object");
  }
  if (j.contains("prompt") && j["prompt"].is_string()) {
    return PromptSpec(j["prompt"].get<std::string>());
  }
  if (j.contains("prompt_ids") && j["prompt_ids"].is_array()) {
    std::vector<int32_t> ids;
    for (const auto& v : j["prompt_ids"]) {
      if (!v.is_number_integer())
        return absl::InvalidArgumentError("prompt_ids holds a non-integer");
      ids.push_back(v.get<int32_t>());
    }
    return PromptSpec(std::move(ids));
  }
  return absl::InvalidArgumentError("needs \"prompt\" (string) or \"prompt_ids\" (array)");
}

}  // namespace simpler::llm
