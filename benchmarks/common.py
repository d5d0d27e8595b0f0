"""What the benchmarks share: spawning the ranks, interleaved timing, statistics (the DLRM sizes and
batches are ``harness.dlrm_data``'s).

Timing rules (this machine: 2 cores shared by 2 gloo ranks, +-30% from run to run):

* contenders train their own copy of the same model on the same data, **interleaved call by
  call** (the order rotates every step), so they see the same machine load;
* the first ``warmup`` steps of each are dropped; medians and P90s are of the rest, on rank 0;
* compare ratios measured in one run, not absolute times across runs.
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness.dlrm_data import SIZES


def size_arg(text: str) -> list[str]:
    """argparse type for ``--sizes small,medium``."""
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [n for n in names if n not in SIZES]
    if unknown or not names:
        raise ValueError(f"sizes must be a comma-separated subset of {', '.join(SIZES)}, got {text!r}")
    return names


def run_ranks(fn: Callable[..., Any], *args: Any, timeout_s: float = 7200.0, world_size: int = 2) -> Any:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo ranks; return rank 0's result.

    Uses the test harness (``harness/ranks.py and harness/parity.py``): a failing rank raises RankError with its
    traceback, and no rank outlives the call. The harness turns on deterministic algorithms;
    the benchmarks turn them off again in each rank (``rank_setup``), as a user's run would be.
    """
    from harness.ranks import run_on_ranks

    return run_on_ranks(fn, *args, timeout_s=timeout_s, world_size=world_size)[0]


def rank_setup() -> None:
    """In each rank: quiet logs and warnings, default (non-deterministic) algorithms."""
    import logging
    import warnings

    import torch

    torch.use_deterministic_algorithms(False)
    warnings.filterwarnings("ignore")
    logging.getLogger("torchrec").setLevel(logging.ERROR)
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)


@dataclass
class Contender:
    """One side of a comparison: a runner (anything with ``step(it)`` returning ``(loss, ...)``),
    its batches, and what was measured: the time of each ``step`` call and each step's loss."""

    label: str
    runner: Any
    batches: Iterator[Any]
    times: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)


def interleave(contenders: Sequence[Contender], steps: int, tick: Callable[[], None] | None = None) -> None:
    """``steps`` steps of every contender, interleaved call by call; the order rotates each step."""
    n = len(contenders)
    for step in range(steps):
        for k in range(n):
            c = contenders[(step + k) % n]
            start = time.perf_counter()
            output = c.runner.step(c.batches)
            c.times.append(time.perf_counter() - start)
            c.losses.append(float(output[0]))
        if tick is not None:
            tick()


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) by the nearest-rank rule."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def step_stats(times: Sequence[float], examples_per_step: int) -> dict[str, float]:
    """Median and P90 step time (ms) and the QPS at the median step (examples per second, all ranks)."""
    median = statistics.median(times)
    return {
        "median_ms": 1e3 * median,
        "p90_ms": 1e3 * percentile(times, 0.9),
        "qps": examples_per_step / median,
    }


def ratio_interval(base: Sequence[float], other: Sequence[float], resamples: int = 1000) -> tuple[float, float]:
    """95% bootstrap interval of median(other) / median(base) over paired steps (step k of both
    ran back to back, so steps are resampled together). Seeded: the same data gives the same interval."""
    import random

    rng = random.Random(0)
    n = min(len(base), len(other))
    ratios = []
    for _ in range(resamples):
        idx = [rng.randrange(n) for _ in range(n)]
        ratios.append(statistics.median(other[i] for i in idx) / statistics.median(base[i] for i in idx))
    return percentile(ratios, 0.025), percentile(ratios, 0.975)


def release(*contenders: Contender) -> None:
    """Close the runners and free their models before the next pair is built."""
    for c in contenders:
        c.runner.close()
    gc.collect()


def write_json(path: Path, data: Any) -> None:
    import json

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")


# ------------------------------------------------------------------------ engine accounting
@dataclass(frozen=True)
class StepRecord:
    """Where one ``progress()`` call of our pipeline spent its time (seconds).

    ``main_tasks``: task runs on the calling thread; ``main_waits``: its waits for tasks on other
    threads; ``barrier``: its wait at the end of an iteration for workers still running (from its
    own last task or wait to the workers' last task end, when that is later); ``busy``: task time
    per thread in the call's busiest iteration; ``overhead``: the rest of the call.
    """

    step: float
    main_tasks: float
    main_waits: float
    barrier: float
    busy: dict[str, float]
    task_calls: int

    @property
    def overhead(self) -> float:
        return self.step - self.main_tasks - self.main_waits - self.barrier


class StepAccounting:
    """Engine observer (``engine.instrument(acc)``) that turns each step into a StepRecord.

    Call ``take(step_seconds)`` after each ``progress()`` call. Worker threads append to lists
    (atomic under the GIL); everything is summed in ``take``.
    """

    def __init__(self, main_thread: str = "default", lanes: dict[str, int] | None = None) -> None:
        """``lanes``: thread group -> how many threads run it at once (a source with several
        loads): its busy time counts divided by that, as the lanes share its work."""
        self.main = main_thread
        self.lanes = dict(lanes or {})
        self._runs: list[tuple[str, int, float, float]] = []
        self._waits: list[tuple[str, int, float, float]] = []

    def on_run(self, task: str, batch: int, thread: str, iteration: int, start: float, end: float) -> None:
        self._runs.append((thread, iteration, start, end))

    def on_wait(self, producer: str, thread: str, iteration: int, start: float, end: float) -> None:
        self._waits.append((thread, iteration, start, end))

    def on_iteration(self, iteration: int, start: float, end: float) -> None:
        return None

    def take(self, step_seconds: float) -> StepRecord:
        runs, waits = self._runs, self._waits
        self._runs, self._waits = [], []
        main_tasks = sum(e - s for t, _, s, e in runs if t == self.main)
        main_waits = sum(e - s for t, _, s, e in waits if t == self.main)
        barrier = 0.0
        busy: dict[str, float] = {}
        for it in sorted({i for _, i, _, _ in runs}):
            main_last = max((e for t, i, _, e in (*runs, *waits) if i == it and t == self.main), default=None)
            worker_last = max((e for t, i, _, e in runs if i == it and t != self.main), default=None)
            if main_last is not None and worker_last is not None:
                barrier += max(0.0, worker_last - main_last)
            per_thread: dict[str, float] = {}
            for t, i, s, e in runs:
                if i == it:
                    per_thread[t] = per_thread.get(t, 0.0) + (e - s) / self.lanes.get(t, 1)
            if sum(per_thread.values()) > sum(busy.values()):
                busy = per_thread
        return StepRecord(step_seconds, main_tasks, main_waits, barrier, busy, len(runs))


def instrumentation_cost_s(tasks: int = 8, iterations: int = 3000) -> float:
    """What attaching StepAccounting adds per task call (seconds): an upper bound of what it adds
    to the measured overhead (a little of it falls inside the task windows).

    Measured on a bare Engine running ``tasks`` trivial tasks on the calling thread, with and
    without the observer; best of 5 runs each.
    """
    from harness.profiler_overhead import chain_plan
    from torchrec_swp.engine import Engine

    plan = chain_plan(tasks)

    def bindings() -> dict[str, Callable[..., Any]]:
        def source(b: int) -> int:
            if b >= iterations:
                raise StopIteration
            return b

        return {t: source if t == plan.source else (lambda b, **_: b) for t in plan.fire_order}

    def run(observed: bool) -> float:
        engine = Engine(plan, bindings(), name="swp-calibration")
        acc = StepAccounting()
        if observed:
            engine.instrument(acc)
        start = time.perf_counter()
        try:
            while True:
                try:
                    engine.step()
                except StopIteration:
                    break
                acc.take(0.0)
        finally:
            engine.close()
        return time.perf_counter() - start

    bare = min(run(False) for _ in range(5))
    observed = min(run(True) for _ in range(5))
    return max(0.0, observed - bare) / (tasks * iterations)
