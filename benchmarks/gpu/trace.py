"""Part (d): a torch.profiler trace of our TrainPipelineSparseDist on one GPU, with the default
plan and with ``thread_map={"H2D": "io"}``, and from each trace's events how much of the H2D
(memcpy stream) and input-dist (data_dist stream, and NCCL's) device work ran while the compute
stream was busy, per step (``overlap.overlap_summary``).

Each trace is written gzipped (``trace_<label>.json.gz``; Perfetto and chrome://tracing open it):
CPU threads with the engine's ``## Task batch ##`` labels, CUDA launches, kernels and copies per
stream.
"""

from __future__ import annotations

import gzip
import json
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

WARMUP = 20
STEPS = 10
CONFIGS: dict[str, dict[str, str] | None] = {"default": None, "H2D on io": {"H2D": "io"}}
"""Label -> thread_map of the plans traced (None: the default plan, every task on the calling thread)."""


def _file_label(label: str) -> str:
    return "".join(ch if ch.isalnum() else "_" for ch in label)


def _trace_one(
    label: str, thread_map: dict[str, str] | None, run: dict[str, Any], rank: int, world_size: int
) -> dict[str, Any]:
    import torch

    from benchmarks.gpu.dlrm import LOOKAHEAD, make_gpu_runner, pinned_batches
    from benchmarks.gpu.overlap import overlap_summary
    from benchmarks.gpu.parity import device_of

    out, warmup, steps, size = Path(run["out"]), run["warmup"], run["steps"], run["size"]
    device = device_of(run["device_type"], rank)
    on_cuda = device.type == "cuda"

    def sync() -> None:
        if on_cuda:
            torch.cuda.synchronize(device)

    runner = make_gpu_runner("TrainPipelineSparseDist", "ours", device, rank, world_size, size, thread_map=thread_map)
    data = pinned_batches(size, rank, warmup + steps + LOOKAHEAD, pin=on_cuda)  # every traced step in steady state
    engine = runner.pipeline.engine
    tasks = engine.plan.fire_order
    engine.instrument(labels=True)
    step_s = []
    try:
        for _ in range(warmup):
            runner.step(data)
        sync()
        activities = [torch.profiler.ProfilerActivity.CPU]
        if on_cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        profiler = torch.profiler.profile(
            activities=activities,
            # the engine's worker threads exist before the profiler starts: ask for every thread
            experimental_config=torch._C._profiler._ExperimentalConfig(profile_all_threads=True),
        )
        with profiler:
            for _ in range(steps):
                start = time.perf_counter()
                runner.step(data)
                sync()
                step_s.append(time.perf_counter() - start)
    finally:
        engine.instrument()
        runner.close()
    raw = out / f"trace_{_file_label(label)}.json"
    profiler.export_chrome_trace(str(raw))
    events = json.loads(raw.read_text())["traceEvents"]
    packed = raw.with_suffix(".json.gz")
    with raw.open("rb") as src, gzip.open(packed, "wb") as dst:
        shutil.copyfileobj(src, dst)
    raw.unlink()
    return {
        "label": label,
        "thread_map": thread_map,
        "trace": packed.name,
        "step_ms": 1e3 * statistics.median(step_s),
        "overlap": overlap_summary(events, steps, tasks),
    }


def _rank(rank: int, world_size: int, run: dict[str, Any]) -> dict[str, Any]:
    from benchmarks.common import rank_setup

    rank_setup()
    configs = [_trace_one(label, tm, run, rank, world_size) for label, tm in CONFIGS.items()]
    return {"configs": configs, "size": run["size"].describe()}


def status_of(configs: list[dict[str, Any]]) -> str:
    """passed if, in some traced plan, H2D or input-dist device work overlapped compute."""
    overlapped = any(v > 0 for c in configs for v in c["overlap"]["overlap_us_per_step"].values())
    return "passed" if overlapped else "failed"


def run(
    out: Path, timeout_s: float, warmup: int = WARMUP, steps: int = STEPS, device_type: str = "cuda", size: Any = None
) -> dict[str, Any]:
    from benchmarks.gpu.dlrm import GPU_SIZE
    from benchmarks.gpu.parity import backend_of
    from harness.ranks import run_on_ranks

    run = {"out": str(out), "warmup": warmup, "steps": steps, "device_type": device_type, "size": size or GPU_SIZE}
    start = time.perf_counter()
    [got] = run_on_ranks(_rank, run, world_size=1, backend=backend_of(device_type), timeout_s=timeout_s)
    return {
        "status": status_of(got["configs"]),
        "seconds": time.perf_counter() - start,
        "steps": steps,
        **got,
        **({} if status_of(got["configs"]) == "passed" else {"reason": "no H2D or input-dist work overlapped compute"}),
    }
