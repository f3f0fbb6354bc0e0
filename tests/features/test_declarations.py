"""Declaring workflows and steps (SPEC section 2, section 7)."""

from __future__ import annotations

import pytest

from durable_singleton import BaseWorkflow, Singleton, WorkflowOptions, step, workflow
from durable_singleton.definitions import Registry
from durable_singleton.definitions import registry as global_registry
from durable_singleton.exceptions import (
    DuplicateWorkflowError,
    InvalidWorkflowError,
    UnknownStepError,
    UnknownWorkflowError,
)
from durable_singleton.testing import make_engine

pytestmark = pytest.mark.vendor_agnostic  # the registry and the in-memory store only


def test_decorated_class_is_registered_with_its_singleton(registry: Registry) -> None:
    @workflow(name="w1", version="2", singleton=Singleton(key=lambda i: i["k"], limit=3), registry=registry)
    class W1(BaseWorkflow):
        def run(self, ctx, input):  # type: ignore[no-untyped-def]
            return 1

    d = registry.get("w1")
    assert (d.name, d.version, d.singleton and d.singleton.limit) == ("w1", "2", 3)
    assert W1.definition is d


def test_class_attribute_mapping_and_typed_options_are_accepted() -> None:
    class MappingForm(BaseWorkflow):
        workflow = {"name": "test-mapping-form", "singleton": {"key": lambda i: "x", "max_queue_depth": 0}}

    class TypedForm(BaseWorkflow):
        workflow = WorkflowOptions(name="test-typed-form", version="7", singleton=Singleton(key=lambda i: "x"))

    assert global_registry.get("test-mapping-form").singleton.max_queue_depth == 0  # type: ignore[union-attr]
    assert global_registry.get("test-typed-form", "7").singleton.limit == 1  # type: ignore[union-attr]


def test_engine_register_plain_function(registry: Registry) -> None:
    engine = make_engine(registry=registry)
    engine.register("fn", "1", lambda ctx, i: i * 2, singleton={"key": lambda i: "k"})
    run = engine.start("fn", 21)
    engine.dispatcher.drain()
    assert engine.get(run.run_id).output == 42


@pytest.mark.parametrize(
    ("singleton", "field"),
    [
        ({"key": "not callable"}, "singleton.key"),
        ({"key": lambda i: "k", "limit": 0}, "singleton.limit"),
        ({"key": lambda i: "k", "limit": True}, "singleton.limit"),
        ({"key": lambda i: "k", "max_queue_depth": -1}, "singleton.max_queue_depth"),
        ({"limit": 1}, "singleton.key"),
        ({"key": lambda i: "k", "colour": 1}, "singleton"),
    ],
)
def test_invalid_declaration_is_refused_naming_workflow_and_field(
    registry: Registry, singleton: dict, field: str
) -> None:
    """Section 7: refused at registration with a message naming the workflow and the field."""
    with pytest.raises(InvalidWorkflowError) as info:
        registry.add("bad-wf", "1", lambda c, i: None, singleton=singleton)
    assert info.value.field == field
    assert "bad-wf" in str(info.value) and field in str(info.value)
    with pytest.raises(UnknownWorkflowError):
        registry.get("bad-wf")


def test_duplicate_name_and_version_is_refused(registry: Registry) -> None:
    registry.add("dup", "1", lambda c, i: 1)
    with pytest.raises(DuplicateWorkflowError, match="dup"):
        registry.add("dup", "1", lambda c, i: 2)
    registry.add("dup", "2", lambda c, i: 2)  # another version is fine


def test_unknown_declared_step_is_refused(registry: Registry) -> None:
    with pytest.raises(InvalidWorkflowError, match="unknown step 'nope'"):
        registry.add("wf-steps", "1", lambda c, i: 1, steps=["nope"])


def test_unknown_step_at_run_time_fails_the_run_with_a_typed_error(registry: Registry) -> None:
    engine = make_engine(registry=registry)
    engine.register("calls-missing", "1", lambda ctx, i: ctx.step("missing"))
    run = engine.start("calls-missing")
    engine.dispatcher.drain()
    final = engine.get(run.run_id)
    assert final.status == "failed"
    assert final.error["type"] == UnknownStepError.__qualname__


def test_step_decorator_registers_handler(registry: Registry) -> None:
    @step("double", registry=registry)
    def double(x: int) -> int:
        return x * 2

    assert registry.get_step("double")(4) == 8


def test_workflows_modules_are_discovered() -> None:
    """The test project's inventory/workflows.py is imported by ready()."""
    d = global_registry.get("sync-inventory")
    assert d.singleton is not None and d.singleton.max_queue_depth == 2
