"""The quota machine's failure of #34 item 11, replayed step by step (X3f, K1, X3g).

``quota token 2 of r003 after [1, 3]``: a cancel freed a quota slot and its
release admitted the next waiter, which took the quota key's next token; a
settle's handoff then admitted another run with the token after it. The machine
recorded the handoff's admission (from ``Finish.granted``) and a claim's, but
not the release's that a cancel makes, so the waiter's later claim, which
confirmed its token, read as a token handed out of order. The store hands the
tokens out in admission order; the machine now records every admission where it
happens (a claim's and its grants, a settle's handoff, and a tick's or a
cancel's through ``run_admitted``), and nothing in it waits on the wall clock.
"""

from __future__ import annotations

from typing import Any

import pytest

from durable_singleton.models import Run, SingletonKey
from durable_singleton.stores.django import DjangoStore
from tests.model.test_quota_model import QuotaProtocol


class _Pick:
    """A rule's ``data`` that draws the value given."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def draw(self, strategy: Any) -> Any:
        return self.value


@pytest.mark.django_db(transaction=True)
def test_a_cancels_admission_is_recorded_before_a_later_handoff_admission() -> None:
    """X3f, K1, X3g: five runs of quota key P (limit 2): the first two claim
    (tokens 1, 2); the first settles and its handoff admits the third (3); the
    third is cancelled and the release admits the fourth (4); the second settles
    and its handoff admits the fifth (5); the fourth's claim confirms 4. The
    machine records the tokens in admission order, 1 to 5, whatever the wall
    clock does meanwhile."""

    def fresh(clock: Any) -> DjangoStore:
        Run.objects.all().delete()
        SingletonKey.objects.all().delete()
        return DjangoStore()

    machine_class = type("Machine", (QuotaProtocol,), {"make_store": staticmethod(fresh)})
    machine = machine_class()
    try:

        def start() -> str:
            machine.start(workflow="plain", key="P", tenant="a")
            return str(machine.created[-1])

        first, second = start(), start()
        machine.turn(_Pick(first))
        machine.turn(_Pick(second))
        third, fourth, fifth = start(), start(), start()
        machine.settle(_Pick(first))  # its handoff admits the third (token 3)
        assert machine.store.get_run(third).quota_slot == "holder"
        machine.cancel(_Pick(third))  # its release admits the fourth (token 4)
        assert machine.store.get_run(fourth).quota_slot == "holder"
        machine.settle(_Pick(second))  # its handoff admits the fifth (token 5)
        assert machine.store.get_run(fifth).quota_slot == "holder"
        machine.turn(_Pick(fourth))  # the fourth's claim confirms token 4
        assert machine.tokens[("pool", "P")] == [1, 2, 3, 4, 5]
    finally:
        machine.teardown()
