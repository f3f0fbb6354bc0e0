"""Class- and decorator-declared workflows: :func:`workflow` and :class:`BaseWorkflow`.

Both fill a :class:`~durable_singleton.definitions.Registry` (the
process-wide one by default); :meth:`BaseWorkflow.start` starts a run on the
default engine of :mod:`durable_singleton.runtime`, so this module is a shell
above the composition root.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import fields
from typing import Any, ClassVar, TypeVar

from .context import WorkflowCtx
from .definitions import (
    Debounce,
    Quota,
    Registry,
    Singleton,
    Throttle,
    WorkflowDefinition,
    WorkflowOptions,
    origin_of,
    registry,
)
from .exceptions import InvalidWorkflowError
from .records import RunRecord
from .runtime import get_engine
from .schedule_specs import Schedule

__all__ = ["BaseWorkflow", "options_from", "workflow"]


def options_from(workflow_name: str, value: WorkflowOptions | Mapping[str, Any]) -> dict[str, Any]:
    """Return the registration options of a ``WorkflowOptions`` or a mapping of its fields."""
    known = [f.name for f in fields(WorkflowOptions)]
    if isinstance(value, WorkflowOptions):
        return {name: getattr(value, name) for name in known}
    if isinstance(value, Mapping):
        unknown = set(value) - set(known)
        if unknown:
            raise InvalidWorkflowError(workflow_name, "workflow", f"unknown options {sorted(unknown)}")
        if "name" not in value:
            raise InvalidWorkflowError(workflow_name, "name", "is required")
        return {"version": "1", **value}
    raise InvalidWorkflowError(
        workflow_name, "workflow", f"expected a mapping or WorkflowOptions, got {type(value).__name__}"
    )


W = TypeVar("W")


def workflow(
    name: str,
    version: str = "1",
    *,
    singleton: Singleton | Mapping[str, Any] | None = None,
    timeout: float | None = None,
    steps: Iterable[str] = (),
    queue: str | None = None,
    on_dead: Callable[[RunRecord], None] | None = None,
    events: Iterable[str] = (),
    schedules: Iterable[Schedule] = (),
    quotas: Iterable[Quota] = (),
    debounce: Debounce | None = None,
    throttles: Iterable[Throttle] = (),
    registry: Registry = registry,
) -> Callable[[W], W]:
    """Register the decorated :class:`BaseWorkflow` subclass or function as a workflow.

    A function body takes ``(ctx, input)``. ``quotas``: a sequence of the
    shared :class:`~durable_singleton.definitions.Quota` limits its runs carry
    (X3). ``debounce``: a :class:`~durable_singleton.definitions.Debounce`
    that folds a burst of starts into one run (X7). Raises :class:`InvalidWorkflowError`
    (X3); ``throttles``: the shared :class:`~durable_singleton.definitions.Throttle`
    rate limits (X6). Raises :class:`InvalidWorkflowError`
    at decoration time for an invalid option.
    """
    options = WorkflowOptions(
        name=name,
        version=version,
        singleton=singleton,
        timeout=timeout,
        steps=tuple(steps),
        queue=queue,
        on_dead=on_dead,
        events=tuple(events),
        schedules=tuple(schedules),
        quotas=quotas if quotas is None or isinstance(quotas, (str, Quota)) else tuple(quotas),  # type: ignore[arg-type]  # refused at registration (X3a)
        debounce=debounce,
        throttles=(
            throttles if throttles is None or isinstance(throttles, (str, Throttle)) else tuple(throttles)  # type: ignore[arg-type]  # refused at registration (X6)
        ),
    )

    def decorate(target: W) -> W:
        if isinstance(target, type) and issubclass(target, BaseWorkflow):
            target.workflow = options
            target._register(registry)
        else:
            registry.add(body=target, **options_from(name, options))  # type: ignore[arg-type]
        return target

    return decorate


class BaseWorkflow:
    """Base class of class-declared workflows; override :meth:`run`.

    Declare options with the :func:`workflow` decorator or a ``workflow`` class
    attribute (a mapping or :class:`WorkflowOptions`).
    """

    workflow: ClassVar[WorkflowOptions | Mapping[str, Any] | None] = None
    definition: ClassVar[WorkflowDefinition]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.__dict__.get("workflow") is not None:
            cls._register(registry)

    @classmethod
    def _register(cls, target: Registry) -> None:
        options = options_from(cls.__qualname__, cls.__dict__["workflow"])
        cls.definition = target.add(body=cls._body, origin=origin_of(cls), **options)

    @classmethod
    def _body(cls, ctx: WorkflowCtx, input: Any) -> Any:
        return cls().run(ctx, input)

    def run(self, ctx: WorkflowCtx, input: Any) -> Any:
        """Run the workflow body; called again from the top after every suspension (R4)."""
        raise NotImplementedError(f"{type(self).__qualname__}.run")

    @classmethod
    def start(
        cls,
        input: Any,
        *,
        run_id: str | None = None,
        tags: Iterable[str] = (),
        engine: Any = None,
        priority: int = 0,
    ) -> RunRecord:
        """Start a run of this workflow; see :meth:`Engine.start`. Never blocks (S3).

        ``priority``: an int from -100 to 100, the run's place among its key's
        waiters (X8); raises :class:`~durable_singleton.exceptions.InvalidPriorityError`
        otherwise, writing nothing."""
        return (engine or get_engine()).start(
            cls.definition.name, input, run_id=run_id, tags=tags, version=cls.definition.version, priority=priority
        )

    dispatch = start

    @classmethod
    async def astart(
        cls,
        input: Any,
        *,
        run_id: str | None = None,
        tags: Iterable[str] = (),
        engine: Any = None,
        priority: int = 0,
    ) -> RunRecord:
        """Start a run of this workflow off the event loop, for async views; see ``Engine.astart``.

        Raises what :meth:`start` raises, each writing nothing (S15, X8, section 7).
        """
        runner = engine or get_engine()
        return await runner.astart(
            cls.definition.name, input, run_id=run_id, tags=tags, version=cls.definition.version, priority=priority
        )

    adispatch = astart
