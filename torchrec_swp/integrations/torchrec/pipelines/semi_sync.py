"""TrainPipelineSemiSync on the engine: two plans, one per phase, switched at ``start_batch``."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.autograd.profiler import record_function
from torchrec.distributed.train_pipeline import train_pipelines as upstream
from torchrec.distributed.train_pipeline.pipeline_context import EmbeddingTrainPipelineContext, In, Out
from torchrec.distributed.train_pipeline.runtime_forwards import EmbeddingPipelinedForward
from torchrec.distributed.train_pipeline.utils import _start_embedding_lookup, _wait_for_events
from torchrec.sparse.jagged_tensor import KeyedTensor

from torchrec_swp.engine import DEFAULT_TIMEOUT_S, STREAM_DEVICE_TYPES
from torchrec_swp.integrations.torchrec import plans
from torchrec_swp.integrations.torchrec.pipelines._driven import PlanLike
from torchrec_swp.integrations.torchrec.pipelines.sparse_dist import TrainPipelineSparseDist
from torchrec_swp.plan import PipelinePlan, ThreadMap

__all__ = ["TrainPipelineSemiSync"]

SYNC, SEMI_SYNC = "sync", "semi_sync"


class _EmbeddingPipelinedForward(EmbeddingPipelinedForward):
    """Upstream's EmbeddingPipelinedForward, also correct without a data-dist stream (CPU).

    Upstream falls back to ``torch.device("cuda")`` when it has no stream and then asks CUDA
    for its current stream; and it calls ``record_stream`` on the embeddings, which CPU tensors
    reject. Without a stream nothing changes streams: the device is the CPU and there is
    nothing to record. With a stream (CUDA, MTIA) this is upstream's class unchanged.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self._stream is None:
            self._device = torch.device("cpu")

    def detach_embeddings(self, embeddings: dict[str, Any] | KeyedTensor, cur_stream: Any) -> None:
        if self._stream is not None or not isinstance(embeddings, KeyedTensor):
            # upstream's path; for a dict of JaggedTensors it records no stream anyway
            super().detach_embeddings(embeddings, cur_stream)
            return
        # upstream's KeyedTensor branch without embeddings.record_stream(cur_stream)
        tensor = embeddings.values()
        detached = tensor.detach().requires_grad_()
        detached.retain_grad()
        embeddings._values = detached
        self._context.embedding_tensors.append([tensor])
        self._context.embedding_features.append([list(embeddings.keys())])
        self._context.detached_embedding_tensors.append([detached])


class TrainPipelineSemiSync(TrainPipelineSparseDist[In, Out], upstream.TrainPipelineSemiSync[In, Out]):
    """TrainPipelineSemiSync on the engine: H2D(i+3), InputDist(i+2), EmbLookup(i+1), fwd/bwd/opt(i).

    Same constructor as upstream's SemiSync (``start_batch``, ``stash_gradients``, ...), plus
    the keyword-only engine options of TrainPipelineSparseDist (``plan``, ``thread_map``,
    ``engine_timeout_s``).

    Two default plans, ``plans.semi_sync_plan(phase="sync")`` and ``(phase="semi_sync")``, with
    the same tasks and stages. Before each ``progress()`` the pipeline runs the plan of the
    batch it is about to forward, as upstream decides ``is_semi_sync`` per call from that
    batch's context index: below ``start_batch`` EmbLookup(i+1) follows the optimizer of batch
    i and a device synchronize() (the embeddings of i+1 see batch i's update); from
    ``start_batch`` on it is issued before Backward(i) (they see updates up to i-1). The
    gradient swap of ``stash_gradients`` and the skipped optimizer step at ``start_batch`` are
    decided per batch inside OptimizerStep, as upstream does. A ``plan=`` given by the user is
    run in both phases (no switching). ``thread_map`` applies to both default plans.

    Runs on CPU as shipped, where upstream fails: its embedding lookup and forward call
    ``record_stream`` on CPU tensors, and its pipelined forward asks CUDA for a stream. Here the
    lookup and forward pass no stream on a device without streams, and the pipelined forward is
    ``_EmbeddingPipelinedForward``. On CUDA/MTIA both are upstream's code paths.
    """

    _pipelined_forward_type = _EmbeddingPipelinedForward


    def __init__(
        self,
        *args: Any,
        plan: PlanLike | None = None,
        thread_map: ThreadMap | None = None,
        engine_timeout_s: float = DEFAULT_TIMEOUT_S,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, plan=plan, thread_map=thread_map, engine_timeout_s=engine_timeout_s, **kwargs)
        # The phase plans, or None when the user's plan runs throughout.
        self._swp_phase_plans: dict[str, PipelinePlan] | None = None
        if plan is None:
            phase_plans = {phase: self._swp_phase_plan(phase) for phase in (SYNC, SEMI_SYNC)}
            if thread_map is not None:
                phase_plans = {phase: p.with_thread_map(thread_map) for phase, p in phase_plans.items()}
            self._swp_phase_plans = phase_plans
        self._swp_phase = self._swp_phase_of(self._next_index)

    def _swp_phase_plan(self, phase: str) -> PipelinePlan:
        return plans.semi_sync_plan(
            phase=phase,
            # SemiSync's own copy never raises at the end of data; the in-place copy does
            execute_all_batches=self._execute_all_batches or not self._enable_inplace_copy_batch,
            clear_data_dist_inputs=self._clear_data_dist_inputs,
        )

    def _swp_default_plan(self) -> PipelinePlan:
        return self._swp_phase_plan(self._swp_phase_of(self._next_index))

    def _swp_phase_of(self, index: int | None) -> str:
        return SEMI_SYNC if index is not None and index >= self._start_batch else SYNC

    def progress(self, dataloader_iter: Iterator[In]) -> Out:
        if self._swp_phase_plans is not None:
            # the batch this call forwards: the oldest in flight, or the next one to be loaded
            index = self.contexts[0].index if self.contexts else self._next_index
            phase = self._swp_phase_of(index)
            if phase != self._swp_phase:
                self._swp_engine.switch_plan(self._swp_phase_plans[phase], self._swp_task_functions())
                self._swp_phase = phase
        return super().progress(dataloader_iter)

    # ------------------------------------------------- upstream helpers, CPU-safe
    def _swp_current_stream(self) -> torch.Stream | None:
        """The compute stream, or None on a device without streams (nothing to record there)."""
        if self._device.type in STREAM_DEVICE_TYPES:
            return torch.get_device_module(self._device).current_stream()
        return None

    def start_embedding_lookup(self, batch: In | None, context: EmbeddingTrainPipelineContext) -> None:
        """Upstream's start_embedding_lookup, with no target stream on a device without streams."""
        if batch is None:
            return
        with record_function(f"## start_embedding_lookup {context.index} ##"):
            current_stream = self._swp_current_stream()
            _wait_for_events(batch, context, current_stream)
            for module in self._pipelined_modules:
                _start_embedding_lookup(
                    module,
                    context,
                    source_stream=self._data_dist_stream,
                    target_stream=current_stream,
                    stream_context=self._stream_context,
                )
                event = torch.get_device_module(self._device).Event()
                event.record()
                context.events.append(event)

    def _mlp_forward(self, batch: In, context: Any) -> tuple[torch.Tensor, Out]:
        """Upstream's _mlp_forward, with no stream to record on a device without streams."""
        with record_function(f"## forward {context.index} ##"):
            _wait_for_events(batch, context, self._swp_current_stream())
            return self._model_fwd(batch)

    # ------------------------------------------------------------ task functions
    def _swp_task_functions(self) -> Mapping[str, Callable[..., Any]]:
        return {
            **super()._swp_task_functions(),
            "EmbLookup": self._task_emb_lookup,
            "EmbBackward": self._task_emb_backward,
            "Synchronize": self._task_synchronize,
        }

    def _task_input_dist_start(self, b: int, batch: Any, context: Any) -> None:
        if b == self._swp_engine.delivered:
            # the pipeline is (re)filling: upstream's fill_pipeline rewrites the model the first
            # time, starts input dist, and checks the optimizer holds no pipelined parameter
            self._init_pipelined_modules(batch, context, self._pipelined_forward_type)
            self._validate_optimizer()
        else:
            self.start_sparse_data_dist(batch, context)

    def _task_emb_lookup(self, b: int, batch: Any, context: Any) -> None:
        self.start_embedding_lookup(batch, context)

    def _task_forward(self, b: int, batch: Any, context: Any) -> tuple[Any, Any]:
        losses, output = self._mlp_forward(batch, context)
        return losses, output

    def _task_dequeue(self, b: int, context: Any) -> None:
        self.dequeue_batch()
        # upstream frees the cached postproc results of the batch as soon as it is forwarded
        del context.postproc_fwd_results

    def _task_backward(self, b: int, losses: torch.Tensor, context: Any) -> None:
        if self._model.training:
            with record_function(f"## backward {context.index or 0} ##"):
                torch.sum(losses, dim=0).backward()

    def _task_emb_backward(self, b: int, context: Any) -> None:
        if self._model.training:
            with record_function(f"## emb_backward {context.index or 0} ##"):
                self.embedding_backward(context)
            self.sync_embeddings(self._model, self._dmp_collection_sync_interval_batches, context)

    def _task_optimizer_step(self, b: int, context: Any) -> None:
        if self._model.training:
            iteration = context.index or 0
            with record_function(f"## optimizer {iteration - 1} ##"):
                if self._swp_phase_of(context.index) == SEMI_SYNC and self._stash_gradients:
                    self._grad_swap()
                self._mlp_optimizer_step(iteration)

    def _task_synchronize(self, b: int) -> None:
        # Upstream synchronizes the device before the next batch's lookup, and only when there
        # is a next batch. A device without streams runs everything in order already.
        if b + 1 < self._swp_engine.loaded and self._device.type in STREAM_DEVICE_TYPES:
            torch.get_device_module(self._device).synchronize()
