// Streaming text for generated tokens: incremental detokenization and stop
// strings, as an output processor runs them per request (ARCHITECTURE.md,
// Serving: the output processor owns incremental detokenization and stop
// strings, off the engine loop).
//
// IncrementalDetokenizer turns a growing list of token ids into text deltas
// whose concatenation equals Tokenizer::decode(all ids) exactly, and no delta
// ever ends inside a UTF-8 character: a byte-level token may carry only part
// of a character's bytes, and the decoder's U+FFFD for such an incomplete tail
// is held back until later tokens complete (or finally invalidate) it. The
// same scheme as Hugging Face's and vLLM's incremental detokenizers, with one
// property made exact: decode(ids) of byte-level BPE is the lossy UTF-8
// decoding of the concatenated token bytes (Tokenizer::decode_bytes), so the
// detokenizer keeps only the bytes of a trailing incomplete character — a
// lead byte and the continuation bytes a valid sequence allows after it, at
// most 3 bytes — and renders everything before it at once: a lossy decoding
// always restarts at such a lead byte, so the pieces add up to the whole.
// Invalid bytes become U+FFFD as soon as they are known to be invalid; a push
// costs O(its own bytes).
//
// StopStringMatcher finds stop strings in streamed text across delta (and so
// token) boundaries: the text it releases never contains a stop string, nor a
// prefix of one that a later delta could complete — such a tail is held back
// until it either completes a stop string (the text is cut before it) or
// cannot any more (then it is released). OpenAI's `stop` and vLLM's
// `include_stop_str_in_output = false`: the stop string is not part of the
// output.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "simpler/tokenizer/tokenizer.h"

namespace simpler::llm {

// Whether `s` is well-formed UTF-8, as utf8proc decodes it (no overlong forms, surrogates or
// code points past U+10FFFF).
bool valid_utf8(std::string_view s);

// One request's detokenization state. Holds a pointer to `tokenizer`, which
// must outlive it. Thread-compatible (one output-processor thread per request
// at a time); the Tokenizer itself is shared and thread-safe.
class IncrementalDetokenizer {
 public:
  explicit IncrementalDetokenizer(const Tokenizer* tokenizer, bool skip_special_tokens = false)
      : tokenizer_(tokenizer), skip_special_tokens_(skip_special_tokens) {}

  // Appends `ids` (generated tokens, in order) and returns the new text that
  // is final: complete UTF-8 characters only (possibly empty).
  std::string push(std::span<const int32_t> ids);

  // The text still held back (an incomplete character's U+FFFD at the end),
  // released as decode() renders it: call once the request's last token is
  // in. Afterwards text() == tokenizer->decode(all ids).
  std::string finish();

  // Everything returned so far by push() and finish(), concatenated.
  const std::string& text() const { return text_; }
  // Ids pushed so far.
  int64_t num_ids() const { return num_ids_; }

 private:
  const Tokenizer* tokenizer_;
  bool skip_special_tokens_;
  std::string pending_;  // raw bytes of a trailing incomplete character (<= 3)
  std::string text_;
  int64_t num_ids_ = 0;
};

// Stop strings of one request. Thread-compatible.
class StopStringMatcher {
 public:
  // INVALID_ARGUMENT for an empty stop string (it would match everywhere) or
  // one that is not valid UTF-8, naming its index.
  static absl::StatusOr<StopStringMatcher> create(std::vector<std::string> stops);

  struct Result {
    std::string text;         // text now final: releasable to the client
    bool stopped = false;     // a stop string matched; `text` ends right before it
    int32_t stop_index = -1;  // which stop string (index into the list), when stopped
  };

  // Feeds the next text delta. After a match every later push is ignored
  // (returns an empty, stopped result). `armed` false: the request has not
  // generated min_tokens yet, so no stop string may end inside this delta
  // (vLLM checks stop strings only from min_tokens on); a stop string that
  // starts here and ends in a later armed delta still matches.
  Result push(std::string_view delta, bool armed = true);
  // Releases the held-back tail (no stop string completed): at the request's end.
  std::string finish();

  bool stopped() const { return stopped_; }
  const std::vector<std::string>& stops() const { return stops_; }

 private:
  explicit StopStringMatcher(std::vector<std::string> stops);
  std::vector<std::string> stops_;
  size_t longest_ = 0;  // bytes of the longest stop string
  std::string held_;    // text not yet released: may begin a stop string
  // Bytes of held_ pushed while not armed (a match must end after them).
  size_t unarmed_ = 0;
  bool stopped_ = false;
};

}  // namespace simpler::llm
