"""What ``sim_vs_real.py`` and ``close_loop.py`` share: profile our pipelines on every rank, and
turn the profiles into a prediction of the multi-rank simulator.

In each rank, ``profile_interleaved`` trains several of our pipelines interleaved call by call
(the same machine load for all), with a ``TaskProfiler`` attached after the warm-up, and times
each step (``progress()`` and, for StagedTrainPipeline, the caller's training after it). The
parent gets every rank's ``ProfiledRun`` and calls ``calibration`` (``torchrec_swp.sim.calibrate``:
each rank's task costs, collectives taken after the last rank arrived, the loader latency off
the CPU, contention removed for ``cores`` cores) and ``predicted_step`` (``simulate_ranks``:
rank 0's median simulated step).

Per-iteration overhead of a rank (``overhead_s``, simulated as CPU work on the calling thread
before each iteration): what the profile does not attribute to a task on the iteration's
critical path (``exposed_times``: dispatch and wake-up latencies), plus the part of a
``progress()`` call outside its internal iteration, plus the caller's own work after it
(``Runner.finish``: StagedTrainPipeline's training). Medians over the measured steps.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from torchrec_swp.plan import PipelinePlan
from torchrec_swp.sim import Calibration, calibrate, simulate, simulate_ranks


@dataclass
class ProfiledRun:
    """One pipeline on one rank: the plan it ran (text), the profiler's iteration records, the
    time of each measured ``progress()`` call and of the caller's work after it (s), the losses,
    ``Profile.durations()`` (the medians, the single-rank simulator's cost model) and the whole
    profile (``Profile.to_json()``, what ``python -m torchrec_swp.autosched --profile`` reads)."""

    label: str
    plan: str
    records: list[Any] = field(default_factory=list)
    progress_s: list[float] = field(default_factory=list)
    finish_s: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    medians: dict[str, float] = field(default_factory=dict)
    profile: dict[str, Any] = field(default_factory=dict)  # Profile.to_json()

    @property
    def step_s(self) -> list[float]:
        return [p + f for p, f in zip(self.progress_s, self.finish_s, strict=True)]

    @property
    def median_step_s(self) -> float:
        return statistics.median(self.step_s)


def profile_interleaved(
    labels: Sequence[str],
    runners: Sequence[Any],
    data: Sequence[Iterator[Any]],
    *,
    warmup: int,
    steps: int,
    tick: Callable[[], None] | None = None,
) -> list[ProfiledRun]:
    """In a rank: ``warmup`` then ``steps`` steps of every runner (``harness.dlrm.Runner``
    of our pipelines), interleaved call by call, the order rotating every step; a TaskProfiler
    on each during the measured steps. Returns a ProfiledRun per runner."""
    from torchrec_swp.profiler import TaskProfiler

    n = len(runners)
    for step in range(warmup):
        for k in range(n):
            runners[(step + k) % n].step(data[(step + k) % n])
        if tick is not None:
            tick()
    profilers = [TaskProfiler(warmup=0) for _ in runners]
    out = [ProfiledRun(label, "") for label in labels]
    for r, p in zip(runners, profilers, strict=True):
        r.pipeline.engine.instrument(p)
    try:
        for step in range(steps):
            for k in range(n):
                i = (step + k) % n
                t0 = time.perf_counter()
                progressed = runners[i].pipeline.progress(data[i])
                t1 = time.perf_counter()
                output = runners[i].finish(progressed)
                t2 = time.perf_counter()
                out[i].progress_s.append(t1 - t0)
                out[i].finish_s.append(t2 - t1)
                out[i].losses.append(float(output[0]))
            if tick is not None:
                tick()
    finally:
        for r in runners:
            r.pipeline.engine.instrument()
    for run, r, p in zip(out, runners, profilers, strict=True):
        plan = r.pipeline.engine.plan  # the plan of the measured steps (SemiSync's is phased: its second phase)
        run.plan = plan.to_text()
        run.records = list(p.records)
        profile = p.profile(plan)
        run.medians = profile.durations()
        run.profile = profile.to_json()
    return out


def overhead_s(run: ProfiledRun) -> float:
    """The per-iteration overhead of a rank (module docstring)."""
    from torchrec_swp.profiler import exposed_times

    plan = PipelinePlan.from_text(run.plan)
    steady = frozenset(t for t in plan.fire_order if plan.task(t).when.in_steady_state)
    comm = {t: plan.task(t).comm_group for t in plan.fire_order}
    complete = [r for r in run.records if r.ran() == steady and len(r.runs) == len(steady)]
    if not complete:
        return 0.0
    unattributed = statistics.median(exposed_times(r, comm)[1] for r in complete)
    outside = max(0.0, statistics.median(run.progress_s) - statistics.median(r.duration for r in complete))
    return unattributed + outside + statistics.median(run.finish_s)


def calibration(
    runs: Sequence[ProfiledRun], *, latency_s: float, cores: int | None, overhead: bool = True
) -> Calibration:
    """Every rank's costs from its ProfiledRun of one pipeline (``runs[r]``: rank ``r``'s). The
    source task's first ``latency_s`` seconds are the loader waiting (off the CPU)."""
    plans = [PipelinePlan.from_text(r.plan) for r in runs]
    source = plans[0].source
    return calibrate(
        plans,
        [r.records for r in runs],
        off_cpu={source: latency_s} if source is not None and latency_s > 0 else None,
        cores=cores,
        overhead=[overhead_s(r) for r in runs] if overhead else None,
    )


def predicted_step(
    cal: Calibration,
    *,
    mode: str = "replay",
    cores: int | None,
    plan: PipelinePlan | None = None,
    batches: int | None = None,
    seed: int = 0,
) -> float:
    """Rank 0's median simulated step of the calibrated ranks (running ``plan`` if given, else
    what they ran): over ``batches`` batches (default: as many as were measured, 12 for medians)."""
    depth = max(c.plan.max_stage for c in cal.ranks) + 1
    n = batches or (12 if mode == "median" else cal.iterations + depth)
    plans = None if plan is None else [plan] * len(cal.ranks)
    ranks = cal.simulation_ranks(mode, seed=seed, plans=plans)  # type: ignore[arg-type]
    result = simulate_ranks(ranks, n, cores=cores)
    got = result.ranks[0].median_iteration_time
    assert got is not None
    return got


def single_rank_step(run: ProfiledRun) -> float:
    """What the single-rank simulator predicted before: ``simulate`` of rank 0's plan with its
    ``Profile.durations()`` (medians), steady iteration time."""
    plan = PipelinePlan.from_text(run.plan)
    got = simulate(plan, run.medians, plan.max_stage + 4).steady_iteration_time
    assert got is not None
    return got
