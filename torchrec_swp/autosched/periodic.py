"""Exact mode for a pipeline's steady state (periodic schedules) with OR-Tools CP-SAT (imported
on first use): proven-optimal schedules.

(``solve_dag``, the one-shot DAG solver that pipeline parallelism uses too, lives below both, in
``torchrec_swp.solve.cpsat``.)

``solve_periodic``: a pipeline's steady state, in the engine's semantics (an iteration runs
one instance of every task, iterations are separated by a barrier; see
``estimate.iteration_time``). Per task: a start time, a thread (optional intervals, NoOverlap
per thread, at most ``max_threads``), a height (stages below the highest) in
``[0, max_in_flight - 1]`` (anchors 0, the source the largest, rule 1 of ``stages``). A
dependency either shares the iteration (``lead == 0``: the consumer starts after the producer
ends) or is cut (``lead >= 1``: free); each comm group is a NoOverlap resource (its tickets
serialize it across threads); with ``on_exhausted="stop"`` whatever fires after the source
starts after it ends. The objective is the iteration time, then the batches in flight. Fire
order is the order of start times. Streams keep the problem's plan (they only matter with a
device model, which exact mode does not have: it raises for a problem with device durations).

Durations are scaled to integers (the longest task becomes ``resolution`` units, every task at
least one unit): "optimal" is exact for the scaled durations. Both solvers honour
``time_limit_s`` and report whether the answer is proven optimal and how long it took.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

from torchrec_swp.autosched.estimate import iteration_ends
from torchrec_swp.autosched.layout import Layout, layout_of, named_threads, to_plan
from torchrec_swp.autosched.problem import Problem
from torchrec_swp.autosched.score import predict
from torchrec_swp.plan import PipelinePlan
from torchrec_swp.solve.cpsat import cp_model_module, new_solver


@dataclass(frozen=True)
class PeriodicSolution:
    """CP-SAT's best plan for a problem: its steady iteration time (simulated with the problem's
    durations), the solver's proven lower bound on it, whether it is proven optimal, the
    solver's status and wall time."""

    plan: PipelinePlan
    iteration: float
    lower_bound: float
    optimal: bool
    status: str
    seconds: float

    def format(self, scale: float = 1.0, unit: str = "") -> str:
        proof = "proven optimal" if self.optimal else f"not proven (bound {self.lower_bound * scale:.4g}{unit})"
        return (
            f"CP-SAT: iteration {self.iteration * scale:.4g}{unit}, {proof}, "
            f"{self.plan.pipeline_depth} batches in flight, {len(self.plan.thread_groups)} threads, "
            f"{self.seconds:.2f}s ({self.status})"
        )


def solve_periodic(
    problem: Problem,
    *,
    time_limit_s: float = 30.0,
    workers: int = 2,
    resolution: int = 10_000,
    hint: PipelinePlan | None = None,
) -> PeriodicSolution:
    """The optimal steady-state plan of ``problem`` (model in the module docstring).

    ``hint``: a plan of the problem (e.g. the beam search's) to start from. Raises ValueError for
    a problem with device durations, RuntimeError when no plan is found in time.
    """
    if problem.models_device:
        raise ValueError("exact mode models CPU threads and comm groups only; drop device_durations or use beam_search")
    began = time.perf_counter()
    cp_model = cp_model_module()
    n = len(problem.tasks)
    longest = max(problem.cpu) or 1.0
    scale = resolution / longest
    d = [max(1, round(c * scale)) for c in problem.cpu]
    horizon = sum(d)
    limit = problem.max_in_flight - 1
    threads = problem.max_threads
    model = cp_model.CpModel()

    start = [model.new_int_var(0, horizon - d[i], f"s_{t}") for i, t in enumerate(problem.tasks)]
    on = [[model.new_bool_var(f"x_{t}_{k}") for k in range(threads)] for t in problem.tasks]
    for i in range(n):
        model.add_exactly_one(on[i])
        for k in range(i + 1, threads):  # threads are interchangeable: task i uses one of the first i + 1
            model.add(on[i][k] == 0)
    for k in range(threads):
        model.add_no_overlap(
            [model.new_optional_fixed_size_interval_var(start[i], d[i], on[i][k], f"i_{i}_{k}") for i in range(n)]
        )
    groups: dict[str, list[int]] = {}
    for i, g in enumerate(problem.comm):
        if g is not None:
            groups.setdefault(g, []).append(i)
    for g, members in groups.items():
        model.add_no_overlap([model.new_fixed_size_interval_var(start[i], d[i], f"c_{g}_{i}") for i in members])

    height = [model.new_int_var(0, limit, f"h_{t}") for t in problem.tasks]  # stage = top - height
    top = model.new_int_var(0, limit, "A")
    src = problem.source_index
    model.add(height[src] == top)
    for i in range(n):
        if i in problem.anchor_index:
            model.add(height[i] == 0)
        model.add(height[i] <= top if problem.on_source[i] else height[i] <= top - 1)
    for dep in problem.deps:
        c, p = dep.consumer, dep.producer
        lead = height[p] - height[c] + dep.distance
        model.add(lead >= 0)
        shared = model.new_bool_var(f"same_{c}_{p}_{dep.distance}")
        model.add(lead >= 1).only_enforce_if(shared.Not())
        model.add(start[c] >= start[p] + d[p]).only_enforce_if(shared)
    if problem.plan.on_exhausted == "stop":
        for i in range(n):
            if i != src:
                after = model.new_bool_var(f"after_source_{i}")
                model.add(start[i] >= start[src] + d[src]).only_enforce_if(after)
                model.add(start[i] + 1 <= start[src]).only_enforce_if(after.Not())

    makespan = model.new_int_var(max(d), horizon, "iteration")
    for i in range(n):
        model.add(makespan >= start[i] + d[i])
    model.minimize(makespan * (limit + 1) + top)
    if hint is not None:
        _add_hint(model, problem, hint, start, on, height, d)

    solver = new_solver(time_limit_s, workers)
    status = solver.solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise RuntimeError(
            f"CP-SAT found no plan for {problem.plan.name} in {time_limit_s:g}s (status {solver.status_name(status)})"
        )
    starts = [solver.value(s) for s in start]
    pool = problem.thread_pool
    layout = Layout(
        threads=tuple(pool[next(k for k in range(threads) if solver.boolean_value(on[i][k]))] for i in range(n)),
        streams=layout_of(problem, problem.plan).streams,
        order=tuple(sorted(range(n), key=lambda i: (starts[i], starts[i] + d[i], i))),
    )
    heights = tuple(int(solver.value(v)) for v in height)
    stages = tuple(max(heights) - h for h in heights)
    plan = to_plan(problem, named_threads(problem, layout), stages)
    iteration = predict(problem, plan)
    bound_units = solver.best_objective_bound // (limit + 1)
    return PeriodicSolution(
        plan=plan,
        iteration=iteration,
        lower_bound=bound_units / scale,
        optimal=status == cp_model.OPTIMAL,
        status=solver.status_name(status),
        seconds=time.perf_counter() - began,
    )


def _add_hint(
    model: Any,
    problem: Problem,
    plan: PipelinePlan,
    start: list[Any],
    on: list[list[Any]],
    height: list[Any],
    d: list[int],
) -> None:
    """Hint the solver with ``plan``: its ASAP start times in scaled units (same estimate as the
    search), its threads renumbered in order of first task index, its stages."""
    layout = layout_of(problem, plan)
    stages = tuple(plan.task(t).stage for t in problem.tasks)
    number: dict[str, int] = {}
    for i in range(len(problem.tasks)):
        number.setdefault(layout.threads[i], len(number))
    if len(number) > len(on[0]):
        return
    scaled = dataclasses.replace(problem, durations=dict(zip(problem.tasks, map(float, d), strict=True)))
    ends = iteration_ends(scaled, layout, stages)
    for i in range(len(problem.tasks)):
        model.add_hint(start[i], int(ends[i] - d[i]))
        for k in range(len(on[i])):
            model.add_hint(on[i][k], number[layout.threads[i]] == k)
        model.add_hint(height[i], plan.max_stage - stages[i])
