"""Close the auto-scheduler's loop on the DLRM example by hand: profile -> search -> run.

    python benchmarks/close_loop.py             # the example's DLRM, SparseDist, loader 10 ms (about 2 min)
    python benchmarks/close_loop.py --quick     # small DLRM, fewer steps (about 1 min)
    python benchmarks/close_loop.py --pipeline TrainPipelineBase --latency-ms 5

What a self-tuning pipeline (``autotune=True``) does inside one run, done here in steps that can
be looked at one by one:

1. **Profile.** 2 gloo ranks train the DLRM with our pipeline at its default plan (its draw split
   off on the calling thread, as the tuner starts), over a ``MapSource`` (so parallel loads are
   on the table), in blocks of consecutive steps, a TaskProfiler on each rank
   (``benchmarks/profiled.py``); each rank's profile is saved (``OUT/close_loop/rank<r>.profile.json``,
   what ``python -m torchrec_swp.autosched --profile`` reads).
2. **Search.** ``autosched.overlap.search_overlap`` on every rank's calibrated costs
   (``autosched.inputs.from_profiles``): threads, lookahead, parallel loads; the found plan goes to
   ``OUT/close_loop/found.plan``, with why it wins.
3. **Run.** 2 ranks train the default plan and the found plan in blocks; measured mean steps
   (rank 0), the same losses at every step, and the prediction's error.

Writes ``OUT/close_loop.json``/``.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import rank_setup
from benchmarks.profiled import ProfiledRun, inputs_of, predicted_step, profile_blocks
from benchmarks.report import add_train_pipeline_arg, run_meta, write_report
from examples.dlrm.model import DlrmSize
from harness.dlrm_data import SIZES


def _size(name: str) -> DlrmSize:
    return DlrmSize() if name == "example" else SIZES[name]


def _rank(rank: int, world_size: int, args: argparse.Namespace, plans: list[str | None]) -> list[ProfiledRun]:
    """Train one copy per plan (None: the default plan, its draw split off), in blocks, profiled."""
    rank_setup()
    from benchmarks.peers import latency_dataset
    from examples.dlrm.model import build_dlrm
    from harness.dlrm import make_runner
    from torchrec_swp import plans as edits
    from torchrec_swp.autotune.agreement import machine
    from torchrec_swp.data import MapSource
    from torchrec_swp.plan import MAIN_THREAD, PipelinePlan

    size = _size(args.size)
    host, cores = machine()
    total = args.warmup + args.rounds * args.block + 8
    runners, data = [], []
    try:
        for text in plans:
            if text is None:
                split = lambda p: edits.with_parallel_loads(p, 1, lookahead=0, thread=MAIN_THREAD)  # noqa: E731
                runner = make_runner(args.pipeline, "ours", lambda: build_dlrm(rank, world_size, size), edit_plan=split)
            else:
                plan = PipelinePlan.from_text(text)
                runner = make_runner(args.pipeline, "ours", lambda: build_dlrm(rank, world_size, size), plan=plan)
            runners.append(runner)
            data.append(MapSource(latency_dataset(size, rank, total, args.latency_ms / 1000)))
        where = lambda r: dict(  # noqa: E731
            rank=rank, world_size=world_size, host=host, cores=cores, split_draws=True
        )
        labels = ["default" if t is None else "found" for t in plans]
        return profile_blocks(
            labels, runners, data, warmup=args.warmup, rounds=args.rounds, block=args.block, skip=args.skip, where=where
        )
    finally:
        for r in runners:
            r.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_train_pipeline_arg(parser)
    parser.add_argument("--quick", action="store_true", help="small DLRM, 2 rounds of 40 steps")
    parser.add_argument(
        "--size", choices=["example", *SIZES], default=None, help="DLRM size (default: example, --quick small)"
    )
    parser.add_argument("--latency-ms", type=float, default=10.0, help="loader latency (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds of blocks (default: 3, --quick 2)")
    parser.add_argument("--block", type=int, default=None, help="steps per block (default: 60, --quick 40)")
    parser.add_argument("--warmup", type=int, default=None, help="(default: 20, --quick 10)")
    parser.add_argument("--out", type=Path, default=Path("out/bench"), help="output folder (default: %(default)s)")
    args = parser.parse_args(argv)
    args.size = args.size or ("small" if args.quick else "example")
    args.rounds = args.rounds or (2 if args.quick else 3)
    args.block = args.block or (40 if args.quick else 60)
    args.skip = args.block // 3
    args.warmup = args.warmup if args.warmup is not None else (10 if args.quick else 20)
    if args.block < 12 or args.warmup < 2 or args.latency_ms < 0 or args.rounds < 1:
        parser.error("--block >= 12, --warmup >= 2, --rounds >= 1, --latency-ms >= 0")

    from harness.ranks import run_on_ranks
    from torchrec_swp.autosched.inputs import DEFAULT_GIL
    from torchrec_swp.autosched.overlap import Space, search_overlap
    from torchrec_swp.plans import DRAW_TASKS, INPUT_DIST_TASKS

    folder = args.out / "close_loop"
    folder.mkdir(parents=True, exist_ok=True)

    print(f"1/3 profile: {args.pipeline}, default plan, 2 ranks", flush=True)
    before = [runs[0] for runs in run_on_ranks(_rank, args, [None], timeout_s=3600.0)]
    for r, run in enumerate(before):
        (folder / f"rank{r}.profile.json").write_text(json.dumps(run.profile().to_json(), indent=1) + "\n")
    inputs = inputs_of(before, gil=DEFAULT_GIL)  # as the tuner and the CLI model the GIL
    start = before[0].profile().plan
    print(before[0].profile().format_table())

    print("2/3 search: threads, lookahead, parallel loads", flush=True)
    space = Space(loads=(1, 2, 3) if start.source in DRAW_TASKS else (1,), split_draws=True, own_group=())
    found_result = search_overlap(start, inputs.calibration, inputs.machine, space)
    found = found_result.plan.replace(name=f"{start.name}_found")
    found.save(str(folder / "found.plan"))
    print(found_result.format())
    print(found.format_schedule(found.max_stage + 3))

    print("3/3 run: default and found plans in blocks", flush=True)
    after = run_on_ranks(_rank, args, [None, found.to_text()], timeout_s=3600.0)
    default_run, found_run = after[0]
    own = inputs_of([runs[1] for runs in after], gil=DEFAULT_GIL)
    result = {
        "pipeline": args.pipeline,
        "size": args.size,
        "latency_ms": args.latency_ms,
        "found_plan": found.to_text(),
        "change": found_result.change,
        "why": found_result.why(),
        "input_dist_tasks": list(INPUT_DIST_TASKS),
        "measured_before_profile_ms": 1e3 * before[0].mean_step_s,
        "measured_default_ms": 1e3 * default_run.mean_step_s,
        "measured_found_ms": 1e3 * found_run.mean_step_s,
        "speedup": default_run.mean_step_s / found_run.mean_step_s,
        "predicted_default_ms": 1e3 * found_result.baseline,
        "predicted_found_ms": 1e3 * found_result.predicted,
        "error": found_result.predicted / found_run.mean_step_s - 1,
        "own_profile_replay_ms": 1e3 * predicted_step(own, mode="replay"),
        "same_losses": default_run.losses == found_run.losses,
        "search_seconds": found_result.seconds,
        "candidates": found_result.scored,
    }
    meta = run_meta("close_loop.py", argv, args, "rounds", "block", "warmup")
    write_report(args.out, "close_loop", {"meta": meta, "result": result}, _markdown(result, meta, found))


def _markdown(r: dict[str, Any], meta: dict[str, Any], found: Any) -> str:
    return "\n".join(
        [
            f"# Closing the loop on the DLRM example: {r['pipeline']}, {r['size']} DLRM, loader {r['latency_ms']:g} ms",
            "",
            f"{meta['date']}; `{meta['command']}`",
            "",
            f"Search: {r['candidates']} candidates simulated in {r['search_seconds']:.1f} s; "
            f"the change: {r['change']}.",
            "",
            *(f"- {line}" for line in r["why"]),
            "",
            "| | ms per step (mean) |",
            "|---|---|",
            f"| default plan, measured in the profiling run | {r['measured_before_profile_ms']:.2f} |",
            f"| default plan, predicted | {r['predicted_default_ms']:.2f} |",
            f"| default plan, measured in the final run | {r['measured_default_ms']:.2f} |",
            f"| found plan, predicted from the default's profiles "
            f"| **{r['predicted_found_ms']:.2f}** ({100 * r['error']:+.1f}%) |",
            f"| found plan, its own final-run profiles replayed (the model alone) | {r['own_profile_replay_ms']:.2f} |",
            f"| found plan, measured | **{r['measured_found_ms']:.2f}** |",
            "",
            f"Speed-up measured: {r['speedup']:.2f}x; same losses at every step: "
            + ("yes." if r["same_losses"] else "NO."),
            "",
            "```",
            found.format_schedule(found.max_stage + 3),
            "```",
        ]
    ) + "\n"


if __name__ == "__main__":
    main()
