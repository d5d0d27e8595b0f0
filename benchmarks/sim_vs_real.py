"""Predicted vs measured step time of real runs: the multi-rank simulator's engine model against the clock.

    python benchmarks/sim_vs_real.py              # the 12 pipelines, 2 ranks then 1 rank (about 10 min)
    python benchmarks/sim_vs_real.py --quick      # the 10 that do not compile, 2 ranks, fewer steps
    python benchmarks/sim_vs_real.py --pipelines TrainPipelineSparseDist --ranks 1 --steps 150

For each pipeline, on ``--ranks`` gloo ranks (2, then 1: with 2 ranks on 2 cores the ranks share
the cores and wait for each other in every collective; 1 rank has both cores), the loader waiting
``--latency-ms`` per batch (a ``MapSource`` over the same dataset for every configuration), our
pipeline trains its own copy of the small DLRM in each configuration:

* ``default``: the default plan, its draw split off into a Fetch task on the calling thread
  where the pipeline has one (``plans.with_parallel_loads(plan, 1, lookahead=0, thread="default")``:
  the same calls in the same order; what a self-tuning pipeline profiles);
* ``io``: the stage-0 tasks (loading and copying the next batch) on thread ``io``;
* ``io+ahead``: besides, ``lookahead 2``: the io thread runs up to two batches ahead;
* ``2loads``: two parallel loads (lookahead 2), where the pipeline's draw splits.

Configurations run in blocks of consecutive steps (``benchmarks/profiled.py``), a TaskProfiler
and the step periods recorded during each block's timed steps. Then, in the parent, per
configuration:

* **measured**: rank 0's mean step period (the throughput), and how precisely it is known: the
  95% t interval of the mean of its blocks (``measurement``); a block during which other
  programs used more than ``--max-other-load`` cores of the machine (its busy time less every
  rank's process: another test suite on a shared machine halves a 2-rank step) is run again,
  up to ``--retries`` times, after waiting for the machine to be quiet;
* **replay**: the engine model calibrated from the run's own profiles (every rank's), each
  simulated iteration costing what a measured one cost: the model of the run itself;
* **mean**: the same with every task at its mean cost;
* **from default**: the configuration's plan simulated with the costs calibrated on the
  *default* run, its measured iterations replayed in turn: the model's prediction for a plan
  that was not profiled; **from default, mean costs**: the same with every task at its mean,
  what the auto-tuner's first round ranks plans by (it falls short on two ranks, where the
  rendezvous of ranks that vary from step to step takes longer than that of their means).

Every calibration takes each run's CPU back to what it costs on a warm thread
(``autosched.inputs.DEFAULT_COLD``, ``torchrec_swp.sim.cold``), and every simulation charges it
again where the simulated thread wakes cold: the default plan's training thread sleeps in Fetch
every step, a plan with parallel loads keeps it busy. The same rule takes each rank's collectives'
transfers back to a warm transport and charges them where the simulated transport sat idle.

Errors are ``predicted / measured - 1``; misses over 10% are listed, and counted apart where the
prediction is within 10% of some step inside the measured mean's interval (a miss the
measurement cannot tell from noise: extra information, the target is the error itself). Writes
``OUT/sim_vs_real.json`` and ``.md`` (default ``out/bench``), and every rank's profiles to
``OUT/sim_vs_real.raw.pkl`` (``--from-raw`` analyses them again without running).
"""

from __future__ import annotations

import argparse
import math
import pickle
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import rank_setup, size_arg
from benchmarks.profiled import ProfiledRun, inputs_of, predicted_step, profile_blocks, replay_batches
from benchmarks.report import run_meta, write_report
from harness.dlrm import INFO, PIPELINES
from harness.dlrm_data import SIZES

QUICK_PIPELINES = [n for n in PIPELINES if not INFO[n].compiles]
CONFIGS = ("default", "io", "io+ahead", "2loads")


def configs_of(name: str) -> list[str]:
    """The configurations pipeline ``name`` runs: parallel loads only where its draw splits."""
    from torchrec_swp.plans import default_plans, splits_draw

    if INFO[name].kind == "staged":  # its plan follows its stages: a thread map, no plan options
        return ["default", "io"]
    plan = default_plans()[name]
    first = plan.plans[0] if hasattr(plan, "plans") else plan
    return [c for c in CONFIGS if c != "2loads" or splits_draw(first)]


def _runner(
    name: str, config: str, rank: int, world: int, size_name: str, total: int, latency_s: float
) -> tuple[Any, Any]:
    from benchmarks.peers import latency_dataset
    from examples.dlrm.model import build_dlrm
    from harness.dlrm import make_runner
    from torchrec_swp import plans
    from torchrec_swp.data import MapSource
    from torchrec_swp.plan import MAIN_THREAD
    from torchrec_swp.plans import splits_draw

    size = SIZES[size_name]
    build = lambda: build_dlrm(rank, world, size)  # noqa: E731
    staged = INFO[name].kind == "staged"

    def split(plan: Any) -> Any:
        first = plan.plans[0] if hasattr(plan, "plans") else plan
        return plans.with_parallel_loads(plan, 1, lookahead=0, thread=MAIN_THREAD) if splits_draw(first) else plan

    options: dict[str, Any] = {}
    if config == "io+ahead":
        options["lookahead"] = 2
    if config == "2loads":
        options.update(loads=2, lookahead=2)
    runner = make_runner(
        name,
        "ours",
        build,
        edit_plan=None if staged or config == "2loads" else split,
        thread_map="io" if config in ("io", "io+ahead") else None,
        options=options,
    )
    # the same data for every configuration: a map-style dataset whose items wait (a draw that
    # splits, so that loads overlap their waits; one load draws it as any iterator)
    return runner, MapSource(latency_dataset(size, rank, total, latency_s))


def rounds_of(args: argparse.Namespace, world_size: int) -> int:
    """The rounds of blocks on ``world_size`` ranks: ``args.rounds``, one number for every world
    size or one per entry of ``args.ranks``."""
    if isinstance(args.rounds, int):
        return args.rounds
    if len(args.rounds) == 1:
        return args.rounds[0]
    return dict(zip(args.ranks, args.rounds, strict=True))[world_size]


def _rank(rank: int, world_size: int, args: argparse.Namespace) -> dict[str, list[ProfiledRun]]:
    rank_setup()
    from tqdm import tqdm

    from torchrec_swp.autotune.agreement import machine

    host, cores = machine()
    retries = getattr(args, "retries", 0)
    rounds = rounds_of(args, world_size)
    total = args.warmup + rounds * args.block * (1 + retries) + 8
    steps = sum(len(configs_of(n)) for n in args.pipelines) * (args.warmup + rounds * args.block)
    bar = tqdm(total=steps, disable=rank != 0, unit="step", mininterval=1.0, file=sys.stdout)
    out: dict[str, list[ProfiledRun]] = {}
    try:
        for name in args.pipelines:
            bar.set_description(f"{world_size} rank(s), {name}")
            configs = configs_of(name)
            runners, data = [], []
            try:
                for config in configs:
                    r, d = _runner(name, config, rank, world_size, args.size[0], total, args.latency_ms / 1000)
                    runners.append(r)
                    data.append(d)

                def where(r: Any) -> dict[str, Any]:
                    draws = r.pipeline.engine.draws
                    return dict(
                        rank=rank,
                        world_size=world_size,
                        host=host,
                        cores=cores,
                        split_draws=bool(draws and draws.splits),
                    )

                out[name] = profile_blocks(
                    configs,
                    runners,
                    data,
                    warmup=args.warmup,
                    rounds=rounds,
                    block=args.block,
                    skip=args.skip,
                    where=where,
                    tick=bar.update,
                    keep=lambda usage: _quiet_enough(usage, world_size, args),
                    retries=retries,
                )
            finally:
                for r in runners:
                    r.close()
    finally:
        bar.close()
    return out


def _quiet_enough(usage: dict[str, Any], world_size: int, args: argparse.Namespace) -> bool:
    """In every rank alike: whether a block counts - the cores the machine spent on other programs
    during its timed steps (rank 0's reading of the machine's busy time less every rank's
    process) at most ``args.max_other_load``. If not, wait until the machine is that quiet (rank
    0 looks, at most ``args.quiet_wait`` seconds) before the block runs again."""
    import torch.distributed as dist

    mine = (usage.get("busy_s"), usage.get("wall_s"), usage.get("cpu_s"))
    got: list[Any] = [mine]
    if world_size > 1:
        got = [None] * world_size
        dist.all_gather_object(got, mine)
    busy, wall = got[0][0], got[0][1]
    if busy is None or not wall:
        return True
    if max(0.0, busy - sum(g[2] for g in got)) / wall <= getattr(args, "max_other_load", math.inf):
        return True
    if dist.is_initialized() and dist.get_rank() != 0:
        dist.barrier()
        return False
    from benchmarks.profiled import Usage

    deadline = time.perf_counter() + getattr(args, "quiet_wait", 20.0)
    while time.perf_counter() < deadline:  # the ranks are idle: the machine's busy time is the others'
        before = Usage.now()
        time.sleep(0.5)
        got_now = Usage.now()
        if got_now.busy is None or before.busy is None:
            break
        if (got_now.busy - before.busy) / (got_now.wall - before.wall) <= args.max_other_load:
            break
    if world_size > 1:
        dist.barrier()
    return False


def _error(predicted: float, measured: float) -> float:
    return predicted / measured - 1


def _same_losses(a: list[float], b: list[float]) -> bool:
    """The same losses step for step, over the steps both ran (a block run again trains on)."""
    n = min(len(a), len(b))
    return n > 0 and a[:n] == b[:n]


#: the confidence of the measured mean step's interval (``measurement``)
CONFIDENCE = 0.95


def measurement(ranks_runs: list[ProfiledRun]) -> dict[str, Any]:
    """How precisely a configuration's mean step is known: rank 0's mean step of each block
    (``blocks_ms``, in the order they ran) and the half-width of the ``CONFIDENCE`` t interval of
    their mean, as a share of the measured mean (``measured_halfwidth``; None from one block).
    Blocks of different rounds ran minutes apart, between the other configurations' blocks, so
    their spread holds the drift of the machine and the state a run settles in (on 2 ranks a
    block's steps move together: the ranks fall into a rhythm that lasts the block). Also, where
    recorded (``ProfiledRun.usage``), ``other_load``: the cores the machine spent on other
    programs during the timed steps (its busy time less every rank's process), mean over the
    blocks, and its largest block."""
    from torchrec_swp.autotune.trial import t_quantile

    means = ranks_runs[0].block_means()
    out: dict[str, Any] = {"blocks_ms": [1e3 * m for m in means], "measured_halfwidth": None}
    if len(means) >= 2:
        mean = statistics.fmean(means)
        half = t_quantile(CONFIDENCE, len(means) - 1) * statistics.stdev(means) / math.sqrt(len(means))
        out["measured_halfwidth"] = half / mean
    usage = [getattr(r, "usage", []) for r in ranks_runs]
    if usage[0] and all(len(u) == len(usage[0]) for u in usage):
        other = []
        for k, u in enumerate(usage[0]):
            if u.get("busy_s") is not None and u["wall_s"] > 0:
                ours = sum(x[k]["cpu_s"] for x in usage)
                other.append(max(0.0, u["busy_s"] - ours) / u["wall_s"])
        if other:
            out["other_load"] = statistics.fmean(other)
            out["other_load_max"] = max(other)
    return out


def analyse(per_rank: list[dict[str, list[ProfiledRun]]], world_size: int) -> list[dict[str, Any]]:
    """The table's rows from every rank's runs (module docstring)."""
    from torchrec_swp.plan import PipelinePlan

    rows = []
    for name in per_rank[0]:
        runs = {run.label: [rank[name][k] for rank in per_rank] for k, run in enumerate(per_rank[0][name])}
        inputs = {label: inputs_of(r) for label, r in runs.items()}
        for label, ranks_runs in runs.items():
            measured = ranks_runs[0].mean_step_s
            row: dict[str, Any] = {
                "pipeline": name,
                "ranks": world_size,
                "config": label,
                "measured_ms": 1e3 * measured,
                **measurement(ranks_runs),
                "same_losses_as_default": _same_losses(ranks_runs[0].losses, runs["default"][0].losses),
                "blocks_dropped": len(getattr(ranks_runs[0], "dropped", [])),
                "iterations_calibrated": inputs[label].calibration.iterations,
                "overhead_ms": [1e3 * c.overhead for c in inputs[label].calibration.ranks],
            }
            predictions = {
                "replay": predicted_step(inputs[label], mode="replay"),
                "mean": predicted_step(inputs[label], mode="mean"),
            }
            if label != "default":
                plan = PipelinePlan.from_text(ranks_runs[0].plan)
                # the model's prediction for a plan not run: the default's iterations replayed on it;
                # beside it, every task at its mean cost (what the tuner's first round ranks by)
                predictions["from_default"] = predicted_step(inputs["default"], mode="replay", plan=plan)
                predictions["from_default_mean"] = predicted_step(inputs["default"], mode="mean", plan=plan)
                row["causes"] = causes(inputs["default"], inputs[label], plan, measured)
            for key, value in predictions.items():
                row[f"{key}_ms"] = 1e3 * value
                row[f"{key}_error"] = _error(value, measured)
            rows.append(row)
    return rows


#: the causes a prediction from another plan's profile misses (``causes``), in the report's order
CAUSES = {
    "moved_cpu": "CPU of the tasks that moved thread (cores, GIL, caches on the new thread)",
    "moved_off": "waits inside the tasks that moved (loads waiting on one another, collectives on gloo)",
    "stayed_cpu": "CPU of the tasks that stayed (contention from the moved ones)",
    "stayed_off": "waits inside the tasks that stayed (collectives, copies)",
    "overhead": "the caller's overhead between steps",
    "variation": "how the tasks vary from step to step (the default's iterations' for the configuration's own)",
    "model": "the model itself (its error replaying the configuration's own iterations)",
}


def causes(default: Any, own: Any, plan: Any, measured: float) -> dict[str, float]:
    """Where a prediction of ``plan`` from ``default``'s profile (its iterations replayed, as
    ``from_default``) misses: each cause's share of the measured step (``CAUSES``), by swapping
    that part of the default costs for the configuration's own and simulating again. A mean
    swap moves each of those tasks' CPU or off-CPU time (or the caller's overhead) to the
    configuration's own mean, keeping the default's iteration-to-iteration deviations;
    ``variation`` takes the configuration's own deviations (its iterations) about the same means;
    ``model``: the error left with every cost the configuration's own (its own replay);
    ``interaction``: what the causes do not add up to."""
    from dataclasses import replace

    from torchrec_swp.sim import simulate_ranks

    start = default.calibration.ranks[0].plan
    moved = {
        t for t in plan.fire_order if t in start.schedule and plan.task(t).thread_group != start.task(t).thread_group
    }

    def step(swap: set[str]) -> float:
        ranks = []
        for k, (d, o) in enumerate(zip(default.calibration.ranks, own.calibration.ranks, strict=True)):
            (d_cpu, d_off), (o_cpu, o_off) = d.means(), o.means()
            deviating = o if "variation" in swap else d  # whose iterations vary about the means
            v_cpu, v_off = deviating.means()
            samples = []
            for sample in deviating.samples:
                row = {}
                for t, (c, f) in sample.items():
                    group = "moved" if t in moved else "stayed"
                    mc = o_cpu.get(t, d_cpu.get(t, 0.0)) if f"{group}_cpu" in swap else d_cpu.get(t, v_cpu[t])
                    mo = o_off.get(t, d_off.get(t, 0.0)) if f"{group}_off" in swap else d_off.get(t, v_off[t])
                    row[t] = (max(0.0, mc + c - v_cpu[t]), max(0.0, mo + f - v_off[t]))
                samples.append(row)
            src = o if "overhead" in swap else d
            costs = replace(
                deviating,
                plan=d.plan,
                samples=tuple(samples),
                once=d.once,
                overhead=src.overhead,
                overhead_off=src.overhead_off,
                cold=d.cold,
            )
            ranks.append(
                costs.rank(
                    "replay",
                    plan=plan,
                    machine=default.machine.machines[k],
                    wake=default.machine.wake,
                    split_draws=default.split_draws,
                    gil=default.machine.gil,
                )
            )
        n = replay_batches((own if "variation" in swap else default).calibration.iterations, plan)
        got = simulate_ranks(ranks, n, cores=default.machine.cores).step_period
        assert got is not None
        return got

    base = step(set())
    parts = [c for c in CAUSES if c != "model"]
    out = {c: (base - step({c})) / measured for c in parts}  # the error this cause accounts for
    all_own = step(set(parts))
    out["model"] = all_own / measured - 1
    out["interaction"] = (base / measured - 1) - sum(out[c] for c in parts) - out["model"]
    return out


def _causes_table(rows: list[dict[str, Any]]) -> list[str]:
    """Per cause: its mean and largest share of the error, over the configurations predicted from
    the default's profile."""
    with_causes = [r for r in rows if "causes" in r]
    if not with_causes:
        return []
    lines = [
        "",
        "Where the predictions from the default's profile miss (`causes`: each cause's part of the error, as a "
        "share of the measured step: + the prediction is too long by it, - too short):",
        "",
        "| cause | mean | mean abs | largest |",
        "|---|---|---|---|",
    ]
    for c, what in (*CAUSES.items(), ("interaction", "what the causes do not add up to")):
        vals = [r["causes"][c] for r in with_causes]
        worst = max(vals, key=abs)
        lines.append(
            f"| {what} | {100 * sum(vals) / len(vals):+.1f}% | {100 * sum(map(abs, vals)) / len(vals):.1f}% "
            f"| {100 * worst:+.1f}% |"
        )
    lines += [
        "",
        "| ranks | pipeline | config | from default | " + " | ".join(CAUSES) + " |",
        "|---|---|---|---|" + "---|" * len(CAUSES),
    ]
    for r in with_causes:
        lines.append(
            f"| {r['ranks']} | {r['pipeline']} | {r['config']} | {100 * r['from_default_error']:+.0f}% | "
            + " | ".join(f"{100 * r['causes'][c]:+.1f}%" for c in CAUSES)
            + " |"
        )
    return lines


#: the predictions, in the report's order, and their titles
PREDICTIONS = {
    "replay": "replay",
    "mean": "mean",
    "from_default": "from default",
    "from_default_mean": "from default, mean costs",
}
#: the tolerance a prediction is judged by
TOLERANCE = 0.10


def within_noise(row: dict[str, Any], key: str) -> bool:
    """Whether prediction ``key`` is within ``TOLERANCE`` of some step inside the measured mean's
    interval (``measured_halfwidth``): a miss the measurement cannot tell from noise. Extra
    information only: the target is the error against the measured mean."""
    half = row.get("measured_halfwidth") or 0.0
    predicted, measured = row[f"{key}_ms"], row["measured_ms"]
    low, high = measured * (1 - half), measured * (1 + half)
    # the prediction is within the tolerance of a step in [low, high] iff the bands meet
    return predicted / (1 + TOLERANCE) <= high and predicted / (1 - TOLERANCE) >= low


def summary(rows: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per prediction (``PREDICTIONS``) and per number of ranks (``"all"``, ``"1"``, ``"2"``...):
    how many rows it predicts, how many within ``TOLERANCE``, how many within it or the
    measurement's interval, the mean absolute error, the worst error (signed)."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    groups = {"all": rows, **{str(w): [r for r in rows if r["ranks"] == w] for w in sorted({r["ranks"] for r in rows})}}
    for key in PREDICTIONS:
        out[key] = {}
        for group, members in groups.items():
            have = [r for r in members if f"{key}_error" in r]
            if not have:
                continue
            errs = [r[f"{key}_error"] for r in have]
            out[key][group] = {
                "n": len(have),
                "within": sum(abs(e) <= TOLERANCE for e in errs),
                "within_or_noise": sum(abs(r[f"{key}_error"]) <= TOLERANCE or within_noise(r, key) for r in have),
                "mean_abs": sum(map(abs, errs)) / len(errs),
                "worst": max(errs, key=abs),
            }
    return out


def _rounds_text(meta: dict[str, Any]) -> str:
    rounds = meta["rounds"] if isinstance(meta["rounds"], list) else [meta["rounds"]]
    if len(rounds) == 1:
        return f"{rounds[0]} rounds"
    return "rounds (" + ", ".join(f"{r} on {w} rank(s)" for w, r in zip(meta["ranks"], rounds, strict=True)) + ")"


def _markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    def cell(r: dict[str, Any], key: str) -> str:
        if f"{key}_ms" not in r:
            return "-"
        err = r[f"{key}_error"]
        text = f"{r[f'{key}_ms']:.2f} ({100 * err:+.0f}%)"
        return f"**{text}**" if abs(err) > TOLERANCE else text

    def measured(r: dict[str, Any]) -> str:
        half = r.get("measured_halfwidth")
        return f"{r['measured_ms']:.2f}" + ("" if half is None else f" ±{100 * half:.1f}%")

    def other(r: dict[str, Any]) -> str:
        return "-" if "other_load" not in r else f"{r['other_load']:.2f} ({r['other_load_max']:.2f})"

    lines = [
        "# Predicted vs measured step time: the engine model against real runs",
        "",
        f"{meta['date']}; `{meta['command']}`",
        (
            f"{meta['size']} DLRM, loader latency {meta['latency_ms']:g} ms, {meta['warmup']} warm-up steps, then "
            f"{_rounds_text(meta)} of {meta['block']} consecutive steps per configuration ({meta['skip']} untimed); "
            f"measured: rank 0's mean step (ms) ± the half-width of the {100 * CONFIDENCE:.0f}% t interval of the "
            "mean of its blocks; other load: the cores other programs used meanwhile (mean over the blocks, "
            "largest block); predictions: ms (error vs measured), misses over 10% in bold."
        ),
        "",
        "| ranks | pipeline | config | measured ms | other load | replay | mean | from default's profile "
        "| from default's, mean costs |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['ranks']} | {r['pipeline']} | {r['config']} | {measured(r)} | {other(r)} | {cell(r, 'replay')} "
            f"| {cell(r, 'mean')} | {cell(r, 'from_default')} | {cell(r, 'from_default_mean')} |"
        )
    dropped = sum(r.get("blocks_dropped", 0) for r in rows)
    if meta.get("retries"):
        kept = sum(len(r["blocks_ms"]) for r in rows)
        lines += [
            "",
            f"A block during which other programs used more than {meta['max_other_load']:g} cores ran again, "
            f"up to {meta['retries']} times: {dropped} ran again, {kept} counted.",
        ]
    table = summary(rows)
    lines += [
        "",
        f"Within {100 * TOLERANCE:.0f}% (the target; beside it, in brackets, within {100 * TOLERANCE:.0f}% of some "
        "step inside the measured mean's interval: misses the measurement cannot tell from noise), mean |error|, "
        "worst:",
        "",
        "| prediction | ranks | within 10% | (or within the interval) | mean error | worst |",
        "|---|---|---|---|---|---|",
    ]
    for key, title in PREDICTIONS.items():
        for group, s in table[key].items():
            lines.append(
                f"| {title} | {group} | {s['within']}/{s['n']} | ({s['within_or_noise']}/{s['n']}) "
                f"| {100 * s['mean_abs']:.1f}% | {100 * s['worst']:+.1f}% |"
            )
    halves = {}
    for r in rows:
        if r.get("measured_halfwidth") is not None:
            halves.setdefault(r["ranks"], []).append(r["measured_halfwidth"])
    if halves:
        lines += [
            "",
            "The measured means' interval half-width, per number of ranks: "
            + "; ".join(
                f"{w} rank(s) median {100 * statistics.median(h):.1f}%, largest {100 * max(h):.1f}%"
                for w, h in sorted(halves.items(), reverse=True)
            )
            + ".",
        ]
    misses = [
        f"- {r['ranks']} rank(s) {r['pipeline']} {r['config']}, {key}: {100 * r[f'{key}_error']:+.0f}% "
        f"(measured ±{100 * (r.get('measured_halfwidth') or 0):.1f}%; overhead per step, ms per rank: "
        f"{', '.join(f'{o:.2f}' for o in r['overhead_ms'])})"
        for r in rows
        for key in PREDICTIONS
        if abs(r.get(f"{key}_error", 0.0)) > TOLERANCE
    ]
    if misses:
        lines += ["", "Misses over 10%:", "", *misses]
    lines += _causes_table(rows)
    return "\n".join(lines) + "\n"


#: the options a recording saves with its profiles (``--from-raw`` reports them, not its own)
RECORDED = ("warmup", "rounds", "block", "skip", "max_other_load", "retries")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--pipelines",
        type=lambda s: [x.strip() for x in s.split(",") if x.strip()],
        default=None,
        help="comma-separated (default: all 12; with --quick the 10 that do not compile)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="2 ranks only, 2 rounds of 40 steps, no compiled pipelines"
    )
    parser.add_argument("--ranks", type=lambda s: [int(x) for x in s.split(",")], default=None, help="(default: 2,1)")
    parser.add_argument(
        "--rounds",
        type=lambda s: [int(x) for x in s.split(",")],
        default=None,
        help="rounds of blocks, one number or one per --ranks entry (default: 3, --quick 2)",
    )
    parser.add_argument("--block", type=int, default=None, help="consecutive steps per block (default: 60, --quick 40)")
    parser.add_argument("--skip", type=int, default=None, help="untimed steps per block (default: a third)")
    parser.add_argument("--warmup", type=int, default=None, help="dropped steps, interleaved (default: 20, --quick 10)")
    parser.add_argument("--latency-ms", type=float, default=10.0, help="loader latency (default: %(default)s)")
    parser.add_argument(
        "--max-other-load",
        type=float,
        default=0.25,
        help="a block during which other programs used more cores than this is run again (default: %(default)s)",
    )
    parser.add_argument("--retries", type=int, default=3, help="times a block may be run again (default: %(default)s)")
    parser.add_argument(
        "--quiet-wait",
        type=float,
        default=20.0,
        help="seconds to wait for the machine to be quiet before a block runs again (default: %(default)s)",
    )
    parser.add_argument("--size", type=size_arg, default=["small"], help="DLRM size (default: small)")
    parser.add_argument("--out", type=Path, default=Path("out/bench"), help="output folder (default: %(default)s)")
    parser.add_argument(
        "--from-raw", type=Path, metavar="FILE", help="analyse the profiles a run saved (OUT/sim_vs_real.raw.pkl)"
    )
    args = parser.parse_args(argv)
    args.rounds = args.rounds or [2 if args.quick else 3]
    args.block = args.block or (40 if args.quick else 60)
    args.skip = args.skip if args.skip is not None else args.block // 3
    args.warmup = args.warmup if args.warmup is not None else (10 if args.quick else 20)
    args.ranks = args.ranks or ([2] if args.quick else [2, 1])
    args.pipelines = args.pipelines or (QUICK_PIPELINES if args.quick else list(PIPELINES))
    unknown = [p for p in args.pipelines if p not in INFO]
    if unknown:
        parser.error(f"unknown pipeline(s) {unknown}; choose among {', '.join(PIPELINES)}")
    if args.block - args.skip < 4 or args.skip < 1 or args.warmup < 2 or args.latency_ms < 0 or min(args.rounds) < 1:
        parser.error("--block - --skip >= 4, --skip >= 1, --warmup >= 2, --rounds >= 1, --latency-ms >= 0")
    if len(args.rounds) not in (1, len(args.ranks)):
        parser.error(f"--rounds takes one number or one per --ranks entry ({len(args.ranks)})")
    if len(args.size) != 1:
        parser.error("--size takes one size")

    if args.from_raw:
        with args.from_raw.open("rb") as f:
            saved = pickle.load(f)
        runs, args.latency_ms = saved["runs"], saved["latency_ms"]
        # what the recording ran with (older ones saved none of it: they ran no block again)
        for key, value in saved.get("options", {"retries": 0}).items():
            setattr(args, key, value)
    else:
        from harness.ranks import run_on_ranks

        runs = {w: run_on_ranks(_rank, args, world_size=w, timeout_s=3600.0) for w in args.ranks}
        args.out.mkdir(parents=True, exist_ok=True)
        with (args.out / "sim_vs_real.raw.pkl").open("wb") as f:
            options = {k: getattr(args, k) for k in RECORDED}
            pickle.dump({"runs": runs, "latency_ms": args.latency_ms, "options": options}, f)
    rows = [row for w, per_rank in runs.items() for row in analyse(per_rank, w)]
    meta = run_meta("sim_vs_real.py", argv, args, "latency_ms", *RECORDED)
    meta.update(size=args.size[0], ranks=list(runs))
    write_report(args.out, "sim_vs_real", {"meta": meta, "summary": summary(rows), "rows": rows}, _markdown(rows, meta))


if __name__ == "__main__":
    main()
