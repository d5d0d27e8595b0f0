"""State a user put where upstream reads it is honoured (issue: upstream's unit tests that fill
``pipeline.batches``/``pipeline.contexts`` and mock helpers by name before ``progress()``).

This is the scenario of TorchRec's ``TrainPipelineSparseDist2DShardingTest`` (both versions'
``test_train_pipelines.py``), rewritten here: a mocked DMP collection, three batches put in the
deques, the data helpers patched to no-ops. Upstream's progress() trains batches[0], syncs the
2D-sharded embeddings when the context index is a multiple of the interval, and returns the
model's output; ours must do the same instead of finding no data.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any
from unittest.mock import MagicMock, patch

import pytest
import torch
from torchrec.distributed.model_parallel import DistributedModelParallel, DMPCollection
from torchrec.distributed.train_pipeline import train_pipelines as upstream
from torchrec.distributed.train_pipeline.pipeline_context import TrainPipelineContext
from torchrec.streamable import Pipelineable

import torchrec_swp

pytestmark = pytest.mark.parity

MOCKED = [
    "fill_pipeline",
    "_wait_for_batch",
    "enqueue_batch",
    "dequeue_batch",
    "start_sparse_data_dist",
    "wait_sparse_data_dist",
]


@contextmanager
def mocked(pipeline: Any) -> Iterator[Any]:
    with ExitStack() as stack:
        for method in MOCKED:
            stack.enter_context(patch.object(pipeline.__class__, method, return_value=None))
        yield pipeline


def model_mock(spec: type) -> MagicMock:
    model = MagicMock(spec=spec)
    model.training = True
    model.return_value = (torch.tensor(0.1, requires_grad=True), torch.tensor(2))
    return model


def filled(cls: type, model: MagicMock, interval: int | None) -> Any:
    pipeline = cls(model, MagicMock(spec=torch.optim.Optimizer), device=torch.device("cpu"),
                   dmp_collection_sync_interval_batches=interval)
    context = TrainPipelineContext()
    context.index = 10
    data = MagicMock(spec=Pipelineable)
    for _ in range(3):
        pipeline.batches.append(data)
        pipeline.contexts.append(context)
    return pipeline


@pytest.mark.parametrize(
    "cls", [upstream.TrainPipelineSparseDist, torchrec_swp.TrainPipelineSparseDist], ids=["upstream", "ours"]
)
@pytest.mark.parametrize(("interval", "synced"), [(None, False), (10, True)])
def test_pre_filled_batches_train_and_sync_like_upstream(cls: type, interval: int | None, synced: bool) -> None:
    dmp = model_mock(DMPCollection)
    pipeline = filled(cls, dmp, interval)
    with mocked(pipeline):
        output = pipeline.progress(MagicMock())
    assert torch.equal(output, torch.tensor(2))
    dmp.assert_called_once()
    assert dmp.sync.called == synced


@pytest.mark.parametrize(
    "cls", [upstream.TrainPipelineSparseDist, torchrec_swp.TrainPipelineSparseDist], ids=["upstream", "ours"]
)
def test_sync_interval_is_ignored_without_a_dmp_collection(cls: type) -> None:
    dmp = model_mock(DistributedModelParallel)
    pipeline = filled(cls, dmp, 10)
    with mocked(pipeline):
        pipeline.progress(MagicMock())  # no exception
    dmp.assert_called_once()
