"""A process that makes debounced starts (X7) on the test database, for
tests/features/test_debounce.py's race of processes: ``python -m tests.features.debounce_starter
GO_FILE STARTS``. It declares the workflow ``sync-proc`` (debounce key = the
input's ``store``), waits until GO_FILE exists (so every process starts at
once), makes STARTS starts of store ``A`` and prints the run ids it was given,
one per line. The database is ``DATABASE_URL``'s."""

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
        "sync-proc",
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
    for n in range(starts):
        print(engine.start("sync-proc", {"store": "A", "n": os.getpid() * 1000 + n}).run_id, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2])))
