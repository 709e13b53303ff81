// Reading whole files without blocking on what is not a regular file.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace simpler::base {

// The contents of the regular file `path`, at most `max_bytes` long. The file is opened with
// O_NONBLOCK and its type checked before anything is read, so a FIFO or a device never blocks.
// Errors name the path: NOT_FOUND when it does not exist; INVALID_ARGUMENT "<path> is a
// directory", "<path> is not a regular file (a FIFO)" or "<path> is N bytes, above the limit of
// M"; PERMISSION_DENIED / INTERNAL for other OS errors. Thread-safe.
absl::StatusOr<std::string> read_regular_file(const std::string& path,
                                              uint64_t max_bytes = uint64_t{1} << 30);

}  // namespace simpler::base
