// libFuzzer target: tokenizer.json and tokenizer_config.json through Tokenizer::load_files.
// Input: the tokenizer.json text, then optionally a 0x01 byte and the tokenizer_config.json text
// (no 0x01: no tokenizer_config.json; 0x01 cannot appear raw in JSON). A tokenizer that loads
// encodes a few probe texts, including a long run that makes a backtracking pre_tokenizer regex
// blow up.
// Checks: no crash/UB/hang; an accepted file holds no NUL byte (JSON cannot: nothing may follow
// the value but whitespace); try_encode either succeeds with every id an entry of the
// vocabulary, or fails with RESOURCE_EXHAUSTED (a PCRE2 limit); decode accepts the ids.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "base/fuzz_check.h"
#include "base/fuzz_input.h"
#include "base/fuzz_temp_file.h"
#include "simpler/tokenizer/tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using simpler::fuzz::check;
  using simpler::llm::Tokenizer;
  const simpler::fuzz::TwoTexts input = simpler::fuzz::split_at_0x01(data, size);
  const std::string json_path = simpler::fuzz::write_scratch_file("tokenizer.json", input.first);
  std::string config_path;
  if (input.second.has_value()) {
    config_path = simpler::fuzz::write_scratch_file("tokenizer_config.json", *input.second);
  }
  auto tokenizer = Tokenizer::load_files(json_path, config_path);
  if (!tokenizer.ok()) return 0;
  check(input.free_of_nul(),
        "a file with a NUL byte accepted (bytes after the JSON value are ignored)");
  const int32_t vocab = tokenizer->vocab_size();
  check(vocab > 0, "a loaded tokenizer has an empty vocabulary");
  if (auto eos = tokenizer->eos_token_id()) check(*eos >= 0 && *eos < vocab, "eos id out of range");
  if (auto pad = tokenizer->pad_token_id()) check(*pad >= 0 && *pad < vocab, "pad id out of range");
  static const std::string kProbes[] = {
      "Hello, world! It's 2024.\n\n  ok",
      "caf\xc3\xa9 e\xcc\x81 \xef\xac\x81 \xe4\xbd\xa0\xe5\xa5\xbd \xff\xfe",
      "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
      std::string(48, 'a') + "!" + std::string(48, ' ') + "x" + std::string(48, '1') + "\n",
  };
  for (const std::string& probe : kProbes) {
    auto ids = tokenizer->try_encode(probe);
    if (!ids.ok()) {
      check(ids.status().code() == absl::StatusCode::kResourceExhausted,
            "try_encode failed with a code other than RESOURCE_EXHAUSTED");
      continue;
    }
    for (int32_t id : *ids) {
      check(id >= 0 && id < vocab, "encode produced an id outside [0, vocab_size)");
      check(tokenizer->id_to_token(id).has_value(), "encode produced an id without an entry");
    }
    (void)tokenizer->decode(*ids);
    (void)tokenizer->decode(*ids, /*skip_special_tokens=*/true);
  }
  return 0;
}
