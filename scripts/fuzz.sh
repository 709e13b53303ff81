#!/usr/bin/env bash
# Builds the libFuzzer targets (scripts/build.sh fuzz --target fuzzers) and runs them.
#
#   scripts/fuzz.sh replay [TARGET...]
#       What scripts/test.sh runs. For each target: every seed-corpus file and every saved crash
#       (src/<layer>/fuzz/<target>/{corpus,crashes}/) once, then a deterministic run from the
#       seeds with -seed=1 -runs=N (N per target below, each capped at 20 s — 60 s for the
#       mailbox targets, which run that long; 5 minutes in all,
#       not counting the build). Fails when any input crashes, a saved crash still reproduces,
#       the deterministic run finds a crash, or the whole replay overruns its 6 minutes.
#   scripts/fuzz.sh time [SECONDS] [TARGET...]
#       Fuzzes each target for SECONDS (default 300) with -max_total_time, in fork mode so that it
#       goes on past a crash; the growing corpus is kept in build/fuzz/corpus/<target>/ and
#       crashes go to build/fuzz/artifacts/<target>/. Fails when a target found any.
#
# New inputs never land in the repository; a crash found is printed with the command that
# saves it as a regression input (docs/fuzzing.md).
set -uo pipefail
cd "$(dirname "$0")/.."

mode="${1:-replay}"
shift || true

# Deterministic executions per target in replay mode: about 10 s each on 2 busy vCPUs
# (60-70 s in all); a slower machine stops at the 20 s cap.
declare -A RUNS=(
  [fault_plan_fuzz]=300000
  [prompts_file_fuzz]=150000
  [model_config_fuzz]=100000
  [safetensors_fuzz]=80000
  [model_weights_index_fuzz]=50000
  [tokenizer_load_fuzz]=8000
  [tokenizer_encode_fuzz]=5000
  [openai_protocol_fuzz]=60000
  [mailbox_frame_fuzz]=100000000
  [mailbox_entry_fuzz]=100000000
  [mailbox_control_fuzz]=200000
)
readonly PER_TARGET_CAP_S=20
# Targets that run for longer in replay mode (seconds: 60 s for the mailbox's).
declare -A CAP_S=(
  [mailbox_frame_fuzz]=60
  [mailbox_entry_fuzz]=60
)
readonly BIN=build/fuzz/fuzz

scripts/build.sh fuzz --target fuzzers >&2 || { echo "fuzz.sh: build failed" >&2; exit 1; }

# The directory holding a target's corpus/, crashes/ and *.dict.
data_dir() { ls -d src/*/fuzz/"$1" 2>/dev/null | head -n 1; }

targets=()
if [ "$mode" = "time" ] && [ $# -gt 0 ] && [[ "$1" =~ ^[0-9]+$ ]]; then
  seconds="$1"
  shift
else
  seconds=300
fi
if [ $# -gt 0 ]; then
  targets=("$@")
else
  for b in "$BIN"/*_fuzz; do targets+=("$(basename "$b")"); done
fi

common_flags=(-timeout=10 -rss_limit_mb=2048 -print_final_stats=1)
# Deterministic runs need a fixed address layout (absl's hash seeds and compared pointers follow
# ASLR) and no periodic corpus reload (-reload=0); setarch -R turns ASLR off where allowed.
no_aslr=()
if setarch "$(uname -m)" -R true 2>/dev/null; then
  no_aslr=(setarch "$(uname -m)" -R)
elif [ "$mode" = replay ]; then
  echo "fuzz.sh: cannot turn ASLR off (setarch -R); the -seed=1 runs may differ between runs" >&2
fi
failed=()
start=$(date +%s)

for t in "${targets[@]}"; do
  dir="$(data_dir "$t")"
  if [ ! -x "$BIN/$t" ] || [ -z "$dir" ]; then
    echo "fuzz.sh: unknown target '$t'" >&2
    failed+=("$t:unknown")
    continue
  fi
  dict=()
  for d in "$dir"/*.dict; do [ -f "$d" ] && dict=(-dict="$d"); done
  case "$mode" in
    replay)
      echo "== $t: replay $(ls "$dir/corpus" | wc -l) seeds" >&2
      if ! "$BIN/$t" "${common_flags[@]}" "$dir"/corpus/* >"build/fuzz/$t.replay.log" 2>&1; then
        tail -n 30 "build/fuzz/$t.replay.log" >&2
        failed+=("$t:seeds")
      fi
      if [ -d "$dir/crashes" ]; then
        for c in "$dir"/crashes/*; do
          [ -f "$c" ] || continue
          if ! "$BIN/$t" "${common_flags[@]}" "$c" >"build/fuzz/$t.crash.log" 2>&1; then
            echo "fuzz.sh: $t: saved crash still reproduces: $c" >&2
            grep -E "ERROR: |runtime error|violated|SUMMARY" "build/fuzz/$t.crash.log" | head -n 3 >&2
            failed+=("$t:$(basename "$c")")
          fi
        done
      fi
      runs="${RUNS[$t]:-10000}"
      work="$(mktemp -d)"
      artifacts="build/fuzz/artifacts/$t"
      mkdir -p "$artifacts"
      cap="${CAP_S[$t]:-$PER_TARGET_CAP_S}"
      echo "== $t: -seed=1 -runs=$runs (cap ${cap} s)" >&2
      t0=$(date +%s%N)
      "${no_aslr[@]}" "$BIN/$t" "${common_flags[@]}" "${dict[@]}" -seed=1 -runs="$runs" -reload=0 \
        -max_total_time="$cap" -artifact_prefix="$artifacts/" \
        "$work" "$dir/corpus" >"build/fuzz/$t.run.log" 2>&1
      rc=$?
      t1=$(date +%s%N)
      execs="$(grep -E 'stat::number_of_executed_units' "build/fuzz/$t.run.log" | awk '{print $2}')"
      printf 'fuzz.sh: %s: %s executions in %d.%d s (asked %s)%s\n' "$t" "${execs:-?}" \
        $(((t1 - t0) / 1000000000)) $(((t1 - t0) / 100000000 % 10)) "$runs" \
        "$([ $rc -eq 0 ] && [ "${execs:-0}" -lt "$runs" ] 2>/dev/null &&
          echo ', stopped by the time cap')" >&2
      rm -rf "$work"
      if [ $rc -ne 0 ]; then
        grep -E "ERROR: |runtime error|violated|SUMMARY|Test unit written" \
          "build/fuzz/$t.run.log" | head -n 5 >&2
        echo "fuzz.sh: $t found a crash; keep it with: cp $artifacts/crash-* $dir/crashes/<what-it-is>" >&2
        failed+=("$t:run")
      fi
      ;;
    time)
      # Fork mode keeps fuzzing past a crash, so one run collects every crash it finds.
      corpus="build/fuzz/corpus/$t"
      artifacts="build/fuzz/artifacts/$t"
      mkdir -p "$corpus" "$artifacts"
      stamp="$(mktemp)"
      echo "== $t: fuzzing for $seconds s (corpus $corpus, crashes $artifacts)" >&2
      "$BIN/$t" "${common_flags[@]}" "${dict[@]}" -max_total_time="$seconds" -fork=1 \
        -ignore_crashes=1 -ignore_timeouts=1 -ignore_ooms=1 -artifact_prefix="$artifacts/" \
        "$corpus" "$dir/corpus" >"build/fuzz/$t.time.log" 2>&1
      found="$(find "$artifacts" -type f -newer "$stamp" | wc -l)"
      rm -f "$stamp"
      echo "fuzz.sh: $t: $(grep -oE '^#[0-9]+' "build/fuzz/$t.time.log" | tail -n 1 | tr -d '#')" \
        "executions, $found new crash/timeout/oom inputs" >&2
      if [ "$found" -gt 0 ]; then
        echo "fuzz.sh: $t found crashes; keep each with: cp $artifacts/<file> $dir/crashes/<what-it-is>" >&2
        failed+=("$t")
      fi
      ;;
    *)
      echo "fuzz.sh: unknown mode '$mode' (replay|time)" >&2
      exit 2
      ;;
  esac
done

elapsed=$(($(date +%s) - start))
if [ "$mode" = replay ] && [ "$elapsed" -gt 360 ]; then
  echo "fuzz.sh: replay took ${elapsed} s, over its 6-minute budget (lower RUNS or a CAP_S)" >&2
  failed+=("over-budget")
fi
if [ ${#failed[@]} -gt 0 ]; then
  echo "fuzz.sh: $mode FAILED after ${elapsed} s: ${failed[*]}" >&2
  exit 1
fi
echo "fuzz.sh: $mode passed in ${elapsed} s" >&2
