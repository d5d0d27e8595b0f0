"""Part (c): ours vs upstream step time on the DLRM example, on one GPU (nccl, world size 1).

``benchmarks/compare.py``'s method (both train their own copy of the same model on the same
data, interleaved, warm-up dropped, ratio of medians with a paired bootstrap interval), with one
change for a device that runs ahead of the host: steps are timed in blocks of ``block_steps``
ending in ``torch.cuda.synchronize()``, and upstream and ours alternate block by block (the
order rotating). A block's time over its steps is one sample; a host clock around a single
``progress()`` would time the launches, not the GPU work.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.common import Contender, percentile, ratio_interval

WARMUP = 20
STEPS = 200
BLOCK_STEPS = 5


def interleave_blocks(contenders: Sequence[Contender], blocks: int, block_steps: int, sync: Callable[[], None]) -> None:
    """``blocks`` blocks of ``block_steps`` steps per contender, alternating block by block (the
    order rotates every round). Appends each block's time per step to ``times`` and its steps'
    losses (read after the block's sync) to ``losses``."""
    n = len(contenders)
    for k in range(blocks):
        for j in range(n):
            c = contenders[(k + j) % n]
            sync()
            start = time.perf_counter()
            outputs = [c.runner.step(c.batches) for _ in range(block_steps)]
            sync()
            c.times.append((time.perf_counter() - start) / block_steps)
            c.losses.extend(float(o[0]) for o in outputs)


def block_stats(times: Sequence[float], examples_per_step: int) -> dict[str, float]:
    """Median and P90 of the per-step times of the blocks (ms) and the QPS at the median."""
    median = statistics.median(times)
    return {"median_ms": 1e3 * median, "p90_ms": 1e3 * percentile(times, 0.9), "qps": examples_per_step / median}


def compare(
    name: str, upstream: Contender, ours: Contender, warmup_blocks: int, examples_per_step: int
) -> dict[str, Any]:
    """The figures of one pipeline from two contenders that ran ``interleave_blocks``."""
    up_t, us_t = upstream.times[warmup_blocks:], ours.times[warmup_blocks:]
    up, us = block_stats(up_t, examples_per_step), block_stats(us_t, examples_per_step)
    diffs = [abs(a - b) for a, b in zip(upstream.losses, ours.losses)]
    return {
        "pipeline": name,
        "upstream": up,
        "ours": us,
        "ratio": us["median_ms"] / up["median_ms"],
        "ratio_95": ratio_interval(up_t, us_t),
        "same_losses": upstream.losses == ours.losses,
        "max_loss_diff": max(diffs, default=0.0),
    }


def _rank(
    rank: int, world_size: int, names: list[str], warmup: int, steps: int, block_steps: int, device_type: str, size: Any
) -> dict[str, Any]:
    import torch

    from benchmarks.common import rank_setup
    from benchmarks.gpu.dlrm import LOOKAHEAD, make_gpu_runner, pinned_batches
    from benchmarks.gpu.parity import device_of

    rank_setup()
    device = device_of(device_type, rank)
    on_cuda = device.type == "cuda"

    def sync() -> None:
        if on_cuda:
            torch.cuda.synchronize(device)

    blocks, warmup_blocks = (warmup + steps) // block_steps, warmup // block_steps
    total = blocks * block_steps
    results, errors = [], {}
    for name in names:
        contenders: list[Contender] = []
        try:
            for impl in ("upstream", "ours"):
                runner = make_gpu_runner(name, impl, device, rank, world_size, size)
                contenders.append(Contender(impl, runner, pinned_batches(size, rank, total + LOOKAHEAD, pin=on_cuda)))
            interleave_blocks(contenders, blocks, block_steps, sync)
            results.append(compare(name, *contenders, warmup_blocks, size.batch_size * world_size))
        except Exception as e:  # noqa: BLE001  (reported as this pipeline's result)
            errors[name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
        finally:
            for c in contenders:
                c.runner.close()
            del contenders
            gc.collect()
            if on_cuda:
                torch.cuda.empty_cache()
    return {"results": results, "errors": errors, "size": size.describe()}


def run(
    out: Path,
    timeout_s: float,
    pipelines: Sequence[str] | None = None,
    warmup: int = WARMUP,
    steps: int = STEPS,
    block_steps: int = BLOCK_STEPS,
    device_type: str = "cuda",
    size: Any = None,
) -> dict[str, Any]:
    from benchmarks.gpu.dlrm import GPU_SIZE, TIMED_PIPELINES
    from benchmarks.gpu.parity import backend_of
    from harness.ranks import run_on_ranks

    names = list(pipelines or TIMED_PIPELINES)
    args = (names, warmup, steps, block_steps, device_type, size or GPU_SIZE)
    start = time.perf_counter()
    [got] = run_on_ranks(_rank, *args, world_size=1, backend=backend_of(device_type), timeout_s=timeout_s)
    status = "error" if got["errors"] and not got["results"] else "passed" if not got["errors"] else "failed"
    return {
        "status": status,
        "seconds": time.perf_counter() - start,
        "warmup": warmup,
        "steps": steps,
        "block_steps": block_steps,
        **got,
        **({"reason": "every pipeline raised"} if status == "error" else {}),
    }
