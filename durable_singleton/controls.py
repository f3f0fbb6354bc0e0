"""Runtime key controls (K2): pause, resume and override the limit of a key,
or of every key of a workflow, with a record of every change.

The controls live in the store, behind its key-control seam
(:meth:`~durable_singleton.stores.base.BaseStore.apply_key_controls`, announced
by ``supports_key_controls``): on the key's lock row in the database
(``SingletonKey.paused`` and ``limit_override``), in ``MemoryStore.controls``
in memory, where the claim reads them under the same lock (S5): a change is applied at
the next claim of every queued run, and no interleaving of a change with
racing claims admits more than the limit in force when each claim ran. A
lowered limit never evicts a holder; it only admits no one until the holders
drop below it. A paused key admits nothing while its queue keeps its order
and still accepts starts (the queue cap still applies). Resuming, raising or
clearing an override wakes the newly admissible waiters at once (S7).

:class:`KeyControls` is the service; the engine has one as ``engine.controls``
and forwards ``pause_key``, ``resume_key``, ... to it. On a store without key
controls a change raises
:class:`~durable_singleton.exceptions.UnsupportedByStoreError` and reads say
no key is paused or overridden.

Every change is written with who made it, when, the old and new value and
an optional reason (:class:`ControlChangeRecord`), in the same transaction
as the change.

A workflow-wide change applies to every key of the workflow that has a lock
row (every key that ever had a claim or a capped start) or an active run
(its lock row is created then), and is recorded once with an empty key; a
key first seen after the change starts uncontrolled.
"""

from __future__ import annotations

from dataclasses import dataclass

from .admission import KEY_MAX_LENGTH, QUOTA_PREFIX, THROTTLE_PREFIX, effective_limit
from .core import Core
from .exceptions import UnknownWorkflowError, ValidationError
from .stores.base import ControlChange, ControlChangeRecord
from .values import MAX_LIMIT, check_int, check_text

__all__ = [
    "ControlChangeRecord",
    "KeyControlState",
    "KeyControls",
]

REASON_MAX_LENGTH = 1000
BY_MAX_LENGTH = 150
#: Most recorded changes one :meth:`KeyControls.control_history` call returns.
HISTORY_MAX = 10_000


@dataclass(frozen=True)
class KeyControlState:
    """A key's controls (K2): ``paused``, ``limit_override`` (None: not set),
    ``declared_limit`` (the workflow's) and ``limit`` (the one in force)."""

    workflow: str
    key: str
    paused: bool
    limit_override: int | None
    declared_limit: int
    limit: int


class KeyControls:
    """The runtime key controls (K2) over ``core``'s store: ``engine.controls``."""

    def __init__(self, core: Core) -> None:
        self.core = core

    def _declared_limit(self, workflow: str) -> int:
        if workflow.startswith(QUOTA_PREFIX):
            # A quota's keys, addressed as the workflow ``quota:<name>`` (X3b).
            quota = self.core.registry.quotas.get(workflow[len(QUOTA_PREFIX) :])
            if quota is None:
                raise UnknownWorkflowError(f"no quota named {workflow[len(QUOTA_PREFIX) :]!r}")
            return quota.limit
        if workflow.startswith(THROTTLE_PREFIX):
            # A throttle's keys, addressed as the workflow ``throttle:<name>`` (X6, K2).
            throttle = self.core.registry.throttles.get(workflow[len(THROTTLE_PREFIX) :])
            if throttle is None:
                raise UnknownWorkflowError(f"no throttle named {workflow[len(THROTTLE_PREFIX) :]!r}")
            return throttle.limit
        definition = self.core.registry.get(workflow)
        if definition.singleton is None:
            raise ValidationError(f"workflow {workflow!r} is not a singleton workflow; it has no keys to control")
        return definition.singleton.limit

    def _control(
        self, workflow: str, key: str | None, change: ControlChange, by: str, reason: str
    ) -> list[KeyControlState]:
        if not isinstance(workflow, str):
            raise UnknownWorkflowError(f"no workflow named {workflow!r}")
        declared = self._declared_limit(workflow)
        if key is not None:
            check_text(key, "key", KEY_MAX_LENGTH)
        check_text(by, "by", BY_MAX_LENGTH, empty=True, allow="\t\n")
        check_text(reason, "reason", REASON_MAX_LENGTH, empty=True, allow="\t\n")
        if not change.keep_override and change.override is not None:
            check_int(change.override, "a limit override (or None)", low=1, high=MAX_LIMIT)
        store = self.core.store
        results = store.apply_key_controls(
            workflow, [key] if key is not None else None, change, by=by, reason=reason, now=store.now()
        )
        states = []
        for r in results:
            before = 0 if r.old_paused else effective_limit(declared, r.old_override)
            after = 0 if r.paused else effective_limit(declared, r.override)
            if after > before:
                self.wake_key(workflow, r.key)  # newly admissible waiters, at once (S7)
            states.append(
                KeyControlState(workflow, r.key, r.paused, r.override, declared, effective_limit(declared, r.override))
            )
        return states

    def wake_key(self, workflow: str, key: str) -> list[str]:
        """Grant the free slots of one key to its oldest waiters and send their turns (S7);
        return their run ids. Called after a change that admits more (K2). A throttle
        key (``throttle:<name>``) grants nothing: its oldest runs parked over the rate,
        as many as its limit in force, and every run parked on its retry delay are made
        due now and sent their turns, whose claims count the window (X6,
        ``BaseStore.wake_throttled``)."""
        store = self.core.store
        if workflow.startswith(THROTTLE_PREFIX):
            state = self.key_controls(workflow, key)
            woken = store.wake_throttled(workflow[len(THROTTLE_PREFIX) :], key, max(state.limit, 1))
            self.core.hand_off(woken)  # waiters still: a turn each, no admission announced (X3h)
            return [r.run_id for r in woken]
        granted = store.release(workflow, key, limits=self.core.limits(), ttls=self.core.queue_ttls())
        self.core.hand_off(granted)
        return [r.run_id for r in granted]

    def pause_key(self, workflow: str, key: str, *, by: str = "", reason: str = "") -> KeyControlState:
        """Pause one key (K2): holders go on, nothing more is admitted, waiters keep their order.

        ``by`` names who (at most 150 characters), ``reason`` why (at most 1000);
        ``key`` at most 191 characters with a non-space one. None of them may hold a
        control character (tabs and newlines aside in ``by`` and ``reason``) or a
        lone surrogate. Raises :class:`UnknownWorkflowError` or :class:`ValidationError`, and
        :class:`~durable_singleton.exceptions.UnsupportedByStoreError` on a store
        without key controls; writes nothing then.
        """
        return self._control(workflow, check_text(key, "key", KEY_MAX_LENGTH), ControlChange(paused=True), by, reason)[
            0
        ]

    def resume_key(self, workflow: str, key: str, *, by: str = "", reason: str = "") -> KeyControlState:
        """Resume one key (K2) and wake the waiters its free slots admit (S7). Raises as :meth:`pause_key`."""
        return self._control(workflow, check_text(key, "key", KEY_MAX_LENGTH), ControlChange(paused=False), by, reason)[
            0
        ]

    def override_limit(
        self, workflow: str, key: str, limit: int | None, *, by: str = "", reason: str = ""
    ) -> KeyControlState:
        """Set one key's limit to ``limit`` (an int from 1 to 2**31 - 1), or clear the override with None (K2).

        Lowering never evicts a holder; raising wakes the newly admissible waiters
        at once. Raises as :meth:`pause_key`.
        """
        return self._control(
            workflow,
            check_text(key, "key", KEY_MAX_LENGTH),
            ControlChange(override=limit, keep_override=False),
            by,
            reason,
        )[0]

    def pause_workflow(self, workflow: str, *, by: str = "", reason: str = "") -> list[KeyControlState]:
        """Pause every key of ``workflow`` that has a lock row or an active run (K2); see :meth:`pause_key`."""
        return self._control(workflow, None, ControlChange(paused=True), by, reason)

    def resume_workflow(self, workflow: str, *, by: str = "", reason: str = "") -> list[KeyControlState]:
        """Resume every key of ``workflow`` (K2); see :meth:`resume_key`."""
        return self._control(workflow, None, ControlChange(paused=False), by, reason)

    def override_workflow_limit(
        self, workflow: str, limit: int | None, *, by: str = "", reason: str = ""
    ) -> list[KeyControlState]:
        """Override (or, with None, clear) the limit of every key of ``workflow`` (K2); see :meth:`override_limit`."""
        return self._control(workflow, None, ControlChange(override=limit, keep_override=False), by, reason)

    def key_controls(self, workflow: str, key: str) -> KeyControlState:
        """Return one key's controls and the limit in force (K2). Raises :class:`UnknownWorkflowError`."""
        declared = self._declared_limit(workflow)
        check_text(key, "key", KEY_MAX_LENGTH)
        paused, override = self.core.store.key_control_state(workflow, key)
        return KeyControlState(workflow, key, paused, override, declared, effective_limit(declared, override))

    def control_history(self, workflow: str, key: str | None = None, *, limit: int = 50) -> list[ControlChangeRecord]:
        """Return the newest ``limit`` recorded changes of a key (with its workflow-wide
        ones) or of a workflow, newest first (K2). ``limit``: 1 to
        :data:`HISTORY_MAX`. Raises :class:`ValidationError` for a bad key or limit."""
        if not isinstance(workflow, str):
            raise UnknownWorkflowError(f"no workflow named {workflow!r}")
        if key is not None:
            check_text(key, "key", KEY_MAX_LENGTH)
        check_int(limit, "limit", low=1, high=HISTORY_MAX)
        return self.core.store.key_control_history(workflow, key, limit)
