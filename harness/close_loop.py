"""Close the loop: profile a real run, search a plan, run it, compare prediction and measurement.

This module runs the engine (it imports torch through ``harness.sleep``); ``torchrec_swp.autosched``
does not. ``python -m harness.close_loop`` runs the demo
workload (``workloads.sleep_workload``) and prints the report.
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.sleep import SleepWorkload
from harness.workloads import Workload, sleep_workload
from torchrec_swp.autosched.beam import SearchResult, beam_search
from torchrec_swp.autosched.problem import Problem
from torchrec_swp.profiler import Profile


@dataclass(frozen=True)
class LoopReport:
    """The profile of the starting plan, the search, and the profile of the plan it proposed."""

    before: Profile
    search: SearchResult
    after: Profile

    @property
    def predicted(self) -> float:
        return self.search.predicted

    @property
    def measured(self) -> float:
        """Median measured iteration time of the proposed plan."""
        return self.after.iteration_s

    @property
    def error(self) -> float:
        """``(predicted - measured) / measured``."""
        return (self.predicted - self.measured) / self.measured

    def format(self) -> str:
        ms = 1e3
        return "\n".join(
            [
                (
                    f"measured before: {self.before.iteration_s * ms:.3f} ms per iteration "
                    f"(plan {self.before.plan.name}, {len(self.before.plan.thread_groups)} thread(s), "
                    f"depth {self.before.plan.pipeline_depth})"
                ),
                f"search: {self.search.format(ms, ' ms')}",
                (
                    f"measured after:  {self.measured * ms:.3f} ms per iteration; "
                    f"predicted {self.predicted * ms:.3f} ms, error {100 * self.error:+.1f}%; "
                    f"speed-up x{self.before.iteration_s / self.measured:.2f}"
                ),
            ]
        )


def close_loop(
    workload: Workload,
    *,
    num_batches: int = 40,
    warmup: int = 3,
    beam_width: int = 8,
    max_passes: int = 5,
) -> LoopReport:
    """Run ``workload.plan`` with sleeping tasks (``workload.durations`` seconds) under a
    TaskProfiler, search a plan from the measured medians, run that plan the same way."""
    tasks = SleepWorkload(workload.plan, workload.durations)
    before = tasks.profile(num_batches=num_batches, warmup=warmup)
    problem = Problem.from_profile(before, max_threads=workload.max_threads, max_in_flight=workload.max_in_flight)
    search = beam_search(problem, beam_width=beam_width, max_passes=max_passes)
    after = tasks.profile(search.plan, num_batches=num_batches, warmup=warmup)
    return LoopReport(before, search, after)


if __name__ == "__main__":
    report = close_loop(sleep_workload())
    print(report.before.format_table())
    print()
    print(report.after.format_table())
    print()
    print(report.format())
