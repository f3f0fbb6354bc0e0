from django.apps import AppConfig


class InventoryConfig(AppConfig):
    name = "testproject.inventory"
    label = "inventory"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from . import crash_hooks

        crash_hooks.connect()  # test-only, armed by DS_KILL_AT (tests/core/test_handoff_crash_windows.py)
