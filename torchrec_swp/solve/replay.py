"""The mechanics the replays of a schedule share, whatever they replay (the engine's compiled
programs in ``torchrec_swp.sim``, pipeline-parallel action programs in ``torchrec_swp.pp``, a
DAG schedule here):

* ``sweep``: the max-plus replay of lanes that each run their own steps in order, every step as
  soon as what it waits for has run; what is left when a round takes no step is a deadlock.
* ``peak_held``: the largest amount held at once, from hold and free events.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

L = TypeVar("L")


def sweep(lanes: Sequence[L], step: Callable[[L], bool]) -> None:
    """Visit ``lanes`` in order, each taking steps while ``step(lane)`` takes one (returns True;
    False when the lane has none left or its next one must wait), and go round again until a
    whole round takes none. A lane with steps left then waits for something no lane will do:
    the caller reports the deadlock."""
    progressed = True
    while progressed:
        progressed = False
        for lane in lanes:
            while step(lane):
                progressed = True


def peak_held(events: Iterable[tuple[float, int]]) -> int:
    """The largest running sum of ``(time, amount)`` events, a hold adding and a free subtracting
    its amount (0 without events). At equal times frees come first: a free and a hold at the same
    instant never count together."""
    held = peak = 0
    for _, amount in sorted(events):
        held += amount
        peak = max(peak, held)
    return peak
