"""An audit of body entry and exit, used by the demo's verdict and the end-to-end tests."""

from __future__ import annotations

from django.db import models


class BodyAudit(models.Model):
    """When a run's body entered and left, and in which process."""

    run_id = models.CharField(max_length=191, unique=True)
    workflow_name = models.CharField(max_length=191)
    key = models.CharField(max_length=191)
    entered_at = models.DateTimeField()
    exited_at = models.DateTimeField(null=True)
    pid = models.IntegerField()

    def __str__(self) -> str:
        return f"{self.run_id} {self.key}"
