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
aarch64-linux-gnu-g++ -std=c++20 -O2 -static -Wall -Wextra -Werror -I include -I src \
  -I "$out/include" src/kernels/matmul_portable.cc src/kernels/matmul_neon.cc \
  src/kernels/matmul_int8.cc src/kernels/matmul_int8_neon.cc \
  tests/cross/matmul_cross_test.cc -o "$out/matmul_cross_test"
timeout 180 qemu-aarch64 "$out/matmul_cross_test"
# The int8 path's sdot (the dot-product extension in the baseline; qemu's default CPU has it).
aarch64-linux-gnu-g++ -std=c++20 -O2 -static -Wall -Wextra -Werror -march=armv8.2-a+dotprod \
  -I include -I src -I "$out/include" -DSIMPLER_CROSS_INT8_ONLY src/kernels/matmul_portable.cc \
  src/kernels/matmul_neon.cc src/kernels/matmul_int8.cc src/kernels/matmul_int8_neon.cc \
  tests/cross/matmul_cross_test.cc -o "$out/matmul_cross_test_dotprod"
timeout 180 qemu-aarch64 "$out/matmul_cross_test_dotprod"
# The kernels' dispatch (KernelIsa::kNeon, the attention tile, the x86 parts left out) compiles
# for aarch64 as a native build would compile it; linking it needs the target's abseil.
aarch64-linux-gnu-g++ -std=c++20 -O2 -Wall -Wextra -Werror -fsyntax-only -I include -I src \
  -I "$out/include" src/kernels/kernels.cc src/kernels/matmul_benchmark.cc
echo "test_neon.sh: kernels.cc and matmul_benchmark.cc compile for aarch64"
