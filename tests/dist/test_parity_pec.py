"""Our TrainPipelinePEC against upstream's (TorchRec 1.9), on 2 gloo ranks.

The model is TorchRec's own PEC test model (``harness.pec_model``: a data-parallel
EmbeddingBagCollection table and two PEC EmbeddingCollection tables, row-wise), as in upstream's
``test_pec_train_pipeline.py``, here on CPU. Ours runs as shipped; upstream needs a test-only
patch on CPU (``upstream_cpu_patch``, which includes CPU events): its constructor creates
``torch.cuda.Event()``, which a CPU build of torch refuses, and its helpers ``record_stream``
CPU tensors. Outputs, losses, final weights and the StopIteration call must be equal bit for
bit; against a non-pipelined loop, predictions agree within upstream's own tolerance (PEC's
split gradient accumulation changes the order of float additions).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import pytest
import torch

from examples.dlrm.upstream_cpu_patch import upstream_cpu_patch
from harness.parity import RunResult, assert_runs_equal, local_state, record_losses, train_pipeline_run
from harness.pec_model import PEC_THREAD_MAPS, build_pec_model
from harness.ranks import run_on_ranks
from torchrec_swp.integrations.torchrec.compat import installed

pytestmark = [
    pytest.mark.parity,
    pytest.mark.multiprocess,
    pytest.mark.skipif(not installed().has_pec, reason="TrainPipelinePEC is new in TorchRec 1.9"),
]

STEPS = 9
CPU = torch.device("cpu")


def _build(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, list[Any]]:
    return build_pec_model(seed, STEPS)


def _run(factory: Callable[[torch.nn.Module, torch.optim.Optimizer], Any], seed: int, patched: bool) -> RunResult:
    model, optimizer, batches = _build(seed)
    with upstream_cpu_patch() if patched else contextlib.nullcontext():
        pipeline = factory(model, optimizer)
        try:
            return train_pipeline_run(pipeline, batches, STEPS + 3)
        finally:
            if hasattr(pipeline, "close"):
                pipeline.close()


def _plain(seed: int) -> list[torch.Tensor]:
    model, optimizer, batches = _build(seed)
    outputs = []
    with record_losses(model):
        for batch in batches:
            optimizer.zero_grad()
            loss, pred = model(batch)
            loss.backward()
            optimizer.step()
            outputs.append(pred.detach().clone())
    return outputs


def _all(rank: int, world_size: int, seed: int) -> dict[str, Any]:
    from torchrec.distributed.train_pipeline.pec_train_pipeline import TrainPipelinePEC as Upstream

    from torchrec_swp import TrainPipelinePEC

    out: dict[str, Any] = {
        "plain": _plain(seed),
        "upstream": _run(lambda m, o: Upstream(m, o, CPU), seed, patched=True),
        "ours": {
            label: _run(lambda m, o, tm=tm: TrainPipelinePEC(m, o, CPU, thread_map=tm), seed, patched=False)
            for label, tm in PEC_THREAD_MAPS.items()
        },
    }
    from torchrec.distributed.pec_embedding import ShardedPECEmbeddingCollection

    model, optimizer, batches = _build(seed)
    out["initial weights"] = local_state(model)
    pipeline = TrainPipelinePEC(model, optimizer, CPU)
    pipeline.progress(iter(batches))
    # as upstream's test: the model rewrite found every sharded PEC module
    sharded = sum(isinstance(m, ShardedPECEmbeddingCollection) for m in model.modules())
    out["pec modules"] = (len(pipeline._pec_modules), sharded)
    pipeline.close()
    return out


def test_pec_equals_upstream_bit_for_bit_and_the_plain_loop_within_tolerance() -> None:
    for rank, runs in enumerate(run_on_ranks(_all, 31, timeout_s=600)):
        reference: RunResult = runs["upstream"]
        assert reference.num_calls == STEPS and reference.stop_iteration_call == STEPS
        for label, result in runs["ours"].items():
            assert_runs_equal(reference, result, what=f"rank {rank} TrainPipelinePEC [{label}]")
        indexed, present = runs["pec modules"]
        assert indexed == present > 0
        # the model trained: weights moved away from the initial ones
        assert any(not torch.equal(w, runs["initial weights"][k]) for k, w in reference.weights.items())
        for step, (ours, plain) in enumerate(zip(runs["ours"]["default"].outputs, runs["plain"], strict=True)):
            torch.testing.assert_close(ours, plain, msg=lambda m, s=step, r=rank: f"rank {r} step {s}: {m}")
