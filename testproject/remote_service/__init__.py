"""A second service sharing the test project's database: its own settings
module and Celery app, and the body of ``remote-sync``, which only its
workers run (SPEC section 2, ``register_remote``; docs/remote.rst)."""
