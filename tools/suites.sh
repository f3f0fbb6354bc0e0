#!/usr/bin/env bash
# Run pytest once per database (called by tools/test with DS_PG_URL,
# DS_MYSQL_URL and DS_REDIS_URL set), then once more on SQLite with the other
# tested combination in .venv-alt (Python 3.13 and Django 5.2, see
# tools/bootstrap.sh alt). Exits non-zero if any run failed or ran no test.
#
# The pass split: every test that touches the database of the run (the Django
# store, claims, transactions, the database clock, real worker processes) runs
# in every database pass. Vendor-agnostic tests (marker vendor_agnostic: pure
# Python, docs, packaging, the spin model, the pytest plugin's subprocesses,
# and the memory case of each store_kind test) run in the two SQLite passes
# only: tests/conftest.py deselects them on PostgreSQL and MariaDB and says so
# in the summary. Slow tests run in the first SQLite pass, not in .venv-alt.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONDONTWRITEBYTECODE=1
status=0
run() {
  local label="$1" python="$2"; shift 2
  echo "=== pytest on ${label} ==="
  env "$@" "$python" -m pytest "${PYTEST_ARGS[@]}"
  local rc=$?
  if [ "$rc" -ne 0 ]; then
    echo "=== pytest on ${label} failed (exit ${rc}) ==="
    status=1
  fi
}
PYTEST_ARGS=("$@")
.venv/bin/ruff check --quiet . || status=1
echo "=== mypy --strict with the django-stubs plugin (setup.cfg [mypy]) ==="
.venv/bin/python -m mypy || status=1
echo "=== docs: sphinx-build -W -n (warnings are errors, every reference resolves) ==="
docs_out=$(mktemp -d)
.venv/bin/python -m sphinx -W --keep-going -n -q -b html docs "$docs_out" || status=1
rm -rf "$docs_out"
run sqlite .venv/bin/python DATABASE_URL= CELERY_BROKER_URL="${DS_REDIS_URL:-}"
run postgresql .venv/bin/python DATABASE_URL="${DS_PG_URL:?}" CELERY_BROKER_URL="${DS_REDIS_URL:?}"
run mariadb .venv/bin/python DATABASE_URL="${DS_MYSQL_URL:?}" CELERY_BROKER_URL="${DS_REDIS_URL:?}"
# The chaos soak of #12 (soak/, docs/reliability.rst): its own servers, two groups of real
# Celery workers, three ticks and random faults for 150 s on each database, then the
# independent checker; at least 3,000 runs each. DS_SOAK=0 skips it (e.g. with -k).
if [ "${DS_SOAK:-1}" != 0 ]; then
  for db in postgresql mariadb; do
    echo "=== chaos soak on ${db} (python -m soak) ==="
    if ! timeout --kill-after=30 600 .venv/bin/python -m soak --db "$db" --seconds 150 --rate 20 --drain 120 \
      --min-runs 3000 --out "artifacts/soak-ci-${db}"; then
      echo "=== chaos soak on ${db} failed: artifacts/soak-ci-${db}/summary.json ==="
      status=1
    fi
  done
fi
if [ -x .venv-alt/bin/python ]; then
  alt=$(.venv-alt/bin/python -c 'import sys, django; print(f"Python {sys.version_info[0]}.{sys.version_info[1]}, Django {django.get_version()}")')
  # The other combination runs what is not marked slow (browser, packaging, real
  # processes run in the default SQLite pass above): it keeps CI well under 30 minutes.
  PYTEST_ARGS=(-m "not slow" "${PYTEST_ARGS[@]}")
  run "sqlite (${alt})" .venv-alt/bin/python DATABASE_URL= CELERY_BROKER_URL=
else
  echo "=== .venv-alt is missing: run bash tools/bootstrap.sh alt ==="
  status=1
fi
exit $status
