#!/usr/bin/env bash
# Configures and builds one flavour into build/<flavour>:
#   release (default): everything, RelWithDebInfo
#   asan: test targets only, -O1, AddressSanitizer + UBSan
#   tsan: test targets only, -O1, ThreadSanitizer
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
  *) echo "build.sh: unknown flavour '$flavour' (release|asan|tsan)" >&2; exit 2 ;;
esac
cmake -S . -B "build/$flavour" -G Ninja "${flags[@]}" >/dev/null
cmake --build "build/$flavour" -j "$jobs" "$@"
