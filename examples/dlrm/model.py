"""TorchRec's DLRM on random Criteo-like data, sharded over the ranks of the default process group.

Used by the examples and the benchmarks. The embedding tables use the FUSED kernel (EXACT_SGD
applied inside backward), alternately table-wise and row-wise; the dense part is trained by the
returned SGD optimizer. Every call with the same arguments builds the same model.
"""

from __future__ import annotations

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

NUM_DENSE = 13
SPARSE = [f"cat_{i}" for i in range(4)]


def build_dlrm(rank: int, world_size: int, embedding_dim: int, num_embeddings: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
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



def random_batches(
    rank: int, num_batches: int, batch_size: int, num_embeddings: int, ids_per_feature: int = 3, seed: int = 1000
) -> RandomRecDataset:
    """This rank's random batches (13 dense features, the sparse features above, binary labels)."""
    return RandomRecDataset(
        keys=SPARSE,
        batch_size=batch_size,
        hash_size=num_embeddings,
        ids_per_feature=ids_per_feature,
        num_dense=NUM_DENSE,
        manual_seed=seed + rank,
        num_batches=num_batches,
        num_generated_batches=num_batches,
    )
