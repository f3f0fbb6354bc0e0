/*
 * The turn protocol of durable_singleton (issue 8), as a Promela model for spin.
 *
 * Every `atomic` block below is one database transaction of the code; every
 * step between two atomic blocks is a point where another process (worker,
 * tick, canceller, clock, fault) may run.  docs/model.rst maps each block to
 * the function that implements it.
 *
 * Configuration (cpp macros, set with spin -D...):
 *   NW          workers (2 or 3)
 *   NR          runs (3 or 4); run i is older than run j iff i < j
 *               (created_at, run_id order); all are created at the start but LATE
 *   KEYS        which key each run has, e.g. {0,0,0,1} (see KEY_OF below)
 *   LIM0, LIM1  limit of key 0 and key 1
 *   CAP0        max active runs of key 0 (limit + max_queue_depth), 0 = none
 *   SLEEPER     bitmask of runs whose body sleeps once (parks as a holder)
 *   LATE        a run created at any moment instead of at the start (9 = none)
 *   FAIR_TIME   every wake time, lease expiry of a crashed worker and deadline
 *               has come by the next tick (for the liveness check)
 *   TO_RUN      the run with an execution timeout (may become overdue); NR = none
 *   MAXCRASH, MAXPAUSE, MAXLOST, MAXDUP, MAXCANCEL   fault budgets
 *   MAXREC      recoveries before a run is settled dead
 *   BROKEN_TIMEOUT   the old unfenced timeout settle (must fail the invariants)
 *   CHECK_OVERLAP_ONLY  check only "no more bodies than the limit" (shows the overlap itself)
 *   BROKEN_NO_WAKE   no handoff and no catch-up (must fail liveness)
 *
 * Faults: a worker crashes at any statement (its local state is lost and its
 * delivery with it); a lease expires at any time while its worker is paused
 * (budgeted) or after its worker crashed (always, eventually); a send is lost;
 * a delivery is duplicated; any run may be cancelled at any time.
 */

#ifndef NW
#define NW 2
#endif
#ifndef NR
#define NR 3
#endif
#ifndef LIM0
#define LIM0 1
#endif
#ifndef LIM1
#define LIM1 1
#endif
#ifndef CAP0
#define CAP0 0
#endif
/* key of run i: bit i of KEY1 set = key 1, else key 0 */
#ifndef KEY1
#define KEY1 0
#endif
#ifndef SLEEPER
#define SLEEPER 1
#endif
#ifndef LATE
#define LATE 9
#endif
#ifndef TO_RUN
#define TO_RUN 0
#endif
#ifndef MAXCRASH
#define MAXCRASH 1
#endif
#ifndef MAXPAUSE
#define MAXPAUSE 1
#endif
#ifndef MAXLOST
#define MAXLOST 1
#endif
#ifndef MAXDUP
#define MAXDUP 1
#endif
#ifndef MAXCANCEL
#define MAXCANCEL 1
#endif
#ifndef MAXREC
#define MAXREC 1
#endif

/* run status */
#define NONE    0   /* not created yet */
#define PEND    1   /* pending */
#define RUN     2   /* running */
#define SUSP    3   /* suspended (parked) */
#define COMP    4   /* completed */
#define CANC    5   /* cancelled */
#define DEAD    6   /* dead */
#define REFUSED 7   /* start refused by the queue cap: no row */

/* wake_at */
#define W_NONE  0   /* no wake time (running, or terminal) */
#define W_LATER 1   /* in the future; the clock makes it due */
#define W_DUE   2   /* due: the tick's due batch sends it */
#define W_FAR   3   /* a parked waiter: only a handoff or the catch-up makes it due */

#define NOBODY 255

#define KEY_OF(i)     ((KEY1 >> (i)) & 1)
#define LIM(k)        ((k) == 0 -> LIM0 : LIM1)
#define ACTIVE(i)     (st[i] == PEND || st[i] == RUN || st[i] == SUSP)
#define PARKED(i)     (st[i] == PEND || st[i] == SUSP)
#define TERMINAL(i)   (st[i] >= COMP)
#define IS_SLEEPER(i) ((SLEEPER >> (i)) & 1)
#define HAS_TIMEOUT(i) ((i) == TO_RUN)
/* the compare-and-set of every write of a turn (R5a): running, my lease, unexpired */
#define LEASED(i, w)  (st[i] == RUN && own[i] == (w) && live[i])

/* ---- the database ---- */
byte st[NR];        /* status */
bit  hold[NR];      /* singleton_slot = holder */
byte tok[NR];       /* fencing_token (K1) */
byte own[NR];       /* lease_owner (a worker id) */
bit  live[NR];      /* lease_expires_at > now, by the database clock */
bit  creq[NR];      /* cancel_requested */
byte wake[NR];      /* wake_at */
byte steps[NR];     /* stored steps: 1 = step 0 done, 2 = sleep done */
byte rec[NR];       /* recoveries */
bit  fresh[NR];     /* granted, and no claim wrote the run since (its attempts are the grant's) */
bit  overdue[NR];   /* deadline_at <= now */
byte last[2];       /* SingletonKey.last_token */

/* ---- the broker ---- */
bit  msgs[NR];      /* a delivery queued for the run (two sends fold into one) */

/* ---- ghosts: what the processes are doing, for the invariants ---- */
bit  inbody[NW];    /* worker is inside a body */
bit  wok[NW];       /* ... and the lease it took has not expired */
byte cur[NW];       /* the run whose body it is in */
bit  orphan[NR];    /* the lease's worker crashed */
bit  wascanc[NR];   /* the run was settled cancelled */
bit  crash_req[NW];
byte maxent[2];     /* highest token that entered a body, per key */

/* ---- fault budgets ---- */
byte crashes, pauses, lost, dups, cancels;

/* ---- the invariants (checked in every state by the monitor) ---- */
#define CNT_EXEC(k, w)  ((inbody[w] && wok[w] && KEY_OF(cur[w]) == (k)) -> 1 : 0)
#if NW == 3
#define EXEC(k) (CNT_EXEC(k, 0) + CNT_EXEC(k, 1) + CNT_EXEC(k, 2))
#else
#define EXEC(k) (CNT_EXEC(k, 0) + CNT_EXEC(k, 1))
#endif
#define CNT_HOLD(k, i)  ((hold[i] && KEY_OF(i) == (k)) -> 1 : 0)
#if NR == 4
#define HOLDERS(k) (CNT_HOLD(k, 0) + CNT_HOLD(k, 1) + CNT_HOLD(k, 2) + CNT_HOLD(k, 3))
#else
#define HOLDERS(k) (CNT_HOLD(k, 0) + CNT_HOLD(k, 1) + CNT_HOLD(k, 2))
#endif
/* a worker that believes it holds an unexpired lease really holds it (fencing) */
#define FENCED_OK(w)  (!(inbody[w] && wok[w]) || LEASED(cur[w], w))
#if NW == 3
#define ALL_FENCED (FENCED_OK(0) && FENCED_OK(1) && FENCED_OK(2))
#else
#define ALL_FENCED (FENCED_OK(0) && FENCED_OK(1))
#endif
#define RUN_HOLDS(i)  ((st[i] != RUN || hold[i]) && (!hold[i] || ACTIVE(i)) && (!wascanc[i] || st[i] == CANC))
#if NR == 4
#define ALL_RUNS_OK (RUN_HOLDS(0) && RUN_HOLDS(1) && RUN_HOLDS(2) && RUN_HOLDS(3))
#define ALLDONE (TERMINAL(0) && TERMINAL(1) && TERMINAL(2) && TERMINAL(3))
#else
#define ALL_RUNS_OK (RUN_HOLDS(0) && RUN_HOLDS(1) && RUN_HOLDS(2))
#define ALLDONE (TERMINAL(0) && TERMINAL(1) && TERMINAL(2))
#endif
#ifdef CHECK_OVERLAP_ONLY
#define SAFE (EXEC(0) <= LIM0 && EXEC(1) <= LIM1)
#else
#define SAFE (EXEC(0) <= LIM0 && EXEC(1) <= LIM1 && HOLDERS(0) <= LIM0 && HOLDERS(1) <= LIM1 \
              && ALL_FENCED && ALL_RUNS_OK)
#endif

ltl live { <> ALLDONE }

/* ---- helpers ---- */

/* A send after commit: may be lost (budget). */
inline send(r) {
  if
  :: lost < MAXLOST -> lost++
  :: true -> msgs[r] = 1
  fi
}

/* Settle run r terminal (inside a transaction): slot and lease go with it (R2, S12). */
inline settle(r, outcome) {
  assert(ACTIVE(r));
  printf("    run %d settled (status %d)\n", r, outcome);
  st[r] = outcome; hold[r] = 0; live[r] = 0; own[r] = NOBODY; wake[r] = W_NONE; fresh[r] = 0;
  if :: outcome == CANC -> wascanc[r] = 1 :: else -> skip fi
}

/* The grant (DjangoStore._grant), inside a transaction with the key row locked:
 * give the free slots of key k to its oldest waiters: holder, token, a wake
 * time one redelivery window ahead (their turns are sent or run at once).
 * g gets a bitmask of the runs granted. */
inline grant(k, g) {
  h = HOLDERS(k);
  i = 0;
  g = 0;
  do
  :: i < NR ->
     if
     :: KEY_OF(i) == k && PARKED(i) && !hold[i] && h < LIM(k) ->
        hold[i] = 1; h++;
        j = 0;
        do
        :: j < NR -> assert(!(hold[j] && KEY_OF(j) == k && j != i && tok[j] > last[k])); j++
        :: else -> break
        od;
        last[k]++; tok[i] = last[k];   /* K1: ++key.last_token */
        printf("    handoff: run %d granted the slot of key %d, token %d\n", i, k, tok[i]);
        wake[i] = W_LATER;             /* wake_at one redelivery window ahead */
        fresh[i] = 1;                  /* still parked, no lease: the grant takes none */
        g = g | (1 << i)
     :: else -> skip
     fi;
     i++
  :: else -> break
  od
}

/* The handoff of a settle: the same grant, in the settle's transaction. */
#ifdef BROKEN_NO_WAKE
inline handoff(k, g) { g = 0 }   /* the broken variant: a settle hands nothing off */
#else
inline handoff(k, g) { grant(k, g) }
#endif

/* Send a turn to every run in bitmask g (after commit). */
inline send_all(g) {
  i = 0;
  do
  :: i < NR ->
     if :: (g >> i) & 1 -> send(i) :: else -> skip fi;
     i++
  :: else -> break
  od
}

/* ---- processes ---- */

/* engine.start in one transaction (a capped start locks the key row, counts,
 * inserts), then the send: runs are pending waiters from creation (S5). */
inline create(x) {
  n = 0; i = 0;
  do
  :: i < NR -> if :: KEY_OF(i) == KEY_OF(x) && ACTIVE(i) -> n++ :: else -> skip fi; i++
  :: else -> break
  od;
  if
  :: CAP0 > 0 && KEY_OF(x) == 0 && n >= CAP0 -> st[x] = REFUSED   /* SingletonQueueFullError, no row */
  :: else -> st[x] = PEND; hold[x] = 0; wake[x] = W_LATER; send(x)  /* redelivery wake; sent on commit */
  fi;
  n = 0; i = 0
}

#if LATE < NR
/* The run LATE is created at any moment, though it is older than the others
 * (its created_at was stamped in a transaction that committed late, F3). */
active proctype Starter() {
  byte n, i;
  atomic { create(LATE) }
}
#endif

/* The locals of a worker between turns (so idle states merge). */
#define RESET_LOCALS r = 0; f = 0; g = 0; h = 0; i = 0; j = 0; k = 0; res = 0

/* Store.claim, one transaction (key row locked first, then the run row):
 * skip, settle (cancel / dead) with handoff, take the lease as a holder
 * (confirmation or admission with a new token), or park the waiter. */
inline claim(r) {
  k = KEY_OF(r);
  g = 0;
  if
  :: !ACTIVE(r) || (st[r] == RUN && live[r]) -> res = 0;               /* skip (R6) */
     printf("worker %d: claim run %d -> skipped\n", w, r)
  :: else ->
     if
     :: st[r] == RUN -> rec[r]++                                        /* recovery of an expired lease (D4) */
     :: else -> skip
     fi;
     if
     :: creq[r] -> printf("worker %d: claim run %d sees its cancel\n", w, r);
        settle(r, CANC); handoff(k, g); res = 2           /* a stored cancel: settle + handoff */
     :: !creq[r] && rec[r] > MAXREC -> settle(r, DEAD); handoff(k, g); res = 2
     :: else ->
        if
        :: !hold[r] ->
           /* a waiter: the free slots go to the oldest waiters, this one among them or not */
           grant(k, g);
           g = g & ~(1 << r)
        :: else -> skip                                                   /* a holder: confirmation (S6) */
        fi;
        if
        :: hold[r] ->
           st[r] = RUN; own[r] = w; live[r] = 1; orphan[r] = 0; wake[r] = W_NONE; fresh[r] = 0;
           inbody[w] = 1; wok[w] = 1; cur[w] = r;
           if
           :: LIM(k) == 1 -> assert(tok[r] >= maxent[k]); maxent[k] = tok[r]
           :: else -> skip
           fi;
           res = 1;
           printf("worker %d: claim run %d -> holder, token %d, lease taken, body enters\n", w, r, tok[r])
        :: else ->
           st[r] = SUSP; own[r] = NOBODY; live[r] = 0; wake[r] = W_FAR; res = 0; fresh[r] = 0;  /* park the waiter (S5.5) */
           printf("worker %d: claim run %d -> waiter parked\n", w, r)
        fi
     fi
  fi;
  f = 0; h = 0; i = 0; j = 0;
  if :: res == 0 && g == 0 -> RESET_LOCALS :: else -> skip fi
}

/* The confirmation claim of a waiter this worker has just granted (begin_turn(known=...)):
 * no read, one compare-and-set on the run as the grant wrote it (status, attempts, the
 * cancel flag).  It takes the lease if no claim wrote the run since the grant, else the
 * turn is skipped: it never recovers, settles or admits (S6, R5a, R6). */
inline confirm(r) {
  k = KEY_OF(r);
  g = 0;
  if
  :: fresh[r] && PARKED(r) && hold[r] && !creq[r] ->
     st[r] = RUN; own[r] = w; live[r] = 1; orphan[r] = 0; wake[r] = W_NONE; fresh[r] = 0;
     inbody[w] = 1; wok[w] = 1; cur[w] = r;
     if
     :: LIM(k) == 1 -> assert(tok[r] >= maxent[k]); maxent[k] = tok[r]
     :: else -> skip
     fi;
     res = 1;
     printf("worker %d: confirm run %d -> holder, token %d, lease taken, body enters\n", w, r, tok[r])
  :: else -> res = 0;
     printf("worker %d: confirm run %d -> skipped (changed since its grant)\n", w, r)
  fi;
  f = 0; h = 0; i = 0; j = 0;
  if :: res == 0 -> RESET_LOCALS :: else -> skip fi
}

/* Leave the body (inside the transaction that ends the turn). */
#define LEAVE inbody[w] = 0; wok[w] = 0; cur[w] = 0

/* A Celery worker process: executes one turn per delivery. */
proctype Worker(byte w) {
  byte r, f, g, h, i, j, k, res;
end_idle:
  do
  :: { /* a delivery arrives (a duplicate stays queued for another worker) and its turn claims */
       atomic {
         if
         :: msgs[0] -> r = 0
         :: msgs[1] -> r = 1
         :: msgs[2] -> r = 2
#if NR == 4
         :: msgs[3] -> r = 3
#endif
         fi;
         if
         :: dups < MAXDUP -> dups++
         :: true -> msgs[r] = 0
         fi;
         claim(r)
       };
next_turn:
       if
       :: res == 2 || (res == 0 && g != 0) -> goto handed_off   /* no body here: Core.hand_off(turn.granted) */
       :: res == 1 && g != 0 -> atomic { send_all(g); g = 0; i = 0 }   /* a body runs here: the grants are sent */
       :: else -> skip
       fi;
       if
       :: res == 0 -> atomic { RESET_LOCALS }; goto turn_done
       :: else -> skip
       fi;
       /* the body, replaying stored steps.  ctx.step: the boundary check (renew,
        * cancel) and save_step, both fenced; the handler's side effect runs
        * between them, covered by the monitor's fencing invariant */
       if
       :: steps[r] == 0 ->
          atomic {
            if
            :: LEASED(r, w) && !creq[r] -> assert(steps[r] == 0); steps[r] = 1; res = 1;
               printf("worker %d: run %d step stored\n", w, r)
            :: LEASED(r, w) && creq[r] -> settle(r, CANC); handoff(k, g); res = 2; LEAVE   /* stopped at the boundary (D6) */
            :: else -> res = 0; LEAVE; RESET_LOCALS                                        /* fenced */
            fi
          };
          if
          :: res == 0 -> goto turn_done
          :: res == 2 -> goto handed_off
          :: else -> skip
          fi
       :: else -> skip
       fi;
       atomic {
         if
         :: IS_SLEEPER(r) && steps[r] == 1 ->
            /* ctx.sleep: park as a holder, fenced; a stored cancel settles instead (D6) */
            if
            :: LEASED(r, w) && creq[r] -> settle(r, CANC); handoff(k, g); res = 2
            :: LEASED(r, w) && !creq[r] ->
               st[r] = SUSP; steps[r] = 2; own[r] = NOBODY; live[r] = 0; wake[r] = W_LATER; res = 0;
               printf("worker %d: run %d sleeps: parked as a holder, lease released\n", w, r)
            :: else -> res = 0; printf("worker %d: run %d park fenced\n", w, r)
            fi
         :: else ->
            /* the body returned: settle + handoff, fenced (R5a) */
            if
            :: LEASED(r, w) -> printf("worker %d: run %d body returned\n", w, r);
               settle(r, COMP); handoff(k, g); res = 2   /* a body that returned completes (owner CAS only) */
            :: else -> res = 0; printf("worker %d: run %d settle fenced\n", w, r)
            fi
         fi;
         LEAVE;
         if :: res == 0 -> RESET_LOCALS :: else -> skip fi
       };
       if :: res == 0 -> goto turn_done :: else -> skip fi;
handed_off:
       /* after commit (Core.hand_off): inside execute_chain the first granted waiter's
        * turn runs here (a confirmation claim) and the others are sent; a waiter of a
        * workflow with a queue of its own, or a handoff outside execute_chain (the
        * embedded worker), sends them all */
       atomic {
         if
         :: g == 0 -> RESET_LOCALS
         :: g != 0 -> send_all(g); RESET_LOCALS
         :: g != 0 ->
            i = 0;
            do
            :: (g >> i) & 1 -> break
            :: else -> i++
            od;
            f = i;
            g = g & ~(1 << f);
            send_all(g);
            r = f;
            f = 0; g = 0; i = 0; res = 3
         fi
       };
       if
       :: res == 3 -> atomic { confirm(r) }; goto next_turn
       :: else -> skip
       fi;
turn_done:
       skip
     } unless {
       crash_req[w] ->
       atomic {
         /* the process dies: local state and its delivery are lost, its lease runs out later */
         printf("worker %d crashes\n", w);
         if
         :: inbody[w] && LEASED(cur[w], w) -> orphan[cur[w]] = 1
         :: else -> skip
         fi;
         LEAVE; crash_req[w] = 0;
         RESET_LOCALS
       }
     }
  od
}

inline pause(x) {
  atomic { pauses < MAXPAUSE && st[x] == RUN && live[x] && !orphan[x] ->
    /* a worker frozen past its lease: the lease expires under it */
    pauses++; live[x] = 0;
    printf("the worker of run %d freezes past its lease\n", x);
    w = 0;
    do
    :: w < NW -> if :: inbody[w] && cur[w] == x -> wok[w] = 0 :: else -> skip fi; w++
    :: else -> break
    od }
}

/* engine.cancel: one transaction with the key row locked; then a send */
inline cancel(x) {
  atomic { cancels < MAXCANCEL && ACTIVE(x) ->
    cancels++; r = x; k = KEY_OF(r); g = 0; creq[r] = 1;
    printf("cancel(run %d) stored\n", r);
    if
    :: PARKED(r) -> settle(r, CANC); handoff(k, g)
    :: else -> skip
    fi };
  if
  :: st[r] == RUN -> send(r)
  :: else -> send_all(g)
  fi
}

active proctype Faults() {
  byte r, w, g, h, i, j, k;
end_faults:
  do
  :: atomic { crashes < MAXCRASH -> crashes++;
       if
       :: crash_req[0] = 1
       :: crash_req[1] = 1
#if NW == 3
       :: crash_req[2] = 1
#endif
       fi }
  :: pause(0)
  :: pause(1)
  :: pause(2)
#if NR == 4
  :: pause(3)
#endif
  :: cancel(0)
  :: cancel(1)
  :: cancel(2)
#if NR == 4
  :: cancel(3)
#endif
  od
}

/* The tick: its batches in order, each write its own transaction. */
#ifdef FAIR_TIME
#define MAYBE(stmt) stmt
#else
#define MAYBE(stmt) if :: stmt :: skip fi
#endif

/* Time passes for run x (inside the tick's first step): a wake time comes, the
 * lease of a crashed worker runs out, the deadline passes. Nondeterministic,
 * or certain with FAIR_TIME. */
inline time_passes(x) {
  if
  :: wake[x] == W_LATER && PARKED(x) -> MAYBE(wake[x] = W_DUE)
  :: else -> skip
  fi;
  if
  :: st[x] == RUN && live[x] && orphan[x] -> MAYBE(live[x] = 0)
  :: else -> skip
  fi;
  if
  :: HAS_TIMEOUT(x) && !overdue[x] && ACTIVE(x) -> MAYBE(overdue[x] = 1)
  :: else -> skip
  fi
}

/* The tick (one process stands for every tick; several at once behave like
 * duplicate sends). Its batches in order; each write is conditional. */
active proctype Tick() {
  byte r, g, h, i, j, k, n;
  bit seen;
end_tick:
  do
  :: atomic {
       r = 0;
       do
       :: r < NR -> time_passes(r); r++
       :: else -> break
       od;
       r = 0;
       /* 1. execution timeouts (D5): the overdue runs are read first */
       seen = (TO_RUN < NR && overdue[TO_RUN] && PARKED(TO_RUN));
       if :: seen -> printf("tick: timeout sweep reads run %d as parked and overdue\n", TO_RUN) :: else -> skip fi;
       if
       :: TO_RUN < NR && overdue[TO_RUN] && st[TO_RUN] == RUN && !creq[TO_RUN] -> creq[TO_RUN] = 1
          /* a running body stops at its boundary; an expired one is settled by the recovery claim */
       :: else -> skip
       fi
     };
     atomic {
       /* ... and a run read as parked is then settled in its own transaction */
       if
       :: seen ->
          r = TO_RUN; k = KEY_OF(r); g = 0;
          printf("tick: timeout sweep settles run %d (status now %d)\n", r, st[r]);
#ifdef BROKEN_TIMEOUT
          /* the old settle: no owner or lease check */
          if
          :: ACTIVE(r) -> settle(r, CANC); handoff(k, g)
          :: else -> skip
          fi;
#else
          /* CAS: still parked (so no live lease) */
          if
          :: PARKED(r) && !live[r] -> settle(r, CANC); handoff(k, g)
          :: else -> skip
          fi;
#endif
          send_all(g)
       :: else -> skip
       fi;
       /* 2. per-key catch-up: a key with a free slot and a waiter grants it (DjangoStore.catch_up) */
       k = 0;
#ifdef BROKEN_NO_WAKE
       k = 2;   /* the broken variant: no catch-up */
#endif
       do
       :: k < 2 ->
          if
          :: HOLDERS(k) < LIM(k) -> grant(k, g); send_all(g)
          :: else -> skip
          fi;
          k++
       :: else -> break
       od;
       /* 3. due wakes: send, push the wake ahead (S7a) */
       r = 0;
       do
       :: r < NR ->
          if
          :: PARKED(r) && wake[r] == W_DUE -> wake[r] = W_LATER; send(r)
          :: else -> skip
          fi;
          r++
       :: else -> break
       od;
       /* 4. recovery: re-drive expired leases */
       r = 0;
       do
       :: r < NR -> if :: st[r] == RUN && !live[r] -> send(r) :: else -> skip fi; r++
       :: else -> break
       od;
       r = 0; g = 0; h = 0; i = 0; j = 0; k = 0; n = 0; seen = 0
     }
  od
}

/* The invariants, in every reachable state; the trail names the one that failed. */
#define OVERLAP_OK (EXEC(0) <= LIM0 && EXEC(1) <= LIM1)
active proctype Monitor() {
  atomic {
    !SAFE ->
    if
    :: !OVERLAP_OK -> printf("VIOLATION: more bodies executing under unexpired leases than the key's limit\n")
    :: !(HOLDERS(0) <= LIM0 && HOLDERS(1) <= LIM1) -> printf("VIOLATION: more holders than the limit\n")
    :: !ALL_FENCED -> printf("VIOLATION: a worker whose lease has not expired no longer holds it (unfenced write)\n")
    :: !ALL_RUNS_OK -> printf("VIOLATION: a running non-holder, a terminal holder, or a cancel undone\n")
    :: else -> skip
    fi;
    assert(SAFE)
  }
}

init {
  byte i, j, n, x;
  atomic {
    i = 0;
    do
    :: i < NR -> own[i] = NOBODY; i++
    :: else -> break
    od;
    x = 0;
    do
    :: x < NR -> if :: x != LATE -> create(x) :: else -> skip fi; x++
    :: else -> break
    od;
    i = 0; x = 0;
    i = 0;
    do
    :: i < NW -> run Worker(i); i++
    :: else -> break
    od
  }
}
