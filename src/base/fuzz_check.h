// Fuzz-target helper: the property check every libFuzzer target of the project uses.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace simpler::fuzz {

// Aborts (a finding libFuzzer saves) with "<target file>: violated: <what>" when `ok` is false.
// `file` defaults to the calling source file, so each target's findings name it.
inline void check(bool ok, const char* what, const char* file = __builtin_FILE()) {
  if (ok) return;
  const char* slash = std::strrchr(file, '/');
  std::fprintf(stderr, "%s: violated: %s\n", slash != nullptr ? slash + 1 : file, what);
  std::abort();
}

}  // namespace simpler::fuzz
