"""WSGI entry point of the test project.

With ``DURABLE_SINGLETON["DISPATCH"] = "thread"`` the embedded worker starts
when this module is loaded by the serving process (runserver's child,
each gunicorn worker), not at the first dispatch (O1).
"""

import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "testproject.settings")
application = get_wsgi_application()

from durable_singleton.worker import start_embedded_worker  # noqa: E402 (needs the app registry)

start_embedded_worker()
