"""The checker's cost: ``python -m harness.streamcheck_overhead [--steps N]``.

Times one small training step (MLP 64-256-256-1, batch 128, SGD) as three tasks (H2D copy on a
memcpy stream, forward+backward, optimizer) without the checker and inside it, and an empty task;
prints the median step time of each, the ops per step and the overhead per op and per task.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from torchrec_swp.streamcheck.checker import StreamChecker


def _step_fn(checker: StreamChecker | None) -> Callable[[int], None]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    host = torch.randn(128, 64)

    if checker is None:

        def plain(b: int) -> None:
            x = host.clone()
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()

        return plain

    memcpy = checker.stream("memcpy")

    def checked(b: int) -> None:
        with checker.task("H2D", b), checker.stream_context(memcpy):
            x = host.clone()
        with checker.task("FwdBwd", b):
            current = checker.current_stream()
            current.wait_stream(memcpy)
            checker.record_stream(x, current)
            model(x).sum().backward()
        with checker.task("Opt", b):
            opt.step()
            opt.zero_grad()

    return checked


def _medians_s(fns: list[Callable[[int], None]], steps: int) -> list[float]:
    """Median seconds per call of each of ``fns``, called in turn (so a busy machine slows all alike)."""
    for b in range(3):
        for fn in fns:
            fn(b)
    times: list[list[float]] = [[] for _ in fns]
    for b in range(steps):
        for fn, ts in zip(fns, times, strict=True):
            start = time.perf_counter()
            fn(b)
            ts.append(time.perf_counter() - start)
    return [statistics.median(ts) for ts in times]


def measure(steps: int = 50) -> dict[str, float]:
    """Median seconds per step plain and checked, ops per step, overhead per op and per task."""
    with StreamChecker() as checker:
        plain_fn, checked_fn = _step_fn(None), _step_fn(checker)
        before = checker.stats.ops
        checked_fn(-1)
        ops = checker.stats.ops - before

        def empty(b: int) -> None:
            with checker.task("Empty", b):
                pass

        plain, checked = _medians_s([plain_fn, checked_fn], steps)
        (empty_task,) = _medians_s([empty], steps * 20)
        checker.check()
    return {
        "plain_step_s": plain,
        "checked_step_s": checked,
        "ops_per_step": ops,
        "overhead_per_op_s": (checked - plain) / ops,
        "empty_task_s": empty_task,
        "overhead_per_task_s": (checked - plain) / 3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    r = measure(parser.parse_args().steps)
    print(
        f"step: plain {r['plain_step_s'] * 1e3:.2f} ms, checked {r['checked_step_s'] * 1e3:.2f} ms "
        f"({r['checked_step_s'] / r['plain_step_s']:.1f}x); {r['ops_per_step']:.0f} aten ops per step\n"
        f"overhead: {r['overhead_per_op_s'] * 1e6:.1f} us per op, {r['overhead_per_task_s'] * 1e6:.0f} us per task "
        f"(3 tasks per step); an empty task costs {r['empty_task_s'] * 1e6:.1f} us"
    )


if __name__ == "__main__":
    main()
