"""plans.with_parallel_loads: the TorchRec plans' source split into Fetch (k loads on lanes) and H2D."""

from __future__ import annotations

import pytest

from torchrec_swp.catalog.torchrec import FETCH, semi_sync_phases, sparse_dist_plan, with_parallel_loads
from torchrec_swp.compile import CompiledPlan, format_program
from torchrec_swp.plan import PhasedPlan, PipelinePlan, PipelineTask, TaskSchedule
from torchrec_swp.plan.text import plan_to_text


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
    with pytest.raises(ValueError, match="plan toy: .* this plan's is Load"):
        with_parallel_loads(toy)
