"""How long a blocked thread takes to resume once what it waited for happened: the engine
model's wake-up latency (``torchrec_swp.sim.engine_model``), by what the other threads of its
process do at that moment.

A woken Python thread runs again once it holds its process's GIL. Measured on the 2-core
machines this project runs on (two ``benchmarks/sim_vs_real.py`` recordings, 1 rank, the io
plans: from the end of the task a thread waited for to the start of its next task):

* **busy**: another thread of the process computes. The woken thread waits until that one
  lets go of the GIL: 0.07 ms beside TrainPipelinePEC's embedding lookup, about 0.5 ms beside
  TrainPipelineSparseDist's first tasks of a step, 1.4-3.3 ms beside
  PrefetchTrainPipelineSparseDist's forward, the whole forward (2.9 ms) beside
  TrainPipelineBase's. What a task does between its kernels decides it, and a profile of the
  default plan (one thread) cannot tell; 0.5 ms is the middle.
* **walk_end**: no other thread computes, but one has just finished its part of an internal
  iteration (``engine_model.Done``): the engine's bookkeeping at a walk's end runs before the
  woken thread gets the GIL, 0.16-0.29 ms.
* **idle**: no other thread computes: the GIL is free, 0.04-0.06 ms (TrainPipelinePEC's hand-offs
  between its training thread and its io thread, each waiting for the other).

A thread *computes* when it is in the CPU part of a run, or in an off-CPU part no longer than
the CPU part to follow (in a real task the two interleave: a collective's short waits between
its own work). A run that mostly waits (a load, with its 10 ms off the CPU) does not hold the
GIL meanwhile.

``Wake.of(x)`` with a number: one latency ``x`` whatever the other threads do (the rule before
this one, and what ``--wake-us`` gives).
"""

from __future__ import annotations

from dataclasses import dataclass

from torchrec_swp.sim.errors import check_non_negative


@dataclass(frozen=True)
class Wake:
    """The wake-up latencies (seconds, off the CPU) by what the process's other threads do (module
    docstring)."""

    busy: float
    idle: float
    walk_end: float

    def __post_init__(self) -> None:
        check_non_negative(self, ("busy", "idle", "walk_end"))

    @classmethod
    def of(cls, value: float | Wake) -> Wake:
        """``value`` as a rule: a Wake as it is, a number as the same latency in every case."""
        if isinstance(value, Wake):
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"a wake-up latency must be a number of seconds or a sim.Wake, got {value!r}")
        return cls(busy=value, idle=value, walk_end=value)

    @property
    def uniform(self) -> bool:
        """The same latency whatever the other threads do."""
        return self.busy == self.idle == self.walk_end

    @property
    def longest(self) -> float:
        return max(self.busy, self.idle, self.walk_end)

    def latency(self, *, busy: bool, walk_ended: bool) -> float:
        """The latency of a thread woken while another thread of its process computes (``busy``),
        or none does but one just ended its walk (``walk_ended``), or neither."""
        if busy:
            return self.busy
        return self.walk_end if walk_ended else self.idle
