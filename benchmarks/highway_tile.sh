#!/usr/bin/env bash
# The x86-64-v3 matmul path against the same algorithm on Google Highway, one thread, three
# qwen3-0.6b projection shapes with 64 x rows: prints GFLOP/s of each (docs/design/
# kernel_targets.md, "Why our own traits, not Highway"). Needs an x86 CPU with AVX2, FMA and F16C,
# and Debian's libhwy-dev (scripts/install_deps.sh --bench). Builds into build/highway_tile/.
set -euo pipefail
cd "$(dirname "$0")/.."
out=build/highway_tile
mkdir -p "$out"
flags=(-O2 -DNDEBUG -std=c++20 -Isrc -Iinclude -isystem /usr/include/eigen3)
c++ "${flags[@]}" -mavx2 -mfma -mf16c -c src/kernels/matmul_x86_64_v3.cc -o "$out/v3.o"
c++ "${flags[@]}" -c src/kernels/matmul_portable.cc -o "$out/portable.o"
# Highway 1.0.3 picks its static AVX2 target only when the flags name AES and PCLMUL too.
c++ "${flags[@]}" -march=haswell -maes -mtune=generic -c benchmarks/highway_tile.cc -o "$out/hwy.o"
c++ "${flags[@]}" benchmarks/highway_tile_main.cc "$out/v3.o" "$out/portable.o" "$out/hwy.o" \
  -o "$out/highway_tile"
for shape in "64 1024 3024" "64 3072 1008" "64 2048 1008"; do
  # shellcheck disable=SC2086
  "$out/highway_tile" $shape
done
