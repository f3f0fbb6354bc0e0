"""The package's import structure (issue #16; STYLE "Layers", "Seams and roots").

Every import of every module under durable_singleton/ (module-level,
function-level and ``TYPE_CHECKING`` ones, relative ones resolved) goes to a
module of the same layer or a lower one of ``tools/imports.py``'s
:data:`LAYERS`; no import cycle but models <-> querysets; only the stores take
row locks (``select_for_update``, STYLE "Only the store takes locks"); the
async twins take their synchronous methods' arguments. ``python
tools/imports.py`` prints the graph these tests read.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.vendor_agnostic  # source files only


def _tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("_ds_imports_tool", ROOT / "tools" / "imports.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


imports = _tool()


def test_every_module_is_in_a_layer() -> None:
    """The layer map names every module of the package, so a new module must be placed."""
    missing = [name for name in imports.package_modules() if imports.layer_of(name) is None]
    assert missing == []


def test_no_module_imports_a_higher_layer() -> None:
    """Each module imports only modules of its own layer or lower ones (STYLE "Layers")."""
    assert imports.violations(imports.graph()) == []


def test_no_import_cycle_but_models_and_querysets() -> None:
    """No import cycle, lazy or not, except models <-> querysets for typing (STYLE
    "Seams and roots": a cycle held up by lazy imports is a design fault)."""
    assert imports.forbidden_cycles(imports.graph()) == []


def test_the_graph_command_prints_no_forbidden_cycle_and_exits_0() -> None:
    """``python tools/imports.py --cycles``, the command the docs name, exits 0 on the package as it is."""
    import subprocess

    done = subprocess.run(
        [sys.executable, "tools/imports.py", "--cycles"], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "cycle of 2 (allowed): models querysets" in done.stdout
    assert "# 0 upward import(s)" in done.stdout


def _synthetic(source: str, name: str = "durable_singleton.statuses") -> list[str]:
    """Return the violations of module ``name`` if its source were ``source``."""
    modules = imports.package_modules()
    return imports.violations([i for i in imports.imports_of(name, source, modules) if i.target in modules])


@pytest.mark.parametrize(
    "source",
    [
        "from .engine import Engine\n",
        "def f():\n    from .runtime import get_engine\n    return get_engine\n",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .controls import KeyControlState\n",
        "import durable_singleton.admin.runs\n",
        "from . import explain\n",
        "class C:\n    def m(self):\n        with open('x'):\n            from .stores import django\n",
    ],
    ids=["module-level", "function-level", "type-checking", "absolute", "from-package", "nested"],
)
def test_the_checker_fails_on_an_upward_import(source: str) -> None:
    """A word (statuses) that imports a higher layer, however the import is
    written, is reported with its line: the checker can fail."""
    found = _synthetic(source)
    assert found, source
    assert all(line.startswith("durable_singleton.statuses:") for line in found)


def test_the_checker_accepts_a_downward_import() -> None:
    """An import of the same or a lower layer is no violation (the control case)."""
    assert _synthetic("from .exceptions import ValidationError\n") == []


def test_the_checker_finds_a_cycle() -> None:
    """Two modules that import each other are a cycle, reported as one component."""
    a = imports.Import("durable_singleton.a", "durable_singleton.b", 1, "module")
    b = imports.Import("durable_singleton.b", "durable_singleton.a", 1, "function")
    assert imports.cycles([a, b]) == [["durable_singleton.a", "durable_singleton.b"]]
    assert imports.forbidden_cycles([a, b]) == [["durable_singleton.a", "durable_singleton.b"]]


def test_only_the_stores_take_row_locks() -> None:
    """``select_for_update`` appears only under durable_singleton/stores/ (STYLE:
    "Only the store takes locks"; the lock order of docs/design.rst is the stores')."""
    found = set()
    for path in sorted((ROOT / "durable_singleton").rglob("*.py")):
        if path.is_relative_to(ROOT / "durable_singleton" / "stores"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "select_for_update":
                found.add(str(path.relative_to(ROOT)))
    assert found == set()


def _twins() -> list[tuple[str, str]]:
    from durable_singleton.engine import Engine

    return sorted(
        (name, name[1:])
        for name in dir(Engine)
        if name.startswith("a") and inspect.iscoroutinefunction(getattr(Engine, name)) and hasattr(Engine, name[1:])
    )


def test_every_async_twin_takes_its_sync_methods_arguments() -> None:
    """Each ``a``-method of the engine has the parameters (names, kinds and
    defaults) of its synchronous twin (docs/async.rst: "the same arguments")."""
    from durable_singleton.engine import Engine

    twins = _twins()
    assert {"astart", "aget", "asignal", "acancel"} <= {a for a, _ in twins}
    for async_name, sync_name in twins:
        got = list(inspect.signature(getattr(Engine, async_name)).parameters.values())
        want = list(inspect.signature(getattr(Engine, sync_name)).parameters.values())
        assert [(p.name, p.kind, p.default) for p in got] == [(p.name, p.kind, p.default) for p in want], async_name


def test_no_module_probes_a_store_for_undeclared_members() -> None:
    """No ``getattr``/``hasattr`` on a store (``store``, ``engine.store``, a wrapper's
    ``inner``): what a feature needs of a store is a declared seam member of
    BaseStore behind a capability flag (STYLE "Seams and roots"; #16 counted 19
    such probes in 13 modules)."""
    found = []
    for path in sorted((ROOT / "durable_singleton").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args):
                continue
            if node.func.id not in ("getattr", "hasattr"):
                continue
            target = ast.unparse(node.args[0])
            if target.split(".")[-1] in ("store", "inner") or target.endswith("()" + ".store"):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert found == []


def test_the_workflow_class_twins_take_the_same_arguments() -> None:
    """``BaseWorkflow.astart`` takes what ``BaseWorkflow.start`` takes (docs/async.rst)."""
    from durable_singleton.workflows import BaseWorkflow

    def params(fn: object) -> list[tuple[str, object, object]]:
        return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]  # type: ignore[arg-type]

    assert params(BaseWorkflow.astart) == params(BaseWorkflow.start)


def test_the_engine_forwards_the_key_controls_with_their_signatures() -> None:
    """Each key-control call of the façade is the service's: the same parameters and
    docstring (K2), so ``engine.pause_key`` cannot drift from ``engine.controls.pause_key``."""
    from durable_singleton.controls import KeyControls
    from durable_singleton.engine import Engine

    public = [n for n in vars(KeyControls) if not n.startswith("_")]
    assert {"pause_key", "resume_key", "override_limit", "pause_workflow", "key_controls"} <= set(public)
    for name in public:
        forwarded, service = getattr(Engine, name), getattr(KeyControls, name)
        assert inspect.signature(forwarded) == inspect.signature(service), name
        assert forwarded.__doc__ == service.__doc__, name


#: The modules outside stores/ that read a store's ``database`` alias, and why
#: none of them reaches the ORM through it.
DATABASE_ALIAS_READERS = {
    "durable_singleton/dispatch.py": "Django's on_commit hooks and connections of the store's database",
    "durable_singleton/runtime.py": "DISPATCH 'worker' needs a store in a database (E007)",
    "durable_singleton/tasks.py": "the tick's lease (stores.turns) on the store's database",
    "durable_singleton/celery_tick.py": "the tick's lease (stores.turns) on the store's database",
    "durable_singleton/management/commands/durable_reencode.py": "refuses a codec store without a database",
}


def test_services_read_through_the_store_not_its_database() -> None:
    """No module outside stores/ reads a store's ``database`` alias to query
    the models behind it: the store has a method for each read and write a
    service needs (STYLE "Seams and roots", "Rooms and SQL"; issue 32 counted
    9 such sites, one of them writing run rows in worker.py; the slot audit,
    health and the metrics were the last). The modules that read the alias
    are listed with their reason, and none queries through it."""
    found = set()
    for path in sorted((ROOT / "durable_singleton").rglob("*.py")):
        if path.is_relative_to(ROOT / "durable_singleton" / "stores"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "database":
                owner = ast.unparse(node.value).split(".")[-1]
                if owner in ("store", "inner") or owner.endswith("store"):
                    found.add(str(path.relative_to(ROOT)))
    assert found == set(DATABASE_ALIAS_READERS)


def test_a_run_row_becomes_a_record_in_one_place() -> None:
    """R1, STYLE "One place for a rule": the run table's row is mapped to a
    RunRecord by stores.rows.run_record only (the ORM's model rows and the
    rooms' raw rows alike; issue 32 counted the mapping written four times);
    the core builds the record of a new start, which no row holds yet."""
    found = set()
    for path in sorted((ROOT / "durable_singleton").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "RunRecord":
                found.add(str(path.relative_to(ROOT)))
    assert found == {"durable_singleton/stores/rows.py", "durable_singleton/core.py"}
