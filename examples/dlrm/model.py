"""TorchRec's DLRM for Criteo-like data, sharded over the ranks of the default process group.

Used by the examples and the benchmarks. One embedding table per sparse feature (26 by default,
as in Criteo), alternately table-wise (on rank ``i % world_size``) and row-wise sharded, with the
FUSED kernel (EXACT_SGD applied inside backward); the dense part is trained by the returned SGD
optimizer. Every call with the same arguments builds the same model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
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

from examples.dlrm.data import NUM_DENSE, NUM_SPARSE, sparse_names

LEARNING_RATE = 0.05


@dataclass(frozen=True)
class DlrmSize:
    """The sizes of a DLRM and of its batches.

    ``dense_arch`` is the bottom MLP without its last layer (which is ``embedding_dim``);
    ``over_arch`` is the top MLP without its last layer (which is 1, the click logit).
    """

    batch_size: int = 256
    num_sparse: int = NUM_SPARSE
    num_embeddings: int = 10_000
    embedding_dim: int = 32
    dense_arch: tuple[int, ...] = (64,)
    over_arch: tuple[int, ...] = (64,)

    def describe(self) -> str:
        return (
            f"batch {self.batch_size}, {self.num_sparse} tables x {self.num_embeddings} rows "
            f"x dim {self.embedding_dim}, "
            f"MLPs {NUM_DENSE}-{'-'.join(map(str, self.dense_arch))}-{self.embedding_dim} / "
            f"{'-'.join(map(str, self.over_arch))}-1"
        )


def build_dlrm(
    rank: int, world_size: int, size: DlrmSize = DlrmSize(), *, seed: int = 0, device: torch.device | None = None
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A DistributedModelParallel DLRMTrain of ``size`` on ``device`` (default: the CPU) and the SGD
    optimizer of its dense part. The same seed gives the same initial weights on every device.

    Needs the default process group. ``DLRMTrain(batch)`` returns ``(loss, (loss, logits, labels))``
    (all detached in the second element): what a train pipeline's ``progress()`` returns.
    """
    device = torch.device("cpu") if device is None else device
    embedding_dim = size.embedding_dim
    tables = [
        EmbeddingBagConfig(
            name=f"t_{f}", feature_names=[f], num_embeddings=size.num_embeddings, embedding_dim=embedding_dim
        )
        for f in sparse_names(size.num_sparse)
    ]
    torch.manual_seed(seed)
    dlrm = DLRMTrain(
        DLRM(
            embedding_bag_collection=EmbeddingBagCollection(tables=tables, device=torch.device("meta")),
            dense_in_features=NUM_DENSE,
            dense_arch_layer_sizes=[*size.dense_arch, embedding_dim],
            over_arch_layer_sizes=[*size.over_arch, 1],
        )
    )
    sharder = EmbeddingBagCollectionSharder(
        fused_params={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": LEARNING_RATE}
    )
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
                device_type=device.type,
                sharder=sharder,
            )
        }
    )
    model = DistributedModelParallel(
        dlrm,
        env=ShardingEnv.from_process_group(dist.group.WORLD),
        plan=plan,
        sharders=[sharder],
        device=device,
    )
    dense = [p for _, p in in_backward_optimizer_filter(model.named_parameters())]
    return model, torch.optim.SGD(dense, lr=LEARNING_RATE)
