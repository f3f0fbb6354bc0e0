"""``python -m soak``: run one chaos soak (see :mod:`soak.driver`)."""

from __future__ import annotations

from .driver import main

raise SystemExit(main())
