"""Workflows and a client shared by two releases in tests/workers/test_rolling_deploy.py.

This folder is copied beside each release's source and put on its
``PYTHONPATH``; it uses only names both releases export (the ``workflow``
decorator, ``Singleton``, ``Quota``, ``get_engine``) and the test project's
``BodyAudit`` model, so the older release and this one register the same
workflows under the same names and versions (S2)."""
