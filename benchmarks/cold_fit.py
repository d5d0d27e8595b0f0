"""Fit the cold-thread rule (``torchrec_swp.sim.cold``) to this machine from ``sim_vs_real`` profiles.

    python benchmarks/sim_vs_real.py --out /tmp/raw1                     # record (10 min, under the lock)
    python benchmarks/cold_fit.py /tmp/raw1/sim_vs_real.raw.pkl [/tmp/raw2/sim_vs_real.raw.pkl ...]

On one rank each pipeline ran the same tasks with its training thread sleeping before it
computes (``default``: 10 ms in Fetch every step; ``io``, ``io+ahead``: waiting for the loader
thread) and working back to back (``2loads``: two loads keep batches coming). The ``2loads``
run's mean CPU time of each task on the calling thread is taken for its warm cost; in the other
runs each of those tasks is placed where the rule places it (``Warmth``: warm work since the
thread last woke after ``--after`` seconds off the CPU, its CPU part at the end of its run) and
its mean measured CPU time is compared with ``warm + Cold(after, extra, span).cost(position, warm)
- warm`` over a grid of ``extra`` and ``span``. Prints the least-squares fit, what the rule leaves
unexplained against a rule of no cold at all, and per run the calling thread's measured, warm and
modelled CPU per step: the constants of ``autosched.inputs.DEFAULT_COLD``.
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torchrec_swp.plan import MAIN_THREAD
from torchrec_swp.sim import Cold
from torchrec_swp.sim.cold import Warmth

COLD_RUNS = ("default", "io", "io+ahead")
WARM_RUN = "2loads"


def points(saved: dict[str, Any], after: float) -> list[tuple[str, str, str, float, float, float]]:
    """``(pipeline, run, task, position, warm, cold)`` of every task on the calling thread of every
    one-rank run that sleeps, positions in warm seconds, costs the run's mean CPU seconds."""
    out = []
    rule = Cold(after, 0.0, 1.0)  # where a thread stands does not depend on extra and span
    for name, runs in saved["runs"].get(1, [{}])[0].items():
        by_label = {r.label: r for r in runs}
        if WARM_RUN not in by_label:
            continue
        warm = _mean_cpu(by_label[WARM_RUN])
        for label in COLD_RUNS:
            if label not in by_label:
                continue
            seen: dict[str, list[tuple[float, float]]] = {}
            warmth = Warmth()
            mine = (x for r in by_label[label].profile().records for x in r.runs if x.thread == MAIN_THREAD)
            for x in sorted(mine, key=lambda x: x.start):
                cpu = min(max(0.0, x.cpu or 0.0), x.end - x.start)
                work = warm.get(x.task, cpu)
                warmth.charge(rule, x.end - cpu, work)  # moves the position on by the warm work
                warmth.ended(x.end)
                if x.task in warm and cpu > 0 and warmth.position < float("inf"):  # after a first wake
                    seen.setdefault(x.task, []).append((warmth.position - work, cpu))
            for task, got in seen.items():
                position = statistics.fmean(p for p, _ in got)
                out.append((name, label, task, position, warm[task], statistics.fmean(c for _, c in got)))
    return out


def _mean_cpu(run: Any) -> dict[str, float]:
    got: dict[str, list[float]] = {}
    for r in run.profile().records:
        for x in r.runs:
            if x.thread == MAIN_THREAD and x.cpu:
                got.setdefault(x.task, []).append(x.cpu)
    return {t: statistics.fmean(v) for t, v in got.items()}


def fit(pts: list[tuple[str, str, str, float, float, float]], after: float) -> tuple[Cold, float, float]:
    """The grid's least-squares ``Cold``, its residual and the residual of no rule (seconds squared)."""

    def residual(rule: Cold) -> float:
        return sum((w + (rule.cost(p, w) - w) - c) ** 2 for *_, p, w, c in pts)

    best = min(
        (Cold(after, extra / 20, span * 0.25e-3) for extra in range(0, 41) for span in range(1, 61)), key=residual
    )
    return best, residual(best), residual(Cold(after, 0.0, 1.0))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("raw", type=Path, nargs="+", help="sim_vs_real.raw.pkl files (one or more recordings)")
    parser.add_argument("--after", type=float, default=2e-3, help="seconds off the CPU that make a thread cold")
    args = parser.parse_args(argv)
    pts = []
    for path in args.raw:
        with path.open("rb") as f:
            pts += points(pickle.load(f), args.after)
    if not pts:
        parser.error("no one-rank run with a 2loads configuration in the files")
    rule, left, none = fit(pts, args.after)
    print(
        f"{rule}: residual {1e6 * left:.2f} ms^2 against {1e6 * none:.2f} without the rule "
        f"({100 * (1 - left / none):.0f}% explained), a burst pays at most {1e3 * rule.extra * rule.span:.2f} ms"
    )
    per_run: dict[tuple[str, str], list[float]] = {}
    for name, label, _, p, w, c in pts:
        row = per_run.setdefault((name, label), [0.0, 0.0, 0.0])
        row[0] += c
        row[1] += w
        row[2] += rule.cost(p, w)
    print("| pipeline | run | measured CPU ms | warm | modelled |\n|---|---|---|---|---|")
    for (name, label), (c, w, m) in per_run.items():
        modelled = f"{1e3 * m:.2f} ({100 * (m / c - 1):+.0f}%)"
        print(f"| {name} | {label} | {1e3 * c:.2f} | {1e3 * w:.2f} (x{c / w:.2f}) | {modelled} |")


if __name__ == "__main__":
    main()
