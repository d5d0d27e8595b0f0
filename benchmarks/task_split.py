"""Where ours' extra time per step goes: in our task functions, or around them.

    python benchmarks/task_split.py                                  # every pipeline that does not compile
    python benchmarks/task_split.py --pipelines TrainPipelinePEC --steps 600

Each task function of our pipeline (the methods marked ``@task``) is timed from its entry to its
exit, so that every step of ours splits into the time *in* its task functions and the time
*around* them (the engine, the calls' arguments and returns, ``progress()`` itself, freeing the
batch that leaves). Upstream's class and ours train their own copies of the same DLRM (small, one
gloo rank, so that nothing but the step is measured), interleaved call by call; the first
``--warmup`` steps are dropped.

Per pipeline: upstream's median step, ours' median step, ours' median time in its task functions
and around them, and the ratio of ours' time in its tasks to upstream's whole step with its 95%
interval (paired steps resampled together). Where that ratio is 1.00, our task functions together
do what upstream's ``progress()`` does in the same time, and all of ours' extra time is around
them. The timers cost something themselves: each call's share is calibrated on a no-op method
(``wrapper_us``, about half of it falls inside the timed window, half outside); ``around, net``
subtracts ``calls x wrapper_us`` from the time around the tasks, an upper bound of the timers' part.

Writes ``OUT/task_split.json`` and ``OUT/task_split.md`` (default ``out/bench``).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import rank_setup, ratio_interval, run_ranks
from benchmarks.report import load_average, run_meta, write_report


class TaskClock:
    """Every ``@task`` method of ``cls`` timed while the clock is on the class: ``spent`` and
    ``calls`` add up since the last ``start()``. ``remove()`` puts the methods back."""

    def __init__(self, cls: type) -> None:
        from torchrec_swp.integrations.torchrec.pipelines.protocol import task_methods

        self.cls, self.spent, self.calls = cls, 0.0, 0
        self._saved = {name: cls.__dict__.get(name) for name in set(task_methods(cls).values())}
        for name in self._saved:
            setattr(cls, name, self._timed(getattr(cls, name)))

    def _timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        clock = time.perf_counter

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent += clock() - start
                self.calls += 1

        return timed

    def start(self) -> None:
        self.spent, self.calls = 0.0, 0

    def remove(self) -> None:
        for name, fn in self._saved.items():
            if fn is None:
                delattr(self.cls, name)
            else:
                setattr(self.cls, name, fn)


def wrapper_us(calls: int = 200_000) -> float:
    """What ``TaskClock``'s timer adds to one call of a task method (best of 5, microseconds)."""
    from torchrec_swp.integrations.torchrec.pipelines.protocol import task

    class Plain:
        @task("Forward")
        def _task_forward(self, b: int, context: Any = None) -> None:
            return None

    class Timed(Plain):
        pass

    def per_call(obj: Any) -> float:
        start = time.perf_counter()
        for b in range(calls):
            obj._task_forward(b, context=None)
        return (time.perf_counter() - start) / calls

    clock = TaskClock(Timed)
    try:
        plain, timed = Plain(), Timed()
        return 1e6 * min(per_call(timed) - per_call(plain) for _ in range(5))
    finally:
        clock.remove()


def _split(name: str, rank: int, world_size: int, args: argparse.Namespace) -> dict[str, Any]:
    """Upstream's and ours' step of ``name``, ours' split at its task functions."""
    from examples.dlrm.model import build_dlrm
    from harness.dlrm import _pipeline_class, make_runner
    from harness.dlrm_data import SIZES, batches

    size = SIZES["small"]
    total = args.warmup + args.steps
    build = lambda: build_dlrm(rank, world_size, size)  # noqa: E731
    clock = TaskClock(_pipeline_class(name, "ours"))
    runners = []
    try:
        runners = [make_runner(name, impl, build, upstream_patch=True) for impl in ("upstream", "ours")]
        data: list[Iterator[Any]] = [batches(size, rank, total) for _ in runners]
        steps: list[list[float]] = [[], []]
        inside: list[float] = []
        calls: list[int] = []
        losses: list[list[float]] = [[], []]
        for i in range(total):
            for k in range(2):
                j = (i + k) % 2
                clock.start()
                start = time.perf_counter()
                out = runners[j].step(data[j])
                steps[j].append(time.perf_counter() - start)
                losses[j].append(float(out[0]))
                if j == 1:
                    inside.append(clock.spent)
                    calls.append(clock.calls)
    finally:
        for r in runners:
            r.close()
        clock.remove()
    w = args.warmup
    up, ours, inside, calls = steps[0][w:], steps[1][w:], inside[w:], calls[w:]
    around = [s - t for s, t in zip(ours, inside, strict=True)]
    return {
        "pipeline": name,
        "upstream_us": 1e6 * statistics.median(up),
        "ours_us": 1e6 * statistics.median(ours),
        "inside_us": 1e6 * statistics.median(inside),
        "around_us": 1e6 * statistics.median(around),
        "calls": statistics.median(calls),
        "inside_ratio": statistics.median(inside) / statistics.median(up),
        "inside_ratio_95": ratio_interval(up, inside) if max(calls) else None,
        "same_losses": losses[0] == losses[1],
    }


def _rank(rank: int, world_size: int, args: argparse.Namespace) -> dict[str, Any]:
    rank_setup()
    cost = wrapper_us()
    rows = []
    for name in args.pipelines:
        rows.append(_split(name, rank, world_size, args))
        print(f"  {name}: {rows[-1]['ours_us']:.0f} us ours, {rows[-1]['upstream_us']:.0f} us upstream", flush=True)
    return {"wrapper_us": cost, "rows": rows}


def _markdown(result: dict[str, Any], meta: dict[str, Any]) -> str:
    cost = result["wrapper_us"]
    lines = [
        "# Ours' step split at its task functions, against upstream's step",
        "",
        f"{meta['date']}; `{meta['command']}`; load average {meta['load_before']} before, {meta['load_after']} after",
        "",
        f"Small DLRM, one gloo rank, {meta['warmup']} warm-up + {meta['steps']} measured steps, interleaved; "
        f"microseconds, medians per step; the timers cost {cost:.2f} us per task call "
        "(`around, net` subtracts that for every call).",
        "",
        "| pipeline | upstream step | ours step | ours - upstream | in tasks | around | around, net | task calls "
        "| in tasks / upstream step (95%) | same losses |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        if not r["calls"]:
            lines.append(
                f"| {r['pipeline']} | {r['upstream_us']:.0f} | {r['ours_us']:.0f} "
                f"| {r['ours_us'] - r['upstream_us']:+.0f} | - | - | - | 0 "
                "| (no `@task` methods: its stages are the user's functions) | "
                f"{'yes' if r['same_losses'] else '**no**'} |"
            )
            continue
        lo, hi = r["inside_ratio_95"]
        lines.append(
            f"| {r['pipeline']} | {r['upstream_us']:.0f} | {r['ours_us']:.0f} | {r['ours_us'] - r['upstream_us']:+.0f} "
            f"| {r['inside_us']:.0f} | {r['around_us']:.0f} | {r['around_us'] - r['calls'] * cost:.0f} "
            f"| {r['calls']:g} "
            f"| {r['inside_ratio']:.3f} ({lo:.3f}-{hi:.3f}) | {'yes' if r['same_losses'] else '**no**'} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    from harness.dlrm import INFO, PIPELINES

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--pipelines", type=lambda s: s.split(","), default=None, help="(default: every one that does not compile)"
    )
    parser.add_argument("--steps", type=int, default=400, help="measured steps per pipeline (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=20, help="dropped steps (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=Path("out/bench"))
    args = parser.parse_args(argv)
    args.pipelines = args.pipelines or [p for p in PIPELINES if not INFO[p].compiles]
    unknown = [p for p in args.pipelines if p not in INFO]
    if unknown:
        parser.error(f"unknown pipeline(s) {unknown}; choose among {', '.join(PIPELINES)}")
    if args.steps < 10 or args.warmup < 1:
        parser.error("--steps >= 10 and --warmup >= 1")
    load_before = load_average()
    result = run_ranks(_rank, args, world_size=1)
    meta = run_meta("task_split.py", argv, args, "steps", "warmup")
    meta.update(load_before=load_before, load_after=load_average())
    write_report(args.out, "task_split", {"meta": meta, **result}, _markdown(result, meta))


if __name__ == "__main__":
    main()
