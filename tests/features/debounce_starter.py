"""A process that makes debounced starts (X7) on the test database, for the
races of processes in tests/features/test_debounce.py and
test_debounce_races.py: ``python -m tests.features.debounce_starter GO_FILE
STARTS MODE``. It declares the workflow ``sync-MODE`` (debounce key = the
input's ``store``), prints ``ready``, waits until GO_FILE exists (so every
process starts at once) and makes STARTS starts. The database is
``DATABASE_URL``'s.

* MODE ``proc``: every start is of store ``A``; prints the run id it was
  given, one per line.
* MODE ``race``: three starts of each store ``K0``, ``K1``, ... in turn;
  prints ``start <run id> <n> <the run's start time as returned> <store>`` for
  each.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path


def main(go_file: str, starts: int, mode: str) -> int:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "testproject.settings")
    import django

    django.setup()
    from durable_singleton import Debounce
    from durable_singleton.definitions import registry
    from durable_singleton.runtime import get_engine

    workflow = f"sync-{mode}"
    registry.add(
        workflow,
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
        if mode == "proc":
            print(engine.start(workflow, {"store": "A", "n": n}).run_id, flush=True)
            continue
        store = f"K{i // 3}"  # a new key every third start: every process races its first start
        run = engine.start(workflow, {"store": store, "n": n})
        assert run.not_before is not None
        print("start", run.run_id, n, run.not_before.isoformat(), store, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2]), sys.argv[3]))
