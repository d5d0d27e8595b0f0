"""Exact mode with CP-SAT against known answers: the interleaved 1F1B example of docs/autosched.md (CP-SAT
285, greedy list scheduling 320, still 285 with at most 8 live activations per device), and the
periodic pipeline model against the beam search, the bounds and the time limit."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("ortools")

from harness.workloads import random_workload, sleep_workload, torchrec_workloads
from torchrec_swp.autosched import (
    Dag,
    DagError,
    DagSchedule,
    DagTask,
    Memory,
    Problem,
    beam_search,
    check_constraints,
    interleaved_pipeline,
    list_schedule,
    search_bounds,
    solve_dag,
    solve_periodic,
)

# The example's greedy chart: the layers each device runs, in order (forward and backward alike).
SEED_GREEDY_ORDER = {
    "D0": "00004444000044400404444044400400",
    "D1": "11115555111515511515155555511511",
    "D2": "22226666626262226222666666622622",
    "D3": "33337777773737333333777777373733",
}


def layers(schedule: DagSchedule, resource: str) -> str:
    return "".join(name.split(".L")[1] for name in schedule.order(resource))


def test_greedy_list_scheduling_reproduces_seed_002_exactly() -> None:
    dag = interleaved_pipeline()
    assert len(dag.tasks) == 8 * 8 * 2
    greedy = list_schedule(dag)
    greedy.check()
    assert greedy.makespan == 320
    assert {r: layers(greedy, r) for r in dag.resources} == SEED_GREEDY_ORDER
    assert greedy.peak_memory() == {"D0": 12, "D1": 11, "D2": 8, "D3": 5}


def test_cpsat_makespan_is_285_and_proven() -> None:
    solution = solve_dag(interleaved_pipeline(), minimize_memory=False, time_limit_s=30)
    solution.schedule.check()
    assert solution.makespan == 285 and solution.makespan_optimal
    assert solution.memory_optimal is None
    print(f"makespan 285 proven in {solution.seconds:.2f}s")


def test_cpsat_still_reaches_285_with_at_most_8_live_activations_per_device() -> None:
    solution = solve_dag(interleaved_pipeline(), memory_limit=8, minimize_memory=False, time_limit_s=60)
    solution.schedule.check()
    assert solution.makespan == 285 and solution.makespan_optimal
    assert max(solution.schedule.peak_memory().values()) <= 8
    print(f"285 with <= 8 activations in {solution.seconds:.2f}s")


@pytest.mark.slow
def test_phase_two_lowers_the_peak_at_the_same_makespan() -> None:
    solution = solve_dag(interleaved_pipeline(), time_limit_s=8)
    assert solution.makespan == 285 and solution.makespan_optimal
    assert solution.peak_memory <= 8  # the example's memory-optimal schedule: 8, 8, 8, 5
    print(f"peak {solution.peak_memory} (proven minimal: {solution.memory_optimal}) in {solution.seconds:.2f}s")


def test_small_dag_and_bad_dags() -> None:
    dag = Dag(
        (DagTask("a", "r0", 2), DagTask("b", "r0", 3), DagTask("c", "r1", 4), DagTask("d", "r1", 1)),
        (("a", "c"), ("b", "d")),
        (Memory("a", "c"),),
    )
    solution = solve_dag(dag, time_limit_s=10)
    # r0: a [0,2] b [2,5]; r1: c [2,6] d [6,7] (b first would give 9)
    assert solution.makespan == 7 and solution.makespan_optimal
    assert solution.schedule.starts == {"a": 0, "b": 2, "c": 2, "d": 6}
    assert list_schedule(dag).makespan == 7
    with pytest.raises(DagError, match="cycle"):
        Dag((DagTask("a", "r", 1), DagTask("b", "r", 1)), (("a", "b"), ("b", "a")))
    with pytest.raises(DagError, match="'z'"):
        Dag((DagTask("a", "r", 1),), (("a", "z"),))
    with pytest.raises(DagError, match="declared twice"):
        Dag((DagTask("a", "r", 1), DagTask("a", "r", 1)))
    with pytest.raises(RuntimeError, match="memory limit 0"):
        solve_dag(dag, memory_limit=0, time_limit_s=5)


def test_periodic_optimum_is_proven_admissible_and_never_beaten_by_the_beam() -> None:
    for workload in [*torchrec_workloads()[:2], sleep_workload(), random_workload(5, 9)]:
        problem = workload.problem()
        exact = solve_periodic(problem, time_limit_s=30)
        assert exact.optimal, exact.format()
        assert check_constraints(exact.plan, problem) == []
        assert search_bounds(problem).value <= exact.iteration + 1e-9
        assert exact.lower_bound <= exact.iteration * (1 + 1e-3)
        beam = beam_search(problem, beam_width=4, max_passes=2)
        # optimal for durations rounded to 1/10000 of the longest task
        assert beam.predicted >= exact.iteration * (1 - 1e-3)
        print(f"{workload.name}: beam {beam.predicted:.4g} vs CP-SAT {exact.iteration:.4g} ({exact.seconds:.2f}s)")


def test_periodic_honours_the_time_limit_and_rejects_a_device_model() -> None:
    problem = random_workload(1, 16, max_threads=4, max_in_flight=4).problem()
    began = time.perf_counter()
    solution = solve_periodic(problem, time_limit_s=0.5)
    assert time.perf_counter() - began < 5.0
    assert solution.seconds < 5.0 and check_constraints(solution.plan, problem) == []
    assert solution.optimal == (solution.status == "OPTIMAL")
    workload = torchrec_workloads()[0]
    with pytest.raises(ValueError, match="device"):
        solve_periodic(Problem(workload.plan, workload.durations, device_durations={"Forward": 1.0}))


def test_hint_from_the_beam_is_accepted() -> None:
    problem = random_workload(2, 10).problem()
    beam = beam_search(problem, beam_width=3, max_passes=1)
    hinted = solve_periodic(problem, time_limit_s=30, hint=beam.plan)
    assert hinted.optimal and hinted.iteration <= beam.predicted + 1e-9
