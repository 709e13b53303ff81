#include "simpler/base/file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "simpler/base/status.h"

namespace simpler::base {
namespace {

const char* kind_of(mode_t mode) {
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  return "not a plain file";
}

}  // namespace

absl::Status os_error(int err, std::string_view what, std::string_view path) {
  std::string message =
      absl::StrCat(std::string(what), " ", std::string(path), ": ", std::strerror(err));
  switch (err) {
    case ENOENT:
    case ENOTDIR:
      return absl::NotFoundError(message);
    case EACCES:
    case EPERM:
    case EROFS:
      return absl::PermissionDeniedError(message);
    case ENOSPC:
    case EDQUOT:
      return absl::ResourceExhaustedError(message);
    default:
      return absl::InternalError(message);
  }
}

absl::StatusOr<RegularFile> open_regular_file(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    if (errno == EISDIR) return absl::InvalidArgumentError(absl::StrCat(path, " is a directory"));
    return os_error(errno, "cannot open", path);
  }
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    return os_error(err, "cannot stat", path);
  }
  if (S_ISDIR(st.st_mode)) {
    ::close(fd);
    return absl::InvalidArgumentError(absl::StrCat(path, " is a directory"));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return absl::InvalidArgumentError(
        absl::StrCat(path, " is not a regular file (", kind_of(st.st_mode), ")"));
  }
  return RegularFile{fd, static_cast<uint64_t>(st.st_size)};
}

absl::StatusOr<std::string> read_regular_file(const std::string& path, uint64_t max_bytes) {
  SIMPLER_ASSIGN_OR_RETURN(const RegularFile file, open_regular_file(path));
  const int fd = file.fd;
  if (file.size > max_bytes) {
    ::close(fd);
    return absl::InvalidArgumentError(
        absl::StrCat(path, " is ", file.size, " bytes, above the limit of ", max_bytes));
  }
  std::string text;
  text.resize(static_cast<size_t>(file.size));
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::read(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      ::close(fd);
      return os_error(err, "cannot read", path);
    }
    if (n == 0) break;  // the file shrank
    done += static_cast<size_t>(n);
  }
  text.resize(done);
  ::close(fd);
  return text;
}

}  // namespace simpler::base
