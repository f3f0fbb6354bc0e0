"""Run Django's own tests/tasks suite against the durable task backend.

    python -m tests.django_suite.run [-v 2] [test labels...]

1. Take ``tests/tasks`` of the installed Django version from its source
   distribution: ``pip download --no-deps --no-binary :all: django==<version>``
   through pip's own configuration, once per version, into
   ``<temporary directory>/durable_singleton-django-tests/<version>``
   (``DS_DJANGO_TESTS_DIR`` overrides the place).
2. Point the paths of Django's two built-in backends at the stand-ins of
   :mod:`tests.django_suite.backends` and let every ``SimpleTestCase`` use the
   database (Django's built-in backends keep results in memory; ours stores
   them in its models).
3. Run the suite with Django's test runner under
   :mod:`tests.django_suite.settings`, as tests/runtests.py runs a test app.
4. Compare: every test that failed must be listed in
   :data:`~tests.django_suite.differences.DIFFERENCES`, and every strict
   entry there must fail. Print "X of Y passed" and the differences.

Exits 0 when the outcome matches the list, 1 when it does not, 2 when the
suite could not be fetched. Django 5.2 has no django.tasks: exits 0 saying so.
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import unittest
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
#: The Django classes the suite names by path, and the stand-in each path is pointed at.
STAND_INS = {
    "django.tasks.backends.immediate": ("ImmediateBackend", "tests.django_suite.backends"),
    "django.tasks.backends.dummy": ("DummyBackend", "tests.django_suite.backends"),
}


def suite_dir(version: str) -> Path:
    """Return the folder holding ``tasks/`` (Django's tests/tasks of ``version``), fetching it once."""
    base = Path(os.environ.get("DS_DJANGO_TESTS_DIR") or Path(tempfile.gettempdir()) / "durable_singleton-django-tests")
    target = base / version
    if (target / "tasks" / "__init__.py").is_file() and (target / ".complete").is_file():
        return target
    with tempfile.TemporaryDirectory() as download:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps",
             "--no-binary", ":all:", f"django=={version}", "-d", download],
            check=True,
        )  # fmt: skip
        [sdist] = [p for p in Path(download).iterdir() if p.name.endswith(".tar.gz")]
        base.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=base))  # beside the target: the rename below is atomic
        try:
            with tarfile.open(sdist) as archive:
                members = [m for m in archive.getmembers() if m.name.split("/")[1:3] == ["tests", "tasks"]]
                if not members:
                    raise RuntimeError(f"{sdist.name} has no tests/tasks folder")
                for member in members:
                    member.name = "/".join(member.name.split("/")[2:])  # "tasks/..."
                archive.extractall(staging, members=members, filter="data")
            (staging / ".complete").write_text(version)
            if target.exists():
                shutil.rmtree(target)
            staging.rename(target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target


def point_backends_at_stand_ins() -> None:
    """Make Django's two backend paths resolve to the durable stand-ins (step 2)."""
    from importlib import import_module

    from django.test import SimpleTestCase

    for module_name, (name, stand_in_module) in STAND_INS.items():
        setattr(import_module(module_name), name, getattr(import_module(stand_in_module), name))
    SimpleTestCase.databases = {"default"}  # type: ignore[assignment]


def _tests(suite: unittest.TestSuite) -> Iterator[unittest.TestCase]:
    for test in suite:
        if isinstance(test, unittest.TestSuite):
            yield from _tests(test)
        else:
            yield test


def _test_id(test: Any) -> str:
    """The id of a test, or of the test a subtest belongs to."""
    case = getattr(test, "test_case", test)
    return str(case.id())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("labels", nargs="*", default=["tasks"], help="test labels (default: the whole suite)")
    parser.add_argument("-v", "--verbosity", type=int, default=1)
    options = parser.parse_args(argv)

    import django

    version = django.get_version()
    try:
        import django.tasks
    except ImportError:
        print(f"Django {version} has no django.tasks: Django's tests/tasks suite does not apply")
        return 0
    try:
        folder = suite_dir(version)
    except (subprocess.CalledProcessError, RuntimeError, ValueError, OSError) as exc:
        print(f"could not fetch Django {version}'s tests/tasks: {exc}", file=sys.stderr)
        return 2
    sys.path[:0] = [str(folder), str(ROOT)]
    os.environ["DJANGO_SETTINGS_MODULE"] = "tests.django_suite.settings"
    # As tests/runtests.py: deprecation and runtime warnings are errors.
    from django.utils.deprecation import RemovedAfterNextVersionWarning, RemovedInNextVersionWarning

    for category in (RemovedInNextVersionWarning, RemovedAfterNextVersionWarning, ResourceWarning, RuntimeWarning):
        warnings.simplefilter("error", category)
    django.setup()
    point_backends_at_stand_ins()

    from django.test.runner import DiscoverRunner

    from .differences import DIFFERENCES

    outcome: dict[str, Any] = {}

    class Runner(DiscoverRunner):
        def get_test_runner_kwargs(self) -> dict[str, Any]:
            kwargs = super().get_test_runner_kwargs()
            if self.verbosity < 2:  # the summary below says what failed; Django's report is -v 2's
                kwargs["stream"] = io.StringIO()
            return kwargs

        def run_suite(self, suite: unittest.TestSuite, **kwargs: Any) -> unittest.TestResult:
            outcome["ids"] = [t.id() for t in _tests(suite)]
            result = super().run_suite(suite, **kwargs)
            outcome["result"] = result
            return result

    runner = Runner(verbosity=options.verbosity, interactive=False)
    runner.run_tests(options.labels)
    result: unittest.TestResult = outcome["result"]
    ids: list[str] = outcome["ids"]
    failed = {_test_id(test): text for test, text in [*result.failures, *result.errors]}
    skipped = {_test_id(test) for test, _ in result.skipped}
    passed = [i for i in ids if i not in failed and i not in skipped]
    print(f"\nDjango {version} tests/tasks against DurableSingletonBackend: {len(passed)} of {len(ids)} passed")
    unexpected = sorted(set(failed) - set(DIFFERENCES))
    stale = sorted(i for i, (_, strict) in DIFFERENCES.items() if strict and i in ids and i not in failed)
    for test_id in sorted(set(failed) & set(DIFFERENCES)):
        print(f"  documented difference: {test_id}: {DIFFERENCES[test_id][0]}")
    for test_id in sorted(i for i in DIFFERENCES if i in ids and i not in failed and i not in stale):
        print(f"  passes (a difference that may pass): {test_id}")
    for test_id in unexpected:
        print(f"UNEXPECTED FAILURE: {test_id}\n{failed[test_id]}")
    if unexpected or stale:
        print(f"{len(unexpected)} unexpected failures, {len(stale)} listed differences that pass")
    for test_id in stale:
        print(f"LISTED DIFFERENCE PASSES: {test_id}: remove it from tests/django_suite/differences.py")
    return 1 if unexpected or stale or not ids else 0


if __name__ == "__main__":
    sys.exit(main())
