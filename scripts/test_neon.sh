#!/usr/bin/env bash
# Cross-builds the matmul kernels for aarch64 (NEON and the portable path; g++-aarch64-linux-gnu,
# statically linked) with tests/cross/matmul_cross_test.cc and runs them under qemu-user
# (qemu-aarch64), then compiles the kernels' dispatch (kernels.cc) for aarch64. Kernels only:
# the rest of simpler needs the target's libraries. Part of scripts/test.sh; about a minute on
# 2 vCPUs.
set -euo pipefail
cd "$(dirname "$0")/.."
out=build/cross-aarch64
mkdir -p "$out/include"
# Only the header-only libraries the kernels include, not the host's whole /usr/include.
ln -sfn /usr/include/absl "$out/include/absl"
ln -sfn /usr/include/eigen3/Eigen "$out/include/Eigen"
# Each source is compiled on its own (both CPUs, and through ccache where it is installed, as
# scripts/build.sh does), then linked statically.
cxx=(aarch64-linux-gnu-g++)
if command -v ccache >/dev/null 2>&1 && [ -z "${CCACHE_DISABLE:-}" ]; then
  cxx=(ccache aarch64-linux-gnu-g++)
  export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$PWD}" CCACHE_NOHASHDIR="${CCACHE_NOHASHDIR:-1}"
fi
sources=(src/kernels/matmul_portable.cc src/kernels/matmul_neon.cc src/kernels/matmul_int8.cc
  src/kernels/matmul_int8_neon.cc src/task/data_layout.cc tests/cross/matmul_cross_test.cc)
# cross_build NAME FLAGS...: builds $out/NAME from the sources with FLAGS.
cross_build() {
  local name="$1" pids=() objs=() src obj rc=0
  shift
  mkdir -p "$out/$name.o"
  for src in "${sources[@]}"; do
    obj="$out/$name.o/$(basename "$src" .cc).o"
    objs+=("$obj")
    "${cxx[@]}" -std=c++20 -O2 -Wall -Wextra -Werror -I include -I src -I "$out/include" "$@" \
      -c "$src" -o "$obj" &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
  [ $rc = 0 ] && aarch64-linux-gnu-g++ -static "${objs[@]}" -o "$out/$name"
}
cross_build matmul_cross_test
timeout 180 qemu-aarch64 "$out/matmul_cross_test"
# The int8 path's sdot (the dot-product extension in the baseline; qemu's default CPU has it).
cross_build matmul_cross_test_dotprod -march=armv8.2-a+dotprod -DSIMPLER_CROSS_INT8_ONLY
timeout 180 qemu-aarch64 "$out/matmul_cross_test_dotprod"
# The kernels' dispatch (KernelIsa::kNeon, the attention tile, the x86 parts left out) compiles
# for aarch64 as a native build would compile it; linking it needs the target's abseil.
aarch64-linux-gnu-g++ -std=c++20 -O2 -Wall -Wextra -Werror -fsyntax-only -I include -I src \
  -I "$out/include" src/kernels/kernels.cc src/kernels/matmul_benchmark.cc
echo "test_neon.sh: kernels.cc and matmul_benchmark.cc compile for aarch64"
