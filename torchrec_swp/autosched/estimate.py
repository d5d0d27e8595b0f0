"""The steady-state iteration time of a layout with stages, computed directly.

The engine separates internal iterations by a barrier, so in steady state (every stage active,
CPU only) an iteration takes the makespan of one instance of every task where:

* each thread runs its tasks in fire order, each as soon as it may;
* a dependency whose producer instance runs in the same iteration (``lead == 0``, see
  ``lead``) makes the consumer start after the producer ends - on another thread through a
  wait; a dependency on an earlier iteration costs nothing (the barrier already ordered it);
* the tasks of a comm group spread over several threads take tickets in fire order: each
  starts after the previous one of its group ends;
* with ``on_exhausted="stop"``, whatever fires after the source waits for it.

Fire order is a topological order of all of these, so one pass computes the makespan. This is
exactly the simulated steady period of a CPU-only plan (``score.predict``); the search uses it
to rank many candidates and simulates only the best.
"""

from __future__ import annotations

from torchrec_swp.autosched.layout import Layout
from torchrec_swp.autosched.problem import IndexedDep, Problem


def lead(dep: IndexedDep, stages: tuple[int, ...]) -> int:
    """Iterations from the producer instance to the consumer instance of ``dep``."""
    return stages[dep.consumer] - stages[dep.producer] + dep.distance


def iteration_time(problem: Problem, layout: Layout, stages: tuple[int, ...]) -> float:
    """Makespan of one steady iteration (rules above), in the problem's duration unit."""
    return max(iteration_ends(problem, layout, stages), default=0.0)


def iteration_ends(problem: Problem, layout: Layout, stages: tuple[int, ...]) -> list[float]:
    """When each task ends in one steady iteration started at time 0 (rules above)."""
    d = problem.cpu
    end = [0.0] * len(d)
    thread_free: dict[str, float] = {}
    comm_free: dict[str, float] = {}
    ticketed = _ticketed_groups(problem, layout)
    src = problem.source_index
    stops = problem.plan.on_exhausted == "stop"
    seen_source = False
    for i in layout.order:
        start = thread_free.get(layout.threads[i], 0.0)
        for dep in problem.producers[i]:
            if lead(dep, stages) == 0 and end[dep.producer] > start:
                start = end[dep.producer]
        group = problem.comm[i]
        if group in ticketed:
            start = max(start, comm_free.get(group, 0.0))
        if stops and seen_source and end[src] > start:
            start = end[src]
        end[i] = start + d[i]
        thread_free[layout.threads[i]] = end[i]
        if group in ticketed:
            comm_free[group] = end[i]
        seen_source = seen_source or i == src
    return end


def cross_thread_waits(problem: Problem, layout: Layout, stages: tuple[int, ...]) -> int:
    """Same-iteration dependencies between tasks on different threads (each costs a wait)."""
    return sum(
        1
        for dep in problem.deps
        if lead(dep, stages) == 0 and layout.threads[dep.producer] != layout.threads[dep.consumer]
    )


def _ticketed_groups(problem: Problem, layout: Layout) -> set[str]:
    threads: dict[str, set[str]] = {}
    for i, group in enumerate(problem.comm):
        if group is not None:
            threads.setdefault(group, set()).add(layout.threads[i])
    return {g for g, ts in threads.items() if len(ts) > 1}
