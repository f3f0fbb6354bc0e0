"""``manage.py durable_demo``: the reference text's live picture, for real.

Part of the test project (``testproject.demo``), not of the installed app.

Three keys with one slot each; a burst on the first key backs up only its
lane while the others run. Lanes are drawn from the database; the verdict at
the end is computed from the stored runs and the body audits (see
docs/demo.rst).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from django.conf import settings as django_settings
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import connection

from durable_singleton.admission import ACTIVE_STATUSES
from durable_singleton.conf import get_settings
from durable_singleton.definitions import registry
from durable_singleton.dispatch import CeleryDispatcher, ThreadDispatcher
from durable_singleton.engine import Engine
from durable_singleton.runtime import build_store
from testproject.demo import live as demo
from testproject.inventory.models import BodyAudit

WORKFLOW = "demo-sync-inventory"
READY_TIMEOUT = 60.0
STOP_TIMEOUT = 15.0


class _Raw:
    """A file for rich that writes through the command's stdout without added newlines."""

    def __init__(self, out: Any) -> None:
        self.out = out

    def write(self, text: str) -> int:
        self.out.write(text, ending="")
        return len(text)

    def flush(self) -> None:
        self.out.flush()

    def isatty(self) -> bool:
        return bool(getattr(self.out, "isatty", lambda: False)())


class Command(BaseCommand):
    help = (
        "Run the live singleton demo: several keys with LIMIT slots each, a burst on the first key. "
        "Embedded mode (default) runs the in-process worker; distributed mode (PostgreSQL or MySQL and a "
        "redis:// CELERY_BROKER_URL) starts separate Celery worker processes. Deletes earlier demo runs first. "
        "Exits non-zero if the verdict fails."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--keys", default="A,B,C", help="Comma-separated store ids (default: A,B,C).")
        parser.add_argument("--burst", type=int, default=6, help="Runs started on the first key (default: 6).")
        parser.add_argument("--runs-per-key", type=int, default=2, help="Runs on each other key (default: 2).")
        parser.add_argument("--limit", type=int, default=1, help="Slots per key (default: 1).")
        parser.add_argument("--duration", type=float, default=0.6, help="Body duration in seconds (default: 0.6).")
        parser.add_argument(
            "--workers",
            type=int,
            default=None,
            help=(
                "Embedded: worker threads (default: limit x keys, so every key's slots can run at once); "
                "distributed: Celery worker processes (default: 2)."
            ),
        )
        parser.add_argument(
            "--concurrency", type=int, default=2, help="Distributed: prefork children per worker (default: 2)."
        )
        parser.add_argument("--timeout", type=float, default=120.0, help="Give up after this many seconds.")
        parser.add_argument(
            "--mode",
            choices=("auto", "embedded", "distributed"),
            default="auto",
            help="auto: distributed on PostgreSQL/MySQL with a redis:// broker and DISPATCH 'celery', else embedded.",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        stores = [s.strip() for s in options["keys"].split(",") if s.strip()]
        if not stores or len(set(stores)) != len(stores):
            raise CommandError("--keys needs distinct, non-empty store ids")
        mode = self._mode(options["mode"])
        if options["workers"] is None:
            # Embedded: one thread per slot of every key, so a burst on one key
            # never leaves another key's free slot waiting for a thread.
            options["workers"] = options["limit"] * len(stores) if mode == "embedded" else 2
        for name in ("burst", "runs_per_key", "limit", "workers", "concurrency"):
            if options[name] < (0 if name == "runs_per_key" else 1):
                raise CommandError(f"--{name.replace('_', '-')} is too small: {options[name]}")
        if options["duration"] < 0:
            raise CommandError("--duration must be >= 0")
        limit = options["limit"]

        conf = get_settings()
        store = build_store(conf)
        if mode == "embedded":
            dispatcher: Any = ThreadDispatcher(store, options["workers"], conf.TICK_SECONDS)
        else:
            dispatcher = CeleryDispatcher(store)
        # This process and the worker processes agree on the slot count: here
        # by a registry variant, there by DURABLE_DEMO_LIMIT read at import.
        engine = Engine(store, dispatcher, registry=demo.with_limit(registry, WORKFLOW, limit), settings=conf)
        dispatcher.bind(engine)

        from durable_singleton.models import Run

        Run.objects.filter(workflow_name=WORKFLOW).delete()
        BodyAudit.objects.filter(workflow_name=WORKFLOW).delete()

        session = uuid.uuid4().hex[:6]
        plan = [(stores[0], n) for n in range(1, options["burst"] + 1)]
        plan += [(s, n) for n in range(1, options["runs_per_key"] + 1) for s in stores[1:]]
        labels = {f"demo-{session}-{s}-{n:02d}": f"{s}{n}" for s, n in plan}
        keys = [f"store:{s}" for s in stores]
        limits = dict.fromkeys(keys, limit)

        workers: list[tuple[subprocess.Popen[bytes], Path]] = []
        log_dir = Path(tempfile.mkdtemp(prefix="durable-demo-"))
        try:
            if mode == "embedded":
                dispatcher.start()
                where = f"embedded, {options['workers']} threads, {connection.vendor}"
            else:
                workers = self._start_workers(options["workers"], options["concurrency"], limit, log_dir)
                where = f"{options['workers']} Celery workers x{options['concurrency']}, {connection.vendor}"
            for store_id, n in plan:
                run_id = f"demo-{session}-{store_id}-{n:02d}"
                engine.start(WORKFLOW, {"store_id": store_id, "duration": options["duration"]}, run_id=run_id)
            finished = self._watch(engine, mode, keys, limits, labels, options, where)
        except KeyboardInterrupt:
            raise CommandError("interrupted; the next demo deletes the runs left behind") from None
        finally:
            if mode == "embedded":
                dispatcher.stop()
            self._stop_workers(workers)

        runs = Run.objects.filter(run_id__in=list(labels)).values(
            "run_id", "singleton_key", "created_at", "status", "attempts"
        )
        audits = BodyAudit.objects.filter(run_id__in=list(labels)).values("run_id", "entered_at", "exited_at")
        verdict = demo.judge(demo.records_from_rows(runs, audits), limits)
        self.stdout.write("")
        self.stdout.write(f"Verdict, from {len(labels)} stored runs and their body audits:")
        for line in verdict.lines(label=lambda run_id: labels.get(run_id, run_id)):
            self.stdout.write("  " + line if not line.startswith(("PASS", "FAIL")) else line)
        if not finished:
            self.stdout.write(f"(gave up after {options['timeout']:.0f} s)")
        if not verdict.ok:
            if workers:
                self.stdout.write(f"worker logs: {log_dir}")
            raise CommandError("the demo's verdict is FAIL")

    def _mode(self, requested: str) -> str:
        """Pick embedded or distributed; refuse distributed without its servers."""
        broker = str(getattr(django_settings, "CELERY_BROKER_URL", "") or "")
        capable = connection.vendor in ("postgresql", "mysql") and broker.startswith(("redis://", "rediss://"))
        if requested == "distributed" and not capable:
            raise CommandError(
                "distributed mode needs DATABASE_URL on PostgreSQL or MySQL and CELERY_BROKER_URL=redis://..."
                f" (database: {connection.vendor}, broker: {broker or 'unset'})"
            )
        if requested == "auto":
            return "distributed" if capable and get_settings().DISPATCH == "celery" else "embedded"
        return requested

    def _watch(
        self,
        engine: Engine,
        mode: str,
        keys: list[str],
        limits: dict[str, int],
        labels: dict[str, str],
        options: dict[str, Any],
        where: str,
    ) -> bool:
        """Follow the runs about four times a second until every run is terminal
        or the timeout passes; in distributed mode also run the tick every
        TICK_SECONDS. On a terminal the lanes redraw in place, fitted to its
        width (80 columns included); elsewhere (a pipe, a log) each change of a
        lane prints one line of at most 80 characters, so the whole run is
        kept, not only its last frame. Return whether every run finished."""
        from rich.console import Console
        from rich.live import Live

        from durable_singleton.models import Run

        title = f"burst of {options['burst']} on {keys[0]}, {options['limit']} slot(s) per key: {where}"
        console = Console(file=_Raw(self.stdout), emoji=False, highlight=False)  # type: ignore[arg-type]
        started = time.monotonic()
        next_tick = started + engine.settings.TICK_SECONDS
        ids = list(labels)

        def label(run_id: str) -> str:
            return labels.get(run_id, run_id)

        def state() -> tuple[list[demo.Lane], str, bool]:
            # Counted before the lanes are read: once none is active, the lanes read after are the last ones.
            active = Run.objects.filter(run_id__in=ids, status__in=ACTIVE_STATUSES).count()
            lanes = demo.load_lanes(WORKFLOW, keys, limits, ids)
            parked = sum(len(lane.waiters) for lane in lanes)
            ready = sum(len(lane.ready) for lane in lanes)
            caption = (
                f"{time.monotonic() - started:4.1f} s  {len(ids) - active}/{len(ids)} finished  "
                f"{parked} wait for their key (parked), {ready} for a worker"
            )
            return lanes, caption, active == 0

        def step() -> None:
            nonlocal next_tick
            time.sleep(0.25)
            if mode == "distributed" and time.monotonic() >= next_tick:
                engine.tick()
                next_tick = time.monotonic() + engine.settings.TICK_SECONDS

        lanes, caption, finished = state()
        if not console.is_terminal:
            self.stdout.write(title)
            shown: dict[str, str] = {}
            while True:
                elapsed = time.monotonic() - started
                for lane in lanes:
                    line = demo.lane_line(lane, label=label, width=72)
                    if shown.get(lane.key) != line:
                        shown[lane.key] = line
                        self.stdout.write(f"{elapsed:5.1f} s {line}")
                if finished or elapsed >= options["timeout"]:
                    break
                step()
                lanes, caption, finished = state()
            self.stdout.write(caption.strip())
            return finished
        table = demo.render_lanes(lanes, title=title, caption=caption, label=label)
        with Live(table, console=console, refresh_per_second=4, auto_refresh=False) as live:
            while not finished and time.monotonic() - started < options["timeout"]:
                step()
                lanes, caption, finished = state()
                live.update(demo.render_lanes(lanes, title=title, caption=caption, label=label), refresh=True)
        return finished

    def _start_workers(
        self, count: int, concurrency: int, limit: int, log_dir: Path
    ) -> list[tuple[subprocess.Popen[bytes], Path]]:
        """Start ``count`` Celery worker processes on this command's database and
        broker; wait until each logs that it is ready."""
        env = {
            **os.environ,
            "DATABASE_URL": demo.database_url(connection.settings_dict),
            "CELERY_BROKER_URL": str(django_settings.CELERY_BROKER_URL),
            "DURABLE_DISPATCH": "celery",
            "DURABLE_DEMO_LIMIT": str(limit),
        }
        cwd = Path(django_settings.BASE_DIR)
        workers = []
        try:
            for n in range(count):
                log = log_dir / f"worker-{n}.log"
                with open(log, "wb") as out:
                    proc = subprocess.Popen(
                        [sys.executable, "-m", "celery", "-A", "testproject", "worker", "--loglevel=INFO",
                         f"--concurrency={concurrency}", "-n", f"demo{n}-{os.getpid()}@%h",
                         "--without-gossip", "--without-mingle", "--without-heartbeat", "--disable-prefetch"],
                        cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                    )  # fmt: skip
                workers.append((proc, log))
            self.stdout.write(f"starting {count} Celery worker processes (logs in {log_dir}) ...")
            deadline = time.monotonic() + READY_TIMEOUT
            for proc, log in workers:
                while b" ready." not in log.read_bytes():
                    if proc.poll() is not None:
                        raise CommandError(f"a Celery worker exited with {proc.returncode}; see {log}")
                    if time.monotonic() > deadline:
                        raise CommandError(f"a Celery worker was not ready within {READY_TIMEOUT:.0f} s; see {log}")
                    time.sleep(0.1)
        except BaseException:
            self._stop_workers(workers)
            raise
        return workers

    @staticmethod
    def _stop_workers(workers: list[tuple[subprocess.Popen[bytes], Path]]) -> None:
        """Warm-stop each worker by its PID (SIGTERM), then SIGKILL its group if it lingers."""
        for proc, _ in workers:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc, _ in workers:
            try:
                proc.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(STOP_TIMEOUT)
