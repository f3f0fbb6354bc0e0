"""This process's name in the database: ``host:pid:token`` (O6, R5).

The name is the worker registry row's name, the prefix of the lease owner
of every turn this process claims (``host:pid:token:turn``), the tick
lease's and the tick heartbeat's owner. ``token`` is 8 random hex digits
made once per process start (again in a forked child), so two processes
that share a host name and a pid (containers with host networking and pid
1, a pid reused after a restart) never share a name: one's clean stop never
hands back the other's runs, and one killed is seen dead while the other
lives. Host and pid stay readable for operators.

The previous release named a process ``host:pid`` and its lease owners
``host:pid:turn``; :func:`owns` tells both shapes apart, so a rolling
deploy still recovers and shows the runs such a process leased.
"""

from __future__ import annotations

import os
import secrets
import socket

__all__ = ["owns", "process_name"]

_name: str | None = None


def process_name() -> str:
    """Return this process's name, ``host:pid:token`` (``token``: 8 hex
    digits, made at the first call in this process and again after a fork)."""
    global _name
    if _name is None:
        _name = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
    return _name


def _forget() -> None:
    global _name
    _name = None


os.register_at_fork(after_in_child=_forget)


def owns(name: str, owner: str) -> bool:
    """Tell whether lease ``owner`` is a turn of the process named ``name``:
    ``name:turn``, ``turn`` free of ``:``. That rule keeps the turns of a
    process ``host:pid:token`` out of the previous release's ``host:pid``
    of the same host and pid (and is no more than ``startswith`` otherwise).
    """
    prefix = f"{name}:"
    return owner.startswith(prefix) and ":" not in owner[len(prefix) :]
