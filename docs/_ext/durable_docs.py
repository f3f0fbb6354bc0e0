"""Sphinx directives for the API and settings references.

``.. public-names::`` lists ``durable_singleton.__all__``, each name linked to
where it is documented (an undocumented name is an unresolved reference, so
``sphinx-build -n -W`` fails); a reference to ``durable_singleton.NAME``
resolves to the module that defines NAME.

``.. setting:: NAME`` documents one key of ``DURABLE_SINGLETON`` (and gives
the ``:setting:`NAME``` role); ``.. settings-defaults::`` renders the table of
every key and its default from ``durable_singleton.conf.DEFAULTS``. When the
build ends, a key of DEFAULTS without a ``.. setting::`` entry, or an entry
for a key DEFAULTS does not have, is a warning, so ``sphinx-build -W`` fails.
"""

from __future__ import annotations

from typing import Any

from docutils import nodes
from sphinx import addnodes
from sphinx.application import Sphinx
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective

logger = logging.getLogger(__name__)


class SettingsDefaults(SphinxDirective):
    """Render a two-column table: each setting (linked) and its default."""

    def run(self) -> list[nodes.Node]:
        defaults: dict[str, Any] = self.config.durable_settings_defaults
        table = nodes.table()
        group = nodes.tgroup(cols=2)
        table += group
        group += nodes.colspec(colwidth=1)
        group += nodes.colspec(colwidth=1)
        head = nodes.thead()
        group += head
        head += self._row(nodes.Text("Setting"), nodes.Text("Default"))
        body = nodes.tbody()
        group += body
        for name, value in defaults.items():
            ref = addnodes.pending_xref(
                "",
                nodes.literal(text=name),
                refdomain="std",
                reftype="setting",
                reftarget=name,
                refdoc=self.env.docname,
            )
            body += self._row(ref, nodes.literal(text=repr(value)))
        return [table]

    @staticmethod
    def _row(*cells: nodes.Node) -> nodes.row:
        row = nodes.row()
        for cell in cells:
            entry = nodes.entry()
            entry += nodes.paragraph("", "", cell)
            row += entry
        return row


class PublicNames(SphinxDirective):
    """A bullet list of ``durable_singleton.__all__``, each linked to its defining module."""

    def run(self) -> list[nodes.Node]:
        import importlib

        package = importlib.import_module("durable_singleton")
        items = nodes.bullet_list()
        for name in package.__all__:
            target = f"{_defining_module(package, name)}.{name}"
            ref = addnodes.pending_xref(
                "", nodes.literal(text=name), refdomain="py", reftype="obj", reftarget=target, refdoc=self.env.docname
            )
            item = nodes.list_item()
            item += nodes.paragraph("", "", ref)
            items += item
        return [items]


def _defining_module(package: Any, name: str) -> str:
    """Return the module that defines public ``name``: its ``__module__``, or for
    a constant the submodule whose ``__all__`` holds the same object."""
    import importlib

    obj = getattr(package, name)
    module = getattr(obj, "__module__", None)
    if isinstance(module, str) and module.startswith(package.__name__):
        return module
    for candidate in ("admission", "conf", "exceptions", "definitions"):
        sub = importlib.import_module(f"{package.__name__}.{candidate}")
        if name in getattr(sub, "__all__", ()) and getattr(sub, name) is obj:
            return sub.__name__
    raise LookupError(f"cannot tell which module defines durable_singleton.{name}")


def resolve_public_alias(app: Sphinx, env: Any, node: Any, contnode: nodes.Element) -> nodes.Element | None:
    """Resolve ``durable_singleton.NAME`` for a name of ``__all__`` to where NAME is
    documented, as ``from durable_singleton import NAME`` resolves it in code."""
    import importlib

    target = node.get("reftarget", "")
    if node.get("refdomain") != "py" or not target.startswith("durable_singleton."):
        return None
    package = importlib.import_module("durable_singleton")
    name = target.removeprefix("durable_singleton.")
    if name not in package.__all__:
        return None
    real = f"{_defining_module(package, name)}.{name}"
    return env.get_domain("py").resolve_xref(env, node["refdoc"], app.builder, node["reftype"], real, node, contnode)


def check_documented(app: Sphinx, env: Any) -> None:
    """Warn for every setting in DEFAULTS not documented, and every documented one unknown."""
    defaults = set(app.config.durable_settings_defaults)
    documented = {name for (kind, name) in env.get_domain("std").objects if kind == "setting"}
    for name in sorted(defaults - documented):
        logger.warning("setting %s is in durable_singleton.conf.DEFAULTS but has no '.. setting::' entry", name)
    for name in sorted(documented - defaults):
        logger.warning("'.. setting:: %s' documents a key that durable_singleton.conf.DEFAULTS does not have", name)


def setup(app: Sphinx) -> dict[str, Any]:
    app.add_config_value("durable_settings_defaults", {}, "env")
    app.add_object_type("setting", "setting", indextemplate="pair: %s; setting")
    app.add_directive("settings-defaults", SettingsDefaults)
    app.add_directive("public-names", PublicNames)
    app.connect("env-check-consistency", check_documented)
    app.connect("missing-reference", resolve_public_alias)
    return {"parallel_read_safe": True, "env_version": 1}
