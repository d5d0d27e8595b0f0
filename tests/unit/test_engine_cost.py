"""benchmarks/engine_cost.py: the plans it times are what its docstring says, and run."""

from __future__ import annotations

import pytest

from benchmarks.engine_cost import cost_plan, markdown, sync_counts, time_steps
from torchrec_swp.engine import Engine
from torchrec_swp.plan import MAIN_THREAD


@pytest.mark.parametrize("tasks", [10, 30, 100])
@pytest.mark.parametrize("threads", [1, 2, 4, 8])
def test_cost_plans_spread_their_stages_over_the_threads_asked_for(tasks: int, threads: int) -> None:
    plan = cost_plan(tasks, threads)
    assert len(plan.fire_order) == tasks and plan.max_stage == 2
    assert len(plan.thread_groups) == threads
    first = plan.task(plan.fire_order[0])
    assert first.thread_group == MAIN_THREAD and first.stage == 2  # the calling thread trains
    assert plan.task(plan.source).stage == 0
    counts = sync_counts(tasks, threads)
    assert (counts["waits"] == 0) == (threads == 1)
    assert counts["signals"] == counts["waits"]  # a chain: each hand-off one signal, one wait


@pytest.mark.parametrize("threads", [1, 4])
def test_a_cost_plan_trains_every_batch_in_order(threads: int) -> None:
    plan = cost_plan(10, threads)
    bindings = {t: (lambda b: b) if t == plan.source else (lambda b, **_: b) for t in plan.fire_order}
    engine = Engine(plan, bindings, timeout_s=10)
    try:
        assert [engine.step() for _ in range(20)] == list(range(20))
    finally:
        engine.close()
    assert time_steps(10, threads, steps=5, warmup=2) > 0


def test_the_report_shows_both_engines_when_given_a_baseline() -> None:
    side = {"best_us": 20.0, "median_us": 21.0, "per_task_us": 2.0, "runs_us": [20.0, 21.0]}
    rows = [{"tasks": 10, "threads": 2, "steps": 100, "waits": 3, "signals": 3, "ours": side, "baseline": side}]
    meta = {"date": "d", "load_before": "1", "load_after": "1", "repeats": 2, "baseline": "/tmp/x"}
    text = markdown({"meta": meta, "rows": rows})
    assert "| 10 | 2 | 3 / 3 | 20.0 (21.0) | 2.00 | - | 20.0 (21.0) | 2.00 | - |" in text
