// Status helpers. Note: Debian 12's Abseil is built with its own
// absl::string_view (not std::string_view); pass std::string, const char* or
// absl::string_view to absl functions.
// Errors are values: core code returns absl::Status /
// absl::StatusOr<T> with a canonical code and a message naming the run,
// task or field at fault. No exception crosses a thread or layer boundary.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

#define SIMPLER_STATUS_CONCAT_INNER(a, b) a##b
#define SIMPLER_STATUS_CONCAT(a, b) SIMPLER_STATUS_CONCAT_INNER(a, b)

// Returns from the enclosing function when `expr` is not OK.
#define SIMPLER_RETURN_IF_ERROR(expr)                  \
  do {                                                 \
    ::absl::Status simpler_status_ = (expr);           \
    if (!simpler_status_.ok()) return simpler_status_; \
  } while (0)

// `lhs = value of expr` or return its error.
#define SIMPLER_ASSIGN_OR_RETURN(lhs, expr) \
  SIMPLER_ASSIGN_OR_RETURN_IMPL(SIMPLER_STATUS_CONCAT(simpler_statusor_, __LINE__), lhs, expr)
#define SIMPLER_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                                  \
  if (!tmp.ok()) return std::move(tmp).status();      \
  lhs = std::move(tmp).value()

namespace simpler::base {

// Payload key marking an error after which the device state is unknown
// (device fault, operation timeout, lost device). Such an error poisons its
// lane (ARCHITECTURE.md invariant 5); every other error is recoverable.
inline constexpr absl::string_view kUnrecoverablePayload = "simpler/unrecoverable";

// Returns `status` marked unrecoverable.
absl::Status mark_unrecoverable(absl::Status status);

// True when `status` carries the unrecoverable mark.
bool is_unrecoverable(const absl::Status& status);

// Returns `status` with `prefix` prepended to its message, keeping code and payloads.
absl::Status annotate(const absl::Status& status, absl::string_view prefix);

// Payload key naming the run whose unrecoverable error poisoned a lane: set
// on every "lane poisoned by run N" status, so a caller holding many handles
// can find the run whose own error explains the refusal.
inline constexpr absl::string_view kPoisonedByRunPayload = "simpler/poisoned-by-run";

// Returns `status` tagged with the poisoning run `run` (see above).
absl::Status mark_poisoned_by(absl::Status status, uint64_t run);
// The run that poisoned the lane this status reports, when it is such a status.
std::optional<uint64_t> poisoned_by(const absl::Status& status);

// The exception being handled, as an INTERNAL (recoverable) status:
// "<what> threw <type>: <message>" (the demangled type of a std::exception and
// its what(); "an exception of unknown type" for anything else). Must be
// called inside a catch block: exceptions thrown by user code (orchestration
// functions, kernels) become the run's error here, so none crosses a thread
// or layer boundary.
absl::Status status_from_current_exception(absl::string_view what);

// An integer field that must be above 0, under the name its error message gives it.
struct PositiveField {
  absl::string_view name;
  int64_t value = 0;
};

// OK when every field's value is above 0; otherwise INVALID_ARGUMENT for the first that is not:
// "<name> <value> must be positive". For the size and count fields of an options struct.
absl::Status require_positive(std::initializer_list<PositiveField> fields);

}  // namespace simpler::base
