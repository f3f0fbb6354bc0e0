"""A small real Django project used by the tests and the demo."""

from .celery import app as celery_app

__all__ = ["celery_app"]
