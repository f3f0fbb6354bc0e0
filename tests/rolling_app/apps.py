from django.apps import AppConfig


class RollingAppConfig(AppConfig):
    name = "rolling_app"
    label = "rolling_app"
