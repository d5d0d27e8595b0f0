"""EvalPipelineSparseDist on the engine: upstream's background loading thread is the plan's ``io`` thread."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from torchrec.distributed.train_pipeline import train_pipelines as upstream
from torchrec.distributed.train_pipeline.pipeline_context import In, Out
from torchrec.distributed.train_pipeline.utils import _is_data_loading_retriable

from torchrec_swp.engine.labels import record_function
from torchrec_swp.integrations.torchrec.input_dist_cache import InputDistCache
from torchrec_swp.integrations.torchrec.pipelines.sparse_dist import TrainPipelineSparseDist
from torchrec_swp.plan import PipelinePlan

__all__ = ["EvalPipelineSparseDist"]

logger = logging.getLogger(__name__)


class EvalPipelineSparseDist(TrainPipelineSparseDist[In, Out], upstream.EvalPipelineSparseDist[In, Out]):  # type: ignore[type-arg]  # generic through upstream's base; TorchRec is Any to mypy
    """EvalPipelineSparseDist on the engine: H2D(i+2) on the io thread || InputDist(i+1) || forward(i).

    Same constructor as upstream's, plus the engine's keyword-only options (``EngineOptions``). The
    default plan is ``catalog.eval_sparse_dist_plan(...)``: upstream's background DataLoadingThread is
    the plan's ``io`` thread group, which runs H2D (``next()``, then ``.to(device)`` on the
    memcpy stream) while the calling thread runs input dist and forward; ``thread_map`` can move it
    like any other task.

    As upstream: ``progress()`` returns the second element of ``model(batch)`` (no backward,
    no optimizer, no ``no_grad``, no ``model.eval()``); the loader binds the first iterator
    given, and later ones are ignored until ``reset()``; after the last batch every call raises
    StopIteration; a data loading error that says it is retriable skips the batch.

    Differences: batch 0's input dist is started once (upstream starts it twice and discards
    the first result); the loader appends each batch and its context to ``batches``/``contexts``
    when it loads it, so between calls they hold batches i+1 and i+2 (upstream: i+1).

    ``input_dist_cache_mb`` (ours; default None: off): evaluating the same held-out batches
    again reuses their input dist, kept from the first time under this many MiB per rank
    (``torchrec_swp.integrations.torchrec.input_dist_cache``: keyed by each batch's content,
    agreed by every rank; same outputs). ``input_dist_cache`` holds it (``stats()``); it
    outlives ``reset()``. Every rank must build its eval pipelines in the same order (the
    agreement's gloo group is made here, where ranks > 1).
    """

    def __init__(self, *args: Any, input_dist_cache_mb: float | None = None, **kwargs: Any) -> None:
        self.input_dist_cache: InputDistCache | None = None
        super().__init__(*args, **kwargs)
        if input_dist_cache_mb is not None:
            cache = InputDistCache.create(input_dist_cache_mb, type(self).__name__)
            if cache.group is not None:
                self._swp_teardown().group(cache.group)
            self.input_dist_cache = cache
            if (sync := self._swp_engine.exhaustion) is not None:
                sync.carry = cache.carry  # the ranks agree on reuse in the draw's agreement

    def _swp_default_plan(self) -> PipelinePlan:
        return self._swp_row_plan(clear_data_dist_inputs=self._clear_data_dist_inputs)

    def progress(self, dataloader_iter: Iterator[In]) -> Out:
        # the loader binds the first iterator given (until reset()), as upstream's loading thread:
        # later calls do not read theirs
        binds = self._swp_engine.draws is None
        self._swp_check_progress(dataloader_iter, read=binds)
        return self._swp_engine.step(dataloader_iter if binds else None)

    def start_sparse_data_dist(self, batch: In | None, context: Any) -> None:
        cache = self.input_dist_cache
        if cache is None or batch is None:
            super().start_sparse_data_dist(batch, context)
            return
        start = super().start_sparse_data_dist
        cache.start(self._pipelined_modules, self._pipelined_postprocs, context, lambda: start(batch, context))

    def wait_sparse_data_dist(self, context: Any) -> None:
        cache = self.input_dist_cache
        if cache is None:
            super().wait_sparse_data_dist(context)
            return
        cache.wait(context, lambda: super(EvalPipelineSparseDist, self).wait_sparse_data_dist(context))

    def reset(self) -> None:
        super().reset()
        self._swp_engine.forget_data()

    # ------------------------------------------------------------ task functions
    def _task_fetch(self, b: int, data: Iterator[In]) -> In:
        # upstream's DataLoadingThread's draw: a batch whose loading error says it is retriable
        # is skipped. StopIteration from the iterator is the end of data.
        while True:
            try:
                return next(data)
            except Exception as e:  # StopIteration too: it is not retriable
                if not _is_data_loading_retriable(e):
                    raise
                logger.warning("%s: retriable exception in data loading (skipping batch): %r", type(self).__name__, e)

    def _task_h2d(self, b: int, data: Iterator[In] | None = None, host: In | None = None) -> tuple[Any, Any]:
        # what upstream's DataLoadingThread does for one batch (the draw is Fetch's with loads=);
        # the engine has entered the memcpy stream.
        batch: Any = self._task_fetch(b, data) if data is not None else host
        context = self._create_context()
        if self.input_dist_cache is not None:
            self.input_dist_cache.mark(context, batch)  # the key of the batch as loaded, on the host
        batch = batch.to(self._device, non_blocking=True)
        self.batches.append(batch)
        self.contexts.append(context)
        return batch, context

    def _task_wait_batch(self, b: int, batch: Any, context: Any) -> None:
        with record_function("## wait_for_batch ##"):
            upstream._wait_for_batch(batch, self._data_dist_stream)

    def _task_forward(self, b: int, batch: Any, context: Any) -> tuple[Any, Any]:
        with record_function("## forward ##"):
            losses, output = self._model(batch)
        return losses, output
