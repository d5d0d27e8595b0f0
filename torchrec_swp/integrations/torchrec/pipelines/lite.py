"""TrainPipelineSparseDistLite on the engine."""

from __future__ import annotations

from typing import Any

import torch
from torchrec.distributed.train_pipeline import train_pipelines as upstream
from torchrec.distributed.train_pipeline.pipeline_context import In, Out
from torchrec.distributed.train_pipeline.types import PipelineState

from torchrec_swp.integrations.torchrec.pipelines.protocol import task
from torchrec_swp.integrations.torchrec.pipelines.sparse_dist import TrainPipelineSparseDist
from torchrec_swp.integrations.torchrec.pipelines.training_tasks import indexed_optimizer_step
from torchrec_swp.plan import PipelinePlan

__all__ = ["TrainPipelineSparseDistLite"]


class TrainPipelineSparseDistLite(TrainPipelineSparseDist[In, Out], upstream.TrainPipelineSparseDistLite[In, Out]):  # type: ignore[type-arg]  # generic through upstream's base; TorchRec is Any to mypy
    """TrainPipelineSparseDistLite on the engine: H2D(i+1) || input dist, fwd/bwd/opt(i).

    Same constructor as upstream's Lite, plus the engine's keyword-only options
    (``EngineOptions``). The default plan is ``catalog.sparse_dist_lite_plan()``;
    upstream forces the options that would change it.

    Method resolution puts our TrainPipelineSparseDist (engine ``progress()``, task functions)
    before upstream's Lite, so Lite's own helpers stay in force: its constructor sets
    ``_data_dist_stream = None`` (input dist on the default stream, in the critical path) and
    its ``_wait_for_batch()`` waits on the memcpy stream. Its plan's InitPipelinedModules runs for
    every batch, as upstream's progress() calls ``_init_pipelined_modules`` on every call (it
    rewrites the model the first time, then sets the module context and starts input dist).
    """

    def _swp_default_plan(self) -> PipelinePlan:
        return self._swp_row_plan(h2d_thread=self._swp_h2d_thread())

    # ------------------------------------------------------------ task functions
    # Upstream's Lite runs the backward without SparseDist's sync of 2D-sharded embeddings and
    # steps the optimizer itself, not through SparseDist's ``_optimizer_step()`` hook.
    @task("Backward")
    def _task_backward(self, b: int, losses: torch.Tensor, context: Any = None) -> None:
        if self._model.training:
            self._state = PipelineState.CALL_BWD
            self._backward(losses)

    @task("OptimizerStep")
    def _task_optimizer_step(self, b: int, context: Any) -> None:  # type: ignore[override]  # called with its plans' reads, which here always include context
        if self._model.training:
            indexed_optimizer_step(self, context)
