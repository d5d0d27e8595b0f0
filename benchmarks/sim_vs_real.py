"""Predicted vs measured step time of real 2-rank runs: the multi-rank simulator against the clock.

    python benchmarks/sim_vs_real.py              # the 12 pipelines, default plan and io thread (3-5 min)
    python benchmarks/sim_vs_real.py --quick      # the 10 that do not compile, fewer steps (about 45 s)
    python benchmarks/sim_vs_real.py --pipelines TrainPipelineSparseDist --steps 300

For each pipeline, 2 gloo ranks train two copies of the small DLRM with our pipeline, one with
its default plan and one with the stage-0 tasks (loading and copying the next batch) on thread
``io``, interleaved call by call, the loader waiting ``--latency-ms`` per batch. After the
warm-up, a TaskProfiler on every rank records each task run; each step is timed.

Then, per pipeline and plan, in the parent (``benchmarks/profiled.py``):

* **measured**: rank 0's median step (``progress()``, plus the caller's training for Staged);
* **1 rank**: what the simulator predicted before: ``simulate`` of the plan with rank 0's
  ``Profile.durations()`` (median per task), one rank's threads only;
* **ranks, medians**: ``simulate_ranks`` of both ranks calibrated from both profiles
  (collectives as rendezvous, the loader's latency off the CPU, 2 cores shared by both ranks,
  the per-iteration overhead), every task at its median;
* **ranks, replay**: the same, each simulated iteration costing what a measured iteration cost
  (every task and both ranks from the same one), the median of the simulated steps: the model;
* **from default**: for the io plan, ``simulate_ranks`` of the io plan with the costs
  calibrated on the *default* plan's run - a prediction for a plan that was not profiled, what
  the auto-scheduler relies on.

Errors are ``predicted / measured - 1``; misses over 10% are listed with what changed. Writes
``OUT/sim_vs_real.json`` and ``.md`` (default ``out/bench``), and every rank's profiles to
``OUT/sim_vs_real.raw.pkl`` (``--from-raw`` analyses them again without running).
"""

from __future__ import annotations

import argparse
import pickle
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import SIZES, batches, rank_setup, size_arg
from benchmarks.profiled import ProfiledRun, calibration, predicted_step, profile_interleaved, single_rank_step
from benchmarks.report import run_meta, write_report
from harness.dlrm import INFO, PIPELINES

CORES = 2  # this machine
QUICK_PIPELINES = [n for n in PIPELINES if not INFO[n].compiles]


def _rank(rank: int, world_size: int, args: argparse.Namespace) -> dict[str, list[ProfiledRun]]:
    rank_setup()
    from tqdm import tqdm

    from examples.dlrm.model import build_dlrm
    from examples.dlrm.train import thread_map_of
    from harness.dlrm import make_runner

    size = SIZES[args.size[0]]
    total = args.warmup + args.steps
    bar = tqdm(total=total * len(args.pipelines), disable=rank != 0, unit="step", mininterval=1.0, file=sys.stdout)
    out: dict[str, list[ProfiledRun]] = {}
    try:
        for name in args.pipelines:
            bar.set_description(name)
            runners = []
            try:
                for tm in ("default", "io"):
                    runners.append(
                        make_runner(
                            name,
                            "ours",
                            lambda: build_dlrm(rank, world_size, size),
                            thread_map=None if tm == "default" else thread_map_of(tm),
                        )
                    )
                data = [batches(size, rank, total + 4, args.latency_ms / 1000) for _ in runners]
                out[name] = profile_interleaved(
                    ["default", "io"], runners, data, warmup=args.warmup, steps=args.steps, tick=bar.update
                )
            finally:
                for r in runners:
                    r.close()
    finally:
        bar.close()
    return out


def _error(predicted: float, measured: float) -> float:
    return predicted / measured - 1


def analyse(per_rank: list[dict[str, list[ProfiledRun]]], latency_s: float) -> list[dict[str, Any]]:
    """The table's rows from every rank's runs (module docstring)."""
    from torchrec_swp.plan import PipelinePlan

    rows = []
    for name in per_rank[0]:
        runs = {label: [rank[name][k] for rank in per_rank] for k, label in enumerate(("default", "io"))}
        cal = {label: calibration(r, latency_s=latency_s, cores=CORES) for label, r in runs.items()}
        for label in ("default", "io"):
            measured = runs[label][0].median_step_s
            row: dict[str, Any] = {
                "pipeline": name,
                "plan": label,
                "measured_ms": 1e3 * measured,
                "same_losses_as_default": runs[label][0].losses == runs["default"][0].losses,
                "iterations_calibrated": cal[label].iterations,
                "overhead_ms": [1e3 * c.overhead for c in cal[label].ranks],
            }
            predictions = {
                "one_rank": single_rank_step(runs[label][0]),
                "ranks_median": predicted_step(cal[label], mode="median", cores=CORES),
                "ranks_replay": predicted_step(cal[label], mode="replay", cores=CORES),
            }
            if label == "io":
                predictions["from_default"] = predicted_step(
                    cal["default"], mode="replay", cores=CORES, plan=PipelinePlan.from_text(runs["io"][0].plan)
                )
                # what changed between the two runs, to explain a miss of the prediction from default
                before, after = cal["default"].ranks[0].measured(), cal["io"].ranks[0].measured()
                row["rank0_task_ms_default_vs_io"] = {t: (1e3 * before[t], 1e3 * after[t]) for t in before}
                row["overhead_ms_default"] = [1e3 * c.overhead for c in cal["default"].ranks]
            for key, value in predictions.items():
                row[f"{key}_ms"] = 1e3 * value
                row[f"{key}_error"] = _error(value, measured)
            rows.append(row)
    return rows


def _markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    def cell(r: dict[str, Any], key: str) -> str:
        if f"{key}_ms" not in r:
            return "-"
        err = r[f"{key}_error"]
        text = f"{r[f'{key}_ms']:.2f} ({100 * err:+.0f}%)"
        return f"**{text}**" if abs(err) > 0.10 else text

    lines = [
        "# Predicted vs measured step time, 2 gloo ranks",
        "",
        f"{meta['date']}; `{meta['command']}`",
        (
            f"{meta['size']} DLRM, loader latency {meta['latency_ms']:g} ms, {meta['warmup']} warm-up + "
            f"{meta['steps']} measured steps of both plans interleaved; predictions: ms (error vs measured), "
            "misses over 10% in bold."
        ),
        "",
        "| pipeline | plan | measured ms | 1 rank, medians (before) | ranks, medians | ranks, replay "
        "| io from default's profile |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['pipeline']} | {r['plan']} | {r['measured_ms']:.2f} | {cell(r, 'one_rank')} "
            f"| {cell(r, 'ranks_median')} | {cell(r, 'ranks_replay')} | {cell(r, 'from_default')} |"
        )
    misses = [line for r in rows for line in _explain(r)]
    if misses:
        lines += ["", "Misses over 10% of the multi-rank predictions, and what changed:", "", *misses]
    for key, title in (("one_rank", "1 rank"), ("ranks_replay", "ranks, replay"), ("from_default", "from default")):
        errs = [abs(r[f"{key}_error"]) for r in rows if f"{key}_error" in r]
        if errs:
            within = sum(e <= 0.10 for e in errs)
            lines.append(
                f"\n{title}: mean |error| {100 * sum(errs) / len(errs):.1f}%, worst {100 * max(errs):.1f}%, "
                f"{within}/{len(errs)} within 10%."
            )
    return "\n".join(lines) + "\n"


def _explain(r: dict[str, Any]) -> list[str]:
    """A line per multi-rank prediction of ``r`` that misses by more than 10%, with the numbers
    that explain it: the per-iteration overhead, and for the io plan predicted from the default
    plan's profile, rank 0's tasks whose cost changed most between the two runs."""
    out = []
    where = f"{r['pipeline']} ({r['plan']})"
    overhead = ", ".join(f"{ms:.2f}" for ms in r["overhead_ms"])
    for key in ("ranks_median", "ranks_replay"):
        if abs(r[f"{key}_error"]) > 0.10:
            out.append(
                f"- {where}, {key.replace('_', ', ')}: {100 * r[f'{key}_error']:+.0f}%; per-iteration overhead "
                f"(ms, per rank) {overhead}"
            )
    if abs(r.get("from_default_error", 0.0)) > 0.10:
        changes = sorted(
            r["rank0_task_ms_default_vs_io"].items(), key=lambda kv: -abs(kv[1][1] - kv[1][0])
        )[:3]
        out.append(
            f"- {where}, from default: {100 * r['from_default_error']:+.0f}%; rank 0's costs, default run -> io run: "
            + ", ".join(f"{t} {a:.2f} -> {b:.2f} ms" for t, (a, b) in changes)
            + "; overhead (ms, per rank) "
            + ", ".join(f"{ms:.2f}" for ms in r["overhead_ms_default"])
            + f" -> {overhead}"
        )
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--pipelines",
        type=lambda s: [x.strip() for x in s.split(",") if x.strip()],
        default=None,
        help="comma-separated (default: all 12; with --quick the 10 that do not compile)",
    )
    parser.add_argument("--quick", action="store_true", help="60 steps after 10 warm-up, no compiled pipelines")
    parser.add_argument("--steps", type=int, default=None, help="measured steps (default: 200, --quick 60)")
    parser.add_argument("--warmup", type=int, default=None, help="dropped steps (default: 20, --quick 10)")
    parser.add_argument("--latency-ms", type=float, default=10.0, help="loader latency (default: %(default)s)")
    parser.add_argument("--size", type=size_arg, default=["small"], help="DLRM size (default: small)")
    parser.add_argument("--out", type=Path, default=Path("out/bench"), help="output folder (default: %(default)s)")
    parser.add_argument(
        "--from-raw",
        type=Path,
        metavar="FILE",
        help="analyse the profiles a run saved (OUT/sim_vs_real.raw.pkl) instead of running",
    )
    args = parser.parse_args(argv)
    args.steps = args.steps or (60 if args.quick else 200)
    args.warmup = args.warmup if args.warmup is not None else (10 if args.quick else 20)
    args.pipelines = args.pipelines or (QUICK_PIPELINES if args.quick else list(PIPELINES))
    unknown = [p for p in args.pipelines if p not in INFO]
    if unknown:
        parser.error(f"unknown pipeline(s) {unknown}; choose among {', '.join(PIPELINES)}")
    if args.steps < 4 or args.warmup < 4 or args.latency_ms < 0:
        parser.error("--steps and --warmup must be >= 4, --latency-ms >= 0")
    if len(args.size) != 1:
        parser.error("--size takes one size")

    if args.from_raw:
        with args.from_raw.open("rb") as f:
            saved = pickle.load(f)
        per_rank, args.latency_ms = saved["per_rank"], saved["latency_ms"]
    else:
        from harness.ranks import run_on_ranks

        per_rank = run_on_ranks(_rank, args, timeout_s=3600.0)
        args.out.mkdir(parents=True, exist_ok=True)
        with (args.out / "sim_vs_real.raw.pkl").open("wb") as f:
            pickle.dump({"per_rank": per_rank, "latency_ms": args.latency_ms}, f)
    rows = analyse(per_rank, args.latency_ms / 1000)
    meta = run_meta("sim_vs_real.py", argv, args, "latency_ms", "steps", "warmup")
    meta.update(size=args.size[0], cores=CORES)
    write_report(args.out, "sim_vs_real", {"meta": meta, "rows": rows}, _markdown(rows, meta))


if __name__ == "__main__":
    main()
