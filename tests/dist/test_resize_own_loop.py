"""The own-loop recipe of docs/long_jobs.md ("Resume on another world size", "In your own loop"),
2 -> 1, without the DLRM example: TorchRec's planner, DistributedModelParallel, a CombinedOptimizer
(row-wise Adagrad fused into the tables, Adagrad on the MLP), ours TrainPipelineSparseDist over a
GlobalMapSource, the model and optimizer through DCP, rank 0's pipeline state and the plan's
sharding types in a file of its own.

Two tables, 16 and 1000 rows of dim 8: on 2 ranks TorchRec 1.9.2's planner makes both
table-wise; on 1 rank it makes ``t0`` data-parallel, the trap of issue 46 (DCP then fails with
``Missing key in checkpoint state_dict: optim.state...``). The recipe pins every table
table-wise. The 2 ranks train 2 steps (4 of the epoch's 12 batches), save, and 1 rank resumes:

* the planner's own plan on 1 rank is refused in one line before any load (``check_sharding_types``),
  and the load that line saves the user from fails in DCP;
* ``pipeline.load_state_dict(state)`` without ``resized=True`` is refused in one line;
* with the pinned plan and ``resized=True`` the 1 rank trains the 8 batches left: every sample of
  the epoch trained once (the model's own forward logs each batch's sample ids).
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from harness.ranks import run_on_ranks

pytestmark = pytest.mark.multiprocess

EPOCH, BATCH, K = 12, 4, 2  # 12 batches of 4 samples; the cut after step 2 on 2 ranks (4 batches)
ROWS, DIM = (16, 1000), 8
CPU = torch.device("cpu")


class Batches:
    """The epoch's batches, one order for all ranks: batch ``g`` holds samples ``g * BATCH`` to
    ``(g + 1) * BATCH - 1``, whose ids ride in the first dense column (the model ignores it)."""

    def __len__(self) -> int:
        return EPOCH

    def __getitem__(self, g: int) -> Any:
        from torchrec.datasets.utils import Batch
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        gen = torch.Generator().manual_seed(g)
        ids = torch.arange(g * BATCH, (g + 1) * BATCH, dtype=torch.float32)
        values = torch.cat([torch.randint(rows, (BATCH,), generator=gen) for rows in ROWS])
        return Batch(
            dense_features=torch.stack([ids, torch.rand(BATCH, generator=gen)], 1),
            sparse_features=KeyedJaggedTensor.from_lengths_sync(
                keys=[f"f{i}" for i in range(len(ROWS))],
                values=values,
                lengths=torch.ones(len(ROWS) * BATCH, dtype=torch.int32),
            ),
            labels=torch.randint(2, (BATCH,), generator=gen).float(),
        )


class Tiny(nn.Module):
    def __init__(self) -> None:
        from torchrec.modules.embedding_configs import EmbeddingBagConfig
        from torchrec.modules.embedding_modules import EmbeddingBagCollection

        super().__init__()
        tables = [
            EmbeddingBagConfig(name=f"t{i}", feature_names=[f"f{i}"], num_embeddings=rows, embedding_dim=DIM)
            for i, rows in enumerate(ROWS)
        ]
        self.ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
        self.over = nn.Linear(len(ROWS) * DIM + 1, 1)

    def forward(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        pooled = self.ebc(batch.sparse_features).values()
        logit = self.over(torch.cat([pooled, batch.dense_features[:, 1:]], 1)).squeeze(1)
        return nn.functional.binary_cross_entropy_with_logits(logit, batch.labels), logit.detach()


def planner(world_size: int, *, pinned: bool) -> Any:
    """TorchRec's planner for ``world_size`` ranks: every table pinned table-wise, or its own choice."""
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.types import ParameterConstraints

    constraints = {f"t{i}": ParameterConstraints(sharding_types=["table_wise"]) for i in range(len(ROWS))}
    return EmbeddingShardingPlanner(
        topology=Topology(world_size=world_size, compute_device="cpu"), constraints=constraints if pinned else None
    )


def _plan(pinned: bool) -> Any:
    """The planner's plan for this world, made on rank 0 and given to every rank."""
    import torch.distributed as dist

    chosen = planner(dist.get_world_size(), pinned=pinned)
    return chosen.collective_plan(Tiny(), [sharder()], dist.GroupMember.WORLD)


def sharder() -> Any:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    return EmbeddingBagCollectionSharder(
        fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05}
    )


def _build(plan: Any) -> tuple[Any, Any]:
    """The model sharded by ``plan`` and its optimizer: the tables' fused one and Adagrad on the rest."""
    import torch.distributed as dist
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    model = DistributedModelParallel(
        Tiny(), env=ShardingEnv.from_process_group(dist.GroupMember.WORLD), plan=plan, sharders=[sharder()], device=CPU
    )
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(model.named_parameters())), lambda ps: torch.optim.Adagrad(ps, lr=0.05)
    )
    return model, CombinedOptimizer([model.fused_optimizer, dense])


def _log_samples(model: nn.Module) -> list[int]:
    """The sample ids of every batch ``model`` runs forward on (each one a trained batch)."""
    trained: list[int] = []
    model.register_forward_pre_hook(lambda _m, args: trained.extend(args[0].dense_features[:, 0].long().tolist()))
    return trained


def _quiet() -> None:
    logging.disable(logging.WARNING)  # the planner's and the pipeline's logs
    warnings.filterwarnings("ignore")


def _first(rank: int, world_size: int, ckpt: str) -> dict[str, Any]:
    """2 ranks: K steps, then the recipe's save."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import torchrec_swp
    from torchrec_swp.data import GlobalMapSource
    from torchrec_swp.sharding import sharding_types

    _quiet()
    plan = _plan(pinned=True)
    model, optimizer = _build(plan)
    trained = _log_samples(model)
    source = GlobalMapSource(Batches(), rank=rank, world_size=world_size)
    with torchrec_swp.TrainPipelineSparseDist(model, optimizer, CPU) as pipeline:
        for _ in range(K):
            pipeline.progress(source)
        state = pipeline.state_dict()
    dcp.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, checkpoint_id=ckpt)
    loaders: list[Any] = [None] * world_size
    dist.all_gather_object(loaders, state["loader"])
    GlobalMapSource.agree(loaders)  # ValueError unless every rank cut at the same global position
    if rank == 0:
        torch.save({"pipeline": state, "sharding": sharding_types(plan)}, Path(ckpt) / "pipeline.pt")
    return {"trained": trained, "sharding": sharding_types(plan)}


def _resume(rank: int, world_size: int, ckpt: str) -> dict[str, Any]:
    """1 rank: the traps, then the recipe's load and the rest of the epoch."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    import torchrec_swp
    from torchrec_swp.data import GlobalMapSource
    from torchrec_swp.sharding import check_sharding_types, sharding_types

    _quiet()
    saved = torch.load(Path(ckpt) / "pipeline.pt", weights_only=False)
    found: dict[str, Any] = {}
    # the trap: the planner's own plan for this world, refused before anything is loaded
    unpinned = _plan(pinned=False)
    found["unpinned"] = sharding_types(unpinned)
    try:
        check_sharding_types(saved["sharding"], sharding_types(unpinned))
    except ValueError as e:
        found["refused"] = str(e)
    model, optimizer = _build(unpinned)  # what that line saves the user from
    try:
        dcp.load({"model": model.state_dict(), "optim": optimizer.state_dict()}, checkpoint_id=ckpt)
    except CheckpointException as e:  # a BaseException: every rank's failures
        found["dcp_error"] = str(e)
    # the recipe
    plan = _plan(pinned=True)
    check_sharding_types(saved["sharding"], sharding_types(plan))
    model, optimizer = _build(plan)
    state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
    dcp.load(state, checkpoint_id=ckpt)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optim"])
    trained = _log_samples(model)
    source = GlobalMapSource(Batches(), rank=rank, world_size=world_size)
    source.load_state_dict(saved["pipeline"]["loader"])
    with torchrec_swp.TrainPipelineSparseDist(model, optimizer, CPU) as pipeline:
        try:
            pipeline.load_state_dict(saved["pipeline"])
        except torchrec_swp.PlanError as e:
            found["not_told"] = str(e)
        pipeline.load_state_dict(saved["pipeline"], resized=True)
        steps = 0
        while True:
            try:
                pipeline.progress(source)
            except StopIteration:
                break
            steps += 1
    return {**found, "trained": trained, "steps": steps}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    ckpt = str(tmp_path_factory.mktemp("own-loop") / "step-2")
    first = run_on_ranks(_first, ckpt, world_size=2, timeout_s=120)
    (resumed,) = run_on_ranks(_resume, ckpt, world_size=1, timeout_s=120)
    return first, resumed


def test_every_sample_of_the_epoch_is_trained_once_over_the_resize(runs: Any) -> None:
    first, resumed = runs
    before = [s for rank in first for s in rank["trained"]]
    assert len(before) == 2 * K * BATCH and resumed["steps"] == EPOCH - 2 * K
    assert sorted(before + resumed["trained"]) == list(range(EPOCH * BATCH))


def test_a_sharding_type_the_planner_changed_is_refused_in_one_line_before_any_load(runs: Any) -> None:
    first, resumed = runs
    # the precondition: on 1 rank TorchRec's planner changes t0's type (if not, this test says nothing)
    assert first[0]["sharding"] == {"t0": "table_wise", "t1": "table_wise"}
    assert resumed["unpinned"] == {"t0": "data_parallel", "t1": "table_wise"}
    assert resumed["refused"] == (
        "table t0 is table_wise in the checkpoint's sharding plan and data_parallel in the new one, which DCP "
        "cannot load (a data_parallel table's optimizer state is in the dense optimizer, a sharded table's in "
        'the fused one): pin its type on every world size: EmbeddingShardingPlanner(..., constraints={"t0": '
        'ParameterConstraints(sharding_types=["table_wise"])})'
    )
    assert "Missing key in checkpoint state_dict: optim.state.ebc.embedding_bags.t0.weight" in resumed["dcp_error"]


def test_a_resize_without_resized_true_is_refused_in_one_line(runs: Any) -> None:
    _, resumed = runs
    assert resumed["not_told"] == (
        "TrainPipelineSparseDist.load_state_dict(): the state was cut on 2 ranks, this process runs on 1 rank: "
        "pass resized=True, with the data position global (torchrec_swp.data.GlobalMapSource) and the model and "
        "optimizer resharded through torch.distributed.checkpoint (docs/long_jobs.md, Resume on another world size)"
    )
