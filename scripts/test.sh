#!/usr/bin/env bash
# Installs, builds and runs every test: formatting; llama.cpp's tools (the peer the exported
# GGUF is checked against); the release build's full suite; clang's thread-safety analysis of
# every source file; the unit tests under AddressSanitizer + UBSan; the concurrency tests under
# ThreadSanitizer; the aarch64 NEON kernels cross-built and run under qemu-user; and the
# libFuzzer targets replaying their seed corpora and saved crashes plus a short deterministic
# run each (scripts/fuzz.sh replay).
# Every test has a time limit (ctest TIMEOUT).
# Every leg runs even when an earlier one failed; the exit status is non-zero
# when any leg failed, and the last line names them.
set -uo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
failed=()
# Each leg's wall time, printed as it ends and summed up at the end (where the minutes go).
leg_name="" leg_start=0 times=()
leg() {
  local now
  now=$(date +%s)
  if [ -n "$leg_name" ]; then
    times+=("$leg_name $((now - leg_start))s")
    echo "-- $leg_name: $((now - leg_start)) s" >&2
  fi
  leg_name="$1" leg_start=$now
  [ -n "$1" ] && echo "== $1" >&2
  return 0
}

leg "install dependencies"
scripts/install_deps.sh || { echo "test.sh: installing dependencies failed" >&2; exit 1; }

leg "format check"
git ls-files '*.h' '*.cc' | xargs clang-format --dry-run -Werror || failed+=("format")

leg "llama.cpp peer (npm's node-llama-cpp, for the exported-GGUF test)"
scripts/build_llamacpp_peer.sh || failed+=("llamacpp-peer")

leg "release build + all tests"
if scripts/build.sh release; then
  ctest --test-dir build/release --output-on-failure -j 2 --timeout 300 || failed+=("release")
  leg "clang thread-safety analysis (GUARDED_BY / REQUIRES)"
  timeout 900 scripts/check_thread_safety.py build/release || failed+=("thread-safety")
else
  failed+=("release-build")
fi

leg "AddressSanitizer + UBSan: unit tests"
if scripts/build.sh asan; then
  ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    ctest --test-dir build/asan --output-on-failure -j 2 --timeout 300 -L unit || failed+=("asan")
else
  failed+=("asan-build")
fi

leg "ThreadSanitizer: concurrency tests"
if scripts/build.sh tsan --target concurrency_tests; then
  TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 suppressions=$PWD/tsan.supp" \
    ctest --test-dir build/tsan --output-on-failure -j 2 --timeout 300 -L concurrency ||
    failed+=("tsan")
else
  failed+=("tsan-build")
fi

leg "aarch64 NEON kernels: cross-built, run under qemu-user"
if [ "$(uname -m)" = x86_64 ]; then
  timeout 300 scripts/test_neon.sh || failed+=("neon")
fi

leg "fuzzers: replay corpora and saved crashes, deterministic runs"
if scripts/build.sh fuzz --target fuzzers; then
  timeout 480 scripts/fuzz.sh replay || failed+=("fuzz")
else
  failed+=("fuzz-build")
fi

leg ""
echo "test.sh: legs: ${times[*]}" >&2
elapsed=$(( $(date +%s) - start ))
if [ ${#failed[@]} -gt 0 ]; then
  echo "test.sh: FAILED legs: ${failed[*]} (after ${elapsed} s)" >&2
  exit 1
fi
echo "test.sh: all legs passed in ${elapsed} s" >&2
