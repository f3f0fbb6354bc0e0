"""A release's client: starts the runs the test asks for, one per stdin line.

``python -m rolling_app.client`` with ``DJANGO_SETTINGS_MODULE=rolling_app.settings``
and the release's source first on ``PYTHONPATH``. It prints ``ready``, then
reads lines ``<workflow> <run id> <input as JSON>`` and answers each with
``ok <run id>`` once the start committed, or ``error <run id> <reason>``.
It exits at the end of its input.
"""

from __future__ import annotations

import json
import sys

import django


def main() -> None:
    django.setup()
    from durable_singleton.runtime import get_engine

    engine = get_engine()
    print("ready", flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        workflow, run_id, payload = line.rstrip("\n").split(" ", 2)
        try:
            engine.start(workflow, json.loads(payload), run_id=run_id)
        except Exception as exc:  # reported to the test, which fails on it
            print(f"error {run_id} {type(exc).__name__}: {exc}".replace("\n", " "), flush=True)
        else:
            print(f"ok {run_id}", flush=True)


if __name__ == "__main__":
    main()
