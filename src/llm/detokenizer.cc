#include "simpler/llm/detokenizer.h"

#include <utf8proc.h>

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace simpler::llm {

namespace {

constexpr std::string_view kReplacement = "\xEF\xBF\xBD";  // U+FFFD in UTF-8

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

}  // namespace

std::string IncrementalDetokenizer::push(std::span<const int32_t> ids) {
  window_.insert(window_.end(), ids.begin(), ids.end());
  num_ids_ += static_cast<int64_t>(ids.size());
  const std::string full = tokenizer_->decode(window_, skip_special_tokens_);
  // A trailing U+FFFD may stand for an incomplete character that the next
  // token completes: hold every trailing one back.
  size_t stable = full.size();
  while (stable >= kReplacement.size() &&
         std::string_view(full).substr(stable - kReplacement.size()) == kReplacement) {
    stable -= kReplacement.size();
  }
  std::string delta;
  if (stable > window_emitted_) {
    delta = full.substr(window_emitted_, stable - window_emitted_);
    window_emitted_ = stable;
  }
  if (stable == full.size()) {
    // The window's bytes end on a character boundary: later tokens decode
    // independently of it, so decoding restarts after it.
    window_.clear();
    window_emitted_ = 0;
  }
  text_ += delta;
  return delta;
}

std::string IncrementalDetokenizer::finish() {
  const std::string full = tokenizer_->decode(window_, skip_special_tokens_);
  std::string delta = full.size() > window_emitted_ ? full.substr(window_emitted_) : std::string();
  window_.clear();
  window_emitted_ = 0;
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
