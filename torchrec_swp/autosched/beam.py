"""Beam search over thread map, stream map and fire order, with the stage oracle.

The initial beam: the problem's plan and a few simple layouts (``_initial_beam``). Then the
funnel, one level per task (largest CPU time first) and a swap level, repeated in passes:

1. Every layout in the beam re-places the level's task: on each thread in use or one new
   thread (at most ``max_threads``), on each stream it may use (anchors are pinned to the
   default stream; a task with no device work keeps its stream, which changes nothing), at each
   position of the fire order. At the swap level, every two tasks on different threads
   exchange threads and fire positions instead.
2. The oracle (``stages.assign_stages``) gives each new layout its stages; layouts it
   cannot stage are dropped. Layouts that run alike (``Layout.key``) are considered once.
3. Candidates are ranked by the direct estimate (``estimate.iteration_time``); the best
   ``beam_width * funnel`` are built as plans (PipelinePlan validates them) and scored with
   the simulator (``score.predict``): steady period, then fewer batches in flight, fewer
   threads, fewer cross-thread waits.
4. The best ``beam_width`` scored layouts, the current beam included, form the next beam, with
   at most two per grouping of the tasks into threads so that fire-order variants of one
   grouping do not crowd out the others.

Passes stop when one does not improve the best score, or after ``max_passes``. The winner is
checked against every hard constraint (``constraints.check_constraints``) before it is returned.
"""

from __future__ import annotations

import functools
import heapq
import time
from collections.abc import Callable
from dataclasses import dataclass

from torchrec_swp.autosched.bounds import BoundReport, plan_bounds, search_bounds
from torchrec_swp.autosched.constraints import ensure_constraints
from torchrec_swp.autosched.estimate import cross_thread_waits, iteration_time
from torchrec_swp.autosched.layout import Layout, layout_of, named_threads, normalized, to_plan
from torchrec_swp.autosched.problem import Problem
from torchrec_swp.autosched.score import predict
from torchrec_swp.autosched.stages import assign_stages
from torchrec_swp.plan import MAIN_THREAD, PipelinePlan, PlanError

#: ``on_level(levels done, levels at most, best score so far)``
LevelCallback = Callable[[int, int, float], None]


@dataclass(frozen=True)
class SearchResult:
    """The best plan found, its predicted (simulated) steady iteration time, the problem's own
    plan simulated (``baseline``), the bounds, and what the search cost."""

    plan: PipelinePlan
    predicted: float
    baseline: float
    bounds: BoundReport
    plan_bounds: BoundReport
    estimated: int
    simulated: int
    passes: int
    seconds: float

    @property
    def efficiency(self) -> float:
        """Search lower bound / predicted time (1.0: provably optimal)."""
        return self.bounds.value / self.predicted if self.predicted > 0 else 1.0

    @property
    def speedup(self) -> float:
        return self.baseline / self.predicted if self.predicted > 0 else 1.0

    def format(self, scale: float = 1.0, unit: str = "") -> str:
        p = self.plan
        return "\n".join(
            [
                (
                    f"plan {p.name}: predicted iteration {self.predicted * scale:.4g}{unit} "
                    f"(problem's plan {self.baseline * scale:.4g}{unit}, x{self.speedup:.2f}), "
                    f"efficiency {100 * self.efficiency:.1f}% of the lower bound {self.bounds.value * scale:.4g}{unit} "
                    f"({self.bounds.binding.kind} {self.bounds.binding.what})"
                ),
                (
                    f"{len(p.thread_groups)} threads {list(p.thread_groups)}, {p.pipeline_depth} batches in flight; "
                    f"{self.estimated} layouts estimated, {self.simulated} simulated in {self.passes} passes, "
                    f"{self.seconds:.2f}s"
                ),
            ]
        )


@dataclass(frozen=True, slots=True)
class _Scored:
    score: tuple[float, int, int, int]
    key: tuple[object, ...]
    layout: Layout
    stages: tuple[int, ...]


class _Search:
    """Caches of one search: oracle + estimate per layout key, simulation per key."""

    def __init__(self, problem: Problem) -> None:
        self.problem = problem
        self.staged: dict[tuple[object, ...], tuple[tuple[int, ...], float] | None] = {}
        self.scored: dict[tuple[object, ...], _Scored | None] = {}

    def stage(self, layout: Layout) -> tuple[tuple[object, ...], tuple[int, ...], float] | None:
        key = layout.key(self.problem)
        if key not in self.staged:
            stages = assign_stages(self.problem, layout)
            self.staged[key] = (
                None if stages is None else (stages, iteration_time(self.problem, layout, stages))
            )
        entry = self.staged[key]
        return None if entry is None else (key, *entry)

    def score(self, key: tuple[object, ...], layout: Layout, stages: tuple[int, ...]) -> _Scored | None:
        if key not in self.scored:
            self.scored[key] = self._simulate(key, layout, stages)
        return self.scored[key]

    def _simulate(self, key: tuple[object, ...], layout: Layout, stages: tuple[int, ...]) -> _Scored | None:
        problem = self.problem
        try:
            plan = to_plan(problem, layout, stages)
        except PlanError:
            return None
        t = predict(problem, plan)
        waits = cross_thread_waits(problem, layout, stages)
        return _Scored((t, max(stages) + 1, layout.thread_count(), waits), key, layout, stages)


def beam_search(
    problem: Problem,
    *,
    beam_width: int = 8,
    funnel: int = 2,
    max_passes: int = 5,
    on_level: LevelCallback | None = None,
) -> SearchResult:
    """Search the problem's plans (rules above); return the best found with its prediction.

    Raises PlanError when no starting layout can be staged within the constraints.
    """
    if beam_width < 1 or funnel < 1 or max_passes < 1:
        raise ValueError(f"beam_width, funnel and max_passes must be >= 1, got {beam_width}, {funnel}, {max_passes}")
    began = time.perf_counter()
    search = _Search(problem)
    beam = _initial_beam(search)
    if not beam:
        raise PlanError(
            f"no starting layout of plan {problem.plan.name} can be staged with its anchors at the highest stage "
            f"and at most {problem.max_in_flight} batches in flight",
            culprit=problem.plan.name,
        )
    levels = sorted(range(len(problem.tasks)), key=lambda i: (-problem.cpu[i], i))
    moves = [*(functools.partial(_placements, problem, task=t) for t in levels), functools.partial(_swaps, problem)]
    total = max_passes * len(moves)
    done = passes = 0
    for _ in range(max_passes):
        passes += 1
        best_before = beam[0].score
        for move in moves:
            beam = _level(search, beam, move(beam), beam_width, funnel)
            done += 1
            if on_level is not None:
                on_level(done, total, beam[0].score[0])
        if not beam[0].score < best_before:
            break
    if on_level is not None and done < total:
        on_level(total, total, beam[0].score[0])
    best = beam[0]
    plan = to_plan(problem, named_threads(problem, best.layout), best.stages)
    ensure_constraints(plan, problem)
    baseline = predict(problem, problem.plan)
    return SearchResult(
        plan=plan,
        predicted=best.score[0],
        baseline=baseline,
        bounds=search_bounds(problem),
        plan_bounds=plan_bounds(plan, problem.durations, problem.device_durations),
        estimated=len(search.staged),
        simulated=len(search.scored),
        passes=passes,
        seconds=time.perf_counter() - began,
    )


def _initial_beam(search: _Search) -> list[_Scored]:
    """The problem's plan, everything on the calling thread, one thread per stream, and list
    scheduled layouts (each within the thread and stream constraints), in the plan's fire order
    and in a topological one (producers of the same batch first: no cut is forced, so it can
    be staged with few batches in flight), staged by the oracle and simulated."""
    problem = search.problem
    base = layout_of(problem, problem.plan)
    topological = Layout(base.threads, base.streams, _topological_order(problem, base))
    starts = [
        base,
        topological,
        Layout(tuple(MAIN_THREAD for _ in base.threads), base.streams, base.order),
        Layout(tuple(MAIN_THREAD for _ in base.threads), base.streams, topological.order),
        layout_of(problem, problem.plan.with_thread_map("by_stream")),
        *(_list_scheduled(problem, base, k) for k in range(2, problem.max_threads + 1)),
    ]
    out: dict[tuple[object, ...], _Scored] = {}
    for layout in (normalized(problem, s) for s in starts):
        staged = search.stage(layout)
        if staged is not None:
            scored = search.score(staged[0], layout, staged[1])
            if scored is not None:
                out[scored.key] = scored
    return sorted(out.values(), key=_rank)


def _topological_order(problem: Problem, base: Layout) -> tuple[int, ...]:
    """The base fire order, reordered as little as possible so that every same-batch producer
    fires before its consumers."""
    pos = base.position()
    missing = {i: 0 for i in base.order}
    consumers: dict[int, list[int]] = {}
    for d in problem.deps:
        if d.distance == 0:
            missing[d.consumer] += 1
            consumers.setdefault(d.producer, []).append(d.consumer)
    ready = [(pos[i], i) for i, m in missing.items() if m == 0]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        _, i = heapq.heappop(ready)
        order.append(i)
        for c in consumers.get(i, ()):
            missing[c] -= 1
            if missing[c] == 0:
                heapq.heappush(ready, (pos[c], c))
    return tuple(order)


def _list_scheduled(problem: Problem, base: Layout, threads: int) -> Layout:
    """A layout by list scheduling one iteration on ``threads`` threads, as if every dependency
    could be cut except same-batch ones between anchors: tasks in the base fire order, each on
    the thread where it would end first (ties: the fuller thread, to keep threads few); comm
    groups serialized. The fire order is the order of start times."""
    d = problem.cpu
    pool = problem.thread_pool[:threads]
    free = dict.fromkeys(pool, 0.0)
    comm_free: dict[str, float] = {}
    end = [0.0] * len(d)
    start = [0.0] * len(d)
    thread = list(base.threads)
    anchors = problem.anchor_index
    for i in base.order:
        ready = max(
            (
                end[x.producer]
                for x in problem.producers[i]
                if x.distance == 0 and i in anchors and x.producer in anchors
            ),
            default=0.0,
        )
        group = problem.comm[i]
        if group is not None:
            ready = max(ready, comm_free.get(group, 0.0))
        t = min(pool, key=lambda t: (max(free[t], ready), -free[t]))
        start[i] = max(free[t], ready)
        end[i] = free[t] = start[i] + d[i]
        thread[i] = t
        if group is not None:
            comm_free[group] = end[i]
    pos = base.position()
    order = tuple(sorted(base.order, key=lambda i: (start[i], pos[i])))
    return Layout(tuple(thread), base.streams, order)


def _rank(s: _Scored) -> tuple[object, ...]:
    """Score first; the key's text makes ties deterministic."""
    return (s.score, repr(s.key))


def _placements(problem: Problem, beam: list[_Scored], task: int) -> list[Layout]:
    """Every layout of the beam with ``task`` re-placed: any thread in use or one new one, any
    stream it may use, any fire position."""
    out = []
    for state in beam:
        layout = state.layout
        others = {t for i, t in enumerate(layout.threads) if i != task}
        threads = sorted(others)
        fresh = next((t for t in problem.thread_pool if t not in others), None)
        if fresh is not None and len(others) < problem.max_threads:
            threads.append(fresh)
        if task in problem.anchor_index or not (problem.device_durations or {}).get(problem.tasks[task]):
            streams = [layout.streams[task]]  # pinned, or no device work: its stream changes nothing
        else:
            streams = list(problem.streams)
        for thread in threads:
            for stream in streams:
                for at in range(len(layout.order)):
                    out.append(layout.moved(task, thread, stream, at))
    return out


def _swaps(problem: Problem, beam: list[_Scored]) -> list[Layout]:
    """Every layout of the beam with two tasks on different threads exchanging threads and
    fire positions."""
    out = []
    for state in beam:
        layout = state.layout
        pos = layout.position()
        for i in range(len(layout.threads)):
            for j in range(i + 1, len(layout.threads)):
                if layout.threads[i] == layout.threads[j]:
                    continue
                threads = list(layout.threads)
                threads[i], threads[j] = threads[j], threads[i]
                order = list(layout.order)
                order[pos[i]], order[pos[j]] = j, i
                out.append(Layout(tuple(threads), layout.streams, tuple(order)))
    return out


def _level(search: _Search, beam: list[_Scored], children: list[Layout], beam_width: int, funnel: int) -> list[_Scored]:
    """Stage and estimate ``children``, simulate the best ``beam_width * funnel``, keep the best
    ``beam_width`` of those and the beam."""
    candidates: dict[tuple[object, ...], tuple[float, int, Layout, tuple[int, ...]]] = {}
    for child in children:
        staged = search.stage(child)
        if staged is None or staged[0] in candidates:
            continue
        key, stages, estimate = staged
        candidates[key] = (estimate, max(stages), child, stages)
    ranked = sorted(candidates.items(), key=lambda kv: (kv[1][0], kv[1][1], kv[1][2].thread_count(), repr(kv[0])))
    # what the estimate ranks first is simulated; the simulator has the last word
    pool = {s.key: s for s in beam}
    for key, (_, _, child, stages) in ranked[: beam_width * funnel]:
        scored = search.score(key, child, stages)
        if scored is not None:
            pool[key] = scored
    return _diverse(sorted(pool.values(), key=_rank), beam_width)


def _diverse(ranked: list[_Scored], beam_width: int) -> list[_Scored]:
    """The best ``beam_width`` of ``ranked``, at most two per partition of the tasks into threads
    (so that fire-order variants of one partition do not crowd the others out), filled up with
    the next best if there are too few partitions."""
    per_partition: dict[tuple[int, ...], int] = {}
    chosen: list[_Scored] = []
    rest: list[_Scored] = []
    for s in ranked:
        partition = s.layout.partition()
        if per_partition.get(partition, 0) < 2 and len(chosen) < beam_width:
            per_partition[partition] = per_partition.get(partition, 0) + 1
            chosen.append(s)
        else:
            rest.append(s)
    return sorted([*chosen, *rest[: beam_width - len(chosen)]], key=_rank)
