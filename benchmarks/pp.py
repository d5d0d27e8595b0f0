"""Pipeline parallelism on 2 CPU gloo ranks: Maglev's own schedules against ours, our other
schedules, and the simulator's prediction of each step against the measured one.

Model: TorchRec's MaglevTestModel (4 layers of an EmbeddingBagCollection, a dense projection
and a residual), 8 microbatches a step. Maglev-family contenders cut it into 2 stages (one per
rank, upstream's StageWrapper fed by the CPU input driver); Interleaved1F1B and ZBV cut it into
4 one-layer stages, 2 per rank (``PipelineRank``). Every contender trains its own copy.

Timing (``benchmarks/common.py``'s rules): contenders are interleaved step by step, the order
rotating every step; before each step the ranks meet at a barrier, and a step's time is the
slower rank's ``progress()``; the first ``--warmup`` steps are dropped. ``ours / upstream`` is
the ratio of medians over the same steps with a 95% bootstrap interval.

Simulated vs measured: after the timed steps, our contenders run ``--calibrate`` more steps,
interleaved the same way, with the engine instrumented (``ProgramEngine.instrument``): every
action's duration, minus the time a compute action waited for the wire, averaged per kind and
stage, plus the transfer latency of one activation (a gloo ping-pong), become the simulator's
``ActionDurations``; ``pp.simulate`` of the program then predicts the time of ``run_program``, compared
with the measured one (the engine's step time in the same instrumented steps).

    python benchmarks/pp.py                  # about a minute; out/pp/pp.json and out/pp/pp.md
    python benchmarks/pp.py --steps 60 --size medium
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import percentile, rank_setup, ratio_interval, write_json
from benchmarks.report import load_average

OUT = Path("out/pp")
MICROBATCHES = 8
DISTINCT = 8  # distinct batches per rank, repeated: data generation stays out of the timings
_TABLES = {"num_tables": 4, "emb_dim": 32, "num_embeddings": 5000, "num_float_features": 32, "pooling": 8}
SIZES: dict[str, dict[str, int]] = {
    "small": {"batch_size": 256, "layer_dim": 256, **_TABLES},
    "medium": {"batch_size": 512, "layer_dim": 512, **_TABLES},
}

#: (label, implementation, what, options): "upstream"/"ours" Maglev classes on a StageWrapper,
#: "rank": a PipelineRank running a builder's program on 4 stages.
CONTENDERS: list[tuple[str, str, str, dict[str, Any]]] = [
    ("upstream Maglev1F1B", "upstream", "Maglev1F1B", {}),
    ("ours Maglev1F1B", "ours", "Maglev1F1B", {}),
    ("ours Maglev1F1B, P2P on a comm thread", "ours", "Maglev1F1B", {"thread_map": "comm"}),
    ("upstream Maglev1F1BRecvAhead", "upstream", "Maglev1F1BRecvAhead", {}),
    ("ours Maglev1F1BRecvAhead", "ours", "Maglev1F1BRecvAhead", {}),
    ("ours ZB-H1", "ours", "Maglev1F1B", {"schedule": "ZB-H1"}),
    ("ours 1F1B-split (sparse hoist)", "ours", "Maglev1F1B", {"schedule": "1F1B-split"}),
    ("ours GPipe", "ours", "Maglev1F1B", {"schedule": "GPipe"}),
    ("ours Interleaved1F1B (4 stages, 2 per rank)", "rank", "Interleaved1F1B", {"thread_map": "comm"}),
    ("ours ZBV (4 stages in a V)", "rank", "ZBV", {"thread_map": "comm"}),
]
PAIRS = [("upstream Maglev1F1B", "ours Maglev1F1B"), ("upstream Maglev1F1BRecvAhead", "ours Maglev1F1BRecvAhead")]


@dataclass
class _Contender:
    label: str
    run: Any
    pipeline: Any = None
    times: list[float] = field(default_factory=list)

    def step(self) -> None:
        self.run()


class _Timings:
    """ProgramEngine observer: action durations and step times."""

    def __init__(self) -> None:
        self.actions: list[tuple[str, float]] = []
        self.steps: list[float] = []
        self.in_actions: dict[int, float] = defaultdict(float)  # step -> seconds inside actions

    def on_run(self, task: str, batch: int, thread: str, iteration: int, start: float, end: float) -> None:
        self.actions.append((task, end - start))
        self.in_actions[iteration] += end - start

    def on_wait(self, producer: str, thread: str, iteration: int, start: float, end: float) -> None:
        return None

    def on_iteration(self, iteration: int, start: float, end: float) -> None:
        self.steps.append(end - start)


def _build(label: str, impl: str, what: str, options: dict[str, Any], size: dict[str, int], rank: int) -> _Contender:
    import torch
    from torchrec.distributed.maglev import pipeline as upstream
    from torchrec.distributed.maglev.stage import StageWrapper

    from torchrec_swp.integrations.torchrec import maglev as ours
    from torchrec_swp.integrations.torchrec.maglev.cpu import ModelConfig, build_model, make_batches, on_cpu
    from torchrec_swp.pp import build

    config = ModelConfig(**size)
    if impl == "rank":
        program = build(what, 2, MICROBATCHES)
        per_stage = [config.num_layers // program.num_stages] * program.num_stages
        runner = ours.PipelineRank(
            build_model(config), per_stage, program, optimizer=lambda ps: torch.optim.SGD(ps, lr=1e-4), **options
        )
        per_rank = [make_batches(config, DISTINCT, seed=r) for r in range(2)]
        # the order the cascade all-to-all hands the Maglev contenders their microbatches
        order = itertools.cycle([per_rank[j][k] for k in range(DISTINCT) for j in range(2)])
        return _Contender(label, lambda: runner.progress([next(order) for _ in range(MICROBATCHES)]), runner)
    stage = on_cpu(StageWrapper(build_model(config), list(config.layers_per_stage), stage_size=1))
    optimizer = torch.optim.SGD(stage.module.parameters(), lr=1e-4)
    pipeline = getattr(upstream if impl == "upstream" else ours, what)(stage, optimizer, MICROBATCHES, **options)
    batches = itertools.cycle(make_batches(config, DISTINCT, seed=rank))
    return _Contender(label, lambda: pipeline.progress(batches), pipeline if impl == "ours" else None)


def _latency_s(size: dict[str, int], rounds: int = 50) -> float:
    """Half the round trip of one activation between the two ranks (gloo isend/irecv)."""
    import torch
    import torch.distributed as dist

    t = torch.zeros(size["batch_size"], size["layer_dim"])
    rank, other = dist.get_rank(), 1 - dist.get_rank()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(rounds):
        if rank == 0:
            dist.send(t, other)
            dist.recv(t, other)
        else:
            dist.recv(t, other)
            dist.send(t, other)
    return (time.perf_counter() - start) / rounds / 2


class _Calibration:
    """Instrumented steps of one of our contenders: compute-only action durations (the time a
    compute action waited for the wire subtracted) and the engine's step times."""

    def __init__(self, c: _Contender) -> None:
        self.c, self.timings = c, _Timings()
        self.per: dict[str, list[float]] = defaultdict(list)  # "<stage><kind>" -> compute-only seconds
        c.pipeline.engine.instrument(self.timings)

    def step(self) -> None:
        from torchrec_swp.pp.actions import Action

        runtime, seen = self.c.pipeline.runtime, len(self.timings.actions)
        runtime.awaited = {}
        self.c.step()
        for text, seconds in self.timings.actions[seen:]:
            a = Action.from_text(text)
            if a.kind.value in ("F", "B", "I"):
                seconds -= runtime.awaited.get(("F" if a.kind.value == "F" else "B", a.stage, a.microbatch or 0), 0.0)
            self.per[f"{a.stage}{a.kind.value}"].append(max(0.0, seconds))

    def result(self) -> dict[str, Any]:
        pipeline, timings = self.c.pipeline, self.timings
        pipeline.engine.instrument()
        pipeline.runtime.awaited = None
        out: dict[str, Any] = {
            "actions": {k: statistics.mean(v) for k, v in self.per.items()},
            "program_s": timings.steps,
        }
        if pipeline.lowered.single_thread:  # one thread: what is not an action is the engine's own time
            first = min(timings.in_actions)
            outside = [total - timings.in_actions[first + k] for k, total in enumerate(timings.steps)]
            out["engine_overhead_s"] = statistics.median(outside)
            out["actions_per_step"] = len(timings.actions) / len(timings.steps)
        return out


def _interleaved(steps: int, runners: list[Any], times: list[list[float]] | None = None) -> None:
    """``steps`` steps of every runner, the order rotating each step, the ranks meeting before each."""
    import torch.distributed as dist

    for step in range(steps):
        for k in range(len(runners)):
            i = (step + k) % len(runners)
            dist.barrier()
            start = time.perf_counter()
            runners[i].step()
            if times is not None:
                times[i].append(time.perf_counter() - start)


def _rank(rank: int, world_size: int, args: argparse.Namespace) -> dict[str, Any]:
    rank_setup()
    size = SIZES[args.size]
    contenders = [_build(*spec, size, rank) for spec in CONTENDERS]
    _interleaved(args.warmup, contenders)
    _interleaved(args.steps, contenders, [c.times for c in contenders])
    latency = _latency_s(size)
    calibrations = [_Calibration(c) for c in contenders if c.pipeline is not None]
    _interleaved(args.calibrate, calibrations)
    calibration = {cal.c.label: cal.result() for cal in calibrations}
    programs = {c.label: c.pipeline.program.to_text() for c in contenders if c.pipeline is not None}
    for c in contenders:
        if c.pipeline is not None:
            c.pipeline.close()
    return {
        "times": {c.label: c.times for c in contenders},
        "calibration": calibration,
        "programs": programs,
        "latency_s": latency,
    }


def _durations(label: str, results: list[dict[str, Any]], latency_s: float) -> Any:
    """The simulator's ActionDurations from both ranks' calibration of ``label``."""
    from torchrec_swp.pp import ActionDurations

    per_stage: dict[int, dict[str, float]] = defaultdict(dict)
    p2p: list[float] = []
    other: dict[str, list[float]] = defaultdict(list)
    for r in results:
        for key, seconds in r["calibration"][label]["actions"].items():
            stage, kind = int("".join(ch for ch in key if ch.isdigit())), "".join(ch for ch in key if ch.isalpha())
            if kind in ("SF", "RF", "SB", "RB"):
                p2p.append(seconds)
            elif kind in ("G", "O"):
                other[kind].append(seconds)
            else:
                per_stage[stage][kind] = seconds
    kinds = sorted({k for d in per_stage.values() for k in d})
    base = {k: statistics.mean(d[k] for d in per_stage.values() if k in d) for k in kinds}
    scale = []
    for s in range(max(per_stage) + 1):
        d = per_stage.get(s, {})
        scale.append(sum(d.values()) / sum(base[k] for k in d) if d else 1.0)
    fields = {k: base.get(k, 0.0) for k in ("F", "E", "B", "I", "W")}
    return ActionDurations(
        **fields,
        P2P=statistics.mean(p2p) if p2p else 0.0,
        G=statistics.mean(other["G"]) if other["G"] else 0.0,
        O=statistics.mean(other["O"]) if other["O"] else 0.0,
        latency=latency_s,
        stage_scale=tuple(scale),
    )


def _report(results: list[dict[str, Any]], args: argparse.Namespace, wall_s: float) -> dict[str, Any]:
    from torchrec_swp.pp import Program, simulate

    labels = [c[0] for c in CONTENDERS]
    steps = {label: [max(r["times"][label][k] for r in results) for k in range(args.steps)] for label in labels}
    latency = max(r["latency_s"] for r in results)
    rows = []
    for label in labels:
        times = steps[label]
        row: dict[str, Any] = {
            "contender": label,
            "median_ms": 1e3 * statistics.median(times),
            "p90_ms": 1e3 * percentile(times, 0.9),
        }
        if label in results[0]["calibration"]:
            program = Program.from_text(results[0]["programs"][label])
            durations = _durations(label, results, latency)
            sim = simulate(program, durations)
            measured = statistics.median(x for r in results for x in r["calibration"][label]["program_s"])
            row.update(
                program=program.name,
                simulated_ms=1e3 * sim.makespan,
                measured_program_ms=1e3 * measured,
                simulated_over_measured=sim.makespan / measured,
                simulated_bubble=sim.bubble,
                durations=str(durations),
            )
            overhead = [r["calibration"][label].get("engine_overhead_s") for r in results]
            if all(o is not None for o in overhead):
                row["engine_overhead_us_per_step"] = 1e6 * statistics.mean(overhead)  # type: ignore[arg-type]
                row["actions_per_step"] = results[0]["calibration"][label]["actions_per_step"]
        rows.append(row)
    pairs = []
    for base, other in PAIRS:
        lo, hi = ratio_interval(steps[base], steps[other])
        pairs.append(
            {
                "upstream": base,
                "ours": other,
                "ratio": statistics.median(steps[other]) / statistics.median(steps[base]),
                "ci95": [lo, hi],
            }
        )
    return {
        "size": args.size,
        "model": SIZES[args.size],
        "microbatches": MICROBATCHES,
        "steps": args.steps,
        "warmup": args.warmup,
        "calibrate": args.calibrate,
        "latency_us": 1e6 * latency,
        "rows": rows,
        "pairs": pairs,
        "machine": {
            "cpus": os.cpu_count(),
            "load_average_after": load_average(),
            "python": platform.python_version(),
            "note": "2 gloo ranks share the machine's cores; other work may run beside them: compare ratios",
        },
        "wall_s": wall_s,
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }


def _markdown(report: dict[str, Any]) -> str:
    lines = [
        f"# Pipeline parallelism on 2 CPU gloo ranks ({report['date']})",
        "",
        (
            f"MaglevTestModel, size {report['size']} ({report['model']}), {report['microbatches']} microbatches a "
            f"step; {report['steps']} measured steps after {report['warmup']} warm-up, contenders interleaved step by "
            f"step; a step is the slower rank's `progress()`. {report['machine']['cpus']} CPUs, load average after the "
            f"run {report['machine']['load_average_after']}: the machine is shared, so absolute times move by tens of "
            "percent from run to run; compare ratios and the simulated/measured columns."
        ),
        "",
        "| pair (same schedule) | ours / upstream median step | 95% interval |",
        "|---|---|---|",
    ]
    for p in report["pairs"]:
        lines.append(f"| {p['ours']} vs {p['upstream']} | {p['ratio']:.3f} | {p['ci95'][0]:.3f} - {p['ci95'][1]:.3f} |")
    lines += [
        "",
        (
            f"Simulator calibrated per contender from {report['calibrate']} instrumented steps (compute-only action "
            f"times per kind and stage; transfer latency {report['latency_us']:.0f} us from a ping-pong); "
            "`simulated` is `pp.simulate(program).makespan`, `measured` the engine's `run_program` time in those steps."
        ),
        "",
        "| contender | median step ms | p90 ms | simulated program ms | measured program ms | sim / measured "
        "| simulated bubble |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        if "simulated_ms" in r:
            extra = (
                f"{r['simulated_ms']:.1f} | {r['measured_program_ms']:.1f} | {r['simulated_over_measured']:.2f} | "
                f"{r['simulated_bubble']:.3f}"
            )
        else:
            extra = "- | - | - | -"
        lines.append(f"| {r['contender']} | {r['median_ms']:.1f} | {r['p90_ms']:.1f} | {extra} |")
    lines += [""]
    for r in report["rows"]:
        if "engine_overhead_us_per_step" in r:
            lines.append(
                f"Engine time per step outside the actions ({r['contender']}, one thread, "
                f"{r['actions_per_step']:.0f} actions per rank, median step, mean of ranks, observer included): "
                f"{r['engine_overhead_us_per_step']:.0f} us "
                f"({r['engine_overhead_us_per_step'] / 10 / r['measured_program_ms']:.2f}% of the step)."
            )
    lines += ["", f"Run time {report['wall_s']:.0f} s.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--steps", type=int, default=30, help="measured steps per contender (default 30)")
    parser.add_argument("--warmup", type=int, default=5, help="dropped steps per contender (default 5)")
    parser.add_argument("--calibrate", type=int, default=5, help="instrumented steps per contender (default 5)")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    from harness.ranks import run_on_ranks

    results = run_on_ranks(_rank, args, timeout_s=3600)
    report = _report(results, args, time.perf_counter() - start)
    write_json(args.out / "pp.json", report)
    (args.out / "pp.md").write_text(_markdown(report))
    print(_markdown(report))
    return report


if __name__ == "__main__":
    main()
