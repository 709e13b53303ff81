#!/usr/bin/env bash
# Configures and builds one flavour into build/<flavour>:
#   release (default): everything, RelWithDebInfo
#   asan: test targets only, -O1, AddressSanitizer + UBSan
#   tsan: test targets only, -O1, ThreadSanitizer
#   fuzz: clang, libFuzzer targets (build/fuzz/fuzz/*_fuzz), -O1, ASan + UBSan; build with
#         `scripts/build.sh fuzz --target fuzzers` to build only them
# Further arguments go to `cmake --build` (e.g. --target worker_test).
set -euo pipefail
cd "$(dirname "$0")/.."
flavour="${1:-release}"
shift || true
jobs="${SIMPLER_BUILD_JOBS:-$(nproc)}"
case "$flavour" in
  release) flags=(-DCMAKE_BUILD_TYPE=RelWithDebInfo) ;;
  asan) flags=(-DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_FLAGS_DEBUG="-O1 -g" -DSIMPLER_ENABLE_ASAN=ON -DSIMPLER_TESTS_ONLY=ON) ;;
  tsan) flags=(-DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_FLAGS_DEBUG="-O1 -g" -DSIMPLER_ENABLE_TSAN=ON -DSIMPLER_TESTS_ONLY=ON) ;;
  fuzz) flags=(-DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_FLAGS_DEBUG="-O1 -g" -DSIMPLER_ENABLE_FUZZING=ON
              -DSIMPLER_TESTS_ONLY=ON -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++) ;;
  *) echo "build.sh: unknown flavour '$flavour' (release|asan|tsan|fuzz)" >&2; exit 2 ;;
esac
# ccache (Debian's; its cache under the user's cache directory) when present: rebuilds of a
# fresh clone's flavours share the objects they have in common.
if command -v ccache >/dev/null 2>&1; then flags+=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache); fi
cmake -S . -B "build/$flavour" -G Ninja "${flags[@]}" >/dev/null
cmake --build "build/$flavour" -j "$jobs" "$@"
