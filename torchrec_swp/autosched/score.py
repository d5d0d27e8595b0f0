"""What a plan is worth: its simulated steady period, the figure the search predicts."""

from __future__ import annotations

from torchrec_swp.autosched.problem import Problem
from torchrec_swp.plan import PipelinePlan
from torchrec_swp.sim import SimResult, simulate


def steady_period(result: SimResult) -> float | None:
    """Time per steady iteration of a simulated run (see ``SimResult.steady_iteration_time``);
    None with fewer than two steady iterations."""
    if len(result.steady_iterations) < 2:
        return None
    return result.steady_iteration_time


def predict(problem: Problem, plan: PipelinePlan) -> float:
    """The steady period of ``plan`` simulated with the problem's durations (and device model)."""
    result = simulate(
        plan,
        problem.durations,
        problem.simulation_batches(plan.pipeline_depth),
        device_durations=problem.device_durations,
    )
    period = steady_period(result)
    assert period is not None  # simulation_batches leaves steady iterations
    return period
