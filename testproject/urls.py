"""URLs of the test project."""

from django.contrib import admin
from django.urls import path

from testproject.inventory import views

urlpatterns = [
    path("admin/", admin.site.urls),
    path("inventory/<str:store_id>/sync", views.sync_inventory, name="sync-inventory"),
    path("runs/<str:run_id>", views.run_status, name="run-status"),
]
