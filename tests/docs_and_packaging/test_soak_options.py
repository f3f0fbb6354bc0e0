"""The chaos soak's options (docs/reliability.rst): what ``python -m soak`` accepts."""

from __future__ import annotations

import pytest

from soak.driver import parse

pytestmark = pytest.mark.vendor_agnostic


def test_the_load_phase_goes_on_past_its_seconds_only_when_asked() -> None:
    """``--max-seconds`` (default ``--seconds``: no extension) bounds how long the load
    goes on past ``--seconds`` while fewer than ``--min-runs`` runs were started (a
    loaded machine, as two CI runs side by side); it may not be shorter than ``--seconds``."""
    assert parse(["--seconds", "165"]).max_seconds == 165
    assert parse(["--seconds", "165", "--max-seconds", "300", "--min-runs", "3000"]).max_seconds == 300
    with pytest.raises(SystemExit):
        parse(["--seconds", "165", "--max-seconds", "100"])
