"""The engine: the façade over the core and its features.

:class:`Engine` is a :class:`~durable_singleton.core.Core` (start, the turn,
settle and handoff, cancel, retry, signal, emit, the tick's core jobs) that
assembles the features above the core and joins them by attribute:

* ``engine.controls``: the runtime key controls (:class:`~durable_singleton.controls.KeyControls`, K2),
  whose calls the engine forwards (``engine.pause_key(...)``, ...);
* :meth:`Engine.explain` (:mod:`durable_singleton.explain`, K3) and
  :meth:`Engine.audit_slots` (:mod:`durable_singleton.audit`, K4);
* the tick's schedules (:mod:`durable_singleton.schedules`, S17) and
  retention (:mod:`durable_singleton.retention`, O2) jobs, then the heartbeat
  (:mod:`durable_singleton.heartbeat`, O3);
* the async twins ``astart``, ``aget``, ``asignal``, ``acancel``
  (:func:`~durable_singleton.aio.async_twin`).

Nothing below this module imports it; :mod:`durable_singleton.runtime` (the
composition root) builds engines from settings.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from datetime import datetime
from typing import Any, Concatenate

from . import heartbeat, retention, schedules
from .aio import async_twin
from .audit import AuditReport, audit_slots
from .conf import Settings
from .controls import KeyControls
from .core import ERROR_TEXT_CHARS as ERROR_TEXT_CHARS
from .core import RUN_ID_MAX_LENGTH as RUN_ID_MAX_LENGTH
from .core import Core, TickJob, TickReport
from .core import StoreClock as StoreClock
from .definitions import Registry, registry
from .dispatcher import Dispatcher
from .explain import Explanation
from .explain import explain as explain_run
from .stores.base import BaseStore

# ERROR_TEXT_CHARS, RUN_ID_MAX_LENGTH, Dispatcher, StoreClock and TickReport are
# importable from here too (their homes: durable_singleton.core, .dispatcher).
__all__ = ["Engine"]

logger = logging.getLogger("durable_singleton")


def _forward[**P, R](attribute: str, method: Callable[Concatenate[Any, P], R]) -> Callable[Concatenate[Any, P], R]:
    """Return an engine method that calls ``method`` on the feature ``engine.<attribute>``:
    the same parameters and docstring, so the façade cannot drift from its feature."""

    @functools.wraps(method)
    def forwarded(self: Any, /, *args: P.args, **kwargs: P.kwargs) -> R:
        feature = getattr(self, attribute)
        result: R = getattr(feature, method.__name__)(*args, **kwargs)
        return result

    return forwarded


class Engine(Core):
    """Runs durable workflows over a store and a dispatcher.

    ``store``: a :class:`~durable_singleton.stores.base.BaseStore`.
    ``dispatcher``: a :class:`~durable_singleton.dispatcher.Dispatcher` that
    sends turns (Celery, the embedded worker, or manual).
    ``namespace``/``scope_reads``: D10; admission stays global (S11).
    ``settings``: a :class:`~durable_singleton.conf.Settings` (default: Django settings).
    ``clock``: returns the current aware datetime (default: the store's clock, R5).
    """

    def __init__(
        self,
        store: BaseStore,
        dispatcher: Dispatcher,
        *,
        registry: Registry = registry,
        namespace: str | None = None,
        scope_reads: bool | None = None,
        settings: Settings | None = None,
        clock: Callable[[], datetime] | None = None,
    ) -> None:
        super().__init__(
            store,
            dispatcher,
            registry=registry,
            namespace=namespace,
            scope_reads=scope_reads,
            settings=settings,
            clock=clock,
        )
        #: The runtime key controls (K2): :class:`~durable_singleton.controls.KeyControls`.
        self.controls = KeyControls(self)

    # -- the tick's features -------------------------------------------------
    def tick_jobs(self) -> list[TickJob]:
        """Return the core's tick jobs, then the schedules (S17) and retention (O2) jobs."""
        return [*super().tick_jobs(), ("schedules", self._tick_schedules), ("retention", self._tick_retention)]

    def _tick_schedules(self, report: TickReport) -> None:
        # Its own bounded batch (S17, S8b), windows decided on the store's clock (R8).
        schedules.fire_due_schedules(self, self.caller_now(), self.settings.TICK_BATCH)

    def _tick_retention(self, report: TickReport) -> None:
        retention.retention_batch(self, self.now())  # finished runs past RETENTION_SECONDS, bounded (O2, S8b)

    def after_tick(self, seconds: float) -> None:
        """Record the tick's heartbeat, which ``manage.py durable_health`` reads (O3),
        and its duration of ``seconds`` (the ``tick_finished`` signal, O4); never raises."""
        try:
            self.store.discard_broken_connection()
            heartbeat.record_tick(self, self.now(), seconds)
        except Exception:
            logger.exception("tick: recording the heartbeat failed")

    # -- reads of the features -----------------------------------------------
    def explain(self, run_id: str) -> Explanation:
        """Return why run ``run_id`` is where it is, as plain data and one sentence (K3).

        Raises :class:`~durable_singleton.exceptions.RunNotFoundError`.
        """
        return explain_run(self, run_id)

    def audit_slots(self, repair: bool = False) -> AuditReport:
        """Check the slot invariants (K4), repairing the safe findings if ``repair``: :mod:`durable_singleton.audit`."""
        return audit_slots(self, repair=repair)

    # -- the runtime key controls (K2), forwarded to ``self.controls`` ---------
    pause_key = _forward("controls", KeyControls.pause_key)
    resume_key = _forward("controls", KeyControls.resume_key)
    override_limit = _forward("controls", KeyControls.override_limit)
    pause_workflow = _forward("controls", KeyControls.pause_workflow)
    resume_workflow = _forward("controls", KeyControls.resume_workflow)
    override_workflow_limit = _forward("controls", KeyControls.override_workflow_limit)
    key_controls = _forward("controls", KeyControls.key_controls)
    control_history = _forward("controls", KeyControls.control_history)
    wake_key = _forward("controls", KeyControls.wake_key)

    # -- async twins -----------------------------------------------------------
    astart = async_twin(Core.start)
    aget = async_twin(Core.get)
    asignal = async_twin(Core.signal)
    acancel = async_twin(Core.cancel)


Engine.signal_sender = Engine
