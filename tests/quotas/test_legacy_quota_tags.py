"""An older release's caller tags after an upgrade (R1, X3b; #34 item 2).

The release before quotas stored a caller's tags as given, ``quota:billing:acme``
included. A run's quota keys are what its start recorded beside its memberships,
never a caller's tag read again: such a tag stays one of the run's user tags,
explain names no quota, and no claim creates a lock row for a quota nobody
declared."""

from __future__ import annotations

import pytest
from django.utils import timezone

from durable_singleton.definitions import Registry
from durable_singleton.models import QuotaMembership, Run, SingletonKey
from durable_singleton.stores.django import record_of
from durable_singleton.testing import make_engine
from tests.helpers import apps_at, claim, migrate_to_latest, settle

pytestmark = pytest.mark.django_db(transaction=True)

#: The last migration of the release before quotas (0010 added them).
BEFORE_QUOTAS = [("durable_singleton", "0009_untracked_index")]
OLD_TAGS = ["quota:billing:acme", "mine"]


def _old_release_runs() -> None:
    """Insert, on the schema of the release before quotas, a waiter of key K and
    a run without a key, each with the caller's tag ``quota:billing:acme``, as
    that release stored them; then migrate to this release, and insert one more
    as a process of that release still running would."""
    old_run = apps_at(BEFORE_QUOTAS).get_model("durable_singleton", "Run")
    now = timezone.now()
    common = {"workflow_version": "1", "status": "pending", "input": {}, "tags": OLD_TAGS}
    old_run.objects.create(
        run_id="keyed",
        workflow_name="keyed",
        singleton_key="K",
        singleton_limit=1,
        singleton_tracked=True,
        singleton_slot="waiter",
        created_at=now,
        updated_at=now,
        **common,
    )
    old_run.objects.create(run_id="plain", workflow_name="plain", created_at=now, updated_at=now, **common)
    migrate_to_latest()
    # A process of the older release still running during the rolling upgrade inserts
    # its runs without the columns it does not know.
    old_run.objects.create(run_id="late", workflow_name="plain", created_at=now, updated_at=now, **common)


def test_an_older_release_caller_tag_spelled_as_a_quota_key_is_never_read_as_one() -> None:
    """R1, X3b: after migrating, a run whose caller tag reads ``quota:billing:acme``
    carries no quota: the tag stays among its user tags, explain (K3) names no
    quota before or after its claim, the claim takes its singleton slot alone
    and creates no lock row ``quota:billing``, and its settle leaves none; a run
    such a process inserts after the migration (no ``quota_keys``) is the same."""
    _old_release_runs()
    registry = Registry()
    registry.add("keyed", "1", lambda ctx, i: None, singleton={"key": lambda i: "K"})
    registry.add("plain", "1", lambda ctx, i: None)
    engine = make_engine("django", registry=registry)
    for run_id in ("keyed", "plain", "late"):
        run = engine.get(run_id)
        assert run.user_tags == tuple(OLD_TAGS) and run.quota_keys == ()
        assert "quota" not in engine.explain(run_id).sentence
        turn = claim(engine, run_id)
        assert turn is not None and turn.run.run_id == run_id
        run = engine.get(run_id)
        assert run.status == "running" and run.quota_keys == () and run.quota_slot is None
        assert run.user_tags == tuple(OLD_TAGS)
        assert "quota" not in engine.explain(run_id).sentence
        assert settle(engine, run_id, "completed")
    assert not SingletonKey.objects.filter(workflow_name__startswith="quota:").exists()
    assert not QuotaMembership.objects.exists()
    assert sorted(Run.objects.values_list("status", flat=True)) == ["completed"] * 3


def test_migration_0015_copies_the_quota_keys_a_start_recorded_and_keeps_every_caller_tag() -> None:
    """X3b, R1: a run stored by the release that wrote its quota keys as tags
    ``quota:<name>:<key>`` keeps them as its quota keys (each has a membership),
    and a tag of that spelling without a membership stays the caller's."""
    before = [("durable_singleton", "0011_fair_quotas")]
    apps = apps_at(before)
    old_run = apps.get_model("durable_singleton", "Run")
    old_member = apps.get_model("durable_singleton", "QuotaMembership")
    now = timezone.now()
    run = old_run.objects.create(
        run_id="carrier",
        workflow_name="w",
        workflow_version="1",
        status="pending",
        input={},
        tags=["mine", "quota:billing:acme", "quota:api:k1"],
        quota_slot="waiter",
        created_at=now,
        updated_at=now,
    )
    old_member.objects.create(run=run, quota="api", key="k1", slot="waiter", created_at=now)
    migrate_to_latest()
    row = Run.objects.get(pk="carrier")
    # The tags stay as stored (an older release's process reads its quotas from them);
    # the keys are the column's, and the user tags are every tag but those keys' spelling.
    assert row.tags == ["mine", "quota:billing:acme", "quota:api:k1"] and row.quota_keys == [["api", "k1"]]
    record = record_of(row)
    assert record.quota_keys == (("api", "k1"),) and record.user_tags == ("mine", "quota:billing:acme")


def test_a_run_this_release_starts_spells_its_quota_keys_in_its_tags_for_the_release_before() -> None:
    """R1, X3b, rolling upgrade: the release before 0015 reads a run's quota keys from
    its tags (``quota:<name>:<key>``, its ``admission.split_quota_tags``). A run this
    release starts keeps its keys in ``quota_keys`` and spells them in its tags too, so a
    process of that release still running sees the quotas of the runs this one starts and
    admits no run over a quota's limit; this release reads the column only, and the caller's
    tags come back without the keys' spelling (a caller's own ``quota:...`` tag is dropped
    at start, S12)."""
    from durable_singleton import Quota

    registry = Registry()
    registry.add("charge", "1", lambda ctx, i: None, quotas=[Quota("billing", key=lambda i: i["account"], limit=1)])
    engine = make_engine("django", registry=registry)
    run = engine.start("charge", {"account": "acme"}, tags=["mine", "quota:forged:x"])
    row = Run.objects.get(pk=run.run_id)
    assert row.quota_keys == [["billing", "acme"]]
    assert row.tags == ["mine", "quota:billing:acme"]
    # What the release before read from the tags (its split_quota_tags): the same keys.
    old_reading = [tuple(tag.split(":", 2)[1:]) for tag in row.tags if tag.startswith("quota:") and tag.count(":") >= 2]
    assert old_reading == [("billing", "acme")]
    assert engine.get(run.run_id).user_tags == ("mine",) and engine.get(run.run_id).quota_keys == (("billing", "acme"),)
