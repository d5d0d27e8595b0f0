"""TrainEvalHybridPipelineBase (``experimental_pipelines.py``) on the engine: training and
evaluation batches through one pipeline, the model's mode deciding at each ``progress()`` call."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torchrec.distributed.train_pipeline import experimental_pipelines as upstream
from torchrec.distributed.train_pipeline.pipeline_context import In, Out
from torchrec.distributed.train_pipeline.types import PipelineState

from torchrec_swp.engine.labels import record_function
from torchrec_swp.integrations.torchrec.pipelines.protocol import task
from torchrec_swp.integrations.torchrec.pipelines.sparse_dist import TrainPipelineSparseDist
from torchrec_swp.integrations.torchrec.pipelines.training_tasks import indexed_optimizer_step
from torchrec_swp.plan import PipelinePlan

__all__ = ["TrainEvalHybridPipelineBase"]


class TrainEvalHybridPipelineBase(TrainPipelineSparseDist[In, Out], upstream.TrainEvalHybridPipelineBase[In, Out]):  # type: ignore[type-arg]  # generic through upstream's base; TorchRec is Any to mypy
    """TrainEvalHybridPipelineBase on the engine: SparseDist's three stages, and at each
    ``progress()`` call the model's mode (``model.train()`` / ``model.eval()``) decides whether the
    batch it steps is trained or only evaluated.

    Same constructor as upstream's (TrainPipelineSparseDist's), plus the keyword-only engine
    options (``PlanDriven``). The default plan is ``catalog.train_eval_hybrid_plan(...)``: ZeroGrad,
    Backward and OptimizerStep are guarded ``when=train`` (the engine asks ``model.training`` at
    every call), so a batch stepped in eval mode is only forwarded, under ``no_grad``, and its
    output returned. Upstream's pre-fetch of batch i+2 at the start of the step is the task Fetch,
    its copy to the device H2D (upstream's ``copy_batch_to_gpu``, fed through
    ``_next_batch_on_cpu`` as upstream's own ``_prepare_pipeline_step`` feeds it).

    As upstream: switching modes keeps the pipeline full (the batches in flight at a switch are
    stepped in the new mode); at the end of any data (the eval data's too) the batches in flight
    drain, then ``progress()`` raises StopIteration, and a call with the next data fills again.

    Differences: ``execute_all_batches=False`` is refused (upstream stops a different number of
    batches early in train and in eval mode; one line says so); a plan with ``lookahead`` (or
    ``loads``, which brings it) draws batches ahead of upstream, so at a switch of iterators the
    batches it drew ahead from the old one are stepped before the new one's.

    Checkpoints: ``state_dict()`` records the position of the data the pipeline last drew from
    (one cut, as for every pipeline of ours). After an evaluation that is the eval data, not the
    training data: take a training checkpoint before switching to ``model.eval()`` (with the
    training batches drained, as the DLRM example's ``--eval-mode hybrid`` does), not after.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        execute_all = kwargs.get("execute_all_batches", args[3] if len(args) > 3 else True)
        if not execute_all:
            raise ValueError(
                f"{type(self).__name__}(execute_all_batches=False) is not supported: upstream's stops early by "
                "a different number of batches in train and eval mode; pass execute_all_batches=True"
            )
        super().__init__(*args, **kwargs)

    def _swp_default_plan(self) -> PipelinePlan:
        return self._swp_row_plan(
            clear_data_dist_inputs=self._clear_data_dist_inputs, h2d_thread=self._swp_h2d_thread()
        )

    def _swp_training_mode(self) -> Callable[[], bool]:
        return lambda: self._model.training

    def _swp_on_new_data(self) -> None:
        super()._swp_on_new_data()
        self._draining_eval = False

    # ------------------------------------------------------------ task functions
    def _task_h2d(self, b: int, data: Iterator[In] | None = None, host: In | None = None) -> tuple[Any, Any]:
        if data is not None:  # a plan of the user's with H2D as its source draws here
            host = self._task_fetch(b, data)
        # upstream's hand-over from the pre-fetch (_prepare_pipeline_step) to copy_batch_to_gpu,
        # whose _next_batch returns it
        self._next_batch_on_cpu = host
        return super()._task_h2d(b, host=host)

    @task("OptimizerStep")
    def _task_optimizer_step(self, b: int, context: Any) -> None:  # type: ignore[override]  # upstream steps it itself, as Lite's; its plans always give context
        if self._model.training:
            indexed_optimizer_step(self, context)

    def _task_forward(self, b: int, batch: Any, context: Any) -> tuple[Any, Any]:
        if self._model.training:
            return super()._task_forward(b, batch, context)
        with record_function(f"## eval {context.index} ##"), torch.no_grad():
            self._state = PipelineState.CALL_FWD
            losses, output = self._model_fwd(batch)
        return losses, output
