"""plans.with_parallel_loads: the TorchRec plans' source split into Fetch (k loads on lanes) and H2D,
or, where it only draws (LoadBatch), moved to the lanes as it is; the loads hint of plan errors."""

from __future__ import annotations

import re

import pytest

from torchrec_swp.catalog.torchrec import (
    default_plans,
    pt2_phases,
    semi_sync_phases,
    sparse_dist_plan,
    train_pipeline_base_plan,
)
from torchrec_swp.catalog.transforms import FETCH, with_parallel_loads
from torchrec_swp.compile import CompiledPlan, format_program
from torchrec_swp.plan import PhasedPlan, PipelinePlan, PipelineTask, PlanError, TaskSchedule
from torchrec_swp.plan.text_write import plan_to_text


def test_the_source_becomes_fetch_on_lanes_and_h2d_copies_what_it_drew() -> None:
    base = sparse_dist_plan()
    plan = with_parallel_loads(base, 2)
    assert isinstance(plan, PipelinePlan)
    assert (plan.source, plan.loads, plan.lookahead) == (FETCH, 2, 2)
    assert plan.source_lanes() == ("load", "load.1")
    assert plan.fire_order.index(FETCH) == plan.fire_order.index("H2D") - 1
    assert "host" in plan.tasks["H2D"].reads and plan.tasks[FETCH].writes == ("host",)
    assert plan.task(FETCH).stage == plan.task("H2D").stage
    # nothing else moves: same tasks, stages, streams, threads, comm groups
    for name in base.fire_order:
        assert plan.schedule[name] == base.schedule[name]
    assert PipelinePlan.from_text(plan_to_text(plan)) == plan
    # the compiled program runs Fetch on both lanes, H2D where it was (after Fetch's batch)
    text = format_program(CompiledPlan(plan).steady)
    assert "run! Fetch x2" in text


def test_every_phase_is_split_and_the_lookahead_is_the_plans_choice() -> None:
    phased = with_parallel_loads(semi_sync_phases(start_batch=2), 3, lookahead=1)
    assert isinstance(phased, PhasedPlan)
    assert all((p.source, p.loads, p.lookahead) == (FETCH, 3, 1) for p in phased.plans)


def test_a_plan_whose_source_is_not_h2d_is_refused_naming_it() -> None:
    toy = PipelinePlan(
        schedule={"Load": TaskSchedule(0), "Train": TaskSchedule(1)},
        tasks=[PipelineTask("Load", writes=("x",)), PipelineTask("Train", reads=("x",))],
        source="Load",
        name="toy",
    )
    with pytest.raises(ValueError, match="plan toy: .* this plan's source is Load"):
        with_parallel_loads(toy)


@pytest.mark.parametrize("plan", [train_pipeline_base_plan(), *pt2_phases().plans], ids=lambda p: p.name)
def test_a_source_that_only_draws_moves_to_the_load_threads_as_it_is(plan: PipelinePlan) -> None:
    loaded = with_parallel_loads(plan, 3, lookahead=1, thread="loader")
    assert isinstance(loaded, PipelinePlan)
    assert (loaded.source, loaded.loads, loaded.lookahead) == ("LoadBatch", 3, 1)
    assert loaded.source_lanes() == ("loader", "loader.1", "loader.2")
    # nothing else changes: no Fetch, same tasks, fire order and schedules but the source's thread
    assert loaded.fire_order == plan.fire_order and loaded.tasks == plan.tasks
    assert {t: s for t, s in loaded.schedule.items() if t != "LoadBatch"} == {
        t: s for t, s in plan.schedule.items() if t != "LoadBatch"
    }
    assert loaded.schedule["LoadBatch"] == plan.schedule["LoadBatch"].replace(thread_group="loader")


def test_pt2s_phases_all_get_the_loads_and_a_split_plan_can_be_loaded_again() -> None:
    phased = with_parallel_loads(pt2_phases(), 2)
    assert isinstance(phased, PhasedPlan)
    assert [(p.source, p.loads, p.lookahead) for p in phased.plans] == [("LoadBatch", 2, 2)] * 3
    split = with_parallel_loads(sparse_dist_plan(), 2)
    again = with_parallel_loads(split, 4, lookahead=1)  # Fetch only draws: it just gets the loads
    assert isinstance(again, PipelinePlan)
    assert (again.loads, again.lookahead, again.fire_order) == (4, 1, split.fire_order)


def test_a_source_that_cannot_be_split_is_named_in_one_line() -> None:
    staged = default_plans()["StagedTrainPipeline"]
    with pytest.raises(ValueError) as info:
        with_parallel_loads(staged, 2)
    assert str(info.value) == (
        "plan StagedTrainPipeline: with_parallel_loads needs a source that only draws (Fetch, LoadBatch) or H2D, "
        "to split the draw off; this plan's source is data_copy"
    )


@pytest.mark.parametrize("bad, message", [(0, "loads must be an int >= 1, got 0"), (True, "got True")])
def test_bad_loads_are_refused_by_the_plan(bad: object, message: str) -> None:
    for plan in (sparse_dist_plan(), train_pipeline_base_plan()):
        with pytest.raises(PlanError, match=message):
            with_parallel_loads(plan, bad)  # type: ignore[arg-type]
    with pytest.raises(PlanError, match="lookahead must be an int >= 0, got -1"):
        with_parallel_loads(sparse_dist_plan(), 2, lookahead=-1)


HINT = re.compile(r"`(plan\.with_loads\([^`]*\))`")


@pytest.mark.parametrize("name", sorted(default_plans()))
def test_the_loads_hint_works_on_every_torchrec_plan(name: str) -> None:
    # plan.replace(loads=2) where the source shares the calling thread: the error's code builds
    # a plan that validates, with the source alone on a thread of its own (EvalPipelineSparseDist's
    # H2D already is, on its loader thread: no error)
    entry = default_plans()[name]
    for plan in getattr(entry, "plans", (entry,)):
        if plan.task(str(plan.source)).thread_group != "default":
            assert plan.replace(loads=2).loads == 2
            continue
        with pytest.raises(PlanError) as info:
            plan.replace(loads=2)
        (code,) = HINT.findall(str(info.value))
        fixed = eval(code, {"plan": plan})
        assert fixed.loads == 2 and fixed.task(str(plan.source)).thread_group == "load"


def test_a_load_records_its_event_on_its_own_lane_only() -> None:
    # Every lane walks the source's program; only the lane that drew batch b may record b's event
    # (as only it signals b): another lane's later record would replace it with one no CPU edge
    # orders before the consumer's stream wait.
    from tests.unit.engine_fixtures import Toy, drawing, run, toy_plan
    from torchrec_swp.engine import Engine, RecordingStreamPool

    plan = toy_plan().with_thread_map({"H2D": "load"}).with_loads(2, lookahead=2)
    pool = RecordingStreamPool()
    toy = Toy(14, jitter_s=0.002)
    engine = Engine(plan, drawing(toy), streams=pool)
    try:
        run(engine)
    finally:
        engine.close()
    records = [e for e in pool.log if e[:2] == ("record", "memcpy")]
    assert len(records) == 14
