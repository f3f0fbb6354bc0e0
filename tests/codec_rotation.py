"""One process of a rolling key rotation (tests/codecs/test_key_rotation.py).

    python -m tests.codec_rotation write RUN_ID TEXT [RUN_ID...]   start a run, execute its turn, read runs
    python -m tests.codec_rotation read RUN_ID...                  read runs back

The test project's settings on ``DATABASE_URL``, with the manual dispatcher
and the store ``DURABLE_STORE`` (``tests.codec_stores.EnvKeysStore``: its keys
come from this process's environment). Prints one JSON object: run id to
``{"input": ..., "output": ...}``, or to ``"PayloadDecodeError"`` when this
process cannot decode the run.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any


def echo(ctx: Any, input: Any) -> dict[str, Any]:
    """The body: its output repeats its input (encoded with this process's key)."""
    return {"echo": input}


def main(argv: list[str]) -> int:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "testproject.settings")
    import django

    django.setup()
    from durable_singleton.codecs import PayloadDecodeError
    from durable_singleton.runtime import get_engine

    engine = get_engine()
    action, *args = argv
    if action == "write":
        run_id, text, *others = args
        engine.registry.add("rotation-echo", "1", echo)
        engine.start("rotation-echo", {"text": text}, run_id=run_id)
        engine.dispatcher.drain()
        args = [run_id, *others]
    out: dict[str, Any] = {}
    for run_id in args:
        try:
            run = engine.get(run_id)
        except PayloadDecodeError:
            out[run_id] = "PayloadDecodeError"
        else:
            out[run_id] = {"input": run.input, "output": run.output, "status": run.status}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
