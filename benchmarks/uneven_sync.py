"""What ``sync_dataloader_exhaustion`` (on by default) costs the training thread, against upstream's proposal
(one all-reduce on the training thread per ``progress()`` call).

    python benchmarks/uneven_sync.py                     # small DLRM, 20 + 200 steps
    python benchmarks/uneven_sync.py --steps 400 --size medium

On 2 gloo ranks, TrainPipelineSparseDist trains its own copy of the same DLRM in each contender,
interleaved call by call (``benchmarks/common.py``), with the draw on the training thread (the
default plan) and on a loader thread (``thread_map="io", lookahead=1``):

* ``<where>, no sync``: the baseline (``sync_dataloader_exhaustion=False``), what upstream does
  without its proposal;
* ``<where>, ours``: the default: a MIN all-reduce per draw on a gloo group of the pipeline's
  own, begun by the thread that draws and waited for by the batch's next task (deferred);
* ``<where>, per progress``: upstream's proposal, emulated: the pipeline without the sync,
  wrapped so that a MIN all-reduce of one int32 on a gloo group of its own runs on the training
  thread before each ``progress()`` call.

Every contender must give the same loss at every step. Reported per contender: median and P90
step time (rank 0), the ratio of its median to its baseline's with the 95% bootstrap interval,
the added time per step (median minus the baseline's), and the time the all-reduce itself took
per step, by thread (training thread or loader thread): measured around each call. The last
column is the figure asked for: the all-reduce's time on the training thread per step, ours
over upstream's proposal.

Writes ``OUT/uneven_sync.json`` (default ``out/bench``) and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import Contender, interleave, rank_setup, ratio_interval, release, step_stats, write_json
from harness.dlrm_data import SIZES, batches

PIPELINE = "TrainPipelineSparseDist"
#: where the draw runs -> the engine options placing it there
WHERE: dict[str, dict[str, Any]] = {
    "training thread": {},
    "loader thread": {"thread_map": "io", "lookahead": 1},
}
KINDS = ("no sync", "ours", "per progress")


class PerProgress:
    """Upstream's proposal, emulated around a runner: before each ``step`` (one ``progress()``
    call) a MIN all-reduce of one int32 on ``group``, on the calling thread; ``seconds`` holds
    its time by thread name."""

    def __init__(self, runner: Any, group: Any) -> None:
        self.runner, self.group = runner, group
        self.seconds: dict[str, float] = {}

    @property
    def pipeline(self) -> Any:
        return self.runner.pipeline

    def step(self, it: Any) -> Any:
        import torch
        import torch.distributed as dist

        start = time.perf_counter()
        flag = torch.tensor([1], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        thread = threading.current_thread().name
        self.seconds[thread] = self.seconds.get(thread, 0.0) + time.perf_counter() - start
        if not flag.item():
            raise StopIteration
        return self.runner.step(it)

    def close(self) -> None:
        self.runner.close()


def _collective_seconds(c: Contender) -> dict[str, float]:
    """The all-reduce's time so far, by thread ("training" for the calling thread, else "loader")."""
    runner = c.runner
    if isinstance(runner, PerProgress):
        seconds = runner.seconds
    else:
        sync = runner.pipeline.engine.exhaustion
        seconds = {} if sync is None else sync.seconds
    main = threading.current_thread().name
    out = {"training": 0.0, "loader": 0.0}
    for thread, s in seconds.items():
        out["training" if thread == main else "loader"] += s
    return out


def _rank(rank: int, world_size: int, args: argparse.Namespace) -> dict[str, Any]:
    rank_setup()
    import torch.distributed as dist

    from examples.dlrm.model import build_dlrm
    from harness.dlrm import make_runner

    size = SIZES[args.size]
    total = args.warmup + args.steps
    build = lambda: build_dlrm(rank, world_size, size)
    contenders: list[Contender] = []
    try:
        for where, engine in WHERE.items():
            for kind in KINDS:
                thread_map = engine.get("thread_map")
                options = {k: v for k, v in engine.items() if k != "thread_map"}
                # ours: the default (on with several ranks); the others without it
                options["sync_dataloader_exhaustion"] = None if kind == "ours" else False
                runner: Any = make_runner(PIPELINE, "ours", build, thread_map=thread_map, options=options)
                if kind == "per progress":
                    runner = PerProgress(runner, dist.new_group(backend="gloo"))
                contenders.append(Contender(f"{where}, {kind}", runner, batches(size, rank, total + 5)))
        interleave(contenders, args.warmup)
        warm = {c.label: _collective_seconds(c) for c in contenders}
        for c in contenders:
            c.times.clear()
        interleave(contenders, args.steps)
        spent = {c.label: _collective_seconds(c) for c in contenders}
    finally:
        release(*contenders)
    examples = size.batch_size * world_size
    rows = []
    for k, c in enumerate(contenders):
        base = contenders[k - k % len(KINDS)]
        stats = step_stats(c.times, examples)
        base_ms = statistics.median(base.times) * 1e3
        per_step = {t: 1e3 * (spent[c.label][t] - warm[c.label][t]) / args.steps for t in ("training", "loader")}
        rows.append(
            {
                "label": c.label,
                **stats,
                "ratio": stats["median_ms"] / base_ms,
                "ratio_95": ratio_interval(base.times, c.times),
                "added_ms": stats["median_ms"] - base_ms,
                "collective_training_ms": per_step["training"],
                "collective_loader_ms": per_step["loader"],
                "same_losses": c.losses == base.losses,
            }
        )
    return {"rank": rank, "rows": rows}


def _markdown(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    rows = {r["label"]: r for r in results[0]["rows"]}
    lines = [
        f"{PIPELINE}, {args.size} DLRM, 2 gloo ranks, {args.warmup} + {args.steps} steps interleaved, rank 0's times",
        "",
        (
            "| contender | median ms | P90 ms | / no sync (95% interval) | added ms / step "
            "| all-reduce ms / step on the training thread | on the loader thread | same losses |"
        ),
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows.values():
        low, high = row["ratio_95"]
        lines.append(
            f"| {row['label']} | {row['median_ms']:.2f} | {row['p90_ms']:.2f} "
            f"| {row['ratio']:.3f} ({low:.3f}-{high:.3f}) "
            f"| {row['added_ms']:+.2f} | {row['collective_training_ms']:.3f} | {row['collective_loader_ms']:.3f} "
            f"| {'yes' if row['same_losses'] else 'NO'} |"
        )
    lines.append("")
    for where in WHERE:
        ours, theirs = rows[f"{where}, ours"], rows[f"{where}, per progress"]
        ratio = ours["collective_training_ms"] / theirs["collective_training_ms"]
        lines.append(
            f"* draw on the {where}: the all-reduce's time on the training thread, ours / per progress: "
            f"{ours['collective_training_ms']:.3f} / {theirs['collective_training_ms']:.3f} ms = {ratio:.2f}; "
            f"added step time, ours / per progress: {ours['added_ms']:+.2f} / {theirs['added_ms']:+.2f} ms"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="small", help="DLRM size (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=200, help="timed steps (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=20, help="untimed steps first (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=Path("out/bench"), help="output folder (default: %(default)s)")
    args = parser.parse_args(argv)
    from harness.ranks import run_on_ranks

    results = run_on_ranks(_rank, args, timeout_s=1800)
    write_json(args.out / "uneven_sync.json", {"args": {k: str(v) for k, v in vars(args).items()}, "ranks": results})
    print(_markdown(results, args))


if __name__ == "__main__":
    main()
