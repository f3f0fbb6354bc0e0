"""The documentation's generated parts stay true (issue #10): the contract page
matches the project's contract, and the settings reference covers DEFAULTS."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from durable_singleton.conf import DEFAULTS

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT.parent / "shared" / "SPEC.md"

pytestmark = pytest.mark.vendor_agnostic  # text files only


@pytest.mark.skipif(not SPEC.exists(), reason="the contract (../shared/SPEC.md) is not beside this checkout")
def test_spec_page_is_generated_from_the_current_contract() -> None:
    """docs/spec.rst is tools/spec_rst.py's output for the current SPEC.md and
    field cases: run ``python tools/spec_rst.py`` after the contract changes."""
    done = subprocess.run([sys.executable, "tools/spec_rst.py", "--check"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_every_rule_of_the_spec_page_has_an_anchor_of_its_name() -> None:
    """Each numbered rule (R1..O4, F1..F16) is addressable: ``.. _S5:`` before ``**S5.**``."""
    text = (ROOT / "docs" / "spec.rst").read_text()
    rules = re.findall(r"^\*\*([RSDKOFX]\d+[a-z]?)\.\*\*", text, flags=re.MULTILINE)
    anchors = re.findall(r"^\.\. _([RSDKOFX]\d+[a-z]?):$", text, flags=re.MULTILINE)
    assert rules == anchors
    assert {"R1", "R5a", "S5", "S8a", "S13a", "D10", "K4", "O4", "F16"} <= set(rules)
    assert len(rules) == len(set(rules))


def test_settings_page_documents_each_default() -> None:
    """The settings reference has one ``.. setting::`` entry per key of DEFAULTS
    (the Sphinx build enforces the same; this says it without building)."""
    text = (ROOT / "docs" / "settings.rst").read_text()
    documented = re.findall(r"^\.\. setting:: (\w+)$", text, flags=re.MULTILINE)
    assert sorted(documented) == sorted(DEFAULTS)


#: Double-backticked dotted names that are not Python objects: system check ids,
#: Celery task names, file names.
_NOT_PYTHON = re.compile(r"^durable_singleton\.(?:[EW]\d+|E0xx|execute_runs?|tick)$|\.(?:py|jsonl|rst|toml|cfg|sql)$")
#: Module names of this package that the docs also use for something else: Django's
#: package, the usual variable of an engine, a project's file.
_AMBIGUOUS = {"django", "engine", "workflows", "tasks"}
_NAMED = re.compile(
    r"``~?([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?:\(\))?``"
    r"|:(?:func|meth|class|attr|mod|data|exc):`(?:[^`<]*<)?~?([\w.]+)>?`"
)


def _resolves(name: str, modules: dict[str, Any], classes: dict[str, type]) -> bool | None:
    """Tell whether ``name`` is an attribute path of this package's objects; None:
    it does not start with this package, one of its modules or one of its classes."""
    import importlib

    parts = name.split(".")
    short = {m.rsplit(".", 1)[1]: mod for m, mod in modules.items() if m.rsplit(".", 1)[1] not in _AMBIGUOUS}
    obj: Any
    if parts[0] == "durable_singleton":
        cut = max(i for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in {*modules, "durable_singleton"})
        obj, rest = importlib.import_module(".".join(parts[:cut])), parts[cut:]
    elif parts[0] in classes:
        obj, rest = classes[parts[0]], parts[1:]
    elif parts[0] in short:
        obj, rest = short[parts[0]], parts[1:]
    else:
        return None
    for part in rest:
        if hasattr(obj, part):
            obj = getattr(obj, part)
            continue
        # A dataclass field without a default, an annotated attribute, a model field.
        if part in getattr(obj, "__dataclass_fields__", {}) or part in getattr(obj, "__annotations__", {}):
            return True
        meta = getattr(obj, "_meta", None)
        return meta is not None and any(f.name == part for f in meta.get_fields())
    return True


def test_every_name_the_docs_give_of_this_package_exists() -> None:
    """Docs state only what the code does today (#34 item 8): every ``:func:``,
    ``:meth:``, ``:class:`` (and the other roles) and every double-backticked
    dotted name in docs/*.rst and README.rst that starts with this package, one
    of its modules or one of its classes is an attribute that exists (a renamed
    or removed function named by a page, such as ``DjangoStore._leased``, fails)."""
    import importlib
    import inspect
    import pkgutil

    import durable_singleton

    modules: dict[str, Any] = {}
    absent: list[str] = []
    for info in pkgutil.walk_packages(durable_singleton.__path__, "durable_singleton."):
        if ".migrations" not in info.name and not info.name.endswith("test_store_conformance"):
            try:
                modules[info.name] = importlib.import_module(info.name)
            except ModuleNotFoundError as exc:
                # A module of an optional part this Django lacks (django.tasks before 6.0):
                # the names the pages give of it are not checked here.
                assert exc.name is not None and not exc.name.startswith("durable_singleton"), exc
                absent.append(info.name)
    classes: dict[str, type] = {}
    for module in modules.values():
        for attr, value in vars(module).items():
            if inspect.isclass(value) and value.__module__.startswith("durable_singleton"):
                classes.setdefault(attr, value)
    missing: list[str] = []
    resolved = 0
    for page in [*sorted((ROOT / "docs").glob("*.rst")), ROOT / "README.rst"]:
        for lineno, line in enumerate(page.read_text().splitlines(), 1):
            for found in _NAMED.finditer(line):
                name = found.group(1) or found.group(2)
                if _NOT_PYTHON.search(name) or any(name.startswith(f"{m}.") or name == m for m in absent):
                    continue
                verdict = _resolves(name, modules, classes)
                if verdict is False:
                    missing.append(f"{page.relative_to(ROOT)}:{lineno}: {name}")
                resolved += bool(verdict)
    assert not missing, "names the code no longer has:\n" + "\n".join(missing)
    assert resolved > 100  # the check reads the pages it means to
