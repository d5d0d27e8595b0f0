"""Per-step time of torchrec_swp's pipelines next to upstream TorchRec's, in one run.

    python benchmarks/step_time.py                 # 2 gloo ranks on this machine
    python benchmarks/step_time.py --steps 400 --loader-latency-ms 5 --json out/step_time.json

For each pair (upstream pipeline, ours with a given thread_map) both pipelines train their own
copy of the same DLRM, interleaved call by call (who goes first alternates every step), so both
see the same machine load. The first ``--warmup`` calls of each are dropped. Reported per pair:
median and P90 of the ``progress()`` time on rank 0 and the ratio ours/upstream of the medians.
Timings on a shared 2-core machine vary by +-30% from run to run: compare ratios, not absolutes.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from examples.dlrm.model import build_dlrm, random_batches  # noqa: E402

CPU = torch.device("cpu")


def _pairs() -> dict[str, tuple[Callable[..., Any], Callable[..., Any]]]:
    import torchrec.distributed.train_pipeline.train_pipelines as upstream

    import torchrec_swp

    return {
        "TrainPipelineBase": (
            lambda m, o: upstream.TrainPipelineBase(m, o, CPU),
            lambda m, o: torchrec_swp.TrainPipelineBase(m, o, CPU),
        ),
        "TrainPipelineSparseDist": (
            lambda m, o: upstream.TrainPipelineSparseDist(m, o, CPU),
            lambda m, o: torchrec_swp.TrainPipelineSparseDist(m, o, CPU),
        ),
        "TrainPipelineSparseDist[H2D on io thread]": (
            lambda m, o: upstream.TrainPipelineSparseDist(m, o, CPU),
            lambda m, o: torchrec_swp.TrainPipelineSparseDist(m, o, CPU, thread_map={"H2D": "io"}),
        ),
    }


def _slow(batches: Iterator[Any], latency_s: float) -> Iterator[Any]:
    """A data loader that waits ``latency_s`` per batch (storage latency; releases the GIL)."""
    for batch in batches:
        time.sleep(latency_s)
        yield batch


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _rank(rank: int, world_size: int, port: int, args: argparse.Namespace, out: Any) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    warnings.filterwarnings("ignore")
    logging.getLogger("torchrec").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, init_method=f"tcp://127.0.0.1:{port}")
    results = {}
    for name, (make_upstream, make_ours) in _pairs().items():
        pipelines, iters, times = [], [], [[], []]
        for make in (make_upstream, make_ours):
            model, optimizer = build_dlrm(rank, world_size, args.embedding_dim, args.num_embeddings)
            pipelines.append(make(model, optimizer))
            data = iter(random_batches(rank, args.steps, args.batch_size, args.num_embeddings))
            iters.append(_slow(data, args.loader_latency_ms / 1000) if args.loader_latency_ms else data)
        for step in range(args.steps):
            order = (0, 1) if step % 2 == 0 else (1, 0)
            for k in order:
                start = time.perf_counter()
                pipelines[k].progress(iters[k])
                times[k].append(time.perf_counter() - start)
        for p in pipelines:
            if hasattr(p, "close"):
                p.close()
        up, ours = (t[args.warmup :] for t in times)
        results[name] = {
            "upstream_median_ms": 1e3 * statistics.median(up),
            "upstream_p90_ms": 1e3 * _percentile(up, 0.9),
            "ours_median_ms": 1e3 * statistics.median(ours),
            "ours_p90_ms": 1e3 * _percentile(ours, 0.9),
            "ratio_median": statistics.median(ours) / statistics.median(up),
            "steps_measured": len(up),
        }
    if rank == 0:
        out.put(results)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--embedding-dim", type=int, default=32)
    parser.add_argument("--num-embeddings", type=int, default=20000)
    parser.add_argument("--loader-latency-ms", type=float, default=0.0)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    if args.warmup >= args.steps:
        parser.error("--warmup must be smaller than --steps")

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, 2, port, args, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = out.get(timeout=3600)
    for p in procs:
        p.join(60)
    width = max(len(n) for n in results)
    print(f"{'pipeline':<{width}}  upstream median/p90 ms   ours median/p90 ms   ours/upstream")
    for name, r in results.items():
        print(
            f"{name:<{width}}  {r['upstream_median_ms']:8.2f} / {r['upstream_p90_ms']:7.2f}   "
            f"{r['ours_median_ms']:8.2f} / {r['ours_p90_ms']:7.2f}   {r['ratio_median']:.3f}"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results}, indent=2))


if __name__ == "__main__":
    main()
