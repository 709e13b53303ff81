#include "simpler/tokenizer/detokenizer.h"

#include <utf8proc.h>

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace simpler::llm {

bool valid_utf8(std::string_view s) {
  const auto* p = reinterpret_cast<const utf8proc_uint8_t*>(s.data());
  utf8proc_ssize_t left = static_cast<utf8proc_ssize_t>(s.size());
  while (left > 0) {
    utf8proc_int32_t cp;
    const utf8proc_ssize_t n = utf8proc_iterate(p, left, &cp);
    if (n <= 0 || cp < 0) return false;
    p += n;
    left -= n;
  }
  return true;
}

namespace {

// Length of the trailing proper prefix of a valid UTF-8 sequence in `bytes`
// (0 when the bytes end on a complete character or in invalid bytes): a lead
// byte followed by fewer continuation bytes than it needs, each in the range
// the Unicode standard (Table 3-7, well-formed byte sequences) allows there.
size_t incomplete_tail(std::string_view bytes) {
  const size_t n = bytes.size();
  for (size_t back = 1; back <= 3 && back <= n; ++back) {
    const auto lead = static_cast<unsigned char>(bytes[n - back]);
    if ((lead & 0xC0) == 0x80) continue;  // a continuation byte: look further back
    size_t need = 0;
    unsigned char lo = 0x80, hi = 0xBF;  // allowed range of the second byte
    if (lead >= 0xC2 && lead <= 0xDF) {
      need = 2;
    } else if (lead >= 0xE0 && lead <= 0xEF) {
      need = 3;
      if (lead == 0xE0) lo = 0xA0;
      if (lead == 0xED) hi = 0x9F;
    } else if (lead >= 0xF0 && lead <= 0xF4) {
      need = 4;
      if (lead == 0xF0) lo = 0x90;
      if (lead == 0xF4) hi = 0x8F;
    } else {
      return 0;  // ASCII or a byte that never starts a sequence
    }
    if (back >= need) return 0;  // complete (or too long: invalid, not incomplete)
    for (size_t k = 1; k < back; ++k) {
      const auto c = static_cast<unsigned char>(bytes[n - back + k]);
      const unsigned char l = k == 1 ? lo : 0x80, h = k == 1 ? hi : 0xBF;
      if (c < l || c > h) return 0;
    }
    return back;
  }
  return 0;
}

}  // namespace

std::string IncrementalDetokenizer::push(std::span<const int32_t> ids) {
  num_ids_ += static_cast<int64_t>(ids.size());
  pending_ += tokenizer_->decode_bytes(ids, skip_special_tokens_);
  const size_t hold = incomplete_tail(pending_);
  std::string delta =
      Tokenizer::lossy_utf8(std::string_view(pending_).substr(0, pending_.size() - hold));
  pending_.erase(0, pending_.size() - hold);
  text_ += delta;
  return delta;
}

std::string IncrementalDetokenizer::finish() {
  std::string delta = Tokenizer::lossy_utf8(pending_);
  pending_.clear();
  text_ += delta;
  return delta;
}

absl::StatusOr<StopStringMatcher> StopStringMatcher::create(std::vector<std::string> stops) {
  for (size_t i = 0; i < stops.size(); ++i) {
    if (stops[i].empty()) {
      return absl::InvalidArgumentError(absl::StrCat("stop string ", i, " is empty"));
    }
    if (!valid_utf8(stops[i])) {
      return absl::InvalidArgumentError(absl::StrCat("stop string ", i, " is not valid UTF-8"));
    }
  }
  return StopStringMatcher(std::move(stops));
}

StopStringMatcher::StopStringMatcher(std::vector<std::string> stops) : stops_(std::move(stops)) {
  for (const auto& s : stops_) longest_ = std::max(longest_, s.size());
}

StopStringMatcher::Result StopStringMatcher::push(std::string_view delta, bool armed) {
  Result r;
  if (stopped_) {
    r.stopped = true;
    return r;
  }
  held_.append(delta);
  if (!armed) unarmed_ = held_.size();
  // The earliest match of any stop string (the first listed on a tie) that
  // ends after the text pushed before arming.
  size_t best = std::string::npos;
  for (size_t i = 0; armed && i < stops_.size(); ++i) {
    const size_t from = unarmed_ >= stops_[i].size() ? unarmed_ - stops_[i].size() + 1 : 0;
    const size_t at = held_.find(stops_[i], from);
    if (at < best) {
      best = at;
      r.stop_index = static_cast<int32_t>(i);
    }
  }
  if (best != std::string::npos) {
    r.text = held_.substr(0, best);
    r.stopped = stopped_ = true;
    held_.clear();
    return r;
  }
  r.stop_index = -1;
  // Hold back the longest tail that is a proper prefix of a stop string.
  size_t keep = 0;
  for (const auto& s : stops_) {
    for (size_t k = std::min(s.size() - 1, held_.size()); k > keep; --k) {
      if (std::string_view(held_).substr(held_.size() - k) == std::string_view(s).substr(0, k)) {
        keep = k;
        break;
      }
    }
  }
  r.text = held_.substr(0, held_.size() - keep);
  held_.erase(0, held_.size() - keep);
  unarmed_ = armed ? 0 : held_.size();
  return r;
}

std::string StopStringMatcher::finish() {
  if (stopped_) return std::string();
  std::string out = std::move(held_);
  held_.clear();
  return out;
}

}  // namespace simpler::llm
