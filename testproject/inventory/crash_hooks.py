"""Test-only crash points for tests/core/test_handoff_crash_windows.py: a worker process
kills itself with SIGKILL at a named point of a named run's handoff.

Armed by two environment variables of the worker (unset: nothing happens,
no receiver is connected):

* ``DS_KILL_AT``: ``handoff:<run_id>`` kills the process that just committed
  the settle and handoff granting ``<run_id>`` a slot, inside
  ``run_admitted`` (sent by ``Core.hand_off`` after the commit and before the
  granted waiter's turn is run or sent); ``body:<run_id>`` kills the process
  whose claim of ``<run_id>`` committed, at the first statement of the body
  of workflow ``handoff-kill`` (before it does anything);
* ``DS_KILL_MARK``: a file the killing process creates first (``O_EXCL``:
  one kill across all worker processes sharing it), holding the kill's
  moment (``time.time()``, seconds) and the run as that process saw it.

The kill takes the whole Celery worker (its main process and its pool
processes, one process group since the tests start each worker in its own
session), or only this process when its group is not a worker's.
"""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

from durable_singleton import signals

__all__ = ["KILL_AT_ENV", "KILL_MARK_ENV", "connect", "maybe_kill"]

KILL_AT_ENV = "DS_KILL_AT"
KILL_MARK_ENV = "DS_KILL_MARK"


def _armed(phase: str, run_id: str) -> bool:
    return os.environ.get(KILL_AT_ENV) == f"{phase}:{run_id}" and bool(os.environ.get(KILL_MARK_ENV))


def maybe_kill(phase: str, run: Any) -> None:
    """SIGKILL this worker if ``DS_KILL_AT`` names ``phase`` and ``run`` and no
    process has fired the point yet (``DS_KILL_MARK`` does not exist)."""
    if not _armed(phase, run.run_id):
        return
    try:
        fd = os.open(os.environ[KILL_MARK_ENV], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return  # fired once already (another process, or this run's next turn)
    seen = {
        "phase": phase,
        "run_id": run.run_id,
        "pid": os.getpid(),
        "killed_at": time.time(),
        "status": run.status,
        "admitted": run.admitted,
        "lease_owner": run.lease_owner,
        "fencing_token": run.fencing_token,
        "recoveries": run.recoveries,
    }
    os.write(fd, json.dumps(seen).encode())
    os.fsync(fd)
    os.close(fd)
    group = os.getpgid(0)
    if group in (os.getpid(), os.getppid()):  # a worker's own session: the worker and its pool
        os.killpg(group, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def _on_admitted(sender: Any, run: Any, **kwargs: Any) -> None:
    maybe_kill("handoff", run)


def connect() -> None:
    """Connect the ``handoff`` crash point's receiver when ``DS_KILL_AT`` arms it."""
    if os.environ.get(KILL_AT_ENV, "").startswith("handoff:"):
        signals.run_admitted.connect(_on_admitted, dispatch_uid="testproject.crash_hooks.handoff")
