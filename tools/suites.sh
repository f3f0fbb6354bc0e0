#!/usr/bin/env bash
# Run pytest once per database (called by tools/test with DS_PG_URL,
# DS_MYSQL_URL and DS_REDIS_URL set). Exits non-zero if any run failed or
# ran no test.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONDONTWRITEBYTECODE=1
status=0
run() {
  local label="$1"; shift
  echo "=== pytest on ${label} ==="
  env "$@" .venv/bin/python -m pytest "${PYTEST_ARGS[@]}"
  local rc=$?
  if [ "$rc" -ne 0 ]; then
    echo "=== pytest on ${label} failed (exit ${rc}) ==="
    status=1
  fi
}
PYTEST_ARGS=("$@")
.venv/bin/ruff check --quiet . || status=1
echo "=== docs: sphinx-build -W -n (warnings are errors, every reference resolves) ==="
docs_out=$(mktemp -d)
.venv/bin/python -m sphinx -W --keep-going -n -q -b html docs "$docs_out" || status=1
rm -rf "$docs_out"
run sqlite DATABASE_URL= CELERY_BROKER_URL="${DS_REDIS_URL:-}"
run postgresql DATABASE_URL="${DS_PG_URL:?}" CELERY_BROKER_URL="${DS_REDIS_URL:?}"
run mariadb DATABASE_URL="${DS_MYSQL_URL:?}" CELERY_BROKER_URL="${DS_REDIS_URL:?}"
exit $status
