"""The live demo behind ``bash tools/demo``: ``manage.py durable_demo`` and its verdict.

It lives in the test project, not in the installed app, so users' projects do
not list a command that needs this repository's inventory app.
"""
