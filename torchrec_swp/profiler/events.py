"""What the profiler records: every task run and cross-thread wait of one internal iteration.

Times are ``time.perf_counter()`` seconds, as the engine reports them to its observer.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RunEvent:
    """``task`` worked on ``batch`` on ``thread`` from ``start`` to ``end``; ``cpu``: the CPU
    time its thread spent in it (None when not measured)."""

    task: str
    batch: int
    thread: str
    start: float
    end: float
    cpu: float | None = None

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(frozen=True, slots=True)
class WaitEvent:
    """``thread`` blocked from ``start`` to ``end`` until ``producer`` (same iteration) finished."""

    producer: str
    thread: str
    start: float
    end: float


@dataclass(frozen=True, slots=True)
class IterationRecord:
    """One internal iteration as the engine ran it: its span on the calling thread and the
    runs and waits of every thread in it."""

    iteration: int
    start: float
    end: float
    runs: tuple[RunEvent, ...]
    waits: tuple[WaitEvent, ...]

    @property
    def duration(self) -> float:
        return self.end - self.start

    def ran(self) -> frozenset[str]:
        return frozenset(r.task for r in self.runs)
