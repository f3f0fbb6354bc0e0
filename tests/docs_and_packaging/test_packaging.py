"""The package as a user gets it: metadata, README, sdist contents, and the
wheel installed into a clean virtualenv outside this repository (issue #10)."""

from __future__ import annotations

import configparser
import io
import json
import os
import re
import socket
import subprocess
import sys
import tarfile
import textwrap
import time
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Files and a fresh virtualenv on its own SQLite file: the same on every database pass.
pytestmark = pytest.mark.vendor_agnostic


def setup_cfg() -> configparser.ConfigParser:
    parser = configparser.ConfigParser(interpolation=None)
    parser.read(ROOT / "setup.cfg")
    return parser


# -- fast checks of the files ----------------------------------------------------
def test_readme_starts_with_the_two_repository_commands_then_the_install_line() -> None:
    """README.rst is the repository's front page and the package's description:
    the two repository commands come first, then what it is and how to install it.

    Nothing is published on a package index, so the install line installs a
    clone (issue #19: ``pip install durable-singleton[postgres]`` found no
    distribution), and no page tells users to install by the bare name."""
    lines = (ROOT / "README.rst").read_text().splitlines()
    commands = [line.split("#")[0].strip() for line in lines[:10] if line.startswith("    bash ")]
    assert commands == ["bash tools/demo", "bash tools/test"]
    for command in commands:
        assert (ROOT / command.split()[1]).is_file()
    text = "\n".join(lines)
    install = '    pip install "./durable_singleton[postgres]"'
    assert install in text and "Nothing is published on a package index yet" in text
    assert text.index("bash tools/test") < text.index(install)
    for page in [ROOT / "README.rst", *sorted((ROOT / "docs").glob("*.rst"))]:
        bare = re.findall(r"pip install (?:--upgrade )?\"?durable-singleton\[[\w,]+\](?! @)", page.read_text())
        assert not bare, f"{page.name} installs by a name no index serves"


def test_readme_names_repository_files_only_as_in_the_repository() -> None:
    """The README ships as the package description, where tools/, docs/,
    testproject/ and bench/ do not exist: a paragraph naming one (or the
    paragraph introducing a literal block that names one) says it is in the
    repository, or its section's heading does."""
    text = (ROOT / "README.rst").read_text()
    for section in re.split(r"\n(?=[^\n]+\n[-=]{3,}\n)", text):
        heading = section.split("\n", 1)[0]
        intro = ""
        for paragraph in section.split("\n\n"):
            if not paragraph.startswith(" "):
                intro = paragraph  # a literal block is read with the paragraph that introduces it
            named = [d for d in ("tools/", "docs/", "testproject/", "bench/") if d in paragraph]
            if named and "repository" not in heading:
                assert "repository" in intro, f"{named} named without saying it is in the repository: {paragraph}"


def test_readme_renders_as_a_package_description_without_warnings() -> None:
    """The package index renders README.rst with plain docutils (no Sphinx roles):
    it must parse without a warning, or the page falls back to raw text."""
    docutils_core = pytest.importorskip("docutils.core")
    stream = io.StringIO()
    docutils_core.publish_doctree(
        (ROOT / "README.rst").read_text(),
        settings_overrides={"report_level": 2, "halt_level": 5, "warning_stream": stream},
    )
    assert stream.getvalue() == ""


def test_licence_file_matches_the_metadata() -> None:
    """LICENSE is the BSD 3-clause text the metadata declares."""
    metadata = setup_cfg()["metadata"]
    assert metadata["license_expression"] == "BSD-3-Clause"
    assert metadata["license_files"] == "LICENSE"
    licence = (ROOT / "LICENSE").read_text()
    assert licence.startswith("BSD 3-Clause License")
    assert "Neither the name of the copyright holder" in licence


def test_tested_django_versions_match_the_classifiers_and_bounds() -> None:
    """The Django classifiers name exactly the versions tox.ini tests (5.2,
    6.0 and 6.1: 6.0 is supported until April 2027, issue #19), and
    install_requires allows them all and caps the next, untested one; CI
    runs each (tools/suites.sh: .venv, .venv-alt and .venv-dj60)."""
    cfg = setup_cfg()
    classified = {
        line.rsplit("::", 1)[1].strip()
        for line in cfg["metadata"]["classifiers"].splitlines()
        if line.startswith("Framework :: Django :: ")
    }
    tox = (ROOT / "tox.ini").read_text()
    tested = {f"{v[0]}.{v[1:]}" for v in ("52", "60", "61") if f"django{v}:" in tox}
    assert classified == tested == {"5.2", "6.0", "6.1"}
    requirement = next(r for r in cfg["options"]["install_requires"].split() if r.startswith("django>="))
    assert requirement == "django>=5.2,<6.2"
    suites = (ROOT / "tools" / "suites.sh").read_text()
    assert "other_pass .venv-alt" in suites and "other_pass .venv-dj60" in suites
    assert "bash tools/bootstrap.sh dj60" in (ROOT / "tools" / "test").read_text()


def test_rich_is_an_extra_not_a_dependency() -> None:
    """rich only draws durable_queues' table (plain columns without it), so it is an extra."""
    cfg = setup_cfg()
    assert not [r for r in cfg["options"]["install_requires"].split() if r.startswith("rich")]
    extras = cfg["options.extras_require"]
    assert extras["rich"].startswith("rich>=")
    assert {"postgres", "mysql", "rich", "prometheus"} <= set(extras)


# -- the built artefacts, installed where this repository is out of reach ------------
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run(args: list[str], cwd: Path, env: dict[str, str], timeout: float = 300) -> str:
    """Run a command, fail the test with its output if it exits non-zero."""
    done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(args)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


SETTINGS_TAIL = """
INSTALLED_APPS += ["durable_singleton", "jobs"]
DURABLE_SINGLETON = {"DISPATCH": "thread", "TICK_SECONDS": 0.2}
DATABASES["default"]["OPTIONS"] = {"transaction_mode": "IMMEDIATE", "timeout": 20}
"""

WORKFLOWS = """
from durable_singleton import BaseWorkflow, Singleton, WorkflowCtx, step, workflow


@step("jobs:double")
def double(n: int) -> int:
    return 2 * n


@workflow(name="count", version="1", singleton=Singleton(key=lambda input: f"lane:{input['lane']}", limit=1))
class Count(BaseWorkflow):
    def run(self, ctx: WorkflowCtx, input: dict) -> dict:
        return {"doubled": ctx.step("jobs:double", input["n"])}
"""

VIEWS = """
from django.http import JsonResponse
from django.views.decorators.csrf import csrf_exempt

from durable_singleton import get_engine

from .workflows import Count


@csrf_exempt
def start(request, lane, n):
    run = Count.dispatch({"lane": lane, "n": n})
    return JsonResponse({"run_id": run.run_id})


def status(request, run_id):
    run = get_engine().get(run_id)
    return JsonResponse({"status": run.status, "output": run.output, "key": run.singleton_key})
"""

URLS = """
from django.urls import path

from jobs import views

urlpatterns = [
    path("start/<str:lane>/<int:n>", views.start),
    path("runs/<str:run_id>", views.status),
]
"""


def get_json(url: str, method: str = "GET") -> dict:
    with urllib.request.urlopen(urllib.request.Request(url, method=method), timeout=10) as response:
        return json.loads(response.read())


@pytest.mark.slow
def test_wheel_installs_into_a_clean_virtualenv_and_runs_a_workflow(tmp_path: Path) -> None:
    """Build the sdist and the wheel, check the sdist ships no tests, install the
    wheel (no extras) into a new virtualenv outside the repository, generate a
    project with startproject, then ``check``, ``migrate`` and serve it: three
    runs on one key started through a view complete with the embedded worker,
    one body at a time (S5, S9; issue #10 point 1)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "DJANGO_SETTINGS_MODULE", "VIRTUAL_ENV")}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    dist = tmp_path / "dist"
    run([sys.executable, "-m", "build", "--outdir", str(dist), str(ROOT)], cwd=tmp_path, env=env)
    (sdist,) = dist.glob("durable_singleton-*.tar.gz")
    (wheel,) = dist.glob("durable_singleton-*.whl")
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    assert {
        "LICENSE",
        "README.rst",
        "durable_singleton/py.typed",
        "durable_singleton/migrations/0001_initial.py",
    } <= names
    assert not [n for n in names if n.startswith(("tests/", "testproject/", "tools/", "bench/", "docs/"))]
    # The named SQL blocks of each database's room ship in both (issue 32 item 4).
    sql_files = {str(p.relative_to(ROOT)) for p in (ROOT / "durable_singleton" / "sql").rglob("*.sql")}
    assert sql_files and sql_files <= names, sql_files - names
    with zipfile.ZipFile(wheel) as archive:
        assert sql_files <= set(archive.namelist()), sql_files - set(archive.namelist())

    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", str(venv)], cwd=tmp_path, env=env)
    python = str(venv / "bin" / "python")
    run([python, "-m", "pip", "install", "-q", "--disable-pip-version-check", str(wheel)], cwd=tmp_path, env=env)
    installed = run([python, "-c", "import durable_singleton; print(durable_singleton.__file__)"], tmp_path, env)
    assert installed.startswith(str(venv)) and not installed.startswith(str(ROOT))
    assert "rich" not in run([python, "-m", "pip", "list", "--format=freeze"], tmp_path, env).lower()

    site = tmp_path / "site"
    site.mkdir()
    run([str(venv / "bin" / "django-admin"), "startproject", "mysite", str(site)], cwd=tmp_path, env=env)
    with (site / "mysite" / "settings.py").open("a") as settings:
        settings.write(SETTINGS_TAIL)
    (site / "jobs").mkdir()
    (site / "jobs" / "__init__.py").write_text("")
    (site / "jobs" / "workflows.py").write_text(textwrap.dedent(WORKFLOWS))
    (site / "jobs" / "views.py").write_text(textwrap.dedent(VIEWS))
    (site / "mysite" / "urls.py").write_text(textwrap.dedent(URLS))

    manage = [python, "manage.py"]
    assert "System check identified no issues" in run([*manage, "check"], site, env)
    run([*manage, "migrate", "--verbosity", "0"], site, env)
    commands = run([*manage, "help", "--commands"], site, env).split()
    assert "durable_queues" in commands and "durable_demo" not in commands

    port = free_port()
    log = (tmp_path / "server.log").open("w")
    server = subprocess.Popen(
        [*manage, "runserver", "--noreload", f"127.0.0.1:{port}"], cwd=site, env=env, stdout=log, stderr=log
    )
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                first = get_json(f"{base}/start/a/1", "POST")
                break
            except (urllib.error.URLError, ConnectionError):
                assert server.poll() is None and time.monotonic() < deadline, (tmp_path / "server.log").read_text()
                time.sleep(0.2)
        run_ids = [first["run_id"], *(get_json(f"{base}/start/a/{n}", "POST")["run_id"] for n in (2, 3))]
        deadline = time.monotonic() + 60
        statuses: dict[str, dict] = {}
        while time.monotonic() < deadline:
            statuses = {run_id: get_json(f"{base}/runs/{run_id}") for run_id in run_ids}
            if all(s["status"] == "completed" for s in statuses.values()):
                break
            time.sleep(0.2)
        assert [s["status"] for s in statuses.values()] == ["completed"] * 3, (tmp_path / "server.log").read_text()
        assert [s["output"] for s in statuses.values()] == [{"doubled": 2}, {"doubled": 4}, {"doubled": 6}]
        assert {s["key"] for s in statuses.values()} == {"lane:a"}
    finally:
        server.terminate()
        server.wait(15)
        log.close()
    queues = json.loads(run([*manage, "durable_queues", "--json"], site, env))
    assert queues["rows"] == []
