#include "serve/access_log.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "serve/server_context.h"
#include "simpler/base/clock.h"

namespace simpler::serve {

namespace {

bool printable(char c) { return c >= 0x21 && c <= 0x7E; }

// At most 100 bytes of `s`, what is not printable ASCII (or a space) as '?': a log line stays
// one line whatever the client sent.
std::string loggable(std::string_view s) {
  std::string out(s.substr(0, 100));
  std::replace_if(
      out.begin(), out.end(), [](char c) { return !printable(c); }, '?');
  return out.empty() ? "-" : out;
}

std::string count(int64_t n) { return n < 0 ? "-" : absl::StrCat(n); }

}  // namespace

std::string request_id_for(std::string_view sent) {
  const bool ok =
      !sent.empty() && sent.size() <= 128 && std::all_of(sent.begin(), sent.end(), printable);
  return ok ? std::string(sent) : random_id("req");
}

AccessRecord& AccessRecord::current() {
  thread_local AccessRecord record;
  return record;
}

void AccessRecord::begin() { current() = AccessRecord{.begun = true, .start_ns = base::now_ns()}; }

void AccessRecord::note_tokens(int64_t prompt, int64_t completion) {
  AccessRecord& r = current();
  r.prompt_tokens = prompt;
  r.completion_tokens = completion;
}

void AccessRecord::note_client_disconnected() { current().client_disconnected = true; }

AccessRecord AccessRecord::take() {
  AccessRecord r = current();
  current() = AccessRecord{};
  return r;
}

std::string access_line(std::string_view method, std::string_view path, int status,
                        const AccessRecord& record, int64_t end_ns, std::string_view request_id) {
  const double ms = record.begun ? static_cast<double>(end_ns - record.start_ns) / 1e6 : 0.0;
  return absl::StrCat(loggable(method), " ", loggable(path), " ", status,
                      " prompt_tokens=", count(record.prompt_tokens),
                      " completion_tokens=", count(record.completion_tokens),
                      " ms=", absl::StrFormat("%.1f", ms), " request_id=", loggable(request_id),
                      record.client_disconnected ? " client_disconnected" : "");
}

}  // namespace simpler::serve
