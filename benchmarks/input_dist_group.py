"""The input dist on a process group of its own (``input_dist_group=``): does the next batch's
input dist then overlap this batch's forward and backward, and what does the group cost?

    python benchmarks/input_dist_group.py                       # small DLRM, 20 + 200 steps (about 40 s)
    python benchmarks/input_dist_group.py --size medium --steps 100

On 2 gloo ranks, TrainPipelineSparseDist trains its own copy of the same DLRM in each of these
contenders, interleaved call by call (``benchmarks/common.py``):

* ``one thread``, ``one thread+group``: the default plan, without and with the group;
* ``dist thread``, ``dist thread+group``: InitPipelinedModules, InputDistStart and InputDistWait
  on thread ``dist`` (the input dist of batch i+1 next to forward/backward of batch i), without
  the group (one ``world`` turnstile orders them with Forward and Backward) and with it;
* ``by_stream``, ``by_stream+group``: one thread per stream (H2D on ``memcpy`` too).

Every contender must give the same loss at every step. Reported: median and P90 step time, the
ratio of each median to ``one thread`` with its 95% bootstrap interval; then, in a separate pass
of ``--overlap-steps`` steps per contender with an observer attached to its engine, the overlap:
per step, the time during which an input dist task (of batch i+1) and Forward or Backward (of
batch i) ran at once, and the input dist tasks' own time. The group's cost, per
rank: RSS and open file descriptors before ``new_group``, after it, and after its first
all-to-all; the contenders with the group share that one group (``input_dist_group=group``).

Writes ``OUT/input_dist_group.json`` (default ``out/bench``) and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import Contender, interleave, rank_setup, ratio_interval, release, step_stats, write_json
from harness.dlrm_data import SIZES, batches

PIPELINE = "TrainPipelineSparseDist"
DIST = {"InitPipelinedModules": "dist", "InputDistStart": "dist", "InputDistWait": "dist"}
#: label -> (thread map, with the group)
CONTENDERS: dict[str, tuple[Any, bool]] = {
    "one thread": (None, False),
    "one thread+group": (None, True),
    "dist thread": (DIST, False),
    "dist thread+group": (DIST, True),
    "by_stream": ("by_stream", False),
    "by_stream+group": ("by_stream", True),
}


INPUT_DIST_TASKS = ("InitPipelinedModules", "InputDistStart", "InputDistWait")


class _Overlap:
    """Engine observer: the task intervals of each internal iteration; ``take()`` returns, for
    the iterations since the last call, the mean per iteration of the time input dist tasks ran
    together with Forward or Backward, and of the input dist tasks' own time (seconds)."""

    def __init__(self) -> None:
        self._runs: list[tuple[str, int, float, float]] = []

    def on_run(self, task: str, batch: int, thread: str, iteration: int, start: float, end: float) -> None:
        self._runs.append((task, iteration, start, end))

    def on_wait(self, producer: str, thread: str, iteration: int, start: float, end: float) -> None:
        return None

    def on_iteration(self, iteration: int, start: float, end: float) -> None:
        return None

    def take(self) -> tuple[float, float]:
        runs, self._runs = self._runs, []
        iterations = {i for _, i, _, _ in runs}
        together = own = 0.0
        for it in iterations:
            dist_runs = [(s, e) for t, i, s, e in runs if i == it and t in INPUT_DIST_TASKS]
            step_runs = [(s, e) for t, i, s, e in runs if i == it and t in ("Forward", "Backward")]
            own += sum(e - s for s, e in dist_runs)
            together += sum(max(0.0, min(e, f) - max(s, g)) for s, e in dist_runs for g, f in step_runs)
        n = max(1, len(iterations))
        return together / n, own / n


def _overlap_pass(contenders: list[Contender], steps: int) -> dict[str, dict[str, float]]:
    """``steps`` more steps of each contender alone, an _Overlap observer attached."""
    out = {}
    for c in contenders:
        observer = _Overlap()
        c.runner.pipeline.engine.instrument(observer)
        for _ in range(steps):
            c.runner.step(c.batches)
        together, own = observer.take()
        c.runner.pipeline.engine.instrument()
        out[c.label] = {"together_ms": 1e3 * together, "input_dist_ms": 1e3 * own}
    return out


def _process_usage() -> dict[str, float]:
    """This process's resident set (MiB, from /proc/self/status) and open file descriptors."""
    with open("/proc/self/status", encoding="ascii") as f:
        rss_kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return {"rss_mib": rss_kib / 1024, "fds": len(os.listdir("/proc/self/fd"))}


def _group_cost() -> tuple[Any, dict[str, Any]]:
    import torch
    import torch.distributed as dist

    from torchrec_swp.integrations.torchrec.input_dist_group import new_input_dist_group

    dist.barrier()
    before = _process_usage()
    start = time.perf_counter()
    group = new_input_dist_group()
    created_s = time.perf_counter() - start
    after_new = _process_usage()
    world = dist.get_world_size(group)
    out = torch.empty(world, dtype=torch.int64)
    dist.all_to_all_single(out, torch.arange(world, dtype=torch.int64), group=group)
    after_use = _process_usage()
    return group, {
        "before": before,
        "after_new_group": after_new,
        "after_first_all_to_all": after_use,
        "new_group_s": created_s,
    }


def _rank(rank: int, world_size: int, args: argparse.Namespace) -> dict[str, Any]:
    rank_setup()
    from examples.dlrm.model import build_dlrm
    from harness.dlrm import make_runner

    group, cost = _group_cost()
    size = SIZES[args.size]
    total = args.warmup + args.steps
    build = lambda: build_dlrm(rank, world_size, size)
    contenders = []
    try:
        for label, (thread_map, with_group) in CONTENDERS.items():
            options = {"input_dist_group": group} if with_group else {}
            runner = make_runner(PIPELINE, "ours", build, thread_map=thread_map, options=options)
            contenders.append(Contender(label, runner, batches(size, rank, total + args.overlap_steps)))
        interleave(contenders, total)
        overlap = _overlap_pass(contenders, args.overlap_steps)
    finally:
        release(*contenders)
    base = contenders[0]
    examples = size.batch_size * world_size
    base_ms = step_stats(base.times[args.warmup :], examples)["median_ms"]
    rows = []
    for c in contenders:
        stats = step_stats(c.times[args.warmup :], examples)
        rows.append(
            {
                "label": c.label,
                **stats,
                "ratio": stats["median_ms"] / base_ms,
                "ratio_95": ratio_interval(base.times[args.warmup :], c.times[args.warmup :]),
                "same_losses": c.losses == base.losses,
                **overlap[c.label],
            }
        )
    return {"rank": rank, "cost": cost, "rows": rows}


def _markdown(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [
        f"{PIPELINE}, {args.size} DLRM, 2 gloo ranks, {args.warmup} + {args.steps} steps, rank 0's times",
        "",
        (
            "| contender | median ms | P90 ms | / one thread (95% interval) | same losses "
            "| input dist ms / step | of which with Forward or Backward |"
        ),
        "|---|---|---|---|---|---|---|",
    ]
    for row in results[0]["rows"]:
        low, high = row["ratio_95"]
        same = "yes" if row["same_losses"] else "NO"
        lines.append(
            f"| {row['label']} | {row['median_ms']:.2f} | {row['p90_ms']:.2f} "
            f"| {row['ratio']:.3f} ({low:.3f}-{high:.3f}) | {same} "
            f"| {row['input_dist_ms']:.2f} | {row['together_ms']:.2f} |"
        )
    lines += [
        "",
        "| rank | RSS MiB before | after new_group | after its first all-to-all | fds before / after | new_group s |",
    ]
    lines.append("|---|---|---|---|---|---|")
    for r in results:
        c = r["cost"]
        b, n, u = c["before"], c["after_new_group"], c["after_first_all_to_all"]
        lines.append(
            f"| {r['rank']} | {b['rss_mib']:.1f} | {n['rss_mib']:.1f} (+{n['rss_mib'] - b['rss_mib']:.1f}) "
            f"| {u['rss_mib']:.1f} (+{u['rss_mib'] - b['rss_mib']:.1f}) | {b['fds']} / {u['fds']} "
            f"| {c['new_group_s']:.3f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="small", help="DLRM size (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=200, help="timed steps (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=20, help="untimed steps first (default: %(default)s)")
    parser.add_argument(
        "--overlap-steps", type=int, default=50, help="observed steps per contender (default: %(default)s)"
    )
    parser.add_argument("--out", type=Path, default=Path("out/bench"), help="output folder (default: %(default)s)")
    args = parser.parse_args(argv)
    from harness.ranks import run_on_ranks

    results = run_on_ranks(_rank, args, timeout_s=1800)  # every rank's result: the group's cost per rank
    write_json(
        args.out / "input_dist_group.json", {"args": {k: str(v) for k, v in vars(args).items()}, "ranks": results}
    )
    print(_markdown(results, args))


if __name__ == "__main__":
    main()
