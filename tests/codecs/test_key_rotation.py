"""Key rotation in a rolling deploy (S13, docs/codec.rst): two real Django
processes with different key settings share the DATABASE_URL database, as
the web and worker processes of a deploy do while it rolls out.

Each call of :func:`process` is a new ``python -m tests.codec_rotation``
process with its own keys (``tests.codec_stores.EnvKeysStore``): it writes a
run and executes its turn (input and output encoded with its key), or reads
runs back.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

import pytest
from cryptography.fernet import Fernet

from tests.celery_workers import REPO
from tests.worker_processes import test_database_url

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

OLD, NEW = Fernet.generate_key().decode(), Fernet.generate_key().decode()


def process(action: str, *args: str, key: str, decode_only: Sequence[str] = (), command: Sequence[str] = ()) -> Any:
    """Run one process with encode key ``key`` and ``decode_only`` keys; return its JSON output."""
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "testproject.settings",
        "DATABASE_URL": test_database_url(),
        "DURABLE_DISPATCH": "manual",
        "DURABLE_STORE": "tests.codec_stores.EnvKeysStore",
        "DS_PAYLOAD_KEY": key,
        "DS_PAYLOAD_DECODE_KEYS": ",".join(decode_only),
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    argv = [*command] if command else ["-m", "tests.codec_rotation", action, *args]
    done = subprocess.run(
        [sys.executable, *argv], cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, f"{argv} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return None if command else json.loads(done.stdout.strip().splitlines()[-1])


def readable(run_id: str, text: str) -> dict[str, Any]:
    return {run_id: {"input": {"text": text}, "output": {"echo": {"text": text}}, "status": "completed"}}


def test_the_documented_rotation_order_keeps_every_process_reading_every_run() -> None:
    """S13: a process that knows only the old key cannot read what a process
    encoding with the new key wrote (so the new key may not be first
    anywhere before every process decodes with it). In the documented order
    (the new key decode-only everywhere, then the switch, then re-encoding,
    then dropping the old key), every process reads every run at every step
    of the roll-out, whichever process wrote it."""
    # Every process encodes with OLD. Then, too early, one encodes with NEW.
    assert process("write", "r0", "before", key=OLD) == readable("r0", "before")
    process("write", "early", "too early", key=NEW, decode_only=[OLD])

    # Step 1, rolling: A holds NEW for decoding only, B not yet; both encode with OLD.
    process("write", "s1a", "step 1 by A", key=OLD, decode_only=[NEW])
    b_before = process("write", "s1b", "step 1 by B", "s1a", "r0", "early", key=OLD)
    assert b_before == {
        **readable("s1b", "step 1 by B"),
        **readable("s1a", "step 1 by A"),
        **readable("r0", "before"),
        "early": "PayloadDecodeError",  # why the order matters
    }

    # Step 2, rolling: A encodes with NEW while B is at step 1 (decodes NEW, encodes OLD).
    everything = ["r0", "early", "s1a", "s1b", "s2a", "s2b"]
    a_step_2 = process("write", "s2a", "step 2 by A", "r0", "early", "s1a", "s1b", key=NEW, decode_only=[OLD])
    b_step_1 = process("write", "s2b", "step 2 by B", *everything, key=OLD, decode_only=[NEW])
    for seen in (a_step_2, b_step_1):
        assert "PayloadDecodeError" not in seen.values(), seen
        assert {run["status"] for run in seen.values()} == {"completed"}
    assert b_step_1["s2a"] == readable("s2a", "step 2 by A")["s2a"]

    # Step 3, every process at step 2: re-encode under NEW. Step 4: drop OLD.
    process("reencode", key=NEW, decode_only=[OLD], command=["manage.py", "durable_reencode"])
    new_only = process("read", *everything, key=NEW)
    assert "PayloadDecodeError" not in new_only.values(), new_only
    assert new_only["s2b"] == readable("s2b", "step 2 by B")["s2b"]
