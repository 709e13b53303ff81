#include "model/mapped_file.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <utility>

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
  const int map_err = errno;
  ::close(file.fd);
  if (m == MAP_FAILED) return base::os_error(map_err, "cannot map", path);
  mapped.data_ = static_cast<const std::byte*>(m);
  mapped.size_ = file.size;
  return mapped;
}

MappedFile::MappedFile(MappedFile&& other) noexcept
    : path_(std::move(other.path_)),
      data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)) {}

MappedFile& MappedFile::operator=(MappedFile&& other) noexcept {
  if (this != &other) {
    reset();
    path_ = std::move(other.path_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

MappedFile::~MappedFile() { reset(); }

void MappedFile::reset() {
  if (data_ != nullptr) ::munmap(const_cast<std::byte*>(data_), size_);
  data_ = nullptr;
  size_ = 0;
}

}  // namespace simpler::llm
