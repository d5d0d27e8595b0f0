"""Calibration: the costs of each rank's tasks, from measured runs of every rank.

Input: for each rank, the iterations a ``TaskProfiler`` recorded (``profiler.records``: objects
with ``iteration``, ``start``, ``end`` and ``runs``, each run with ``task``, ``batch``,
``thread``, ``start``, ``end``, in ``time.perf_counter()`` seconds - one clock for every
process of a Linux machine, so the ranks' runs line up). Only *complete* iterations count (every
task the plan runs in the steady state ran once), after ``warmup`` of them, and only those
complete on every rank (matched by internal iteration number). Per iteration and task, on each
rank:

* measured: ``w = end - start``;
* a **collective** (a task with a comm group; with two or more ranks): its own part is what it
  took after the last rank arrived, ``d = end - max over ranks of start`` (the simulator adds the
  rendezvous wait back); anything else: ``d = w``;
* a run whose thread CPU time was measured (``run.cpu``, a ``TaskProfiler`` records it): its CPU
  work is that time (at most ``d``) and the rest of ``d`` is **off-CPU** (a loader sleeping on
  storage, a collective's transfer): what the thread computed, whatever it shared its core with;
* otherwise, **off-CPU**: ``off_cpu[task]`` seconds of ``d`` (at most ``d``) that need no core -
  what the caller knows, e.g. the loader's configured latency in the source task; the rest is
  CPU work, and its **contention** (with ``cores``) is taken out: the CPU part ran while the other
  runnable runs of every rank on the machine (each from ``start + off`` to ``start + d``), plus
  ``background`` threads, shared ``cores`` cores; its work is the integral of
  ``min(1, cores / runnable)`` over it, so that ``simulate_ranks(..., cores=cores)`` stretches it
  back by as much.

With a ``cold`` rule (``torchrec_swp.sim.cold``), every run's CPU work is then taken back to its
warm work: each thread's runs in time order (a run's CPU part from ``start + off`` to ``start +
d``, the simulator's order: off-CPU part, CPU part, rendezvous), a run starting its CPU part
``cold.after`` or more after the thread's previous one ended is cold, and ``Cold.work``
inverts what it cost from its position; each rank's collectives' off-CPU parts (their
transfers, after the rendezvous) are taken back the same way on the rank's transport, walked
in time order over the rank's collectives (``torchrec_swp.sim.cold``). The ranks then simulate
with the same rule (``RankCosts.cold``), which charges each run what its position in the
simulated plan costs, and each collective what its transport's.

Tasks that do not run in the steady state (``when`` first, fill, last) cost the median of
their recorded runs (0 if none ran).

``RankCosts.rank(mode)`` gives a rank's ``sim.Rank``:

* ``mode="mean"``: every part of every task costs its mean - the model of the mean step (the
  throughput): the mean of a sum is the sum of the means, the median is not;
* ``mode="median"``: every task costs its median (the ``Profile.durations()`` model);
* ``mode="replay"``: the measured iterations in the order they ran, over and over: internal
  iteration ``P`` of the simulation costs what the ``(P - first) mod n``-th measured one cost
  (``first``: the number of the first measured iteration, ``n`` of them) - measured iteration
  ``P`` itself when the measured ones are consecutive and include ``P``;
* ``mode="resample"``: the same with the measured iteration drawn at random (seeded).

In the last two, every task of an iteration and every rank take the same measured iteration:
a step's tasks and the ranks stay as correlated as they were (a slow step is slow everywhere),
and the median of the simulated steps estimates the measured median step. The sum of medians
underestimates it when task times are right-skewed, as they are on a loaded machine.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from torchrec_swp.plan import PipelinePlan
from torchrec_swp.sim.cold import Cold, Warmth
from torchrec_swp.sim.durations import Durations
from torchrec_swp.sim.errors import SimError
from torchrec_swp.sim.multirank import Rank
from torchrec_swp.sim.wake import Wake

Mode = Literal["mean", "median", "replay", "resample"]
MODES = ("mean", "median", "replay", "resample")


class RunLike(Protocol):
    task: str
    batch: int
    thread: str
    start: float
    end: float
    # and, where measured, ``cpu``: the thread CPU time of the run (seconds)


class IterationLike(Protocol):
    # read-only: a profiler's IterationRecord (a frozen dataclass) is one
    @property
    def iteration(self) -> int: ...

    @property
    def start(self) -> float: ...

    @property
    def end(self) -> float: ...

    @property
    def runs(self) -> Sequence[Any]: ...


@dataclass(frozen=True)
class RankCosts:
    """One rank's calibrated costs: per measured iteration (numbers in ``iterations``),
    ``(cpu, off)`` seconds per task; ``once``: the tasks that do not run in the steady state,
    with their cost; ``overhead``: the per-iteration overhead to simulate on the calling thread (CPU
    work), ``overhead_off`` its part off the CPU (the caller waiting between steps); ``cold``:
    the rule the CPU work was calibrated with (it is warm work: simulate with the same)."""

    plan: PipelinePlan
    iterations: tuple[int, ...]
    samples: tuple[Mapping[str, tuple[float, float]], ...]
    once: Mapping[str, float]
    overhead: float = 0.0
    overhead_off: float = 0.0
    cold: Cold | None = None

    def medians(self) -> tuple[dict[str, float], dict[str, float]]:
        """``(cpu, off)``: the median of each part of every task."""
        cpu = {t: statistics.median(s[t][0] for s in self.samples) for t in self.samples[0]}
        off = {t: statistics.median(s[t][1] for s in self.samples) for t in self.samples[0]}
        return {**cpu, **self.once}, off

    def means(self) -> tuple[dict[str, float], dict[str, float]]:
        """``(cpu, off)``: the mean of each part of every task."""
        cpu = {t: statistics.fmean(s[t][0] for s in self.samples) for t in self.samples[0]}
        off = {t: statistics.fmean(s[t][1] for s in self.samples) for t in self.samples[0]}
        return {**cpu, **self.once}, off

    def measured(self) -> dict[str, float]:
        """The median of each task's calibrated duration (CPU + off-CPU, without rendezvous waits)."""
        return {t: statistics.median(sum(s[t]) for s in self.samples) for t in self.samples[0]}

    def durations(self, mode: Mode = "resample", seed: int = 0) -> tuple[Durations, Durations]:
        """``(cpu, off_cpu)`` duration tables for the simulator (module docstring)."""
        if mode == "median":
            return self.medians()
        if mode == "mean":
            return self.means()
        if mode not in ("replay", "resample"):
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        stage = {t: s.stage for t, s in self.plan.schedule.items()}
        samples, once, n = self.samples, self.once, len(self.samples)
        first = self.iterations[0]
        draw = (lambda p: (p - first) % n) if mode == "replay" else (lambda p: _draw(seed, p, n))

        def pick(task: str, batch: int) -> tuple[float, float] | None:
            if task in once:
                return None
            return samples[draw(batch + stage[task])][task]

        def cpu(task: str, batch: int) -> float:
            got = pick(task, batch)
            return once[task] if got is None else got[0]

        def off(task: str, batch: int) -> float:
            got = pick(task, batch)
            return 0.0 if got is None else got[1]

        return cpu, off

    def rank(
        self,
        mode: Mode = "resample",
        *,
        seed: int = 0,
        plan: PipelinePlan | None = None,
        machine: int = 0,
        wake: float | Wake = 0.0,
        split_draws: bool = False,
        gil: float | None = None,
    ) -> Rank:
        """This rank for ``simulate_ranks``: its plan (or another ``plan`` with the same tasks,
        e.g. one the auto-scheduler proposes) with the calibrated costs and their ``cold`` rule (and
        the engine model's ``wake``, ``split_draws`` and ``gil``, see ``sim.Rank``)."""
        cpu, off = self.durations(mode, seed)
        return Rank(
            plan or self.plan,
            cpu,
            off_cpu=off,
            overhead=self.overhead,
            overhead_off=self.overhead_off,
            machine=machine,
            wake=wake,
            split_draws=split_draws,
            gil=gil,
            cold=self.cold,
        )


@dataclass(frozen=True)
class Calibration:
    """Every rank's costs (``ranks[r]``) and how many iterations they come from."""

    ranks: tuple[RankCosts, ...]
    iterations: int
    cores: int | None

    def simulation_ranks(
        self,
        mode: Mode = "resample",
        *,
        seed: int = 0,
        plans: Sequence[PipelinePlan] | None = None,
        machines: Sequence[int] | None = None,
        **engine: Any,
    ) -> list[Rank]:
        """A ``sim.Rank`` per rank (``plans``: other plans with the same tasks, one per rank;
        ``machines``: the machine of each rank, default all on machine 0; ``engine``: ``wake``,
        ``split_draws``, ``gil`` for every rank)."""
        return [
            c.rank(
                mode,
                seed=seed,
                plan=None if plans is None else plans[k],
                machine=0 if machines is None else machines[k],
                **engine,
            )
            for k, c in enumerate(self.ranks)
        ]


def _draw(seed: int, iteration: int, n: int) -> int:
    return random.Random(seed * 1_000_003 + iteration).randrange(n)


def calibrate(
    plans: PipelinePlan | Sequence[PipelinePlan],
    records: Sequence[Iterable[IterationLike]],
    *,
    warmup: int = 0,
    off_cpu: Mapping[str, float] | None = None,
    cores: int | None = None,
    background: float = 0.0,
    overhead: Sequence[float] | None = None,
    overhead_off: Sequence[float] | None = None,
    cold: Cold | None = None,
) -> Calibration:
    """Each rank's costs from its recorded iterations (module docstring). ``plans``: the plan
    that ran, the same on every rank, or one per rank; ``records[r]``: rank ``r``'s iterations;
    ``overhead[r]``: the per-iteration overhead of rank ``r`` (CPU; default 0), ``overhead_off[r]``
    its part off the CPU (default 0); ``cold``: take each run's CPU back to its warm work.

    Raises SimError when no iteration is complete on every rank after the warm-up.
    """
    # each rank's iterations are read in several passes: a one-shot iterable is read once here
    rank_records = [tuple(recs) for recs in records]
    n_ranks = len(rank_records)
    if n_ranks < 1:
        raise SimError("calibrate needs the records of at least one rank")
    plan_list = [plans] * n_ranks if isinstance(plans, PipelinePlan) else list(plans)
    if len(plan_list) != n_ranks:
        raise SimError(f"{len(plan_list)} plans for {n_ranks} ranks")
    for table in (overhead, overhead_off):
        if table is not None and len(table) != n_ranks:
            raise SimError(f"{len(table)} overheads for {n_ranks} ranks")
    off_table = dict(off_cpu or {})
    complete: list[dict[int, dict[str, Any]]] = []
    once: list[dict[str, float]] = []
    for plan, recs in zip(plan_list, rank_records, strict=True):
        steady = frozenset(t for t in plan.fire_order if plan.task(t).when.in_steady_state)
        full = [rec for rec in recs if {x.task for x in rec.runs} == steady and len(rec.runs) == len(steady)]
        complete.append({rec.iteration: {x.task: x for x in rec.runs} for rec in full[warmup:]})
        seen: dict[str, list[float]] = {}
        for rec in recs:
            for x in rec.runs:
                if x.task not in steady:
                    seen.setdefault(x.task, []).append(x.end - x.start)
        once.append({t: statistics.median(seen[t]) if t in seen else 0.0 for t in plan.fire_order if t not in steady})
    common = sorted(set.intersection(*(set(c) for c in complete)))
    if not common:
        raise SimError(
            f"no iteration complete on every rank after {warmup} warm-up: complete per rank "
            f"{[len(c) for c in complete]}; record more steps"
        )
    # per rank, per iteration: task -> (start, own part d, off, measured CPU or None)
    parts: list[list[dict[str, tuple[float, float, float, float | None]]]] = [[] for _ in range(n_ranks)]
    # per rank, its collectives: the tasks with a comm group
    comms = [frozenset(t for t in p.fire_order if p.task(t).comm_group is not None) for p in plan_list]
    for it in common:
        for r in range(n_ranks):
            row: dict[str, tuple[float, float, float, float | None]] = {}
            for task, run in complete[r][it].items():
                if n_ranks > 1 and task in comms[r]:
                    late = max(complete[q][it][task].start for q in range(n_ranks) if task in complete[q][it])
                    d = max(0.0, run.end - late)
                else:
                    d = max(0.0, run.end - run.start)
                cpu = getattr(run, "cpu", None)
                if cpu is not None:
                    cpu = min(d, max(0.0, float(cpu)))
                    row[task] = (run.start, d, d - cpu, cpu)
                else:
                    row[task] = (run.start, d, min(d, off_table.get(task, 0.0)), None)
            parts[r].append(row)
    work = _deflated(parts, cores, background)
    if cold is not None:
        for r, recs in enumerate(rank_records):
            index = {it: k for k, it in enumerate(common)}
            _warm(recs, index, parts[r], work[r], cold, off_table, comms[r])
            _warm_transport(recs, index, parts[r], cold, comms[r])
    costs = tuple(
        RankCosts(
            plan=plan_list[r],
            iterations=tuple(common),
            samples=tuple(
                {t: (work[r][k][t], off) for t, (_, _, off, _) in row.items()} for k, row in enumerate(parts[r])
            ),
            once=once[r],
            overhead=0.0 if overhead is None else float(overhead[r]),
            overhead_off=0.0 if overhead_off is None else float(overhead_off[r]),
            cold=cold,
        )
        for r in range(n_ranks)
    )
    return Calibration(costs, len(common), cores)


def _deflated(
    parts: list[list[dict[str, tuple[float, float, float, float | None]]]], cores: int | None, background: float
) -> list[list[dict[str, float]]]:
    """CPU work of every run: its measured CPU time where there is one; else its CPU part's wall
    time, times the share of a core it had (the integral of ``min(1, cores / runnable)``; all of
    it without ``cores``). Runs with a measured CPU time count as runnable during it."""
    if cores is None:
        return [
            [{t: d - off if cpu is None else cpu for t, (_, d, off, cpu) in row.items()} for row in rank]
            for rank in parts
        ]
    # every runnable interval of every rank, then a sweep computing each one's integral
    spans: list[tuple[float, float, int, int, str]] = []
    for r, rank in enumerate(parts):
        for k, row in enumerate(rank):
            for t, (start, d, off, _) in row.items():
                spans.append((start + off, start + d, r, k, t))
    edges = sorted({x for s in spans for x in (s[0], s[1])})
    counts = [0] * len(edges)
    index = {x: i for i, x in enumerate(edges)}
    # difference array over the elementary segments between consecutive edges
    diff = [0] * (len(edges) + 1)
    for a, b, *_ in spans:
        if b > a:
            diff[index[a]] += 1
            diff[index[b]] -= 1
    running = 0
    for i in range(len(edges)):
        running += diff[i]
        counts[i] = running  # runnable on [edges[i], edges[i + 1])
    share = [0.0] * len(edges)  # prefix integral of the core share
    for i in range(1, len(edges)):
        n = counts[i - 1] + background
        rate = 1.0 if n <= cores else cores / n
        share[i] = share[i - 1] + (edges[i] - edges[i - 1]) * rate
    out: list[list[dict[str, float]]] = [[{} for _ in rank] for rank in parts]
    for a, b, r, k, t in spans:
        cpu = parts[r][k][t][3]
        out[r][k][t] = cpu if cpu is not None else share[index[b]] - share[index[a]] if b > a else 0.0
    return out


# a CPU part for ``_warm``: its begin, its end, its cost, the slot it calibrates (None: not
# calibrated), when the run asks whether its thread is cold
_Span = tuple[float, float, float, tuple[int, str] | None, float]


def _warm(
    records: Iterable[IterationLike],
    index: Mapping[int, int],
    parts: list[dict[str, tuple[float, float, float, float | None]]],
    work: list[dict[str, float]],
    cold: Cold,
    off_table: Mapping[str, float],
    comm: frozenset[str],
) -> None:
    """Take one rank's CPU work (``work[k][task]`` of common iteration ``k``, in place) back to
    its warm work: each thread's CPU parts in time order under ``cold`` (module docstring). Every
    recorded run counts for where its thread stands, the runs of iterations not calibrated (the
    warm-up, incomplete ones) with their CPU part at their end. A collective's (``comm``: the tasks
    with a comm group) off-CPU part is no stretch off the CPU: whether it is cold is asked at its
    start, as the simulator does."""
    by_thread: dict[str, list[_Span]] = {}  # per thread
    for rec in records:
        k = index.get(rec.iteration)
        for x in rec.runs:
            if k is not None and x.task in parts[k]:
                start, d, off, _ = parts[k][x.task]
                asked = start if x.task in comm else start + off
                span: _Span = (start + off, start + d, work[k][x.task], (k, x.task), asked)
            else:
                wall = max(0.0, x.end - x.start)
                cpu = getattr(x, "cpu", None)
                cost = (
                    min(wall, max(0.0, float(cpu))) if cpu is not None else max(0.0, wall - off_table.get(x.task, 0.0))
                )
                span = (x.end - cost, x.end, cost, None, x.start if x.task in comm else x.end - cost)
            by_thread.setdefault(x.thread, []).append(span)
    for spans in by_thread.values():
        warmth = Warmth()
        for _, end, cost, slot, asked in sorted(spans, key=lambda x: x[:2]):
            if cost > 0:
                warm = warmth.work(cold, asked, cost)
                warmth.ended(end)
                if slot is not None:
                    work[slot[0]][slot[1]] = warm


def _warm_transport(
    records: Iterable[IterationLike],
    index: Mapping[int, int],
    parts: list[dict[str, tuple[float, float, float, float | None]]],
    cold: Cold,
    comm: frozenset[str],
) -> None:
    """Take one rank's collectives' off-CPU parts (``parts[k][task]``, in place) back to what
    they take on a warm transport: the rank's collectives in time order under ``cold``, asked at
    their run's start whether the transport sat idle ``cold.after`` or more since the previous
    collective ended (module docstring). Runs of iterations not calibrated count for where the
    transport stands with their wall time less their CPU time."""
    spans: list[tuple[float, float, float, tuple[int, str] | None]] = []
    for rec in records:
        k = index.get(rec.iteration)
        for x in rec.runs:
            if x.task not in comm:
                continue
            if k is not None and x.task in parts[k]:
                off = parts[k][x.task][2]
                spans.append((x.start, x.end, off, (k, x.task)))
            else:
                cpu = getattr(x, "cpu", None)
                off = max(0.0, x.end - x.start - (float(cpu) if cpu is not None else 0.0))
                spans.append((x.start, x.end, off, None))
    transport = Warmth()
    for start, end, off, slot in sorted(spans, key=lambda x: x[:2]):
        warm = transport.work(cold, start, off)
        transport.ended(end)
        if slot is not None:
            begin, d, _, cpu = parts[slot[0]][slot[1]]
            parts[slot[0]][slot[1]] = (begin, d, warm, cpu)
