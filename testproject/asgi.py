"""ASGI entry point of the test project (``uvicorn testproject.asgi:application``)."""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "testproject.settings")

application = get_asgi_application()

from durable_singleton.worker import start_embedded_worker  # noqa: E402 (needs the app registry)

# With DISPATCH "thread", each serving process starts its worker here (O1).
start_embedded_worker()
