"""The overlap search: where and when the work runs, never what it computes.

Every move keeps each batch's numerics - the same tasks, stages, fire order and calls - so a
plan found here trains bit for bit like the plan it starts from and can replace it mid-run:

* **threads**: a task below the highest stage (it works on a batch ahead of the one being
  trained: loading, copying, the input dist) that runs in every iteration moves to another CPU
  thread (at most ``max_threads``, the loads' lanes counted). The highest stage's tasks stay where
  they are: their order around the training step (zero_grad before backward, the next forward
  after the optimizer step) is fire order on one thread, not always a declared dependency;
* **lookahead**: the source may draw up to ``k`` batches beyond the pipeline's depth;
* **loads**: ``k`` draws in flight at once, the source alone on thread ``load`` and its lanes
  (only where the data splits a draw, ``Space.loads``, and the source only draws: a Fetch split
  off H2D, or TrainPipelineBase's LoadBatch);
* **comm group**: the input dist's tasks (``Space.own_group``) take tickets in a comm group of
  their own, ``input_dist`` (only where the pipeline gives them a process group of their own).

A candidate is scored by the multi-rank simulator's engine model (``sim.simulate_ranks``) with
every rank's calibrated costs (``sim.calibrate``: by default each task at its mean, or the
measured iterations replayed in turn, ``Space.mode``), the machine's cores, each process's GIL
and the wake-up latency of a blocked thread: its mean step. Memory is part of the objective:
``depth + lookahead`` batches are held at once, each ``Space.batch_bytes``; a candidate over
``Space.memory_cap_bytes`` is left out. Within ``Space.tie`` of the best step, fewer batches in
flight, then fewer threads, fewer loads and fewer changes win.

The search: thread layouts first (a beam over single moves, from the plan's own layout and a few
seeds: the stage-0 tasks on thread ``io``, everything below the highest stage off the calling
thread), each scored at the largest lookahead allowed; then, for the best layouts, every
lookahead, number of loads and comm group choice. ``OverlapResult`` says which plan won, its
predicted step against the starting plan's, what binds it (``bounds``) and why it wins.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from torchrec_swp.autosched.bounds import Bound, BoundReport
from torchrec_swp.plan import MAIN_THREAD, PhasedPlan, PipelinePlan, PlanError
from torchrec_swp.sim import Calibration, SimError, Wake, simulate_ranks

#: The comm group the input dist's tasks move to (``catalog.transforms.INPUT_DIST``).
OWN_GROUP = "input_dist"
#: The thread the source's loads run on.
LOAD_THREAD = "load"

#: ``on_progress(candidates scored, best step so far)``
ProgressCallback = Callable[[int, float], None]


@dataclass(frozen=True)
class Machine:
    """Where the ranks run: ``cores`` per machine, the machine of each rank, the wake-up latency
    of a thread another one signals (seconds, off the CPU; a ``sim.Wake``: by what the other
    threads do then), and the share of CPU work that holds a process's GIL (None: not modelled)."""

    cores: int | None
    machines: tuple[int, ...]
    wake: float | Wake = 0.0
    gil: float | None = None


@dataclass(frozen=True)
class Space:
    """What the search may change and its limits (module docstring)."""

    lookahead: tuple[int, ...] = (0, 1, 2, 3)
    loads: tuple[int, ...] = (1,)
    own_group: tuple[str, ...] = ()
    threads: bool = True
    max_threads: int = 4
    max_in_flight: int = 6
    batch_bytes: float = 0.0
    memory_cap_bytes: float | None = None
    split_draws: bool = False
    tie: float = 0.01
    beam: int = 4
    passes: int = 2
    batches: int = 28
    #: how the calibrated costs are replayed: ``"mean"`` (every task at its mean cost: the ranking
    #: of plans other than the profiled one) or ``"replay"`` (the measured iterations in turn,
    #: every rank's from the same iteration: the profiled plan and its neighbours; ranks that vary
    #: from step to step meet in their collectives later than their means do)
    mode: str = "mean"

    def __post_init__(self) -> None:
        if not self.lookahead or any(isinstance(k, bool) or not isinstance(k, int) or k < 0 for k in self.lookahead):
            raise ValueError(f"lookahead choices must be ints >= 0, got {self.lookahead!r}")
        if not self.loads or any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in self.loads):
            raise ValueError(f"loads choices must be ints >= 1, got {self.loads!r}")
        for name in ("max_threads", "max_in_flight", "beam", "passes", "batches"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if self.memory_cap_bytes is not None and not self.memory_cap_bytes > 0:
            raise ValueError(f"memory_cap_bytes must be > 0 or None, got {self.memory_cap_bytes!r}")
        if self.mode not in ("mean", "replay"):
            raise ValueError(f"mode must be 'mean' or 'replay', got {self.mode!r}")

    def holds(self, depth: int, lookahead: int) -> bool:
        """Whether a plan of ``depth`` batches running ``lookahead`` ahead stays within the
        batches in flight and the memory cap (each batch ``batch_bytes``)."""
        in_flight = depth + lookahead
        cap = self.memory_cap_bytes
        return in_flight <= self.max_in_flight and (cap is None or in_flight * self.batch_bytes <= cap)


@dataclass(frozen=True, slots=True)
class Candidate:
    """One point of the space: the thread of every task (the plan's fire order), lookahead,
    loads and whether the input dist has its own comm group."""

    threads: tuple[str, ...]
    lookahead: int
    loads: int
    own_group: bool

    def describe(self, base: Candidate, tasks: Sequence[str]) -> str:
        """What differs from ``base``, in words."""
        moved = [f"{t} on {th}" for t, th, b in zip(tasks, self.threads, base.threads, strict=True) if th != b]
        parts = [*moved]
        if self.loads != base.loads:
            parts.append(f"{self.loads} loads")
        if self.lookahead != base.lookahead:
            parts.append(f"lookahead {self.lookahead}")
        if self.own_group != base.own_group:
            parts.append(
                "the input dist in a comm group of its own"
                if self.own_group
                else "the input dist back in its comm group"
            )
        return ", ".join(parts) or "the plan as it is"


@dataclass(frozen=True)
class Scored:
    candidate: Candidate
    plan: PipelinePlan
    step: float
    in_flight: int
    memory: float
    bounds: BoundReport


@dataclass(frozen=True)
class OverlapResult:
    """The best candidate found (``best``) against the starting plan (``start``), what each was
    predicted to take per step, and what the search cost; ``ranking``: every candidate scored with
    its lookahead, loads and comm group, best first (``OverlapSearch.ordered``)."""

    best: Scored
    start: Scored
    change: str
    scored: int
    seconds: float
    ranking: tuple[Scored, ...] = field(default=(), repr=False)

    @property
    def plan(self) -> PipelinePlan:
        return self.best.plan

    @property
    def predicted(self) -> float:
        return self.best.step

    @property
    def baseline(self) -> float:
        return self.start.step

    @property
    def speedup(self) -> float:
        return self.start.step / self.best.step if self.best.step > 0 else 1.0

    def why(self, scale: float = 1e3, unit: str = " ms", start: str = "the starting plan") -> list[str]:
        """Why the chosen plan wins: what bound the starting plan (called ``start``), what the
        change does to it, and what binds now. Each bound is named by its ``what`` alone, a noun
        phrase (``OverlapSearch.bounds``)."""
        s, b = self.start.bounds.binding, self.best.bounds.binding
        lines = [
            f"{start} is bound by {s.what} ({s.value * scale:.3g}{unit} per step); "
            f"predicted {self.start.step * scale:.3g}{unit}",
        ]
        if self.best.candidate == self.start.candidate:
            lines.append("no change is predicted to do better")
            return lines
        lines.append(f"the change: {self.change}")
        old = {(x.kind, x.what): x.value for x in self.start.bounds.bounds}
        if (s.kind, s.what) in {(x.kind, x.what) for x in self.best.bounds.bounds}:
            now = next(x.value for x in self.best.bounds.bounds if (x.kind, x.what) == (s.kind, s.what))
            lines.append(f"{s.what}: {old[(s.kind, s.what)] * scale:.3g}{unit} -> {now * scale:.3g}{unit} per step")
        lines.append(
            f"now bound by {b.what} ({b.value * scale:.3g}{unit}); predicted {self.best.step * scale:.3g}{unit} "
            f"(x{self.speedup:.2f}), {self.best.in_flight} batches in flight"
            + (f" ({self.best.memory / 2**20:,.1f} MiB)" if self.best.memory else "")
        )
        return lines

    def format(self, scale: float = 1e3, unit: str = " ms") -> str:
        return "\n".join(
            [
                *self.why(scale, unit),
                f"{self.scored} candidates simulated in {self.seconds:.2f}s",
            ]
        )


class OverlapSearch:
    """One search: the starting plan, every rank's calibrated costs, the machine and the space."""

    def __init__(
        self,
        plan: PipelinePlan | PhasedPlan,
        calibration: Calibration,
        machine: Machine,
        space: Space = Space(),
        *,
        overhead: Sequence[float] | None = None,
    ) -> None:
        self.phased = plan
        self.plan = plan.plans[-1] if isinstance(plan, PhasedPlan) else plan
        self.cal = calibration
        self.machine = machine
        self.space = space
        if len(machine.machines) != len(calibration.ranks):
            raise ValueError(f"{len(machine.machines)} machines given for {len(calibration.ranks)} ranks")
        for c in calibration.ranks:
            missing = sorted(set(self.plan.fire_order) - set(c.plan.fire_order))
            if missing:
                raise PlanError(
                    f"the profile is of plan {c.plan.name}, which lacks task {missing[0]} of plan {self.plan.name}: "
                    "profile the plan the search starts from",
                    culprit=missing[0],
                )
        self.tasks = self.plan.fire_order
        self.anchors = {t for t in self.tasks if self.plan.tasks[t].anchor}
        #: the tasks whose thread may move (module docstring)
        self.movable = {
            t
            for t in self.tasks
            if t not in self.anchors
            and self.plan.task(t).stage < self.plan.max_stage
            and self.plan.task(t).when.in_steady_state
        }
        self.source = self.plan.source
        self.top = self.plan.max_stage
        self.scores: dict[Candidate, Scored | None] = {}
        self.on_progress: ProgressCallback | None = None

    # ------------------------------------------------------------------ candidates
    def start(self) -> Candidate:
        p = self.plan
        own = bool(self.space.own_group) and all(p.task(t).comm_group == OWN_GROUP for t in self._own_tasks())
        return Candidate(tuple(p.task(t).thread_group for t in self.tasks), p.lookahead, p.loads, own)

    def _own_tasks(self) -> list[str]:
        """The input dist tasks of the space that issue collectives in this plan (EvalPipelineCPUSparse's
        InitPipelinedModules issues none: its tables are data-parallel)."""
        return [t for t in self.space.own_group if t in self.plan.schedule and self.plan.task(t).comm_group is not None]

    def build(self, c: Candidate) -> PipelinePlan:
        """The plan of candidate ``c`` (validated: PlanError if it cannot run)."""
        plan = self.plan
        schedule = {
            t: plan.task(t).schedule.replace(thread_group=th) for t, th in zip(self.tasks, c.threads, strict=True)
        }
        if c.own_group:
            for t in self._own_tasks():
                schedule[t] = schedule[t].replace(comm_group=OWN_GROUP)
        elif self.space.own_group:
            for t in self._own_tasks():
                schedule[t] = schedule[t].replace(comm_group=self.plan.task(t).comm_group)
        return plan.replace(schedule=schedule, lookahead=c.lookahead, loads=c.loads)

    def seeds(self) -> list[tuple[str, ...]]:
        """Thread layouts to start from: the plan's own, the stage-0 tasks on ``io``, and besides
        everything below the highest stage that issues no collective on ``dist``."""
        plan = self.plan
        own = tuple(plan.task(t).thread_group for t in self.tasks)
        io = tuple(
            "io" if plan.task(t).stage == 0 and t in self.movable else th for t, th in zip(self.tasks, own, strict=True)
        )
        dist = tuple(
            "dist" if plan.task(t).stage > 0 and t in self.movable else th for t, th in zip(self.tasks, io, strict=True)
        )
        return list(dict.fromkeys([own, io, dist]))

    def moves(self, threads: tuple[str, ...]) -> list[tuple[str, ...]]:
        """Every layout with one movable task on another thread in use, or a new one."""
        used = list(dict.fromkeys(threads))
        fresh = next(f"w{k}" for k in range(1, 99) if f"w{k}" not in used)
        out = []
        for i, t in enumerate(self.tasks):
            if t not in self.movable:
                continue
            for th in [*used, fresh]:
                if th != threads[i]:
                    out.append(threads[:i] + (th,) + threads[i + 1 :])
        return out

    def with_loads(self, threads: tuple[str, ...], loads: int) -> tuple[str, ...]:
        """``threads`` with the source alone on the load thread when it has several loads."""
        if loads == 1 or self.source is None:
            return threads
        return tuple(
            LOAD_THREAD if t == self.source else (MAIN_THREAD if th == LOAD_THREAD else th)
            for t, th in zip(self.tasks, threads, strict=True)
        )

    # ------------------------------------------------------------------ scoring
    def score(self, c: Candidate) -> Scored | None:
        if c in self.scores:
            return self.scores[c]
        scored = self._score(c)
        self.scores[c] = scored
        if self.on_progress is not None and scored is not None:
            best = min((s.step for s in self.scores.values() if s is not None), default=scored.step)
            self.on_progress(len(self.scores), best)
        return scored

    def _score(self, c: Candidate) -> Scored | None:
        space = self.space
        if len(set(c.threads)) + c.loads - 1 > space.max_threads:
            return None
        if not space.holds(self.plan.pipeline_depth, c.lookahead):
            return None
        in_flight = self.plan.pipeline_depth + c.lookahead
        memory = in_flight * space.batch_bytes
        try:
            plan = self.build(c)
        except PlanError:
            return None
        ranks = self.cal.simulation_ranks(
            space.mode,  # type: ignore[arg-type]  # a mode name the search space checked when built
            plans=[plan] * len(self.cal.ranks),
            machines=self.machine.machines,
            wake=self.machine.wake,
            split_draws=space.split_draws,
            gil=self.machine.gil,
        )
        try:
            n = max(space.batches, 4 * (in_flight + c.loads) + 10)
            if space.mode == "replay":  # every measured iteration replayed at least once
                n = max(n, self.cal.iterations + 2 * (in_flight + c.loads))
            result = simulate_ranks(ranks, n, cores=self.machine.cores)
        except SimError:
            return None
        step = result.step_period
        if step is None:
            return None
        return Scored(c, plan, step, in_flight, memory, self.bounds(plan, c))

    def bounds(self, plan: PipelinePlan, c: Candidate) -> BoundReport:
        """Per-step loads of the resources, worst rank (mean costs): each thread's tasks (the
        source's over its loads), each comm group's collectives, each machine's cores, each
        process's GIL. The step cannot be shorter than the largest. Each bound's ``what`` names
        its resource as a noun phrase ("the calling thread, rank 0", "comm group g, rank 0",
        "rank 0's GIL", "the 2 cores of machine 0"): ``OverlapResult.why`` prints it alone."""
        found: list[Bound] = []
        per_machine: dict[int, float] = {}
        for k, costs in enumerate(self.cal.ranks):
            cpu, off = costs.means()
            threads: dict[str, float] = {}
            groups: dict[str, float] = {}
            for t in plan.fire_order:
                s = plan.task(t)
                if not s.when.in_steady_state:
                    continue
                busy = cpu.get(t, 0.0) + off.get(t, 0.0)
                share = busy / c.loads if t == plan.source else busy
                threads[s.thread_group] = threads.get(s.thread_group, 0.0) + share
                if s.comm_group is not None:
                    groups[s.comm_group] = groups.get(s.comm_group, 0.0) + busy
            threads[MAIN_THREAD] = threads.get(MAIN_THREAD, 0.0) + costs.overhead
            work = sum(cpu.get(t, 0.0) for t in plan.fire_order if plan.task(t).when.in_steady_state) + costs.overhead
            for th, v in threads.items():
                if th == MAIN_THREAD:
                    label = "the calling thread"
                else:
                    loader = plan.source is not None and th == plan.task(plan.source).thread_group
                    suffix = f" ({c.loads} loads)" if loader and c.loads > 1 else ""
                    label = f"thread {th}{suffix}"
                found.append(Bound("thread", f"{label}, rank {k}", v))
            for g, v in groups.items():
                found.append(Bound("comm", f"comm group {g}, rank {k}", v))
            if self.machine.gil is not None:
                found.append(Bound("gil", f"rank {k}'s GIL", work * self.machine.gil))
            m = self.machine.machines[k]
            per_machine[m] = per_machine.get(m, 0.0) + work
        if self.machine.cores is not None:
            for m, work in per_machine.items():
                cores = self.machine.cores
                found.append(Bound("cores", f"the {cores} cores of machine {m}", work / cores))
        return BoundReport(tuple(sorted(found, key=lambda b: -b.value)))

    def ordered(self, scored: Sequence[Scored], start: Candidate) -> list[Scored]:
        """Best first: the shortest step; within ``Space.tie`` of it, the fewest batches in flight,
        threads, loads and changes from ``start``."""
        best = min(s.step for s in scored)

        def key(s: Scored) -> tuple[object, ...]:
            c = s.candidate
            if s.step > best * (1 + self.space.tie):
                return (1, s.step)
            changes = sum(a != b for a, b in zip(c.threads, start.threads, strict=True))
            changes += c.own_group != start.own_group
            return (0, s.in_flight, len(set(c.threads)), c.loads, changes, s.step)

        return sorted(scored, key=key)

    # ------------------------------------------------------------------ the search
    def run(self) -> OverlapResult:
        began = time.perf_counter()
        space = self.space
        start = self.start()
        first = self.score(start)
        if first is None:
            raise PlanError(
                f"the starting plan {self.plan.name} itself does not fit the search's limits "
                f"(threads {space.max_threads}, batches in flight {space.max_in_flight}"
                + (f", memory cap {space.memory_cap_bytes / 2**20:,.1f} MiB" if space.memory_cap_bytes else "")
                + ")",
                culprit=self.plan.name,
            )
        probe = max(
            (k for k in space.lookahead if self.plan.pipeline_depth + k <= space.max_in_flight), default=start.lookahead
        )
        layouts: dict[tuple[str, ...], float] = {}

        def layout_score(threads: tuple[str, ...]) -> float:
            if threads not in layouts:
                s = self.score(Candidate(threads, probe, 1, start.own_group))
                layouts[threads] = s.step if s is not None else float("inf")
            return layouts[threads]

        beam = sorted(self.seeds(), key=layout_score)[: space.beam]
        if space.threads:
            for _ in range(space.passes):
                before = layout_score(beam[0])
                pool = set(beam)
                for threads in beam:
                    pool.update(self.moves(threads))
                beam = sorted(pool, key=lambda t: (layout_score(t), t))[: space.beam]
                if not layout_score(beam[0]) < before:
                    break
        else:
            beam = [start.threads]
        full: list[Scored] = [first]
        groups = (False, True) if self._own_tasks() else (start.own_group,)
        for threads in dict.fromkeys([start.threads, *beam]):
            for loads in space.loads:
                placed = self.with_loads(threads, loads)
                for k in space.lookahead:
                    for own in groups:
                        s = self.score(Candidate(placed, k, loads, own))
                        if s is not None:
                            full.append(s)
        ranking = self.ordered(full, start)
        best = ranking[0]
        return OverlapResult(
            best=best,
            start=first,
            change=best.candidate.describe(start, self.tasks),
            scored=len(self.scores),
            seconds=time.perf_counter() - began,
            ranking=tuple(ranking),
        )


def search_overlap(
    plan: PipelinePlan | PhasedPlan,
    calibration: Calibration,
    machine: Machine,
    space: Space = Space(),
    *,
    on_progress: ProgressCallback | None = None,
) -> OverlapResult:
    """Search the overlap options of ``plan`` (module docstring) with every rank's calibrated
    costs on ``machine``. Raises PlanError when the profile does not match the plan or the
    starting plan does not fit the limits."""
    search = OverlapSearch(plan, calibration, machine, space)
    search.on_progress = on_progress
    return search.run()


def apply_candidate(plan: PipelinePlan | PhasedPlan, found: PipelinePlan) -> PipelinePlan | PhasedPlan:
    """``plan`` (every phase of a PhasedPlan) with the threads, lookahead, loads and comm groups
    of ``found``, a plan the search returned for one of its phases (same tasks)."""
    def edit(p: PipelinePlan) -> PipelinePlan:
        schedule = {
            t: p.task(t).schedule.replace(thread_group=found.task(t).thread_group, comm_group=found.task(t).comm_group)
            if t in found.schedule
            else p.task(t).schedule
            for t in p.fire_order
        }
        return p.replace(schedule=schedule, lookahead=found.lookahead, loads=found.loads)

    return plan.each(edit) if isinstance(plan, PhasedPlan) else edit(plan)


def memory_of(plan: PipelinePlan, batch_bytes: float) -> float:
    """Bytes held by the batches in flight of ``plan``."""
    return (plan.pipeline_depth + plan.lookahead) * batch_bytes


__all__ = [
    "Candidate",
    "LOAD_THREAD",
    "Machine",
    "OWN_GROUP",
    "OverlapResult",
    "OverlapSearch",
    "Scored",
    "Space",
    "apply_candidate",
    "memory_of",
    "search_overlap",
]
