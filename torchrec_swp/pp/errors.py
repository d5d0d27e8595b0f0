"""Errors about pipeline-parallel programs. Every message names rank, step and action where
there is one; validation and simulation errors also show the program grid with the culprit
cell marked ``>...<``."""

from __future__ import annotations

from dataclasses import dataclass


class PPError(ValueError):
    """A program (or a request to build, simulate or solve one) that cannot run.

    ``rank``, ``step`` (position in the rank's action list) and ``action`` (its text, e.g. ``0F1``)
    locate the culprit when there is one, so that tools and tests need not parse the message.
    """

    def __init__(self, message: str, *, rank: int | None = None, step: int | None = None, action: str | None = None):
        super().__init__(message)
        self.rank = rank
        self.step = step
        self.action = action


@dataclass(frozen=True, slots=True)
class Stuck:
    """One rank of a deadlock: the action it cannot run and what it waits for."""

    rank: int
    step: int
    action: str
    waits_for: str

    def __str__(self) -> str:
        return f"rank {self.rank} step {self.step} ({self.action}) waits for {self.waits_for}"


class PPDeadlock(PPError):
    """No rank can make progress while some have actions left; ``stuck`` lists each of them."""

    def __init__(self, message: str, stuck: tuple[Stuck, ...]) -> None:
        first = stuck[0] if stuck else None
        super().__init__(
            message,
            rank=None if first is None else first.rank,
            step=None if first is None else first.step,
            action=None if first is None else first.action,
        )
        self.stuck = stuck
