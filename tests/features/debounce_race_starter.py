"""A process that makes debounced starts (X7) on the test database, for
tests/features/test_debounce_races.py: ``python -m tests.features.debounce_race_starter
GO_FILE STARTS``. It declares ``sync-race`` (debounce key = the input's
``store``), waits until GO_FILE exists, makes STARTS starts, three of each store
``K0``, ``K1``, ... in turn, and prints ``start <run id> <n> <the run's start
time as returned> <store>`` for each."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path


def main(go_file: str, starts: int) -> int:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "testproject.settings")
    import django

    django.setup()
    from durable_singleton import Debounce
    from durable_singleton.definitions import registry
    from durable_singleton.runtime import get_engine

    registry.add(
        "sync-race",
        "1",
        lambda ctx, input: None,
        debounce=Debounce(key=lambda i: i["store"], seconds=3600, max_seconds=7200),
    )
    engine = get_engine()
    print("ready", flush=True)
    deadline = time.monotonic() + 120
    while not Path(go_file).exists():
        if time.monotonic() > deadline:
            return 2
        time.sleep(0.01)
    for i in range(starts):
        n = os.getpid() * 1000 + i
        store = f"K{i // 3}"  # a new key every third start: every process races its first start
        run = engine.start("sync-race", {"store": store, "n": n})
        assert run.not_before is not None
        print("start", run.run_id, n, run.not_before.isoformat(), store, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2])))
