#include "simpler/base/status.h"

#include <string>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"

namespace simpler::base {

absl::Status mark_unrecoverable(absl::Status status) {
  if (status.ok()) return status;
  status.SetPayload(kUnrecoverablePayload, absl::Cord("1"));
  return status;
}

bool is_unrecoverable(const absl::Status& status) {
  return !status.ok() && status.GetPayload(kUnrecoverablePayload).has_value();
}

absl::Status annotate(const absl::Status& status, absl::string_view prefix) {
  if (status.ok()) return status;
  absl::Status out(status.code(), absl::StrCat(prefix, status.message()));
  status.ForEachPayload(
      [&out](absl::string_view key, const absl::Cord& value) { out.SetPayload(key, value); });
  return out;
}

}  // namespace simpler::base
