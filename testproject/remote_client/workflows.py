"""``remote-sync``, declared with register_remote's options: this project
starts and gates it, the other service's workers on the ``remote`` queue run
its body (testproject.remote_service; D7). Discovered automatically, as every
installed app's ``workflows`` module is."""

from __future__ import annotations

from durable_singleton import Singleton
from durable_singleton.definitions import registry
from testproject.inventory.workflows import store_key

REMOTE_QUEUE = "remote"

registry.add(
    "remote-sync",
    "1",
    None,
    queue=REMOTE_QUEUE,
    singleton=Singleton(key=store_key, limit=1),
    remote=True,
    origin=f"remote:{REMOTE_QUEUE}",
)
