"""What the engine is for: a data loader that waits on storage, overlapped with training.

    python benchmarks/overlap.py                               # latencies 5, 10, 20 ms, small DLRM
    python benchmarks/overlap.py --latencies-ms 10 --sizes small,medium --steps 300

Each batch arrives ``latency`` ms after it is asked for (a sleep, like a read from storage). Three
contenders train their own copy of the same DLRM on the same data, on 2 gloo ranks, interleaved
call by call:

* ``upstream``: TorchRec's pipeline; the loader runs in ``progress()``, in the critical path;
* ``ours``: our pipeline with its default plan (upstream's schedule, same critical path);
* ``ours+io``: our pipeline with the stage-0 tasks (load the batch, copy it to the device) on
  their own thread ``io``, so the wait overlaps the training of earlier batches.

All three must give the same loss at every step. Reported per latency: median step time and QPS
of each, the speed-up ours+io / upstream, and the efficiency against the lower bound: an
iteration cannot take less than its busiest thread's task time (the training thread's tasks,
or the io thread's loading and copying). That bound comes from a separate pass of ``ours+io``
with an observer attached (``--bound-steps``); efficiency = bound / median step time.

Targets (issue 4), for a latency of at least 30% of upstream's step: ours+io >= 1.3x upstream's
QPS and within 10% of the lower bound (efficiency >= 0.9).

Writes ``OUT/overlap.json`` and ``OUT/overlap.md`` (default ``out/bench``).
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (
    SIZES,
    Contender,
    StepAccounting,
    batches,
    interleave,
    rank_setup,
    release,
    run_ranks,
    size_arg,
    step_stats,
    write_json,
)
from examples.dlrm.pipelines import INFO


def _case(
    rank: int, world_size: int, size_name: str, latency_ms: float, args: argparse.Namespace, tick: Any
) -> dict[str, Any]:
    import time

    from examples.dlrm.model import build_dlrm
    from examples.dlrm.pipelines import make_runner
    from examples.dlrm.train import thread_map_of

    size = SIZES[size_name]
    total = args.warmup + args.steps
    latency = latency_ms / 1000
    build = lambda: build_dlrm(rank, world_size, size)
    contenders: list[Contender] = []
    try:
        for label, impl, thread_map, extra in (
            ("upstream", "upstream", None, 0),
            ("ours", "ours", None, 0),
            ("ours+io", "ours", thread_map_of("io"), args.bound_steps),
        ):
            runner = make_runner(args.pipeline, impl, build, thread_map=thread_map, upstream_patch=True)
            contenders.append(Contender(label, runner, batches(size, rank, total + extra, latency)))
        interleave(contenders, total, tick)
        io = contenders[-1]
        engine = io.runner.pipeline.engine
        acc = StepAccounting()
        engine.instrument(acc)
        records = []
        try:
            for _ in range(args.bound_steps):
                start = time.perf_counter()
                io.runner.step(io.batches)
                records.append(acc.take(time.perf_counter() - start))
                tick()
        finally:
            engine.instrument()
        threads = io.runner.pipeline.plan.thread_groups
    finally:
        release(*contenders)
    examples = size.batch_size * world_size
    stats = {c.label: step_stats(c.times[args.warmup :], examples) for c in contenders}
    bound_s = statistics.median(max(r.busy.values(), default=0.0) for r in records)
    busy = {t: 1e3 * statistics.median(r.busy.get(t, 0.0) for r in records) for t in threads}
    up, io_stats = stats["upstream"], stats["ours+io"]
    return {
        "size": size_name,
        "latency_ms": latency_ms,
        "latency_share_of_upstream_step": latency_ms / up["median_ms"],
        **stats,
        "speedup": io_stats["qps"] / up["qps"],
        "lower_bound_ms": 1e3 * bound_s,
        "busy_ms_per_thread": busy,
        "efficiency": {label: 1e3 * bound_s / s["median_ms"] for label, s in stats.items()},
        "same_losses": all(c.losses == contenders[0].losses for c in contenders),
    }


def _rank(rank: int, world_size: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    rank_setup()
    from tqdm import tqdm

    cases = [(s, lat) for s in args.sizes for lat in args.latencies_ms]
    per_case = args.warmup + args.steps + args.bound_steps
    bar = tqdm(total=per_case * len(cases), disable=rank != 0, unit="step", mininterval=1.0, file=sys.stdout)
    out = []
    try:
        for size_name, latency in cases:
            bar.set_description(f"{size_name}, loader {latency:g} ms")
            out.append(_case(rank, world_size, size_name, latency, args, bar.update))
    finally:
        bar.close()
    return out


def _markdown(results: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        f"# Overlap: {meta['pipeline']} with a loader that waits",
        "",
        f"{meta['date']}; {meta['command']}",
        (
            f"2 gloo ranks; {meta['warmup']} warm-up + {meta['steps']} measured steps, interleaved call by call; "
            f"lower bound from {meta['bound_steps']} instrumented steps of ours+io."
        ),
        "",
        (
            "| size | loader latency (share of upstream step) | upstream median ms / QPS | ours median ms / QPS "
            "| ours+io median ms / QPS | speed-up ours+io / upstream | lower bound ms (busiest thread) "
            "| efficiency upstream / ours+io | same losses |"
        ),
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        busiest = max(r["busy_ms_per_thread"], key=r["busy_ms_per_thread"].get)
        lines.append(
            f"| {r['size']} | {r['latency_ms']:g} ms ({100 * r['latency_share_of_upstream_step']:.0f}%) "
            + " ".join(f"| {r[k]['median_ms']:.2f} / {r[k]['qps']:,.0f}" for k in ("upstream", "ours", "ours+io"))
            + f" | **{r['speedup']:.2f}x** | {r['lower_bound_ms']:.2f} ({busiest}) "
            f"| {r['efficiency']['upstream']:.2f} / **{r['efficiency']['ours+io']:.2f}** "
            f"| {'yes' if r['same_losses'] else 'NO'} |"
        )
    lines += [
        "",
        "Busy time per thread of ours+io (median ms per step): "
        + "; ".join(
            f"{r['latency_ms']:g} ms: " + ", ".join(f"{t} {ms:.2f}" for t, ms in r["busy_ms_per_thread"].items())
            for r in results
        )
        + ".",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--pipeline",
        default="TrainPipelineSparseDist",
        choices=[n for n, i in INFO.items() if i.kind == "train" and not i.compiles],
        help="(default: %(default)s)",
    )
    parser.add_argument(
        "--latencies-ms",
        type=lambda s: [float(x) for x in s.split(",")],
        default=[5.0, 10.0, 20.0],
        help="comma-separated loader latencies in ms (default: 5,10,20)",
    )
    parser.add_argument(
        "--sizes", type=size_arg, default=["small"], help=f"comma-separated, of {', '.join(SIZES)} (default: small)"
    )
    parser.add_argument("--steps", type=int, default=200, help="measured steps (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=20, help="dropped steps (default: %(default)s)")
    parser.add_argument(
        "--bound-steps", type=int, default=50, help="instrumented steps for the lower bound (default: %(default)s)"
    )
    parser.add_argument("--out", type=Path, default=Path("out/bench"), help="output folder (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.bound_steps < 1 or any(x < 0 for x in args.latencies_ms):
        parser.error("--steps and --bound-steps must be >= 1, --warmup and latencies >= 0")
    from examples.dlrm.pipelines import not_exported

    if args.pipeline in not_exported():
        parser.error(not_exported()[args.pipeline])

    results = run_ranks(_rank, args)
    meta = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": "python benchmarks/overlap.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "pipeline": args.pipeline,
        "steps": args.steps,
        "warmup": args.warmup,
        "bound_steps": args.bound_steps,
    }
    write_json(args.out / "overlap.json", {"meta": meta, "results": results})
    (args.out / "overlap.md").write_text(_markdown(results, meta))
    print((args.out / "overlap.md").read_text())
    print(f"wrote {args.out / 'overlap.json'}, {args.out / 'overlap.md'}")


if __name__ == "__main__":
    main()
