"""The browser fixtures for every browser test of the admin (Debian's chromium via
Playwright against the live server; tests/admin/test_browser_admin.py defines them)."""

from tests.admin.test_browser_admin import browser, chromium, thread_workers

__all__ = ["browser", "chromium", "thread_workers"]
