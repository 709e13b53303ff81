// One line of a prompts file (`simpler generate --prompts-file`): JSON lines, each an object
// {"prompt": "text"} or {"prompt_ids": [id, ...]}. Blank lines (only spaces, tabs, CR) are
// skipped.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "absl/status/statusor.h"

namespace simpler::llm {

// A prompt as written in the file: text to tokenize, or token ids.
using PromptSpec = std::variant<std::string, std::vector<int32_t>>;

// Parses one line (without its newline). nullopt for a blank line. INVALID_ARGUMENT
// "not a JSON object", "prompt_ids holds a non-integer" or
// "needs \"prompt\" (string) or \"prompt_ids\" (array)"; the caller prefixes the file and line.
// Thread-safe (pure).
absl::StatusOr<std::optional<PromptSpec>> parse_prompts_line(std::string_view line);

}  // namespace simpler::llm
