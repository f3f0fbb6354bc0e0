"""Benchmarks of durable_singleton against plain Celery and its peers (issue #4).

Run them with ``bash bench/run``; see ``docs/benchmarks.rst``.
"""
