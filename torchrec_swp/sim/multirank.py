"""Several ranks at once: collectives as rendezvous across ranks, threads sharing CPU cores.

``simulate_ranks(ranks, num_batches, cores=...)`` replays one compiled program per rank (each
with its own task durations) in one timeline. ``model`` says how a rank's threads walk their
iterations:

* ``"engine"`` (default): as ``torchrec_swp.engine`` walks them - no barrier, the caller's
  ``step()`` calls, run-ahead within the source's credit (``lookahead``), parallel loads taking
  turns, wake-up latencies (``torchrec_swp.sim.engine_model``); the step time is the time
  between two returns of ``step()`` (``RanksResult.step_period``);
* ``"barrier"``: every thread finishes internal iteration ``P`` before any starts ``P + 1``
  (the engine before it ran ahead; still its steady state with lookahead 0 and one load);
* ``"free"``: no barrier and no gate: each thread goes on as soon as its own program lets it.

Within a rank everything else is as in ``simulate`` (threads, waits and signals, collective
tickets, device streams). What it adds:

* **A task instance has parts.** First its *off-CPU* time (``Rank.off_cpu``; wall time that
  needs no core: a loader sleeping on storage), then its *CPU work* (``Rank.durations``: seconds
  of a core), then, for a collective, the rendezvous below.
* **Collectives are rendezvous.** Every admitted run of a task with a comm group is a
  collective. The ``k``-th collective of comm group ``g`` on a rank meets the ``k``-th of ``g``
  on every other rank (every rank issues a group's collectives in the same order: the engine's
  tickets, or one thread's program order); they must be the same task (else ``SimError``: the
  ranks would desync). A rank that has done its own parts waits, needing no core, until every
  rank has: the collective ends on every rank at ``max over ranks of (its start + its parts)``.
* **Cores are shared.** The ranks of one machine (``Rank.machine``) share ``cores`` cores: at any
  moment the threads in a CPU part, plus ``background`` always-runnable threads of other
  programs, share them by processor sharing, each process's threads also sharing its GIL
  (``Rank.gil``; ``torchrec_swp.sim.cores``). Threads that wait (for a task, a ticket, the
  barrier, a rendezvous) or are off-CPU need no core. ``cores=None``: as many as needed.
* **Per-iteration overhead.** ``Rank.overhead`` seconds of CPU work (after ``Rank.overhead_off``
  seconds off the CPU: the caller waiting, e.g. in its own collectives) on the calling thread
  before each internal iteration (with the engine model: before each ``step()`` call; the
  engine's and ``progress()``'s own work, the caller's code between steps); with the iteration
  barrier the other threads start the iteration after it.

With one rank, no off-CPU time, no overhead and enough cores this is ``simulate`` exactly
(tested). Each rank's replay comes back as a ``SimResult`` (``RanksResult.ranks``), so its
timeline, steady iteration time, renderings and ``check_happens_before`` work as for one rank.

The replay is event-driven: time advances from one completion (of an off-CPU part, a CPU part,
a rendezvous) to the next; at each, every instruction that can execute does. If nothing is
running and nothing can execute while instructions remain, ``SimDeadlock`` names every stuck
thread of every rank, including ranks waiting in a rendezvous that another rank never joins.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from torchrec_swp.compile import CompiledPlan, Instr, IterationProgram, Run
from torchrec_swp.plan import MAIN_THREAD, PipelinePlan
from torchrec_swp.sim.cold import Cold, Warmth
from torchrec_swp.sim.cores import fair_rates
from torchrec_swp.sim.durations import Durations, cpu_time, optional_time
from torchrec_swp.sim.engine_model import MOVES, Await, Call, Done, EngineModel, Gate, Move
from torchrec_swp.sim.errors import Blocked, SimDeadlock, SimError
from torchrec_swp.sim.render import format_timeline, to_chrome_trace
from torchrec_swp.sim.result import SimResult, Step
from torchrec_swp.sim.simulator import Replay, ReplayLane, check_num_batches, validate_programs
from torchrec_swp.sim.wake import Wake

Phases = Sequence[tuple[int, IterationProgram]]
Model = Literal["engine", "barrier", "free"]
MODELS = ("engine", "barrier", "free")

# Two event times closer than this (relative to the clock) are the same instant.
_EPS = 1e-12


@dataclass(frozen=True)
class Rank:
    """One rank: its plan (compiled with device syncs iff ``device_durations`` is given) or
    compiled plan, and its costs (module docstring). ``machine`` groups the ranks sharing cores.
    For the engine model: ``wake``, the latency of a thread woken by another (off the CPU): a
    number, or a ``sim.Wake`` with one by what the rank's other threads do then;
    ``split_draws``, whether the data splits a draw in claim and fetch (parallel loads overlap
    their fetches); ``gil``, the share of CPU work that holds the process's GIL (None: not
    modelled). ``cold``: a thread's CPU work after a long stretch off the CPU costs more, and
    so do the rank's collectives' transfers after its transport sat idle
    (``torchrec_swp.sim.cold``; None: not modelled)."""

    plan: PipelinePlan | CompiledPlan
    durations: Durations
    off_cpu: Durations | None = None
    overhead: float = 0.0
    overhead_off: float = 0.0
    machine: int = 0
    device_durations: Durations | None = None
    wake: float | Wake = 0.0
    split_draws: bool = False
    gil: float | None = None
    cold: Cold | None = None

    def compiled(self) -> CompiledPlan:
        match self.plan:
            case CompiledPlan():
                return self.plan
            case PipelinePlan():
                return CompiledPlan(self.plan, device_streams=self.device_durations is not None)
            case _:
                raise TypeError(f"Rank.plan must be a PipelinePlan or a CompiledPlan, got {type(self.plan).__name__}")


@dataclass(frozen=True)
class RanksResult:
    """The replay of every rank. ``ranks[r]`` is rank ``r``'s SimResult; ``rendezvous_wait[r]``
    the total time each task of rank ``r`` waited for the other ranks in its collectives;
    ``contention[r]`` the total time CPU parts of rank ``r`` took beyond their work (waiting
    for a core); ``returns[r]``: with the engine model, when each ``step()`` of rank ``r``
    returned (empty otherwise)."""

    ranks: tuple[SimResult, ...]
    machines: tuple[int, ...]
    cores: Mapping[int, int | None]
    rendezvous_wait: tuple[Mapping[str, float], ...]
    contention: tuple[float, ...]
    returns: tuple[tuple[float, ...], ...] = ()

    def steady_returns(self, rank: int = 0) -> tuple[float, ...]:
        """The return times of rank ``rank``'s steady steps: past the fill and the run-ahead's
        ramp, before the drain and the run-ahead's end (the first and the last ``depth +
        lookahead + loads`` steps are left out, keeping at least two)."""
        times = self.returns[rank] if self.returns else ()
        plan = self.ranks[rank].plan
        head = tail = plan.pipeline_depth + plan.lookahead + plan.loads
        if len(times) - head - tail >= 2:
            return times[head : len(times) - tail]
        return times[-2:] if len(times) >= 2 else ()

    @property
    def step_period(self) -> float | None:
        """The engine model's mean step time (the slowest rank's, over its steady steps: the
        throughput); None for the other models or too short a run."""
        slopes = []
        for r in range(len(self.returns)):
            t = self.steady_returns(r)
            if len(t) < 2:
                return None
            slopes.append((t[-1] - t[0]) / (len(t) - 1))
        return max(slopes) if slopes else None

    @property
    def median_step(self) -> float | None:
        """The engine model's median step time over the steady steps (the slowest rank's)."""
        medians = []
        for r in range(len(self.returns)):
            t = self.steady_returns(r)
            if len(t) < 2:
                return None
            gaps = sorted(b - a for a, b in zip(t, t[1:]))
            n = len(gaps)
            medians.append(gaps[n // 2] if n % 2 else (gaps[n // 2 - 1] + gaps[n // 2]) / 2)
        return max(medians) if medians else None

    @property
    def makespan(self) -> float:
        return max((r.makespan for r in self.ranks), default=0.0)

    @property
    def steady_iteration_time(self) -> float | None:
        """The slowest rank's ``steady_iteration_time`` (None if a rank has none)."""
        times = [r.steady_iteration_time for r in self.ranks]
        return None if not times or any(t is None for t in times) else max(t for t in times if t is not None)

    @property
    def median_iteration_time(self) -> float | None:
        """The slowest rank's ``median_iteration_time`` (None if a rank has none)."""
        times = [r.median_iteration_time for r in self.ranks]
        return None if not times or any(t is None for t in times) else max(t for t in times if t is not None)

    def format_timeline(self, width: int = 100) -> str:
        """Each rank's text Gantt chart, under a ``rank r`` heading."""
        return "\n".join(f"rank {k}:\n{format_timeline(r, width)}" for k, r in enumerate(self.ranks))

    def to_chrome_trace(self, us_per_unit: float = 1.0) -> dict[str, Any]:
        """One Chrome/Perfetto trace, a process per rank."""
        events: list[dict[str, Any]] = []
        for k, r in enumerate(self.ranks):
            for e in to_chrome_trace(r, us_per_unit)["traceEvents"]:
                e = {**e, "pid": k}
                if e.get("name") == "process_name":
                    e["args"] = {"name": f"rank {k}: sim {r.plan.name}"}
                events.append(e)
        return {"traceEvents": events, "displayTimeUnit": "ms"}


def simulate_ranks(
    ranks: Sequence[Rank],
    num_batches: int,
    *,
    cores: int | Mapping[int, int] | None = None,
    background: float | Mapping[int, float] = 0.0,
    model: Model = "engine",
) -> RanksResult:
    """Replay every rank over ``num_batches`` batches (fill, steady state, drain); see the module
    docstring. ``cores`` and ``background`` are per machine (a number applies to every machine).

    Raises SimDeadlock (stuck threads or an unmatched rendezvous), SimError (bad durations,
    ranks whose collectives differ, malformed programs).
    """
    check_num_batches(num_batches)
    return simulate_rank_programs(
        [(r, r.compiled().iterations(num_batches)) for r in ranks],
        cores=cores,
        background=background,
        model=model,
    )


def simulate_rank_programs(
    ranks: Sequence[tuple[Rank, Phases]],
    *,
    cores: int | Mapping[int, int] | None = None,
    background: float | Mapping[int, float] = 0.0,
    model: Model = "engine",
) -> RanksResult:
    """``simulate_ranks`` for ``(rank, phases)`` pairs: hand-written or compiled programs."""
    if not ranks:
        raise SimError("simulate_ranks needs at least one rank")
    if model not in MODELS:
        raise SimError(f"model must be one of {', '.join(MODELS)}, got {model!r}")
    machines = sorted({r.machine for r, _ in ranks})
    core_table = {m: _per_machine(cores, m, "cores") for m in machines}
    load_table = {m: _per_machine(background, m, "background") for m in machines}
    for m, k in core_table.items():
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise SimError(f"cores of machine {m} must be an int >= 1 or None, got {k!r}")
    for m, b in load_table.items():
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b) or b < 0:
            raise SimError(f"background of machine {m} must be a finite number >= 0, got {b!r}")
    states: list[_RankState] = []
    for k, (rank, phases) in enumerate(ranks):
        if not isinstance(rank, Rank):
            raise TypeError(f"rank {k} must be a Rank, got {type(rank).__name__}")
        plan = rank.compiled().plan
        phases = tuple(phases)
        validate_programs(plan, phases)
        try:
            Wake.of(rank.wake)
        except ValueError as e:
            raise SimError(f"wake of rank {k} must be a finite number >= 0 or a sim.Wake: {e}") from None
        for name in ("overhead", "overhead_off"):
            o = getattr(rank, name)
            if isinstance(o, bool) or not isinstance(o, (int, float)) or not math.isfinite(o) or o < 0:
                raise SimError(f"{name} of rank {k} must be a finite number >= 0, got {o!r}")
        g = rank.gil
        if g is not None and (isinstance(g, bool) or not isinstance(g, (int, float)) or not 0 < g <= 1):
            raise SimError(f"gil of rank {k} must be None or a number in (0, 1], got {g!r}")
        if rank.cold is not None and not isinstance(rank.cold, Cold):
            raise SimError(f"cold of rank {k} must be None or a sim.Cold, got {rank.cold!r}")
        if model == "engine":
            states.append(_EngineRankState(k, rank, plan, phases))
        else:
            states.append(_RankState(k, rank, plan, phases, model == "barrier"))
    replay = _Multi(states, core_table, load_table)
    replay.run()
    return RanksResult(
        ranks=tuple(s.result(model == "barrier") for s in states),
        machines=tuple(s.spec.machine for s in states),
        cores=core_table,
        rendezvous_wait=tuple(dict(s.rendezvous_wait) for s in states),
        contention=tuple(s.contention for s in states),
        returns=tuple(s.returns() for s in states) if model == "engine" else (),
    )


def _per_machine(value: Any, machine: int, name: str) -> Any:
    if isinstance(value, Mapping):
        if machine not in value:
            raise SimError(f"{name} names machines {sorted(value)}, not machine {machine}")
        return value[machine]
    return value


def _computes(job: _Job) -> bool:
    """Whether ``job``'s thread computes now, holding its process's GIL (``sim.wake``): in its
    CPU part, or in an off-CPU part no longer than the CPU part to follow (a run's waits and work
    interleave); a wake-up or a run that mostly waits (a load) does not."""
    return job.phase == "cpu" or (job.phase == "off" and 0 < job.left <= job.cpu)


# ---------------------------------------------------------------------- state
@dataclass(slots=True)
class _Lane(ReplayLane[Instr | Move | None]):
    """A thread of a rank (see ``simulator.ReplayLane``) and the job it is running, if any. Its
    ``todo`` entries may hold ``None``: the per-iteration overhead (and, with the engine model,
    the engine's moves). ``stalled``: its next instruction had to wait for another lane (it
    resumes after the rank's wake-up latency). ``warmth``: where it stands under the rank's
    ``cold`` rule."""

    job: _Job | None = None
    stalled: bool = False
    warmth: Warmth = field(default_factory=Warmth)
    walk_ended: float = -math.inf  # when it last finished its part of an internal iteration


@dataclass(slots=True, eq=False)
class _Job:
    """A run (or the overhead, ``instr is None``) in progress on a lane.

    ``phase``: ``off`` (elapsing ``left`` seconds of wall time), ``cpu`` (``left`` seconds of
    work at ``rate`` since ``anchor``), ``meet`` (waiting in a rendezvous since ``anchor``).
    """

    rank: _RankState
    thread: str
    p: int
    index: int
    instr: Run | None
    batch: int
    start: float
    cpu: float
    phase: Literal["off", "cpu", "meet"]
    left: float
    anchor: float
    rate: float = 1.0
    cpu_start: float = 0.0
    meet: tuple[str, int] | None = None
    sources: list[Step] = field(default_factory=list)

    def finish_time(self) -> float:
        if self.phase == "off":
            return self.anchor + self.left
        if self.phase == "cpu":
            return self.anchor + (self.left if self.rate == 1.0 else self.left / self.rate)
        return math.inf


class _RankState(Replay[_Lane]):
    """One rank's replay state: the replay's signals and tickets (``simulator.Replay``, whose
    bookkeeping it reuses) over its own lanes, plus its collectives, jobs and what it waited for."""

    def __init__(
        self,
        number: int,
        spec: Rank,
        plan: PipelinePlan,
        phases: tuple[tuple[int, IterationProgram], ...],
        barrier: bool,
    ) -> None:
        super().__init__(plan, phases, spec.durations, spec.device_durations, _Lane)
        self.number = number
        self.spec = spec
        self.wake = Wake.of(0.0)  # the barrier model does not wake threads up late
        self.barrier_mode = barrier
        self.comm = {t: s.comm_group for t, s in plan.schedule.items()}
        self.collectives: dict[str, int] = {}  # comm group -> collectives started
        self.rendezvous_wait: dict[str, float] = {}
        self.contention = 0.0
        self.transport = Warmth()  # the rank's collectives' transfers under its ``cold`` rule
        self.segment = 0  # next segment to load
        self.in_preamble = False  # the calling thread is running the overhead before that segment
        self.done = False
        self.dirty = True  # something changed since the dispatch last looked at its lanes

    def load_next_segment(self, now: float) -> None:
        """Hand the lanes their instructions of the next iteration (with the barrier) or of the
        whole run; join the lanes first (time and vector clocks), as the barrier does. With the
        barrier and an overhead, the calling thread first runs the overhead alone (a segment of
        its own: the other threads start the iteration after it)."""
        if self.segment >= (len(self.phases) if self.barrier_mode else 1):
            self.done = True
            return
        overhead = self.spec.overhead > 0 or self.spec.overhead_off > 0
        if self.barrier_mode:
            self.barrier()
        for lane in self.lanes.values():
            lane.todo, lane.at = [], 0
        if self.barrier_mode and overhead and not self.in_preamble:
            self.in_preamble = True
            self.lanes[MAIN_THREAD].todo.append((self.phases[self.segment][0], -1, None))
            return
        self.in_preamble = False
        segment = (self.phases[self.segment],) if self.barrier_mode else self.phases
        self.segment += 1
        for p, prog in segment:
            if overhead and not self.barrier_mode:
                self.lanes[MAIN_THREAD].todo.append((p, -1, None))
            for thread, instrs in prog.threads:
                self.lanes[thread].todo.extend((p, index, instr) for index, instr in enumerate(instrs))

    def segment_done(self) -> bool:
        for lane in self.lanes.values():  # a loop, not all(): the dispatch asks at every pass
            if lane.job is not None or lane.at < len(lane.todo):
                return False
        return True

    # what the engine model adds (nothing here)
    def execute_at(
        self, thread: str, lane: _Lane, p: int, index: int, instr: Instr | Move, where: str, now: float
    ) -> None:
        """Execute an instruction that is not a run at ``now``."""
        assert not isinstance(instr, MOVES)  # only the engine model's lanes hold its moves
        self.execute_sync(thread, lane, p, index, instr, where)

    def lane_blocker(self, thread: str, p: int, instr: Instr | Move | None) -> str | None:
        """Why ``thread``'s next instruction (of iteration ``p``) cannot execute now, or None."""
        return self.blocker(p, instr)

    def started(self, run: Run, p: int) -> None:
        """A run of iteration ``p`` started."""

    def finished(self, run: Run, p: int) -> None:
        """A run of iteration ``p`` ended."""

    def returns(self) -> tuple[float, ...]:
        return ()


class _EngineRankState(_RankState):
    """One rank replayed as the engine walks it (``torchrec_swp.sim.engine_model``): a lane per
    walker, the caller's calls and the walkers' gates among their instructions."""

    def __init__(
        self, number: int, spec: Rank, plan: PipelinePlan, phases: tuple[tuple[int, IterationProgram], ...]
    ) -> None:
        super().__init__(number, spec, plan, phases, barrier=False)
        self.wake = Wake.of(spec.wake)
        self.walkers = EngineModel(plan, phases, spec.split_draws)
        self.threads = self.walkers.names
        self.lanes = {t: _Lane(k, 0.0, [0] * len(self.threads)) for k, t in enumerate(self.threads)}
        self.call_clock: dict[int, list[int]] = {}  # batch d -> the caller's clock when step() asked for it
        self.done_clock: dict[str, list[int]] = {}  # walker -> its clock when it last finished an iteration

    def load_next_segment(self, now: float) -> None:
        if self.segment >= 1:
            self.done = True
            return
        self.segment = 1
        overhead = self.spec.overhead > 0 or self.spec.overhead_off > 0
        for name, todo in self.walkers.todo(self.num_batches, overhead).items():
            lane = self.lanes[name]
            lane.todo, lane.at = todo, 0

    def lane_blocker(self, thread: str, p: int, instr: Instr | Move | None) -> str | None:
        why = self.walkers.blocker(thread, p, instr, self.num_batches)
        if why is not None or isinstance(instr, MOVES):
            return why
        return self.blocker(p, instr)

    def blocked(self, thread: str, lane: ReplayLane[Any], rank: int | None = None) -> Blocked:
        p, index, instr = lane.todo[lane.at]
        return Blocked(thread, p, index, str(instr), self.lane_blocker(thread, p, instr) or "", rank)

    def execute_at(
        self, thread: str, lane: _Lane, p: int, index: int, instr: Instr | Move, where: str, now: float
    ) -> None:
        lane.time = max(lane.time, now)
        if not isinstance(instr, MOVES):
            self.execute_sync(thread, lane, p, index, instr, where)
            return
        self._merge(thread, lane, instr)
        self.walkers.moved(thread, instr, lane.time)
        if isinstance(instr, Call):
            self.call_clock[instr.d] = list(lane.clock)
        elif isinstance(instr, Done):
            self.done_clock[thread] = list(lane.clock)
            lane.walk_ended = now

    def _merge(self, thread: str, lane: _Lane, move: Move) -> None:
        """A move that waited for another lane is ordered after what it waited for (vector clocks:
        a gate after the call that opened it, the caller's wait after every walker's last iteration)."""
        sources: list[list[int]] = []
        match move:
            case Gate(P=P):
                d = P - self.walkers.top - self.walkers.walkers[thread].ahead
                sources = [c for c in [self.call_clock.get(max(d, 0))] if c is not None]
            case Await():
                sources = list(self.done_clock.values())
        for c in sources:
            lane.clock = [max(a, b) for a, b in zip(lane.clock, c, strict=True)]

    def started(self, run: Run, p: int) -> None:
        self.walkers.started(run, p)

    def finished(self, run: Run, p: int) -> None:
        self.walkers.finished(run, p)

    def returns(self) -> tuple[float, ...]:
        return tuple(self.walkers.returns)


# --------------------------------------------------------------------- replay
class _Multi:
    """The event loop over every rank (module docstring)."""

    def __init__(
        self, states: list[_RankState], cores: Mapping[int, int | None], background: Mapping[int, float]
    ) -> None:
        self.states = states
        self.cores = cores
        self.background = background
        self.now = 0.0
        self.jobs: list[_Job] = []
        # (comm group, k) -> the jobs of the ranks that reached the rendezvous, by rank
        self.meets: dict[tuple[str, int], dict[int, _Job]] = {}
        self.meet_task: dict[tuple[str, int], tuple[str, int]] = {}  # -> (task, first rank to start it)
        # fair_rates by machine and runnable threads per rank (_set_rates)
        self.rates: dict[tuple[int, tuple[tuple[int, int], ...]], dict[int, float]] = {}

    def run(self) -> None:
        for s in self.states:
            s.load_next_segment(0.0)
        while True:
            self._dispatch()
            if all(s.done for s in self.states):
                return
            timed = [j for j in self.jobs if j.phase != "meet"]
            if not timed:
                raise self._deadlock()
            self._set_rates()
            ends = [(j.finish_time(), j) for j in timed]
            now = min(end for end, _ in ends)
            self.now = now
            tolerance = _EPS * max(1.0, abs(now))
            for job in [j for end, j in ends if end <= now + tolerance]:
                self._end_phase(job)

    # ------------------------------------------------------------ dispatch
    def _dispatch(self) -> None:
        """Execute everything that can execute at ``now``, until nothing more can."""
        changed = True
        while changed:
            changed = False
            woken: list[tuple[_RankState, str, _Lane, int, int]] = []
            for s in self.states:
                if not s.dirty:  # its lanes stand as the last pass left them: none can go now
                    continue
                s.dirty = False
                while not s.done and s.segment_done():
                    s.load_next_segment(self.now)
                    changed = True
                if s.done:
                    continue
                for thread, lane in s.lanes.items():
                    while lane.job is None and lane.at < len(lane.todo):
                        p, index, instr = lane.todo[lane.at]
                        if s.lane_blocker(thread, p, instr) is not None:
                            lane.stalled = True
                            break
                        if lane.stalled and s.wake.longest > 0:  # woken by another thread: off the CPU a while
                            woken.append((s, thread, lane, p, index))
                            s.dirty = True  # looked at again in every pass until it wakes
                            break
                        lane.stalled = False
                        lane.at += 1
                        self._execute(s, thread, lane, p, index, instr)
                        s.dirty = changed = True
            for key in [k for k, met in self.meets.items() if len(met) == len(self.states)]:
                for job in self.meets.pop(key).values():
                    self._finish(job)
                changed = True
            if not changed:
                changed = self._wake(woken)

    def _wake(self, woken: list[tuple[_RankState, str, _Lane, int, int]]) -> bool:
        """The threads woken at ``now``, once every other thread did what it can at ``now``: each
        is off the CPU for its rank's wake-up latency (``sim.wake``: by whether another thread of
        the rank computes, or just ended its walk). True if one resumes at once (latency 0)."""
        again = False
        for s, thread, lane, p, index in woken:
            lane.stalled = False  # (its rank is marked: the pass that found it woken marked it)
            others = [o for t, o in s.lanes.items() if t != thread]
            busy = any(o.job is not None and _computes(o.job) for o in others)
            ended = any(o.walk_ended == self.now for o in others)
            latency = s.wake.latency(busy=busy, walk_ended=ended)
            if latency > 0:
                self._start(_Job(s, thread, p, index, None, p, self.now, 0.0, "off", latency, self.now))
            else:
                again = True
        return again

    def _execute(self, s: _RankState, thread: str, lane: _Lane, p: int, index: int, instr: Instr | Move | None) -> None:
        where = f"rank {s.number}, thread {thread!r}, internal iteration {p}"
        now = self.now
        match instr:
            case None:
                self._start(_Job(s, thread, p, index, None, p, now, s.spec.overhead, "off", s.spec.overhead_off, now))
            case Run(task=task, stage=stage):
                s.started(instr, p)
                sources = s.ticket_sources(instr)
                b = p - stage
                admitted = s.admits(instr, p)
                cpu = cpu_time(s.spec.durations, task, b, where) if admitted else 0.0
                off = optional_time(s.spec.off_cpu, task, b, where, "off-CPU") if admitted else 0.0
                group = s.comm[task]
                if admitted and group is not None and s.spec.cold is not None:
                    off = s.transport.charge(s.spec.cold, now, off)  # a cold transport transfers slower
                job = _Job(s, thread, p, index, instr, b, now, cpu, "off", off, now, sources=sources)
                if admitted and group is not None:
                    k = s.collectives.get(group, 0)
                    s.collectives[group] = k + 1
                    job.meet = (group, k)
                    first = self.meet_task.setdefault(job.meet, (task, s.number))
                    if first[0] != task:
                        raise SimError(
                            f"collective {k} of comm group {group!r} is {first[0]} on rank {first[1]} but {task} "
                            f"(batch {b}) on rank {s.number} ({where}): the ranks would desync"
                        )
                self._start(job)
            case _:
                s.execute_at(thread, lane, p, index, instr, where, now)

    # ---------------------------------------------------------------- jobs
    def _start(self, job: _Job) -> None:
        """Put ``job`` on its lane and run through every part that takes no time."""
        job.rank.lanes[job.thread].job = job
        self.jobs.append(job)
        if job.left <= 0:
            self._end_phase(job)

    def _end_phase(self, job: _Job) -> None:
        now = self.now
        if job.phase == "off":
            cold = job.rank.spec.cold
            if cold is not None and job.instr is not None and job.cpu > 0:  # a run's CPU part
                # a collective's off-CPU part is the waits between its own CPU work (its transfers),
                # not a stretch off the CPU before it: the thread stands where the run started
                begin = job.start if job.meet is not None else now
                job.cpu = job.rank.lanes[job.thread].warmth.charge(cold, begin, job.cpu)
            job.phase, job.left, job.anchor, job.rate, job.cpu_start = "cpu", job.cpu, now, 1.0, now
            if job.cpu > 0:
                return
        if job.phase == "cpu":
            job.rank.contention += max(0.0, (now - job.cpu_start) - job.cpu)
            if job.rank.spec.cold is not None and job.instr is not None and job.cpu > 0:
                job.rank.lanes[job.thread].warmth.ended(now)
            if job.meet is None:
                self._finish(job)
                return
            job.phase, job.anchor = "meet", now
            self.meets.setdefault(job.meet, {})[job.rank.number] = job
            if len(self.meets[job.meet]) == len(self.states):
                for other in self.meets.pop(job.meet).values():
                    self._finish(other)

    def _finish(self, job: _Job) -> None:
        """The job ends at ``now``: record the run, release its ticket, signal nothing (the
        program's own ``signal`` follows), submit its device work."""
        s, now = job.rank, self.now
        self.jobs.remove(job)
        lane = s.lanes[job.thread]
        lane.job = None
        s.dirty = True
        if job.phase == "meet":
            task = job.instr.task if job.instr is not None else ""
            s.rendezvous_wait[task] = s.rendezvous_wait.get(task, 0.0) + (now - job.anchor)
        if job.meet is not None and s.spec.cold is not None:  # the transport idles from here
            s.transport.ended(now)
        if job.instr is None:  # the overhead or a wake-up: time on the lane, no step
            lane.time = now
            return
        where = f"rank {s.number}, thread {job.thread!r}, internal iteration {job.p}"
        s.finish_run(job.thread, lane, job.p, job.index, job.instr, job.start, now, job.sources, where)
        s.finished(job.instr, job.p)

    def _set_rates(self) -> None:
        """Processor sharing (``sim.cores.fair_rates``): re-anchor the CPU parts whose rate changed."""
        runnable: dict[int, list[_Job]] = {}
        for j in self.jobs:
            if j.phase == "cpu":
                runnable.setdefault(j.rank.spec.machine, []).append(j)
        for machine, jobs in runnable.items():
            per_rank: dict[int, int] = {}
            for j in jobs:
                per_rank[j.rank.number] = per_rank.get(j.rank.number, 0) + 1
            key = (machine, tuple(per_rank.items()))  # (a rank's GIL share is its spec's: fixed by the rank)
            rates = self.rates.get(key)
            if rates is None:  # the same few mixes of runnable threads recur at every step
                gil = {j.rank.number: j.rank.spec.gil for j in jobs}
                rates = self.rates[key] = fair_rates(per_rank, self.cores[machine], self.background[machine], gil)
            for j in jobs:
                rate = rates[j.rank.number]
                if j.rate != rate:
                    done = (self.now - j.anchor) * j.rate
                    j.left, j.anchor, j.rate = max(0.0, j.left - done), self.now, rate

    # ------------------------------------------------------------ deadlock
    def _deadlock(self) -> SimDeadlock:
        blocked: list[Blocked] = []
        for s in self.states:
            if s.done:
                continue
            for thread, lane in s.lanes.items():
                if lane.job is not None and lane.job.meet is not None:
                    group, k = lane.job.meet
                    met = self.meets.get(lane.job.meet, {})
                    missing = [r.number for r in self.states if r.number not in met]
                    instr = lane.job.instr
                    blocked.append(
                        Blocked(
                            thread,
                            lane.job.p,
                            lane.job.index,
                            str(instr),
                            f"collective {k} of comm group {group!r} ({instr.task if instr else ''}, batch "
                            f"{lane.job.batch}) waits for rank(s) {missing}, which never join it",
                            s.number,
                        )
                    )
                elif lane.at < len(lane.todo):
                    blocked.append(s.blocked(thread, lane, s.number))
        lines = ["deadlock across ranks: no thread of any rank can make progress", *(f"  {b}" for b in blocked)]
        return SimDeadlock("\n".join(lines), tuple(blocked))
