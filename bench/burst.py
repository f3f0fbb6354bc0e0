"""A burst producer: ``python -m bench.burst TAG KEY N`` starts N runs on KEY and prints its timing as JSON."""

from __future__ import annotations

import json
import os
import sys
import time


def main(argv: list[str]) -> int:
    """Start the runs; print ``{"runs", "seconds", "starts_per_s"}``."""
    tag, key, runs = argv[0], argv[1], int(argv[2])
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench.settings")
    import django

    django.setup()
    from durable_singleton.runtime import get_engine

    from . import audit
    from .workflows import WORKFLOW

    engine = get_engine()
    audit.client().incr(f"bench:{tag}:producers")
    started = time.time()
    for _ in range(runs):
        engine.start(WORKFLOW, {"tag": tag, "key": key})
    seconds = time.time() - started
    print(json.dumps({"runs": runs, "seconds": seconds, "starts_per_s": runs / seconds}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
