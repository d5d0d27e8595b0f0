"""Our TrainPipelineBase and TrainPipelineSparseDist against upstream's, on 2 gloo ranks.

Same sharded model (fresh, same seed) and same data for every run: outputs, losses, final
weights, batch counts and the call that raises StopIteration must be equal bit for bit, with
the default plan, with thread maps that move tasks to other threads, and with the overlap
options (``thread_map="io"``, ``loads=2``, ``lookahead=2``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torchrec.distributed.train_pipeline.train_pipelines as upstream

import torchrec_swp
from harness.parity import RunResult, assert_runs_equal, build_model, make_batches, train_pipeline_run
from harness.ranks import run_on_ranks
from torchrec_swp.integrations.torchrec.compat import installed

pytestmark = pytest.mark.parity

STEPS = 20
ASYNC_ON_UPSTREAM = {"async_inplace_copy": True} if installed().has_async_inplace_copy else {}
CPU = torch.device("cpu")

Factory = Callable[[torch.nn.Module, torch.optim.Optimizer], Any]

# (name, upstream factory, our factories by label)
CASES: list[tuple[str, Factory, dict[str, Factory]]] = [
    (
        "Base",
        lambda m, o: upstream.TrainPipelineBase(m, o, CPU),
        {
            "default": lambda m, o: torchrec_swp.TrainPipelineBase(m, o, CPU),
            "io_thread": lambda m, o: torchrec_swp.TrainPipelineBase(
                m, o, CPU, thread_map={"LoadBatch": "io", "H2D": "io"}
            ),
            "per_task": lambda m, o: torchrec_swp.TrainPipelineBase(m, o, CPU, thread_map="per_task"),
            # LoadBatch only draws: on 2 load threads as it is, drawing up to 2 batches ahead
            "io_loads_lookahead": lambda m, o: torchrec_swp.TrainPipelineBase(
                m, o, CPU, thread_map="io", loads=2, lookahead=2
            ),
        },
    ),
    (
        "SparseDist",
        lambda m, o: upstream.TrainPipelineSparseDist(m, o, CPU),
        {
            "default": lambda m, o: torchrec_swp.TrainPipelineSparseDist(m, o, CPU),
            "io_thread": lambda m, o: torchrec_swp.TrainPipelineSparseDist(m, o, CPU, thread_map={"H2D": "io"}),
            "by_stream": lambda m, o: torchrec_swp.TrainPipelineSparseDist(m, o, CPU, thread_map="by_stream"),
            "per_task": lambda m, o: torchrec_swp.TrainPipelineSparseDist(m, o, CPU, thread_map="per_task"),
            # H2D's draw split off into Fetch on 2 load threads, H2D on the io thread, 2 batches ahead
            "io_loads_lookahead": lambda m, o: torchrec_swp.TrainPipelineSparseDist(
                m, o, CPU, thread_map="io", loads=2, lookahead=2
            ),
        },
    ),
    (
        "SparseDist.execute_all_batches=False",
        lambda m, o: upstream.TrainPipelineSparseDist(m, o, CPU, execute_all_batches=False),
        {
            "default": lambda m, o: torchrec_swp.TrainPipelineSparseDist(m, o, CPU, execute_all_batches=False),
            "io_thread": lambda m, o: torchrec_swp.TrainPipelineSparseDist(
                m, o, CPU, execute_all_batches=False, thread_map={"H2D": "io"}
            ),
        },
    ),
    (
        "SparseDist.enqueue_batch_after_forward",
        lambda m, o: upstream.TrainPipelineSparseDist(m, o, CPU, enqueue_batch_after_forward=True),
        {
            "default": lambda m, o: torchrec_swp.TrainPipelineSparseDist(m, o, CPU, enqueue_batch_after_forward=True),
            "io_thread": lambda m, o: torchrec_swp.TrainPipelineSparseDist(
                m, o, CPU, enqueue_batch_after_forward=True, thread_map={"H2D": "io"}
            ),
        },
    ),
    (
        "SparseDist.enable_inplace_copy_batch",
        lambda m, o: upstream.TrainPipelineSparseDist(m, o, CPU, enable_inplace_copy_batch=True),
        {"default": lambda m, o: torchrec_swp.TrainPipelineSparseDist(m, o, CPU, enable_inplace_copy_batch=True)},
    ),
    # TorchRec 1.9's async_inplace_copy: ours runs the in-place H2D on the "io" thread, on
    # either version; upstream 1.9 accepts it and keeps it off on CPU (it copies on its background
    # thread on CUDA/MTIA only), upstream 1.8 has no such option. Same numbers, on and off.
    (
        "SparseDist.async_inplace_copy",
        lambda m, o: upstream.TrainPipelineSparseDist(m, o, CPU, enable_inplace_copy_batch=True, **ASYNC_ON_UPSTREAM),
        {
            "on": lambda m, o: torchrec_swp.TrainPipelineSparseDist(
                m, o, CPU, enable_inplace_copy_batch=True, async_inplace_copy=True
            ),
            "off": lambda m, o: torchrec_swp.TrainPipelineSparseDist(
                m, o, CPU, enable_inplace_copy_batch=True, async_inplace_copy=False
            ),
        },
    ),
    (
        "SparseDistLite.async_inplace_copy",
        lambda m, o: upstream.TrainPipelineSparseDistLite(
            m, o, CPU, enable_inplace_copy_batch=True, **ASYNC_ON_UPSTREAM
        ),
        {
            "on": lambda m, o: torchrec_swp.TrainPipelineSparseDistLite(
                m, o, CPU, enable_inplace_copy_batch=True, async_inplace_copy=True
            )
        },
    ),
]


def _train(factory: Factory, rank: int, world_size: int, seed: int) -> RunResult:
    model, optimizer = build_model(rank, world_size, seed)
    pipeline = factory(model, optimizer)
    try:
        return train_pipeline_run(pipeline, make_batches(rank, world_size, STEPS, seed), STEPS + 5)
    finally:
        if hasattr(pipeline, "close"):
            pipeline.close()


def _all_cases(rank: int, world_size: int, seed: int) -> dict[str, tuple[RunResult, dict[str, RunResult]]]:
    return {
        name: (
            _train(up, rank, world_size, seed),
            {label: _train(f, rank, world_size, seed) for label, f in ours.items()},
        )
        for name, up, ours in CASES
    }


def _epochs(rank: int, world_size: int, seed: int) -> dict[str, list[RunResult]]:
    """Two epochs: after StopIteration, a new iterator starts a new epoch (as upstream)."""
    out: dict[str, list[RunResult]] = {}
    for label, factory in (
        ("upstream", lambda m, o: upstream.TrainPipelineSparseDist(m, o, CPU)),
        ("ours", lambda m, o: torchrec_swp.TrainPipelineSparseDist(m, o, CPU, thread_map={"H2D": "io"})),
    ):
        model, optimizer = build_model(rank, world_size, seed)
        pipeline = factory(model, optimizer)
        out[label] = [train_pipeline_run(pipeline, make_batches(rank, world_size, 7, seed + e), 20) for e in range(2)]
        if hasattr(pipeline, "close"):
            pipeline.close()
    return out


def _eval_mode(rank: int, world_size: int, seed: int) -> dict[str, RunResult]:
    """model.eval(): no zero_grad, backward or step. In eval mode the test model returns only
    its predictions, so a custom_model_fwd supplies the (losses, output) pair pipelines unpack."""
    out = {}
    for label, cls in (("upstream", upstream.TrainPipelineSparseDist), ("ours", torchrec_swp.TrainPipelineSparseDist)):
        model, optimizer = build_model(rank, world_size, seed)
        model.eval()
        pipeline = cls(model, optimizer, CPU, custom_model_fwd=lambda batch, m=model: (torch.zeros(()), m(batch)))
        out[label] = train_pipeline_run(pipeline, make_batches(rank, world_size, STEPS, seed), STEPS + 5)
        if hasattr(pipeline, "close"):
            pipeline.close()
    return out


@pytest.mark.multiprocess
def test_base_and_sparse_dist_equal_upstream_bit_for_bit() -> None:
    per_rank = run_on_ranks(_all_cases, 1234, timeout_s=600)
    for rank, results in enumerate(per_rank):
        for name, (reference, ours) in results.items():
            expected_batches = STEPS - 2 if "execute_all_batches=False" in name else STEPS
            assert reference.num_calls == expected_batches, f"{name}: upstream trained {reference.num_calls}"
            for label, result in ours.items():
                assert_runs_equal(reference, result, what=f"rank {rank} {name} [{label}]")


@pytest.mark.multiprocess
def test_new_epoch_with_a_new_iterator_and_eval_mode() -> None:
    for rank, runs in enumerate(run_on_ranks(_epochs, 77, timeout_s=300)):
        for epoch, (a, b) in enumerate(zip(runs["upstream"], runs["ours"])):
            assert a.num_calls == 7
            assert_runs_equal(a, b, what=f"rank {rank} epoch {epoch}")
    for rank, runs in enumerate(run_on_ranks(_eval_mode, 5, timeout_s=300)):
        assert_runs_equal(runs["upstream"], runs["ours"], what=f"rank {rank} eval mode")
