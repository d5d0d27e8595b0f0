"""Close the auto-scheduler's loop on the real DLRM example: profile -> search -> run.

    python benchmarks/close_loop.py             # the example's DLRM, SparseDist, loader 10 ms (about 1 min)
    python benchmarks/close_loop.py --quick     # small DLRM, fewer steps, a narrower search (about 30 s)
    python benchmarks/close_loop.py --pipeline TrainPipelineBase --latency-ms 5

1. **Profile.** 2 gloo ranks train the DLRM of ``examples/dlrm`` with our pipeline at its
   default plan, a TaskProfiler on each rank; each rank's profile is saved
   (``OUT/close_loop/rank<r>.profile.json``, what ``python -m torchrec_swp.autosched --profile``
   reads) and every rank's costs are calibrated (``benchmarks/profiled.py``: collectives taken
   after the last rank arrived, the loader's latency off the CPU, 2 cores shared by both ranks).
2. **Search.** ``autosched.beam_search`` on rank 0's profile, its candidates scored by the
   multi-rank simulator (``simulate_ranks`` of both calibrated ranks running the candidate, the
   measured iterations replayed; ``--score-mode median``: every task at its median) instead of
   the single-rank one (``--scorer single``). The found plan is written to
   ``OUT/close_loop/found.plan``.
3. **Predict.** ``simulate_ranks`` of the found plan with both ranks' measured iterations
   replayed (the model of ``sim_vs_real.py``): the predicted median step. Also what the search
   itself reported, and what the single-rank simulator predicts for the found plan.
4. **Run.** 2 ranks train the default plan and the found plan (``plan=found.plan``),
   interleaved call by call; measured median steps (rank 0), and the same losses at every step.

The multi-rank scorer is plugged in by replacing ``autosched.beam.predict`` while the search
runs (autosched has no scorer argument; see ``scored_by``). Writes ``OUT/close_loop.json``/``.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import SIZES, batches, rank_setup
from benchmarks.profiled import ProfiledRun, calibration, predicted_step, profile_interleaved, single_rank_step
from benchmarks.report import add_train_pipeline_arg, run_meta, write_report
from examples.dlrm.model import DlrmSize

CORES = 2


def _size(name: str) -> DlrmSize:
    return DlrmSize() if name == "example" else SIZES[name]


def _profile_rank(rank: int, world_size: int, args: argparse.Namespace, plans: list[str | None]) -> list[ProfiledRun]:
    """Train one copy per plan (None: the default plan), interleaved, profiled."""
    rank_setup()
    from examples.dlrm.model import build_dlrm
    from harness.dlrm import make_runner
    from torchrec_swp.plan import PipelinePlan

    size = _size(args.size)
    runners = []
    try:
        for text in plans:
            plan = None if text is None else PipelinePlan.from_text(text)
            runners.append(make_runner(args.pipeline, "ours", lambda: build_dlrm(rank, world_size, size), plan=plan))
        data = [batches(size, rank, args.warmup + args.steps + 4, args.latency_ms / 1000) for _ in runners]
        labels = ["default" if t is None else "found" for t in plans]
        return profile_interleaved(labels, runners, data, warmup=args.warmup, steps=args.steps)
    finally:
        for r in runners:
            r.close()


@contextlib.contextmanager
def scored_by(score: Callable[[Any, Any], float]) -> Iterator[None]:
    """While inside, ``beam_search`` scores every candidate plan with ``score(problem, plan)``
    (it calls ``autosched.beam.predict``, replaced here and restored on exit)."""
    import torchrec_swp.autosched.beam as beam

    saved = beam.predict
    beam.predict = score  # type: ignore[assignment]
    try:
        yield
    finally:
        beam.predict = saved  # type: ignore[assignment]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_train_pipeline_arg(parser)
    parser.add_argument("--quick", action="store_true", help="small DLRM, 60 steps, beam width 4, 2 passes")
    parser.add_argument(
        "--size", choices=["example", *SIZES], default=None, help="DLRM size (default: example, --quick small)"
    )
    parser.add_argument("--latency-ms", type=float, default=10.0, help="loader latency (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=None, help="measured steps per run (default: 200, --quick 60)")
    parser.add_argument("--warmup", type=int, default=None, help="(default: 20, --quick 10)")
    parser.add_argument("--beam-width", type=int, default=None, help="(default: 8, --quick 4)")
    parser.add_argument("--passes", type=int, default=None, help="(default: 3, --quick 2)")
    parser.add_argument(
        "--scorer",
        choices=("ranks", "single"),
        default="ranks",
        help="the search's scorer: multi-rank simulator (default) or autosched's own single-rank one",
    )
    parser.add_argument(
        "--score-mode",
        choices=("replay", "median"),
        default="replay",
        help="multi-rank scorer: measured iterations replayed (default) or every task at its median (faster)",
    )
    parser.add_argument("--out", type=Path, default=Path("out/bench"), help="output folder (default: %(default)s)")
    args = parser.parse_args(argv)
    args.size = args.size or ("small" if args.quick else "example")
    args.steps = args.steps or (60 if args.quick else 200)
    args.warmup = args.warmup if args.warmup is not None else (10 if args.quick else 20)
    args.beam_width = args.beam_width or (4 if args.quick else 8)
    args.passes = args.passes or (2 if args.quick else 3)
    if args.steps < 10 or args.warmup < 4 or args.latency_ms < 0:
        parser.error("--steps >= 10, --warmup >= 4, --latency-ms >= 0")

    from harness.ranks import run_on_ranks
    from torchrec_swp.autosched import Problem, beam_search, check_constraints
    from torchrec_swp.plan import PipelinePlan
    from torchrec_swp.profiler import Profile
    from torchrec_swp.sim import simulate_ranks

    folder = args.out / "close_loop"
    folder.mkdir(parents=True, exist_ok=True)
    latency_s = args.latency_ms / 1000

    # 1. profile the default plan on both ranks
    print(f"1/4 profile: {args.pipeline}, default plan, 2 ranks, {args.steps} steps", flush=True)
    before = [runs[0] for runs in run_on_ranks(_profile_rank, args, [None], timeout_s=3600.0)]
    for r, run in enumerate(before):
        (folder / f"rank{r}.profile.json").write_text(json.dumps(run.profile, indent=1) + "\n")
    cal = calibration(before, latency_s=latency_s, cores=CORES)
    profile = Profile.from_json(before[0].profile)
    print(profile.format_table())

    # 2. search, scored by the multi-rank simulator
    def ranks_score(problem: Any, plan: PipelinePlan) -> float:
        if args.score_mode == "replay":
            return predicted_step(cal, mode="replay", cores=CORES, plan=plan)
        ranks = cal.simulation_ranks("median", plans=[plan] * len(cal.ranks))
        got = simulate_ranks(ranks, plan.pipeline_depth + 6, cores=CORES).ranks[0].steady_iteration_time
        assert got is not None
        return got

    problem = Problem.from_profile(profile)
    print(f"2/4 search: beam width {args.beam_width}, {args.passes} passes, scorer {args.scorer}", flush=True)
    with scored_by(ranks_score) if args.scorer == "ranks" else contextlib.nullcontext():
        search = beam_search(problem, beam_width=args.beam_width, max_passes=args.passes)
    found = search.plan.replace(name=f"{problem.plan.name}_found")
    violations = check_constraints(found, problem)
    found.save(str(folder / "found.plan"))
    print(search.format(1e3, " ms"))
    print(found.format_schedule(found.max_stage + 3))

    # 3. predict the found plan's step from the default plan's profiles
    print("3/4 predict: the found plan's step, from the default plan's profiles", flush=True)
    predicted = {
        "ranks_replay": predicted_step(cal, mode="replay", cores=CORES, plan=found),
        "ranks_median": predicted_step(cal, mode="median", cores=CORES, plan=found),
        "search": search.predicted,
        "one_rank": single_rank_step(ProfiledRun("found", found.to_text(), medians=before[0].medians)),
    }
    predicted_default = predicted_step(cal, mode="replay", cores=CORES)

    # 4. run default and found plans, interleaved
    print("4/4 run: default and found plans interleaved", flush=True)
    after = run_on_ranks(_profile_rank, args, [None, found.to_text()], timeout_s=3600.0)
    default_run, found_run = after[0]
    measured = found_run.median_step_s
    # the found run's own profile, replayed: the model's error alone, without the costs' change
    own = calibration([runs[1] for runs in after], latency_s=latency_s, cores=CORES)
    predicted["own_profile_replay"] = predicted_step(own, mode="replay", cores=CORES)
    drift = default_run.median_step_s / before[0].median_step_s
    predicted["ranks_replay_drift_scaled"] = predicted["ranks_replay"] * drift
    before_costs, after_costs = cal.ranks[0].measured(), own.ranks[0].measured()
    changes = {t: (1e3 * before_costs[t], 1e3 * after_costs[t]) for t in before_costs}
    result = {
        "pipeline": args.pipeline,
        "size": args.size,
        "latency_ms": args.latency_ms,
        "scorer": args.scorer,
        "found_plan": found.to_text(),
        "constraint_violations": [str(v) for v in violations],
        "threads": list(found.thread_groups),
        "depth": found.pipeline_depth,
        "measured_before_profile_ms": 1e3 * before[0].median_step_s,
        "measured_default_ms": 1e3 * default_run.median_step_s,
        "measured_found_ms": 1e3 * measured,
        "speedup": default_run.median_step_s / measured,
        "predicted_default_ms": 1e3 * predicted_default,
        "predicted_found_ms": {k: 1e3 * v for k, v in predicted.items()},
        "error": {k: v / measured - 1 for k, v in predicted.items()},
        "same_losses": default_run.losses == found_run.losses,
        "load_drift": drift,
        "rank0_task_ms_profiled_vs_found_run": changes,
        "search_seconds": search.seconds,
        "layouts_simulated": search.simulated,
    }
    meta = run_meta("close_loop.py", argv, args, "steps", "warmup", "beam_width", "passes", "score_mode")
    write_report(args.out, "close_loop", {"meta": meta, "result": result}, _markdown(result, meta, found))


def _markdown(r: dict[str, Any], meta: dict[str, Any], found: Any) -> str:
    e, p = r["error"], r["predicted_found_ms"]
    return "\n".join(
        [
            f"# Closing the loop on the DLRM example: {r['pipeline']}, {r['size']} DLRM, loader {r['latency_ms']:g} ms",
            "",
            f"{meta['date']}; `{meta['command']}`",
            "",
            f"Search: beam width {meta['beam_width']}, {meta['passes']} passes, scorer: "
            + (f"multi-rank simulator ({meta['score_mode']})" if r["scorer"] == "ranks" else "single-rank simulator")
            + f", {r['layouts_simulated']} layouts simulated in {r['search_seconds']:.1f} s; found plan: "
            f"{len(r['threads'])} threads {r['threads']}, {r['depth']} batches in flight"
            + (f"; constraint violations: {r['constraint_violations']}" if r["constraint_violations"] else "")
            + ".",
            "",
            "| | ms per step |",
            "|---|---|",
            f"| default plan, measured in the profiling run | {r['measured_before_profile_ms']:.2f} |",
            f"| default plan, predicted (ranks, replay) | {r['predicted_default_ms']:.2f} |",
            f"| default plan, measured in the final run | {r['measured_default_ms']:.2f} |",
            f"| found plan, predicted: ranks, replay | **{p['ranks_replay']:.2f}** ({100 * e['ranks_replay']:+.1f}%) |",
            f"| found plan, predicted: ranks, replay, x the default plan's drift between the runs "
            f"({r['load_drift']:.3f}) | {p['ranks_replay_drift_scaled']:.2f} "
            f"({100 * e['ranks_replay_drift_scaled']:+.1f}%) |",
            f"| found plan, predicted: ranks, medians | {p['ranks_median']:.2f} ({100 * e['ranks_median']:+.1f}%) |",
            f"| found plan, the search's score | {p['search']:.2f} ({100 * e['search']:+.1f}%) |",
            f"| found plan, predicted: 1 rank, medians | {p['one_rank']:.2f} ({100 * e['one_rank']:+.1f}%) |",
            f"| found plan, measured | **{r['measured_found_ms']:.2f}** |",
            f"| found plan, its own final-run profile replayed (the model alone) | {p['own_profile_replay']:.2f} "
            f"({100 * e['own_profile_replay']:+.1f}%) |",
            "",
            "Rank 0's task costs (median own part, CPU + off-CPU, without rendezvous waits), profiled on the default "
            "plan -> in the found plan's run: "
            + ", ".join(
                f"{t} {a:.2f} -> {b:.2f}" for t, (a, b) in r["rank0_task_ms_profiled_vs_found_run"].items()
            )
            + ".",
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
