"""A synthetic workload for the engine: tasks that sleep for set durations.

``time.sleep`` releases the GIL, as a device kernel, a collective or I/O does, so tasks on
different threads really overlap. This module imports the engine (and so torch); the rest of
``torchrec_swp.profiler`` does not.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torchrec_swp.engine import Engine
from torchrec_swp.plan import PipelinePlan, PlanError
from torchrec_swp.profiler.profile import Profile
from torchrec_swp.profiler.task_profiler import TaskProfiler


@dataclass(frozen=True)
class SleepWorkload:
    """Every task of ``plan`` sleeps ``durations[task]`` seconds; the source yields batches
    ``0 .. num_batches - 1``; a task writing data writes the batch index into each name."""

    plan: PipelinePlan
    durations: Mapping[str, float] = field(hash=False)

    def __post_init__(self) -> None:
        missing = [t for t in self.plan.fire_order if t not in self.durations]
        if missing:
            raise PlanError(
                f"SleepWorkload: no duration for task {missing[0]} of plan {self.plan.name}", culprit=missing[0]
            )

    def bindings(self, num_batches: int, plan: PipelinePlan | None = None) -> dict[str, Callable[..., Any]]:
        """Functions for every task of ``plan`` (default: the workload's)."""
        plan = plan or self.plan
        return {t: self._task(plan, t, num_batches) for t in plan.fire_order}

    def _task(self, plan: PipelinePlan, task: str, num_batches: int) -> Callable[..., Any]:
        seconds = float(self.durations[task])
        writes = len(plan.tasks[task].writes)
        is_source = task == plan.source

        def run(b: int, **reads: Any) -> Any:
            if is_source and b >= num_batches:
                raise StopIteration
            time.sleep(seconds)
            if writes == 0:
                return None
            return b if writes == 1 else (b,) * writes

        return run

    def profile(self, plan: PipelinePlan | None = None, *, num_batches: int = 30, warmup: int = 2) -> Profile:
        """Run ``plan`` (default: the workload's) over ``num_batches`` batches on a fresh Engine
        with a TaskProfiler attached, and return the profile."""
        plan = plan or self.plan
        engine = Engine(plan, self.bindings(num_batches, plan), name="swp-sleep")
        profiler = TaskProfiler(warmup=warmup).attach(engine)
        try:
            engine.run_to_end()
        finally:
            engine.close()
        return profiler.profile(plan)
