"""One definition of every word the protocol speaks (R2, S5, R5, D1-D4): run
statuses, slot states, turn outcomes, store verdicts and park reasons are the
enumerations of durable_singleton/statuses.py, and no other module of the
package spells one as a string literal where it decides or writes with it
(compares, assigns, returns, passes or stores it). Migrations are frozen
history and are left out. Regression of #16: about 78 lines in 18 modules
wrote such literals."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

from durable_singleton import statuses

pytestmark = pytest.mark.vendor_agnostic

PACKAGE = Path(statuses.__file__).parent
WORDS: dict[str, str] = {}
for enum in (statuses.RunStatus, statuses.SlotState, statuses.Outcome, statuses.Verdict, statuses.ParkReason):
    for member in enum:
        named = f"{enum.__name__}.{member.name}"
        WORDS[str(member.value)] = f"{WORDS[str(member.value)]} / {named}" if str(member.value) in WORDS else named
#: Calls whose string arguments are words for people, not the protocol's (translations).
TEXT_CALLS = frozenset({"_", "gettext", "gettext_lazy", "ngettext", "pgettext", "pgettext_lazy"})
#: Bases of an enumeration: its own members' values are definitions, not uses.
ENUM_BASES = frozenset({"Enum", "StrEnum", "IntEnum", "TextChoices", "IntegerChoices", "Choices"})


def _modules() -> Iterator[Path]:
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "statuses.py" and path.parent == PACKAGE:
            continue
        if "migrations" in path.relative_to(PACKAGE).parts:
            continue
        yield path


def _called(node: ast.Call) -> str:
    func = node.func
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""


def _enum_bodies(tree: ast.AST) -> set[int]:
    """The ids of every node inside the body of an enumeration class."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            bases = {
                b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else "" for b in node.bases
            }
            if bases & ENUM_BASES:
                inside.update(id(n) for statement in node.body for n in ast.walk(statement))
    return inside


def _spelled(tree: ast.AST) -> Iterator[ast.Constant]:
    """The string constants that are used as a value: compared (alone or in a
    tuple, list or set compared with ``in``), assigned, returned, a default,
    passed to a call (positionally or by keyword) or stored in a dict or a
    collection. A docstring, a dict key, a subscript and an f-string part are
    not values; neither is the argument of a translation call or of an
    exception's constructor (a message, a field's name), nor an enumeration's
    own member definition."""
    skip = _enum_bodies(tree)
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        candidates: list[ast.expr] = []
        if isinstance(node, ast.Compare):
            candidates += [node.left, *node.comparators]
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.Return, ast.AugAssign)) and node.value is not None:
            candidates.append(node.value)
        elif isinstance(node, ast.arguments):
            candidates += [d for d in (*node.defaults, *node.kw_defaults) if d is not None]
        elif isinstance(node, ast.Call) and _called(node) not in TEXT_CALLS and not _called(node).endswith("Error"):
            candidates += [*node.args, *(k.value for k in node.keywords)]
        elif isinstance(node, ast.Dict):
            candidates += list(node.values)
        elif isinstance(node, ast.IfExp):
            candidates += [node.body, node.orelse]
        elif isinstance(node, ast.BoolOp):
            candidates += node.values
        for candidate in candidates:
            items = candidate.elts if isinstance(candidate, (ast.Tuple, ast.List, ast.Set)) else [candidate]
            for item in items:
                if isinstance(item, ast.Constant) and isinstance(item.value, str):
                    yield item


def test_no_status_slot_outcome_verdict_or_park_reason_literal_outside_statuses() -> None:
    """R2, S5, R5, D1-D4 (#16): every such word is named through its enumeration."""
    found = []
    for path in _modules():
        tree = ast.parse(path.read_text(), filename=str(path))
        for constant in _spelled(tree):
            name = WORDS.get(constant.value)
            if name is not None:
                found.append(f"{path.relative_to(PACKAGE.parent)}:{constant.lineno}: {constant.value!r} is {name}")
    assert found == [], "\n".join(sorted(set(found)))


def test_the_check_finds_a_literal() -> None:
    """The check can fail: a status compared as a string, a slot passed by keyword,
    a verdict returned and a park reason's prefix are each found."""
    source = (
        "def f(run, rows):\n"
        "    if run.status == 'running':\n"
        "        rows.filter(singleton_slot='holder')\n"
        "    if run.park_reason.startswith('signal:'):\n"
        "        return 'fenced'\n"
        "    x = _('running')\n"  # a translated word for people: not a value
        "    y = {'waiter': 1}\n"  # a dict key: not a value
    )
    assert sorted(c.value for c in _spelled(ast.parse(source)) if c.value in WORDS) == [
        "fenced",
        "holder",
        "running",
        "signal:",
    ]
