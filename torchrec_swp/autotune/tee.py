"""``Tee``: two engine observers in the one place the engine has for an observer.

Every call goes to both; a run's CPU time (``cpu=``) only to the one that asked for it
(``wants_cpu``), ``on_step`` only to an observer that has it.
"""

from __future__ import annotations

from typing import Any


class Tee:
    def __init__(self, first: Any, second: Any) -> None:
        self.first, self.second = first, second
        self.wants_cpu = bool(getattr(first, "wants_cpu", False) or getattr(second, "wants_cpu", False))

    def on_run(
        self, task: str, batch: int, thread: str, iteration: int, start: float, end: float, cpu: float | None = None
    ) -> None:
        for o in (self.first, self.second):
            if cpu is not None and getattr(o, "wants_cpu", False):
                o.on_run(task, batch, thread, iteration, start, end, cpu=cpu)
            else:
                o.on_run(task, batch, thread, iteration, start, end)

    def on_wait(self, producer: str, thread: str, iteration: int, start: float, end: float) -> None:
        self.first.on_wait(producer, thread, iteration, start, end)
        self.second.on_wait(producer, thread, iteration, start, end)

    def on_iteration(self, iteration: int, start: float, end: float) -> None:
        self.first.on_iteration(iteration, start, end)
        self.second.on_iteration(iteration, start, end)

    def on_step(self, start: float, end: float, cpu_start: float, cpu_end: float) -> None:
        for o in (self.first, self.second):
            if hasattr(o, "on_step"):
                o.on_step(start, end, cpu_start, cpu_end)
