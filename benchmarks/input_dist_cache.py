"""What reusing a held-out set's input dist saves per evaluation (``EvalPipelineSparseDist(input_dist_cache_mb=)``).

    python benchmarks/input_dist_cache.py                   # small DLRM, 16 held-out batches, 1 + 12 evaluations
    python benchmarks/input_dist_cache.py --size medium --evaluations 20

On 2 gloo ranks, each contender evaluates its own copy of the same DLRM (eval mode, under
``torch.no_grad()``) on the same held-out batches, one whole evaluation at a time (attach,
``progress()`` until StopIteration, detach, reset: what a train-and-evaluate loop does),
interleaved evaluation by evaluation (the order rotates):

* ``upstream``: TorchRec's EvalPipelineSparseDist (what a user of upstream evaluates with);
* ``ours``: our EvalPipelineSparseDist, no cache;
* ``ours, cached``: ours with ``input_dist_cache_mb`` (the first, untimed, evaluation fills it;
  every timed one reuses every batch's input dist);
* ``ours, cached, own agreement``: the same with ``sync_dataloader_exhaustion=False``, so that
  the ranks agree on each reuse in a blocking all-reduce of the cache's own before the batch's
  input dist, not in the agreement each draw makes anyway: what that agreement would cost.

Every contender must give the same outputs in every evaluation. Reported: the median time of
one evaluation (rank 0), the ratio to upstream's with the 95% bootstrap interval over paired
evaluations, the time saved per evaluation and per batch against ``ours``, and the cache's
counts and bytes per rank.

Writes ``OUT/input_dist_cache.json`` (default ``out/bench``) and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import percentile, rank_setup, ratio_interval, write_json
from harness.dlrm_data import DISTINCT_BATCHES, SIZES, batches

KINDS = ("upstream", "ours", "ours, cached", "ours, cached, own agreement")
CACHED = KINDS[2:]


def _tensors(value: Any) -> list[Any]:
    import torch

    if isinstance(value, torch.Tensor):
        return [value.detach().clone()]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _evaluate(pipeline: Any, model: Any, held_out: list[Any]) -> list[Any]:
    """One evaluation: every held-out batch once; the outputs' tensors."""
    import torch

    outputs = []
    pipeline.attach(model)
    it = iter(held_out)
    with torch.no_grad():
        while True:
            try:
                outputs.append(_tensors(pipeline.progress(it)))
            except StopIteration:
                break
    pipeline.detach()
    pipeline.reset()
    return outputs


def _rank(rank: int, world_size: int, args: argparse.Namespace) -> dict[str, Any]:
    rank_setup()
    import torch
    from torchrec.distributed.train_pipeline import train_pipelines as upstream

    from examples.dlrm.model import build_dlrm
    from torchrec_swp import EvalPipelineSparseDist

    size = SIZES[args.size]
    held_out = list(itertools.islice(batches(size, rank, args.batches), args.batches))
    cpu = torch.device("cpu")
    contenders: dict[str, tuple[Any, Any]] = {}
    for kind in KINDS:
        model, optimizer = build_dlrm(rank, world_size, size)
        model.eval()
        if kind == "upstream":
            pipeline = upstream.EvalPipelineSparseDist(model, optimizer, cpu)
        else:
            options: dict[str, Any] = {"input_dist_cache_mb": args.cap_mb} if kind in CACHED else {}
            if kind == "ours, cached, own agreement":
                options["sync_dataloader_exhaustion"] = False
            pipeline = EvalPipelineSparseDist(model, optimizer, cpu, **options)
        contenders[kind] = (pipeline, model)
    times: dict[str, list[float]] = {k: [] for k in KINDS}
    same = True
    try:
        for e in range(args.evaluations + 1):
            found: dict[str, list[Any]] = {}
            for k in range(len(KINDS)):
                kind = KINDS[(e + k) % len(KINDS)]
                pipeline, model = contenders[kind]
                start = time.perf_counter()
                found[kind] = _evaluate(pipeline, model, held_out)
                if e:  # the first evaluation fills the cache: untimed
                    times[kind].append(time.perf_counter() - start)
            base = found["upstream"]
            same = same and all(
                len(found[kind]) == len(base) == args.batches
                and all(torch.equal(a, b) for x, y in zip(found[kind], base) for a, b in zip(x, y, strict=True))
                for kind in KINDS
            )
        stats = {kind: contenders[kind][0].input_dist_cache.stats() for kind in CACHED}
    finally:
        for pipeline, _ in contenders.values():
            if hasattr(pipeline, "close"):
                pipeline.close()
    up = statistics.median(times["upstream"])
    ours = statistics.median(times["ours"])
    rows = []
    for kind in KINDS:
        median = statistics.median(times[kind])
        rows.append(
            {
                "label": kind,
                "median_ms": 1e3 * median,
                "p90_ms": 1e3 * percentile(times[kind], 0.9),
                "ratio": median / up,
                "ratio_95": ratio_interval(times["upstream"], times[kind]),
                "saved_ms": 1e3 * (ours - median),
            }
        )
    return {"rank": rank, "rows": rows, "same_outputs": same, "cache": stats}


def _markdown(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    n = args.batches
    lines = [
        f"EvalPipelineSparseDist, {args.size} DLRM, 2 gloo ranks, {n} held-out batches per rank, 1 + "
        f"{args.evaluations} evaluations interleaved (the first untimed), rank 0's times",
        "",
        "| contender | median ms / evaluation | P90 ms | / upstream (95% interval) | saved vs ours: ms / evaluation "
        "| ms / batch |",
        "|---|---|---|---|---|---|",
    ]
    for row in results[0]["rows"]:
        low, high = row["ratio_95"]
        lines.append(
            f"| {row['label']} | {row['median_ms']:.1f} | {row['p90_ms']:.1f} | {row['ratio']:.3f} "
            f"({low:.3f}-{high:.3f}) | {row['saved_ms']:+.1f} | {row['saved_ms'] / n:+.2f} |"
        )
    lines.append("")
    for r in results:
        for kind, c in r["cache"].items():
            seen = max(1, c["hits"] + c["misses"])
            lines.append(
                f"rank {r['rank']}, {kind}: {c['entries']} batches kept, {c['bytes'] / 1024:.1f} KiB; {c['hits']} "
                f"reused, {c['misses']} distributed; {c['carried']} agreed in the draws' agreement, own agreement "
                f"{1e3 * c['agree_s'] / seen:.3f} ms per batch"
            )
        same = "yes" if r["same_outputs"] else "NO"
        lines.append(f"rank {r['rank']}: same outputs as upstream in every evaluation: {same}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="small", help="DLRM size (default: %(default)s)")
    parser.add_argument(
        "--batches", type=int, default=DISTINCT_BATCHES, help="held-out batches per rank (default: %(default)s)"
    )
    parser.add_argument("--evaluations", type=int, default=12, help="timed evaluations (default: %(default)s)")
    parser.add_argument("--cap-mb", type=float, default=256.0, help="the cache's cap per rank (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=Path("out/bench"), help="output folder (default: %(default)s)")
    args = parser.parse_args(argv)
    if not 1 <= args.batches <= DISTINCT_BATCHES:
        parser.error(f"--batches must be 1..{DISTINCT_BATCHES} (the distinct synthetic batches), got {args.batches}")
    if args.evaluations < 1:
        parser.error(f"--evaluations must be >= 1, got {args.evaluations}")
    from harness.ranks import run_on_ranks

    results = run_on_ranks(_rank, args, timeout_s=1800)
    found = {"args": {k: str(v) for k, v in vars(args).items()}, "ranks": results}
    write_json(args.out / "input_dist_cache.json", found)
    print(_markdown(results, args))


if __name__ == "__main__":
    main()
