// libFuzzer target: config.json and generation_config.json through ModelConfig::parse.
// Input: the config.json text, then optionally a 0x01 byte and the generation_config.json text
// (0x01 cannot appear raw in JSON, so the split loses no valid input).
// Checks: no crash/UB; an accepted text holds no NUL byte (JSON cannot: nothing may follow the
// value but whitespace); an accepted configuration validates, and its own config.json /
// generation_config.json (to_config_json, to_generation_config_json) parse back to the same
// shape fields and stop ids.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string_view>

#include "base/fuzz_check.h"
#include "base/fuzz_input.h"
#include "simpler/model/model_config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using simpler::fuzz::check;
  using simpler::llm::ModelConfig;
  const simpler::fuzz::TwoTexts input = simpler::fuzz::split_at_0x01(data, size);
  const std::string_view config = input.first;
  const std::string_view generation = input.second.value_or(std::string_view());
  auto parsed = ModelConfig::parse(config, generation);
  if (!parsed.ok()) return 0;
  check(config.find('\0') == std::string_view::npos,
        "config.json with a NUL byte accepted (bytes after the JSON value are ignored)");
  check(generation.find('\0') == std::string_view::npos,
        "generation_config.json with a NUL byte accepted (bytes after the JSON value are ignored)");
  check(parsed->validate().ok(), "parse accepted a configuration validate refuses");
  (void)parsed->stop_ids();
  auto again = ModelConfig::parse(parsed->to_config_json(), parsed->to_generation_config_json());
  if (!again.ok()) {
    std::fprintf(stderr, "re-parse: %s\n", std::string(again.status().message()).c_str());
  }
  check(again.ok(), "to_config_json() of an accepted configuration does not parse");
  check(again->hidden_size == parsed->hidden_size &&
            again->intermediate_size == parsed->intermediate_size &&
            again->num_hidden_layers == parsed->num_hidden_layers &&
            again->num_attention_heads == parsed->num_attention_heads &&
            again->num_key_value_heads == parsed->num_key_value_heads &&
            again->head_dim == parsed->head_dim && again->vocab_size == parsed->vocab_size &&
            again->tie_word_embeddings == parsed->tie_word_embeddings,
        "to_config_json() round trip changes a shape field");
  check(again->stop_ids() == parsed->stop_ids(), "to_config_json() round trip changes stop ids");
  return 0;
}
