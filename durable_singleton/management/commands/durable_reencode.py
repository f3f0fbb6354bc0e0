"""``manage.py durable_reencode``: rewrite stored payloads with the codec store's
current codec and first key (S13): after a key rotation, or to encode rows
written before the codec was configured."""

from __future__ import annotations

import json
from argparse import ArgumentParser
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from ...codecs import PayloadDecodeError
from ...runtime import get_engine
from ...stores.codec import CodecStore
from ._options import count_option

#: The most rows one --batch may name (a huge one was a LIMIT beyond bigint, section 7).
MAX_BATCH = 100_000


class Command(BaseCommand):
    help = (
        "Re-encode every stored payload (run input/output/error, step results, signal payloads, schedule "
        "inputs) with the configured codec store's codec: new writes already use the first key; this "
        "rewrites old rows so the old key can be dropped."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument(
            "--batch",
            type=int,
            default=500,
            help="Rows per transaction, 1 to 100000 (default 500; on SQLite at most 50).",
        )
        parser.add_argument("--dry-run", action="store_true", help="Count what would change; write nothing.")
        parser.add_argument("--json", action="store_true", help="Print the counts as JSON.")

    def handle(self, *args: Any, **options: Any) -> None:
        from ...stores.reencode import reencode_all

        count_option(options["batch"], "--batch", high=MAX_BATCH)
        store = get_engine().store
        if not isinstance(store, CodecStore):
            raise CommandError(
                f"the configured store is {type(store).__name__}, not a CodecStore: nothing to re-encode"
            )
        if store.inner.database is None:
            raise CommandError("re-encoding rewrites database rows; the codec store does not wrap a database store")
        try:
            counts = reencode_all(store, batch=options["batch"], dry_run=options["dry_run"])
        except PayloadDecodeError as exc:
            raise CommandError(f"a stored payload cannot be decoded with the configured keys: {exc}") from exc
        if options["json"]:
            self.stdout.write(json.dumps(counts, sort_keys=True))
            return
        verb = "would re-encode" if options["dry_run"] else "re-encoded"
        for table, (seen, changed) in counts.items():
            self.stdout.write(f"{table}: {verb} {changed} of {seen} rows")
