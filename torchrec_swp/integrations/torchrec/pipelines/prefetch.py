"""PrefetchTrainPipelineSparseDist on the engine."""

from __future__ import annotations

from typing import Any

import torch
from torchrec.distributed.train_pipeline import train_pipelines as upstream
from torchrec.distributed.train_pipeline.pipeline_context import In, Out, PrefetchTrainPipelineContext
from torchrec.distributed.train_pipeline.utils import _wait_for_batch

from torchrec_swp.engine import StreamPool, stream_pool_for
from torchrec_swp.engine.labels import record_function
from torchrec_swp.integrations.torchrec.pipelines import cpu_safe
from torchrec_swp.integrations.torchrec.pipelines.protocol import task
from torchrec_swp.integrations.torchrec.pipelines.sparse_dist import TrainPipelineSparseDist
from torchrec_swp.integrations.torchrec.pipelines.training_tasks import TrainingTasks
from torchrec_swp.plan import PipelinePlan

__all__ = ["PrefetchTrainPipelineSparseDist"]


class PrefetchTrainPipelineSparseDist(
    TrainPipelineSparseDist[In, Out], upstream.PrefetchTrainPipelineSparseDist[In, Out]  # type: ignore[type-arg]  # generic through upstream's base; TorchRec is Any to mypy
):
    """PrefetchTrainPipelineSparseDist on the engine: H2D and InputDistStart(i+2),
    InputDistWait and EmbPrefetch(i+1), forward/backward/optimizer(i).

    Same constructor as upstream's, plus the engine's keyword-only options (``EngineOptions``). The
    default plan is ``catalog.prefetch_sparse_dist_plan(...)`` with this pipeline's
    ``execute_all_batches``. With ``execute_all_batches=False`` it stops at the first missing batch,
    as TrainPipelineSparseDist does (upstream's refills on every call and drops the last four
    batches).

    Runs on CPU as shipped: ``_prefetch`` uses ``cpu_safe.prefetch_embeddings``, which prefetches
    without streams where upstream's skips the prefetch (and its forward then fails).

    Differences from upstream: ``progress()`` re-attaches a detached model, as
    TrainPipelineSparseDist does (upstream's Prefetch does not, and would fail in prefetch). The
    plan orders the data_dist stream after the prefetch stream before each later input dist
    (``dep InputDistStart <- EmbPrefetch @1``, TorchRec's open PR #4191; see
    ``catalog.prefetch_sparse_dist_plan``): no task function changes, the calls are upstream's.
    """

    def _swp_default_plan(self) -> PipelinePlan:
        return self._swp_row_plan(
            execute_all_batches=self._execute_all_batches, h2d_thread=self._swp_h2d_thread()
        )

    def _swp_streams(self) -> StreamPool:
        pool = stream_pool_for(
            self._device,
            {"memcpy": self._memcpy_stream, "data_dist": self._data_dist_stream, "prefetch": self._prefetch_stream},
        )
        return self._swp_checked(
            pool, {"_memcpy_stream": "memcpy", "_data_dist_stream": "data_dist", "_prefetch_stream": "prefetch"}
        )

    def _prefetch(self, context: PrefetchTrainPipelineContext) -> None:
        """Upstream's ``_prefetch``: prefetch the embeddings of the batch of ``context`` on the
        prefetch stream, also where there are no streams (see ``cpu_safe.prefetch_embeddings``)."""
        context.module_input_post_prefetch.clear()
        context.module_contexts_post_prefetch.clear()
        with record_function(f"## sharded_module_prefetch {context.index} ##"):
            with self._stream_context(self._prefetch_stream):
                cpu_safe.prefetch_embeddings(
                    context,
                    self._pipelined_modules,
                    self._device,
                    self._stream_context,
                    self._data_dist_stream,
                    self._default_stream,
                )

    # ------------------------------------------------------------ task functions
    def _task_wait_batch(self, b: int, batch: Any, context: Any) -> None:
        self._set_module_context(context)
        with record_function("## wait_for_batch ##"):
            _wait_for_batch(batch, self._prefetch_stream)

    def _task_forward(self, b: int, batch: Any, context: Any) -> tuple[Any, Any]:
        with record_function("## forward ##"):
            losses, output = self._model_fwd(batch)
        # free what forward consumed, so batch i+1's prefetch can reuse the memory
        context.module_input_post_prefetch.clear()
        context.module_contexts_post_prefetch.clear()
        return losses, output

    @task("EmbPrefetch")
    def _task_emb_prefetch(self, b: int, context: Any) -> None:
        self._prefetch(context)

    # Upstream's Prefetch progress() runs backward and the optimizer inline: no ``_state``, no
    # ``_backward``/``_optimizer_step`` hooks, no 2D embedding sync.
    def _task_backward(self, b: int, losses: torch.Tensor, context: Any) -> None:  # type: ignore[override]  # called with its plans' reads, which here always include context
        if self._model.training:
            with record_function("## backward ##"):
                torch.sum(losses, dim=0).backward()

    _task_optimizer_step = TrainingTasks._task_optimizer_step
