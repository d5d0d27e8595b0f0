"""Gradient accumulation as phases of a plan: the phases do what upstream's wrapper does to each call.

Upstream's ``_GAOptimizerWrapper`` and ``GradientAccumulationWrapper._should_sync_grad`` are run
here call by call, with ZeroGrad and OptimizerStep in each plan's fire order; the phase
``accumulation_phases`` gives that call must hold ZeroGrad exactly where upstream's zero_grad
acted, OptimizerStep where its step acted, and say ``_nosync`` where it skips the all-reduce.
"""

from __future__ import annotations

import pytest
import torch
from torchrec.distributed.train_pipeline.gradient_accumulation import (
    GradientAccumulationConfig,
    GradientAccumulationWrapper,
    _GAOptimizerWrapper,
)

from torchrec_swp.catalog import torchrec as catalog
from torchrec_swp.catalog.accumulation import accumulation_calls, accumulation_phases
from torchrec_swp.plan import PhasedPlan, PlanError

PLANS = {
    "zero first (SparseDist)": catalog.sparse_dist_plan(),
    "zero first (Base)": catalog.train_pipeline_base_plan(),
    "zero after the step (SemiSync)": catalog.semi_sync_plan(),
    "per task threads": catalog.sparse_dist_plan().with_thread_map("per_task"),
}
WINDOWS = [(1, 1), (2, 1), (3, 1), (4, 2), (2, 5), (3, 7)]
CALLS = 40


class _Recorder:
    """An optimizer that records which of its methods acted."""

    def __init__(self) -> None:
        self.acted: list[str] = []

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.acted.append("zero")

    def step(self) -> None:
        self.acted.append("step")


def _upstream(order: list[str], k: int, w: int) -> list[tuple[bool, bool, bool]]:
    """(zero acted, step acted, synced) of calls 0 .. CALLS-1 under upstream's wrapper."""
    config = GradientAccumulationConfig(is_enabled=True, num_steps=k, num_warmup_steps=w)
    recorder = _Recorder()
    intercepted = _GAOptimizerWrapper(recorder, config)  # type: ignore[arg-type]
    wrapper = GradientAccumulationWrapper(object(), recorder, torch.nn.Linear(1, 1), config)  # type: ignore[arg-type]
    out = []
    for n in range(CALLS):
        wrapper.set_step(n)
        recorder.acted.clear()
        for task in order:
            intercepted.zero_grad() if task == "ZeroGrad" else intercepted.step()
        intercepted.advance_step()
        out.append(("zero" in recorder.acted, "step" in recorder.acted, wrapper._should_sync_grad()))
    return out


@pytest.mark.parametrize("name", list(PLANS))
@pytest.mark.parametrize("k, w", WINDOWS)
def test_each_call_runs_the_tasks_upstreams_wrapper_lets_act(name: str, k: int, w: int) -> None:
    plan = PLANS[name]
    order = [t for t in plan.fire_order if t in ("ZeroGrad", "OptimizerStep")]
    expected = _upstream(order, k, w)
    assert [(c.zero, c.step, c.sync) for c in accumulation_calls(plan, k, w, CALLS)] == expected
    phased = accumulation_phases(plan, k, w)
    assert phased.clock == "trained" and PhasedPlan.from_text(phased.to_text()) == phased
    for n, (zero, step, sync) in enumerate(expected):
        chosen = phased.plan_for(n)
        runs = tuple(chosen.task(t).schedule.when.value != "never" for t in ("ZeroGrad", "OptimizerStep"))
        assert runs == (zero, step), (n, chosen.name)
        assert chosen.name.endswith("_nosync") == (not sync), (n, chosen.name)


def test_a_window_of_four_repeats_from_its_second_window() -> None:
    phased = accumulation_phases(catalog.sparse_dist_plan(), 4)
    assert phased.name == "TrainPipelineSparseDist_accumulate4" and phased.cycle == (4, 4)
    assert [(s, p.name.removeprefix("TrainPipelineSparseDist_")) for s, p in phased.phases] == [
        (0, "zero"), (1, "accumulate_nosync"), (3, "step"), (4, "zero_nosync"), (5, "accumulate_nosync"), (7, "step"),
    ]  # fmt: skip
    text = phased.format_schedule(3)
    assert "phase 5 (batches 7 to 7, then every 4 batches trained since the pipeline was built or reset)" in text


def test_a_task_that_does_nothing_keeps_its_place() -> None:
    # Forward(i) waits for OptimizerStep(i-1) also where that step does nothing: it still waits
    # for Backward(i-1), on whatever thread each runs
    phased = accumulation_phases(catalog.sparse_dist_plan().with_thread_map("per_task"), 3)
    accumulate = phased.plan_for(1)
    assert accumulate.task("OptimizerStep").schedule.when.value == "never"
    assert accumulate.deps == catalog.sparse_dist_plan().with_thread_map("per_task").deps
    assert "OptimizerStep" in accumulate.format_schedule(3) and "never" in accumulate.format_schedule(3)


@pytest.mark.parametrize(
    "call, message",
    [
        (
            lambda: accumulation_phases(catalog.eval_sparse_dist_plan(), 2),
            "has no ZeroGrad task: nothing to accumulate",
        ),
        (lambda: accumulation_phases(catalog.sparse_dist_plan(), 0), "num_steps must be an int >= 1, got 0"),
        (lambda: accumulation_phases(catalog.sparse_dist_plan(), 2, True), "num_warmup_steps must be an int >= 1"),
        (
            lambda: accumulation_phases(catalog.sparse_dist_plan().with_schedule("ZeroGrad", when="first"), 2),
            "ZeroGrad runs when=first; gradient accumulation guards it itself",
        ),
        (lambda: PhasedPlan([(0, catalog.sparse_dist_plan())], cycle=(0, 0)), "period must be >= 1"),
        (lambda: PhasedPlan([(0, catalog.sparse_dist_plan())], cycle=(1, 2)), "first a phase's start"),
        (
            lambda: PhasedPlan([(0, catalog.sparse_dist_plan()), (3, catalog.sparse_dist_plan())], cycle=(0, 2)),
            "phase 3 starts past the cycle's end",
        ),
        (lambda: PhasedPlan.from_text("phases x\ncycle 1\n"), "a cycle line reads 'cycle FIRST PERIOD'"),
    ],
)
def test_bad_input_gets_one_line(call: object, message: str) -> None:
    with pytest.raises(PlanError) as info:
        call()  # type: ignore[operator]
    assert message in str(info.value) and "\n" not in str(info.value)
