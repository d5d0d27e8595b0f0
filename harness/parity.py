"""Comparing train pipelines bit for bit on CPU gloo ranks: the model, its data, runs and their comparison.

Everything here runs on loopback with the gloo backend, so it needs neither a GPU nor a
launcher. (On a CUDA machine the same harness runs with ``backend="nccl"``, rank ``r`` on
``cuda:r``, and :func:`build_model` takes the ``device`` to shard onto; the defaults are the
CPU.) A test hands a module-level *rank function* to ``harness.ranks.run_on_ranks``; inside it, the rank
builds a fresh model with :func:`build_model`, fresh batches with
:func:`make_batches`, trains with :func:`train_pipeline_run` (any object with
``progress(iterator)``, e.g. a TorchRec train pipeline) or :func:`plain_loop_run` (the
non-pipelined reference), and returns the :class:`RunResult` objects to the parent, where
:func:`assert_runs_equal` compares them.

Example::

    def _rank_fn(rank: int, world_size: int, seed: int) -> tuple[RunResult, RunResult]:
        model, optimizer = build_model(rank, world_size, seed)
        reference = plain_loop_run(model, optimizer, make_batches(rank, world_size, 20, seed))
        model, optimizer = build_model(rank, world_size, seed)
        pipeline = TrainPipelineSparseDist(model, optimizer, torch.device("cpu"))
        return reference, train_pipeline_run(pipeline, make_batches(rank, world_size, 20, seed))

    for reference, pipelined in run_on_ranks(_rank_fn, 0):
        assert_runs_equal(reference, pipelined, what="TrainPipelineSparseDist")
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.tensor import DTensor
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
from torchrec.distributed.test_utils.test_model import ModelInput, TestSparseNN
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.optim.optimizers import in_backward_optimizer_filter

from torchrec_swp.streamcheck import process_checker, stream_check_requested

__all__ = [
    "BATCH_SIZE",
    "LEARNING_RATE",
    "NUM_FLOAT_FEATURES",
    "TABLES",
    "WEIGHTED_TABLES",
    "RunResult",
    "assert_runs_equal",
    "build_model",
    "local_state",
    "make_batches",
    "plain_loop_run",
    "record_losses",
    "staged_pipeline_run",
    "train_pipeline_run",
]

# --------------------------------------------------------------------------------------------
# The model and its data
# --------------------------------------------------------------------------------------------

NUM_FLOAT_FEATURES = 10
"""Width of ``ModelInput.float_features``."""

BATCH_SIZE = 8
"""Samples per rank per batch."""

LEARNING_RATE = 0.1
"""Learning rate of both the fused EXACT_SGD on the tables and the dense SGD."""

TABLES: list[EmbeddingBagConfig] = [
    EmbeddingBagConfig(
        name=f"table_{i}",
        feature_names=[f"feature_{i}"],
        num_embeddings=50 * (i + 1),
        embedding_dim=8 * (1 + i % 2),
    )
    for i in range(4)
]
"""Unweighted tables, in ``sparse.ebc``: 0 and 1 table-wise (on ranks 0 and 1), 2 and 3 row-wise."""

WEIGHTED_TABLES: list[EmbeddingBagConfig] = [
    EmbeddingBagConfig(
        name="weighted_table_0",
        feature_names=["weighted_feature_0"],
        num_embeddings=60,
        embedding_dim=8,
    )
]
"""Weighted (id-score) table, in ``sparse.weighted_ebc``, row-wise."""


def _sharding_plan(
    model: TestSparseNN, sharder: EmbeddingBagCollectionSharder, world_size: int, device_type: str = "cpu"
) -> ShardingPlan:
    """Tables 0 and 1 table-wise on ranks 0 and 1 (modulo ``world_size``), all others row-wise; FUSED kernel."""
    fused = EmbeddingComputeKernel.FUSED.value
    ebc_sharding = {
        table.name: (
            table_wise(rank=i % world_size, compute_kernel=fused) if i < 2 else row_wise(compute_kernel=fused)
        )
        for i, table in enumerate(TABLES)
    }
    weighted_sharding = {table.name: row_wise(compute_kernel=fused) for table in WEIGHTED_TABLES}
    common: dict[str, Any] = {
        "sharder": sharder,
        "local_size": world_size,
        "world_size": world_size,
        "device_type": device_type,
    }
    return ShardingPlan(
        {
            "sparse.ebc": construct_module_sharding_plan(model.sparse.ebc, ebc_sharding, **common),
            "sparse.weighted_ebc": construct_module_sharding_plan(
                model.sparse.weighted_ebc, weighted_sharding, **common
            ),
        }
    )


def _load_full_state(model: nn.Module, full_state: dict[str, torch.Tensor]) -> None:
    """Copies an unsharded state dict into ``model``'s (possibly sharded) state, in place."""
    with torch.no_grad():
        for name, value in model.state_dict().items():
            full = full_state[name]
            if isinstance(value, ShardedTensor):
                for shard in value.local_shards():
                    window = tuple(
                        slice(offset, offset + size)
                        for offset, size in zip(shard.metadata.shard_offsets, shard.metadata.shard_sizes)
                    )
                    shard.tensor.copy_(full[window])
            else:
                value.copy_(full)


def build_model(
    rank: int,
    world_size: int,
    seed: int,
    device: torch.device | None = None,
    fused_optimizer: EmbOptimType = EmbOptimType.EXACT_SGD,
) -> tuple[DistributedModelParallel, torch.optim.Optimizer]:
    """Builds the sharded test model and its dense optimizer, identically for equal seeds.

    The model is TorchRec's ``TestSparseNN`` (dense MLP + ``TABLES`` in an
    EmbeddingBagCollection + ``WEIGHTED_TABLES`` in a weighted one + over-arch MLP) wrapped in a
    ``DistributedModelParallel`` on the default process group: tables 0 and 1 table-wise on ranks
    0 and 1 (modulo ``world_size``), the others row-wise, all with the FUSED kernel whose
    optimizer is EXACT_SGD applied in backward. The dense part is replicated (DDP) and trained by
    the returned ``torch.optim.SGD``; the fused tables are not in it. ``model(batch)`` returns
    ``(loss, prediction)`` in training mode.

    Every weight is copied from an unsharded twin built under ``torch.manual_seed(seed)``, so
    the same seed gives the same weights on every call, whatever the sharding, and the sharded
    model starts as that unsharded ``TestSparseNN`` (on a global batch their predictions were
    found bit-identical; the tables' own sharded initialization would draw other numbers). The
    caller's RNG state is left untouched. ``rank`` is implied by the process group and only checked.
    ``device`` is where the model is sharded and placed (default: the CPU); ``fused_optimizer``
    the tables' fused optimizer (e.g. EXACT_ROWWISE_ADAGRAD, which keeps a state per row).
    """
    device = torch.device("cpu") if device is None else device
    assert dist.get_rank() == rank and dist.get_world_size() == world_size, "process group mismatch"
    sharder = EmbeddingBagCollectionSharder(
        fused_params={"optimizer": fused_optimizer, "learning_rate": LEARNING_RATE}
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        full = TestSparseNN(tables=TABLES, weighted_tables=WEIGHTED_TABLES, num_float_features=NUM_FLOAT_FEATURES)
        skeleton = TestSparseNN(
            tables=TABLES,
            weighted_tables=WEIGHTED_TABLES,
            num_float_features=NUM_FLOAT_FEATURES,
            sparse_device=torch.device("meta"),
        )
        model = DistributedModelParallel(
            skeleton,
            env=ShardingEnv.from_process_group(dist.group.WORLD),
            plan=_sharding_plan(skeleton, sharder, world_size, device.type),
            sharders=[sharder],
            device=device,
        )
    _load_full_state(model, full.state_dict())
    dense_params = [param for _, param in in_backward_optimizer_filter(model.named_parameters())]
    return model, torch.optim.SGD(dense_params, lr=LEARNING_RATE)


def make_batches(rank: int, world_size: int, num_batches: int, seed: int) -> list[ModelInput]:
    """Returns this rank's ``num_batches`` CPU batches of ``BATCH_SIZE`` samples.

    Batch ``i`` is rank ``rank``'s slice of the ``i``-th global batch that
    ``ModelInput.generate`` draws after ``torch.manual_seed(seed)``; so ranks get different
    samples, calls with equal arguments give equal batches, and the caller's RNG state is left
    untouched. Each call returns new objects, so pipelines never share batches.
    """
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return [
            ModelInput.generate(
                batch_size=BATCH_SIZE,
                world_size=world_size,
                num_float_features=NUM_FLOAT_FEATURES,
                tables=TABLES,
                weighted_tables=WEIGHTED_TABLES,
            )[1][rank]
            for _ in range(num_batches)
        ]


# --------------------------------------------------------------------------------------------
# Recording runs
# --------------------------------------------------------------------------------------------


@dataclass
class RunResult:
    """What one training run on one rank did; picklable, all tensors on the CPU.

    Attributes:
        outputs: per successful call, a detached copy of what it returned (the pipeline's
            ``progress()`` value, or the second element of ``model(batch)`` for the plain loop).
        losses: the loss of every forward call of the model, in call order.
        num_calls: number of calls that returned (``progress()`` calls, or plain-loop steps).
        stop_iteration_call: index of the call that raised ``StopIteration`` (for the plain loop,
            the number of batches), or None if none did within the allowed calls.
        weights: :func:`local_state` of the model after the run.
    """

    outputs: list[Any]
    losses: list[torch.Tensor]
    num_calls: int
    stop_iteration_call: int | None
    weights: dict[str, torch.Tensor]


class _Pipeline(Protocol):
    def progress(self, dataloader_iter: Iterator[Any]) -> Any: ...


@contextlib.contextmanager
def record_losses(model: nn.Module) -> Iterator[list[torch.Tensor]]:
    """Within the block, appends the loss of each ``model(...)`` call to the yielded list.

    A forward hook on ``model`` itself (for a DMP, the outermost wrapper, which is what pipelines
    call) copies the first element of each tuple output; it never changes the output. Non-tuple
    outputs (e.g. eval mode, which returns only predictions) record nothing.
    """
    losses: list[torch.Tensor] = []

    def hook(_module: nn.Module, _args: Any, output: Any) -> None:
        if isinstance(output, tuple):
            losses.append(output[0].detach().cpu().clone())

    handle = model.register_forward_hook(hook)
    try:
        yield losses
    finally:
        handle.remove()


def _snapshot(value: Any) -> Any:
    """Detached CPU copy of ``value``, going into lists, tuples and dicts."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_snapshot(item) for item in value)
    if isinstance(value, dict):
        return {key: _snapshot(item) for key, item in value.items()}
    return value


def local_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's part of ``model.state_dict()`` as plain CPU tensors (copies), by name.

    A ShardedTensor becomes its local shards, ordered by offset, flattened and concatenated
    (omitted if this rank holds none); a DTensor its local tensor; other tensors stay as they are.
    """
    state: dict[str, torch.Tensor] = {}
    for name, value in model.state_dict().items():
        if isinstance(value, ShardedTensor):
            shards = sorted(value.local_shards(), key=lambda shard: shard.metadata.shard_offsets)
            if shards:
                state[name] = torch.cat([shard.tensor.detach().cpu().reshape(-1) for shard in shards])
        elif isinstance(value, DTensor):
            state[name] = value.to_local().detach().cpu().clone()
        else:
            state[name] = value.detach().cpu().clone()
    return state


def train_pipeline_run(
    pipeline: _Pipeline,
    batches: Sequence[Any],
    max_calls: int | None = None,
    *,
    model: nn.Module | None = None,
    iterator: Iterator[Any] | None = None,
) -> RunResult:
    """Calls ``pipeline.progress(it)`` on ``it = iter(batches)`` until it raises StopIteration.

    At most ``max_calls`` calls are made (default ``len(batches) + 2``, enough for any pipeline
    that signals the end). ``model`` is the model the pipeline trains, by default
    ``pipeline._model``, where TorchRec's train pipelines keep it. ``iterator`` continues an
    iterator already in use (default: a fresh ``iter(batches)``). Other exceptions propagate.
    """
    if model is None:
        model = pipeline._model
    if max_calls is None:
        max_calls = len(batches) + 2
    it = iter(batches) if iterator is None else iterator
    outputs: list[Any] = []
    stop_iteration_call: int | None = None
    with record_losses(model) as losses:
        for call in range(max_calls):
            try:
                output = pipeline.progress(it)
            except StopIteration:
                stop_iteration_call = call
                break
            outputs.append(_snapshot(output))
    check_streams()
    return RunResult(outputs, losses, len(outputs), stop_iteration_call, local_state(model))


def sparse_data_dist_stages(
    model: nn.Module, copy_stream: Any, *, device: torch.device | None = None, data_dist_stream: Any = None
) -> list[Any]:
    """A StagedTrainPipeline's stages as a user writes them: an H2D copy to ``device`` (default
    the CPU) on ``copy_stream``, then SparseDataDistUtil's start_sparse_data_dist stage on
    ``data_dist_stream`` (default ``torch.Stream(device="cpu")``: one with a ``.device``)."""
    from torchrec.distributed.train_pipeline.pipeline_stage import PipelineStage, SparseDataDistUtil

    to = torch.device("cpu") if device is None else device
    stream = torch.Stream(device="cpu") if data_dist_stream is None else data_dist_stream
    sdd = SparseDataDistUtil(model, data_dist_stream=stream)
    return [
        PipelineStage("data_copy", lambda b: b.to(to, non_blocking=True), copy_stream),
        PipelineStage(
            "start_sparse_data_dist",
            sdd.start_sparse_data_dist,
            sdd.data_dist_stream,
            fill_callback=sdd.wait_sdd_fill_callback,
            data_exhausted_callback=sdd.data_exhausted_callback,
        ),
    ]


def staged_pipeline_run(
    pipeline: _Pipeline,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Sequence[Any],
    max_calls: int | None = None,
    *,
    iterator: Iterator[Any] | None = None,
) -> RunResult:
    """The caller's loop of a StagedTrainPipeline: ``batch = pipeline.progress(it)`` until it
    returns None, training ``model`` on each batch (zero_grad, ``loss, output = model(batch)``,
    backward, step). ``stop_iteration_call`` is the call that returned None. At most
    ``max_calls`` calls (default ``len(batches) + 5``)."""
    if max_calls is None:
        max_calls = len(batches) + 5
    it = iter(batches) if iterator is None else iterator
    outputs: list[Any] = []
    none_call: int | None = None
    with record_losses(model) as losses:
        for call in range(max_calls):
            batch = pipeline.progress(it)
            if batch is None:
                none_call = call
                break
            optimizer.zero_grad()
            loss, output = model(batch)
            loss.backward()
            optimizer.step()
            outputs.append(output.detach().cpu().clone())
    check_streams()
    return RunResult(outputs, losses, len(outputs), none_call, local_state(model))


def check_streams() -> None:
    """In checked mode (``SWP_STREAM_CHECK=1``): raise ``StreamCheckError`` naming the two
    accesses of each unsynchronised pair and each early free the run's tasks had, then forget
    them (the next run in this process starts clean). Otherwise nothing."""
    if not stream_check_requested():
        return
    checker = process_checker()
    try:
        checker.check()
    finally:
        checker.clear()


def plain_loop_run(model: nn.Module, optimizer: torch.optim.Optimizer, batches: Sequence[Any]) -> RunResult:
    """The non-pipelined reference: per batch zero_grad, ``loss, output = model(batch)``, backward, step."""
    outputs: list[Any] = []
    with record_losses(model) as losses:
        for batch in batches:
            optimizer.zero_grad()
            loss, output = model(batch)
            loss.backward()
            optimizer.step()
            outputs.append(_snapshot(output))
    return RunResult(outputs, losses, len(outputs), len(batches), local_state(model))


# --------------------------------------------------------------------------------------------
# Comparing runs
# --------------------------------------------------------------------------------------------


def _first_difference(a: Any, b: Any, where: str) -> str | None:
    """Describes the first difference between two snapshots (nested tensors), or None."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return f"{where}: {type(a).__name__} vs {type(b).__name__}"
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"{where}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
        if torch.equal(a, b):
            return None
        if a.is_floating_point() or a.is_complex():
            max_diff = (a.double() - b.double()).abs().max().item()
        else:
            max_diff = (a.long() - b.long()).abs().max().item()
        return f"{where}: max abs diff {max_diff!r}"
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and type(a) is type(b):
        if len(a) != len(b):
            return f"{where}: length {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            if (diff := _first_difference(x, y, f"{where}[{i}]")) is not None:
                return diff
        return None
    if isinstance(a, dict) and isinstance(b, dict):
        if list(a) != list(b):
            return f"{where}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"
        for key in a:
            if (diff := _first_difference(a[key], b[key], f"{where}[{key!r}]")) is not None:
                return diff
        return None
    if type(a) is not type(b) or a != b:
        return f"{where}: {a!r} vs {b!r}"
    return None


def assert_runs_equal(a: RunResult, b: RunResult, *, what: str = "") -> None:
    """Asserts two runs are bit-identical; the message names the first difference.

    Compared in this order: call counts, StopIteration call index, then step by step the loss and
    the output (either list may be empty, e.g. no losses in eval mode, but then in both runs),
    then the final weights by name (``torch.equal``).
    """
    prefix = f"{what}: " if what else ""
    if a.num_calls != b.num_calls:
        raise AssertionError(f"{prefix}{a.num_calls} vs {b.num_calls} successful calls")
    if a.stop_iteration_call != b.stop_iteration_call:
        raise AssertionError(
            f"{prefix}StopIteration on call {a.stop_iteration_call} vs {b.stop_iteration_call}"
        )
    for step in range(max(len(a.losses), len(a.outputs), len(b.losses), len(b.outputs))):
        for kind, xs, ys in (("loss", a.losses, b.losses), ("output", a.outputs, b.outputs)):
            if (step < len(xs)) != (step < len(ys)):
                raise AssertionError(f"{prefix}{len(xs)} vs {len(ys)} recorded values of {kind}")
            if step < len(xs) and (diff := _first_difference(xs[step], ys[step], f"{kind} of step {step}")):
                raise AssertionError(prefix + diff)
    if a.weights.keys() != b.weights.keys():
        only_one = sorted(a.weights.keys() ^ b.weights.keys())
        raise AssertionError(f"{prefix}weight names differ; in only one run: {only_one}")
    for name in a.weights:
        if (diff := _first_difference(a.weights[name], b.weights[name], f"weight {name}")) is not None:
            raise AssertionError(prefix + diff)
