#!/usr/bin/env bash
# Create .venv with Python 3.12 and install the project.
#   tools/bootstrap.sh          the app, the test project and the demo
#   tools/bootstrap.sh test     also the test, database and browser dependencies
#   tools/bootstrap.sh alt      .venv-alt: the test dependencies on the other
#                               tested combination, Python 3.13 (3.12 if none is
#                               found) with Django 5.2, for CI's second SQLite run
#   tools/bootstrap.sh dj60     .venv-dj60: the test dependencies on Python 3.12
#                               with Django 6.0, for CI's short Django 6.0 run
set -euo pipefail
cd "$(dirname "$0")/.."

find_python() {
  local candidate
  for candidate in "${PYTHON:-}" python3.12 /root/.pyenv/versions/3.12*/bin/python3.12 /usr/bin/python3.12 python3.13 python3; do
    [ -n "$candidate" ] || continue
    if PYENV_VERSION="$(ls /root/.pyenv/versions 2>/dev/null | grep '^3\.12' | tail -1)" "$candidate" -c 'import sys; assert sys.version_info >= (3, 12)' 2>/dev/null; then
      echo "$candidate"; return 0
    fi
  done
  echo "no Python >= 3.12 found; set PYTHON=/path/to/python3.12" >&2
  return 1
}

if [ "${1:-base}" = "alt" ]; then
  alt=""
  for candidate in "${PYTHON_ALT:-}" python3.13 /root/.pyenv/versions/3.13*/bin/python3.13 /usr/bin/python3.13; do
    if [ -n "$candidate" ] && "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 13)' 2>/dev/null; then
      alt=$("$candidate" -c 'import sys; print(sys.executable)'); break
    fi
  done
  if [ -z "$alt" ]; then
    echo "bootstrap: no Python 3.13 found (set PYTHON_ALT); .venv-alt uses Python 3.12" >&2
    alt=$(find_python)
  fi
  [ -x .venv-alt/bin/python ] || "$alt" -m venv .venv-alt
  stamp=".venv-alt/.installed-$(cat setup.cfg requirements/*.txt 2>/dev/null | cksum | cut -d' ' -f1)"
  if [ ! -f "$stamp" ]; then
    if ! .venv-alt/bin/python -m pip install -q --disable-pip-version-check \
        -r requirements/test.txt "django>=5.2,<5.3" -e . > .venv-alt/pip.log 2>&1; then
      cat .venv-alt/pip.log >&2
      exit 1
    fi
    .venv-alt/bin/python -c 'import django, durable_singleton; assert django.VERSION[:2] == (5, 2)' && touch "$stamp"
  fi
  exit 0
fi

if [ "${1:-base}" = "dj60" ]; then
  if [ ! -x .venv-dj60/bin/python ]; then
    py=$(find_python)
    PYENV_VERSION="$(ls /root/.pyenv/versions 2>/dev/null | grep '^3\.12' | tail -1)" "$py" -m venv .venv-dj60
  fi
  stamp=".venv-dj60/.installed-$(cat setup.cfg requirements/*.txt 2>/dev/null | cksum | cut -d' ' -f1)"
  if [ ! -f "$stamp" ]; then
    if ! .venv-dj60/bin/python -m pip install -q --disable-pip-version-check \
        -r requirements/test.txt "django>=6.0,<6.1" -e . > .venv-dj60/pip.log 2>&1; then
      cat .venv-dj60/pip.log >&2
      exit 1
    fi
    .venv-dj60/bin/python -c 'import django, durable_singleton; assert django.VERSION[:2] == (6, 0)' && touch "$stamp"
  fi
  exit 0
fi

if [ ! -x .venv/bin/python ]; then
  py=$(find_python)
  PYENV_VERSION="$(ls /root/.pyenv/versions 2>/dev/null | grep '^3\.12' | tail -1)" "$py" -m venv .venv
fi
pip_quiet() {
  # pip's output goes to .venv/pip.log and is shown only when it fails.
  if ! .venv/bin/python -m pip install -q --disable-pip-version-check "$@" > .venv/pip.log 2>&1; then
    cat .venv/pip.log >&2
    return 1
  fi
}
pip_quiet --upgrade pip || echo "bootstrap: pip could not upgrade itself; going on" >&2
stamp=".venv/.installed-${1:-base}-$(cat setup.cfg requirements/*.txt 2>/dev/null | cksum | cut -d' ' -f1)"
if [ ! -f "$stamp" ]; then
  if [ "${1:-base}" = "test" ]; then
    pip_quiet -r requirements/test.txt -e .
  else
    pip_quiet -r requirements/base.txt -e .
  fi
  .venv/bin/python -c 'import django, celery, durable_singleton' && touch "$stamp"
fi
