"""TrainPipelineSparseDistT (``experimental_pipelines.py``) on the engine: the copy of each batch to
the device on a thread of the plan."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torchrec.distributed.train_pipeline import experimental_pipelines as upstream
from torchrec.distributed.train_pipeline.pipeline_context import In, Out, TrainPipelineContext
from torchrec.distributed.train_pipeline.train_pipelines import TrainPipelineSparseDist as UpstreamSparseDist

from torchrec_swp.integrations.torchrec.pipelines.sparse_dist import TrainPipelineSparseDist
from torchrec_swp.plan import PipelinePlan

__all__ = ["TrainPipelineSparseDistT"]


class TrainPipelineSparseDistT(TrainPipelineSparseDist[In, Out], upstream.TrainPipelineSparseDistT[In, Out]):  # type: ignore[type-arg]  # generic through upstream's base; TorchRec is Any to mypy
    """TrainPipelineSparseDistT on the engine: upstream's background copy thread is the plan's thread
    group ``io`` (``catalog.COPY_THREAD``), which runs H2D while the calling thread draws the next
    batch (Fetch) and goes on with forward, backward and the optimizer.

    Same constructor as upstream's, plus the keyword-only engine options (``PlanDriven``). The
    default plan is ``catalog.sparse_dist_t_plan(...)``; ``thread_map`` can move H2D back to the
    calling thread, or elsewhere. The copy is TrainPipelineSparseDist's (``copy_batch_to_gpu`` /
    ``inplace_copy_batch_to_gpu``, the same ``_to_device`` call upstream submits to its executor),
    made by the H2D task on its thread: upstream's ``_copy_executor`` is shut down unused, and
    ``batches`` holds device batches, never a Future. Where upstream resolves the copy (the next
    step's input dist, and the fill's first one) the plan's InputDistStart and
    InitPipelinedModules read H2D's batch, so they wait for it.

    Difference: the in-place copy allocates its batch on the compute stream (as
    TrainPipelineSparseDist's), not on the copy thread's current stream.
    """

    def _swp_init_upstream(self, *args: Any, **kwargs: Any) -> None:
        super()._swp_init_upstream(*args, **kwargs)
        self._copy_executor.shutdown(wait=False)  # the plan's copy thread copies

    def _swp_default_plan(self) -> PipelinePlan:
        return self._swp_row_plan(
            execute_all_batches=self._execute_all_batches, clear_data_dist_inputs=self._clear_data_dist_inputs
        )

    # the copies themselves, where the plan runs H2D (instead of submitting them to upstream's executor)
    def copy_batch_to_gpu(self, dataloader_iter: Iterator[In]) -> tuple[In | None, TrainPipelineContext | None]:
        return UpstreamSparseDist.copy_batch_to_gpu(self, dataloader_iter)

    def inplace_copy_batch_to_gpu(self, dataloader_iter: Iterator[In]) -> tuple[In | None, TrainPipelineContext | None]:
        return UpstreamSparseDist.inplace_copy_batch_to_gpu(self, dataloader_iter)
