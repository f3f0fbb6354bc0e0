"""Short entries for working on the repository: ``.venv/bin/nox -s NAME``.

Every session runs in the repository's ``.venv`` (``bash tools/bootstrap.sh
test`` or ``bash tools/test`` makes it; nox comes with requirements/test.txt)
and creates no environment of its own:

* ``lint``: ``ruff check`` and ``ruff format --check`` (what CI checks);
* ``format``: ``ruff format`` and ``ruff check --fix`` (rewrites files);
* ``quick``: the quick tier, SQLite and the memory store, no external
  service: every test not marked ``slow`` or ``celery``, on one pytest-xdist
  worker per core (at most 4; each has its own SQLite file), in a few
  minutes (arguments after ``--`` go to pytest, e.g. ``-- tests/workers/test_tick.py
  -x``, or ``-- -n 0`` for one process);
* ``typecheck``: ``mypy --strict`` (setup.cfg); ``docs``: ``sphinx -W -n``;
* ``full``: the README's ``bash tools/test`` (every database, every tested
  Python and Django, the soaks, the checks; its verdict last).

tox.ini keeps the tested matrix of Python and Django versions.
"""

from __future__ import annotations

import sys
import tempfile

import nox

nox.options.default_venv_backend = "none"
nox.options.sessions = ["lint", "quick"]

PYTHON = sys.executable  # the .venv that runs nox
#: The quick tier's selection: no test that starts worker processes or a browser,
#: builds a wheel or runs a long loop (slow: the model machines and the repeated
#: F1/F5/F15 races on the Django store, the handoff's racing engines, the random
#: schedules past seed 0), none that needs Redis (celery).
QUICK = "not slow and not celery"


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check, as CI runs them."""
    session.run(PYTHON, "-m", "ruff", "check", ".")
    session.run(PYTHON, "-m", "ruff", "format", "--check", ".")


@nox.session(name="format")
def format_(session: nox.Session) -> None:
    """Rewrite the files: ruff format, then ruff check --fix."""
    session.run(PYTHON, "-m", "ruff", "format", ".")
    session.run(PYTHON, "-m", "ruff", "check", "--fix", ".")


@nox.session
def quick(session: nox.Session) -> None:
    """The quick tier: SQLite and the memory store, no external service."""
    session.run(
        PYTHON,
        "-m",
        "pytest",
        "-q",
        "-m",
        QUICK,
        "-n",
        "auto",
        "--maxprocesses",
        "4",
        *session.posargs,
        env={"DATABASE_URL": "", "CELERY_BROKER_URL": ""},
    )


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy --strict with the django-stubs plugin (setup.cfg [mypy])."""
    session.run(PYTHON, "-m", "mypy")


@nox.session
def docs(session: nox.Session) -> None:
    """sphinx-build -W -n: warnings are errors, every reference resolves."""
    with tempfile.TemporaryDirectory() as out:
        session.run(PYTHON, "-m", "sphinx", "-W", "--keep-going", "-n", "-q", "-b", "html", "docs", out)


@nox.session
def full(session: nox.Session) -> None:
    """The README's test command: bash tools/test (arguments go to every pytest run)."""
    session.run("bash", "tools/test", *session.posargs, external=True)
