// Reading whole files without blocking on what is not a regular file.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"

namespace simpler::base {

// The status of a failed system call on `path`: "<what> <path>: <strerror>", with the code
// ENOENT / ENOTDIR -> NOT_FOUND, EACCES / EPERM / EROFS -> PERMISSION_DENIED, ENOSPC / EDQUOT
// -> RESOURCE_EXHAUSTED, anything else INTERNAL. Thread-safe.
absl::Status os_error(int err, std::string_view what, std::string_view path);

// A regular file opened for reading. `fd` belongs to the caller, who closes it.
struct RegularFile {
  int fd = -1;
  uint64_t size = 0;  // bytes, from fstat
};

// Opens `path` read-only with O_NONBLOCK (a FIFO never blocks the open) and checks its type
// before anything is read. INVALID_ARGUMENT "<path> is a directory" or "<path> is not a regular
// file (a FIFO)" (or a socket, a character / block device); os_error otherwise ("cannot open").
// Nothing is left open on an error. Thread-safe.
absl::StatusOr<RegularFile> open_regular_file(const std::string& path);

// The contents of the regular file `path`, at most `max_bytes` long. The file is opened with
// O_NONBLOCK and its type checked before anything is read, so a FIFO or a device never blocks.
// Errors name the path: NOT_FOUND when it does not exist; INVALID_ARGUMENT "<path> is a
// directory", "<path> is not a regular file (a FIFO)" or "<path> is N bytes, above the limit of
// M"; PERMISSION_DENIED / INTERNAL for other OS errors. Thread-safe.
absl::StatusOr<std::string> read_regular_file(const std::string& path,
                                              uint64_t max_bytes = uint64_t{1} << 30);

}  // namespace simpler::base
