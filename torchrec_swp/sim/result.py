"""What a simulation returns: the timeline, every executed instruction, per-iteration spans.

Lanes: ``cpu:<thread group>`` for each CPU thread, ``stream:<stream>`` for each device stream
that received work. A lane runs one thing at a time, so its intervals never overlap.

Steady state: an internal iteration is *steady* when every stage of the plan is active in it
(neither fill nor drain). ``steady_periods`` holds, per steady iteration ``P``,
``end(P) - end(P')`` where ``P'`` is the iteration before ``P`` in the run (the run starts at
time 0) and ``end`` is the time the last CPU or device work of an iteration ended;
``median_iteration_time`` is their median. ``steady_iteration_time`` is a slope over the steady
iterations: with the iteration barrier and no device model exactly the time between two
barriers; with a device model the throughput period, whichever of CPU and device is the
bottleneck.
"""

from __future__ import annotations

from dataclasses import dataclass

from torchrec_swp.compile import Instr, IterationProgram
from torchrec_swp.plan import PipelinePlan


def cpu_lane(thread: str) -> str:
    return f"cpu:{thread}"


def stream_lane(stream: str) -> str:
    return f"stream:{stream}"


@dataclass(frozen=True, slots=True)
class Interval:
    """``task`` working on ``batch`` (in internal iteration ``iteration``) on ``lane`` from
    ``start`` to ``end``."""

    lane: str
    task: str
    batch: int
    iteration: int
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(frozen=True, slots=True)
class Step:
    """One executed instruction.

    ``start``: when the thread began running the task (``Run``) or reached the instruction
    (a ``WaitTask`` starts waiting here); ``end``: when it was done. ``batch``: the batch of
    the task the instruction names (for ``WaitStream``, the producer's batch). ``seq``: the
    1-based position of the step on its thread over the whole run. ``clock``: a vector clock
    over ``SimResult.threads``: entry ``j`` is the ``seq`` of the last step of thread ``j``
    that happens before this step starts, through program order, the iteration barrier,
    signal -> wait and collective tickets (entry of its own thread: its own ``seq``).
    """

    iteration: int
    thread: str
    index: int
    instr: Instr
    batch: int
    start: float
    end: float
    seq: int
    clock: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class IterationSpan:
    """Internal iteration ``iteration``: its CPU work ran from ``start`` to ``cpu_end``, its
    last device work ended at ``end`` (``end == cpu_end`` without device work)."""

    iteration: int
    active_stages: tuple[int, ...]
    start: float
    cpu_end: float
    end: float


@dataclass(frozen=True, slots=True)
class SimResult:
    """The replay of a run. ``timeline`` is sorted by start time, then lane."""

    plan: PipelinePlan
    phases: tuple[tuple[int, IterationProgram], ...]
    threads: tuple[str, ...]
    timeline: tuple[Interval, ...]
    steps: tuple[Step, ...]
    iterations: tuple[IterationSpan, ...]
    iteration_barrier: bool
    device_modelled: bool

    @property
    def makespan(self) -> float:
        """Time from the start of the run to the end of its last CPU or device work."""
        return max((s.end for s in self.iterations), default=0.0)

    @property
    def steady_iterations(self) -> tuple[int, ...]:
        """Iterations in which every stage of the plan is active."""
        stages = tuple(sorted({s.stage for s in self.plan.schedule.values()}))
        return tuple(s.iteration for s in self.iterations if s.active_stages == stages)

    @property
    def steady_iteration_time(self) -> float | None:
        """Time per steady iteration; None when the run is too short to have a steady iteration
        (``num_batches <= plan.max_stage``).

        With two or more steady iterations: the largest of the slopes, from the first to the
        last steady iteration, of the CPU end (which the iteration barrier paces) and of each
        stream's end (its latest work of those iterations or earlier). With a device model,
        device work trails the CPU until the bottleneck stream's queue is full; single periods
        vary meanwhile and their median can fall below the bottleneck, these slopes do not: a
        stream's never falls below its load per iteration. Without a device model every steady
        iteration takes the same time. With one steady iteration: its own period.
        """
        steady = set(self.steady_iterations)
        spans = self.iterations
        at = [k for k, s in enumerate(spans) if s.iteration in steady]
        if not at:
            return None
        if len(at) == 1:
            k = at[0]
            return spans[k].end - (spans[k - 1].end if k else 0.0)
        first, last = at[0], at[-1]
        cpu = spans[last].cpu_end - spans[first].cpu_end
        # each stream's own slope: a stream runs the iterations' work in order, so its end moves
        # by at least its load per iteration (the slope of the latest end over all lanes can fall
        # below that while the lane holding the latest end changes)
        p_first, p_last = spans[first].iteration, spans[last].iteration
        ends: dict[str, list[float]] = {}
        for i in self.timeline:
            if not i.lane.startswith("cpu:") and i.iteration <= p_last:
                e = ends.setdefault(i.lane, [0.0, 0.0])
                e[1] = max(e[1], i.end)
                if i.iteration <= p_first:
                    e[0] = max(e[0], i.end)
        streams = max((e[1] - e[0] for e in ends.values()), default=0.0)
        return max(cpu, streams) / (last - first)

    @property
    def steady_periods(self) -> tuple[float, ...]:
        """Per steady iteration ``P``: ``end(P) - end(P')``, ``P'`` the iteration before it in the
        run (the start of the run for the first), as in the module docstring."""
        steady = set(self.steady_iterations)
        spans = self.iterations
        return tuple(
            s.end - (spans[k - 1].end if k else 0.0) for k, s in enumerate(spans) if s.iteration in steady
        )

    @property
    def median_iteration_time(self) -> float | None:
        """The median of ``steady_periods`` (None without a steady iteration): with per-batch
        durations drawn at random, the figure to compare with a measured median step time
        (``steady_iteration_time`` is a slope, i.e. a mean)."""
        periods = sorted(self.steady_periods)
        if not periods:
            return None
        n = len(periods)
        return periods[n // 2] if n % 2 else (periods[n // 2 - 1] + periods[n // 2]) / 2

    @property
    def lanes(self) -> tuple[str, ...]:
        """CPU lanes in thread order, then stream lanes in order of first work."""
        streams = dict.fromkeys(i.lane for i in self.timeline if not i.lane.startswith("cpu:"))
        return (*(cpu_lane(t) for t in self.threads), *streams)

    @property
    def busy(self) -> dict[str, float]:
        """Total time each lane spent working."""
        out = dict.fromkeys(self.lanes, 0.0)
        for i in self.timeline:
            out[i.lane] += i.duration
        return out

    @property
    def num_batches(self) -> int:
        """Batches the run worked on (one past the highest batch any task saw)."""
        return 1 + max((i.batch for i in self.timeline), default=-1)
