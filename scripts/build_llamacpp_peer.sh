#!/usr/bin/env bash
# Builds llama.cpp's llama-bench and llama-batched-bench, the peer of `simpler bench decode|prefill
# --compare llama.cpp`, into build/peers/llama.cpp/ (run by `scripts/install_deps.sh --bench`;
# idempotent). Everything comes from npm: the package node-llama-cpp holds llama.cpp's source as
# a git bundle, @node-llama-cpp/linux-x64 the matching prebuilt libraries (libllama,
# libllama-common, libggml-base and one libggml-cpu per x86 CPU variant, which ggml picks at run
# time from the executable's folder). Only the two tools are compiled, against those libraries
# (about half a minute on 2 vCPUs). Three folders of the same tools:
#   bin/            every CPU variant (ggml takes the best this CPU runs)
#   bin-x86-64-v3/  only the haswell variant (AVX2 + FMA + F16C): the peer of --kernel-isa x86-64-v3
#   bin-portable/   only the x64 baseline variant: the peer of --kernel-isa portable
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=3.22.1
out=build/peers/llama.cpp
if [ -x "$out/bin/llama-bench" ] && [ -f "$out/.version" ] && [ "$(cat "$out/.version")" = "$VERSION" ]; then
  echo "build_llamacpp_peer: llama.cpp peer $VERSION present in $out" >&2
  exit 0
fi
case "$(uname -m)" in
  x86_64) ;;
  *) echo "build_llamacpp_peer: the prebuilt llama.cpp libraries are x86-64 only here" >&2; exit 1 ;;
esac
rm -rf "$out"
mkdir -p "$out/npm"
( cd "$out/npm" && npm pack --silent "node-llama-cpp@$VERSION" "@node-llama-cpp/linux-x64@$VERSION" >/dev/null )
mkdir -p "$out/pkg" "$out/libs"
tar xzf "$out/npm/node-llama-cpp-$VERSION.tgz" -C "$out/pkg" package/llama/gitRelease.bundle
tar xzf "$out/npm/node-llama-cpp-linux-x64-$VERSION.tgz" -C "$out/libs" --strip-components=3 \
  package/bins/linux-x64
git clone -q "$out/pkg/package/llama/gitRelease.bundle" "$out/src" 2>/dev/null
src="$out/src"
libs=(-l:libllama-common.so -l:libllama.v0.5.0.so -l:libggml.v0.5.0.so -l:libggml-base.so)
for tool in llama-bench batched-bench; do
  name=$tool
  [ "$tool" = batched-bench ] && name=llama-batched-bench
  g++ -O2 -DNDEBUG -w -std=c++17 -I "$src/include" -I "$src/ggml/include" -I "$src/common" \
    -I "$src/vendor" "$src/tools/$tool/$tool.cpp" "$src/tools/$tool/main.cpp" \
    -L "$out/libs" "${libs[@]}" -Wl,-rpath,'$ORIGIN' -pthread -o "$out/libs/$name" &
done
wait
[ -x "$out/libs/llama-bench" ] && [ -x "$out/libs/llama-batched-bench" ]
# One folder per CPU-variant set: the tools copied (ggml looks for its CPU variants beside the
# executable's resolved path), the shared libraries and the variants as links.
for dir in bin bin-x86-64-v3 bin-portable; do
  mkdir -p "$out/$dir"
  cp "$out/libs/llama-bench" "$out/libs/llama-batched-bench" "$out/$dir/"
  for f in libllama-common.so libllama.v0.5.0.so libggml.v0.5.0.so libggml-base.so; do
    ln -sf "../libs/$f" "$out/$dir/$f"
  done
done
for f in "$out"/libs/libggml-cpu-*.so; do ln -sf "../libs/$(basename "$f")" "$out/bin/"; done
ln -sf ../libs/libggml-cpu-haswell.so "$out/bin-x86-64-v3/"
ln -sf ../libs/libggml-cpu-x64.so "$out/bin-portable/"
rm -rf "$out/npm" "$out/pkg"
echo "$VERSION" > "$out/.version"
echo "build_llamacpp_peer: llama.cpp peer $VERSION built in $out" >&2
