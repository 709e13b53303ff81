/* Grant changes of a live mailbox (MailboxParent::regrant, src/hierarchy/mailbox.h),
 * as SPIN checks them.
 *
 * A publisher publishes N runs through K = 2 request frames while, concurrently, a regranter
 * changes the grant twice (each time to grant 1 or 2: M = 3 or 4 entries, chosen by SPIN) and a
 * collector frees terminal entries; one child takes frames, adopts grants from the control frame
 * and completes runs. The parent's record (held entries, its table, the claim limit) is one
 * process's memory under one mutex in the code: those updates are atomic here; every store to
 * shared memory is its own statement.
 *
 * The regrant, as the code does it: under the mutex, refuse a shrink below a held entry and lower
 * the claim limit to what both tables hold; size detached storage (the entries past the current
 * table cleared); wait until the request frames were taken; publish the kRegrant command; wait
 * for the child's ACK (its adoption); commit the parent's table and the claim limit.
 *
 * Checked: the child never sees a frame naming an entry outside its own table (in the code that
 * stops the endpoint: the protocol must never cause it), no run is served twice or lost, every
 * run is collected exactly once, and no deadlock.
 *
 * Mutants (check_mailbox_model.sh requires SPIN to find a violation in each):
 *   -DMUTANT_COMMIT_BEFORE_ACK  the parent commits its new table before the child adopted it
 *   -DMUTANT_NO_CLAIM_LIMIT     a shrink does not lower the claim limit before the child adopts
 */

#define K 2
#define MMAX 4  /* entries at grant 2 */
#define N 4     /* runs */
#define NONE 255

byte f_state[K];  /* 0 free (parent's), 1 published (child's) */
byte f_entry[K];
byte f_gen[K];
byte f_run[K];

byte e_gen[MMAX];   /* odd while occupied */
byte e_state[MMAX]; /* 0 free, 1 claimed, 2 accepted, 3 terminal */
byte e_run[MMAX];

/* The parent's own record (under its mutex in the code). */
bool held[MMAX];
byte in_flight = 0;
byte p_count = 3;     /* the parent's table: grant + K */
byte claim_limit = 3; /* publish claims only entries below it */
byte done = 0;        /* runs collected */
bool published_all = false;
bool regrants_over = false;

/* The control frame. */
byte ctl_state = 0;   /* 0 free, 1 published */
byte ctl_count;

byte c_count = 3;     /* the child's own table size, from its adoptions */

byte served[N];
byte collected[N];

#define ANY_ACCEPTED (e_state[0] == 2 || e_state[1] == 2 || e_state[2] == 2 || e_state[3] == 2)
#define ANY_TERMINAL ((held[0] && e_state[0] == 3) || (held[1] && e_state[1] == 3) || \
                      (held[2] && e_state[2] == 3) || (held[3] && e_state[3] == 3))

proctype publisher() {
  byte next = 0;
  byte nf = 0;
  byte i;
  do
  :: next < N && f_state[nf] == 0 ->
     atomic {
       /* can_dispatch + the claim, under the parent's mutex */
       if
       :: in_flight < claim_limit ->
          i = 0;
          do
          :: i < claim_limit && held[i] -> i++
          :: else -> break
          od;
          assert(i < claim_limit);
          held[i] = true;
          in_flight++
       :: else -> i = NONE
       fi
     }
     if
     :: i != NONE ->
        e_run[i] = next;
        e_state[i] = 1;
        e_gen[i] = e_gen[i] + 1;
        f_entry[nf] = i;
        f_gen[nf] = e_gen[i];
        f_run[nf] = next;
        f_state[nf] = 1;   /* the publication: the parent's last store to the frame */
        nf = (nf + 1) % K;
        next++
     :: else -> skip
     fi
  :: next == N -> published_all = true; break
  od
}

proctype collector() {
  byte i;
  do
  :: ANY_TERMINAL ->
     atomic { i = 0; do :: i < MMAX && !(held[i] && e_state[i] == 3) -> i++ :: else -> break od };
     assert(i < p_count);
     assert(served[e_run[i]] == 1);
     collected[e_run[i]]++;
     e_state[i] = 0;
     e_gen[i] = e_gen[i] + 1;
     atomic { held[i] = false; in_flight--; done++ }
  :: done == N -> break
  od
}

proctype regranter() {
  byte r = 0;
  byte target;
  byte old;
  byte i;
  bool refused;
  do
  :: r < 2 ->
     if
     :: target = 3
     :: target = 4
     fi;
     atomic {
       /* under the mutex: refuse a shrink below a held entry; lower the claim limit */
       old = p_count;
       refused = false;
       i = target;
       do
       :: i < old && held[i] -> refused = true; break
       :: i < old && !held[i] -> i++
       :: else -> break
       od;
#ifndef MUTANT_NO_CLAIM_LIMIT
       if
       :: !refused && target < old -> claim_limit = target
       :: else -> skip
       fi
#endif
     }
     if
     :: refused -> skip
     :: else ->
        /* detached sizing: the entries past the current table are cleared */
        i = old;
        do
        :: i < target -> e_gen[i] = 0; e_state[i] = 0; i++
        :: else -> break
        od;
#ifdef MUTANT_COMMIT_BEFORE_ACK
        atomic { p_count = target; claim_limit = target }
#endif
        /* control(): the request frames published before were taken */
        (f_state[0] == 0 && f_state[1] == 0);
        ctl_count = target;
        ctl_state = 1;
        (ctl_state == 0);  /* the child's ACK: it adopted the table */
        atomic { p_count = target; claim_limit = target }
     fi;
     r++
  :: r == 2 -> regrants_over = true; break
  od
}

active proctype child() {
  byte nf = 0;
  byte idx;
  byte gen;
  byte r;
  byte j;
end_idle:
  do
  :: ctl_state == 1 ->
     c_count = ctl_count;  /* adopt (the extent check holds: the parent sized it) */
     ctl_state = 0         /* the ACK: its last store to the control frame */
  :: f_state[nf] == 1 ->
     idx = f_entry[nf];
     gen = f_gen[nf];
     r = f_run[nf];
     /* A frame naming an entry outside the child's table stops the endpoint in the code; the
        protocol must never make the parent publish one. */
     assert(idx < c_count && gen % 2 == 1);
     if
     :: e_gen[idx] != gen ->
        f_state[nf] = 0;
        nf = (nf + 1) % K
     :: else ->
        assert(r != NONE && e_run[idx] == r);
        served[r]++;
        assert(served[r] == 1);
        e_state[idx] = 2;
        f_state[nf] = 0;
        nf = (nf + 1) % K
     fi
  :: ANY_ACCEPTED ->
     atomic { j = 0; do :: j < MMAX && e_state[j] != 2 -> j++ :: else -> break od };
     assert(j < c_count);
     e_state[j] = 3
  od
}

init {
  byte i;
  atomic {
    run publisher();
    run collector();
    run regranter()
  };
  /* every run served and collected exactly once, once everything is over */
  (published_all && done == N && regrants_over);
  i = 0;
  do
  :: i < N -> assert(served[i] == 1 && collected[i] == 1); i++
  :: else -> break
  od;
  /* both sides ended on the same table */
  assert(p_count == c_count && claim_limit == p_count)
}
