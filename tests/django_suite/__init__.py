"""Django's own ``tests/tasks`` suite, run against the durable task backend.

``python -m tests.django_suite.run`` takes the ``tests/tasks`` folder of the
installed Django version from its source distribution (``pip download``,
cached in the system's temporary directory), runs it with Django's test
runner under :mod:`tests.django_suite.settings`, and compares what failed
with :data:`tests.django_suite.differences.DIFFERENCES`, the documented
differences that are the only failures allowed (docs/django_tasks.rst).

Django's suite configures its two built-in backends by path. The runner
points both paths at the stand-ins of :mod:`tests.django_suite.backends`,
subclasses of :class:`~durable_singleton.tasks_backend.DurableSingletonBackend`,
so every test that enqueues, reads a result or checks the backend runs ours:
on the engine's manual dispatcher and the SQLite database of the settings.
"""
