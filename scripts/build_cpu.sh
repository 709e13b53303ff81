#!/usr/bin/env bash
# Where the CPU time of a build from empty goes: builds one flavour (scripts/build.sh) with ccache
# off into an empty folder, each compiler and linker call timed (scripts/time_build_call.sh),
# then prints the CPU seconds (user + system) of the whole build, of its compiler calls, of its
# links, and the slowest calls. CPU time, not wall time, so that it holds on a machine shared with
# other builds.
#   scripts/build_cpu.sh FLAVOUR [--top N] [cmake --build args, e.g. --target concurrency_tests]
# The folder is build/cpu-FLAVOUR (SIMPLER_BUILD_DIR overrides it); it is emptied first. The
# calls' log stays there: cpu.log, "<user s> <system s> <wall s> <output>" a line.
set -euo pipefail
cd "$(dirname "$0")/.."
flavour="${1:?usage: scripts/build_cpu.sh release|asan|tsan [--top N] [cmake --build args]}"
shift
top=15
if [ "${1:-}" = "--top" ]; then
  top="${2:?--top needs a count}"
  shift 2
fi
dir="${SIMPLER_BUILD_DIR:-build/cpu-$flavour}"
rm -rf "$dir"
mkdir -p "$dir"
dir="$(cd "$dir" && pwd)"
log="$dir/cpu.log"
: >"$log"
CCACHE_DISABLE=1 SIMPLER_BUILD_DIR="$dir" SIMPLER_CPU_LOG="$log" \
  SIMPLER_BUILD_LAUNCHER="$PWD/scripts/time_build_call.sh" \
  /usr/bin/time -f "%U %S %e" -o "$dir/cpu_total.txt" scripts/build.sh "$flavour" "$@"
read -r user sys wall <"$dir/cpu_total.txt"
# A call whose output ends in .o, .pch or .gch compiles; any other links.
awk -v user="$user" -v sys="$sys" -v wall="$wall" '
  { cpu = $1 + $2
    if ($4 ~ /\.(o|pch|gch)$/) { nc++; c += cpu } else { nl++; l += cpu } }
  END {
    printf "build.sh: %.1f CPU-s (user %.1f, system %.1f), %.0f s wall\n", user + sys, user, sys, wall
    printf "compiles: %d, %.1f CPU-s; links: %d, %.1f CPU-s; the rest (configure, archives): %.1f CPU-s\n",
      nc, c, nl, l, user + sys - c - l
  }' "$log"
echo "slowest $top calls (CPU-s, output):"
awk -v dir="$dir/" '{ out = $4; sub("^" dir, "", out); printf "%8.1f  %s\n", $1 + $2, out }' "$log" |
  sort -rn | head -n "$top"
