// A regular file mapped read-only into memory: the one mmap path of the checkpoint readers
// (safetensors and GGUF). Tensor views borrow from the mapping, so tensor data is never copied
// at open; a loader that copies a tensor elsewhere reads its bytes with read() instead (no page
// of the mapping is touched).
#pragma once

#include <cstddef>
#include <span>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace simpler::llm {

// One file mapped read-only (PROT_READ, MAP_PRIVATE), its descriptor kept open for read().
// Move-only; the mapping and the descriptor live as long as the object, and every span into it
// must not outlive it. Const methods are thread-safe.
class MappedFile {
 public:
  // Opens `path` without blocking (a FIFO, a directory or a device is refused by
  // base::open_regular_file before anything is read) and maps the whole file. An empty file maps
  // to an empty span. Errors name the path: those of base::open_regular_file, and the OS error
  // of mmap ("cannot map").
  static absl::StatusOr<MappedFile> open(const std::string& path);

  MappedFile() = default;
  MappedFile(MappedFile&& other) noexcept;
  MappedFile& operator=(MappedFile&& other) noexcept;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  ~MappedFile();

  const std::string& path() const { return path_; }
  std::span<const std::byte> bytes() const { return {data_, size_}; }
  // Copies the file's bytes at `at` (a pointer into bytes()) to `out` with pread, not through the
  // mapping: no page fault or page-table entry per page (costly on a VM), and nothing of the
  // mapping becomes resident. [at, at + out.size()) must lie inside bytes(). Errors name the
  // path: the OS error of pread ("cannot read"); DATA_LOSS when the file ends early (it shrank
  // after it was mapped).
  absl::Status read(const std::byte* at, std::span<std::byte> out) const;

 private:
  void reset();
  std::string path_;
  const std::byte* data_ = nullptr;  // nullptr for an empty file
  size_t size_ = 0;
  int fd_ = -1;  // -1 for an empty file
};

}  // namespace simpler::llm
