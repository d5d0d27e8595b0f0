"""What ``on_nonfinite="skip"`` costs a step where nothing goes wrong, against ``"off"`` (upstream's behaviour).

    python benchmarks/nonfinite_cost.py                     # small DLRM, 20 + 200 steps
    python benchmarks/nonfinite_cost.py --steps 400 --size medium

On 2 gloo ranks, TrainPipelineSparseDist trains its own copy of the same DLRM in each contender,
interleaved call by call (``benchmarks/common.py``), with the default plan:

* ``off``: the baseline, nothing captured (the plan and its program as without the option);
* ``skip``: every step captures the fused rows its ids touch (and their optimizer state), the
  dense parameters, gradients and optimizer state, checks them and the loss, all-reduces the
  verdict (one MAX of 5 floats on the default group) and keeps the new state (on the CPU the
  verdict is read on the host: nothing is restored when it says finite);
* ``skip, device selects``: the same with the GPU's path forced on the CPU: every restore is a
  ``torch.where`` on the verdict's tensor, whatever it says (what a GPU run does without
  reading it on the host), so its CPU cost is an upper bound of that path's work;
* ``skip, no reduction`` (a diagnosis, not a mode: each rank would decide alone): ``skip``
  without the verdict's all-reduce, to tell its cost from the captures' and checks'.

Every contender must give the same loss at every step. Reported per contender: median and P90
step time (rank 0), the ratio of its median to ``off``'s with the 95% bootstrap interval, the
added time per step, and the memory the captures hold per rank: the largest step's captured
bytes (held from the first capture of a step to its verdict, one step at a time), split into the
fused rows and the dense part.

Writes ``OUT/nonfinite_cost.json`` (default ``out/bench``) and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import Contender, interleave, rank_setup, ratio_interval, release, step_stats, write_json
from harness.dlrm_data import SIZES, batches

PIPELINE = "TrainPipelineSparseDist"
KINDS = ("off", "skip", "skip, device selects", "skip, no reduction")


def _nbytes(value: Any) -> int:
    import torch

    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    if isinstance(value, dict):
        return sum(_nbytes(v) for v in value.values())
    return 0


class CaptureMeter:
    """Wraps each effect's capture of a transaction: the bytes its copies hold, by effect, the
    largest step's (``fused_rows``: only the copies, not the row indices and views it keeps)."""

    def __init__(self, transaction: Any) -> None:
        self.largest: dict[str, int] = {}
        for name, effect in transaction.effects.items():
            original = effect.capture

            def capture(b: int, name: str = name, original: Any = original) -> Any:
                saved = original(b)
                held = (
                    sum(_nbytes(olds) for tables, _ in saved for _, _, olds in tables)
                    if name == "fused_rows"
                    else _nbytes(saved)
                )
                self.largest[name] = max(self.largest.get(name, 0), held)
                return saved

            effect.capture = capture


def _rank(rank: int, world_size: int, args: argparse.Namespace) -> dict[str, Any]:
    rank_setup()
    from examples.dlrm.model import build_dlrm
    from harness.dlrm import make_runner

    size = SIZES[args.size]
    total = args.warmup + args.steps
    build = lambda: build_dlrm(rank, world_size, size)  # noqa: E731
    contenders: list[Contender] = []
    meters: dict[str, CaptureMeter] = {}
    try:
        for kind in KINDS:
            options = {} if kind == "off" else {"on_nonfinite": "skip"}
            runner = make_runner(PIPELINE, "ours", build, options=options)
            transaction = runner.pipeline.engine.transaction
            if transaction is not None:
                meters[kind] = CaptureMeter(transaction)
                if kind == "skip, device selects":
                    transaction.host = False  # the GPU's path: restores selected on the verdict's tensor
                if kind == "skip, no reduction":
                    transaction._reduce = None  # (diagnosis: what the verdict's all-reduce costs)
            contenders.append(Contender(kind, runner, batches(size, rank, total + 5)))
        interleave(contenders, args.warmup)
        for c in contenders:
            c.times.clear()
        interleave(contenders, args.steps)
        skipped = {c.label: len(c.runner.pipeline.skipped_steps) for c in contenders}
    finally:
        release(*contenders)
    examples = size.batch_size * world_size
    base = contenders[0]
    base_ms = statistics.median(base.times) * 1e3
    rows = []
    for c in contenders:
        stats = step_stats(c.times, examples)
        held = meters[c.label].largest if c.label in meters else {}
        rows.append(
            {
                "label": c.label,
                **stats,
                "ratio": stats["median_ms"] / base_ms,
                "ratio_95": ratio_interval(base.times, c.times),
                "added_ms": stats["median_ms"] - base_ms,
                "captured_bytes": held,
                "skipped": skipped[c.label],
                "same_losses": c.losses == base.losses,
            }
        )
    return {"rank": rank, "rows": rows}


def _markdown(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [
        f"{PIPELINE}, {args.size} DLRM, 2 gloo ranks, {args.warmup} + {args.steps} steps interleaved, rank 0's times",
        "",
        "| contender | median ms | P90 ms | / off (95% interval) | added ms / step "
        "| captured per step, rank 0: fused rows / dense (KiB) | rank 1 | steps rolled back | same losses |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for k, row in enumerate(results[0]["rows"]):
        low, high = row["ratio_95"]
        held = [r["rows"][k]["captured_bytes"] for r in results]

        def kib(h: dict[str, int]) -> str:
            if not h:
                return "-"
            fused = h.get("fused_rows", 0)
            return f"{fused / 1024:.1f} / {(sum(h.values()) - fused) / 1024:.1f}"

        lines.append(
            f"| {row['label']} | {row['median_ms']:.2f} | {row['p90_ms']:.2f} "
            f"| {row['ratio']:.3f} ({low:.3f}-{high:.3f}) | {row['added_ms']:+.2f} "
            f"| {kib(held[0])} | {kib(held[1]) if len(held) > 1 else '-'} | {row['skipped']} "
            f"| {'yes' if row['same_losses'] else 'NO'} |"
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
    write_json(args.out / "nonfinite_cost.json", {"args": {k: str(v) for k, v in vars(args).items()}, "ranks": results})
    print(_markdown(results, args))


if __name__ == "__main__":
    main()
