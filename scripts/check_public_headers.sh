#!/usr/bin/env bash
# Checks that include/ is the public API alone:
#   1. no public header #includes a quoted path that resolves under src/ (a private header);
#   2. every header under include/ compiles on its own with only include/ and the system include
#      directories on the path (c++ -std=c++20 -fsyntax-only -Iinclude -x c++ HEADER).
# Prints one line per offence naming the header and the offending include; exits 1 on any.
# Usage: scripts/check_public_headers.sh [HEADER...]   (default: every header under include/)
# Environment: CXX (default c++), SIMPLER_CHECK_JOBS (default: the CPU count),
# SIMPLER_CHECK_CACHE_DIR (default: check_public_headers under the user's cache directory,
# $XDG_CACHE_HOME or ~/.cache, beside ccache's; empty = no cache). A header that compiled is not
# compiled again while it and every file it included (its dependency list, kept in the cache)
# have the same contents (SHA-256), with the same compiler and flags: as with ccache, a fresh
# clone or another worktree of the same sources reuses the passes of the earlier ones. An entry
# is named by the header's path and contents, so clones at other versions keep their own.
# Registered as the ctest test `check_public_headers` (label unit).
set -uo pipefail
cd "$(dirname "$0")/.."
root="$PWD"
cxx="${CXX:-c++}"
jobs="${SIMPLER_CHECK_JOBS:-$(nproc)}"

if [[ $# -gt 0 ]]; then
  headers=("$@")
else
  mapfile -t headers < <(find include -type f \( -name '*.h' -o -name '*.hpp' \) | sort)
fi
if [[ ${#headers[@]} -eq 0 ]]; then
  echo "check_public_headers: no headers under include/" >&2
  exit 1
fi

# System packages whose headers are not in the default search path (Debian puts absl, nlohmann,
# spdlog and fmt in /usr/include); spdlog's defines say it is built against the external fmt.
extra_flags=()
if command -v pkg-config >/dev/null 2>&1; then
  for pkg in spdlog; do
    if pkg-config --exists "$pkg"; then
      read -r -a flags <<<"$(pkg-config --cflags "$pkg")"
      extra_flags+=("${flags[@]}")
    fi
  done
fi

failed=0

# 1. Quoted includes that resolve under src/: beside the header (relative), or through src/ as an
# include root (the path exists under src/ and not under include/).
for hdr in "${headers[@]}"; do
  dir="$(dirname "$hdr")"
  while IFS= read -r line; do
    lineno="${line%%:*}"
    path="$(sed -E 's/^[0-9]+:[[:space:]]*#[[:space:]]*include[[:space:]]*"([^"]+)".*/\1/' <<<"$line")"
    resolved=""
    if [[ -f "$dir/$path" ]]; then
      resolved="$(realpath -m "$dir/$path")"
    elif [[ -f "include/$path" ]]; then
      resolved="$root/include/$path"
    elif [[ -f "src/$path" ]]; then
      resolved="$root/src/$path"
    fi
    if [[ "$resolved" == "$root/src/"* ]]; then
      echo "check_public_headers: $hdr:$lineno includes \"$path\", a private header" \
        "(${resolved#"$root"/}); a public header may include only include/ and system headers" >&2
      failed=1
    fi
  done < <(grep -nE '^[[:space:]]*#[[:space:]]*include[[:space:]]*"' "$hdr")
done

# 2. Each header on its own, in parallel; a failure prints the compiler's first error lines
# (they name the include it could not find or the declaration it lacks).
user_cache="${XDG_CACHE_HOME:-${HOME:+$HOME/.cache}}"
cache="${SIMPLER_CHECK_CACHE_DIR-${user_cache:+$user_cache/simpler/check_public_headers}}"
# No cache where there is no user cache directory or it cannot be made: every header compiles.
if [[ -n "$cache" ]] && ! mkdir -p "$cache" 2>/dev/null; then cache=""; fi
export cxx cache
export extra_flags_joined="${extra_flags[*]:-}"
export compiler_id
compiler_id="$("$cxx" --version 2>/dev/null | head -n 1) $(command -v "$cxx") $extra_flags_joined"
# The key of a header's last pass: the compiler and flags, and the name and contents of every
# file its dependency list names (itself first; the project's headers by their path under the
# clone, the system's by their absolute path).
deps_key() {
  local depfile="$1"
  { echo "$compiler_id"
    sed -e 's/^[^:]*://' -e 's/\\$//' "$depfile" | tr -s ' ' '\n' | sed '/^$/d' |
      xargs -r sha256sum 2>&1
  } | sha256sum | cut -d' ' -f1
}
export -f deps_key
compile_one() {
  local hdr="$1" out stem="" key
  if [[ -n "$cache" ]]; then
    stem="$cache/$(tr '/' '_' <<<"$hdr")-$(sha256sum "$hdr" | cut -c1-16)"
  fi
  if [[ -n "$stem" && -f "$stem.d" && -f "$stem.ok" ]] &&
    [[ "$(deps_key "$stem.d")" == "$(cat "$stem.ok")" ]]; then
    return 0
  fi
  # The dependency list is written beside its final name and moved there once the key is, so
  # that a check running at the same time in another clone never reads half of either.
  local dep_flags=()
  [[ -n "$stem" ]] && dep_flags=(-MD -MF "$stem.d.$$")
  # shellcheck disable=SC2086  # the pkg-config flags split on spaces
  if ! out="$("$cxx" -std=c++20 -fsyntax-only -Iinclude $extra_flags_joined "${dep_flags[@]}" \
    -x c++ "$hdr" 2>&1)"; then
    [[ -n "$stem" ]] && rm -f "$stem.d.$$"
    # One write, so that the messages of parallel compiles do not interleave.
    printf '%s\n%s\n' \
      "check_public_headers: $hdr does not compile on its own with only include/ and system headers:" \
      "$(grep -m 5 -E 'error|fatal' <<<"$out" | sed 's/^/    /')" >&2
    return 1
  fi
  if [[ -n "$stem" ]]; then
    key="$(deps_key "$stem.d.$$")"
    mv -f "$stem.d.$$" "$stem.d"
    echo "$key" >"$stem.ok.$$" && mv -f "$stem.ok.$$" "$stem.ok"
  fi
}
export -f compile_one
if ! printf '%s\0' "${headers[@]}" | xargs -0 -n 1 -P "$jobs" bash -c 'compile_one "$1"' _; then
  failed=1
fi

if [[ $failed -ne 0 ]]; then
  echo "check_public_headers: FAILED (see the lines above)" >&2
  exit 1
fi
echo "check_public_headers: ${#headers[@]} public headers compile on their own and include no" \
  "private header"
