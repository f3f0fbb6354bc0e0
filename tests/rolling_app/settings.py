"""The release's own test project settings, with this app installed (its
``workflows`` module is discovered as every installed app's is)."""

from testproject.settings import *  # noqa: F403 - the release's settings, as its test project defines them

INSTALLED_APPS = [*INSTALLED_APPS, "rolling_app"]  # noqa: F405
