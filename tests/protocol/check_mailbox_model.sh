#!/usr/bin/env bash
# Model-checks the mailbox hand-off (mailbox.pml) with SPIN: the model must verify with no
# error (no request served twice or lost, no action on a stale generation, no deadlock), and
# each mutant — the ACK not the child's last store to a frame, a stale generation accepted —
# must make SPIN report a violation, so this check can fail. Needs `spin` and a C compiler.
# Usage: tests/protocol/check_mailbox_model.sh [WORK_DIR]
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
work="${1:-$(mktemp -d)}"
mkdir -p "$work"
cd "$work"
cp "$here/mailbox.pml" .
command -v spin >/dev/null || { echo "check_mailbox_model: spin not found (apt-get install spin)" >&2; exit 1; }

verify() {  # verify LABEL [-DMUTANT]; prints pan's summary line, returns pan's error count
  local label="$1"
  shift
  spin -a "$@" mailbox.pml >/dev/null
  cc -O2 -DSAFETY -o pan pan.c
  local out errors
  out="$(./pan -m100000 -w20 2>&1)"
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

if ! verify "model"; then
  echo "check_mailbox_model: FAILED: the protocol model has a violation" >&2
  exit 1
fi
for mutant in MUTANT_ACK_NOT_LAST MUTANT_ACCEPT_STALE_GEN; do
  if verify "$mutant" "-D$mutant"; then
    echo "check_mailbox_model: FAILED: SPIN found no violation in $mutant" >&2
    exit 1
  fi
done
echo "check_mailbox_model: ok (model verified; both mutants caught)" >&2
