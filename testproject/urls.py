"""URLs of the test project."""

from django.contrib import admin
from django.urls import path

from testproject.inventory import async_views, views

urlpatterns = [
    path("admin/", admin.site.urls),
    path("inventory/<str:store_id>/sync", views.sync_inventory, name="sync-inventory"),
    path("runs/<str:run_id>", views.run_status, name="run-status"),
    path("async/inventory/<str:store_id>/sync", async_views.sync_inventory, name="async-sync-inventory"),
    path("async/runs/<str:run_id>", async_views.run_status, name="async-run-status"),
    path("async/runs/<str:run_id>/signal/<str:name>", async_views.signal_run, name="async-signal-run"),
    path("async/runs/<str:run_id>/cancel", async_views.cancel_run, name="async-cancel-run"),
    path("async/ping", async_views.ping, name="async-ping"),
]

try:  # the optional extra durable-singleton[prometheus]
    from durable_singleton.metrics import metrics_view
except ImportError:
    pass
else:
    urlpatterns.append(path("metrics", metrics_view, name="metrics"))
