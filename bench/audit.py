"""A light audit of body entry and exit, in Redis, shared by every system measured.

Each body calls :func:`enter` first and :func:`leave` last. ``enter`` raises a
per-key counter and keeps the highest value it ever reached (the highest
concurrency seen for that key); ``leave`` lowers it. Both append an event
``(kind, run, key, time, pid)`` to the scenario's list, and ``leave`` pushes
the run to the scenario's done list, which the runner waits on. One Redis
round trip each, so the audit costs every system the same.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import redis

_ENTER = """
local n = redis.call('INCR', KEYS[1])
local seen = tonumber(redis.call('HGET', KEYS[2], ARGV[1]) or '0')
if n > seen then redis.call('HSET', KEYS[2], ARGV[1], n) end
redis.call('RPUSH', KEYS[3], ARGV[2])
return n
"""
_LEAVE = """
redis.call('DECR', KEYS[1])
redis.call('RPUSH', KEYS[2], ARGV[1])
redis.call('RPUSH', KEYS[3], ARGV[2])
return 1
"""

_client: redis.Redis | None = None
_scripts: dict[str, Any] = {}


def client() -> redis.Redis:
    """Return this process's Redis client (``BENCH_REDIS_URL``, else ``CELERY_BROKER_URL``)."""
    global _client
    if _client is None:
        url = os.environ.get("BENCH_REDIS_URL") or os.environ["CELERY_BROKER_URL"]
        # Blocking pops below wait longer than redis-py's default socket timeout.
        _client = redis.Redis.from_url(url, socket_timeout=900, socket_connect_timeout=30)
        _scripts["enter"] = _client.register_script(_ENTER)
        _scripts["leave"] = _client.register_script(_LEAVE)
    return _client


def enter(tag: str, key: str, run: str) -> int:
    """Record that ``run``'s body entered for ``key`` in scenario ``tag``; return the key's concurrency."""
    client()
    now = time.time()
    return int(
        _scripts["enter"](
            keys=[f"bench:{tag}:conc:{key}", f"bench:{tag}:max", f"bench:{tag}:events"],
            args=[key, f"E|{run}|{key}|{now:.6f}|{os.getpid()}"],
        )
    )


def leave(tag: str, key: str, run: str) -> None:
    """Record that ``run``'s body left; push ``run`` to the scenario's done list."""
    client()
    now = time.time()
    _scripts["leave"](
        keys=[f"bench:{tag}:conc:{key}", f"bench:{tag}:events", f"bench:{tag}:done"],
        args=[f"X|{run}|{key}|{now:.6f}|{os.getpid()}", run],
    )


def hold(tag: str, timeout: float = 900.0) -> None:
    """Block until the runner releases scenario ``tag``'s holders (a blocking pop, no busy poll)."""
    r = client()
    deadline = time.monotonic() + timeout
    while not r.exists(f"bench:{tag}:release") and time.monotonic() < deadline:
        r.blpop([f"bench:{tag}:wake"], timeout=0.5)


def body(tag: str, key: str, run: str, holds: bool = False) -> None:
    """The near-empty body every system runs: audit in, optionally hold, audit out."""
    enter(tag, key, run)
    try:
        if holds:
            hold(tag)
    finally:
        leave(tag, key, run)


@dataclass(frozen=True)
class Event:
    """One audit event: ``kind`` is ``E`` (entered) or ``X`` (left); ``at`` in epoch seconds."""

    kind: str
    run: str
    key: str
    at: float
    pid: int


def events(tag: str) -> list[Event]:
    """Return scenario ``tag``'s events in the order Redis received them."""
    out = []
    for raw in client().lrange(f"bench:{tag}:events", 0, -1):
        kind, run, key, at, pid = raw.decode().split("|")
        out.append(Event(kind, run, key, float(at), int(pid)))
    return out


def max_concurrency(tag: str) -> dict[str, int]:
    """Return the highest concurrency seen per key in scenario ``tag``."""
    return {k.decode(): int(v) for k, v in client().hgetall(f"bench:{tag}:max").items()}


def done_count(tag: str) -> int:
    """Return how many bodies of scenario ``tag`` have left."""
    return int(client().llen(f"bench:{tag}:done"))


def release(tag: str) -> float:
    """Release scenario ``tag``'s holders; return the time of the release."""
    r = client()
    now = time.time()
    r.set(f"bench:{tag}:release", "1")
    r.rpush(f"bench:{tag}:wake", *["1"] * 8)
    return now
