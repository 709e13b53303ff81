#!/usr/bin/env bash
# Model-checks the mailbox with SPIN: the frame / entry hand-off (mailbox.pml: no request served
# twice or lost, no action on a stale generation, no deadlock) and grant changes while runs go on
# (mailbox_regrant.pml: the child never sees an entry outside its table, no run lost or served
# twice, both sides end on the same table) and the completion wake-up while a parent thread polls
# (mailbox_wake.pml: no terminal state left uncollected with the collector asleep). Each model
# must verify with no error, and each of its mutants — the ACK not the child's last store to a
# frame, a stale generation accepted; the parent committing a grant before the child adopted it,
# a shrink not lowering the claim limit; the polling flag cleared without a collect after it, a
# collect before the clear, the collector reading the doorbell after collecting — must make SPIN
# report a violation, so this check can fail. Needs `spin` and a C compiler.
# Usage: tests/protocol/check_mailbox_model.sh [WORK_DIR [MODEL]] — MODEL (mailbox.pml,
# mailbox_regrant.pml or mailbox_wake.pml) checks that model and its mutants alone, in WORK_DIR/<MODEL without .pml>.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
work="${1:-$(mktemp -d)}"
only="${2:-}"
case "$only" in
  "" | mailbox.pml | mailbox_regrant.pml | mailbox_wake.pml) ;;
  *) echo "check_mailbox_model: unknown model '$only' (mailbox.pml, mailbox_regrant.pml, mailbox_wake.pml)" >&2; exit 2 ;;
esac
[ -n "$only" ] && work="$work/${only%.pml}"
mkdir -p "$work"
cd "$work"
cp "$here/mailbox.pml" "$here/mailbox_regrant.pml" "$here/mailbox_wake.pml" .
command -v spin >/dev/null || { echo "check_mailbox_model: spin not found (apt-get install spin)" >&2; exit 1; }

verify() {  # verify MODEL LABEL [-DMUTANT]; prints pan's summary line, returns pan's error count
  local model="$1" label="$2"
  shift 2
  spin -a "$@" "$model" >/dev/null
  # -O0: compiling pan.c at -O2 took 4-5 s a model, longer than all but one of the searches.
  cc -O0 -DSAFETY -o pan pan.c
  local out errors
  out="$(./pan -m100000 -w22 2>&1)"
  errors="$(printf '%s\n' "$out" | sed -n 's/.*errors: \([0-9]*\).*/\1/p' | head -1)"
  local states
  states="$(printf '%s\n' "$out" | sed -n 's/^ *\([0-9]*\) states, stored.*/\1/p' | head -1)"
  echo "check_mailbox_model: $label: $errors error(s), $states states" >&2
  if [ -z "$errors" ]; then
    printf '%s\n' "$out" >&2
    echo "check_mailbox_model: $label: could not read pan's result" >&2
    exit 1
  fi
  if [ "$errors" != 0 ]; then printf '%s\n' "$out" | grep -E "violated|invalid end" >&2 || true; fi
  return "$errors"
}

check_model() {  # check_model MODEL MUTANT...
  local model="$1"
  shift
  [ -n "$only" ] && [ "$only" != "$model" ] && return 0
  if ! verify "$model" "$model"; then
    echo "check_mailbox_model: FAILED: $model has a violation" >&2
    exit 1
  fi
  for mutant in "$@"; do
    if verify "$model" "$model $mutant" "-D$mutant"; then
      echo "check_mailbox_model: FAILED: SPIN found no violation in $model $mutant" >&2
      exit 1
    fi
  done
}
check_model mailbox.pml MUTANT_ACK_NOT_LAST MUTANT_ACCEPT_STALE_GEN
check_model mailbox_regrant.pml MUTANT_COMMIT_BEFORE_ACK MUTANT_NO_CLAIM_LIMIT
check_model mailbox_wake.pml MUTANT_NO_FINAL_COLLECT MUTANT_COLLECT_BEFORE_CLEAR \
  MUTANT_SEEN_AFTER_COLLECT
if [ -n "$only" ]; then
  echo "check_mailbox_model: ok ($only verified; its mutants caught)" >&2
else
  echo "check_mailbox_model: ok (all three models verified; all seven mutants caught)" >&2
fi
