"""A short training run with torchrec_swp's TrainPipelineSparseDist on CPU ranks (gloo).

Launch (2 ranks on this machine)::

    python -m torch.distributed.run --standalone --nproc_per_node 2 examples/quickstart.py

Each rank trains TorchRec's DLRM on random Criteo-like batches (13 dense features, a few sparse
ones), its embedding tables sharded across the ranks with the fused EXACT_SGD optimizer. Rank 0
prints the pipeline's plan as a schedule table and the loss of every step. ``--thread-map io``
moves the H2D task to its own thread: the numbers stay the same.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
import warnings

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec.datasets.random import RandomRecDataset
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim.optimizers import in_backward_optimizer_filter

import torchrec_swp

NUM_DENSE = 13
SPARSE = [f"cat_{i}" for i in range(4)]


def build(rank: int, world_size: int, embedding_dim: int, num_embeddings: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    tables = [
        EmbeddingBagConfig(name=f"t_{f}", feature_names=[f], num_embeddings=num_embeddings, embedding_dim=embedding_dim)
        for f in SPARSE
    ]
    torch.manual_seed(0)
    dlrm = DLRMTrain(
        DLRM(
            embedding_bag_collection=EmbeddingBagCollection(tables=tables, device=torch.device("meta")),
            dense_in_features=NUM_DENSE,
            dense_arch_layer_sizes=[32, embedding_dim],
            over_arch_layer_sizes=[32, 1],
        )
    )
    sharder = EmbeddingBagCollectionSharder(fused_params={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.05})
    fused = EmbeddingComputeKernel.FUSED.value  # the optimizer runs inside backward
    per_table = {
        t.name: table_wise(rank=i % world_size, compute_kernel=fused) if i % 2 == 0 else row_wise(compute_kernel=fused)
        for i, t in enumerate(tables)
    }
    plan = ShardingPlan(
        {
            "model.sparse_arch.embedding_bag_collection": construct_module_sharding_plan(
                dlrm.model.sparse_arch.embedding_bag_collection,
                per_table,
                local_size=world_size,
                world_size=world_size,
                device_type="cpu",
                sharder=sharder,
            )
        }
    )
    model = DistributedModelParallel(
        dlrm,
        env=ShardingEnv.from_process_group(dist.group.WORLD),
        plan=plan,
        sharders=[sharder],
        device=torch.device("cpu"),
    )
    dense = [p for _, p in in_backward_optimizer_filter(model.named_parameters())]
    return model, torch.optim.SGD(dense, lr=0.05)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="batches to train")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--embedding-dim", type=int, default=16)
    parser.add_argument("--num-embeddings", type=int, default=1000)
    parser.add_argument("--thread-map", choices=["main", "io", "by_stream"], default="main",
                        help="main: every task on the calling thread (upstream's behaviour); io: H2D on its own thread")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model, optimizer = build(rank, world_size, args.embedding_dim, args.num_embeddings)
    thread_map = {"main": "main", "io": {"H2D": "io"}, "by_stream": "by_stream"}[args.thread_map]
    pipeline = torchrec_swp.TrainPipelineSparseDist(model, optimizer, torch.device("cpu"), thread_map=thread_map)
    if rank == 0:
        print(f"torchrec_swp {torchrec_swp.__version__}: {world_size} ranks, gloo, {args.steps} steps")
        print(pipeline.plan.format_schedule(5))

    data = RandomRecDataset(
        keys=SPARSE,
        batch_size=args.batch_size,
        hash_size=args.num_embeddings,
        ids_per_feature=3,
        num_dense=NUM_DENSE,
        manual_seed=1000 + rank,
        num_batches=args.steps,
        num_generated_batches=args.steps,
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
