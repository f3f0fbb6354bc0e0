"""The SQL of each database's room, in named blocks (issue 32 item 4).

``durable_singleton/sql/<vendor>/*.sql`` hold one block per statement, as
procrastinate's ``procrastinate/sql/queries.sql`` does: a block starts with a
line ``-- name: <name>`` (a statement) or ``-- fragment: <name>`` (a piece that
several statements share), then a line that says what it does, then the SQL,
multi-line, with comments beside its clauses. A statement writes
``{{<name>}}`` where a fragment goes; the fragment's text is put there when the
file is loaded. A fragment that takes arguments is spliced as
``{{<name>: <arg> = <SQL>; <arg> = <SQL>}}`` and writes ``{{<arg>}}`` where each
goes (an argument shadows a fragment of the same name; an empty ``<SQL>`` puts
nothing there), so one fragment serves statements that read the same rule from
parameters or from a row. Each statement comes back with a leading
``/* durable_singleton:<name> */`` comment, so a statement found in
``pg_stat_statements``, ``auto_explain`` or a slow-query log leads to its block.

Parameters are written ``%(name)s``; a ``%`` is allowed nowhere else, and no
block ends on a ``--`` comment (statements are joined into one message).
"""

from __future__ import annotations

import functools
import re
from importlib import resources

__all__ = ["fragment", "parse", "statement", "statements"]

_HEAD = re.compile(r"^-- (name|fragment): ([a-z][a-z0-9_]*)[ \t]*$", re.MULTILINE)
_SPLICE = re.compile(r"^\s*([a-z][a-z0-9_]*)\s*(?::(.*))?$", re.DOTALL)
_ARGUMENT = re.compile(r"^\s*([a-z][a-z0-9_]*)\s*=(.*)$", re.DOTALL)
_PERCENT = re.compile(r"%(?!\(\w+\)s)")


def parse(text: str, source: str = "<text>") -> dict[str, tuple[str, str]]:
    """The blocks of one ``.sql`` file's ``text``: by name, (``"name"`` or
    ``"fragment"``, its SQL as written, without its description). Raises
    ``ValueError`` (naming ``source``) for a name used twice, an empty block, a
    block that ends on a ``--`` comment or a ``%`` that is not a parameter."""
    parts = _HEAD.split(text)
    found: dict[str, tuple[str, str]] = {}
    for kind, name, body in zip(parts[1::3], parts[2::3], parts[3::3], strict=True):
        lines = body.strip("\n").splitlines()
        while lines and lines[0].startswith("--"):
            lines.pop(0)  # the description and any comment before the SQL
        sql_text = "\n".join(lines).rstrip()
        if name in found:
            raise ValueError(f"{source}: the block {name!r} is named twice")
        last = sql_text.splitlines()[-1] if sql_text else ""
        if not sql_text or "--" in last:
            raise ValueError(f"{source}: the block {name!r} is empty or ends on a comment")
        if _PERCENT.search(sql_text):
            raise ValueError(f"{source}: the block {name!r} has a % that is not a parameter")
        found[name] = (kind, sql_text)
    return found


@functools.cache
def _blocks(vendor: str) -> tuple[dict[str, str], dict[str, str]]:
    """(statements, fragments) of every ``.sql`` file of ``vendor``, by name, as written."""
    found: dict[str, dict[str, str]] = {"name": {}, "fragment": {}}
    for entry in sorted(resources.files(__name__).joinpath(vendor).iterdir(), key=lambda e: e.name):
        if not entry.name.endswith(".sql"):
            continue
        for name, (kind, text) in parse(entry.read_text(encoding="utf-8"), entry.name).items():
            if name in found["name"] or name in found["fragment"]:
                raise ValueError(f"{entry.name}: the block {name!r} is named twice")
            found[kind][name] = text
    return found["name"], found["fragment"]


def fragment(name: str, vendor: str = "postgresql", **arguments: str) -> str:
    """The text of the fragment ``name`` of ``vendor``'s files, its own fragments put
    in, each ``{{<arg>}}`` of ``arguments`` replaced by its SQL text. Raises
    ``KeyError`` for an unknown name and for an argument the fragment uses and was
    not given."""
    return _splice(_blocks(vendor)[1][name], vendor, arguments)


def statement(name: str, vendor: str = "postgresql") -> str:
    """The text of the statement ``name`` of ``vendor``'s files: its fragments put in,
    after a ``/* durable_singleton:<name> */`` comment. Raises ``KeyError`` for an
    unknown name."""
    return f"/* durable_singleton:{name} */\n{_splice(_blocks(vendor)[0][name], vendor)}"


def statements(vendor: str = "postgresql") -> dict[str, str]:
    """Every statement of ``vendor``'s files, by name (:func:`statement`)."""
    return {name: statement(name, vendor) for name in _blocks(vendor)[0]}


def _splice(text: str, vendor: str, arguments: dict[str, str] | None = None) -> str:
    """``text`` with each ``{{...}}`` replaced: an argument of ``arguments`` by its
    text, else a fragment (with the arguments its splice gives, each spliced here
    first). Splices nest: an argument's SQL may itself splice."""
    scope = arguments or {}
    out: list[str] = []
    at = 0
    while (start := text.find("{{", at)) >= 0:
        depth, end = 1, start + 2
        while depth:
            opening, closing = text.find("{{", end), text.find("}}", end)
            if closing < 0:
                raise ValueError(f"a splice is not closed: {text[start : start + 60]!r}")
            if 0 <= opening < closing:
                depth, end = depth + 1, opening + 2
            else:
                depth, end = depth - 1, closing + 2
        out.append(text[at:start])
        out.append(_put(text[start + 2 : end - 2], vendor, scope))
        at = end
    out.append(text[at:])
    return "".join(out)


def _put(inside: str, vendor: str, scope: dict[str, str]) -> str:
    """The text of one splice, ``inside`` its braces: ``<name>`` or ``<name>: <arguments>``."""
    head = _SPLICE.match(inside)
    if head is None:
        raise ValueError(f"not a splice: {{{{{inside}}}}}")
    name, given = head[1], head[2]
    if given is None and name in scope:
        return scope[name]
    bound: dict[str, str] = {}
    for part in _arguments(given) if given is not None else ():
        found = _ARGUMENT.match(part)
        if found is None:
            raise ValueError(f"the splice of {name!r} has an argument without '=': {part.strip()!r}")
        bound[found[1]] = _splice(found[2].strip(), vendor, scope)
    return fragment(name, vendor, **bound)


def _arguments(given: str) -> list[str]:
    """``given`` split at its ``;`` outside nested splices."""
    parts, depth, at = [], 0, 0
    for index, char in enumerate(given):
        if given.startswith("{{", index):
            depth += 1
        elif given.startswith("}}", index):
            depth -= 1
        elif char == ";" and depth == 0:
            parts.append(given[at:index])
            at = index + 1
    return [*parts, given[at:]]
