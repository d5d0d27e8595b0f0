"""Timelines of a few real steps and of the simulator's prediction for the same plan.

    python benchmarks/timeline.py                          # SparseDist, loader 10 ms on thread io
    python benchmarks/timeline.py --thread-map main --latency-ms 0 --pipeline TrainPipelineBase

On 2 gloo ranks, rank 0 trains our pipeline with every task wrapped in a profiler label
``## Task batch ##`` (``Engine.instrument(..., labels=True)``) and a TaskProfiler measuring each
task. After ``--warmup`` steps it records ``--steps`` steps with ``torch.profiler`` and writes:

* ``OUT/<pipeline>.real.json``: the Chrome/Perfetto trace of those steps (one track per thread;
  the labels show which task of which batch ran where, next to TorchRec's own ranges);
* ``OUT/<pipeline>.sim.json``: the simulator's replay of the same plan (same thread map) for as
  many batches, each task lasting its median measured time;
* ``OUT/<pipeline>.both.json``: the two in one trace, the prediction as process "simulated";
* a text Gantt chart of the prediction, and predicted vs measured time per step.

Open the files in https://ui.perfetto.dev or chrome://tracing. Default OUT: ``out/timeline``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import rank_setup, run_ranks
from harness.dlrm import INFO
from harness.dlrm_data import SIZES, batches


def _rank(rank: int, world_size: int, args: argparse.Namespace) -> dict[str, Any] | None:
    rank_setup()
    import torch

    from examples.dlrm.model import build_dlrm
    from examples.dlrm.train import thread_map_of
    from harness.dlrm import make_runner
    from torchrec_swp.profiler import TaskProfiler

    size = SIZES[args.size]
    runner = make_runner(
        args.pipeline, "ours", lambda: build_dlrm(rank, world_size, size), thread_map=thread_map_of(args.thread_map)
    )
    data = batches(size, rank, args.warmup + args.steps, args.latency_ms / 1000)
    plan = runner.pipeline.plan
    profiler = TaskProfiler(warmup=2)
    runner.pipeline.engine.instrument(profiler, labels=True)
    step_s = []
    try:
        for _ in range(args.warmup):
            runner.step(data)
        trace = None
        if rank == 0:
            # the engine's worker threads exist before the profiler starts: ask for every thread
            trace = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU],
                experimental_config=torch._C._profiler._ExperimentalConfig(profile_all_threads=True),
            )
        if trace is not None:
            trace.start()
        for _ in range(args.steps):
            start = time.perf_counter()
            progressed = runner.pipeline.progress(data)
            step_s.append(time.perf_counter() - start)  # the plan's work: StagedTrainPipeline's caller trains after
            runner.finish(progressed)
        if trace is not None:
            trace.stop()
    finally:
        runner.pipeline.engine.instrument()
        runner.close()
    if rank != 0:
        return None
    args.out.mkdir(parents=True, exist_ok=True)
    real = args.out / f"{args.pipeline}.real.json"
    trace.export_chrome_trace(str(real))
    return {
        "plan": plan.to_text(),
        "durations": profiler.profile(plan).durations(),
        "measured_step_s": statistics.median(step_s),
        "real": str(real),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--pipeline", default="TrainPipelineSparseDist", choices=list(INFO), help="(default: %(default)s)"
    )
    parser.add_argument(
        "--thread-map",
        default="io",
        help="main, by_stream, per_task, io (stage-0 tasks on thread io) or a JSON object (default: %(default)s)",
    )
    parser.add_argument(
        "--latency-ms", type=float, default=10.0, help="loader latency per batch (default: %(default)s)"
    )
    parser.add_argument("--size", choices=list(SIZES), default="small", help="(default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=20, help="steps before recording (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=6, help="steps recorded (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=Path("out/timeline"), help="output folder (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 4 or args.latency_ms < 0:
        parser.error("--steps must be >= 1, --warmup >= 4 (the profiler needs complete iterations), --latency-ms >= 0")
    from harness.dlrm import not_exported

    if args.pipeline in not_exported():
        parser.error(not_exported()[args.pipeline])

    from torchrec_swp.plan import PipelinePlan
    from torchrec_swp.sim import format_timeline, simulate, to_chrome_trace

    got = run_ranks(_rank, args)
    plan = PipelinePlan.from_text(got["plan"])
    result = simulate(plan, got["durations"], args.steps + plan.max_stage)
    sim_trace = to_chrome_trace(result, us_per_unit=1e6)
    sim = args.out / f"{args.pipeline}.sim.json"
    sim.write_text(json.dumps(sim_trace))
    both = args.out / f"{args.pipeline}.both.json"
    both.write_text(json.dumps(_merged(json.loads(Path(got["real"]).read_text()), sim_trace)))
    print(format_timeline(result))
    predicted = result.steady_iteration_time
    print(
        f"\nper progress() call: measured median {1e3 * got['measured_step_s']:.2f} ms, simulated steady iteration "
        + (f"{1e3 * predicted:.2f} ms" if predicted is not None else "n/a (too few steps)")
    )
    print("task medians (ms): " + ", ".join(f"{t} {1e3 * d:.2f}" for t, d in got["durations"].items()))
    print(
        f"wrote {got['real']} (real steps, with '## Task batch ##' labels), {sim} (simulated) "
        f"and {both} (the two together)"
    )


def _merged(real: dict[str, Any], sim: dict[str, Any]) -> dict[str, Any]:
    """The real trace with the simulated one added as another process, both starting together
    (the simulation starts at its first batch, the real steps in the steady state)."""
    labels = [e["ts"] for e in real["traceEvents"] if str(e.get("name", "")).startswith("## ") and "ts" in e]
    offset = min(labels, default=0.0)
    pid = "simulated"
    shifted = [{**e, "pid": pid, **({"ts": e["ts"] + offset} if "ts" in e else {})} for e in sim["traceEvents"]]
    return {**real, "traceEvents": [*real["traceEvents"], *shifted]}


if __name__ == "__main__":
    main()
