"""A cold thread computes slower: the warm-up of CPU work after a long stretch off the CPU.

On the machines this project is measured on (2-core virtual machines), a thread that slept for
a few milliseconds computes slower when it wakes, and recovers as it works: with one rank, the
default plan's training thread sleeps 10 ms in Fetch every step and its next task costs up to
three times what it costs back to back, its Forward (1 ms later) about 1.4 times, its Backward
(3 ms later) about 1.15 times, a task 5 ms later about as much as warm
(``benchmarks/sim_vs_real.py``: the default plan against two parallel loads, where the training
thread never sleeps). Whatever the cause underneath (a core leaving a deep idle state, caches
and predictors another tenant used), what a plan changes is how long its threads sit off the
CPU before they compute, so the model follows that:

* a thread is **cold** when the CPU part of a task starts at least ``after`` seconds after the
  thread's previous CPU part ended (sleeping, waiting for another thread, in a rendezvous, waking
  up: any time the thread had no CPU work); it then stands at *position* 0;
* from position ``p`` (seconds of warm work done since it woke cold), ``u`` seconds of warm work
  take ``cost(p, u) = u + extra * span * (exp(-p / span) - exp(-(p + u) / span))`` CPU seconds:
  the first work after the wake runs ``1 + extra`` times slower, the slowdown decays by ``e``
  every ``span`` seconds of work, and a whole burst pays at most ``extra * span`` seconds more;
* a thread that never waits that long stays warm (position infinite: work costs what it is);
* a **collective**'s off-CPU part (a task with a comm group: the waits for its transfers and the
  other ranks between its own CPU work) is no stretch off the CPU before it: whether the run is
  cold is asked where it starts. The simulator places that part first, but on gloo a task such
  as Forward or Backward computes and waits in turns, each wait short; counting the whole of it
  as one sleep would make every collective with 2 ms of waits cold, in every plan alike.
* a rank's **transport** (what moves its collectives' data: gloo's threads) follows the same rule
  with the collectives' off-CPU parts as its work: a collective whose waits start ``after`` or
  more after the rank's previous collective ended transfers cold, and its transfers warm up as
  the rank's collectives go on (the transport idles between collectives, not inside one). In a
  plan whose step sleeps (the default's, where the calling thread loads), gloo's threads spend
  more CPU per step for the same transfers and the collectives that stay on the training thread
  wait 20-70% longer inside than in plans that do not sleep (``notebook/2026-11-sim-vs-real.md``,
  "Two ranks: what the judge measures and what changes with the plan", measured on 2 ranks): with
  the rule, a plan that keeps the transport busy is predicted with the warm transfers it will have.

The calibration (``sim.calibrate(..., cold=)``) walks each thread's measured runs in time
order with the same rule and takes each run's measured CPU back to its warm work
(``Cold.work``, the inverse of ``cost``), and each rank's collectives' off-CPU parts back to
their warm transfers; the simulator (``Rank.cold``) charges a run the
``cost`` of its position in the plan it simulates. Replaying the profiled plan gives the
measured costs back; a plan whose threads wait less (parallel loads keeping the training thread
busy) is predicted with the warm costs it will have. The caller's overhead between steps and the
wake-up latency are neither charged nor counted as CPU work (the profile has no runs for them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torchrec_swp.sim.errors import check_non_negative


@dataclass(frozen=True)
class Cold:
    """The rule (module docstring): ``after`` seconds off the CPU make a thread cold; its
    first work then costs ``1 + extra`` times its warm cost, the extra decaying by ``e`` every
    ``span`` seconds of warm work."""

    after: float
    extra: float
    span: float

    def __post_init__(self) -> None:
        check_non_negative(self, ("after", "extra", "span"))
        if self.span == 0 and self.extra > 0:
            raise ValueError("Cold.span must be > 0 where extra is")

    def cost(self, position: float, work: float) -> float:
        """CPU seconds that ``work`` seconds of warm work take from ``position`` (seconds of
        warm work since the thread woke cold; ``math.inf``: warm)."""
        if work <= 0 or self.extra == 0 or math.isinf(position):
            return work
        s = self.span
        return work + self.extra * s * (math.exp(-position / s) - math.exp(-(position + work) / s))

    def work(self, position: float, cost: float) -> float:
        """The warm work that took ``cost`` CPU seconds from ``position``: the inverse of
        ``cost`` (which grows with ``work`` at a rate between 1 and ``1 + extra``)."""
        if cost <= 0 or self.extra == 0 or math.isinf(position):
            return max(0.0, cost)
        lo, hi = cost / (1 + self.extra), cost
        for _ in range(60):  # bisection: cost() is increasing in work
            mid = (lo + hi) / 2
            if self.cost(position, mid) < cost:
                lo = mid
            else:
                hi = mid
            if hi - lo <= 1e-12 * max(1.0, cost):
                break
        return (lo + hi) / 2


class Warmth:
    """One thread's standing under a ``Cold`` rule: when its last CPU part ended and its position
    (warm work since it last woke cold; infinite until it first does). The simulator ``charge``s
    each CPU part, the calibration takes each measured one back to its ``work``; both then say
    when it ``ended``."""

    __slots__ = ("cpu_end", "position")

    def __init__(self) -> None:
        self.cpu_end: float | None = None
        self.position = math.inf

    def _start(self, cold: Cold, now: float) -> float:
        if self.cpu_end is not None and now - self.cpu_end >= cold.after:
            self.position = 0.0
        return self.position

    def charge(self, cold: Cold, now: float, work: float) -> float:
        """A CPU part of ``work`` seconds of warm work starts at ``now``: what it costs."""
        position = self._start(cold, now)
        self.position = position + work
        return cold.cost(position, work)

    def work(self, cold: Cold, now: float, cost: float) -> float:
        """A CPU part that cost ``cost`` started at ``now``: the warm work it did."""
        position = self._start(cold, now)
        work = cold.work(position, cost)
        self.position = position + work
        return work

    def ended(self, now: float) -> None:
        """The CPU part ended at ``now``."""
        self.cpu_end = now
