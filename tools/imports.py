#!/usr/bin/env python3
"""The import graph of the durable_singleton package, its cycles and its layers.

Command line (from the repository root, with the project's Python)::

    .venv/bin/python tools/imports.py            # every module's imports, the cycles, the upward imports
    .venv/bin/python tools/imports.py --cycles   # the cycles only

Every ``import`` statement of every module under ``durable_singleton/``
counts, wherever it stands: at module level, inside a function, or under
``if TYPE_CHECKING:``; relative imports are resolved, and ``from .pkg import
name`` counts ``pkg.name`` when that is a module. The implicit import of a
module's parent packages does not count. Only imports of the package's own
modules are listed.

:data:`LAYERS` is the layer map of docs/design.rst ("Layers"): a module may
import modules of its own layer or of a lower one, never of a higher one, and
no import cycle is allowed except :data:`ALLOWED_CYCLES`.
tests/docs_and_packaging/test_layers.py enforces both with :func:`violations` and :func:`cycles`.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "durable_singleton"

#: The layers, lowest first; each maps to the modules (or packages, with a
#: trailing ``.*``) in it. A module named by no entry is an error.
LAYERS: dict[str, tuple[str, ...]] = {
    "words": (
        "statuses",
        "exceptions",
        "conf",
        "signals",
        "codecs",
        "values",
        "identity",
    ),
    "rules": (
        "admission",
        "renewals",
        "definitions",
        "schedule_specs",
        "records",
        "sql",
    ),
    "seams": (
        "stores",
        "stores.base",
        "dispatcher",
    ),
    "persistence": (
        "models",
        "querysets",
        "migrations",
        "migrations.*",
        "stores.django",
        "stores.pg",
        "stores.mysql",
        "stores.sqlite",
        "stores.memory",
        "stores.codec",
        "stores.loading",
        "stores.key_controls",
        "stores.schedule_state",
        "stores.retention",
        "stores.rows",
        "stores.reencode",
        "stores.turns",
        "dispatch",
        "pull",
    ),
    "core": (
        "core",
        "context",
        "leases",
        "tracing",
    ),
    "services": (
        "controls",
        "explain",
        "audit",
        "schedules",
        "retention",
        "heartbeat",
        "aio",
        "queues",
        "lanes",
    ),
    "facade": (
        "engine",
        "runtime",
    ),
    "shells": (
        "",  # the package itself: its public names
        "apps",
        "checks",
        "receivers",
        "workflows",
        "tasks",
        "celery_tick",
        "worker",
        "tasks_backend",
        "metrics",
        "health",
        "admin",
        "admin.*",
        "management",
        "management.*",
        "templatetags",
        "templatetags.*",
        "testing",
        "testing.*",
    ),
}

#: Cycles allowed (each a set of module names): the models and their querysets name each other for typing.
ALLOWED_CYCLES: tuple[frozenset[str], ...] = (frozenset({f"{PACKAGE}.models", f"{PACKAGE}.querysets"}),)


@dataclass(frozen=True)
class Import:
    """One import of ``target`` by ``source`` at ``line``; ``where`` is
    ``module``, ``function`` or ``type_checking``."""

    source: str
    target: str
    line: int
    where: str


def module_name(path: Path, root: Path = ROOT) -> str:
    """Return the dotted name of the module in file ``path`` under ``root``."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_modules(root: Path = ROOT) -> dict[str, Path]:
    """Return every module of the package by dotted name (packages by their ``__init__``)."""
    return {module_name(p, root): p for p in sorted((root / PACKAGE).rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(name: str, source: str, known: Iterable[str], *, is_package: bool = False) -> list[Import]:
    """Return the imports of the package's own modules in module ``name``'s ``source``.

    ``known``: every module name of the package (to tell ``from .pkg import
    module`` from ``from .pkg import function``). ``is_package``: ``name`` is
    a package (its ``__init__``), so its relative imports start at itself.
    """
    modules = set(known)
    base = name.split(".") if is_package else name.split(".")[:-1]
    found: list[Import] = []

    def add(target: str, node: ast.stmt, where: str) -> None:
        if target == PACKAGE or target.startswith(PACKAGE + "."):
            found.append(Import(name, target, node.lineno, where))

    def visit(parent: ast.AST, where: str) -> None:
        for node in ast.iter_child_nodes(parent):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    add(alias.name, node, where)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    anchor = base[: len(base) - node.level + 1]
                    target = ".".join([*anchor, node.module] if node.module else anchor)
                else:
                    target = node.module or ""
                sub = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in modules]
                if len(sub) < len(node.names):
                    add(target, node, where)
                for s in sub:
                    add(s, node, where)
            elif isinstance(node, ast.If) and _is_type_checking(node.test):
                for child in node.body:
                    visit(ast.Module(body=[child], type_ignores=[]), "type_checking")
                for child in node.orelse:
                    visit(ast.Module(body=[child], type_ignores=[]), where)
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                visit(node, "function" if where == "module" else where)
            else:
                visit(node, where)

    tree = ast.parse(source)
    visit(tree, "module")
    return found


def graph(root: Path = ROOT) -> list[Import]:
    """Return every import between the package's own modules."""
    modules = package_modules(root)
    out: list[Import] = []
    for name, path in modules.items():
        out.extend(imports_of(name, path.read_text(), modules, is_package=path.name == "__init__.py"))
    return [i for i in out if i.target in modules and i.target != i.source]


def layer_of(module: str) -> str | None:
    """Return the layer of dotted module name ``module`` (None: not in :data:`LAYERS`)."""
    short = module[len(PACKAGE) + 1 :] if module.startswith(PACKAGE + ".") else ("" if module == PACKAGE else None)
    if short is None:
        return None
    for layer, names in LAYERS.items():
        for entry in names:
            if entry == short or (entry.endswith(".*") and short.startswith(entry[:-1])):
                return layer
    return None


def rank(layer: str) -> int:
    return list(LAYERS).index(layer)


def violations(imports: Iterable[Import]) -> list[str]:
    """Return a line per import of a module in a higher layer, or of a module in no layer."""
    out = []
    for i in imports:
        src, dst = layer_of(i.source), layer_of(i.target)
        if src is None or dst is None:
            missing = i.source if src is None else i.target
            out.append(f"{missing} is in no layer of tools/imports.py LAYERS")
        elif rank(dst) > rank(src):
            out.append(f"{i.source}:{i.line} ({src}) imports {i.target} ({dst}) [{i.where}]")
    return sorted(set(out))


def cycles(imports: Iterable[Import]) -> list[list[str]]:
    """Return the strongly connected components of more than one module (Tarjan), each sorted."""
    edges: dict[str, set[str]] = {}
    for i in imports:
        edges.setdefault(i.source, set()).add(i.target)
        edges.setdefault(i.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    sys.setrecursionlimit(max(10_000, sys.getrecursionlimit()))

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            strong(v)
    return sorted(out)


def forbidden_cycles(imports: Iterable[Import]) -> list[list[str]]:
    """Return the cycles that :data:`ALLOWED_CYCLES` does not allow."""
    return [c for c in cycles(imports) if frozenset(c) not in ALLOWED_CYCLES]


def report(imports: list[Import], *, cycles_only: bool = False) -> str:
    """Return the printable graph: each module's imports, then the cycles and the upward imports."""
    lines: list[str] = []
    if not cycles_only:
        by_source: dict[str, list[Import]] = {}
        for i in imports:
            by_source.setdefault(i.source, []).append(i)
        lines.append(f"# {len(imports)} imports between {len({i.source for i in imports})} modules")
        for source in sorted(by_source):
            lines.append(f"{source} [{layer_of(source)}]")
            for i in sorted(by_source[source], key=lambda i: (i.target, i.line)):
                mark = "" if i.where == "module" else f" ({i.where})"
                lines.append(f"    -> {i.target}:{i.line}{mark}")
    found = cycles(imports)
    lines.append(f"# {len(found)} cycle(s) (strongly connected components of more than one module)")
    for comp in found:
        allowed = " (allowed)" if frozenset(comp) in ALLOWED_CYCLES else ""
        lines.append(f"cycle of {len(comp)}{allowed}: {' '.join(m.removeprefix(PACKAGE + '.') for m in comp)}")
    up = violations(imports)
    lines.append(f"# {len(up)} upward import(s) against the layer map")
    lines.extend(up)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", action="store_true", help="print the cycles and upward imports only")
    args = parser.parse_args(argv)
    imports = graph()
    sys.stdout.write(report(imports, cycles_only=args.cycles))
    return 1 if forbidden_cycles(imports) or violations(imports) else 0


if __name__ == "__main__":
    sys.exit(main())
