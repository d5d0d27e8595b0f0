"""The overlap search (``autosched.overlap``): threads, lookahead, loads and the input dist's comm
group, scored by the simulator's engine model; every found plan keeps the starting plan's
numerics (tasks, stages, fire order, the highest stage's threads)."""

from __future__ import annotations

import re

import pytest

from torchrec_swp.autosched.overlap import Machine, Space, apply_candidate, search_overlap
from torchrec_swp.catalog.torchrec import semi_sync_phases, sparse_dist_plan
from torchrec_swp.catalog.transforms import INPUT_DIST_TASKS, with_parallel_loads
from torchrec_swp.plan import MAIN_THREAD, PhasedPlan, PipelinePlan, PlanError
from torchrec_swp.sim import Calibration, Rank, RankCosts, simulate_ranks

MS = 1e-3


def start_plan() -> PipelinePlan:
    """SparseDist with its source split (Fetch draws, H2D copies), all on the calling thread."""
    return with_parallel_loads(sparse_dist_plan(), 1, lookahead=0, thread=MAIN_THREAD)  # type: ignore[return-value]


def costs(
    plan: PipelinePlan, *, fetch_off: float, fetch_cpu: float = 0.05 * MS, h2d: float = 0.2 * MS
) -> dict[str, tuple[float, float]]:
    """(cpu, off) per task: 1 ms of CPU for most tasks, the loader's wait off the CPU."""
    out = {t: (1 * MS, 0.0) for t in plan.fire_order}
    out["Fetch"] = (fetch_cpu, fetch_off)
    out["H2D"] = (h2d, 0.0)
    return out


def calibration(plan: PipelinePlan, parts: dict[str, tuple[float, float]], ranks: int = 1) -> Calibration:
    steady = {t: v for t, v in parts.items() if plan.task(t).when.in_steady_state}
    once = {t: v[0] for t, v in parts.items() if not plan.task(t).when.in_steady_state}
    rank = RankCosts(plan=plan, iterations=(0,), samples=(steady,), once=once, overhead=0.1 * MS)
    return Calibration(tuple(rank for _ in range(ranks)), 1, 2)


SPACE = Space(loads=(1, 2, 3), split_draws=True, own_group=INPUT_DIST_TASKS)


def check_numerics_kept(start: PipelinePlan, found: PipelinePlan) -> None:
    assert found.fire_order == start.fire_order and found.tasks == start.tasks
    for t in start.fire_order:
        a, b = start.task(t), found.task(t)
        assert (a.stage, a.stream, a.when) == (b.stage, b.stream, b.when)
        if a.stage == start.max_stage or start.tasks[t].anchor or not a.when.in_steady_state:
            assert b.thread_group == a.thread_group, t


def test_where_the_loader_binds_parallel_loads_and_lookahead_win() -> None:
    plan = start_plan()
    cal = calibration(plan, costs(plan, fetch_off=20 * MS))
    result = search_overlap(plan, cal, Machine(cores=2, machines=(0,)), SPACE)
    found = result.plan
    check_numerics_kept(plan, found)
    assert found.loads == 3 and found.lookahead >= 2
    assert found.task("Fetch").thread_group == "load"
    # the prediction is the simulator's for that plan with the calibrated means
    again = simulate_ranks(cal.simulation_ranks("mean", plans=[found], split_draws=True), 40, cores=2).step_period
    assert result.predicted == pytest.approx(again, rel=0.02)
    assert result.predicted < result.baseline / 2
    text = result.format()
    assert "the starting plan is bound by the calling thread, rank 0 (" in text  # not "by thread the calling thread"
    assert "the calling thread, rank 0: " in text  # the binding bound's change, named alike
    assert "3 loads" in text and "now bound by" in text


def test_where_compute_binds_the_plan_stays() -> None:
    plan = start_plan()
    cal = calibration(plan, costs(plan, fetch_off=0.0), ranks=2)
    result = search_overlap(plan, cal, Machine(cores=2, machines=(0, 0)), SPACE)
    assert result.plan == plan
    assert "no change is predicted to do better" in result.format()


def test_the_gil_decides_whether_a_cpu_heavy_copy_moves() -> None:
    # H2D costs 6 ms of CPU: on 2 cores it overlaps the rest on a thread of its own, unless the
    # process's GIL is held all the time
    plan = start_plan()
    cal = calibration(plan, costs(plan, fetch_off=0.0, h2d=6 * MS))
    free = search_overlap(plan, cal, Machine(cores=2, machines=(0,)), SPACE)
    held = search_overlap(plan, cal, Machine(cores=2, machines=(0,), gil=1.0), SPACE)
    assert free.plan.task("H2D").thread_group != MAIN_THREAD and free.speedup > 1.3
    assert held.plan == plan


BOUND_NAMES = {
    "thread": r"(the calling thread|thread \S+( \(\d+ loads\))?), rank \d+",
    "comm": r"comm group \S+, rank \d+",
    "gil": r"rank \d+'s GIL",
    "cores": r"the \d+ cores of machine \d+",
}


def test_every_bound_is_named_by_a_noun_phrase_that_reads_after_bound_by() -> None:
    # why() prints "bound by <what>": each resource's name must say what it is by itself, once
    # ("the calling thread", not "thread the calling thread"; "comm group g", not "comm group g"
    # from a bare "group g" after the kind)
    plan = start_plan()
    cal = calibration(plan, costs(plan, fetch_off=20 * MS, h2d=6 * MS), ranks=2)
    result = search_overlap(plan, cal, Machine(cores=2, machines=(0, 0), gil=0.5), SPACE)
    bounds = {b for scored in (result.start, result.best) for b in scored.bounds.bounds}
    assert {b.kind for b in bounds} == set(BOUND_NAMES)  # every kind this search makes is seen
    for b in bounds:
        assert re.fullmatch(BOUND_NAMES[b.kind], b.what), b
    why = result.why()
    assert why[0].startswith(f"the starting plan is bound by {result.start.bounds.binding.what} (")
    assert any(line.startswith(f"now bound by {result.best.bounds.binding.what} (") for line in why)
    assert result.why(start="the chosen plan")[0].startswith("the chosen plan is bound by ")


def test_a_memory_cap_limits_the_batches_in_flight() -> None:
    plan = start_plan()
    cal = calibration(plan, costs(plan, fetch_off=20 * MS))
    capped = Space(loads=(1, 2, 3), split_draws=True, batch_bytes=2**20, memory_cap_bytes=4 * 2**20)
    found = search_overlap(plan, cal, Machine(cores=2, machines=(0,)), capped).best
    assert found.in_flight <= 4 and found.memory <= 4 * 2**20
    with pytest.raises(PlanError, match="does not fit the search's limits .*memory cap 2.0 MiB"):
        search_overlap(plan, cal, Machine(cores=2, machines=(0,)), Space(batch_bytes=2**20, memory_cap_bytes=2 * 2**20))


def test_a_profile_of_another_plan_is_refused() -> None:
    plan = start_plan()
    other = sparse_dist_plan()
    cal = calibration(other, {t: (1 * MS, 0.0) for t in other.fire_order})
    with pytest.raises(PlanError, match="lacks task Fetch"):
        search_overlap(plan, cal, Machine(cores=2, machines=(0,)), SPACE)


def test_the_found_plan_edits_every_phase() -> None:
    phased = semi_sync_phases(start_batch=5)
    assert isinstance(phased, PhasedPlan)
    steady = phased.plans[-1]
    cal = calibration(steady, {t: (1 * MS, 10 * MS if t == steady.source else 0.0) for t in steady.fire_order})
    found = search_overlap(phased, cal, Machine(cores=2, machines=(0,)), Space()).plan
    edited = apply_candidate(phased, found)
    assert isinstance(edited, PhasedPlan)
    for p in edited.plans:
        assert p.lookahead == found.lookahead
        assert p.task(steady.source).thread_group == found.task(steady.source).thread_group  # type: ignore[arg-type]


def test_bad_space() -> None:
    with pytest.raises(ValueError, match="loads choices must be ints >= 1"):
        Space(loads=(0,))
    with pytest.raises(ValueError, match="lookahead choices"):
        Space(lookahead=(-1,))
    with pytest.raises(ValueError, match="memory_cap_bytes must be > 0"):
        Space(memory_cap_bytes=0)
    plan = start_plan()
    cal = calibration(plan, costs(plan, fetch_off=0.0))
    with pytest.raises(ValueError, match="2 machines given for 1 ranks"):
        search_overlap(plan, cal, Machine(cores=2, machines=(0, 0)), SPACE)


def test_rank_costs_feed_the_same_simulator() -> None:
    plan = start_plan()
    cal = calibration(plan, costs(plan, fetch_off=3 * MS), ranks=2)
    ranks = cal.simulation_ranks("mean", machines=(0, 0))
    assert all(isinstance(r, Rank) and r.machine == 0 for r in ranks)
