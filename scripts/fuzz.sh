#!/usr/bin/env bash
# Builds the libFuzzer targets (scripts/build.sh asan --target fuzzers: they share the asan
# flavour's build, in build/asan/fuzz/) and runs them.
#
#   scripts/fuzz.sh replay [TARGET...]
#       What scripts/test.sh runs. For each target: every seed-corpus file and every saved crash
#       (src/<layer>/fuzz/<target>/{corpus,crashes}/) once, then a deterministic run from the
#       seeds with -seed=1 -runs=N (N per target below, each capped at 20 s — 60 s for the
#       mailbox targets, which are asked to run that long), two targets at a time on a machine
#       with two or more CPUs (SIMPLER_FUZZ_JOBS sets it): 2.5 minutes in all on 2 vCPUs, not
#       counting the build. Fails when any input crashes, a saved crash still reproduces, the
#       deterministic run finds a crash, or the whole replay overruns its 6 minutes.
#   scripts/fuzz.sh time [SECONDS] [TARGET...]
#       Fuzzes each target for SECONDS (default 300) with -max_total_time, in fork mode so that it
#       goes on past a crash; the growing corpus is kept in build/asan/fuzz/corpus/<target>/ and
#       crashes go to build/asan/fuzz/artifacts/<target>/. Fails when a target found any.
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
  [gguf_fuzz]=60000
  [tokenizer_load_fuzz]=8000
  [tokenizer_encode_fuzz]=5000
  [openai_protocol_fuzz]=60000
  [grammar_fuzz]=2500
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
readonly BIN=build/asan/fuzz

scripts/build.sh asan --target fuzzers >&2 || { echo "fuzz.sh: build failed" >&2; exit 1; }

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

# One target's replay: its seeds, its saved crashes, then the deterministic run. Prints what it
# found to stderr and each failure, one word a line, to stdout.
replay_one() {
  local t="$1" dir dict=() runs work artifacts cap t0 t1 rc execs
  dir="$(data_dir "$t")"
  for d in "$dir"/*.dict; do [ -f "$d" ] && dict=(-dict="$d"); done
  echo "== $t: replay $(ls "$dir/corpus" | wc -l) seeds" >&2
  if ! "$BIN/$t" "${common_flags[@]}" "$dir"/corpus/* >"$BIN/$t.replay.log" 2>&1; then
    tail -n 30 "$BIN/$t.replay.log" >&2
    echo "$t:seeds"
  fi
  if [ -d "$dir/crashes" ]; then
    for c in "$dir"/crashes/*; do
      [ -f "$c" ] || continue
      if ! "$BIN/$t" "${common_flags[@]}" "$c" >"$BIN/$t.crash.log" 2>&1; then
        echo "fuzz.sh: $t: saved crash still reproduces: $c" >&2
        grep -E "ERROR: |runtime error|violated|SUMMARY" "$BIN/$t.crash.log" | head -n 3 >&2
        echo "$t:$(basename "$c")"
      fi
    done
  fi
  runs="${RUNS[$t]:-10000}"
  work="$(mktemp -d)"
  artifacts="$BIN/artifacts/$t"
  mkdir -p "$artifacts"
  cap="${CAP_S[$t]:-$PER_TARGET_CAP_S}"
  t0=$(date +%s%N)
  "${no_aslr[@]}" "$BIN/$t" "${common_flags[@]}" "${dict[@]}" -seed=1 -runs="$runs" -reload=0 \
    -max_total_time="$cap" -artifact_prefix="$artifacts/" \
    "$work" "$dir/corpus" >"$BIN/$t.run.log" 2>&1
  rc=$?
  t1=$(date +%s%N)
  execs="$(grep -E 'stat::number_of_executed_units' "$BIN/$t.run.log" | awk '{print $2}')"
  printf 'fuzz.sh: %s: -seed=1: %s executions in %d.%d s (asked %s, cap %s s)%s\n' "$t" \
    "${execs:-?}" $(((t1 - t0) / 1000000000)) $(((t1 - t0) / 100000000 % 10)) "$runs" "$cap" \
    "$([ $rc -eq 0 ] && [ "${execs:-0}" -lt "$runs" ] 2>/dev/null &&
      echo ', stopped by the time cap')" >&2
  rm -rf "$work"
  if [ $rc -ne 0 ]; then
    grep -E "ERROR: |runtime error|violated|SUMMARY|Test unit written" \
      "$BIN/$t.run.log" | head -n 5 >&2
    echo "fuzz.sh: $t found a crash; keep it with: cp $artifacts/crash-* $dir/crashes/<what-it-is>" >&2
    echo "$t:run"
  fi
}

# One target's fuzzing by time, in fork mode (it keeps fuzzing past a crash, so one run collects
# every crash it finds).
time_one() {
  local t="$1" dir dict=() corpus artifacts stamp found
  dir="$(data_dir "$t")"
  for d in "$dir"/*.dict; do [ -f "$d" ] && dict=(-dict="$d"); done
  corpus="$BIN/corpus/$t"
  artifacts="$BIN/artifacts/$t"
  mkdir -p "$corpus" "$artifacts"
  stamp="$(mktemp)"
  echo "== $t: fuzzing for $seconds s (corpus $corpus, crashes $artifacts)" >&2
  "$BIN/$t" "${common_flags[@]}" "${dict[@]}" -max_total_time="$seconds" -fork=1 \
    -ignore_crashes=1 -ignore_timeouts=1 -ignore_ooms=1 -artifact_prefix="$artifacts/" \
    "$corpus" "$dir/corpus" >"$BIN/$t.time.log" 2>&1
  found="$(find "$artifacts" -type f -newer "$stamp" | wc -l)"
  rm -f "$stamp"
  echo "fuzz.sh: $t: $(grep -oE '^#[0-9]+' "$BIN/$t.time.log" | tail -n 1 | tr -d '#')" \
    "executions, $found new crash/timeout/oom inputs" >&2
  if [ "$found" -gt 0 ]; then
    echo "fuzz.sh: $t found crashes; keep each with: cp $artifacts/<file> $dir/crashes/<what-it-is>" >&2
    echo "$t"
  fi
}

case "$mode" in
  replay) run_one=replay_one ;;
  time) run_one=time_one ;;
  *) echo "fuzz.sh: unknown mode '$mode' (replay|time)" >&2; exit 2 ;;
esac
# Replay runs SIMPLER_FUZZ_JOBS targets at a time (default: 2 where there are 2+ CPUs), the two
# long mailbox targets first so they overlap the short ones; fuzzing by time runs one at a time.
jobs=1
if [ "$mode" = replay ]; then
  jobs="${SIMPLER_FUZZ_JOBS:-$(( $(nproc) >= 2 ? 2 : 1 ))}"
  ordered=()
  for t in "${targets[@]}"; do [ -n "${CAP_S[$t]:-}" ] && ordered+=("$t"); done
  for t in "${targets[@]}"; do [ -z "${CAP_S[$t]:-}" ] && ordered+=("$t"); done
  targets=("${ordered[@]}")
fi
results="$(mktemp -d)"
for t in "${targets[@]}"; do
  if [ ! -x "$BIN/$t" ] || [ -z "$(data_dir "$t")" ]; then
    echo "fuzz.sh: unknown target '$t'" >&2
    failed+=("$t:unknown")
    continue
  fi
  while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n; done
  "$run_one" "$t" >"$results/$t" &
done
wait
for t in "${targets[@]}"; do
  [ -f "$results/$t" ] && while read -r f; do failed+=("$f"); done <"$results/$t"
done
rm -rf "$results"

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
