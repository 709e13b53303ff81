#include "model/mapped_file.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <utility>

#include "absl/strings/str_cat.h"
#include "simpler/base/file.h"
#include "simpler/base/status.h"

namespace simpler::llm {

absl::StatusOr<MappedFile> MappedFile::open(const std::string& path) {
  SIMPLER_ASSIGN_OR_RETURN(const base::RegularFile file, base::open_regular_file(path));
  MappedFile mapped;
  mapped.path_ = path;
  if (file.size == 0) {
    ::close(file.fd);
    return mapped;
  }
  void* m = ::mmap(nullptr, file.size, PROT_READ, MAP_PRIVATE, file.fd, 0);
  if (m == MAP_FAILED) {
    const int map_err = errno;
    ::close(file.fd);
    return base::os_error(map_err, "cannot map", path);
  }
  mapped.data_ = static_cast<const std::byte*>(m);
  mapped.size_ = file.size;
  mapped.fd_ = file.fd;
  return mapped;
}

absl::Status MappedFile::read(const std::byte* at, std::span<std::byte> out) const {
  uint64_t offset = static_cast<uint64_t>(at - data_);
  while (!out.empty()) {
    const ssize_t n = ::pread(fd_, out.data(), out.size(), static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return base::os_error(errno, "cannot read", path_);
    if (n == 0) {
      return absl::DataLossError(absl::StrCat(path_, ": the file ends at byte ", offset,
                                              ", before the ", out.size(),
                                              " bytes still to read (it shrank after it was "
                                              "opened)"));
    }
    out = out.subspan(static_cast<size_t>(n));
    offset += static_cast<uint64_t>(n);
  }
  return absl::OkStatus();
}

MappedFile::MappedFile(MappedFile&& other) noexcept
    : path_(std::move(other.path_)),
      data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      fd_(std::exchange(other.fd_, -1)) {}

MappedFile& MappedFile::operator=(MappedFile&& other) noexcept {
  if (this != &other) {
    reset();
    path_ = std::move(other.path_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    fd_ = std::exchange(other.fd_, -1);
  }
  return *this;
}

MappedFile::~MappedFile() { reset(); }

void MappedFile::reset() {
  if (data_ != nullptr) ::munmap(const_cast<std::byte*>(data_), size_);
  if (fd_ >= 0) ::close(fd_);
  data_ = nullptr;
  size_ = 0;
  fd_ = -1;
}

}  // namespace simpler::llm
