"""An optional trace of a turn's stages, for finding where a handoff's time goes (``--trace``).

With ``BENCH_TRACE=1`` every process records, per run, when its turn was
published to the broker, received by a worker, admitted, and finished, next to
the audit's entry and exit. Off by default: it adds Redis writes to each turn.
"""

from __future__ import annotations

import os
import time
from typing import Any

from . import audit

_KEY = "bench:trace"


def _record(stage: str, run_id: str) -> None:
    audit.client().rpush(_KEY, f"{stage}|{run_id}|{time.time():.6f}")


def _published(sender: Any = None, headers: Any = None, body: Any = None, **kwargs: Any) -> None:
    if sender == "durable_singleton.execute_run" and body:
        _record("sent", body[0][0])


def _prerun(sender: Any = None, args: Any = None, **kwargs: Any) -> None:
    if getattr(sender, "name", "") == "durable_singleton.execute_run" and args:
        _record("recv", args[0])


def _admitted(sender: Any, run: Any, **kwargs: Any) -> None:
    _record("admit", run.run_id)


def _finished(sender: Any, run: Any, **kwargs: Any) -> None:
    _record("fin", run.run_id)


def connect() -> None:
    """Connect the trace receivers if ``BENCH_TRACE`` is set."""
    if os.environ.get("BENCH_TRACE") != "1":
        return
    from celery.signals import after_task_publish, task_prerun

    from durable_singleton import signals

    after_task_publish.connect(_published, weak=False)
    task_prerun.connect(_prerun, weak=False)
    signals.run_admitted.connect(_admitted, weak=False)
    signals.run_finished.connect(_finished, weak=False)


def stages() -> dict[str, dict[str, list[float]]]:
    """Return, per run, the times of each traced stage."""
    out: dict[str, dict[str, list[float]]] = {}
    for raw in audit.client().lrange(_KEY, 0, -1):
        stage, run_id, at = raw.decode().split("|")
        out.setdefault(run_id, {}).setdefault(stage, []).append(float(at))
    return out
