"""What ``sim_vs_real.py`` and ``close_loop.py`` share: profile our pipelines on every rank in
blocks of consecutive steps, and turn the profiles into predictions of the multi-rank simulator.

In each rank, ``profile_blocks`` runs several of our pipelines (each its own copy of the model,
its own data) in rounds: every pipeline runs ``block`` consecutive steps, the order rotating each
round, the first ``skip`` of each block untimed. Consecutive steps, not steps interleaved call
by call: a plan that runs ahead works between its calls, and interleaving would hand it the
other pipelines' steps for free. During a block's timed steps a fresh ``TaskProfiler`` records
every task (with its thread CPU time) and every ``progress()`` call (the engine reports them); the
period of each timed step, from one call's start to the next's, is what the caller lives.

The parent gets every rank's ``ProfiledRun`` and calls ``calibration`` (``torchrec_swp.sim.calibrate``
through ``autosched.inputs.from_profiles``: each rank's thread CPU and off-CPU time per task,
collectives taken from the last rank's arrival on, the calling thread's overhead per step) and
``predicted_step`` (``simulate_ranks`` with the engine model: the mean step of the slowest rank).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from torchrec_swp.autosched.inputs import DEFAULT_WAKE, Inputs, from_profiles
from torchrec_swp.plan import PipelinePlan
from torchrec_swp.profiler import Profile
from torchrec_swp.sim import Wake, simulate_ranks


@dataclass
class ProfiledRun:
    """One pipeline on one rank: the plan it ran (text), each timed step's period (s), every
    step's loss, one ``Profile.to_json()`` per block (records, call costs, where it ran), what
    the machine did during each block's timed steps (``usage``: ``Usage.since``) and during the
    blocks run again because it was busy with other programs (``dropped``)."""

    label: str
    plan: str = ""
    periods: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    blocks: list[dict[str, Any]] = field(default_factory=list)
    usage: list[dict[str, Any]] = field(default_factory=list)
    dropped: list[dict[str, Any]] = field(default_factory=list)

    def block_means(self) -> list[float]:
        """Each block's mean step period (s), in the order the blocks ran."""
        n = len(self.blocks)
        per = len(self.periods) // n if n else 0
        return [statistics.fmean(self.periods[k * per : (k + 1) * per]) for k in range(n)] if per else []

    @property
    def mean_step_s(self) -> float:
        return statistics.fmean(self.periods)

    def profile(self) -> Profile:
        """The blocks' profiles as one: every block's measured iterations, the mean call costs."""
        profiles = [Profile.from_json(b) for b in self.blocks]
        first = profiles[0]
        steps = [p.steps for p in profiles if p.steps is not None]
        merged_steps = None
        if steps:
            merged_steps = replace(
                steps[0],
                calls=sum(s.calls for s in steps),
                overhead_s=statistics.fmean(s.overhead_s for s in steps),
                call_mean_s=statistics.fmean(s.call_mean_s for s in steps),
                call_cpu_mean_s=statistics.fmean(s.call_cpu_mean_s for s in steps),
                gap_mean_s=statistics.fmean(s.gap_mean_s for s in steps),
                gap_cpu_mean_s=statistics.fmean(s.gap_cpu_mean_s for s in steps),
            )
        return replace(first, records=tuple(r for p in profiles for r in p.records), steps=merged_steps)


@dataclass(frozen=True)
class Usage:
    """What the machine and this process's threads did up to a moment (Linux ``/proc``; empty
    elsewhere): ``busy``, the machine's CPU seconds not idle (every core, every process), ``steal``,
    the seconds the hypervisor ran something else; ``threads``: per thread id, its name and the
    seconds it ran on a core and waited for one (``/proc/self/task/*/schedstat``)."""

    wall: float
    busy: float | None = None
    steal: float | None = None
    threads: dict[int, tuple[str, float, float]] = field(default_factory=dict)

    @classmethod
    def now(cls) -> Usage:
        import os

        wall = time.perf_counter()
        busy = steal = None
        try:
            with open("/proc/stat") as f:
                cpu = [int(x) for x in f.readline().split()[1:]]
            tick = os.sysconf("SC_CLK_TCK")
            busy = (sum(cpu) - cpu[3] - cpu[4]) / tick  # all but idle and iowait
            steal = (cpu[7] if len(cpu) > 7 else 0) / tick
        except (OSError, ValueError, IndexError):
            pass
        threads: dict[int, tuple[str, float, float]] = {}
        try:
            for tid in os.listdir("/proc/self/task"):
                try:
                    with open(f"/proc/self/task/{tid}/comm") as f:
                        name = f.read().strip()
                    with open(f"/proc/self/task/{tid}/schedstat") as f:
                        run_ns, wait_ns = (int(x) for x in f.read().split()[:2])
                except (OSError, ValueError):
                    continue
                threads[int(tid)] = (name, run_ns / 1e9, wait_ns / 1e9)
        except OSError:
            pass
        return cls(wall, busy, steal, threads)

    def since(self, before: Usage) -> dict[str, Any]:
        """What happened from ``before`` to this moment: ``wall_s``, the machine's ``busy_s`` and
        ``steal_s`` (None where unknown), this process's ``cpu_s`` (every thread) and ``threads``
        (thread name -> [seconds on a core, seconds waiting for one], threads of one name added)."""
        out: dict[str, Any] = {"wall_s": self.wall - before.wall, "busy_s": None, "steal_s": None}
        if self.busy is not None and before.busy is not None:
            out["busy_s"] = self.busy - before.busy
        if self.steal is not None and before.steal is not None:
            out["steal_s"] = self.steal - before.steal
        threads: dict[str, list[float]] = {}
        for tid, (name, run, wait) in self.threads.items():
            _, run0, wait0 = before.threads.get(tid, (name, 0.0, 0.0))
            got = threads.setdefault(name, [0.0, 0.0])
            got[0] += run - run0
            got[1] += wait - wait0
        out["threads"] = threads
        out["cpu_s"] = sum(r for r, _ in threads.values())
        return out


def profile_blocks(
    labels: Sequence[str],
    runners: Sequence[Any],
    data: Sequence[Iterator[Any]],
    *,
    warmup: int,
    rounds: int,
    block: int,
    skip: int,
    where: Callable[[Any], dict[str, Any]],
    tick: Callable[[], None] | None = None,
    keep: Callable[[dict[str, Any]], bool] | None = None,
    retries: int = 0,
) -> list[ProfiledRun]:
    """In a rank: ``warmup`` steps of every runner (``harness.dlrm.Runner`` of our pipelines)
    interleaved call by call, then ``rounds`` rounds of a block of ``block`` consecutive steps per
    runner (module docstring). ``where(runner)``: the profile's ``where`` fields (rank, machine,
    what the data allows). ``keep(usage)``: whether a block counts, from what the machine did
    meanwhile (``Usage.since``; every rank must decide alike: the caller gathers them); a block
    that does not is run again, up to ``retries`` times (its steps still train: ``losses`` has
    them, ``ProfiledRun.dropped`` keeps their usage). Returns
    a ProfiledRun per runner."""
    from torchrec_swp.profiler import TaskProfiler

    n = len(runners)
    out = [ProfiledRun(label) for label in labels]
    for step in range(warmup):
        for k in range(n):
            i = (step + k) % n
            out[i].losses.append(float(runners[i].step(data[i])[0]))
        if tick is not None:
            tick()
    for round_ in range(rounds):
        for k in range(n):
            i = (round_ + k) % n
            r, run = runners[i], out[i]
            for attempt in range(retries + 1):
                profiler = TaskProfiler(warmup=0)
                last = None
                before: Usage | None = None
                periods: list[float] = []
                for step in range(block):
                    if step == skip:
                        r.pipeline.engine.instrument(profiler)
                        before = Usage.now()
                    start = time.perf_counter()
                    if step > skip and last is not None:
                        periods.append(start - last)
                    last = start
                    run.losses.append(float(r.finish(r.pipeline.progress(data[i]))[0]))
                    if tick is not None and attempt == 0:
                        tick()
                usage = Usage.now().since(before) if before is not None else {}
                r.pipeline.engine.instrument()
                if attempt < retries and keep is not None and not keep(usage):
                    run.dropped.append(usage)
                    continue
                run.periods.extend(periods)
                run.usage.append(usage)
                plan = r.pipeline.engine.plan
                run.plan = plan.to_text()
                run.blocks.append(profiler.profile(plan).with_where(**where(r)).to_json())
                break
    return out


def inputs_of(
    runs: Sequence[ProfiledRun], *, wake: float | Wake = DEFAULT_WAKE, gil: float | None = None, **options: Any
) -> Inputs:
    """Every rank's calibrated costs from its ProfiledRun of one pipeline (``runs[r]``: rank ``r``'s)."""
    return from_profiles([r.profile() for r in runs], wake=wake, gil=gil, **options)


def replay_batches(iterations: int, plan: PipelinePlan) -> int:
    """How many batches a replay of ``iterations`` measured ones simulates on ``plan``: every
    measured iteration, with the pipeline's fill and drain."""
    return iterations + 2 * (plan.pipeline_depth + plan.lookahead + plan.loads)


def predicted_step(
    inputs: Inputs, *, mode: str = "mean", plan: PipelinePlan | None = None, batches: int | None = None
) -> float:
    """The engine model's mean step of the calibrated ranks (running ``plan`` if given, else what
    they ran), over ``batches`` batches (default: replay as many as were measured, 40 for means)."""
    cal = inputs.calibration
    base = cal.ranks[0].plan
    run = plan or base
    n = batches or (replay_batches(cal.iterations, run) if mode == "replay" else 40)
    ranks = cal.simulation_ranks(  # type: ignore[arg-type]
        mode,
        plans=[run] * len(cal.ranks),
        machines=inputs.machine.machines,
        wake=inputs.machine.wake,
        split_draws=inputs.split_draws,
        gil=inputs.machine.gil,
    )
    got = simulate_ranks(ranks, n, cores=inputs.machine.cores).step_period
    assert got is not None
    return got
