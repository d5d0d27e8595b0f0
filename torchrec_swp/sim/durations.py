"""Task durations: how long a task instance occupies its CPU thread or its device stream.

A duration table is either a mapping ``{task: time}`` (the same for every batch) or a callable
``(task, batch) -> time`` (per-batch variation). Times are plain non-negative numbers in any
unit, used consistently.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

from torchrec_swp.sim.errors import SimError

Durations = Mapping[str, float] | Callable[[str, int], float]


def cpu_time(durations: Durations, task: str, batch: int, where: str) -> float:
    """CPU time of ``task`` on ``batch``. Every task that runs needs one; ``where`` names the
    thread and iteration for the error raised when it is missing or invalid."""
    if isinstance(durations, Mapping):
        if task not in durations:
            raise SimError(
                f"no CPU duration for task {task} (batch {batch}, {where}); durations name {sorted(durations)}"
            )
        return _checked(durations[task], "CPU", task, batch, where)
    return _checked(durations(task, batch), "CPU", task, batch, where)


def device_time(durations: Durations | None, task: str, batch: int, where: str) -> float:
    """Device time of ``task`` on ``batch``: 0 when the task submits no device work (no table,
    or a mapping that does not name it)."""
    return optional_time(durations, task, batch, where, "device")


def optional_time(durations: Durations | None, task: str, batch: int, where: str, kind: str) -> float:
    """A time of ``task`` on ``batch`` that tasks may lack: 0 with no table, or a mapping that
    does not name the task. ``kind`` names the table in errors ("device", "off-CPU")."""
    if durations is None:
        return 0.0
    if isinstance(durations, Mapping):
        return _checked(durations[task], kind, task, batch, where) if task in durations else 0.0
    return _checked(durations(task, batch), kind, task, batch, where)


def _checked(value: object, kind: str, task: str, batch: int, where: str) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or math.isnan(value)
        or value < 0
        or math.isinf(value)
    ):
        raise SimError(
            f"{kind} duration of task {task} (batch {batch}, {where}) must be a finite number >= 0, got {value!r}"
        )
    return float(value)
