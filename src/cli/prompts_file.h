// One line of a prompts file (`simpler generate --prompts-file`): JSON lines, each an object
// {"prompt": "text"} or {"prompt_ids": [id, ...]}. Blank lines (only spaces, tabs, CR) are
// skipped. Lines are untrusted input: parsed with base::parse_json_bounded (bounded depth,
// the whole line, no duplicate keys, no exception escapes), values quoted short in messages.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "absl/status/statusor.h"

namespace simpler::llm {

// A prompt as written in the file: text to tokenize, or token ids. Ids stay 64-bit until the
// caller checks them against the model's vocabulary (nothing is narrowed here).
using PromptSpec = std::variant<std::string, std::vector<int64_t>>;

// Parses one line (without its newline). nullopt for a blank line. INVALID_ARGUMENT, every
// message prefixed with `where` and ": " (e.g. "prompts.jsonl:3: "): the JSON parser's reason
// (malformed, too deep, trailing bytes, not UTF-8), "expected a JSON object, got <type> <value>",
// "prompt_ids[i] is not an integer: <value>", "prompt_ids[i] = <n> is not a token id" (above
// the int64 range), "unknown key \"<key>\" ..." (any key but the two), "give one of \"prompt\" and
// \"prompt_ids\", not both", or "needs \"prompt\" (string) or \"prompt_ids\" (array)".
// Thread-safe (pure).
absl::StatusOr<std::optional<PromptSpec>> parse_prompts_line(std::string_view line,
                                                             std::string_view where = "line");

}  // namespace simpler::llm
