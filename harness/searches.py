"""Beam search against CP-SAT's proven optimum on the same problems.

``python -m harness.searches`` prints the table for the TorchRec workloads (with
the default limits, and with 2 threads and 2 batches in flight: ``/2x2``) and six random ones
(``workloads``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass

from harness.workloads import Workload, random_workload, torchrec_workloads
from torchrec_swp.autosched.beam import beam_search
from torchrec_swp.autosched.periodic import solve_periodic


@dataclass(frozen=True, slots=True)
class Comparison:
    """One workload: the problem's own plan, the beam's plan and CP-SAT's plan, each simulated,
    with search times and the search lower bound."""

    workload: str
    tasks: int
    baseline: float
    beam: float
    beam_seconds: float
    exact: float
    exact_optimal: bool
    exact_seconds: float
    bound: float

    @property
    def gap(self) -> float:
        """How much longer the beam's iteration is than CP-SAT's (0.05 = 5 %)."""
        return self.beam / self.exact - 1.0


def compare(
    workloads: Iterable[Workload],
    *,
    beam_width: int = 8,
    funnel: int = 2,
    max_passes: int = 5,
    time_limit_s: float = 60.0,
) -> list[Comparison]:
    out = []
    for w in workloads:
        problem = w.problem()
        beam = beam_search(problem, beam_width=beam_width, funnel=funnel, max_passes=max_passes)
        exact = solve_periodic(problem, time_limit_s=time_limit_s)
        out.append(
            Comparison(
                w.name,
                len(problem.tasks),
                beam.baseline,
                beam.predicted,
                beam.seconds,
                exact.iteration,
                exact.optimal,
                exact.seconds,
                beam.bounds.value,
            )
        )
    return out


def format_comparisons(rows: list[Comparison]) -> str:
    width = max(len("workload"), *(len(r.workload) for r in rows))
    lines = [
        f"{'workload':<{width}}  tasks  problem's plan  beam     beam s  CP-SAT   optimal  CP-SAT s  gap %  bound",
    ]
    for r in rows:
        lines.append(
            f"{r.workload:<{width}}  {r.tasks:>5}  {r.baseline:>14.3f}  {r.beam:>7.3f}  {r.beam_seconds:>6.2f}  "
            f"{r.exact:>7.3f}  {'yes' if r.exact_optimal else 'no':>7}  {r.exact_seconds:>8.2f}  "
            f"{round(100 * r.gap, 1) + 0.0:>5.1f}  "
            f"{r.bound:.3f}"
        )
    mean_gap = sum(r.gap for r in rows) / len(rows)
    lines.append(
        f"mean gap {100 * mean_gap:.2f}%, worst {100 * max(r.gap for r in rows):.2f}%; "
        f"mean search time beam {sum(r.beam_seconds for r in rows) / len(rows):.2f}s, "
        f"CP-SAT {sum(r.exact_seconds for r in rows) / len(rows):.2f}s"
    )
    return "\n".join(lines)


def main() -> None:
    tight = [dataclasses.replace(w, name=f"{w.name}/2x2", max_threads=2, max_in_flight=2) for w in torchrec_workloads()]
    workloads = [*torchrec_workloads(), *tight, *(random_workload(seed) for seed in range(6))]
    print(format_comparisons(compare(workloads)))


if __name__ == "__main__":
    main()
