"""What tuning costs a job, end to end: fresh runs of ``--steps`` steps, with and without
``autotune=True``, against the default plan, the best hand-picked plan and upstream.

    python benchmarks/tuning_cost.py                          # 2 ranks, 60 steps, a loader sleeping 8 ms, 3 rounds
    python benchmarks/tuning_cost.py --steps 1000 --rounds 2  # a job long enough for tuning to pay

A user's short job meets the tuner whole: its warm-up, its profile, its search (on rank 0), its
trial and its switch all fall inside the run, and a run that ends before the tuner has decided
pays for the tuning without its gain. ``benchmarks/overlap.py`` times a tuned pipeline after
its tuning; this script times the run a user would see.

Each contender is built anew in every round (the rounds interleave the contenders, the order
rotating each round): the model (the same seed everywhere), its pipeline and its data, then
``--steps`` calls of ``progress()``. Its **wall** time runs from the first call to the end of
the last, on rank 0, after a barrier (construction, the same for every contender, is not in it);
every call's time is kept. The contenders:

* ``upstream``: TorchRec's pipeline over the loader's iterator;
* ``ours``: our pipeline, its default plan (upstream's schedule), over a ``MapSource`` of the same
  dataset (one draw at a time, in order: the same loader work as an iterator);
* ``ours+2loads``: the hand-picked plan (``with_parallel_loads(plan, 2)``): two draws at once;
* ``ours+autotune``: ``autotune=True`` (the defaults, quiet) over the same ``MapSource``;
* ``ours+autotune+len``: ``Autotune(job_steps=--steps)``: a user who says how long the job is
  (a job shorter than a tuning runs its own plan untuned).

Reported per contender: the median over rounds of the wall time, of the median step and of the
longest step, and the longest step against the default plan's median step (the stall a user
sees), and ``ours+autotune``'s decision line(s). Every contender must give the same loss at
every step. Writes ``OUT/tuning_cost.json`` and ``OUT/tuning_cost.md`` (default ``out/bench``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import percentile, rank_setup, run_ranks, write_json
from benchmarks.report import run_meta
from examples.dlrm.loader_work import KINDS, LoaderWork, calibrate
from harness.dlrm_data import SIZES, batches

CONTENDERS = ("upstream", "ours", "ours+2loads", "ours+autotune", "ours+autotune+len")
#: batches beyond ``--steps`` in each contender's data: a pipeline that runs ahead draws them
SPARE = 16


def _contender(label: str, rank: int, world_size: int, args: argparse.Namespace, work: LoaderWork) -> tuple[Any, Any]:
    """(runner, its data) of ``label``."""
    from benchmarks.peers import latency_dataset
    from examples.dlrm.model import build_dlrm
    from harness.dlrm import make_runner
    from torchrec_swp.data import MapSource

    size = SIZES[args.size]
    n = args.steps + SPARE
    build = lambda: build_dlrm(rank, world_size, size)
    if label == "upstream":
        return make_runner(args.pipeline, "upstream", build, upstream_patch=True), batches(size, rank, n, work)
    data = MapSource(latency_dataset(size, rank, n, work))
    if label == "ours":
        return make_runner(args.pipeline, "ours", build), data
    if label == "ours+2loads":
        from torchrec_swp.catalog.torchrec import default_plans
        from torchrec_swp.catalog.transforms import with_parallel_loads

        plan = with_parallel_loads(default_plans()[args.pipeline], 2)
        return make_runner(args.pipeline, "ours", build, plan=plan), data
    if label in ("ours+autotune", "ours+autotune+len"):
        from torchrec_swp import Autotune

        lines: list[str] = []
        length = {"job_steps": args.steps} if label == "ours+autotune+len" else {}
        tuning = Autotune(report=lines.append, **length)
        runner = make_runner(args.pipeline, "ours", build, options={"autotune": tuning})
        runner.tuner_lines = lines
        return runner, data
    raise ValueError(f"unknown contender {label!r}; choose from {', '.join(CONTENDERS)}")


def _run(label: str, rank: int, world_size: int, args: argparse.Namespace, work: LoaderWork) -> dict[str, Any]:
    import torch.distributed as dist

    runner, data = _contender(label, rank, world_size, args, work)
    it = iter(data) if hasattr(data, "__iter__") and not hasattr(data, "__next__") else data
    times: list[float] = []
    losses: list[float] = []
    if world_size > 1:
        dist.barrier()
    start = time.perf_counter()
    for _ in range(args.steps):
        t = time.perf_counter()
        out = runner.step(it)
        times.append(time.perf_counter() - t)
        losses.append(float(out[0]))
    wall = time.perf_counter() - start
    decision = getattr(getattr(runner, "pipeline", None), "autotune_decision", None)
    lines = list(getattr(runner, "tuner_lines", []))
    runner.close()
    return {
        "times": times,
        "losses": losses,
        "wall_s": wall,
        "decided": None if decision is None else bool(decision.decided),
        "switched": None if decision is None else bool(decision.switched),
        "lines": lines,
    }


def _rank(rank: int, world_size: int, args: argparse.Namespace) -> dict[str, Any]:
    import gc

    rank_setup()
    work = calibrate(args.loader, args.latency_ms, rank=rank)
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in args.contenders}
    for r in range(args.rounds):
        order = args.contenders[r % len(args.contenders) :] + args.contenders[: r % len(args.contenders)]
        for label in order:
            runs[label].append(_run(label, rank, world_size, args, work))
            gc.collect()
            if rank == 0:
                w = runs[label][-1]["wall_s"]
                print(f"[tuning_cost] round {r + 1}/{args.rounds} {label}: {w:.2f} s", file=sys.stderr, flush=True)
    return {"runs": runs}


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per contender: medians over rounds of the wall time, the median step and the longest step;
    the longest step against the default plan's median step; whether every loss matched."""
    ref = runs.get("ours") or next(iter(runs.values()))
    default_median = statistics.median(statistics.median(r["times"]) for r in ref)
    losses = [r["losses"] for rs in runs.values() for r in rs]
    rows = {}
    for label, rs in runs.items():
        walls = [r["wall_s"] for r in rs]
        rows[label] = {
            "wall_s": statistics.median(walls),
            "walls_s": walls,
            "median_step_ms": 1e3 * statistics.median(statistics.median(r["times"]) for r in rs),
            "p99_step_ms": 1e3 * statistics.median(percentile(r["times"], 0.99) for r in rs),
            "max_step_ms": 1e3 * max(max(r["times"]) for r in rs),
            "max_over_default_median": max(max(r["times"]) for r in rs) / default_median,
            "decided": [r["decided"] for r in rs],
            "lines": rs[-1]["lines"],
        }
    same = all(ls == losses[0] for ls in losses)
    return {"rows": rows, "same_losses": same, "default_median_ms": 1e3 * default_median}


def markdown(summary: dict[str, Any], args: argparse.Namespace, meta: dict[str, Any]) -> str:
    rows = summary["rows"]
    base = rows.get("ours", {}).get("wall_s")
    out = [
        f"# Tuning cost: {args.steps} steps, {args.ranks} rank(s), {args.loader} loader {args.latency_ms:g} ms, "
        f"{args.pipeline} ({args.size}), {args.rounds} rounds",
        "",
        f"{meta['date']}: `{meta['command']}`",
        "",
        f"Same losses at every step in every run: {'yes' if summary['same_losses'] else 'NO'}. "
        f"The default plan's median step: {summary['default_median_ms']:.2f} ms.",
        "",
        "| contender | wall s (median) | walls s | vs ours | median step ms | p99 step ms | longest step ms | "
        "longest / default median |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, r in rows.items():
        ratio = f"{r['wall_s'] / base:.3f}" if base else "-"
        walls = ", ".join(f"{w:.2f}" for w in r["walls_s"])
        out.append(
            f"| {label} | {r['wall_s']:.2f} | {walls} | {ratio} | {r['median_step_ms']:.2f} | {r['p99_step_ms']:.2f} | "
            f"{r['max_step_ms']:.1f} | {r['max_over_default_median']:.1f}x |"
        )
    for label in ("ours+autotune", "ours+autotune+len"):
        tuned = rows.get(label)
        if tuned is not None:
            out += ["", f"The tuner's lines, {label} (rank 0, the last round):", ""]
            out += [f"    {line}" for line in tuned["lines"]] or ["    (none)"]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2, help="(default: %(default)s)")
    parser.add_argument("--steps", type=int, default=60, help="progress() calls per run (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each contender (default: %(default)s)")
    parser.add_argument("--loader", choices=KINDS, default="sleep", help="loader work kind (default: %(default)s)")
    parser.add_argument("--latency-ms", type=float, default=8.0, help="loader work per batch (default: %(default)s)")
    parser.add_argument("--size", choices=tuple(SIZES), default="small", help="(default: %(default)s)")
    parser.add_argument("--pipeline", default="TrainPipelineSparseDist", help="(default: %(default)s)")
    parser.add_argument(
        "--contenders",
        type=lambda s: [c.strip() for c in s.split(",") if c.strip()],
        default=list(CONTENDERS),
        help=f"(default: {','.join(CONTENDERS)})",
    )
    parser.add_argument("--out", type=Path, default=Path("out/bench"), help="output folder (default: %(default)s)")
    args = parser.parse_args(argv)
    unknown = [c for c in args.contenders if c not in CONTENDERS]
    if unknown:
        parser.error(f"unknown contenders {', '.join(unknown)}; choose from {', '.join(CONTENDERS)}")
    if args.steps < 1 or args.rounds < 1 or args.ranks < 1:
        parser.error("--steps, --rounds and --ranks must be at least 1")
    result = run_ranks(_rank, args, world_size=args.ranks)
    summary = summarize(result["runs"])
    keys = ("ranks", "steps", "rounds", "loader", "latency_ms", "size", "pipeline")
    meta = run_meta("tuning_cost.py", argv, args, *keys)
    write_json(args.out / "tuning_cost.json", {"meta": meta, "args": vars(args) | {"out": str(args.out)}, **summary})
    text = markdown(summary, args, meta)
    (args.out / "tuning_cost.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
