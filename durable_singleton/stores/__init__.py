"""State stores: the protocol, the Django ORM store and the in-memory store."""

from __future__ import annotations

from .base import AdmissionResult, RunRecord, StateStore, StepRecord

__all__ = ["AdmissionResult", "RunRecord", "StateStore", "StepRecord"]
