"""What a drop-in declares, and the check of it when its class is defined (not when a pipeline is built).

A task function is a method marked with its task's name::

    @task("Forward")
    def _task_forward(self, b: int, batch: Any, context: Any) -> tuple[Any, Any]: ...

A class's tasks are those of its bases (mixins included, e.g. ``TrainingTasks``) and its own,
found by method name, so that a subclass overriding ``_task_forward`` without the mark keeps
task Forward with its own body. ``_swp_without_tasks`` (a class attribute) drops inherited tasks
the class does not run (BwdOpt's Backward and OptimizerStep).

When a class is defined, ``check_class`` raises TypeError naming the class, the name and the
close matches where:

1. a task name the class has or drops is in no plan the catalog can make
   (``catalog_task_names()``: every drop-in's default plan, with each of its catalog function's
   switches flipped, and Fetch of ``with_parallel_loads``); checked for the package's classes and
   every row of ``torchrec_swp.drop_ins`` (a user's subclass may add tasks for plans of its own);
2. for a row of ``torchrec_swp.drop_ins``: a task of its default plan has no function (unless the
   class makes its task functions from its arguments, as StagedTrainPipeline from its stages),
   or one of ``PlanDriven``'s abstract hooks is not implemented.
"""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from typing import Any, TypeVar

from torchrec_swp import drop_ins

F = TypeVar("F", bound=Callable[..., Any])

#: The attribute ``task`` sets on a task function: its task's name.
TASK_ATTRIBUTE = "__swp_task__"


def task(name: str) -> Callable[[F], F]:
    """Mark a method as the function of task ``name`` (``fn(self, b, **reads)``)."""

    def mark(fn: F) -> F:
        marked = getattr(fn, TASK_ATTRIBUTE, None)
        if marked is not None and marked != name:
            raise TypeError(
                f"{fn.__qualname__} is already the function of task {marked!r}; for task {name!r} write a "
                "method that calls it"
            )
        setattr(fn, TASK_ATTRIBUTE, name)
        return fn

    return mark


def task_methods(cls: type) -> dict[str, str]:
    """``{task: method name}`` of ``cls``: its bases' (the farthest first) and its own, less what
    each class drops (``_swp_without_tasks``)."""
    table: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        for name in klass.__dict__.get("_swp_without_tasks", ()):
            table.pop(name, None)
        table.update(_marked(klass))
    return table


def _marked(klass: type) -> dict[str, str]:
    found = {}
    for attribute, value in klass.__dict__.items():
        name = getattr(value, TASK_ATTRIBUTE, None) if inspect.isfunction(value) else None
        if isinstance(name, str):
            found[name] = attribute
    return found


@functools.cache
def catalog_task_names() -> frozenset[str]:
    """Every task name a catalog plan of a drop-in can have: each row's default plan, and the
    plans its catalog function makes with each of its switches (bool arguments) flipped, plus
    ``with_parallel_loads``'s Fetch."""
    from torchrec_swp.catalog.transforms import FETCH

    names = {FETCH}
    for plan in catalog_plans():
        names |= _task_names(plan)
    return frozenset(names)


def catalog_plans() -> list[Any]:
    """Every drop-in's default plan, and the plans its catalog function makes with each of its
    switches (bool arguments) flipped."""
    from torchrec_swp.catalog import torchrec as catalog

    plans = []
    for row in drop_ins.drop_ins():
        plans.append(catalog.default_plan(row))
        for parameter in inspect.signature(getattr(catalog, row.plan)).parameters.values():
            if isinstance(parameter.default, bool):  # a switch: the plan with it flipped
                flipped = {**row.plan_arguments, parameter.name: not parameter.default}
                plans.append(catalog.default_plan(replace(row, plan_arguments=flipped)))
    return plans


def _task_names(plan: Any) -> set[str]:
    return {t for p in getattr(plan, "plans", (plan,)) for t in p.schedule}


def check_class(cls: type, *, abstract: Iterable[str], tasks_from_arguments: bool) -> None:
    """The checks of the module docstring; ``abstract``: the hooks every drop-in implements,
    ``tasks_from_arguments``: the class makes its task functions from its constructor's arguments."""
    row = drop_ins.find(cls.__module__, cls.__name__)
    if row is None and not cls.__module__.startswith("torchrec_swp."):
        return
    owner = cls.__name__
    known = catalog_task_names()
    table = task_methods(cls)
    for name, method in sorted(table.items()):
        if name not in known:
            raise TypeError(
                f"{owner}.{method} is marked @task({name!r}), a task no catalog plan has{_close(name, known)}"
            )
    for klass in cls.__mro__:
        for name in klass.__dict__.get("_swp_without_tasks", ()):
            if name not in known:
                close = _close(name, known)
                raise TypeError(
                    f"{klass.__name__}._swp_without_tasks names {name!r}, a task no catalog plan has{close}"
                )
    if row is None:
        return
    missing = [name for name in abstract if getattr(getattr(cls, name, None), "__isabstractmethod__", False)]
    if missing:
        raise TypeError(f"{owner} (a drop-in of torchrec_swp.drop_ins) does not implement {', '.join(missing)}")
    if tasks_from_arguments:
        return
    from torchrec_swp.catalog import torchrec as catalog

    plan = catalog.default_plan(row)
    for name in sorted(_task_names(plan)):
        if name not in table:
            raise TypeError(
                f"{owner}: its default plan (torchrec_swp.catalog.torchrec.{row.plan}) has task {name!r}, and no "
                f"method of {owner} is marked @task({name!r}){_close(name, table)}"
            )


def _close(name: str, names: Iterable[str] | Mapping[str, Any]) -> str:
    matches = difflib.get_close_matches(name, list(names), n=3)
    return f" (close: {', '.join(matches)})" if matches else ""
