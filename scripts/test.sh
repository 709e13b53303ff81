#!/usr/bin/env bash
# Installs, builds and runs every test: formatting, the release build's full
# suite, the unit tests under AddressSanitizer + UBSan, and the concurrency
# tests under ThreadSanitizer. Every test has a time limit (ctest TIMEOUT).
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)

scripts/install_deps.sh

echo "== format check" >&2
git ls-files '*.h' '*.cc' | xargs clang-format --dry-run -Werror

echo "== release build + all tests" >&2
scripts/build.sh release
ctest --test-dir build/release --output-on-failure -j 2 --timeout 300

echo "== AddressSanitizer + UBSan: unit tests" >&2
scripts/build.sh asan
ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  ctest --test-dir build/asan --output-on-failure -j 2 --timeout 300 -L unit

echo "== ThreadSanitizer: concurrency tests" >&2
scripts/build.sh tsan --target concurrency_tests
TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 suppressions=$PWD/tsan.supp" \
  ctest --test-dir build/tsan --output-on-failure -j 2 --timeout 300 -L concurrency

echo "test.sh: all legs passed in $(( $(date +%s) - start )) s" >&2
