"""Migration 0008 (R4): a run whose steps were stored before 0004 added
``step_count`` (0 for every existing run) gets its count, so the claim, which
skips reading the steps of a run whose count is 0, does not run them again."""

from __future__ import annotations

import pytest
from django.utils import timezone

from tests.helpers import apps_at, migrate_to_latest

pytestmark = pytest.mark.django_db(transaction=True)

BEFORE = [("durable_singleton", "0007_not_before")]
AFTER = [("durable_singleton", "0008_fill_step_count")]


def test_runs_with_steps_stored_before_0004_get_their_step_count() -> None:
    apps = apps_at(BEFORE)
    Run = apps.get_model("durable_singleton", "Run")
    Step = apps.get_model("durable_singleton", "Step")
    now = timezone.now()
    common = {"workflow_name": "old", "workflow_version": "1", "status": "suspended", "input": {}, "tags": []}
    stepped = Run.objects.create(run_id="stepped", created_at=now, updated_at=now, step_count=0, **common)
    Run.objects.create(run_id="plain", created_at=now, updated_at=now, step_count=0, **common)
    for position in range(2):
        Step.objects.create(
            run=stepped, position=position, name="s", result={"ok": position}, started_at=now, finished_at=now
        )
    try:
        # The model as of 0008: a later migration's columns do not exist yet.
        after = apps_at(AFTER).get_model("durable_singleton", "Run")
        assert after.objects.get(pk="stepped").step_count == 2
        assert after.objects.get(pk="plain").step_count == 0
    finally:
        migrate_to_latest()
