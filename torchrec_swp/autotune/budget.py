"""What tuning may cost a job (``Autotune.budget_steps``, ``budget_s``) and what it has cost
(``Ledger``): the time its searches and trials lost against the plans they started from.

Each round (a round 1, a second round, a re-tune) starts from a running plan whose step its
profile measured (``open``); from there until the round's decision (``close``) every step is
charged its period less that step, and the tuner's own time inside a call (a collective, a
switch, a search on the training thread) is charged whole. A candidate faster than the running
plan earns back what a slower one lost: the ledger is the net time the job lost to tuning, and
where it reaches the budget the tuner stops (``tuner.Tuner``: the running plan stays, nothing is
searched or tried again). Steps of a decided plan (settling into it, profiling it for the next
round, verifying it, watching it) are not charged: they run what the tuning chose.

The budget is counted in the starting plan's steps (``budget_steps``, the first profile's
measured step) or in seconds (``budget_s``), whichever is smaller where both are given.
Rank 0's ledger decides for every rank (the tuner says it at its agreement points: a trial's
judgement after each cycle, a background search's polls, a search's result, whose plans are then
not tried), so rank 0 may overshoot the budget by what a cycle or ``POLL_EVERY`` calls lose; a
search on the training thread is charged whole after it, at the next of these points.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Ledger:
    """One tuner's account (module docstring)."""

    budget_steps: int | None
    budget_s: float | None
    lost_s: float = 0.0  # net: a faster candidate's steps earn time back
    charged: int = 0  # the steps charged
    unit_s: float | None = None  # the starting plan's measured step (round 1's profile)
    reference_s: float | None = None  # the running plan's measured step, while a round is open
    opened: int = 0  # the rounds opened (a call that opened and closed one still charges its own time)

    @property
    def limit_s(self) -> float | None:
        """The budget in seconds (None: no budget, or none known before the first profile)."""
        limits = [self.budget_s] if self.budget_s is not None else []
        if self.budget_steps is not None and self.unit_s is not None:
            limits.append(self.budget_steps * self.unit_s)
        return min(limits) if limits else None

    @property
    def is_open(self) -> bool:
        return self.reference_s is not None

    def open(self, measured_s: float | None) -> None:
        """A round begins from a running plan whose profile measured ``measured_s`` a step (None:
        nothing measured, nothing charged until the next round)."""
        if measured_s is None or not measured_s > 0:
            self.reference_s = None
            return
        if self.unit_s is None:
            self.unit_s = measured_s
        self.reference_s = measured_s
        self.opened += 1

    def close(self) -> None:
        """The round decided: the steps that follow run its plan."""
        self.reference_s = None

    def charge_step(self, period_s: float) -> None:
        """A step of an open round took ``period_s``."""
        if self.reference_s is not None:
            self.lost_s += period_s - self.reference_s
            self.charged += 1

    def charge_own(self, seconds: float) -> None:
        """The tuner's own time inside a call of a round (open at the call's start or end, or
        opened in it: ``opened`` counts)."""
        self.lost_s += seconds

    def spent(self) -> bool:
        limit = self.limit_s
        return limit is not None and self.lost_s >= limit

    def line(self) -> str:
        """Why the tuning stopped, in words (after ``spent``)."""
        limit = self.limit_s
        assert limit is not None
        given = []
        if self.budget_steps is not None and self.unit_s is not None:
            given.append(
                f"{self.budget_steps} step{'s' if self.budget_steps != 1 else ''} of the starting plan's "
                f"{1e3 * self.unit_s:.2f} ms (Autotune.budget_steps)"
            )
        if self.budget_s is not None:
            given.append(f"{self.budget_s:g} s (Autotune.budget_s)")
        return (
            f"the tuning's budget is spent: its {self.charged} steps of searching and trying lost "
            f"{self.lost_s:.2f} s against the plans they started from, the budget {limit:.2f} s "
            f"({' or '.join(given)})"
        )
