"""The rows behind ``DISPATCH = "worker"`` (O1, O6, O7): turn notices that
``durable_worker`` processes take, the election of the one process that runs
the tick, and the registry of live worker processes.

Every time here is the database's (``store.now()``, R5). Only this module
locks these rows; admission is still the claim's (S5): a notice only names a
run id a worker tries, the claim of its turn decides.
"""

from __future__ import annotations

import contextlib
import logging
import select
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.db import connections, transaction
from django.db.models import Q

from ..identity import owns
from ..statuses import RunStatus

__all__ = [
    "CHANNEL",
    "DEFAULT_QUEUE",
    "TICK_LEASE",
    "DeadWorker",
    "Listener",
    "add_notices",
    "can_notify",
    "has_notices",
    "hold_tick_lease",
    "register_worker",
    "release_dead_workers",
    "take_notices",
    "tick_lease_keeper",
    "tick_lease_seconds",
    "unregister_worker",
]

logger = logging.getLogger("durable_singleton.worker")

#: The PostgreSQL channel the trigger of migration 0012 NOTIFYs.
CHANNEL = "durable_singleton_turn"
#: The queue of a notice for a workflow declared without one.
DEFAULT_QUEUE = "default"
#: The heartbeat row whose owner runs the tick (``at``: when its lease ends).
TICK_LEASE = "tick-lease"


def can_notify(db: str) -> bool:
    """Tell whether database ``db`` wakes workers by LISTEN/NOTIFY (PostgreSQL)."""
    return connections[db].vendor == "postgresql"


def add_notices(db: str, run_ids: Sequence[str], queue: str | None, *, unless_pending: bool = False) -> None:
    """Write one notice per run of ``run_ids`` for ``queue`` (None: the
    default queue) in the current transaction of ``db`` (one INSERT); on
    PostgreSQL the trigger NOTIFYs as that transaction commits.

    ``unless_pending``: skip the runs that have a notice not taken yet (the
    tick's redelivery of runs that wait for a free worker thread, S8, adds
    none beside the one they have).
    """
    from ..models import TurnNotice

    rows = TurnNotice.objects.using(db)
    if unless_pending:
        pending = set(rows.filter(run_id__in=list(run_ids)).values_list("run_id", flat=True))
        run_ids = [run_id for run_id in run_ids if run_id not in pending]
    if run_ids:
        rows.bulk_create([TurnNotice(run_id=run_id, queue=queue or DEFAULT_QUEUE) for run_id in run_ids])


def _notices(db: str, queues: Sequence[str]) -> Any:
    from ..models import TurnNotice

    rows = TurnNotice.objects.using(db)
    return rows.filter(queue__in=list(queues)) if queues else rows


def has_notices(db: str, queues: Sequence[str] = ()) -> bool:
    """Tell, without a lock, whether any notice of ``queues`` (all: empty) waits."""
    return bool(_notices(db, queues).exists())


def take_notices(db: str, count: int, queues: Sequence[str] = ()) -> dict[str, str]:
    """Take and delete up to ``count`` notices of ``queues`` (all: empty),
    oldest first; return their run ids (without repeats, oldest first), each
    with its queue.

    On PostgreSQL one statement takes and deletes them, rows another fetcher
    holds skipped (``FOR UPDATE SKIP LOCKED``): one round trip and one commit,
    and none when no notice waits (:func:`durable_singleton.stores.pg.take_notices`).
    Elsewhere a read without a lock first (:func:`has_notices`: no write
    transaction when none waits), then one transaction that selects them
    ``FOR UPDATE SKIP LOCKED`` where the database has it (MariaDB 10.6+, MySQL
    8) and deletes them; SQLite takes its write lock for the short transaction
    instead. Workers fetching at once take different notices and never wait on
    each other's. A notice only names a run: its claim decides (S5, R6).
    """
    from . import pg

    taken = pg.take_notices(db, count, queues) if can_notify(db) else None
    if taken is None:
        taken = _take_notices_orm(db, count, queues) if has_notices(db, queues) else []
    found: dict[str, str] = {}
    for _, run_id, queue in taken:
        found.setdefault(run_id, queue)
    return found


def _take_notices_orm(db: str, count: int, queues: Sequence[str]) -> list[tuple[int, str, str]]:
    """:func:`take_notices` through the ORM: (id, run id, queue) of each notice taken, oldest first."""
    features = connections[db].features
    with transaction.atomic(using=db):
        rows = _notices(db, queues).order_by("id")
        if features.has_select_for_update_skip_locked:
            rows = rows.select_for_update(skip_locked=True)
        taken = list(rows.values_list("id", "run_id", "queue")[:count])
        if taken:
            _notices(db, ()).filter(id__in=[pk for pk, _, _ in taken]).delete()
    return taken


class Listener:
    """A connection of its own that LISTENs on :data:`CHANNEL` (PostgreSQL).

    :meth:`wait` returns True when a notice arrived within ``timeout``
    seconds. Opened from the settings of database ``db``; raises the
    driver's error if the server cannot be reached (the caller polls then).
    """

    def __init__(self, db: str) -> None:
        connection = connections[db]
        params = connection.get_connection_params()
        self.connection = connection.get_new_connection(params)
        self.connection.autocommit = True
        with self.connection.cursor() as cursor:
            cursor.execute(f"LISTEN {CHANNEL}")

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for a notice; True if one (or more) came."""
        got = False
        for _ in self._notifies(timeout):
            got = True
        return got

    def _notifies(self, timeout: float) -> Iterator[Any]:
        if callable(self.connection.notifies):
            # psycopg 3.2+: the notices that arrive within timeout; stop_after ends at the first batch.
            yield from self.connection.notifies(timeout=timeout, stop_after=1)
            return
        # psycopg2: wait on the socket, then read what arrived.
        if not self.connection.notifies and select.select([self.connection], [], [], timeout)[0]:
            self.connection.poll()
        while self.connection.notifies:
            yield self.connection.notifies.pop(0)

    def fileno(self) -> int:
        """The socket of the connection (for ``select``)."""
        return int(self.connection.fileno())

    def close(self) -> None:
        """Close the connection (idempotent)."""
        with contextlib.suppress(Exception):  # a broken connection
            self.connection.close()


def tick_lease_seconds(tick_seconds: float) -> float:
    """How long a tick thread takes the tick's lease for, in seconds: three
    periods of ``tick_seconds`` (at least 3 s), renewed every period, so one
    late tick does not hand it to another process (O1b)."""
    return max(3 * tick_seconds, 3.0)


def hold_tick_lease(db: str, owner: str, seconds: float) -> bool:
    """Take or keep the tick's lease for ``owner`` for ``seconds``, on the
    database's clock: a compare-and-set that succeeds for its holder or once
    the lease ended (O1). Returns True if ``owner`` holds it now."""
    from ..models import Heartbeat

    now = _db_now(db)
    until = now + timedelta(seconds=seconds)
    rows = Heartbeat.objects.using(db)
    if rows.filter(name=TICK_LEASE).filter(Q(owner=owner) | Q(at__lte=now)).update(at=until, owner=owner):
        return True
    rows.bulk_create([Heartbeat(name=TICK_LEASE, at=until, owner=owner)], ignore_conflicts=True)
    return bool(rows.filter(name=TICK_LEASE, owner=owner).exists())


def tick_lease_keeper(db: str, owner: str, seconds: float) -> Callable[[], bool]:
    """Return the ``holding`` check of a tick that took the tick's lease for ``owner``
    (:meth:`~durable_singleton.core.Core.tick`, O1b): True while the lease is still
    ``owner``'s, renewed for ``seconds`` on the database's clock (:func:`hold_tick_lease`)
    once a third of them passed since the last renewal (this process's monotonic clock
    only spaces the renewals; the database decides the lease)."""
    renewed = [time.monotonic()]

    def holding() -> bool:
        if time.monotonic() - renewed[0] < seconds / 3:
            return True
        renewed[0] = time.monotonic()
        return hold_tick_lease(db, owner, seconds)

    return holding


def release_tick_lease(db: str, owner: str) -> None:
    """End ``owner``'s tick lease now, so another worker ticks at once."""
    from ..models import Heartbeat

    Heartbeat.objects.using(db).filter(name=TICK_LEASE, owner=owner).update(at=_db_now(db))


def _db_now(db: str) -> datetime:
    from ..querysets import database_now

    return database_now(db)


def register_worker(db: str, *, name: str, host: str, pid: int, mode: str, threads: int, queues: str) -> datetime:
    """Write or refresh this process's registry row (O6), last seen now on
    the database's clock; return that time. A row deleted meanwhile (the
    process was taken for dead) is written again."""
    from ..models import WorkerProcess

    now = _db_now(db)
    rows = WorkerProcess.objects.using(db)
    if not rows.filter(name=name).update(last_seen_at=now, threads=threads, mode=mode, queues=queues):
        rows.bulk_create(
            [
                WorkerProcess(
                    name=name,
                    host=host,
                    pid=pid,
                    mode=mode,
                    threads=threads,
                    queues=queues,
                    started_at=now,
                    last_seen_at=now,
                )
            ],
            ignore_conflicts=True,
        )
    return now


def unregister_worker(db: str, name: str) -> None:
    """Delete this process's registry row (a clean stop, O6)."""
    from ..models import WorkerProcess

    WorkerProcess.objects.using(db).filter(name=name).delete()


@dataclass(frozen=True)
class DeadWorker:
    """A registry row not refreshed for ``silent_seconds`` and the runs taken back from it."""

    name: str
    silent_seconds: float
    runs: tuple[str, ...]


def release_dead_workers(db: str, dead_seconds: float, *, alive: str = "") -> list[DeadWorker]:
    """Take back the runs of every worker process not seen for ``dead_seconds`` (O6).

    Each running run whose lease owner is a turn of that process
    (``name:turn``, :func:`~durable_singleton.identity.owns`: a row of the
    previous release, ``host:pid``, never matches the turns of a current
    process ``host:pid:token`` of the same host and pid) gets
    its lease ended now, by a compare-and-set on the owner and the lease's
    end as read (R5, R5a: a run renewed or taken meanwhile is left alone), so
    the tick's recovery re-drives it as an expired lease (D4). The row is
    deleted first, by a compare-and-set on its ``last_seen_at`` as read, in
    the same transaction: of several callers that read one silent row (two
    tick holders at once), one takes its runs back, and a worker that came
    back meanwhile keeps its row and its runs. One log line per run names
    the dead owner. All on the database's clock. ``alive`` names the calling process, never taken for
    dead (its own heartbeat may be late while it ticks).
    """
    from ..models import Run, WorkerProcess

    now = _db_now(db)
    stale = (
        WorkerProcess.objects.using(db)
        .filter(last_seen_at__lt=now - timedelta(seconds=dead_seconds))
        .exclude(name=alive)
    )
    found = []
    workers = WorkerProcess.objects.using(db)
    for worker in list(stale):
        silent = (now - worker.last_seen_at).total_seconds()
        taken = []
        with transaction.atomic(using=db):
            # One recoverer per dead worker: the one whose delete of its row,
            # still as stale as read, succeeds. Another tick holder that read
            # the same row (a slow tick outliving its lease) deletes nothing
            # and leaves the runs alone; so does everyone if the worker came
            # back meanwhile (its refresh changed last_seen_at).
            if not workers.filter(name=worker.name, last_seen_at=worker.last_seen_at).delete()[0]:
                continue
            held = Run.objects.using(db).filter(
                status=RunStatus.RUNNING, lease_owner__startswith=f"{worker.name}:", lease_expires_at__gt=now
            )
            for run_id, owner, expires_at in held.values_list("run_id", "lease_owner", "lease_expires_at"):
                if not owns(worker.name, owner or ""):  # a newer process of the same host:pid (a rolling deploy)
                    continue
                if (
                    Run.objects.using(db)
                    .filter(pk=run_id, status=RunStatus.RUNNING, lease_owner=owner, lease_expires_at=expires_at)
                    .update(lease_expires_at=now, wake_at=now)
                ):
                    taken.append((run_id, owner))
        for run_id, owner in taken:  # said once committed
            logger.warning(
                "run %s: taking it back from dead worker %s (host %s, pid %d, not seen for %.0f s; lease %s)",
                run_id,
                worker.name,
                worker.host,
                worker.pid,
                silent,
                owner,
                extra={"run_id": run_id, "dead_owner": worker.name},
            )
        found.append(DeadWorker(worker.name, silent, tuple(run_id for run_id, _ in taken)))
    return found
