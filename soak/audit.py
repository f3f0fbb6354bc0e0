"""The append-only audit the bodies write: one JSON object per line.

Every process appends to the file named by ``SOAK_AUDIT`` with ``O_APPEND``
and one ``write`` per line (lines stay far below the page size, so a line is
never interleaved with another process's). The file lives outside the
database and the broker, so a database restart or a rolled-back transaction
cannot erase what a body did: the checker (:mod:`soak.check`) trusts only it
and the final dump. Times are ``time.time()`` of the one machine (seconds).
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

_lock = threading.Lock()
_fd: int | None = None
_fd_pid: int | None = None


def _descriptor() -> int | None:
    global _fd, _fd_pid
    path = os.environ.get("SOAK_AUDIT")
    if not path:
        return None
    if _fd is None or _fd_pid != os.getpid():  # reopen after a fork
        _fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        _fd_pid = os.getpid()
    return _fd


def emit(kind: str, **fields: Any) -> None:
    """Append one event ``{"e": kind, "t": time.time(), "pid": os.getpid(), **fields}``;
    nothing when ``SOAK_AUDIT`` is unset (the soak's workflows imported elsewhere)."""
    with _lock:
        fd = _descriptor()
        if fd is None:
            return
        line = json.dumps({"e": kind, "t": time.time(), "pid": os.getpid(), **fields}, separators=(",", ":"))
        os.write(fd, line.encode() + b"\n")
