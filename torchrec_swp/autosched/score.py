"""What a plan is worth: its simulated steady period, the figure the search predicts."""

from __future__ import annotations

from torchrec_swp.autosched.problem import Problem
from torchrec_swp.plan import PipelinePlan
from torchrec_swp.sim import SimResult, simulate


def steady_period(result: SimResult) -> float | None:
    """Time per steady iteration (None with fewer than two steady iterations): the larger of the
    CPU period and the overall period, each the slope from the first to the last steady
    iteration - of the CPU end (which the iteration barrier paces), and of the latest end of any
    CPU or device work so far.

    Without a device model every steady iteration takes the same time and this equals
    ``SimResult.steady_iteration_time``. With one, device work trails the CPU by an amount that
    settles only once the bottleneck stream's queue is full; single periods vary meanwhile and
    their median can fall below the bottleneck, the slope over the steady run does not.
    """
    steady = set(result.steady_iterations)
    spans = result.iterations
    at = [k for k, s in enumerate(spans) if s.iteration in steady]
    if len(at) < 2:
        return None
    first, last = at[0], at[-1]
    cpu = spans[last].cpu_end - spans[first].cpu_end
    overall = max(s.end for s in spans[: last + 1]) - max(s.end for s in spans[: first + 1])
    return max(cpu, overall) / (last - first)


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
