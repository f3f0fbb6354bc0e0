"""Sphinx configuration of the durable_singleton documentation.

Built in CI by tools/suites.sh with ``sphinx-build -W -n`` (warnings are
errors, every cross-reference must resolve). Autodoc imports the package
inside the repository's test project, so Django is configured first.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import django

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent / "_ext")]
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "testproject.settings")
django.setup()

from durable_singleton.conf import DEFAULTS  # noqa: E402  (needs the path above)

project = "durable_singleton"
author = "the durable-singleton maintainers"
copyright = "2026, the durable-singleton maintainers"
release = "0.1.0.dev0"

extensions = ["sphinx.ext.autodoc", "durable_docs"]
exclude_patterns = ["_build"]
html_static_path = ["_static"]

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": True}
python_use_unqualified_type_names = True

# Every reference into durable_singleton must resolve. References to other
# packages (Python, Django, Celery) cannot: the build runs offline, without
# intersphinx inventories, so those targets alone are left unchecked.
nitpicky = True
# Private names (a leading underscore) and type variables are not part of the
# API, so a base class or an annotation naming one is not documented either.
nitpick_ignore_regex = [
    (r"py:.*", r"(?!durable_singleton\b).*"),
    (r"py:.*", r"durable_singleton\.(\w+\.)*_\w+"),
    (r"py:class", r"durable_singleton\.(\w+\.)*[TW]"),
]

# The settings reference (settings.rst) must document exactly these names.
durable_settings_defaults = DEFAULTS
