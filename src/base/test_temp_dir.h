// Test helper: a scratch directory per test, under a per-process root that is
// removed when the test binary exits (so concurrent test runs never share one,
// and nothing is left in the temp directory), and reading back what a test wrote there.
#pragma once

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <system_error>

#include "gtest/gtest.h"

namespace simpler::testing {

// Empty directory <TempDir>/<prefix>.<pid>/<Suite>.<Test> for the running test.
inline std::filesystem::path test_dir(const std::string& prefix) {
  namespace fs = std::filesystem;
  struct Root {
    fs::path path;
    ~Root() {
      std::error_code ec;
      fs::remove_all(path, ec);
    }
  };
  static const Root root{fs::path(::testing::TempDir()) /
                         (prefix + "." + std::to_string(::getpid()))};
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  fs::path dir = root.path / (std::string(info->test_suite_name()) + "." + info->name());
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

// The bytes of the file at `path`; empty when it cannot be read.
inline std::string read_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream bytes;
  bytes << in.rdbuf();
  return bytes.str();
}

}  // namespace simpler::testing
