"""The SQL of each database's room, in named blocks (issue 32 item 4).

``durable_singleton/sql/<vendor>/*.sql`` hold one block per statement, as
procrastinate's ``procrastinate/sql/queries.sql`` does: a block starts with a
line ``-- name: <name>`` (a statement) or ``-- fragment: <name>`` (a piece that
several statements share), then a line that says what it does, then the SQL,
multi-line, with comments beside its clauses. A statement writes
``{{<name>}}`` where a fragment goes; the fragment's text is put there when the
file is loaded. Each statement comes back with a leading
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
_SPLICE = re.compile(r"\{\{([a-z][a-z0-9_]*)\}\}")
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


def fragment(name: str, vendor: str = "postgresql") -> str:
    """The text of the fragment ``name`` of ``vendor``'s files, its own fragments put
    in. Raises ``KeyError`` for an unknown name."""
    return _splice(_blocks(vendor)[1][name], vendor)


def statement(name: str, vendor: str = "postgresql") -> str:
    """The text of the statement ``name`` of ``vendor``'s files: its fragments put in,
    after a ``/* durable_singleton:<name> */`` comment. Raises ``KeyError`` for an
    unknown name."""
    return f"/* durable_singleton:{name} */\n{_splice(_blocks(vendor)[0][name], vendor)}"


def statements(vendor: str = "postgresql") -> dict[str, str]:
    """Every statement of ``vendor``'s files, by name (:func:`statement`)."""
    return {name: statement(name, vendor) for name in _blocks(vendor)[0]}


def _splice(text: str, vendor: str) -> str:
    return _SPLICE.sub(lambda m: fragment(m[1], vendor), text)
