"""State stores: the protocol, the Django ORM store, the in-memory store and the codec store."""

from __future__ import annotations

from .base import AdmissionResult, RunRecord, StateStore, StepRecord

__all__ = ["AdmissionResult", "RunRecord", "StateStore", "StepRecord"]
