"""factory-boy factories for the stored rows: runs, steps, signals, keys and workers,
and for the engine's :class:`~durable_singleton.stores.base.RunRecord`.

Rows built here have the shapes the store writes (S5, S12): a holder is
``running`` with the admitted slot, a waiter ``suspended`` in the waiter slot,
a finished run has no slot and no markers, and a legacy holder (created by an
older release) is active with the key but not tracked.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC, datetime, timedelta
from typing import Any

import factory
from factory.django import DjangoModelFactory

from durable_singleton.models import Run, Signal, SingletonKey, Step, WorkerProcess
from durable_singleton.stores.base import RunRecord

__all__ = [
    "T0",
    "RunFactory",
    "RunRecordFactory",
    "SignalFactory",
    "SingletonKeyFactory",
    "StepFactory",
    "WorkerProcessFactory",
    "bulk_queue",
]

#: The fixed creation time of factory rows (microsecond precision matters to the queue order, S5).
T0 = datetime(2026, 1, 1, tzinfo=UTC)


class RunFactory(DjangoModelFactory[Run]):
    """A run row; ``singleton_key`` set makes it a tracked singleton run.

    Traits: ``holder`` (running, admitted), ``waiter`` (suspended in the
    queue), ``finished`` (completed: no slot, no markers), ``legacy_holder``
    (suspended, untracked: counted as a holder, S12).
    """

    class Meta:
        model = Run

    run_id = factory.Sequence(lambda n: f"run-{n}")
    workflow_name = "wf"
    workflow_version = "1"
    namespace = "default"
    status = "pending"
    input = factory.LazyAttribute(lambda o: {"k": o.singleton_key} if o.singleton_key else None)
    singleton_key = None
    singleton_limit = factory.LazyAttribute(lambda o: 1 if o.singleton_key else None)
    singleton_slot = factory.LazyAttribute(lambda o: "waiter" if o.singleton_key else None)
    singleton_tracked = factory.LazyAttribute(lambda o: o.singleton_key is not None)
    created_at = T0
    updated_at = factory.SelfAttribute("created_at")

    class Params:
        holder = factory.Trait(
            status="running",
            singleton_slot="holder",
            started_at=factory.SelfAttribute("created_at"),
            attempts=1,
        )
        waiter = factory.Trait(status="suspended", singleton_slot="waiter")
        finished = factory.Trait(
            status="completed",
            singleton_slot=None,
            singleton_tracked=False,
            finished_at=factory.SelfAttribute("created_at"),
        )
        legacy_holder = factory.Trait(status="suspended", singleton_slot=None, singleton_tracked=False)


class StepFactory(DjangoModelFactory[Step]):
    """A memoized step result of a run, at the next position (R4)."""

    class Meta:
        model = Step

    run = factory.SubFactory(RunFactory)
    position = factory.Sequence(lambda n: n)
    name = "step"
    result = None
    started_at = T0
    finished_at = factory.LazyAttribute(lambda o: o.started_at + timedelta(seconds=1))


class SignalFactory(DjangoModelFactory[Signal]):
    """A buffered signal of a run (D2)."""

    class Meta:
        model = Signal

    run = factory.SubFactory(RunFactory)
    name = "go"
    payload = None
    created_at = T0


class SingletonKeyFactory(DjangoModelFactory[SingletonKey]):
    """The lock row of a workflow and key (S13)."""

    class Meta:
        model = SingletonKey
        django_get_or_create = ("workflow_name", "key")

    workflow_name = "wf"
    key = factory.Sequence(lambda n: f"key-{n}")
    last_token = 0


class WorkerProcessFactory(DjangoModelFactory[WorkerProcess]):
    """A row of the worker registry (O6): the process ``host:pid`` of a
    ``durable_worker`` with one thread, seen last at ``last_seen_at``
    (``started_at`` unless given)."""

    class Meta:
        model = WorkerProcess

    host = "host"
    pid = factory.Sequence(lambda n: n + 1)
    name = factory.LazyAttribute(lambda o: f"{o.host}:{o.pid}")
    mode = "worker"
    threads = 1
    started_at = T0
    last_seen_at = factory.SelfAttribute("started_at")


class RunRecordFactory(factory.Factory[RunRecord]):
    """A :class:`RunRecord` as the engine hands it to a store's ``create_run``.

    Insert one with ``engine.store.create_run(RunRecordFactory(...), cap=None)``
    instead of reaching into a store's private state. Traits as
    :class:`RunFactory`'s: ``holder``, ``legacy_holder``.
    """

    class Meta:
        model = RunRecord

    run_id = factory.Sequence(lambda n: f"record-{n}")
    workflow_name = "wf"
    workflow_version = "1"
    namespace = "default"
    status = "pending"
    input = None
    created_at = factory.LazyFunction(lambda: datetime.now(UTC))
    updated_at = factory.SelfAttribute("created_at")
    singleton_key = None
    singleton_limit = factory.LazyAttribute(lambda o: 1 if o.singleton_key else None)
    tracked = factory.LazyAttribute(lambda o: o.singleton_key is not None)

    class Params:
        holder = factory.Trait(status="running", admitted=True, attempts=1)
        legacy_holder = factory.Trait(status="running", tracked=False, admitted=False, attempts=1)


def bulk_queue(
    keys: Iterable[str],
    *,
    workflow: str = "wf",
    holders: int = 1,
    waiters: int = 3,
    finished: int = 1,
    legacy_holders: int = 0,
    limit: int = 1,
    start: datetime = T0,
) -> list[Run]:
    """Insert, in one bulk write, the rows the store leaves for each key: ``holders``
    admitted runs, ``waiters`` waiting runs, ``finished`` completed runs (no slot)
    and ``legacy_holders`` untracked runs of an older release (S12).

    Run ids are ``<workflow>-<key>-<i>`` in that order; each key's runs are
    created a millisecond apart from ``start`` plus one second per key.
    """
    rows = []
    for n, key in enumerate(keys):
        at = start + timedelta(seconds=n)
        traits: list[dict[str, Any]] = (
            [{"holder": True}] * holders
            + [{"waiter": True}] * waiters
            + [{"finished": True}] * finished
            + [{"legacy_holder": True}] * legacy_holders
        )
        for i, trait in enumerate(traits):
            rows.append(
                RunFactory.build(
                    run_id=f"{workflow}-{key}-{i}",
                    workflow_name=workflow,
                    singleton_key=key,
                    singleton_limit=limit,
                    created_at=at + timedelta(milliseconds=i),
                    **trait,
                )
            )
    return Run.objects.bulk_create(rows, batch_size=500)
