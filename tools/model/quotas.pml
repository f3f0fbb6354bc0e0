/*
 * Admission under several limits (SPEC X3, X3c-X3h): a run's limits are its
 * singleton key (limit 0) and its quota keys (limits 1 and 2). Each claim,
 * settle and cancel locks the key rows of the run's limits one at a time in
 * one global order (X3e: ascending here, as the store sorts quota keys and
 * locks the singleton key after them; any fixed order is the same proof),
 * then decides under those locks as the store's one transaction does:
 *
 *   claim   (DjangoStore._quota_turn): a waiter is admitted only if, in every
 *           limit it carries, it is among the oldest waiters (by creation,
 *           the run's index here) that the limit's free slots reach (X3d);
 *           then it takes a slot in each at once, and the waiters within the
 *           free slots of its limits are sent a turn.
 *   settle  (_finish): the holder frees all its slots at once (X3g); each
 *           waiter whose every limit the settle holds (its limits are among the
 *           settling run's) is decided in admission order as its own claim
 *           would be (X3h), under the same locks; the waiters still within the
 *           free slots of each of its limits are sent a turn.
 *   cancel  (request_cancel of a waiter, MAXCANCEL of them; no configuration of
 *           check.py sets it: its search passes the checker's 1 GB bound): the
 *           waiter leaves every queue; the same turns are sent.
 *
 * Checked over every interleaving (tools/model/check.py, the quota-* configs):
 *   - no limit ever has more holders than its capacity (the assert after each
 *     admission, under the locks of the limits it checks);
 *   - no deadlock and no lost turn: every run process ends (a run blocked on
 *     a key lock, or a waiter that no turn ever reaches while the others have
 *     ended, is an invalid end state).
 * No retry delay is modelled: the turns alone must reach every waiter.
 * FAIR orders the waiters by a fixed order other than creation, as a fair
 * quota's tags do (X4): the proof needs only that every claim agrees on one
 * order, which the tags, written at the start and never changed, give.
 * BROKEN_HANDOFF (the settle admits a waiter that also carries a limit it
 * does not hold: over-admission, as such a limit is not checked under its lock),
 * BROKEN_ORDER (odd runs lock in descending order: a deadlock),
 * BROKEN_NO_WAKE (no turn is sent: a lost waiter) and BROKEN_FIRST_ONLY (a
 * claim checks only its lowest limit: over-admission) must each yield a
 * counterexample.
 *
 * THROTTLE (SPEC X6) adds limit 3, a throttle key: its "holders" are the
 * admissions in its window (adm), which an admission adds to and only the
 * window's passing takes away (the expiry process, at any moment, without a
 * lock, as time passes under a claim's read: a claim that read a full window
 * only ever admits less than it could). A settle neither frees nor locks it,
 * and never admits a run that carries it (X6c: only the run's own claim
 * does, under its lock); the window's opening sends a turn to the waiters its
 * free admissions reach (the tick's wake at the opening, X6d). Checked: the
 * admissions in the window never exceed the throttle's limit, and every run
 * ends. BROKEN_THROTTLE_HANDOFF (a settle admits a throttle carrier as a
 * quota carrier, without counting it) must yield a counterexample.
 */

#ifndef NR
#define NR 4
#endif
#ifdef THROTTLE
#define NL 4
#define TL 3
#else
#define NL 3
#endif
#define FREE 255
#define CANCELLER NR

#ifndef CAP0
#define CAP0 1
#endif
#ifndef CAP1
#define CAP1 2
#endif
#ifndef CAP2
#define CAP2 1
#endif
#ifndef CAP3
#define CAP3 1
#endif
/* the limits each run carries, as bit masks (bit l: limit l) */
#ifndef NEED0
#define NEED0 3
#endif
#ifndef NEED1
#define NEED1 3
#endif
#ifndef NEED2
#define NEED2 6
#endif
#ifndef NEED3
#define NEED3 4
#endif
#ifndef MAXCANCEL
#define MAXCANCEL 0
#endif

#define WAITER 0
#define HOLDER 1
#define DONE 2

byte cap[NL];
byte need[NR];
byte state[NR];
bool turn[NR];   /* a turn on its way (a dispatched message) */
byte owner[NL];  /* who holds the key row's lock */
/* the admission order of each run (X3d, X4): by creation (ord[r] = r), or with
   FAIR a fixed other order, as the tags of a fair quota give (tag, created_at) */
byte ord[NR];
byte byord[NR];
byte adm;        /* THROTTLE: the admissions in the throttle key's window (X6b) */

#define HAS(r, l) (((need[r] >> (l)) & 1) == 1)
/* the limits of run r a transaction by "who" locks: a settle or a cancel locks no throttle
   key, only a claim (CLAIM) does (X6c) */
#ifdef THROTTLE
#define LOCKS(who, r, l) (HAS(r, l) && (l != TL || who == CLAIM))
#else
#define LOCKS(who, r, l) HAS(r, l)
#endif
#define CLAIM 254
/* the waiters a settle never admits: a throttle carrier (X6c), unless BROKEN_THROTTLE_HANDOFF */
#ifdef THROTTLE
#ifndef BROKEN_THROTTLE_HANDOFF
#define HANDOFF_SKIPS(w) HAS(w, TL)
#endif
#endif
#ifndef HANDOFF_SKIPS
#define HANDOFF_SKIPS(w) false
#endif

/* n = the holders of limit l */
inline count_holders(l, n, j) {
  n = 0; j = 0;
#ifdef THROTTLE
  if
  :: l == TL -> n = adm; j = NR  /* a throttle counts its window's admissions, not its holders */
  :: else
  fi;
#endif
  do
  :: j < NR -> if :: HAS(j, l) && state[j] == HOLDER -> n++ :: else fi; j++
  :: else -> break
  od
}

/* THROTTLE: an admission of run r counts in its throttle key's window (X6b) */
inline count_admission(r) {
#ifdef THROTTLE
  if :: HAS(r, TL) -> adm++ :: else fi
#else
  skip
#endif
}

/* ok = run me is within the free slots of every limit it carries (X3d) */
inline reaches(me, ok, l, n, j, pos) {
  ok = true; l = 0;
  do
  :: l < NL ->
     if
     :: HAS(me, l) ->
        count_holders(l, n, j);
        pos = 0; j = 0;
        do
        :: j < NR -> if :: HAS(j, l) && state[j] == WAITER && ord[j] < ord[me] -> pos++ :: else fi; j++
        :: else -> break
        od;
#ifdef BROKEN_FIRST_ONLY
        /* the broken variant: only the run's lowest limit is checked */
        if :: n >= cap[l] || pos >= cap[l] - n -> ok = false :: else fi;
        break
#else
        if :: n >= cap[l] || pos >= cap[l] - n -> ok = false :: else fi
#endif
     :: else
     fi;
     l++
  :: else -> break
  od
}

/* send a turn to the waiters within the free slots of each limit of run r (X3g, X3h) */
inline wake_fronts(how, r, l, n, j, k) {
#ifdef BROKEN_NO_WAKE
  skip
#else
  l = 0;
  do
  :: l < NL ->
     if
     :: LOCKS(how, r, l) ->  /* a settle's or a cancel's turns leave a throttle key alone (X6c) */
        count_holders(l, n, j);
        k = 0; j = 0;
        do
        :: j < NR ->
           /* the waiters in admission order: byord[0] first */
           if :: HAS(byord[j], l) && state[byord[j]] == WAITER && k + n < cap[l] -> turn[byord[j]] = true; k++ :: else fi;
           j++
        :: else -> break
        od
     :: else
     fi;
     l++
  :: else -> break
  od
#endif
}

/* lock the key rows of run r's limits in the global order (X3e) */
inline lock_all(who, how, r, l) {
#ifdef BROKEN_ORDER
  if
  :: who % 2 == 1 && who != CANCELLER ->
     l = NL;
     do
     :: l > 0 -> l--; if :: LOCKS(how, r, l) -> atomic { owner[l] == FREE -> owner[l] = who } :: else fi
     :: else -> break
     od
  :: else ->
#endif
     l = 0;
     do
     :: l < NL -> if :: LOCKS(how, r, l) -> atomic { owner[l] == FREE -> owner[l] = who } :: else fi; l++
     :: else -> break
     od
#ifdef BROKEN_ORDER
  fi
#endif
}

inline unlock_all(who, l) {
  l = 0;
  do
  :: l < NL -> if :: owner[l] == who -> owner[l] = FREE :: else fi; l++
  :: else -> break
  od
}

/* the settle of run r admits each waiter whose every limit r's settle holds, as its own
   claim would decide it, in admission order (X3h); BROKEN_HANDOFF admits a waiter sharing
   any limit with r, checking only the limits r holds */
inline admit_carriers(r, w, l, n, j, pos, ok) {
  w = 0;
  do
  :: w < NR ->
     if
#ifdef BROKEN_HANDOFF
     :: state[byord[w]] == WAITER && (need[byord[w]] & need[r]) != 0 ->
        ok = true; l = 0;
        do
        :: l < NL ->
           if
           :: HAS(r, l) && HAS(byord[w], l) ->
              count_holders(l, n, j);
              pos = 0; j = 0;
              do
              :: j < NR -> if :: HAS(j, l) && state[j] == WAITER && ord[j] < ord[byord[w]] -> pos++ :: else fi; j++
              :: else -> break
              od;
              if :: n >= cap[l] || pos >= cap[l] - n -> ok = false :: else fi
           :: else
           fi;
           l++
        :: else -> break
        od;
        if :: ok -> state[byord[w]] = HOLDER; check_limits(byord[w], l, n, j) :: else fi
#else
     /* a throttle carrier: only its own claim admits it (X6c) */
     :: state[byord[w]] == WAITER && (need[byord[w]] & need[r]) == need[byord[w]] && !HANDOFF_SKIPS(byord[w]) ->
        reaches(byord[w], ok, l, n, j, pos);
        if :: ok -> state[byord[w]] = HOLDER; count_admission(byord[w]); check_limits(byord[w], l, n, j) :: else fi
#endif
     :: else
     fi;
     w++
  :: else -> break
  od
}

/* the slots of every limit are within capacity; called under the locks of run r's limits */
inline check_limits(r, l, n, j) {
  l = 0;
  do
  :: l < NL -> if :: HAS(r, l) -> count_holders(l, n, j); assert(n <= cap[l]) :: else fi; l++
  :: else -> break
  od
}

proctype claimer(byte me) {
  byte l, n, j, k, pos, w;
  bool ok;
  do
  :: state[me] == DONE -> break
  :: state[me] == WAITER ->
     /* a turn arrives (or the run ended or was admitted by a handoff meanwhile: its turn
        then skips, and an admitted run goes on as a holder) */
     atomic { (turn[me] || state[me] != WAITER) -> turn[me] = false };
     lock_all(me, CLAIM, me, l);
     if
     :: state[me] == WAITER ->
        reaches(me, ok, l, n, j, pos);
        if
        :: ok -> state[me] = HOLDER; count_admission(me); check_limits(me, l, n, j); wake_fronts(CLAIM, me, l, n, j, k)
        :: else  /* parked: it waits for a turn */
        fi
     :: else
     fi;
     unlock_all(me, l)
  :: state[me] == HOLDER ->
     /* the body ran; the settle frees every slot at once */
     lock_all(me, me, me, l);
     state[me] = DONE;
     admit_carriers(me, w, l, n, j, pos, ok);
     wake_fronts(me, me, l, n, j, k);
     unlock_all(me, l)
  od
}

active proctype canceller() {
  byte c = 0, r, l, n, j, k;
end:
  do
  :: c < MAXCANCEL ->
     r = 0;
     do
     :: r < NR - 1 -> r++
     :: break
     od;
     lock_all(CANCELLER, CANCELLER, r, l);
     c++;  /* one cancel request: it settles the run if it is still a waiter */
     if
     :: state[r] == WAITER -> state[r] = DONE; wake_fronts(CANCELLER, r, l, n, j, k)
     :: else
     fi;
     unlock_all(CANCELLER, l);
     r = 0
  od
}

#ifdef THROTTLE
/* the window's passing: the oldest admission leaves it at any moment, with no lock (time
   passes under a claim), and the waiters its free admissions reach are sent their turns (the
   tick's wake at the opening, X6d) */
active proctype window() {
  byte l, n, j, k;
end:
  do
  :: atomic {
       adm > 0 -> adm--;
       l = TL; count_holders(l, n, j);
       k = 0; j = 0;
       do
       :: j < NR ->
          if :: HAS(byord[j], TL) && state[byord[j]] == WAITER && k + n < cap[TL] -> turn[byord[j]] = true; k++ :: else fi;
          j++
       :: else -> break
       od
     }
  od
}
#endif

init {
  byte i;
  atomic {
    cap[0] = CAP0; cap[1] = CAP1; cap[2] = CAP2;
#ifdef THROTTLE
    cap[TL] = CAP3;
#endif
    need[0] = NEED0; need[1] = NEED1; need[2] = NEED2;
#if NR > 3
    need[3] = NEED3;
#endif
    i = 0;
    do :: i < NL -> owner[i] = FREE; i++ :: else -> break od;
    i = 0;
#ifdef FAIR
    /* the burst of runs 0 and 1 is overtaken by runs 2 and 3 of other sub-keys */
    do :: i < NR -> ord[i] = (i + 2) % NR; i++ :: else -> break od;
#else
    do :: i < NR -> ord[i] = i; i++ :: else -> break od;
#endif
    i = 0;
    do :: i < NR -> byord[ord[i]] = i; i++ :: else -> break od;
    i = 0;
    do :: i < NR -> turn[i] = true; i++ :: else -> break od;  /* each start dispatches a turn */
    i = 0;
    do :: i < NR -> run claimer(i); i++ :: else -> break od
  }
}
