"""What one start costs the client under ``DISPATCH = "worker"`` (issue 31): wall and CPU ms per start.

Run it on a throwaway server with durable settings (a commit waits for its fsync)::

    python tools/services.py run --pg --durable -- bash -c 'DATABASE_URL=$DS_PG_URL python -m bench.start_cost'

Starts ``--runs`` runs of the test project's ``fault-hold`` workflow over 100
keys, one by one, with an engine built as a web process's (no worker: the
runs only wait), after 20 starts to warm the connection and prepared
statements; prints the statements of one start and the wall and CPU
milliseconds per start.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def main(argv: list[str]) -> int:
    """Measure; return 0."""
    parser = argparse.ArgumentParser(prog="bench.start_cost", description=__doc__)
    parser.add_argument("--runs", type=int, default=400, help="starts measured (default 400)")
    parser.add_argument("--dispatch", default="worker", help="DISPATCH of the starting engine (default worker)")
    args = parser.parse_args(argv)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "testproject.settings")
    import django

    django.setup()
    from django.conf import settings
    from django.core.management import call_command
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from durable_singleton.conf import Settings
    from durable_singleton.runtime import build_engine

    call_command("migrate", verbosity=0, interactive=False)
    conf = {**settings.DURABLE_SINGLETON, "DISPATCH": args.dispatch, "REDELIVERY_SECONDS": 600.0}
    engine = build_engine(Settings.from_mapping(conf))
    tag = f"cost{int(time.time())}"
    for n in range(20):
        engine.start("fault-hold", {"store_id": f"{tag}-warm{n}", "seconds": 0})
    with CaptureQueriesContext(connection) as seen:
        engine.start("fault-hold", {"store_id": f"{tag}-one", "seconds": 0})
    for query in seen.captured_queries:
        print("  ", query["sql"][:100])
    wall, cpu = time.perf_counter(), time.process_time()
    for n in range(args.runs):
        engine.start("fault-hold", {"store_id": f"{tag}-{n % 100}", "seconds": 0})
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    print(f"{connection.vendor}: {wall / args.runs * 1000:.2f} ms per start, {cpu / args.runs * 1000:.2f} ms CPU")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
