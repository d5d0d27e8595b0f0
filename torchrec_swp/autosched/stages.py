"""The stage oracle: given threads, streams and fire order, choose every task's stage.

A dependency ``c(b) after p(b - k)`` has ``lead = stage[c] - stage[p] + k`` iterations from
producer to consumer; ``lead == 0`` puts both in one iteration (the consumer waits for the
producer when they are on different threads), ``lead >= 1`` lets the iteration barrier order
them for free. The oracle works downward from the anchors: it computes for every task how many
stages below the highest one it sits (``h = max_stage - stage``), then returns the stages.

Rules of ``assign_stages`` (each solution satisfies 1-4):

1. Anchors are at the highest stage ``A``; the source is at stage 0; a task that does not
   depend on the source in the same batch is at stage ``>= 1`` (it may not run for a batch
   that was never loaded); ``A + 1 <= max_in_flight``.
2. Every dependency has ``lead >= 0``, and ``lead >= 1`` when the producer fires after the
   consumer (a forced cut).
3. Cuts: cross-thread dependencies in fire order get ``lead >= 1`` - all of them if the
   in-flight limit allows; else greedily, each time the cut that leaves the shortest iteration
   (``estimate.iteration_time``), while one still shortens it or keeps it equal.
4. Stages are the fewest satisfying the chosen cuts (fewest batches in flight); then,
   if fewer batches in flight are possible, chosen cuts are dropped again, the last chosen
   first, whenever that lowers the batches in flight without lengthening the iteration.

Stages only decide which dependencies share an iteration, so the oracle reasons about the CPU
iteration only; the search scores the result with the simulator (and device streams).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from torchrec_swp.autosched.estimate import iteration_time
from torchrec_swp.autosched.layout import Layout, layout_of, to_plan
from torchrec_swp.autosched.problem import Problem
from torchrec_swp.plan import PipelinePlan, PlanError

_EPS = 1e-12


def _stages(heights: tuple[int, ...]) -> tuple[int, ...]:
    top = max(heights, default=0)
    return tuple(top - h for h in heights)


def assign_stages(problem: Problem, layout: Layout) -> tuple[int, ...] | None:
    """Stages for ``layout`` by the rules above, or None when rules 1-2 cannot both hold."""
    heights = _assign_heights(problem, layout)
    return None if heights is None else _stages(heights)


def _assign_heights(problem: Problem, layout: Layout) -> tuple[int, ...] | None:
    pos = layout.position()
    deps = problem.deps
    forced = [k for k, d in enumerate(deps) if pos[d.producer] > pos[d.consumer]]
    wanted = [
        k
        for k, d in enumerate(deps)
        if pos[d.producer] < pos[d.consumer] and layout.threads[d.producer] != layout.threads[d.consumer]
    ]
    floor = _solve(problem, set(forced))
    if floor is None:
        return None
    chosen = list(wanted)
    best = _solve(problem, {*forced, *wanted})
    if best is None:
        chosen, best = [], floor
        time = iteration_time(problem, layout, _stages(best))
        remaining = list(wanted)
        while remaining:
            trials = []
            for k in remaining:
                trial = _solve(problem, {*forced, *chosen, k})
                if trial is not None:
                    trials.append((iteration_time(problem, layout, _stages(trial)), max(trial), k, trial))
            if not trials:
                break
            t, _, k, trial = min(trials)
            if t > time + _EPS:
                break
            chosen.append(k)
            remaining.remove(k)
            best, time = trial, t
    if max(floor) < max(best):
        time = iteration_time(problem, layout, _stages(best))
        for k in reversed(list(chosen)):
            rest = [c for c in chosen if c != k]
            trial = _solve(problem, {*forced, *rest})
            if (
                trial is not None
                and max(trial) < max(best)
                and iteration_time(problem, layout, _stages(trial)) <= time + _EPS
            ):
                chosen, best = rest, trial
    return best


def _solve(problem: Problem, cuts: set[int]) -> tuple[int, ...] | None:
    """Smallest heights (stages below the top) with ``lead >= 1`` on the deps indexed by ``cuts`` and ``lead >= 0``
    on the others (rule 1 included), by longest-path relaxation; None if infeasible."""
    n = len(problem.tasks)
    limit = problem.max_in_flight - 1
    src = problem.source_index
    on_source = problem.on_source
    edges = [(d.consumer, d.producer, (1 if k in cuts else 0) - d.distance) for k, d in enumerate(problem.deps)]
    heights = [0] * n
    for _ in range(limit + 2):
        for _ in range(n + 1):
            changed = False
            for c, p, w in edges:
                if heights[c] + w > heights[p]:
                    heights[p] = heights[c] + w
                    changed = True
            if not changed:
                break
        else:
            return None  # a cycle that keeps growing: some cut cannot hold
        if max(heights) > limit:
            return None
        top = max(v if on_source[i] else v + 1 for i, v in enumerate(heights))
        if heights[src] >= top:
            break
        heights[src] = top
    else:
        return None
    if any(heights[a] for a in problem.anchor_index):
        return None
    return tuple(heights)


def auto_assign_stages(
    plan: PipelinePlan,
    durations: Mapping[str, float],
    *,
    max_in_flight: int = 5,
    anchor_names: Iterable[str] = (),
) -> PipelinePlan:
    """``plan`` with every stage (and ``pipeline_depth``) chosen by the oracle, keeping its
    threads, streams and fire order. ``durations`` maps every task to its CPU time.

    Raises PlanError when no stages satisfy the rules (e.g. an anchor would have to run ahead,
    or more than ``max_in_flight`` batches would be in flight).
    """
    problem = Problem(plan, durations, max_in_flight=max_in_flight, anchor_names=frozenset(anchor_names))
    layout = layout_of(problem, plan)
    stages = assign_stages(problem, layout)
    if stages is None:
        raise PlanError(
            f"no stages for plan {plan.name} with its fire order: anchors {sorted(problem.anchors)} "
            f"at the highest stage and at most {max_in_flight} batches in flight cannot satisfy every dependency",
            culprit=plan.name,
        )
    return to_plan(problem, layout, stages)
