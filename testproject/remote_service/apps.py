from django.apps import AppConfig


class RemoteServiceConfig(AppConfig):
    name = "testproject.remote_service"
    label = "remote_service"
    default_auto_field = "django.db.models.BigAutoField"
