/* The mailbox's completion wake-up (src/hierarchy/mailbox.h, "Waiting"), as SPIN
 * checks it.
 *
 * The child writes N terminal states; after each it rings the completion doorbell: it bumps the
 * doorbell's value, then — unless a parent thread polls the entries itself (parent_polling) —
 * wakes the doorbell's sleepers. The parent's collector loops: read the doorbell's value, collect,
 * sleep on the doorbell (a futex wait: it returns at once when the value moved since the read,
 * and is otherwise woken only by a wake issued while it sleeps). A waiter thread turns the
 * polling flag on, polls (collects) any number of times, turns the flag off and collects once
 * more — ROUNDS times. Collections are serialized (collect_mu_ in the endpoint), so each is one
 * atomic step; every other statement is one shared-memory load or store. SPIN's interleavings are
 * sequentially consistent, as the implementation's seq_cst operations make the ring's increment
 * and flag load against the flag's store and the doorbell load that follows it.
 *
 * Checked: no terminal state is left uncollected once every thread is idle or asleep (the
 * collector's sleep has no timeout here: a lost wake-up is a deadlock with a run uncollected).
 *
 * Mutants (tests/protocol/check_mailbox_model.sh requires SPIN to find a violation in each):
 *   -DMUTANT_NO_FINAL_COLLECT      the waiter clears the flag without collecting after it
 *   -DMUTANT_COLLECT_BEFORE_CLEAR  the waiter collects, then clears the flag
 *   -DMUTANT_SEEN_AFTER_COLLECT    the collector reads the doorbell's value after collecting
 */

#define N 3       /* terminal states the child writes */
#define ROUNDS 2  /* polling windows of the waiter */

byte value = 0;      /* the completion doorbell's value */
byte sleepers = 0;   /* threads in a doorbell wait */
bool polling = false;
bool asleep = false; /* the collector is queued on the futex */
bool woken = false;  /* a wake reached it */
byte pending = 0;    /* terminal states not collected yet */
byte collected = 0;
bool child_done = false;
bool waiter_done = false;

inline collect() {
  atomic { collected = collected + pending; pending = 0 }
}

active proctype Child() {
  byte i = 0;
  do
  :: i < N ->
     pending++;  /* the terminal state: the last store to the entry */
     value++;
     if
     :: polling -> skip  /* a parent thread polls: no wake-up */
     :: else ->
        if
        :: sleepers > 0 ->
           /* FUTEX_WAKE reaches only a thread already queued */
           atomic { if :: asleep -> woken = true :: else -> skip fi }
        :: else -> skip
        fi
     fi;
     i++
  :: else -> break
  od;
  child_done = true
}

active proctype Collector() {
  byte seen;
  do
  ::
#ifndef MUTANT_SEEN_AFTER_COLLECT
     seen = value;
     collect();
#else
     collect();
     seen = value;
#endif
     sleepers++;
     /* FUTEX_WAIT: queued only when the value is still the one read */
     if
     :: atomic { value == seen -> asleep = true };
end_asleep:
        woken;
        atomic { woken = false; asleep = false }
     :: atomic { value != seen -> skip }
     fi;
     sleepers--
  od
}

active proctype Waiter() {
  byte round = 0;
  do
  :: round < ROUNDS ->
     polling = true;
     do
     :: collect()  /* a poll (one that lost the try-lock is no step at all) */
     :: break
     od;
#if defined(MUTANT_COLLECT_BEFORE_CLEAR)
     collect();
     polling = false;
#elif defined(MUTANT_NO_FINAL_COLLECT)
     polling = false;
#else
     polling = false;
     collect();
#endif
     round++
  :: else -> break
  od;
  waiter_done = true
}

/* Once nothing can move (the collector asleep, the others done), every terminal state was
 * collected. */
active proctype Check() {
  timeout -> assert(child_done && waiter_done && pending == 0 && collected == N)
}
