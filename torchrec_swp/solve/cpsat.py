"""Exact DAG schedules with OR-Tools CP-SAT (imported on first use), shared by autosched and pp.

``solve_dag``: a one-shot DAG. Interval variables per task, NoOverlap per resource, the edges,
a Cumulative per resource for the memory uses (with ``memory_limit`` as capacity). Phase 1
minimizes the makespan; phase 2 (``minimize_memory``) keeps that makespan and minimizes the
largest peak memory of any resource. Durations are scaled to integers (the longest task becomes
``resolution`` units): "optimal" is exact for the scaled durations. ``time_limit_s`` bounds the
search; the answer says whether it is proven optimal and how long it took.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from torchrec_swp.solve.dag import Dag, DagSchedule


def cp_model_module() -> Any:
    try:
        from ortools.sat.python import cp_model
    except ImportError as e:
        raise ImportError("exact mode needs OR-Tools: pip install ortools") from e
    return cp_model


def new_solver(time_limit_s: float, workers: int) -> Any:
    cp_model = cp_model_module()
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(0.01, float(time_limit_s))
    solver.parameters.num_workers = workers
    return solver


# --------------------------------------------------------------------- one-shot DAG
@dataclass(frozen=True)
class DagSolution:
    """CP-SAT's schedule of a DAG: its makespan (``makespan_optimal`` if proven), its largest
    peak memory (``memory_optimal``: proven minimal at that makespan; None when phase 2 did not
    run), and the solver's wall time."""

    schedule: DagSchedule
    makespan: int
    makespan_optimal: bool
    peak_memory: int
    memory_optimal: bool | None
    seconds: float


def solve_dag(
    dag: Dag,
    *,
    memory_limit: int | None = None,
    minimize_memory: bool = True,
    time_limit_s: float = 30.0,
    workers: int = 2,
) -> DagSolution:
    """Phase 1 (makespan) gets up to ``time_limit_s``; phase 2 (memory) the time left.

    Raises RuntimeError when phase 1 finds no schedule in time (or the memory limit makes the
    DAG infeasible).
    """
    began = time.perf_counter()
    cp_model = cp_model_module()
    tasks = dag.task_map
    horizon = sum(t.duration for t in dag.tasks)

    def build() -> tuple[Any, dict[str, Any], Any, Any]:
        model = cp_model.CpModel()
        start = {t.name: model.new_int_var(0, horizon, f"s_{t.name}") for t in dag.tasks}
        interval = {
            t.name: model.new_fixed_size_interval_var(start[t.name], t.duration, f"i_{t.name}") for t in dag.tasks
        }
        for a, b in dag.edges:
            model.add(start[b] >= start[a] + tasks[a].duration)
        for r in dag.resources:
            model.add_no_overlap([interval[t.name] for t in dag.tasks if t.resource == r])
        makespan = model.new_int_var(0, horizon, "makespan")
        for t in dag.tasks:
            model.add(makespan >= start[t.name] + t.duration)
        peak = model.new_int_var(0, sum(m.amount for m in dag.memory), "peak")
        for r in dag.resources:
            uses = [m for m in dag.memory if tasks[m.start].resource == r]
            if not uses:
                continue
            held = []
            for m in uses:
                end = start[m.end] + tasks[m.end].duration
                size = model.new_int_var(0, horizon, f"held_{m.start}")
                model.add(size == end - start[m.start])
                held.append(model.new_interval_var(start[m.start], size, end, f"m_{m.start}"))
            model.add_cumulative(held, [m.amount for m in uses], peak)
        if memory_limit is not None:
            model.add(peak <= memory_limit)
        return model, start, makespan, peak

    model, start, makespan, peak = build()
    model.minimize(makespan)
    solver = new_solver(time_limit_s, workers)
    status = solver.solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise RuntimeError(
            f"CP-SAT found no schedule of the DAG in {time_limit_s:g}s (status {solver.status_name(status)}"
            + (f", memory limit {memory_limit}" if memory_limit is not None else "")
            + ")"
        )
    best = {n: solver.value(v) for n, v in start.items()}
    best_makespan = int(solver.value(makespan))
    makespan_optimal = status == cp_model.OPTIMAL
    memory_optimal: bool | None = None
    left = time_limit_s - (time.perf_counter() - began)
    if minimize_memory and dag.memory and left > 0:
        model, start, makespan, peak = build()
        model.add(makespan <= best_makespan)
        for n, v in start.items():
            model.add_hint(v, best[n])
        model.minimize(peak)
        solver = new_solver(left, workers)
        status = solver.solve(model)
        if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            best = {n: solver.value(v) for n, v in start.items()}
            memory_optimal = status == cp_model.OPTIMAL
    schedule = DagSchedule(dag, best)
    return DagSolution(
        schedule=schedule,
        makespan=schedule.makespan,
        makespan_optimal=makespan_optimal,
        peak_memory=max(schedule.peak_memory().values(), default=0),
        memory_optimal=memory_optimal,
        seconds=time.perf_counter() - began,
    )


# ---------------------------------------------------------------- periodic pipeline
