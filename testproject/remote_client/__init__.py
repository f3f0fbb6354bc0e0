"""The caller's side of ``remote-sync``: this project declares it remote and
starts it; the other service (testproject.remote_service) runs its body.

Installed by testproject.settings only where turns go through Celery, the
only dispatcher that reaches the other service (system check E005): the
choice is made where the settings are, never by reading them at import."""
