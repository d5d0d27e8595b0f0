"""TrainPipelineSparseDistBwdOpt (``experimental_pipelines.py``) on the engine: the optimizer step
injected into backward."""

from __future__ import annotations

from typing import Any

import torch
from torchrec.distributed.train_pipeline import experimental_pipelines as upstream
from torchrec.distributed.train_pipeline.pipeline_context import In, Out

from torchrec_swp.integrations.torchrec.pipelines.protocol import task
from torchrec_swp.integrations.torchrec.pipelines.sparse_dist import TrainPipelineSparseDist
from torchrec_swp.plan import PipelinePlan

__all__ = ["TrainPipelineSparseDistBwdOpt"]


class TrainPipelineSparseDistBwdOpt(TrainPipelineSparseDist[In, Out], upstream.TrainPipelineSparseDistBwdOpt[In, Out]):  # type: ignore[type-arg]  # generic through upstream's base; TorchRec is Any to mypy
    """TrainPipelineSparseDistBwdOpt on the engine: SparseDist's stages, the optimizer stepping
    inside backward.

    Same constructor as upstream's (``model, optimizer, device, site_fqn, sharding_type, ...``),
    plus the keyword-only engine options (``PlanDriven``). Upstream's ``_pipeline_model`` (run by
    the first input dist, InitPipelinedModules) registers the optimizer step as a backward hook on
    ``site_fqn``'s output-dist gradient (``register_backward_hook``, ``backward_injection.py``);
    the default plan, ``catalog.sparse_dist_bwd_opt_plan(...)``, has no OptimizerStep task, and its
    BackwardOptimizerStep task is the backward in which that hook steps. Same results as upstream.
    """

    def _swp_default_plan(self) -> PipelinePlan:
        return self._swp_row_plan(
            enqueue_batch_after_forward=self._enqueue_batch_after_forward,
            execute_all_batches=self._execute_all_batches,
            clear_data_dist_inputs=self._clear_data_dist_inputs,
        )

    # SparseDist's tasks; its backward steps the optimizer through the hook, and no task does otherwise
    _swp_without_tasks = ("Backward", "OptimizerStep")

    @task("BackwardOptimizerStep")
    def _task_backward_optimizer_step(self, b: int, losses: torch.Tensor, context: Any) -> None:
        self._task_backward(b, losses, context)
