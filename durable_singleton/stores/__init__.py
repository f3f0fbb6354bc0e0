"""Stores: the seam (:class:`BaseStore`), the Django ORM store and the in-memory store."""

from __future__ import annotations

from .base import AdmissionResult, BaseStore, RunRecord, StepRecord

__all__ = ["AdmissionResult", "BaseStore", "RunRecord", "StepRecord"]
