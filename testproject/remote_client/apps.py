from django.apps import AppConfig


class RemoteClientConfig(AppConfig):
    name = "testproject.remote_client"
    label = "remote_client"
