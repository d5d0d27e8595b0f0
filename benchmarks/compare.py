"""Upstream TorchRec's pipelines against torchrec_swp's, side by side, on DLRM at a few sizes.

    python benchmarks/compare.py                                  # every pipeline, 3 sizes
    python benchmarks/compare.py --sizes small --pipelines TrainPipelineBase,TrainPipelineSparseDist --steps 100
    python benchmarks/compare.py --ranks 1 --sizes small --compiled-sizes none     # the engine's own cost, sharper

For every size and every pipeline that runs on CPU, both implementations train their own copy of
the same DLRM (same initial weights, same synthetic data) on 2 gloo ranks (``--ranks``), interleaved call by
call; the first ``--warmup`` steps are dropped. Per pipeline: median and P90 step time, QPS
(examples per second over both ranks, at the median step) and the ratio ours/upstream of the
medians; whether the losses of every step were identical; and, for our engine, the pipeline
overhead: time in ``progress()`` outside the tasks themselves, measured in a separate pass of
``--overhead-steps`` steps with an observer attached (so that the timed pass runs bare). The
overhead is reported net of the observer's own cost, calibrated on a bare engine.

``--ranks 1``: one rank with both cores to itself. Without a second rank contending for the
cores and waiting in every collective, the 95% intervals of the ratio are several times narrower
than with 2 ranks (about +-1% against +-5% on this machine): what the engine's own work costs per
step shows, where with 2 ranks it is below the noise.

Upstream pipelines that fail on CPU as shipped run under the repository's test-only CPU patch
(marked "patched"); pipelines torchrec_swp does not export yet are skipped and listed.

Shortcut: on a CPU device the compiler removes every stream wait and event record
(the device has no streams), so a single-thread plan is a plain list of calls. For
TrainPipelineSparseDist the benchmark also times ours against ours compiled *with* the stream
syncs, run through torch.cpu's dummy streams and events: the difference is what the removal saves.

Writes ``OUT/compare.json``, ``OUT/compare.md`` and ``OUT/compare.png`` (default ``out/bench``).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (
    Contender,
    StepAccounting,
    instrumentation_cost_s,
    interleave,
    rank_setup,
    ratio_interval,
    release,
    run_ranks,
    size_arg,
    step_stats,
    write_json,
)
from benchmarks.report import load_average
from harness.dlrm import INFO, PIPELINES
from harness.dlrm_data import SIZES, batches

SHORTCUT_PIPELINE = "TrainPipelineSparseDist"


# ------------------------------------------------------------------------------ in each rank
class CpuEventStreamPool:
    """The stream syncs a CPU port would keep without the compiler's removal: torch.cpu's dummy
    streams and events (their calls do nothing, but they are made, and the program is no longer flat)."""

    has_streams = True

    def stream(self, name: str) -> Any:
        import torch

        return torch.cpu.current_stream()

    def context(self, name: str) -> Any:
        import torch

        return torch.cpu.stream(torch.cpu.current_stream())

    def record(self, name: str) -> Any:
        import torch

        event = torch.cpu.Event()
        event.record()
        return event

    def wait(self, name: str, event: Any) -> None:
        import torch

        torch.cpu.current_stream().wait_event(event)

    def thread_init(self) -> None:
        return None


def _pair(name: str, rank: int, world_size: int, size_name: str, args: argparse.Namespace, tick: Any) -> dict[str, Any]:
    """Upstream vs ours for one pipeline and size, then our overhead pass."""
    from examples.dlrm.model import build_dlrm
    from harness.dlrm import make_runner

    size = SIZES[size_name]
    total = args.warmup + args.steps
    build = lambda: build_dlrm(rank, world_size, size)
    upstream = Contender(
        "upstream", make_runner(name, "upstream", build, upstream_patch=True), batches(size, rank, total)
    )
    try:
        ours = Contender("ours", make_runner(name, "ours", build), batches(size, rank, total + args.overhead_steps))
    except BaseException:
        release(upstream)
        raise
    try:
        interleave([upstream, ours], total, tick)
        records = _overhead_pass(ours, args.overhead_steps, tick)
    finally:
        release(upstream, ours)
    examples = size.batch_size * world_size
    up, us = (step_stats(c.times[args.warmup :], examples) for c in (upstream, ours))
    return {
        "size": size_name,
        "pipeline": name,
        "upstream_patched": bool(INFO[name].upstream_fails),
        "upstream": up,
        "ours": us,
        "ratio": us["median_ms"] / up["median_ms"],
        "ratio_95": ratio_interval(upstream.times[args.warmup :], ours.times[args.warmup :]),
        "same_losses": upstream.losses == ours.losses,
        "steps_measured": args.steps,
        "overhead": records,
    }


def _overhead_pass(ours: Contender, steps: int, tick: Any) -> dict[str, float]:
    """``steps`` more steps of ours alone with StepAccounting attached; medians per step (us).
    Only ``progress()`` is timed (StagedTrainPipeline's caller then trains outside it)."""
    import time

    engine = ours.runner.pipeline.engine
    acc = StepAccounting()
    engine.instrument(acc)
    records = []
    try:
        for _ in range(steps):
            start = time.perf_counter()
            progressed = ours.runner.pipeline.progress(ours.batches)
            records.append(acc.take(time.perf_counter() - start))
            ours.runner.finish(progressed)
            tick()
    finally:
        engine.instrument()
    med = lambda xs: 1e6 * statistics.median(xs)
    return {
        "step_us": med([r.step for r in records]),
        "overhead_us": med([r.overhead for r in records]),
        "task_calls": statistics.median([r.task_calls for r in records]),
        "threads": len(engine.plan.thread_groups),
    }


def _shortcut(rank: int, world_size: int, size_name: str, args: argparse.Namespace, tick: Any) -> dict[str, Any]:
    """Ours as shipped (stream syncs removed on CPU) vs ours keeping them, TrainPipelineSparseDist."""
    from contextlib import ExitStack

    import torch

    import torchrec_swp
    from examples.dlrm.model import build_dlrm
    from harness.dlrm import Runner, make_runner
    from torchrec_swp.compile import CompiledPlan, RecordEvent, WaitStream

    size = SIZES[size_name]
    total = args.warmup + args.steps
    keeping = type(
        "TrainPipelineSparseDistKeepingStreamSyncs",
        (torchrec_swp.TrainPipelineSparseDist,),
        {"_swp_streams": lambda self: CpuEventStreamPool()},
    )
    model, optimizer = build_dlrm(rank, world_size, size)
    kept = Contender(
        "syncs kept",
        Runner(
            INFO[SHORTCUT_PIPELINE],
            "ours",
            keeping(model, optimizer, torch.device("cpu")),
            model,
            optimizer,
            ExitStack(),
        ),
        batches(size, rank, total),
    )
    removed = Contender(
        "ours",
        make_runner(SHORTCUT_PIPELINE, "ours", lambda: build_dlrm(rank, world_size, size)),
        batches(size, rank, total),
    )
    try:
        plan = removed.runner.pipeline.plan
        interleave([removed, kept], total, tick)
    finally:
        release(removed, kept)
    steady = plan.max_stage  # the first iteration with every stage active
    syncs = sum(
        isinstance(i, (WaitStream, RecordEvent))
        for _, instrs in CompiledPlan(plan, device_streams=True).program(steady, None).threads
        for i in instrs
    )
    examples = size.batch_size * world_size
    a, b = (step_stats(c.times[args.warmup :], examples) for c in (removed, kept))
    return {
        "size": size_name,
        "pipeline": SHORTCUT_PIPELINE,
        "syncs_removed_per_iteration": syncs,
        "flat_when_removed": CompiledPlan(plan).program(steady, None).flat,
        "removed": a,
        "kept": b,
        "saving_us": 1e3 * (b["median_ms"] - a["median_ms"]),
        "saving_pct": 100 * (b["median_ms"] - a["median_ms"]) / b["median_ms"],
        "same_losses": removed.losses == kept.losses,
    }


def _engine_only_shortcut(iterations: int = 3000) -> dict[str, float]:
    """The same removal on the bare engine: TrainPipelineSparseDist's plan with trivial tasks,
    compiled for the CPU (no syncs, flat) vs with the syncs kept (CpuEventStreamPool); microseconds
    per iteration, best of 5. Shows the saving without the model's noise around it."""
    import time

    from torchrec_swp.catalog.torchrec import sparse_dist_plan
    from torchrec_swp.engine import Engine

    plan = sparse_dist_plan()

    def bindings() -> dict[str, Any]:
        def fn_for(task: str) -> Any:
            writes = plan.tasks[task].writes

            def fn(b: int, **_: Any) -> Any:
                if task == plan.source and b >= iterations:
                    raise StopIteration
                return None if not writes else b if len(writes) == 1 else (b,) * len(writes)

            return fn

        return {t: fn_for(t) for t in plan.fire_order}

    def per_iteration_us(streams: Any) -> float:
        engine = Engine(plan, bindings(), streams=streams, name="swp-shortcut")
        start = time.perf_counter()
        try:
            engine.run_to_end()
        finally:
            engine.close()
        return 1e6 * (time.perf_counter() - start) / (iterations + plan.max_stage)

    removed = min(per_iteration_us(None) for _ in range(5))
    kept = min(per_iteration_us(CpuEventStreamPool()) for _ in range(5))
    return {"removed_us": removed, "kept_us": kept}


def _noop_copy_us(size_name: str) -> float:
    """Time of the H2D copy of a batch that is already on the CPU (``Batch.to(cpu)``, which
    returns the same tensors in new objects): what removing that no-op task would save per step.
    Microseconds, best of 5 x 200."""
    import timeit

    import torch

    batch = next(batches(SIZES[size_name], 0, 1))
    cpu = torch.device("cpu")
    return 1e6 * min(timeit.repeat(lambda: batch.to(cpu, non_blocking=True), number=200, repeat=5)) / 200


def _rank(rank: int, world_size: int, args: argparse.Namespace, plan: list[tuple[str, str]]) -> dict[str, Any]:
    rank_setup()
    from tqdm import tqdm

    per_pair = args.warmup + args.steps
    total = sum(per_pair + (args.overhead_steps if what != "shortcut" else 0) for what, _ in plan)
    bar = tqdm(total=total, disable=rank != 0, unit="step", mininterval=1.0, dynamic_ncols=True, file=sys.stdout)
    results, shortcut = [], []
    try:
        for what, size_name in plan:
            bar.set_description(f"{size_name} {what}")
            if what == "shortcut":
                shortcut.append(_shortcut(rank, world_size, size_name, args, bar.update))
            else:
                results.append(_pair(what, rank, world_size, size_name, args, bar.update))
    finally:
        bar.close()
    return {"results": results, "shortcut": shortcut, "instrumentation_us_per_task": 1e6 * instrumentation_cost_s()}


# ---------------------------------------------------------------------------------- reports
def _markdown(report: dict[str, Any]) -> str:
    meta = report["meta"]
    cost = report["instrumentation_us_per_task"]
    lines = [
        "# Upstream TorchRec vs torchrec_swp: step time on DLRM",
        "",
        f"{meta['date']}, {meta['machine']}; {meta['command']}",
        (
            f"{meta.get('ranks', 2)} gloo rank(s); {meta['warmup']} warm-up + {meta['steps']} measured steps "
            "per pipeline, "
            "interleaved call by call; "
            f"load average {meta['load_before']} before, {meta['load_after']} after."
        ),
        "",
        "Sizes: " + "; ".join(f"**{n}**: {SIZES[n].describe()}" for n in meta["sizes"]) + ".",
        "",
        (
            "| size | pipeline | upstream median / P90 ms | ours median / P90 ms | upstream QPS | ours QPS "
            "| ours / upstream (95% interval) | "
            "overhead per step (share of progress()) | same losses |"
        ),
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        up, us, oh = r["upstream"], r["ours"], r["overhead"]
        net = oh["overhead_us"] - cost * oh["task_calls"]
        lo, hi = r["ratio_95"]
        lines.append(
            f"| {r['size']} | {r['pipeline']}{' (upstream patched)' if r['upstream_patched'] else ''}"
            f"{f' [{threads} threads]' if (threads := oh['threads']) > 1 else ''} "
            f"| {up['median_ms']:.2f} / {up['p90_ms']:.2f} | {us['median_ms']:.2f} / {us['p90_ms']:.2f} "
            f"| {up['qps']:,.0f} | {us['qps']:,.0f} | **{r['ratio']:.3f}** ({lo:.3f}-{hi:.3f}) "
            f"| {net:.0f} us ({100 * net / oh['step_us']:.2f}%) | {'yes' if r['same_losses'] else 'NO'} |"
        )
    lines += [
        "",
        (
            "*Overhead per step*: our `progress()` time outside the tasks on the calling thread, its waits for other "
            "threads and its end-of-iteration wait for them (median per step, separate instrumented pass), minus the "
            f"observer's own cost ({cost:.2f} us per task call, calibrated on a bare engine). In brackets: the "
            "threads of our default plan (the others run on the calling thread only, as upstream's do)."
        ),
    ]
    if report["shortcut"]:
        lines += [
            "",
            "## Shortcut: stream syncs removed when the plan is compiled for the CPU",
            "",
            "| size | pipeline | syncs removed per iteration | ours median ms | with syncs kept | saving per step |",
            "|---|---|---|---|---|---|",
        ]
        for s in report["shortcut"]:
            lines.append(
                f"| {s['size']} | {s['pipeline']} | {s['syncs_removed_per_iteration']} "
                f"({'flat program' if s['flat_when_removed'] else 'not flat'}) | {s['removed']['median_ms']:.2f} "
                f"| {s['kept']['median_ms']:.2f} | {s['saving_us']:.0f} us ({s['saving_pct']:.1f}%) |"
            )
        bare = report["shortcut_engine_only"]
        lines += [
            "",
            (
                f"The engine alone, same plan with trivial tasks: {bare['removed_us']:.1f} us per iteration with "
                f"the syncs removed (a flat list of calls), {bare['kept_us']:.1f} us with them kept (interpreted "
                "program, dummy CPU "
                f"events): {bare['kept_us'] - bare['removed_us']:.1f} us saved per iteration."
            ),
            "",
            "A copy of a batch already on the CPU (compiled as an alias in TrainPipelineBase and TrainPipelinePT2, "
            "whose H2D is declared noop_on cpu) costs "
            + ", ".join(f"{us:.1f} us ({size})" for size, us in report["noop_copy_us"].items())
            + " per step.",
        ]
    if report["skipped"]:
        lines += ["", "Skipped: " + "; ".join(f"{n} ({why})" for n, why in report["skipped"].items()) + "."]
    return "\n".join(lines) + "\n"


def _plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = report["meta"]["sizes"]
    fig, axes = plt.subplots(len(sizes), 1, figsize=(11, 3.2 * len(sizes)), squeeze=False)
    for ax, size in zip(axes[:, 0], sizes):
        rows = [r for r in report["results"] if r["size"] == size]
        names = [r["pipeline"].replace("TrainPipeline", "").replace("Pipeline", "") for r in rows]
        x = range(len(rows))
        up = [r["upstream"]["median_ms"] for r in rows]
        us = [r["ours"]["median_ms"] for r in rows]
        for offset, side, medians, label, color in (
            (-0.2, "upstream", up, "upstream", "#9e9e9e"),
            (0.2, "ours", us, "torchrec_swp", "#1f77b4"),
        ):
            whiskers = [[0.0] * len(rows), [r[side]["p90_ms"] - m for r, m in zip(rows, medians)]]
            ax.bar([i + offset for i in x], medians, 0.4, yerr=whiskers, capsize=2, label=label, color=color)
        tops = [max(r["upstream"]["p90_ms"], r["ours"]["p90_ms"]) for r in rows]
        for i, (r, top) in enumerate(zip(rows, tops)):
            ax.annotate(f"{r['ratio']:.2f}", (i, top), ha="center", va="bottom", fontsize=8)
        ax.set_ylim(0, 1.15 * max(tops, default=1.0))  # room for the ratios under the title
        ax.set_xticks(list(x), names, rotation=20, ha="right", fontsize=8)
        ax.set_ylabel("step time (ms)\nmedian, whisker P90")
        ax.set_title(f"{size}: {SIZES[size].describe()}   (numbers: ours / upstream)", fontsize=9)
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))  # beside the bars, not over a ratio
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--sizes", type=size_arg, default=list(SIZES), help=f"comma-separated, of {', '.join(SIZES)} (default: all)"
    )
    parser.add_argument(
        "--pipelines",
        type=lambda s: [p.strip() for p in s.split(",") if p.strip()],
        default=list(PIPELINES),
        help="comma-separated pipeline names (default: all 12; TrainPipelinePEC on TorchRec 1.9 only)",
    )
    parser.add_argument(
        "--compiled-sizes",
        type=lambda s: [] if s == "none" else size_arg(s),
        default=["small"],
        help="sizes for TrainPipelinePT2 and TrainPipelineSparseDistCompAutograd, whose first steps compile "
        "for tens of seconds (default: small; none to skip them)",
    )
    parser.add_argument(
        "--steps", type=int, default=200, help="measured steps per pipeline and size (default: %(default)s)"
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=20,
        help="dropped steps (default: %(default)s; the compiled pipelines compile in them)",
    )
    parser.add_argument(
        "--overhead-steps", type=int, default=50, help="steps of the instrumented pass (default: %(default)s)"
    )
    parser.add_argument(
        "--ranks", type=int, choices=(1, 2), default=2, help="gloo ranks, each with its copy (default: %(default)s)"
    )
    parser.add_argument("--no-shortcut", action="store_true", help="skip the stream-sync removal measurement")
    parser.add_argument("--out", type=Path, default=Path("out/bench"), help="output folder (default: %(default)s)")
    args = parser.parse_args(argv)
    unknown = [p for p in args.pipelines if p not in INFO]
    if unknown:
        parser.error(f"unknown pipeline {unknown[0]!r}; choose among {', '.join(PIPELINES)}")
    if args.steps < 1 or args.warmup < 0 or args.overhead_steps < 1:
        parser.error("--steps and --overhead-steps must be >= 1, --warmup >= 0")

    from harness.dlrm import not_exported

    skipped = {n: why for n, why in not_exported().items() if n in args.pipelines}
    for n, why in skipped.items():
        print(f"skipping {n}: {why}")
    pipelines = [p for p in args.pipelines if p not in skipped]
    # the compiled pipelines change global dynamo settings: run them last in each rank
    pipelines.sort(key=lambda p: INFO[p].compiles)
    plan = [(p, s) for s in args.sizes for p in pipelines if not INFO[p].compiles]
    if not args.no_shortcut and SHORTCUT_PIPELINE in pipelines:
        plan += [("shortcut", s) for s in args.sizes]
    plan += [(p, s) for s in args.compiled_sizes for p in pipelines if INFO[p].compiles]
    if not plan:
        parser.error("nothing to run: every pipeline asked for is skipped")

    load_before = load_average()
    report = run_ranks(_rank, args, plan, world_size=args.ranks)
    report["skipped"] = skipped
    if any(what == "shortcut" for what, _ in plan):
        report["shortcut_engine_only"] = _engine_only_shortcut()
        report["noop_copy_us"] = {size: _noop_copy_us(size) for what, size in plan if what == "shortcut"}
    report["meta"] = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "command": "python benchmarks/compare.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "sizes": list(dict.fromkeys(s for _, s in plan)),
        "ranks": args.ranks,
        "steps": args.steps,
        "warmup": args.warmup,
        "load_before": load_before,
        "load_after": load_average(),
    }
    write_json(args.out / "compare.json", report)
    (args.out / "compare.md").write_text(_markdown(report))
    _plot(report, args.out / "compare.png")
    print((args.out / "compare.md").read_text())
    print(f"wrote {args.out / 'compare.json'}, {args.out / 'compare.md'}, {args.out / 'compare.png'}")


if __name__ == "__main__":
    main()
