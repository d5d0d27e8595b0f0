"""What the plan's helper modules read of a plan: ``PlanView`` (``PipelinePlan`` is one) and
``PhasedView`` (``PhasedPlan`` is one).

Validation (``validate``), the text form (``text``), thread maps (``threads``) and the schedule
table (``table``) take a plan and read it; the plan classes call them. Typing the helpers
against these protocols keeps the imports one way: the plan modules import the helpers, the
helpers import only this and ``task``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from torchrec_swp.plan.task import Dep, PipelineTask, ScheduledTask, TaskSchedule


class PlanView(Protocol):
    """The read-only surface of a ``PipelinePlan`` its helpers use."""

    @property
    def name(self) -> str: ...

    @property
    def source(self) -> str | None: ...

    @property
    def output(self) -> str | None: ...

    @property
    def on_exhausted(self) -> str: ...

    @property
    def pipeline_depth(self) -> int: ...

    @property
    def lookahead(self) -> int: ...

    @property
    def loads(self) -> int: ...

    @property
    def fire_order(self) -> tuple[str, ...]: ...

    @property
    def explicit_deps(self) -> tuple[Dep, ...]: ...

    @property
    def schedule(self) -> Mapping[str, TaskSchedule]: ...

    @property
    def tasks(self) -> Mapping[str, PipelineTask]: ...

    @property
    def max_stage(self) -> int: ...

    def task(self, name: str) -> ScheduledTask: ...

    def scheduled(self) -> list[ScheduledTask]: ...

    def fire_index(self, task: str) -> int: ...

    def source_lanes(self) -> tuple[str, ...]: ...

    def writer_of(self, data: str) -> str | None: ...


class PhasedView(Protocol):
    """The read-only surface of a ``PhasedPlan`` its text form uses."""

    @property
    def name(self) -> str: ...

    @property
    def clock(self) -> str: ...

    @property
    def cycle(self) -> tuple[int, int] | None: ...

    @property
    def phases(self) -> tuple[tuple[int, PlanView], ...]: ...
