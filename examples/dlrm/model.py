"""TorchRec's DLRM for Criteo-like data, sharded over the ranks of the default process group.

Used by the examples and the benchmarks. One embedding table per sparse feature (26 by default,
as in Criteo), by default alternately table-wise (on rank ``i % world_size``) and row-wise sharded
(``sharding=``: ``mixed``, or all ``table_wise`` or all ``row_wise``), with the FUSED kernel (the
tables' optimizer runs inside backward); the dense part is trained by the returned optimizer.
Every call with the same arguments builds the same model.

Optimizers (``optimizer=``): ``sgd`` (the default: EXACT_SGD on the tables, ``torch.optim.SGD`` on
the MLPs; neither keeps state) or ``adagrad`` (EXACT_ROWWISE_ADAGRAD on the tables, one
accumulator per row, and ``torch.optim.Adagrad`` on the MLPs: both keep state, which a
checkpoint must carry).

``sharding_plan`` gives the plan without building the model or a process group (a checkpoint
records it, and a resume compares it); ``describe_plan`` is its one-line-per-table text.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DefaultDataParallelWrapper
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim.optimizers import in_backward_optimizer_filter

from examples.dlrm.data import NUM_DENSE, NUM_SPARSE, sparse_names

LEARNING_RATE = 0.05
#: ``optimizer=`` choices: the tables' fused optimizer and the dense one.
OPTIMIZERS: dict[str, tuple[EmbOptimType, type[torch.optim.Optimizer]]] = {
    "sgd": (EmbOptimType.EXACT_SGD, torch.optim.SGD),
    "adagrad": (EmbOptimType.EXACT_ROWWISE_ADAGRAD, torch.optim.Adagrad),
}
#: ``sharding=`` choices.
SHARDINGS = ("mixed", "table_wise", "row_wise")
#: Where the tables live in the model (the sharding plan's module path).
EBC_PATH = "model.sparse_arch.embedding_bag_collection"


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
    rank: int,
    world_size: int,
    size: DlrmSize = DlrmSize(),
    *,
    seed: int = 0,
    device: torch.device | None = None,
    optimizer: str = "sgd",
    sharding: str = "mixed",
    static_graph: bool = True,
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A DistributedModelParallel DLRMTrain of ``size`` on ``device`` (default: the CPU) and the
    optimizer of its dense part (``optimizer``: a key of ``OPTIMIZERS``; the tables' one is fused,
    ``model.fused_optimizer``), its tables sharded as ``sharding`` says. The same seed gives the
    same initial weights on every device. ``static_graph`` is DDP's (TorchRec's default, True);
    False lets a run with gradient accumulation resume inside a window.

    Needs the default process group. ``DLRMTrain(batch)`` returns ``(loss, (loss, logits, labels))``
    (all detached in the second element): what a train pipeline's ``progress()`` returns.
    """
    device = torch.device("cpu") if device is None else device
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {optimizer!r}")
    if sharding not in SHARDINGS:
        raise ValueError(f"sharding must be one of {', '.join(SHARDINGS)}, got {sharding!r}")
    torch.manual_seed(seed)
    dlrm = _dlrm(size)
    sharder = _sharder(optimizer)
    model = DistributedModelParallel(
        dlrm,
        env=ShardingEnv.from_process_group(dist.group.WORLD),
        plan=_plan(dlrm, sharder, world_size, device.type, sharding),
        sharders=[sharder],
        device=device,
        data_parallel_wrapper=DefaultDataParallelWrapper(static_graph=static_graph),
    )
    dense = [p for _, p in in_backward_optimizer_filter(model.named_parameters())]
    dense_optimizer = OPTIMIZERS[optimizer][1]
    return model, dense_optimizer(dense, lr=LEARNING_RATE)


def sharding_plan(
    size: DlrmSize, world_size: int, *, device_type: str = "cpu", optimizer: str = "sgd", sharding: str = "mixed"
) -> ShardingPlan:
    """The plan ``build_dlrm`` shards the model of ``size`` with over ``world_size`` ranks; needs
    no process group (the tables are on the meta device) and leaves the caller's RNG as it was."""
    with torch.random.fork_rng():
        dlrm = _dlrm(size)
    return _plan(dlrm, _sharder(optimizer), world_size, device_type, sharding)


def describe_plan(plan: ShardingPlan) -> dict[str, str]:
    """``{table: "table_wise on rank 1"}`` (or ``"row_wise on ranks 0,1"``) for the tables of ``plan``."""
    tables = plan.plan[EBC_PATH]
    described = {}
    for name, spec in tables.items():  # type: ignore[union-attr]
        ranks = spec.ranks or []
        where = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ",".join(map(str, ranks))
        described[name] = f"{spec.sharding_type} on {where}"
    return described


def _dlrm(size: DlrmSize) -> DLRMTrain:
    """The unsharded model, its tables on the meta device (DistributedModelParallel makes them)."""
    tables = [
        EmbeddingBagConfig(
            name=f"t_{f}", feature_names=[f], num_embeddings=size.num_embeddings, embedding_dim=size.embedding_dim
        )
        for f in sparse_names(size.num_sparse)
    ]
    return DLRMTrain(
        DLRM(
            embedding_bag_collection=EmbeddingBagCollection(tables=tables, device=torch.device("meta")),
            dense_in_features=NUM_DENSE,
            dense_arch_layer_sizes=[*size.dense_arch, size.embedding_dim],
            over_arch_layer_sizes=[*size.over_arch, 1],
        )
    )


def _sharder(optimizer: str) -> EmbeddingBagCollectionSharder:
    fused_params = {"optimizer": OPTIMIZERS[optimizer][0], "learning_rate": LEARNING_RATE}
    return EmbeddingBagCollectionSharder(fused_params=fused_params)


def _plan(
    dlrm: DLRMTrain, sharder: EmbeddingBagCollectionSharder, world_size: int, device_type: str, sharding: str = "mixed"
) -> ShardingPlan:
    """Table ``i`` table-wise on rank ``i % world_size`` or row-wise (``mixed``: alternately,
    table-wise first), fused."""
    fused = EmbeddingComputeKernel.FUSED.value  # the optimizer runs inside backward
    ebc = dlrm.model.sparse_arch.embedding_bag_collection
    wise = {"mixed": lambda i: i % 2 == 0, "table_wise": lambda i: True, "row_wise": lambda i: False}[sharding]
    per_table = {
        t.name: table_wise(rank=i % world_size, compute_kernel=fused) if wise(i) else row_wise(compute_kernel=fused)
        for i, t in enumerate(ebc.embedding_bag_configs())
    }
    return ShardingPlan(
        {
            EBC_PATH: construct_module_sharding_plan(
                ebc, per_table, local_size=world_size, world_size=world_size, device_type=device_type, sharder=sharder
            )
        }
    )
