"""The chaos soak of issue #12: real Celery workers, Redis and PostgreSQL or
MariaDB under random faults, checked afterwards by an independent checker.

``python -m soak --db postgresql`` (or ``mariadb``) starts its own servers
(tools/services.py), two groups of Celery workers, three racing ticks, a
random workload and a fault injector; then it drains, dumps the database and
runs :mod:`soak.check` over the bodies' append-only audit and the dump.
docs/reliability.rst has the guarantees checked and the figures.
"""
