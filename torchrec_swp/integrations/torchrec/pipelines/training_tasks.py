"""The task functions several drop-ins share, defined once: ``TrainingTasks``.

Upstream's pipeline families (TrainPipelineBase, TrainPipelineSparseDist, TrainPipelinePT2 and
their subclasses) hold the model as ``_model`` and the optimizer as ``_optimizer`` and, in
training mode, zero the gradients, run the backward and step the optimizer the same way. The
roots of our families take these from here (``class X(PlanDriven, TrainingTasks, upstream.X)``);
a subclass whose upstream goes back to the plain form after its parent changed it (e.g. Fused's
optimizer step, not SparseDist's ``_optimizer_step()`` hook) names it again
(``_task_optimizer_step = TrainingTasks._task_optimizer_step``).

Like every task function, each takes the batch index ``b`` and the plan's reads by keyword; a read
some plans give the task and others do not (``context``) is optional.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from torchrec_swp.engine.labels import record_function
from torchrec_swp.integrations.torchrec.pipelines.protocol import task


def indexed_optimizer_step(pipeline: Any, context: Any) -> None:
    """The optimizer step as the ``progress()`` of upstream's SparseDistLite and
    TrainEvalHybridPipelineBase makes it, not through SparseDist's ``_optimizer_step()`` hook:
    ``pipeline._optimizer.step()`` under the label ``## optimizer {index} ##``."""
    with record_function(f"## optimizer {context.index} ##"):
        pipeline._optimizer.step()


class TrainingTasks:
    """ZeroGrad, Backward and OptimizerStep as upstream's pipelines run them (module docstring)."""

    _model: torch.nn.Module
    _optimizer: torch.optim.Optimizer

    _backward: Callable[[torch.Tensor], None]  # upstream's (TrainPipelineBase, TrainPipelineSparseDist)

    @task("ZeroGrad")
    def _task_zero_grad(self, b: int) -> None:
        if self._model.training:
            with record_function("## zero_grad ##"):
                self._optimizer.zero_grad()

    @task("Backward")
    def _task_backward(self, b: int, losses: torch.Tensor, context: Any = None) -> None:
        if self._model.training:
            self._backward(losses)

    @task("OptimizerStep")
    def _task_optimizer_step(self, b: int, context: Any = None) -> None:
        if self._model.training:
            with record_function("## optimizer ##"):
                self._optimizer.step()
