"""A run row as a :class:`~durable_singleton.records.RunRecord` (R1): the one
mapping from the run table's columns to the record, for the ORM's model rows
(:func:`durable_singleton.stores.django.record_of`) and the raw rows of the
vendor rooms' statements (:func:`durable_singleton.stores.pg.record`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

from ..admission import quota_keys_of, stored_tags, throttle_keys_of, user_tags_of
from ..records import RunRecord
from ..statuses import SlotState

__all__ = ["COLUMNS", "json_param", "json_value", "run_record", "start_params"]

#: The run table's columns a :class:`RunRecord` is built from, in this order.
COLUMNS = (
    "run_id",
    "workflow_name",
    "workflow_version",
    "namespace",
    "status",
    "input",
    "created_at",
    "updated_at",
    "output",
    "error",
    "tags",
    "singleton_key",
    "singleton_limit",
    "singleton_slot",
    "singleton_tracked",
    "wake_at",
    "lease_owner",
    "lease_expires_at",
    "started_at",
    "finished_at",
    "admitted_at",
    "attempts",
    "recoveries",
    "parent_run_id",
    "park_reason",
    "cancel_requested",
    "deadline_at",
    "fencing_token",
    "step_count",
    "not_before",
    "quota_slot",
    "trace_parent",
    "quota_keys",
    "debounce_key",
    "debounce_until",
    "throttle_keys",
    "priority",
)


def json_value(value: Any) -> Any:
    """Return a JSON column's value: decoded when a raw cursor returned it as text."""
    return json.loads(value) if isinstance(value, str) else value


def json_param(value: Any) -> str | None:
    """Return a JSON column's value as a raw statement's parameter: the text (None: NULL)."""
    return None if value is None else json.dumps(value, allow_nan=False)


def start_params(run: RunRecord, time: Callable[[datetime | None], Any]) -> dict[str, Any]:
    """Return the parameters of a start's INSERT of ``run`` by a vendor room: a
    value for each of :data:`COLUMNS` (and ``park_reason``), as a new run holds
    them (R1, R3); ``time`` gives a time column's parameter (None stays None in
    every room's spelling)."""
    return {
        "run_id": run.run_id,
        "workflow_name": run.workflow_name,
        "workflow_version": run.workflow_version,
        "namespace": run.namespace,
        "status": run.status,
        "input": json_param(run.input),
        "created_at": time(run.created_at),
        "updated_at": time(run.updated_at),
        "output": json_param(run.output),
        "error": json_param(run.error),
        "tags": json_param(stored_tags(run.user_tags, run.quota_keys)),
        "singleton_key": run.singleton_key,
        "singleton_limit": run.singleton_limit,
        "singleton_slot": SlotState.WAITER.value if run.singleton_key is not None and run.tracked else None,
        "singleton_tracked": run.tracked,
        "wake_at": time(run.wake_at),
        "lease_owner": None,
        "lease_expires_at": None,
        "started_at": None,
        "finished_at": None,
        "admitted_at": None,
        "attempts": 0,
        "recoveries": 0,
        "parent_run_id": run.parent_run_id,
        "park_reason": run.park_reason,
        "cancel_requested": False,
        "deadline_at": time(run.deadline_at),
        "fencing_token": None,
        "step_count": 0,
        "not_before": time(run.not_before),
        "quota_slot": run.quota_slot,
        "trace_parent": run.trace_parent,
        "quota_keys": json_param([list(q) for q in run.quota_keys]),
        "debounce_key": run.debounce_key,
        "debounce_until": time(run.debounce_until),
        "throttle_keys": json_param([list(t) for t in run.throttle_keys]),
        "priority": run.priority,
    }


def run_record(
    row: Sequence[Any],
    *,
    json_text: bool = False,
    quota_keys: tuple[tuple[str, str], ...] | None = None,
) -> RunRecord:
    """Return the :class:`RunRecord` of ``row``, the values of :data:`COLUMNS` in
    that order (more values after them are ignored).

    ``json_text``: the JSON columns (input, output, error, tags, quota keys)
    come as text, as a raw cursor returns them on PostgreSQL; else as the
    model's fields decode them. ``quota_keys``: the run's quota keys when the
    caller read them elsewhere (an older release's row without the column,
    X3b); None: from the ``quota_keys`` column.
    """
    (
        run_id,
        workflow_name,
        workflow_version,
        namespace,
        status,
        input,
        created_at,
        updated_at,
        output,
        error,
        tags,
        singleton_key,
        singleton_limit,
        singleton_slot,
        singleton_tracked,
        wake_at,
        lease_owner,
        lease_expires_at,
        started_at,
        finished_at,
        admitted_at,
        attempts,
        recoveries,
        parent_run_id,
        park_reason,
        cancel_requested,
        deadline_at,
        fencing_token,
        step_count,
        not_before,
        quota_slot,
        trace_parent,
        stored_keys,
        debounce_key,
        debounce_until,
        stored_throttles,
        priority,
    ) = row[: len(COLUMNS)]
    if json_text:
        input, output, error, tags, stored_keys, stored_throttles = map(
            json_value, (input, output, error, tags, stored_keys, stored_throttles)
        )
    keys = quota_keys if quota_keys is not None else quota_keys_of(stored_keys)
    return RunRecord(
        run_id=run_id,
        workflow_name=workflow_name,
        workflow_version=workflow_version,
        namespace=namespace,
        status=status,
        input=input,
        created_at=created_at,
        updated_at=updated_at,
        output=output,
        error=error,
        user_tags=user_tags_of(tags, keys),
        singleton_key=singleton_key,
        singleton_limit=singleton_limit,
        admitted=singleton_slot == SlotState.HOLDER,
        tracked=bool(singleton_tracked),  # SQLite's raw rows give 0 and 1
        wake_at=wake_at,
        lease_owner=lease_owner,
        lease_expires_at=lease_expires_at,
        started_at=started_at,
        finished_at=finished_at,
        admitted_at=admitted_at,
        attempts=attempts,
        recoveries=recoveries,
        parent_run_id=parent_run_id,
        park_reason=park_reason,
        cancel_requested=bool(cancel_requested),
        deadline_at=deadline_at,
        fencing_token=fencing_token,
        step_count=step_count,
        not_before=not_before,
        quota_keys=keys,
        quota_slot=quota_slot,
        trace_parent=trace_parent,
        debounce_key=debounce_key,
        debounce_until=debounce_until,
        throttle_keys=throttle_keys_of(stored_throttles),
        priority=priority,
    )
