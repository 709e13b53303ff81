#!/usr/bin/env bash
# Configures and builds one flavour into build/<flavour>:
#   release (default): everything, -O2 with line tables (-g1: symbols, files and lines for perf
#            and backtraces, without the variables' debug info, which took a third of the
#            compile time)
#   asan: clang, test targets and the libFuzzer targets (build/asan/fuzz/*_fuzz; `--target
#         fuzzers` builds only them), -O1 -g1, AddressSanitizer + UBSan, the libraries
#         instrumented for libFuzzer's coverage; clang's thread-safety analysis is an error
#   tsan: clang, test targets only, -O1 -g (full debug info: with line tables only an inlined
#         frame is named without its scope, and tsan.supp's patterns, e.g. absl::*Status::Unref*,
#         would no longer match it), ThreadSanitizer, thread-safety analysis an error
# Every flavour is a unity build (CMake UNITY_BUILD, 8 sources a batch: half the CPU time of a
# build from empty); SIMPLER_UNITY_BUILD=OFF in the environment compiles each file alone (the
# build folder is reconfigured either way).
# Further arguments go to `cmake --build` (e.g. --target worker_test).
# SIMPLER_BUILD_DIR in the environment builds into that folder instead of build/<flavour>;
# SIMPLER_BUILD_LAUNCHER runs that command in front of each compiler and linker call, without
# ccache (scripts/build_cpu.sh times each call with it).
set -euo pipefail
cd "$(dirname "$0")/.."
flavour="${1:-release}"
shift || true
jobs="${SIMPLER_BUILD_JOBS:-$(nproc)}"
dir="${SIMPLER_BUILD_DIR:-build/$flavour}"
case "$flavour" in
  release) flags=(-DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O2 -g1 -DNDEBUG") ;;
  asan) flags=(-DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_FLAGS_DEBUG="-O1 -g1" -DSIMPLER_ENABLE_ASAN=ON
               -DSIMPLER_ENABLE_FUZZING=ON -DSIMPLER_TESTS_ONLY=ON
               -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++) ;;
  tsan) flags=(-DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_FLAGS_DEBUG="-O1 -g" -DSIMPLER_ENABLE_TSAN=ON
               -DSIMPLER_TESTS_ONLY=ON -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++) ;;
  *) echo "build.sh: unknown flavour '$flavour' (release|asan|tsan)" >&2; exit 2 ;;
esac
# ccache (Debian's; its cache under the user's cache directory) when present: rebuilds of a
# fresh clone's flavours share the objects they have in common, with this clone's and other
# clones' earlier builds.
# Both launchers are set every time, so that a folder once built with SIMPLER_BUILD_LAUNCHER
# forgets it.
compile_launcher="" link_launcher=""
if [ -n "${SIMPLER_BUILD_LAUNCHER:-}" ]; then
  compile_launcher="$SIMPLER_BUILD_LAUNCHER" link_launcher="$SIMPLER_BUILD_LAUNCHER"
elif command -v ccache >/dev/null 2>&1; then
  compile_launcher=ccache
  # Objects are shared between clones at other paths (a fresh clone, a git worktree): ccache
  # hashes paths under the clone relative to the build folder and leaves out the working
  # directory. (The clang flavours' precompiled headers still tie their objects to one path.)
  export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$PWD}" CCACHE_NOHASHDIR="${CCACHE_NOHASHDIR:-1}"
  # The clang flavours' precompiled headers: ccache caches the objects built with them only with
  # this sloppiness (its manual, "Precompiled headers").
  export CCACHE_SLOPPINESS="${CCACHE_SLOPPINESS:-pch_defines,time_macros,include_file_mtime,include_file_ctime}"
fi
flags+=(-DCMAKE_CXX_COMPILER_LAUNCHER="$compile_launcher"
        -DCMAKE_CXX_LINKER_LAUNCHER="$link_launcher")
# A build folder configured with another compiler (the sanitizer flavours were g++ builds until
# 2026-12-03) cannot be reconfigured in place: start it afresh.
cache="$dir/CMakeCache.txt"
if [ -f "$cache" ] && [[ " ${flags[*]} " == *" -DCMAKE_CXX_COMPILER=clang++ "* ]] &&
  ! grep -q '^CMAKE_CXX_COMPILER:.*clang++' "$cache"; then
  echo "build.sh: $dir was configured with another compiler; rebuilding it afresh" >&2
  rm -rf "$dir"
fi
flags+=(-DSIMPLER_UNITY_BUILD="${SIMPLER_UNITY_BUILD:-ON}")
cmake -S . -B "$dir" -G Ninja "${flags[@]}" >/dev/null
cmake --build "$dir" -j "$jobs" "$@"
