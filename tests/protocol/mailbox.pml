/* The mailbox's frame / entry hand-off (src/hierarchy/mailbox.h), as SPIN checks it.
 *
 * One parent publishes N runs through K = 2 request frames into M = grant + K run-state entries
 * (grant 1 here); one child takes them in cyclic frame order, ACKs each frame, and later writes
 * each run's terminal state; the parent collects terminals and frees entries. Once, the parent
 * may also re-publish a stale copy of an earlier frame (the "duplicate" fault): the child must
 * return it untouched. Every statement is one shared-memory load or store (Promela statements
 * are atomic), so SPIN explores every interleaving of the two sides' stores.
 *
 * Checked: no run is served twice (assert in the child), none is lost (every run served and
 * collected exactly once when the parent ends), the child never acts on a frame whose entry
 * moved on (assert: the entry it accepts holds the frame's run), and no deadlock (SPIN's
 * invalid-end-state check; the child's idle loop is a valid end state).
 *
 * Mutants (tests/protocol/check_mailbox_model.sh requires SPIN to find a violation in each):
 *   -DMUTANT_ACK_NOT_LAST      the child stores to a frame after its ACK (clears the run field)
 *   -DMUTANT_ACCEPT_STALE_GEN  the child skips the generation check
 */

#define K 2
#define M 3  /* grant 1 + K */
#define N 4  /* runs */
#define NONE 255

/* Frames: state 0 = free (parent's), 1 = published (child's). */
byte f_state[K];
byte f_entry[K];
byte f_gen[K];
byte f_run[K];

/* Entries: generation odd while occupied; state 0 free, 1 claimed, 2 accepted, 3 terminal. */
byte e_gen[M];
byte e_state[M];
byte e_run[M];

/* Whether the parent holds a terminal entry / the child has an accepted run (M = 3). */
#define ANY_TERMINAL ((held[0] && e_state[0] == 3) || (held[1] && e_state[1] == 3) || \
                      (held[2] && e_state[2] == 3))
#define ANY_ACCEPTED (e_state[0] == 2 || e_state[1] == 2 || e_state[2] == 2)

byte served[N];     /* times the child served each run */
byte collected[N];  /* times the parent collected each run */

active proctype parent() {
  byte next = 0;
  byte nf = 0;      /* next frame, cyclic */
  byte i;
  byte done = 0;
  bool held[M];
  bool dup_used = false;
  byte dup_entry = NONE;
  byte dup_gen;
  byte dup_run;

  do
  /* can_dispatch: the next frame is free and an entry is free (the parent's own record). */
  :: next < N && f_state[nf] == 0 ->
     i = 0;
     do
     :: i < M && held[i] -> i++
     :: else -> break
     od;
     if
     :: i < M ->
        held[i] = true;
        /* claim the entry: run, state, then the odd generation */
        e_run[i] = next;
        e_state[i] = 1;
        e_gen[i] = e_gen[i] + 1;
        /* fill the frame, then publish it: the publication is the parent's last store */
        f_entry[nf] = i;
        f_gen[nf] = e_gen[i];
        f_run[nf] = next;
        if
        :: dup_entry == NONE -> dup_entry = i; dup_gen = e_gen[i]; dup_run = next
        :: true -> skip
        fi;
        f_state[nf] = 1;
        nf = (nf + 1) % K;
        next++
     :: else -> skip
     fi
  /* The duplicate fault: a stale copy of an earlier frame, published once into the next free
     frame after its run was collected (its entry moved on). */
  :: !dup_used && dup_entry != NONE && collected[dup_run] == 1 && f_state[nf] == 0 ->
     dup_used = true;
     f_entry[nf] = dup_entry;
     f_gen[nf] = dup_gen;
     f_run[nf] = dup_run;
     f_state[nf] = 1;
     nf = (nf + 1) % K
  /* collect: a terminal state frees its entry (state, then the even generation) */
  :: ANY_TERMINAL ->
     atomic { i = 0; do :: i < M && !(held[i] && e_state[i] == 3) -> i++ :: else -> break od };
     assert(served[e_run[i]] == 1);
     collected[e_run[i]]++;
     e_state[i] = 0;
     e_gen[i] = e_gen[i] + 1;
     held[i] = false;
     done++
  :: done == N -> break
  od;

  /* Every run served and collected exactly once: none lost, none twice. */
  i = 0;
  do
  :: i < N -> assert(served[i] == 1 && collected[i] == 1); i++
  :: else -> break
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
  :: f_state[nf] == 1 ->
     idx = f_entry[nf];
     gen = f_gen[nf];
     r = f_run[nf];
     /* the model never publishes an index outside the table or an even generation */
     assert(idx < M && gen % 2 == 1);
#ifdef MUTANT_ACCEPT_STALE_GEN
     if
     :: true ->
#else
     if
     :: e_gen[idx] != gen ->
        /* stale: returned untouched, the ACK its only store */
        f_state[nf] = 0;
        nf = (nf + 1) % K
     :: else ->
#endif
        assert(r != NONE && e_run[idx] == r);  /* never act on an entry that moved on */
        served[r]++;
        assert(served[r] == 1);                 /* never served twice */
        e_state[idx] = 2;
        f_state[nf] = 0;                        /* the ACK */
#ifdef MUTANT_ACK_NOT_LAST
        f_run[nf] = NONE;                       /* a store after the ACK */
#endif
        nf = (nf + 1) % K
     fi
  /* complete an accepted run: the terminal state is the last store to its entry */
  :: ANY_ACCEPTED ->
     atomic { j = 0; do :: j < M && e_state[j] != 2 -> j++ :: else -> break od };
     e_state[j] = 3
  od
}
