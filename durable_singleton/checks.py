"""Django system checks (ids ``durable_singleton.E0xx`` / ``W0xx``), SPEC section 7."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django.core import checks

__all__ = [
    "check_celery",
    "check_remote_workflows",
    "check_settings",
    "check_sqlite",
    "check_time_zone",
    "register",
    "remote_workflows",
    "unrouted_queues",
]

_JSON_CONTENT = frozenset({"json", "application/json"})


def _settings_or_none() -> Any:
    """The effective settings, or None when E001 reports them invalid."""
    from .conf import get_settings
    from .exceptions import ConfigurationError

    try:
        return get_settings()
    except ConfigurationError:
        return None


def check_settings(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """E001: each key of ``DURABLE_SINGLETON`` is known, of its type and in range;
    E002: ``STORE`` names a store the runtime can build.

    One E001 per problem, with a hint; the checks that compare settings
    (E004) run only once every value is valid.
    """
    from django.conf import settings as django_settings

    from .conf import problems
    from .exceptions import ConfigurationError
    from .stores.loading import store_class

    found = problems(getattr(django_settings, "DURABLE_SINGLETON", None))
    if found:
        return [checks.Error(message, hint=hint, id="durable_singleton.E001") for message, hint in found]
    settings = _settings_or_none()
    errors: list[checks.CheckMessage] = []
    try:
        store_class(settings.STORE)  # what the composition root builds (#16)
    except ConfigurationError as exc:
        errors.append(
            checks.Error(
                str(exc),
                hint="Use 'django', 'memory' or the dotted path of a BaseStore subclass built with no arguments.",
                id="durable_singleton.E002",
            )
        )
    if settings.DISPATCH not in ("celery", "worker", "thread", "manual"):
        errors.append(
            checks.Error(
                f"DISPATCH {settings.DISPATCH!r} is unknown.",
                hint="Use 'celery', 'worker', 'thread' or 'manual'.",
                id="durable_singleton.E003",
            )
        )
    if settings.DISPATCH == "worker" and settings.STORE != "django":
        errors.append(
            checks.Error(
                f"DISPATCH 'worker' needs the Django store, not STORE {settings.STORE!r}.",
                hint="durable_worker processes take turn notices from the database: set STORE to 'django', "
                "or DISPATCH to 'thread' for one process.",
                id="durable_singleton.E007",
            )
        )
    if settings.WORKER_HEARTBEAT_SECONDS * 2 > settings.WORKER_DEAD_SECONDS:
        errors.append(
            checks.Error(
                "WORKER_DEAD_SECONDS must be at least twice WORKER_HEARTBEAT_SECONDS.",
                hint="A worker refreshes its registry row every WORKER_HEARTBEAT_SECONDS; one late refresh "
                "must not make a live worker look dead and its runs be taken back (O6).",
                id="durable_singleton.E008",
            )
        )
    if settings.LEASE_RENEW_SECONDS >= settings.LEASE_SECONDS:
        errors.append(
            checks.Error(
                "LEASE_RENEW_SECONDS must be smaller than LEASE_SECONDS.",
                hint="Renew at most every third of the lease (docs/durability.rst).",
                id="durable_singleton.E004",
            )
        )
    # REDELIVERY_SECONDS 0 asks the tick to send every pending turn at once: duplicates are chosen there.
    if 0 < settings.REDELIVERY_SECONDS <= settings.DISPATCH_COALESCE_SECONDS:
        errors.append(
            checks.Error(
                "DISPATCH_COALESCE_SECONDS must be smaller than REDELIVERY_SECONDS.",
                hint="A start's first turn waits up to DISPATCH_COALESCE_SECONDS before it is sent; "
                "from REDELIVERY_SECONDS on the tick sends it again, so every coalesced start would "
                "be sent twice. Keep the window to a few milliseconds (default 0.005).",
                id="durable_singleton.E006",
            )
        )
    return errors


def check_sqlite(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """E010: SQLite needs ``transaction_mode = IMMEDIATE`` for a safe claim (S13, F16)."""
    from django.db import connections

    settings = _settings_or_none()
    if settings is None or settings.STORE != "django":
        return []
    alias = settings.DATABASE or "default"
    if alias not in connections.settings:
        return [checks.Error(f"DATABASE {alias!r} is not in DATABASES.", id="durable_singleton.E011")]
    db = connections.settings[alias]
    if db.get("ENGINE", "").endswith("sqlite3"):
        mode = str(db.get("OPTIONS", {}).get("transaction_mode", "")).upper()
        if mode != "IMMEDIATE":
            return [
                checks.Error(
                    f"SQLite database {alias!r} runs transactions in DEFERRED mode: concurrent claims "
                    "can fail with 'database is locked'.",
                    hint="Set DATABASES[...]['OPTIONS'] = {'transaction_mode': 'IMMEDIATE', 'timeout': 20}.",
                    id="durable_singleton.E010",
                )
            ]
    return []


def check_time_zone(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """E012/E013: on SQLite and MySQL/MariaDB stored times must be UTC, the database clock's zone (R5, S13a).

    Leases, wake times and deadlines are compared in SQL with the database's
    UTC clock. These databases have no time zone type: with ``USE_TZ = False``
    Django stores naive local times, and a ``DATABASES[...]['TIME_ZONE']``
    other than UTC stores times in that zone: every comparison is then off by the zone's
    offset (at UTC-5, a run with a one-hour timeout is cancelled at the
    first tick; a sleep ends at once).
    """
    from django.conf import settings as django_settings
    from django.db import connections

    settings = _settings_or_none()
    if settings is None or settings.STORE != "django":
        return []
    alias = settings.DATABASE or "default"
    if alias not in connections.settings:
        return []  # E011
    db = connections.settings[alias]
    engine = str(db.get("ENGINE", ""))
    if "sqlite3" not in engine and "mysql" not in engine:
        return []  # PostgreSQL stores time zones natively
    if not django_settings.USE_TZ:
        return [
            checks.Error(
                "USE_TZ is False: durable_singleton compares stored times with the database's UTC clock, "
                "and naive local times make leases, wake times and deadlines wrong by the zone's offset.",
                hint="Set USE_TZ = True (Django's default).",
                id="durable_singleton.E012",
            )
        ]
    zone = db.get("TIME_ZONE")
    if zone not in (None, "UTC", "Etc/UTC"):
        return [
            checks.Error(
                f"DATABASES[{alias!r}]['TIME_ZONE'] is {zone!r}: times are stored in that zone and compared "
                "with the database's UTC clock, so leases, wake times and deadlines are off by its offset.",
                hint="Leave DATABASES[...]['TIME_ZONE'] unset (UTC) for the database durable_singleton uses.",
                id="durable_singleton.E013",
            )
        ]
    return []


def _tick_queue(app: Any, entry: dict[str, Any]) -> str:
    """The Celery queue a beat ``entry`` of the tick sends to: its ``queue``
    option, else where the app's routes (``task_routes``) send the tick task,
    else the default queue."""
    options = entry.get("options") or {}
    queue = options.get("queue")
    if queue:
        return str(getattr(queue, "name", queue))
    from .tasks import TICK_TASK

    try:
        routed = app.amqp.Router().route({}, TICK_TASK).get("queue")
    except Exception:  # a route that cannot be evaluated here: judge by the default queue
        routed = None
    return str(getattr(routed, "name", None) or app.conf.task_default_queue)


def check_celery(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """W001: the tick is missing from the beat schedule; W003: the workers'
    tick threads are off and beat's tick shares a queue with turns (O5);
    E020: non-JSON serializer."""
    settings = _settings_or_none()
    if settings is None or settings.DISPATCH != "celery":
        return []
    try:
        from celery import current_app
    except ImportError:  # pragma: no cover - celery is a dependency
        return [checks.Error("DISPATCH is 'celery' but Celery is not installed.", id="durable_singleton.E021")]
    from .tasks import TICK_TASK

    conf = current_app.conf
    messages: list[checks.CheckMessage] = []
    schedule = conf.beat_schedule or {}
    ticks = [entry for entry in schedule.values() if entry.get("task") == TICK_TASK]
    if not ticks:
        messages.append(
            checks.Warning(
                "The durable_singleton tick is not in the Celery beat schedule: lost wake-ups, "
                "timers and recoveries will not be driven.",
                hint=(
                    "app.conf.beat_schedule.update(durable_singleton.tasks.beat_schedule()) in your Celery app; "
                    "or, without Celery, set DURABLE_SINGLETON = {'DISPATCH': 'worker'} and run "
                    "manage.py durable_worker (DISPATCH is 'celery' by default)."
                ),
                id="durable_singleton.W001",
            )
        )
    shared = sorted({_tick_queue(current_app, e) for e in ticks} & _turn_queues(current_app))
    if shared and not settings.CELERY_WORKER_TICK:
        messages.append(
            checks.Warning(
                f"CELERY_WORKER_TICK is False and the durable_singleton tick is sent to Celery queue "
                f"{shared[0]!r}, which also carries turns: bodies that hold every worker slot of that queue "
                "hold up the tick, and with it timers, recoveries and the catch-up (O5).",
                hint=(
                    "Leave CELERY_WORKER_TICK True (each worker's main process ticks under the tick's lease), "
                    "or send the tick to a queue of its own, beat_schedule(queue='durable_tick'), and run a "
                    "worker for it: celery -A yourproject worker -Q durable_tick -P solo -c 1 "
                    "(docs/operations.rst)."
                ),
                id="durable_singleton.W003",
            )
        )
    if conf.task_serializer != "json":
        messages.append(
            checks.Error(
                f"Celery task_serializer is {conf.task_serializer!r}; durable_singleton sends run ids as JSON.",
                hint="Set CELERY_TASK_SERIALIZER = 'json'.",
                id="durable_singleton.E020",
            )
        )
    accepted = list(conf.accept_content or ["json"])
    others = [c for c in accepted if c not in _JSON_CONTENT]
    if others or not accepted:
        # A worker that accepts pickle runs whatever a broker message says (section 7).
        messages.append(
            checks.Error(
                f"Celery accept_content is {accepted!r}: it accepts non-JSON content {others!r}.",
                hint="Set CELERY_ACCEPT_CONTENT = ['json'].",
                id="durable_singleton.E020",
            )
        )
    return messages


def _turn_queues(app: Any, registry: Any = None) -> set[str]:
    """The Celery queues turns are sent to: the default queue and each
    registered workflow's ``queue``."""
    if registry is None:
        from .definitions import registry
    with registry._lock:
        queues = {d.queue for d in registry.latest.values() if d.queue}
    return {str(app.conf.task_default_queue), *queues}


def remote_workflows(registry: Any = None) -> list[tuple[str, str]]:
    """Return (name, queue) of every remote workflow of ``registry`` (default: the
    process-wide one), by name: their bodies run only in another service's
    Celery worker (``Engine.register_remote``)."""
    if registry is None:
        from .definitions import registry
    with registry._lock:
        found = [(d.name, d.queue or "") for d in registry.latest.values() if d.remote]
    return sorted(found)


def unrouted_queues(names: Sequence[str], registry: Any = None) -> list[str]:
    """Return the queues of ``names`` that no workflow of ``registry`` (default: the
    process-wide one) sends its turns to, in their order: neither ``"default"`` (the
    queue of workflows declared without one) nor a workflow's ``queue``. A worker given
    such a queue (``durable_worker --queues``) takes its turns only if something else
    sends some there; a misspelled name leaves its queue's runs without a worker."""
    if registry is None:
        from .definitions import registry
    with registry._lock:
        routed = {"default", *(d.queue for d in registry.latest.values() if d.queue)}
    return [name for name in names if name not in routed]


def check_remote_workflows(
    app_configs: Any = None, *, registry: Any = None, **kwargs: Any
) -> list[checks.CheckMessage]:
    """E005: a remote workflow needs ``DISPATCH = "celery"`` (section 2, #18).

    Its turns must reach its queue's Celery worker in the other service; a
    thread or manual dispatcher runs them in this process, which has no body
    and hands each turn back to itself without end.
    """
    settings = _settings_or_none()
    if settings is None or settings.DISPATCH == "celery":
        return []
    remote = remote_workflows(registry)
    if not remote:
        return []
    names = ", ".join(f"{name!r} (queue {queue!r})" for name, queue in remote)
    return [
        checks.Error(
            f"DISPATCH is {settings.DISPATCH!r} but remote workflows are registered: {names}. Their turns "
            "cannot reach the other service's workers and bounce in this process without end.",
            hint="Set DURABLE_SINGLETON['DISPATCH'] = 'celery' where remote workflows are declared, "
            "or declare them only in the processes that dispatch with Celery.",
            id="durable_singleton.E005",
        )
    ]


def check_queue_ttls(app_configs: Any = None, *, registry: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """W002: a workflow's ``queue_ttl`` (X2) at most ``REDELIVERY_SECONDS``.

    A start's first turn that does not arrive (a start in a process whose
    dispatcher is not the workers', a ``manage.py shell`` beside
    ``durable_worker``; a lost broker send, F4) is sent again by the tick only
    after ``REDELIVERY_SECONDS``: by then such a TTL has passed, and the tick
    ends the run ``queue_ttl_expired`` even on an idle key.
    """
    settings = _settings_or_none()
    if settings is None:
        return []
    if registry is None:
        from .definitions import registry
    with registry._lock:
        short = sorted(
            (d.name, float(d.singleton.queue_ttl))
            for d in registry.latest.values()
            if d.singleton is not None
            and d.singleton.queue_ttl is not None
            and d.singleton.queue_ttl <= settings.REDELIVERY_SECONDS
        )
    return [
        checks.Warning(
            f"workflow {name!r} has queue_ttl={ttl:g} s, at most REDELIVERY_SECONDS "
            f"({settings.REDELIVERY_SECONDS:g} s): a run whose first turn does not arrive is sent again "
            "only after REDELIVERY_SECONDS, past its TTL, and is ended queue_ttl_expired even on an idle key.",
            hint="Give the workflow a queue_ttl longer than REDELIVERY_SECONDS (docs/queue_ttl.rst).",
            id="durable_singleton.W002",
        )
        for name, ttl in short
    ]


def register() -> None:
    """Register the checks with Django (called from ``ready()``)."""
    checks.register(check_settings, "durable_singleton")
    checks.register(check_sqlite, "durable_singleton")
    checks.register(check_time_zone, "durable_singleton")
    checks.register(check_celery, "durable_singleton")
    checks.register(check_remote_workflows, "durable_singleton")
    checks.register(check_queue_ttls, "durable_singleton")
