#include "simpler/base/status.h"

#include <cxxabi.h>

#include <cstdlib>
#include <exception>
#include <memory>
#include <string>
#include <typeinfo>

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

absl::Status mark_poisoned_by(absl::Status status, uint64_t run) {
  if (status.ok()) return status;
  status.SetPayload(kPoisonedByRunPayload, absl::Cord(std::to_string(run)));
  return status;
}

std::optional<uint64_t> poisoned_by(const absl::Status& status) {
  auto p = status.GetPayload(kPoisonedByRunPayload);
  if (!p.has_value()) return std::nullopt;
  const std::string text(*p);
  char* end = nullptr;
  const unsigned long long v = std::strtoull(text.c_str(), &end, 10);
  if (end == text.c_str() || *end != '\0') return std::nullopt;
  return static_cast<uint64_t>(v);
}

namespace {

std::string demangle(const char* mangled) {
  int rc = 0;
  std::unique_ptr<char, void (*)(void*)> name(abi::__cxa_demangle(mangled, nullptr, nullptr, &rc),
                                              std::free);
  return rc == 0 && name != nullptr ? std::string(name.get()) : std::string(mangled);
}

}  // namespace

absl::Status status_from_current_exception(absl::string_view what) {
  std::exception_ptr e = std::current_exception();
  if (e == nullptr) {
    return absl::InternalError(absl::StrCat(what, " failed outside of an exception handler"));
  }
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& ex) {
    return absl::InternalError(
        absl::StrCat(what, " threw ", demangle(typeid(ex).name()), ": ", ex.what()));
  } catch (...) {
    const std::type_info* t = abi::__cxa_current_exception_type();
    return absl::InternalError(
        absl::StrCat(what, " threw an exception of ",
                     t != nullptr ? "type " + demangle(t->name()) : "unknown type"));
  }
}

absl::Status require_positive(std::initializer_list<PositiveField> fields) {
  for (const PositiveField& f : fields) {
    if (f.value <= 0) {
      return absl::InvalidArgumentError(absl::StrCat(f.name, " ", f.value, " must be positive"));
    }
  }
  return absl::OkStatus();
}

}  // namespace simpler::base
