#!/usr/bin/env bash
# Installs, builds and runs every test: formatting, function lengths and copied code (jscpd);
# llama.cpp's tools (the peer the exported GGUF is checked against); the release build's full
# suite; clang's thread-safety analysis of every source file; the unit tests under
# AddressSanitizer + UBSan; the concurrency tests under ThreadSanitizer; the aarch64 NEON kernels
# cross-built and run under qemu-user; and the libFuzzer targets replaying their seed corpora and
# saved crashes plus a short deterministic run each (scripts/fuzz.sh replay).
# Every test has a time limit (ctest TIMEOUT).
# Every leg runs even when an earlier one failed; the exit status is non-zero
# when any leg failed, and the last line names them.
#
#   scripts/test.sh --repeat N [--under-load] LEG
#       Flakiness: builds LEG's flavour (release, asan or tsan) and runs that leg's tests N times,
#       then prints each test that failed with its count (failures / N). --under-load runs
#       stress-ng (Debian's; installed when missing) on every CPU beside the tests, as on a CI
#       machine shared with other builds. Exits non-zero when any run failed.
set -uo pipefail
cd "$(dirname "$0")/.."

# The ctest arguments of each leg (run from the repository root).
leg_ctest_args() {
  case "$1" in
    release) echo "--test-dir build/release --timeout 300" ;;
    asan) echo "--test-dir build/asan --timeout 300 -L unit" ;;
    tsan) echo "--test-dir build/tsan --timeout 300 -L concurrency" ;;
    *) return 1 ;;
  esac
}
leg_build() {
  case "$1" in
    release) scripts/build.sh release ;;
    asan) scripts/build.sh asan ;;
    tsan) scripts/build.sh tsan --target concurrency_tests ;;
  esac
}
# Builds a leg's flavour, then runs its tests; records "<leg>-build" or "<leg>" in `failed`.
# Returns non-zero only when the build failed.
leg_build_and_test() {
  if ! leg_build "$1"; then
    failed+=("$1-build")
    return 1
  fi
  # shellcheck disable=SC2046
  ctest $(leg_ctest_args "$1") --output-on-failure -j 2 || failed+=("$1")
}
export ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
export TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 suppressions=$PWD/tsan.supp"

if [ "${1:-}" = "--repeat" ]; then
  shift
  n="${1:-}"
  shift || true
  load=0
  if [ "${1:-}" = "--under-load" ]; then load=1; shift; fi
  which_leg="${1:-}"
  if ! [[ "$n" =~ ^[1-9][0-9]*$ ]] || ! args=$(leg_ctest_args "$which_leg"); then
    echo "usage: scripts/test.sh --repeat N [--under-load] release|asan|tsan (N a positive count)" >&2
    exit 2
  fi
  leg_build "$which_leg" || { echo "test.sh: building the $which_leg leg failed" >&2; exit 1; }
  stress_pid=""
  if [ $load = 1 ]; then
    if ! command -v stress-ng >/dev/null 2>&1; then
      SUDO=""; [ "$(id -u)" != "0" ] && SUDO="sudo"
      $SUDO apt-get install -y -qq stress-ng >&2 || { echo "test.sh: installing stress-ng failed" >&2; exit 1; }
    fi
    stress-ng --cpu "$(nproc)" --cpu-load 100 --quiet &
    stress_pid=$!
    trap '[ -n "$stress_pid" ] && kill "$stress_pid" 2>/dev/null' EXIT
  fi
  declare -A fails=()
  log=$(mktemp)
  for ((i = 1; i <= n; i++)); do
    # shellcheck disable=SC2086
    ctest $args -j 2 --output-on-failure >"$log" 2>&1
    rc=$?
    # ctest lists each failed test as "  <number> - <name> (Failed|Timeout|...)".
    bad=$(sed -n '/The following tests FAILED:/,$p' "$log" | sed -nE 's/^[[:space:]]*[0-9]+ - ([^ ]+) \(.*$/\1/p' |
      tr '\n' ' ' | sed 's/ $//')
    for t in $bad; do fails[$t]=$(( ${fails[$t]:-0} + 1 )); done
    if [ $rc -ne 0 ] && [ -z "$bad" ]; then fails["(ctest-exit-$rc)"]=$(( ${fails["(ctest-exit-$rc)"]:-0} + 1 )); fi
    if [ -n "$bad" ]; then cp "$log" "build/repeat-$which_leg-$i.log"; fi
    echo "test.sh: $which_leg run $i/$n: $( [ $rc = 0 ] && echo passed || echo "FAILED: $bad (log: build/repeat-$which_leg-$i.log)")" >&2
  done
  rm -f "$log"
  if [ ${#fails[@]} -eq 0 ]; then
    echo "test.sh: $which_leg: no failures in $n runs" >&2
    exit 0
  fi
  echo "test.sh: $which_leg: failures per test over $n runs:" >&2
  for t in "${!fails[@]}"; do echo "  $t: ${fails[$t]}/$n"; done | sort >&2
  exit 1
fi

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

leg "format check, function lengths, no copies, no issue references"
git ls-files '*.h' '*.cc' | xargs clang-format --dry-run -Werror || failed+=("format")
scripts/check_function_length.py || failed+=("function-length")
# No code is copied letter for letter outside the tests: jscpd (npm, package.json) lists each run
# of 6 or more identical lines of src/ and include/ (.jscpd.json says what it reads).
node_modules/.bin/jscpd --config .jscpd.json || failed+=("copies")
# Docs and comments say what they mean, not which tracker issue asked for it.
if git grep -nIiE '\bissues? #?[0-9]+' -- . ':!scripts/test.sh'; then
  echo "test.sh: the lines above name tracker issues; say what is meant instead" >&2
  failed+=("issue-references")
fi

leg "llama.cpp peer (npm's node-llama-cpp, for the exported-GGUF test)"
scripts/build_llamacpp_peer.sh || failed+=("llamacpp-peer")

leg "release build + all tests"
leg_build_and_test release

# One clang build serves the unit tests under ASan + UBSan and the libFuzzer targets, and checks
# the thread-safety annotations of everything it compiles (-Werror=thread-safety).
leg "AddressSanitizer + UBSan: unit tests (and the fuzz targets' build)"
asan_built=0
leg_build_and_test asan && asan_built=1

leg "clang thread-safety analysis (GUARDED_BY / REQUIRES) of what the clang builds leave out"
if [ -f build/release/compile_commands.json ]; then
  timeout 900 scripts/check_thread_safety.py build/release --skip-built-by build/asan ||
    failed+=("thread-safety")
fi

leg "ThreadSanitizer: concurrency tests"
leg_build_and_test tsan

leg "aarch64 NEON kernels: cross-built, run under qemu-user"
if [ "$(uname -m)" = x86_64 ]; then
  timeout 300 scripts/test_neon.sh || failed+=("neon")
fi

leg "fuzzers: replay corpora and saved crashes, deterministic runs"
if [ $asan_built = 1 ]; then
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
