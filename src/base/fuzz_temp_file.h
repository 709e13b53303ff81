// Fuzz-target helper: a per-process scratch directory for parsers that read files.
#pragma once

#include <stdlib.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>

namespace simpler::fuzz {

// The process's scratch directory (under /dev/shm when it exists, else $TMPDIR or /tmp),
// created on first use and removed at exit. Owner-thread only (libFuzzer runs one input at a
// time).
inline const std::string& scratch_dir() {
  static const std::string dir = [] {
    std::string base = "/tmp";
    if (const char* t = std::getenv("TMPDIR"); t != nullptr && *t != '\0') base = t;
    if (access("/dev/shm", W_OK) == 0) base = "/dev/shm";
    std::string templ = base + "/simpler_fuzz.XXXXXX";
    if (mkdtemp(templ.data()) == nullptr) {
      std::perror("mkdtemp");
      std::abort();
    }
    static std::string to_remove = templ;
    std::atexit([] {
      std::error_code ec;
      std::filesystem::remove_all(to_remove, ec);
    });
    return templ;
  }();
  return dir;
}

// Writes `bytes` to scratch_dir()/name (replacing it) and returns the path.
inline std::string write_scratch_file(const std::string& name, std::string_view bytes) {
  std::string path = scratch_dir() + "/" + name;
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out) {
    std::perror(path.c_str());
    std::abort();
  }
  return path;
}

}  // namespace simpler::fuzz
