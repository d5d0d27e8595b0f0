"""What the simulator and its checks report: errors, and the records they carry.

Every message says where: thread, internal iteration, instruction or task, batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


class SimError(RuntimeError):
    """A program or an input the simulator cannot replay (bad durations, malformed program)."""


@dataclass(frozen=True, slots=True)
class Blocked:
    """One thread stuck in a deadlock: the instruction it cannot execute and why."""

    thread: str
    iteration: int
    index: int  # position of the instruction in the thread's program for that iteration
    instruction: str
    reason: str
    rank: int | None = None  # set by the multi-rank simulator (``simulate_ranks``)

    def __str__(self) -> str:
        who = f"rank {self.rank} " if self.rank is not None else ""
        return (
            f"{who}thread {self.thread!r} (internal iteration {self.iteration}, instruction {self.index}) "
            f"blocked on `{self.instruction}`: {self.reason}"
        )


class SimDeadlock(SimError):
    """No instruction can make progress while some remain.

    ``blocked`` lists every stuck thread; the message also shows the plan's schedule grid with
    the first blocked task marked ``*``.
    """

    def __init__(self, message: str, blocked: tuple[Blocked, ...]) -> None:
        super().__init__(message)
        self.blocked = blocked


@dataclass(frozen=True, slots=True)
class Race:
    """A dependency instance ``consumer(batch)`` after ``producer(producer_batch)`` that the
    program does not enforce, or that the simulated timeline breaks.

    ``kind``: ``"cpu-order"`` (no happens-before edge between the CPU runs), ``"cpu-time"``
    (the consumer started before the producer ended), ``"device-order"`` (no stream wait on
    the producer's event before the consumer's device work), ``"device-time"`` (the consumer's
    device work started before the producer's ended).
    """

    kind: str
    consumer: str
    batch: int
    producer: str
    producer_batch: int
    thread: str
    iteration: int
    detail: str

    def __str__(self) -> str:
        return (
            f"{self.kind}: {self.consumer}({self.batch}) on thread {self.thread!r} at internal iteration "
            f"{self.iteration} may run before {self.producer}({self.producer_batch}): {self.detail}"
        )


class SimRace(SimError):
    """Dependencies the program does not enforce; ``races`` lists every one."""

    def __init__(self, message: str, races: tuple[Race, ...]) -> None:
        super().__init__(message)
        self.races = races


def check_non_negative(owner: object, names: tuple[str, ...]) -> None:
    """ValueError unless each of ``owner``'s fields ``names`` is a finite number >= 0."""
    for name in names:
        v = getattr(owner, name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise ValueError(f"{type(owner).__name__}.{name} must be a finite number >= 0, got {v!r}")
