"""Our EvalPipelineCPUSparse against upstream's (TorchRec's experimental), on 2 gloo ranks.

The model is the parity harness's ``TestSparseNN`` with every table data-parallel (the
pipeline's design: sparse work on the CPU with no collectives, dense on the device), in
training mode so that it returns ``(loss, prediction)`` (the pipeline runs it under no_grad and
never steps). Batches are TorchRec's ``test_utils.model_input.ModelInput``, whose ``to()``
takes ``dense_only``. Outputs, losses, (unchanged) weights, batch count and the StopIteration
call must be equal bit for bit, for ``pipeline_depth`` 2 and 1, with ``multi_thread`` and with a
thread map, and the outputs equal to the non-pipelined model's.

Upstream needs the test-only CPU patch (``upstream_cpu_patch``): it pins its embedding buffers,
which a CPU-only build refuses. And on the CPU it reuses one embedding buffer per module for
every batch while the "copy to the device" is that buffer itself, so batch i's embeddings are
overwritten by batch i+1's before batch i's dense forward reads them: every output but the last
is wrong (the second test shows it). Compared bit for bit, upstream gets a new buffer per batch
(``_fresh_buffers``), as ours does on the CPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from examples.dlrm.upstream_cpu_patch import upstream_cpu_patch
from harness.parity import (
    NUM_FLOAT_FEATURES,
    TABLES,
    WEIGHTED_TABLES,
    RunResult,
    assert_runs_equal,
    make_batches,
    train_pipeline_run,
)
from harness.ranks import run_on_ranks

pytestmark = [pytest.mark.parity, pytest.mark.multiprocess]

STEPS = 9
CPU = torch.device("cpu")

Factory = Callable[[torch.nn.Module, torch.optim.Optimizer], Any]


def _build(rank: int, world_size: int, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, list[Any]]:
    """The data-parallel model (same weights for equal seeds) and this rank's batches."""
    import torch.distributed as dist
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, data_parallel
    from torchrec.distributed.test_utils.model_input import ModelInput
    from torchrec.distributed.test_utils.test_model import TestSparseNN
    from torchrec.distributed.types import ShardingEnv, ShardingPlan

    sharder = EmbeddingBagCollectionSharder()
    common: dict[str, Any] = {"sharder": sharder, "local_size": world_size, "world_size": world_size}
    common["device_type"] = "cpu"
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = TestSparseNN(tables=TABLES, weighted_tables=WEIGHTED_TABLES, num_float_features=NUM_FLOAT_FEATURES)
        plan = ShardingPlan(
            {
                "sparse.ebc": construct_module_sharding_plan(
                    model.sparse.ebc, {t.name: data_parallel() for t in TABLES}, **common
                ),
                "sparse.weighted_ebc": construct_module_sharding_plan(
                    model.sparse.weighted_ebc, {t.name: data_parallel() for t in WEIGHTED_TABLES}, **common
                ),
            }
        )
        dmp = DistributedModelParallel(
            model, env=ShardingEnv.from_process_group(dist.group.WORLD), plan=plan, sharders=[sharder], device=CPU
        )
    batches = [
        ModelInput(
            float_features=b.float_features,
            idlist_features=b.idlist_features,
            idscore_features=b.idscore_features,
            label=b.label,
        )
        for b in make_batches(rank, world_size, STEPS, seed)
    ]
    return dmp, torch.optim.SGD(dmp.parameters(), lr=0.1), batches


@contextlib.contextmanager
def _fresh_buffers(fresh: bool) -> Iterator[None]:
    """With ``fresh``, upstream's EvalPipelineCPUSparse gets a new embedding buffer for every batch."""
    from torchrec.distributed.train_pipeline.experimental_pipelines import EvalPipelineCPUSparse as Upstream

    if not fresh:
        yield
        return
    original = Upstream._get_or_alloc_pinned
    Upstream._get_or_alloc_pinned = lambda self, name, tensor: torch.empty_like(tensor)  # type: ignore[method-assign]
    try:
        yield
    finally:
        Upstream._get_or_alloc_pinned = original  # type: ignore[method-assign]


def _run(
    rank: int, world_size: int, seed: int, factory: Factory, patched: bool, fresh_buffers: bool = True
) -> RunResult:
    model, optimizer, batches = _build(rank, world_size, seed)
    if patched:
        with upstream_cpu_patch(), _fresh_buffers(fresh_buffers):
            return train_pipeline_run(factory(model, optimizer), batches, STEPS + 3)
    pipeline = factory(model, optimizer)
    try:
        return train_pipeline_run(pipeline, batches, STEPS + 3)
    finally:
        pipeline.close()


def _cases() -> dict[str, tuple[Factory, dict[str, Factory]]]:
    from torchrec.distributed.train_pipeline.experimental_pipelines import EvalPipelineCPUSparse as Upstream

    from torchrec_swp import EvalPipelineCPUSparse

    return {
        "depth 2": (
            lambda m, o: Upstream(m, o, CPU),
            {
                "default": lambda m, o: EvalPipelineCPUSparse(m, o, CPU),
                "by_stream": lambda m, o: EvalPipelineCPUSparse(m, o, CPU, thread_map="by_stream"),
                "multi_thread": lambda m, o: EvalPipelineCPUSparse(m, o, CPU, multi_thread=True),
            },
        ),
        "depth 1": (
            lambda m, o: Upstream(m, o, CPU, pipeline_depth=1),
            {
                "default": lambda m, o: EvalPipelineCPUSparse(m, o, CPU, pipeline_depth=1),
                "multi_thread": lambda m, o: EvalPipelineCPUSparse(m, o, CPU, pipeline_depth=1, multi_thread=True),
            },
        ),
    }


def _plain(rank: int, world_size: int, seed: int) -> list[torch.Tensor]:
    """The model's predictions batch by batch, not pipelined."""
    model, _, batches = _build(rank, world_size, seed)
    with torch.no_grad():
        return [model(batch)[1].detach().clone() for batch in batches]


def _all(rank: int, world_size: int, seed: int, case: str) -> dict[str, Any]:
    upstream, ours = _cases()[case]
    return {
        "plain": _plain(rank, world_size, seed),
        "upstream": _run(rank, world_size, seed, upstream, patched=True),
        "ours": {label: _run(rank, world_size, seed, f, patched=False) for label, f in ours.items()},
    }


def _upstream_as_patched(rank: int, world_size: int, seed: int) -> dict[str, Any]:
    upstream, _ = _cases()["depth 2"]
    return {"plain": _plain(rank, world_size, seed), "upstream": _run(rank, world_size, seed, upstream, True, False)}


@pytest.mark.parametrize("case", ["depth 2", "depth 1"])
def test_eval_cpu_sparse_equals_upstream_bit_for_bit(case: str) -> None:
    for rank, runs in enumerate(run_on_ranks(_all, 43, case, timeout_s=600)):
        reference: RunResult = runs["upstream"]
        assert reference.num_calls == STEPS and reference.stop_iteration_call == STEPS
        assert len(reference.losses) == STEPS
        for label, result in runs["ours"].items():
            assert_runs_equal(reference, result, what=f"rank {rank} EvalPipelineCPUSparse {case} [{label}]")
        for step, (ours, plain) in enumerate(zip(runs["ours"]["default"].outputs, runs["plain"], strict=True)):
            assert torch.equal(ours, plain), f"rank {rank} {case} step {step}: not the model's prediction"


def test_upstream_as_patched_is_wrong_on_the_cpu_but_for_the_last_batch() -> None:
    # why the comparison above gives upstream new buffers: as patched, its outputs are wrong on
    # the CPU but for the last batch's, which has no successor to overwrite its embeddings
    for rank, runs in enumerate(run_on_ranks(_upstream_as_patched, 43, timeout_s=600)):
        equal = [torch.equal(a, b) for a, b in zip(runs["upstream"].outputs, runs["plain"], strict=True)]
        assert equal == [False] * (STEPS - 1) + [True], f"rank {rank}: {equal}"
