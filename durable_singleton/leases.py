"""The lease renewer: one thread per process renews the lease of every body
running in it (R5).

A turn registers its lease with :meth:`LeaseRenewer.hold` before its body
runs and releases it when the body returns. Nothing on the turn's path waits
for a thread: the renewer thread is started once, by the first turn of the
process (after a ``fork``, of the child), and then sleeps until a lease is due.

Each renewal is the store's :meth:`~durable_singleton.stores.base.BaseStore.renew_lease`,
a compare-and-set that extends the lease to the database's now plus
``LEASE_SECONDS`` only while this turn's owner holds it unexpired (R5, R5a).
One that finds the lease taken over (or expired, or the run no longer running)
drops it for good and sets :attr:`Lease.fenced`: an expired lease is never
renewed, so the turn stays fenced, and its body stops at its next step
boundary. One that finds the run's row locked by another transaction does not
wait for it (:class:`~durable_singleton.stores.base.RenewalBusy`): the lease is
tried again at its next interval, and the renewals of the other leases go on
(S9). One that raises (a connection dropped by a server restart or
``pg_terminate_backend``) closes the renewer thread's connections and retries
on a new one at the lease's next interval; it never stops the renewals of the
other leases (O1, S9).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .stores.base import RenewalBusy

__all__ = ["RENEWER_THREAD", "Lease", "LeaseRenewer", "renewer", "stop_renewer"]

logger = logging.getLogger("durable_singleton")

#: The name of the renewer thread (one per process).
RENEWER_THREAD = "durable-lease-renewer"


@dataclass(eq=False)
class Lease:
    """One body's lease, as the renewer holds it.

    ``store``: the store that leased the run (a
    :class:`~durable_singleton.stores.base.BaseStore`); ``run_id``, ``owner``:
    the run and this turn's lease owner; ``lease_seconds``: the extension of
    each renewal, in seconds (``LEASE_SECONDS``); ``renew_seconds``: the
    interval between renewals, in seconds (``LEASE_RENEW_SECONDS``);
    ``close``: releases the calling thread's connections (the engine's
    ``close_thread_resources``), called on the renewer thread after a failed
    renewal and when it has no lease left.
    """

    store: Any
    run_id: str
    owner: str
    lease_seconds: float
    renew_seconds: float
    close: Callable[[], None]
    #: Set once a renewal found the lease no longer held by ``owner`` (R5).
    fenced: threading.Event = field(default_factory=threading.Event)
    #: When the next renewal is due, on this process's monotonic clock (an
    #: interval, never compared with a stored time).
    due: float = 0.0
    #: Renewals that extended the lease.
    renewals: int = 0
    #: The renewer that holds it.
    renewer: LeaseRenewer | None = None

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.renewer is not None:
            self.renewer.release(self)


class LeaseRenewer:
    """Renews the registered leases, each every ``renew_seconds``, on one thread.

    Use the process's instance, :func:`renewer`. Thread-safe: any thread may
    :meth:`hold` and :meth:`release`.
    """

    def __init__(self) -> None:
        self._leases: dict[int, Lease] = {}
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        #: When the thread's current wait ends (monotonic; inf: until notified).
        self._waiting_until = float("inf")
        #: Closers of the connections this thread opened since it last closed them.
        self._opened: dict[Callable[[], None], None] = {}

    @property
    def thread(self) -> threading.Thread | None:
        """The renewer thread, once the first lease started it."""
        return self._thread

    def hold(
        self,
        store: Any,
        run_id: str,
        owner: str,
        *,
        lease_seconds: float,
        renew_seconds: float,
        close: Callable[[], None],
    ) -> Lease:
        """Register a lease just taken; return it. Its first renewal is due
        ``renew_seconds`` seconds from now. Use the result as a context
        manager, or call :meth:`release` when the body returns."""
        lease = Lease(store, run_id, owner, lease_seconds, renew_seconds, close, renewer=self)
        lease.due = time.monotonic() + renew_seconds
        with self._wake:
            self._leases[id(lease)] = lease
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name=RENEWER_THREAD, daemon=True)
                self._thread.start()
            elif lease.due < self._waiting_until:
                self._wake.notify()  # due before the thread would wake: it waits less
        return lease

    def release(self, lease: Lease) -> None:
        """Stop renewing ``lease`` (its body returned). Never waits for a
        renewal in flight: one that lands after the turn settled or parked
        finds the lease gone and changes nothing (R5a)."""
        with self._wake:
            if self._leases.pop(id(lease), None) is not None and not self._leases and self._opened:
                self._wake.notify()  # idle: the thread closes the connections it opened

    def stop(self, timeout: float = 10.0) -> bool:
        """Stop the renewer thread: it closes the connections its renewals opened
        and exits (O1); the leases it held are renewed no more (R5: they expire
        unless released first). Waits at most ``timeout`` seconds for the thread;
        returns whether it ended. The next :meth:`hold` starts a new thread."""
        with self._wake:
            thread, self._thread = self._thread, None
            self._wake.notify_all()
        if thread is None:
            return True
        thread.join(timeout)
        return not thread.is_alive()

    def _loop(self) -> None:
        me = threading.current_thread()
        while True:
            try:
                due = self._next_due(me)
                if due is None:
                    return  # stopped: its connections are closed
                for lease in due:
                    self._renew(lease)
            except Exception:  # pragma: no cover - the loop must outlive anything
                logger.exception("lease renewer: unexpected error; renewing on")
                time.sleep(0.1)

    def _next_due(self, me: threading.Thread) -> list[Lease] | None:
        """Wait until a lease is due; return the leases due now, and those due
        within half their interval (renewed early, so the leases of a busy
        process are renewed in few rounds). None once :meth:`stop` replaced
        thread ``me``: its connections are closed then."""
        with self._wake:
            while True:
                if self._thread is not me:
                    self._close_idle()
                    return None
                if not self._leases:
                    self._close_idle()
                    self._waiting_until = float("inf")
                    self._wake.wait()
                    continue
                now = time.monotonic()
                soonest = min(lease.due for lease in self._leases.values())
                if soonest > now:
                    self._waiting_until = soonest
                    self._wake.wait(soonest - now)
                    continue
                self._waiting_until = now
                return [lease for lease in self._leases.values() if lease.due - lease.renew_seconds / 2 <= now]

    def _close_idle(self) -> None:
        """With no lease left, close the connections renewals opened (called
        with the lock held; closing a connection makes no query)."""
        opened, self._opened = self._opened, {}
        for close in opened:
            try:
                close()
            except Exception:  # pragma: no cover - a close that fails leaves nothing to do
                logger.warning("lease renewer: closing its connections failed", exc_info=True)

    def _renew(self, lease: Lease) -> None:
        with self._wake:
            if id(lease) not in self._leases:
                return  # released meanwhile
            self._opened[lease.close] = None
        try:
            renewed = lease.store.renew_lease(lease.run_id, lease.owner, lease.lease_seconds)
        except RenewalBusy:
            # Another transaction holds the run's row lock: the renewal did not wait
            # (it would hold back every other lease of the process, S9); the lease is
            # not lost, and is tried again at its next interval.
            logger.warning("run %s: lease renewal deferred: its row is locked by another transaction", lease.run_id)
            lease.due = time.monotonic() + lease.renew_seconds
            return
        except Exception:
            # A dropped connection (server restart, pg_terminate_backend;
            # Django's InterfaceError is no DatabaseError, a store of another
            # kind raises its own): close it and renew on a new one at the next
            # interval, never stop renewing a live body (O1, S9).
            logger.warning("run %s: lease renewal failed; retrying", lease.run_id, exc_info=True)
            try:
                lease.close()
            except Exception:  # pragma: no cover
                logger.warning("lease renewer: closing its connections failed", exc_info=True)
            lease.due = time.monotonic() + lease.renew_seconds
            return
        if renewed:
            lease.renewals += 1
            lease.due = time.monotonic() + lease.renew_seconds
            return
        with self._wake:
            held = self._leases.pop(id(lease), None) is not None
        if held:
            # Taken over, expired or no longer running: never renewed again (R5).
            lease.fenced.set()
            logger.warning(
                "run %s: lease of %s lost; renewals stop and the body stops at its next step boundary",
                lease.run_id,
                lease.owner,
            )


_renewer: LeaseRenewer | None = None
_renewer_lock = threading.Lock()


def stop_renewer(timeout: float = 10.0) -> bool:
    """Stop this process's renewer thread if it runs (:meth:`LeaseRenewer.stop`);
    return whether no renewer thread is left."""
    with _renewer_lock:
        current = _renewer
    return current is None or current.stop(timeout)


def renewer() -> LeaseRenewer:
    """Return this process's lease renewer (a new one in a forked child)."""
    global _renewer
    with _renewer_lock:
        if _renewer is None:
            _renewer = LeaseRenewer()
        return _renewer


def _forget_after_fork() -> None:
    # The parent's renewer thread does not exist in a forked child, and its
    # leases are the parent's bodies: the child starts its own.
    global _renewer, _renewer_lock
    _renewer = None
    _renewer_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)
