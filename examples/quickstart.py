"""A short training run with torchrec_swp's TrainPipelineSparseDist on CPU ranks (gloo).

Launch (2 ranks on this machine)::

    python -m torch.distributed.run --standalone --nproc_per_node 2 examples/quickstart.py

Each rank trains TorchRec's DLRM on random Criteo-like batches (13 dense features, 26 sparse
ones), its embedding tables sharded across the ranks with the fused EXACT_SGD optimizer. Rank 0
prints the pipeline's plan as a schedule table and the loss of every step. ``--thread-map io``
moves the H2D task to its own thread: the numbers stay the same.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

import torchrec_swp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from examples.dlrm.data import SyntheticCriteo
from examples.dlrm.model import DlrmSize, build_dlrm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="batches to train")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--embedding-dim", type=int, default=16)
    parser.add_argument("--num-embeddings", type=int, default=1000)
    parser.add_argument(
        "--thread-map",
        choices=["main", "io", "by_stream"],
        default="main",
        help="main: every task on the calling thread (upstream's behaviour); io: H2D on its own thread",
    )
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    size = DlrmSize(batch_size=args.batch_size, embedding_dim=args.embedding_dim, num_embeddings=args.num_embeddings)
    model, optimizer = build_dlrm(rank, world_size, size)
    thread_map = {"main": "main", "io": {"H2D": "io"}, "by_stream": "by_stream"}[args.thread_map]
    pipeline = torchrec_swp.TrainPipelineSparseDist(model, optimizer, torch.device("cpu"), thread_map=thread_map)
    if rank == 0:
        print(f"torchrec_swp {torchrec_swp.__version__}: {world_size} ranks, gloo, {args.steps} steps")
        print(pipeline.plan.format_schedule(5))

    data = SyntheticCriteo(
        batch_size=args.batch_size, num_batches=args.steps, num_embeddings=args.num_embeddings, rank=rank
    )
    it = iter(data)
    step = 0
    start = time.perf_counter()
    while True:
        try:
            loss, _logits, _labels = pipeline.progress(it)
        except StopIteration:
            break
        if rank == 0:
            print(f"step {step:3d}  loss {loss.item():.6f}")
        step += 1
    elapsed = time.perf_counter() - start
    if rank == 0:
        print(f"trained {step} batches in {elapsed:.2f}s ({step / elapsed:.1f} steps/s on rank 0)")
    pipeline.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    warnings.filterwarnings("ignore", category=FutureWarning)
    logging.getLogger("torchrec").setLevel(logging.ERROR)
    main()
