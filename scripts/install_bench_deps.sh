#!/usr/bin/env bash
# Installs the peers the benchmarks compare against (not needed to build or test): Debian's
# PyTorch for `bench decode|prefill --compare torch`, OpenBLAS as the system BLAS (Debian's
# python3-torch runs its matmuls through it; the reference BLAS it falls back to is several
# times slower and single-threaded), and StarPU for the dispatch comparison. Idempotent.
set -euo pipefail
PACKAGES=(python3-torch libopenblas0-pthread libstarpu-dev)
SUDO=""
if [ "$(id -u)" != "0" ]; then SUDO="sudo"; fi
missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "install_bench_deps: installing ${missing[*]}" >&2
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >&2
else
  echo "install_bench_deps: all benchmark peers present" >&2
fi
