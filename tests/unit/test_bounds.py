"""Lower bounds: hand-computed values on a small plan, which bound binds, and that no bound ever
exceeds a simulated iteration (plans, random layouts, the search's plans)."""

from __future__ import annotations

import random

import pytest

from harness.workloads import random_workload, torchrec_workloads
from torchrec_swp.autosched import Problem, assign_stages, beam_search, plan_bounds, search_bounds, to_plan
from torchrec_swp.autosched.layout import Layout
from torchrec_swp.autosched.score import steady_period
from torchrec_swp.catalog.torchrec import default_plans
from torchrec_swp.plan import PipelinePlan, PipelineTask, TaskSchedule
from torchrec_swp.sim import simulate

S = TaskSchedule


def small_plan() -> PipelinePlan:
    """Load -> Prep -> Forward -> Backward -> OptimizerStep; Forward after OptimizerStep @1,
    Prep after Backward @2. Load and Prep on thread io (stage 0), the rest on default (stage 1);
    Prep and Forward are collectives."""
    return PipelinePlan(
        schedule={
            "Load": S(0, "memcpy", thread_group="io"),
            "Prep": S(0, thread_group="io", comm_group="world"),
            "Forward": S(1, comm_group="world"),
            "Backward": S(1),
            "OptimizerStep": S(1),
        },
        intra_iter_deps=[("Prep", "Load"), ("Forward", "Prep"), ("Backward", "Forward"), ("OptimizerStep", "Backward")],
        inter_iter_deps=[("Forward", "OptimizerStep", 1), ("Prep", "Backward", 2)],
        tasks=[
            PipelineTask("Load", writes=("batch",)),
            *(PipelineTask(t, anchor=True) for t in ("Forward", "Backward", "OptimizerStep")),
        ],
        source="Load",
        name="small",
    )


DURATIONS = {"Load": 1.0, "Prep": 6.0, "Forward": 3.0, "Backward": 4.0, "OptimizerStep": 2.0}


def test_plan_bounds_by_hand() -> None:
    report = plan_bounds(small_plan(), DURATIONS)
    values = {(b.kind, b.what.split(" (")[0]): b.value for b in report.bounds}
    assert values[("thread", "io")] == 7.0
    assert values[("thread", "default")] == 9.0
    assert values[("comm", "world")] == 9.0
    # cycles: Forward -> Backward -> OptimizerStep -> Forward (9 / 1) beats
    # Prep -> Forward -> Backward -> Prep (13 / 2 = 6.5)
    assert values[("cycle", "Forward -> Backward -> OptimizerStep -> Forward")] == 9.0
    # one batch: 1 + 6 + 3 + 4 + 2 = 16 over 2 batches in flight
    assert values[("latency", "one batch's critical path / 2 in flight")] == 8.0
    # same iteration: Load -> Prep on io, Forward -> Backward -> OptimizerStep on default
    iteration = next(b for b in report.bounds if b.kind == "iteration")
    assert iteration.value == 9.0 and "Forward -> Backward -> OptimizerStep" in iteration.what
    assert report.value == 9.0
    simulated = simulate(small_plan(), DURATIONS, 6).steady_iteration_time
    assert simulated is not None and simulated >= report.value
    text = report.format()
    assert text.splitlines()[0].startswith("lower bound 9") and "binds" in text.splitlines()[0]
    assert sum(line.startswith(" *") for line in text.splitlines()) == 1


def test_cycle_bound_divides_by_the_distance() -> None:
    durations = {**DURATIONS, "Prep": 20.0}  # Prep -> Forward -> Backward -> Prep: 27 / 2
    report = plan_bounds(small_plan(), durations)
    assert report.binding.kind == "comm" and report.value == 23.0  # Prep + Forward serialize
    cycle = next(b for b in report.bounds if b.kind == "cycle")
    assert cycle.value == pytest.approx(13.5) and "(distance 2)" in cycle.what


def test_device_streams_bound() -> None:
    report = plan_bounds(small_plan(), DURATIONS, {"Load": 12.0, "Forward": 5.0, "Backward": 5.0})
    assert report.binding.kind == "stream" and report.binding.what == "memcpy" and report.value == 12.0
    streams = {b.what: b.value for b in report.bounds if b.kind == "stream"}
    assert streams == {"memcpy": 12.0, "default": 10.0}
    # latency counts the CPU calls only: a batch's device work may finish periods later
    latency = next(b for b in report.bounds if b.kind == "latency")
    assert latency.value == pytest.approx((1 + 6 + 3 + 4 + 2) / 2)



def test_a_batchs_device_work_may_outlast_its_iterations() -> None:
    # one stage: Load's copy (10 on memcpy) outlasts its iteration; Fwd's device work waits for it,
    # while the CPU goes on. The period is the memcpy stream's load, below Load + copy + Fwd (12).
    plan = PipelinePlan(
        schedule={"Load": S(0, "memcpy"), "Fwd": S(0)},
        tasks=[PipelineTask("Load", writes=("x",)), PipelineTask("Fwd", reads=("x",))],
        source="Load",
        name="copy_bound",
    )
    durations, device = {"Load": 1.0, "Fwd": 1.0}, {"Load": 10.0, "Fwd": 0.5}
    period = steady_period(simulate(plan, durations, 20, device_durations=device))
    assert period == pytest.approx(10.0)
    report = plan_bounds(plan, durations, device)
    assert report.binding.kind == "stream" and report.value == 10.0
    latency = next(b for b in report.bounds if b.kind == "latency")
    assert latency.value == 2.0  # the CPU calls only: Load then Fwd


def test_search_bounds_by_hand() -> None:
    problem = Problem(small_plan(), DURATIONS, max_threads=4, max_in_flight=5)
    report = search_bounds(problem)
    values = {b.kind + ":" + b.what: b.value for b in report.bounds}
    assert values["thread:total CPU time / 4 threads"] == 4.0
    assert values["thread:longest task Prep"] == 6.0
    assert values["iteration:anchor chain Forward -> Backward -> OptimizerStep"] == 9.0
    assert values["latency:one batch's critical path / 5 in flight"] == pytest.approx(16 / 5)
    assert report.value == 9.0


@pytest.mark.parametrize("seed", [1, 4, 7])
def test_no_bound_exceeds_a_simulated_iteration_on_random_layouts(seed: int) -> None:
    rng = random.Random(seed)
    checked = 0
    # Each distinct catalog plan once, PT2's compile step left out (it runs once, not in the
    # steady state), under three seeds' draws of durations and layouts.
    catalog = dict.fromkeys(p for entry in default_plans().values() for p in getattr(entry, "plans", (entry,)))
    for plan in [*(p for p in catalog if p.name != "TrainPipelinePT2_compile"), small_plan()]:
        durations = {t: rng.uniform(0.2, 5.0) for t in plan.fire_order}
        device = {t: rng.uniform(0.0, 5.0) for t in plan.fire_order if rng.random() < 0.5}
        problem = Problem(plan, durations)
        space = search_bounds(problem).value
        for _ in range(60):
            order = list(range(len(problem.tasks)))
            rng.shuffle(order)
            layout = Layout(
                tuple(rng.choice(problem.thread_pool) for _ in order),
                tuple(plan.task(t).stream for t in problem.tasks),
                tuple(order),
            )
            stages = assign_stages(problem, layout)
            if stages is None:
                continue
            candidate = to_plan(problem, layout, stages)
            simulated = simulate(candidate, durations, candidate.max_stage + 3).steady_iteration_time
            assert simulated is not None
            assert plan_bounds(candidate, durations).value <= simulated + 1e-9, candidate.to_text()
            assert space <= simulated + 1e-9
            with_device = steady_period(
                simulate(candidate, durations, candidate.max_stage + 10, device_durations=device)
            )
            assert with_device is not None
            assert plan_bounds(candidate, durations, device).value <= with_device + 1e-9
            checked += 1
    assert checked > 100


def test_search_results_respect_the_bounds() -> None:
    for workload in [torchrec_workloads()[0], random_workload(3, 9)]:
        result = beam_search(workload.problem(), beam_width=4, max_passes=2)
        assert result.bounds.value <= result.predicted + 1e-9
        assert result.plan_bounds.value <= result.predicted + 1e-9
        assert 0 < result.efficiency <= 1.0 + 1e-9
