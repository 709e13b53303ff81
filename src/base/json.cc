#include "simpler/base/json.h"

#include <algorithm>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace simpler::base {
namespace {

using json = nlohmann::json;

// Thrown by the parser callback to stop parsing at once; caught in parse_json_bounded.
struct StopParse {
  absl::Status status;
};

// One open container while parsing.
struct Frame {
  bool object = false;
  std::string key;               // the object's last key
  std::vector<uint64_t> hashes;  // a hash of every key seen in the object, in order
};

std::string path_of(const std::vector<Frame>& frames, size_t count) {
  std::string path;
  for (size_t i = 0; i < count && i < frames.size(); ++i) {
    if (frames[i].object) absl::StrAppend(&path, "/", frames[i].key);
  }
  return path.empty() ? "/" : path;
}

uint64_t hash_of(const std::string& key) { return std::hash<std::string>{}(key); }

// The key of `object` seen twice, given the hashes of every key seen (more than object.size()).
template <typename Json>
std::string duplicate_key(const Json& object, std::vector<uint64_t> hashes) {
  std::sort(hashes.begin(), hashes.end());
  auto twice = std::adjacent_find(hashes.begin(), hashes.end());
  if (twice != hashes.end()) {
    for (auto it = object.begin(); it != object.end(); ++it) {
      if (hash_of(it.key()) == *twice) return it.key();
    }
  }
  return "?";
}

// `text` cut to at most `max_chars` bytes (never inside a UTF-8 sequence), "..." appended when
// cut.
std::string cut_utf8(std::string text, size_t max_chars) {
  if (text.size() <= max_chars) return text;
  size_t end = max_chars;
  while (end > 0 && (static_cast<unsigned char>(text[end]) & 0xC0) == 0x80) --end;
  text.resize(end);
  text += "...";
  return text;
}

// nlohmann's what() without the "[json.exception.parse_error.101] " prefix.
std::string reason_of(const json::exception& e) {
  std::string_view what = e.what();
  if (what.starts_with("[json.exception.")) {
    size_t close = what.find("] ");
    if (close != std::string_view::npos) what.remove_prefix(close + 2);
  }
  return std::string(what);
}

// parse_json_bounded for either of nlohmann's object layouts (sorted or insertion-ordered).
template <typename Json>
absl::StatusOr<Json> parse_bounded(std::string_view text, std::string_view what, int max_depth) {
  const std::string source(what);
  if (size_t nul = text.find('\0'); nul != std::string_view::npos) {
    return json_nul_byte_error(source, nul);
  }
  std::vector<Frame> frames;
  typename Json::parser_callback_t callback = [&](int depth, typename Json::parse_event_t event,
                                                  Json& parsed) -> bool {
    switch (event) {
      case Json::parse_event_t::object_start:
      case Json::parse_event_t::array_start:
        if (depth + 1 > max_depth) {
          throw StopParse{json_too_deep_error(source, max_depth, path_of(frames, frames.size()))};
        }
        frames.push_back(Frame{event == Json::parse_event_t::object_start, {}, {}});
        break;
      case Json::parse_event_t::object_end:
      case Json::parse_event_t::array_end:
        if (frames.empty()) break;
        // nlohmann keeps the last of two equal keys: fewer members than keys seen means a
        // duplicate.
        if (frames.back().object && parsed.is_object() &&
            frames.back().hashes.size() != parsed.size()) {
          throw StopParse{json_duplicate_key_error(
              source, duplicate_key(parsed, std::move(frames.back().hashes)),
              path_of(frames, frames.size() - 1))};
        }
        frames.pop_back();
        break;
      case Json::parse_event_t::key: {
        if (frames.empty() || !parsed.is_string()) break;
        Frame& top = frames.back();
        const std::string& key = parsed.template get_ref<const std::string&>();
        top.hashes.push_back(hash_of(key));
        top.key.assign(key);
        break;
      }
      case Json::parse_event_t::value:
        break;
    }
    return true;
  };
  try {
    return Json::parse(text.begin(), text.end(), callback, /*allow_exceptions=*/true);
  } catch (const StopParse& stop) {
    return stop.status;
  } catch (const json::exception& e) {
    return json_malformed_error(source, e);
  }
}

}  // namespace

absl::Status json_malformed_error(std::string_view what, const nlohmann::json::exception& e) {
  return absl::InvalidArgumentError(absl::StrCat(
      std::string(what), ": malformed JSON: ", cut_utf8(reason_of(e), kJsonMaxErrorChars)));
}

absl::Status json_nul_byte_error(std::string_view what, size_t offset) {
  return absl::InvalidArgumentError(
      absl::StrCat(std::string(what), ": malformed JSON: NUL byte at offset ", offset));
}

absl::Status json_too_deep_error(std::string_view what, int max_depth, std::string_view path) {
  return absl::InvalidArgumentError(absl::StrCat(std::string(what), ": JSON nested deeper than ",
                                                 max_depth, " levels at ",
                                                 cut_utf8(std::string(path), 200)));
}

absl::Status json_duplicate_key_error(std::string_view what, std::string_view key,
                                      std::string_view path) {
  return absl::InvalidArgumentError(
      absl::StrCat(std::string(what), ": duplicate key '", cut_utf8(std::string(key), 80),
                   "' in the object at ", cut_utf8(std::string(path), 200)));
}

absl::StatusOr<json> parse_json_bounded(std::string_view text, std::string_view what,
                                        int max_depth) {
  return parse_bounded<json>(text, what, max_depth);
}

absl::StatusOr<nlohmann::ordered_json> parse_ordered_json_bounded(std::string_view text,
                                                                  std::string_view what,
                                                                  int max_depth) {
  return parse_bounded<nlohmann::ordered_json>(text, what, max_depth);
}

std::string quote_json_prefix(const json& value, size_t max_chars) {
  std::string out;
  auto scalar = [&](const json& v) {
    if (v.is_string()) {
      // Quote at most a little more than the bound of a long string.
      const std::string& s = v.get_ref<const std::string&>();
      out += dump_replacing(json(s.size() > max_chars + 1 ? s.substr(0, max_chars + 1) : s));
    } else {
      out += dump_replacing(v);
    }
  };
  struct Open {
    const json* node;
    json::const_iterator next;
    bool first;
  };
  std::vector<Open> stack;
  auto visit = [&](const json& v) {
    if (v.is_object()) {
      out += '{';
      stack.push_back({&v, v.cbegin(), true});
    } else if (v.is_array()) {
      out += '[';
      stack.push_back({&v, v.cbegin(), true});
    } else {
      scalar(v);
    }
  };
  visit(value);
  while (!stack.empty() && out.size() <= max_chars) {
    Open& top = stack.back();
    if (top.next == top.node->cend()) {
      out += top.node->is_object() ? '}' : ']';
      stack.pop_back();
      continue;
    }
    if (!top.first) out += ',';
    top.first = false;
    const json& child = *top.next;
    if (top.node->is_object()) {
      scalar(json(top.next.key()));
      out += ':';
    }
    ++top.next;
    visit(child);  // may grow the stack: `top` is not used after this
  }
  return cut_utf8(std::move(out), max_chars);
}

std::string dump_replacing(const json& value, int indent) {
  return value.dump(indent, ' ', /*ensure_ascii=*/false, json::error_handler_t::replace);
}

}  // namespace simpler::base
