#!/usr/bin/env bash
# Run pytest once per database (called by tools/test with DS_PG_URL,
# DS_MYSQL_URL and DS_REDIS_URL set), on SQLite with the other tested
# combinations: .venv-alt (Python 3.13 and Django 5.2, tools/bootstrap.sh alt)
# and .venv-dj60 (Python 3.12 and Django 6.0, tools/bootstrap.sh dj60), the
# static checks, Django's own tasks suite and the chaos soaks.
# Exits non-zero if any run failed or ran no test.
#
# The pass split: every test that touches the database of the run (the Django
# store, claims, transactions, the database clock, real worker processes) runs
# in every database pass. Vendor-agnostic tests (marker vendor_agnostic: pure
# Python, docs, packaging, the spin model, the pytest plugin's subprocesses,
# and the memory case of each store_kind test) run in the SQLite passes
# only: tests/conftest.py deselects them on PostgreSQL and MariaDB and says so
# in the summary. Slow tests run in the first SQLite pass, not in .venv-alt
# or .venv-dj60; the slow vendor-agnostic ones (spin model, wheel install,
# the pytest plugin's conformance run) are a job of their own.
#
# The jobs run side by side, DS_CI_JOBS at a time (default 3; a pass mostly
# waits on servers, worker processes and polls, so three keep the 2-core
# machine busy without starving the tests' bounds), longest first:
#   postgresql, mariadb, sqlite        the three database passes (.venv)
#   sqlite-slow-agnostic               -m "vendor_agnostic and slow" (the
#                                      spin model checks take minutes)
#   sqlite-alt, sqlite-dj60            .venv-alt and .venv-dj60, -m "not slow":
#                                      they leave out what the quick tier
#                                      does (worker processes, browsers,
#                                      wheels, the model machines and the
#                                      repeated F1/F5/F15 races on the Django
#                                      store, the handoff's racing engines,
#                                      the random schedules past seed 0)
#   checks                             ruff check, ruff format --check, mypy
#                                      --strict, sphinx -W -n
#   django-tasks-suite                 python -m tests.django_suite.run: the
#                                      installed Django's tests/tasks suite
#                                      against the django.tasks backend
# Each pytest pass gets its own Redis database (DS_REDIS_URL's /1, /2, ...:
# Celery's keys and its fanout channels are per database), its own test
# database (PostgreSQL and MariaDB: one server each; SQLite: a file per
# process, testproject/settings.py) and its own free ports. A job's output is
# printed whole when it ends. Then the chaos soaks run side by side, when
# nothing else runs (each needs the machine to reach its minimum of runs).
# DS_CI_JOBS=1 (or DS_CI_SERIAL=1) runs everything one at a time, in the
# foreground.
#
# The verdict: each pass writes a JUnit report and each pass, check and soak
# one line to artifacts/tests/results.jsonl; at the end tools/summary.py
# prints one table (passed, failed, skipped, xfailed and minutes per pass;
# runs, faults and violations per soak; ruff, mypy, sphinx), the failing
# tests by name, and last "total: N passed, N failed, N skipped".
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONDONTWRITEBYTECODE=1
status=0
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
reports=artifacts/tests
rm -rf "$reports"
mkdir -p "$reports"
results="$reports/results.jsonl"
jobs_at_once=${DS_CI_JOBS:-3}
[ "${DS_CI_SERIAL:-0}" = 1 ] && jobs_at_once=1
# record KIND NAME RC STARTED [EXTRA_JSON]: one line of results.jsonl (tools/summary.py).
record() {
  local seconds
  seconds=$(awk -v a="$4" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }')
  printf '{"kind": "%s", "name": "%s", "rc": %d, "started": %s, "seconds": %s%s}\n' \
    "$1" "$2" "$3" "$4" "$seconds" "${5:-}" >> "$results"
}
# check NAME CMD...: run a check and record it.
check() {
  local name="$1"; shift
  local started=$EPOCHREALTIME
  "$@"
  local rc=$?
  record check "$name" "$rc" "$started"
  return "$rc"
}
# redis_db N: DS_REDIS_URL with database N (empty without DS_REDIS_URL).
redis_db() {
  [ -n "${DS_REDIS_URL:-}" ] && printf '%s/%s' "${DS_REDIS_URL%/*}" "$1"
}
# run LABEL PYTHON VAR=VALUE...: one pytest pass with its JUnit report.
run() {
  local label="$1" python="$2"; shift 2
  local junit
  junit="$reports/pytest-$(printf '%s' "$label" | tr -cs 'A-Za-z0-9.' '-' | sed 's/-$//').xml"
  echo "=== pytest on ${label} ==="
  local started=$EPOCHREALTIME
  env "$@" "$python" -m pytest "${PYTEST_ARGS[@]}" --junitxml="$junit" -o junit_family=xunit1
  local rc=$?
  record pytest "$label" "$rc" "$started" ", \"junit\": \"$junit\", \"ok_rcs\": ${OK_RCS:-[0]}"
  if [ "$rc" -eq 5 ]; then
    echo "=== pytest on ${label} selected no test (exit 5) ==="
  elif [ "$rc" -ne 0 ]; then
    echo "=== pytest on ${label} failed (exit ${rc}) ==="
  fi
  return "$rc"
}
sphinx() {
  local docs_out rc
  docs_out=$(mktemp -d)
  .venv/bin/python -m sphinx -W --keep-going -n -q -b html docs "$docs_out"
  rc=$?
  rm -rf "$docs_out"
  return "$rc"
}

# -- the jobs -------------------------------------------------------------------
job_postgresql() {
  run postgresql .venv/bin/python DATABASE_URL="${DS_PG_URL:?}" CELERY_BROKER_URL="$(redis_db 1)"
}
job_mariadb() {
  run mariadb .venv/bin/python DATABASE_URL="${DS_MYSQL_URL:?}" CELERY_BROKER_URL="$(redis_db 2)"
}
job_sqlite() {
  local PYTEST_ARGS=(-m "not (vendor_agnostic and slow)" "${PYTEST_ARGS[@]}")
  run sqlite .venv/bin/python DATABASE_URL= CELERY_BROKER_URL="$(redis_db 3)"
}
job_sqlite_slow_agnostic() {
  local PYTEST_ARGS=(-m "vendor_agnostic and slow" "${PYTEST_ARGS[@]}")
  # 5: nothing selected (e.g. tools/test -k name); the SQLite pass counts its own.
  OK_RCS="[0, 5]" run "sqlite (the slow vendor-agnostic tests)" .venv/bin/python DATABASE_URL= CELERY_BROKER_URL=
  local rc=$?
  [ "$rc" -eq 5 ] && return 0
  return "$rc"
}
job_checks() {
  local rc=0
  echo "=== ruff check ==="
  check ruff .venv/bin/ruff check --quiet . || rc=1
  echo "=== ruff format --check ==="
  check ruff-format .venv/bin/ruff format --check --quiet . || rc=1
  echo "=== mypy --strict with the django-stubs plugin (setup.cfg [mypy]) ==="
  check mypy .venv/bin/python -m mypy || rc=1
  echo "=== docs: sphinx-build -W -n (warnings are errors, every reference resolves) ==="
  check sphinx sphinx || rc=1
  return "$rc"
}
job_django_tasks_suite() {
  echo "=== Django's own tests/tasks suite against the durable task backend (tests/django_suite) ==="
  check django-tasks-suite .venv/bin/python -m tests.django_suite.run
}
# other_pass VENV: the tests not marked slow on SQLite with another Python and
# Django (browser, packaging and real processes run in the default SQLite pass).
other_pass() {
  local venv="$1" combination
  if [ ! -x "$venv/bin/python" ]; then
    echo "=== $venv is missing: run bash tools/bootstrap.sh ${venv#.venv-} ==="
    record check "$venv (missing: bash tools/bootstrap.sh ${venv#.venv-})" 1 "$EPOCHREALTIME"
    return 1
  fi
  combination=$("$venv/bin/python" -c 'import sys, django; print(f"Python {sys.version_info[0]}.{sys.version_info[1]}, Django {django.get_version()}")')
  local PYTEST_ARGS=(-m "not slow" "${PYTEST_ARGS[@]}")
  run "sqlite (${combination})" "$venv/bin/python" DATABASE_URL= CELERY_BROKER_URL=
}
# Python 3.13 with Django 5.2 (.venv-alt), and Python 3.12 with Django 6.0 (.venv-dj60).
job_sqlite_alt() { other_pass .venv-alt; }
job_sqlite_dj60() { other_pass .venv-dj60; }

# -- the pool -------------------------------------------------------------------
# Longest first, so that the short jobs fill the slots at the end.
queue=(postgresql mariadb sqlite sqlite_slow_agnostic sqlite_alt sqlite_dj60 checks django_tasks_suite)
declare -A running=()
# finish PID: print the ended job's output and count its status.
finish() {
  local pid="$1" rc="$2" name="${running[$1]}"
  unset "running[$pid]"
  cat "$logs/$name"
  echo "=== job ${name} ended (exit ${rc}); $(( ${#running[@]} )) still running ==="
  [ "$rc" -eq 0 ] || status=1
}
PYTEST_ARGS=("$@")
for name in "${queue[@]}"; do
  if [ "$jobs_at_once" -le 1 ]; then
    "job_$name" || status=1
    continue
  fi
  while [ "${#running[@]}" -ge "$jobs_at_once" ]; do
    wait -n -p ended "${!running[@]}"
    finish "$ended" "$?"
  done
  "job_$name" > "$logs/$name" 2>&1 &
  running[$!]=$name
  echo "=== job ${name} started; its output follows when it ends ==="
done
while [ "${#running[@]}" -gt 0 ]; do
  wait -n -p ended "${!running[@]}"
  finish "$ended" "$?"
done

# The chaos soak of #12 (soak/, docs/reliability.rst): its own database (a server, or a
# SQLite file in its output folder), two groups of real Celery workers, three ticks and
# random faults for 165 s on each database, then the independent checker.
# DS_SOAK=0 skips it (e.g. with -k).
# With all of #18's workload (--features: namespaces, schedules, a stepped clock,
# retention of children), #20's (quotas: shared and fair quotas, queue TTLs) and #33's (controls:
# throttle, priority, debounce). The soaks run side by side (each has its own servers
# or file; one at a time with DS_CI_SERIAL=1). soak DB RATE MIN_RUNS: PostgreSQL and
# MariaDB start 20 runs a second; PostgreSQL must reach 3,000 runs, MariaDB 2,000 (two CI
# runs side by side, four soaks at load 25: PostgreSQL 3,648 and 3,692 in 480 s, MariaDB
# 2,482 and 2,796; alone each starts about 3,300 in 165 s). DS_SOAK_SQLITE=1 adds the
# SQLite soak beside them, at SQLITE_RATE with SQLITE_MIN_RUNS: off by default, since three
# side by side on the 2-core machine slow the other two into their --max-seconds extension
# (measured: the phase 307 s against about 195 s; docs/reliability.rst, "On SQLite").
# On a loaded machine (two CI runs side by side) the load goes on past 165 s until the
# minimum was started, for 480 s at most (--max-seconds): the soak still judges it.
MARIADB_MIN_RUNS=2000
SQLITE_RATE=6
SQLITE_MIN_RUNS=900
soak() {
  local db="$1" rate="$2" min_runs="$3" rc
  local started=$EPOCHREALTIME
  echo "=== chaos soak on ${db} (python -m soak) ==="
  timeout --kill-after=30 780 .venv/bin/python -m soak --db "$db" --seconds 165 --max-seconds 480 --rate "$rate" \
    --drain 120 --min-runs "$min_runs" --features namespaces,schedules,clock,retention,quotas,controls --out "artifacts/soak-ci-${db}"
  rc=$?
  record soak "$db" "$rc" "$started" ", \"summary\": \"artifacts/soak-ci-${db}/summary.json\""
  if [ "$rc" -ne 0 ]; then
    echo "=== chaos soak on ${db} failed: artifacts/soak-ci-${db}/summary.json ==="
  fi
  return "$rc"
}
if [ "${DS_SOAK:-1}" != 0 ]; then
  if [ "$jobs_at_once" -le 1 ]; then
    soak mariadb 20 "$MARIADB_MIN_RUNS" || status=1
    soak postgresql 20 3000 || status=1
    if [ "${DS_SOAK_SQLITE:-0}" = 1 ]; then
      soak sqlite "$SQLITE_RATE" "$SQLITE_MIN_RUNS" || status=1
    fi
  else
    soak mariadb 20 "$MARIADB_MIN_RUNS" > "$logs/soak-mariadb" 2>&1 &
    mariadb_pid=$!
    sqlite_pid=
    if [ "${DS_SOAK_SQLITE:-0}" = 1 ]; then
      soak sqlite "$SQLITE_RATE" "$SQLITE_MIN_RUNS" > "$logs/soak-sqlite" 2>&1 &
      sqlite_pid=$!
    fi
    soak postgresql 20 3000 || status=1
    wait "$mariadb_pid" || status=1
    cat "$logs/soak-mariadb"
    if [ -n "$sqlite_pid" ]; then
      wait "$sqlite_pid" || status=1
      cat "$logs/soak-sqlite"
    fi
  fi
fi
# The verdict, last: the harness reads the closing "total: N passed, N failed, N skipped".
.venv/bin/python tools/summary.py "$results" || status=1
exit $status
