"""The DLRM example on a CUDA device, for parts (c) and (d): model, pinned batches, runners.

``examples/dlrm`` builds everything for the CPU (``build_dlrm`` shards onto ``"cpu"``,
``make_runner`` passes the CPU to the pipelines); this module does the same on a given device.
Upstream's pipelines run as shipped here (no CPU patch), ours with an optional thread map.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from benchmarks.common import DISTINCT_BATCHES, batches
from examples.dlrm.model import DlrmSize

GPU_SIZE = DlrmSize(
    batch_size=8192, num_embeddings=100_000, embedding_dim=64, dense_arch=(512, 256), over_arch=(512, 256)
)
"""A DLRM that gives an H100 milliseconds of work per step (the CPU sizes give it microseconds)."""

LOOKAHEAD = 3
"""Batches loaded beyond the last step taken, so that no measured step drains the pipeline."""

TIMED_PIPELINES = (
    "TrainPipelineSparseDist",
    "TrainPipelineFusedSparseDist",
    "TrainPipelineSemiSync",
    "PrefetchTrainPipelineSparseDist",
)


def build_dlrm_on(
    device: torch.device, rank: int, world_size: int, size: DlrmSize, *, seed: int = 0
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """``examples.dlrm.model.build_dlrm`` sharded onto ``device``: same tables, sharding
    (alternately table-wise and row-wise, FUSED EXACT_SGD) and initial weights for a seed."""
    import torch.distributed as dist
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
    from torchrec.distributed.types import ShardingEnv, ShardingPlan
    from torchrec.models.dlrm import DLRM, DLRMTrain
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    from examples.dlrm.data import NUM_DENSE, sparse_names
    from examples.dlrm.model import LEARNING_RATE

    tables = [
        EmbeddingBagConfig(
            name=f"t_{f}", feature_names=[f], num_embeddings=size.num_embeddings, embedding_dim=size.embedding_dim
        )
        for f in sparse_names(size.num_sparse)
    ]
    torch.manual_seed(seed)
    dlrm = DLRMTrain(
        DLRM(
            embedding_bag_collection=EmbeddingBagCollection(tables=tables, device=torch.device("meta")),
            dense_in_features=NUM_DENSE,
            dense_arch_layer_sizes=[*size.dense_arch, size.embedding_dim],
            over_arch_layer_sizes=[*size.over_arch, 1],
        )
    )
    sharder = EmbeddingBagCollectionSharder(
        fused_params={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": LEARNING_RATE}
    )
    fused = EmbeddingComputeKernel.FUSED.value
    per_table = {
        t.name: table_wise(rank=i % world_size, compute_kernel=fused) if i % 2 == 0 else row_wise(compute_kernel=fused)
        for i, t in enumerate(tables)
    }
    ebc = dlrm.model.sparse_arch.embedding_bag_collection
    plan = ShardingPlan(
        {
            "model.sparse_arch.embedding_bag_collection": construct_module_sharding_plan(
                ebc, per_table, local_size=world_size, world_size=world_size, device_type=device.type, sharder=sharder
            )
        }
    )
    model = DistributedModelParallel(
        dlrm, env=ShardingEnv.from_process_group(dist.group.WORLD), plan=plan, sharders=[sharder], device=device
    )
    dense = [p for _, p in in_backward_optimizer_filter(model.named_parameters())]
    return model, torch.optim.SGD(dense, lr=LEARNING_RATE)


def pinned_batches(size: DlrmSize, rank: int, num_batches: int, *, seed: int = 1000, pin: bool = True) -> Iterator[Any]:
    """``num_batches`` synthetic batches in pinned host memory (``DISTINCT_BATCHES`` distinct ones,
    repeated), so that the pipelines' non-blocking copies are asynchronous, as with a DataLoader
    that pins memory (``pin=False``: plain memory, for a CPU run)."""
    data = batches(size, rank, DISTINCT_BATCHES, seed=seed)
    distinct = [batch.pin_memory() if pin else batch for batch in data]
    return (distinct[k % len(distinct)] for k in range(num_batches))


def make_gpu_runner(
    name: str, impl: str, device: torch.device, rank: int, world_size: int, size: DlrmSize, *, thread_map: Any = None
) -> Any:
    """A ``examples.dlrm.pipelines.Runner`` of pipeline ``name`` (a train pipeline) on ``device``."""
    import torchrec.distributed.train_pipeline.train_pipelines as upstream

    import torchrec_swp
    from examples.dlrm.pipelines import INFO, Runner

    info = INFO[name]
    if info.kind != "train" or info.compiles:
        raise ValueError(f"{name}: only the eager train pipelines are timed on the GPU")
    model, optimizer = build_dlrm_on(device, rank, world_size, size)
    engine = {"thread_map": thread_map} if thread_map is not None else {}
    if impl == "upstream":
        if engine:
            raise ValueError("a thread_map applies to our pipelines only")
        pipeline = getattr(upstream, name)(model, optimizer, device, **info.options)
    else:
        pipeline = getattr(torchrec_swp, name)(model, optimizer, device, **info.options, **engine)
    return Runner(info, impl, pipeline, model, optimizer, contextlib.ExitStack())  # type: ignore[arg-type]
