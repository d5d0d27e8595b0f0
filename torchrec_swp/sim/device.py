"""Device streams: a FIFO replay of what the CPU threads submitted.

Model (simple on purpose):

* A ``Run`` with device time ``d > 0`` submits one piece of work to its task's stream when its
  CPU call returns; ``RecordEvent`` and ``WaitStream`` submit a marker when the CPU executes them.
* Each stream runs its submissions one at a time in submission order (CPU time, then the order
  the simulator executed the instructions, which respects happens-before).
* A record marker completes its event when the stream reaches it, i.e. after all the work
  submitted to that stream before it. A wait marker holds its stream until the event of the
  producer instance it names completes - if that event was recorded before the wait was
  submitted; otherwise it waits for nothing (as the engine, which finds no event to wait on).
* The CPU never waits for the device.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from torchrec_swp.sim.result import Interval, stream_lane


@dataclass(frozen=True, slots=True)
class Submission:
    """Something a CPU thread put on ``stream`` at time ``issue``; ``order`` breaks ties.

    ``work``: ``task`` on ``batch`` for ``duration``; ``record``: the event of ``(task, batch)``;
    ``wait``: wait for the event of ``(task, batch)``.
    """

    issue: float
    order: int
    kind: Literal["work", "record", "wait"]
    stream: str
    task: str
    batch: int
    iteration: int
    duration: float = 0.0


def replay_streams(submissions: Iterable[Submission]) -> list[Interval]:
    """The device intervals of every ``work`` submission, by the rules above."""
    free_at: dict[str, float] = {}
    events: dict[tuple[str, int], float] = {}
    out: list[Interval] = []
    for sub in sorted(submissions, key=lambda s: (s.issue, s.order)):
        ready = max(free_at.get(sub.stream, 0.0), sub.issue)
        match sub.kind:
            case "work":
                end = ready + sub.duration
                out.append(Interval(stream_lane(sub.stream), sub.task, sub.batch, sub.iteration, ready, end))
                free_at[sub.stream] = end
            case "record":
                events[(sub.task, sub.batch)] = ready
                free_at[sub.stream] = ready
            case "wait":
                free_at[sub.stream] = max(ready, events.get((sub.task, sub.batch), ready))
            case _:
                raise ValueError(f"unknown device submission kind {sub.kind!r}")
    return out
