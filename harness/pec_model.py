"""TorchRec's own PEC test model (``TestPECMixedEmbeddingSparseArch``), sharded on the ranks of the
default process group, as in upstream's ``test_pec_train_pipeline.py``, on the CPU: a
data-parallel EmbeddingBagCollection table and two PEC EmbeddingCollection tables, row-wise.
The PEC parity test and ``make stream-check`` train it (the DLRM example has no PEC module)."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist

CPU = torch.device("cpu")

#: The thread maps TrainPipelinePEC is checked with ("spread": the overlap and the NOL work on a
#: thread ahead, the gradient applications on another), by label.
PEC_THREAD_MAPS: dict[str, Any] = {
    "default": None,
    "by_stream": "by_stream",
    "io": {"H2D": "io"},
    "spread": {
        "H2D": "io",
        "OverlapDist": "ahead",
        "NolCompute": "ahead",
        "DeferNolGrad": "ahead",
        "OlGradApply": "grads",
        "NolGradApply": "grads",
    },
}


def build_pec_model(seed: int, num_batches: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, list[Any]]:
    """The sharded model (same weights for equal seeds), its SGD, and this rank's ``num_batches``
    batches (``ModelInput``, batch size 10)."""
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.pec_embedding import PECEmbeddingCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.test_utils.test_model import ModelInput, TestPECMixedEmbeddingSparseArch
    from torchrec.distributed.types import ShardingEnv
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig

    rank, world = dist.get_rank(), dist.get_world_size()
    tables: list[Any] = [
        EmbeddingBagConfig(name="ebc_table_0", feature_names=["ebc_feature_0"], embedding_dim=8, num_embeddings=100),
        *(
            EmbeddingConfig(
                name=f"ec_table_{i}", feature_names=[f"ec_feature_{i}"], embedding_dim=8, num_embeddings=100
            )
            for i in range(2)
        ),
    ]
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        data = [
            ModelInput.generate(
                tables=tables, weighted_tables=[], batch_size=10, world_size=world, num_float_features=10
            )
            for _ in range(num_batches)
        ]
        skeleton = TestPECMixedEmbeddingSparseArch(tables=tables, dense_device=CPU, sparse_device=torch.device("meta"))
        sharders: list[Any] = [EmbeddingBagCollectionSharder(), PECEmbeddingCollectionSharder()]
        plan = EmbeddingShardingPlanner(topology=Topology(world_size=world, compute_device="cpu")).collective_plan(
            skeleton, sharders, dist.group.WORLD
        )
        torch.manual_seed(seed + 1)
        model = DistributedModelParallel(
            module=copy.deepcopy(skeleton),
            plan=plan,
            env=ShardingEnv.from_process_group(dist.group.WORLD),
            sharders=sharders,
            device=CPU,
            init_data_parallel=True,
        )
    return model, torch.optim.SGD(model.parameters(), lr=0.1, foreach=True), [d[1][rank] for d in data]
