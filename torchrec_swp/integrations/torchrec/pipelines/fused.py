"""TrainPipelineFusedSparseDist and EvalPipelineFusedSparseDist on the engine."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torchrec.distributed.train_pipeline import train_pipelines as upstream
from torchrec.distributed.train_pipeline.pipeline_context import EmbeddingTrainPipelineContext, In, Out
from torchrec.distributed.types import Awaitable

from torchrec_swp.engine import StreamPool, stream_pool_for
from torchrec_swp.engine.labels import record_function
from torchrec_swp.integrations.torchrec.pipelines.cpu_safe import InSyncEmbeddingForward
from torchrec_swp.integrations.torchrec.pipelines.lookup_sync import start_embedding_lookup as _start_embedding_lookup
from torchrec_swp.integrations.torchrec.pipelines.protocol import task
from torchrec_swp.integrations.torchrec.pipelines.sparse_dist import TrainPipelineSparseDist
from torchrec_swp.integrations.torchrec.pipelines.training_tasks import TrainingTasks
from torchrec_swp.plan import DEFAULT_STREAM, PipelinePlan

__all__ = ["EvalPipelineFusedSparseDist", "LookupOutput", "TrainPipelineFusedSparseDist"]

_UPSTREAM_FUSED_INIT = inspect.signature(upstream.TrainPipelineFusedSparseDist.__init__)


def _emb_lookup_stream_option(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """The ``emb_lookup_stream`` a call passes to upstream Fused's constructor (by position or by
    name, else its default); upstream keeps only the stream, which on CPU is None for both
    "data_dist" and "new". Arguments of subclasses' constructors in ``kwargs`` are ignored."""
    params = _UPSTREAM_FUSED_INIT.parameters
    own = {k: v for k, v in kwargs.items() if k in params}
    bound = _UPSTREAM_FUSED_INIT.bind_partial(None, *args, **own)
    return bound.arguments.get("emb_lookup_stream", params["emb_lookup_stream"].default)


class LookupOutput(Awaitable[Any]):
    """The output of an embedding lookup started on ``stream``, waited for on that stream and
    handed to the stream that waits for it (an event wait and ``record_stream``).

    Why: upstream's in-sync forward waits for the output dist on the compute stream. That wait
    reads the lookup's output, which the lookup stream allocated, and frees it (the KeyedTensor
    is a new tensor, ``torch.cat`` of the shards' outputs); nothing records the compute stream on
    that block, and the lookup stream's next allocation (the next batch's InputDistWait, which
    does not wait for the compute stream) may be handed the block before the compute stream's
    ``cat`` ran. The CPU stream checker found it (``make stream-check``, docs/gpu_check.md).
    Here the wait and its ``cat`` run on the lookup stream, which allocated what they read; the
    result is recorded on the consumer's stream, which waits for an event recorded after them.
    Same ops, same values; the consumer waits for the lookup's output only, as before.
    """

    def __init__(
        self, inner: Awaitable[Any], stream: Any, stream_context: Callable[[Any], Any], device: torch.device
    ) -> None:
        super().__init__()
        self._inner, self._stream, self._stream_context, self._device = inner, stream, stream_context, device

    def _wait_impl(self) -> Any:
        consumer = torch.get_device_module(self._device).current_stream()
        with self._stream_context(self._stream):
            out = self._inner.wait()
            done = self._stream.record_event()
        consumer.wait_event(done)
        if isinstance(out, dict):
            for jt in out.values():
                jt.record_stream(consumer)
        else:
            out.record_stream(consumer)
        return out


class TrainPipelineFusedSparseDist(TrainPipelineSparseDist[In, Out], upstream.TrainPipelineFusedSparseDist[In, Out]):  # type: ignore[type-arg]  # generic through upstream's base; TorchRec is Any to mypy
    """TrainPipelineFusedSparseDist on the engine: EmbLookup(i) first, overlapping the end of the
    previous optimizer step; H2D(i+2) and InputDist(i+1) as in TrainPipelineSparseDist.

    Same constructor as upstream's, plus the engine's keyword-only options (``EngineOptions``). The
    default plan is ``catalog.fused_sparse_dist_plan(...)`` with this pipeline's
    ``emb_lookup_stream``, ``embedding_lookup_after_data_dist``, ``enqueue_batch_after_forward``,
    ``execute_all_batches`` and ``clear_data_dist_inputs``. As upstream's: no ``_state`` updates, no
    2D-sharding embedding sync, the optimizer stepped inline.

    Like upstream, it assumes the tables are updated in backward (fused TBE, no feature
    processors): the lookup of batch i may overlap the dense optimizer step of batch i-1. The
    plan also orders EmbLookup(i) after Backward(i-1) on the device (an inter-iteration
    dependency), which upstream leaves to CPU submission order.

    Runs on CPU as shipped, where upstream fails: its pipelined forward is
    ``cpu_safe.InSyncEmbeddingForward`` bound to the pipeline's device, and
    ``start_embedding_lookup`` records tensors on a stream only where the device has streams.
    """

    _pipelined_forward_type = InSyncEmbeddingForward

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._swp_emb_lookup_stream = _emb_lookup_stream_option(args, kwargs)
        super().__init__(*args, **kwargs)
        self._pipelined_forward_type = InSyncEmbeddingForward.on(self._device)

    def _swp_default_plan(self) -> PipelinePlan:
        return self._swp_row_plan(
            emb_lookup_stream=self._swp_emb_lookup_stream,
            embedding_lookup_after_data_dist=self._embedding_lookup_after_data_dist,
            enqueue_batch_after_forward=self._enqueue_batch_after_forward,
            execute_all_batches=self._execute_all_batches,
            clear_data_dist_inputs=self._clear_data_dist_inputs,
            name=type(self).__name__,
        )

    def _swp_streams(self) -> StreamPool:
        streams = {"memcpy": self._memcpy_stream, "data_dist": self._data_dist_stream}
        if self._swp_emb_lookup_stream == "new":
            streams["emb_lookup"] = self._emb_lookup_stream
        lookup = {"data_dist": "data_dist", "new": "emb_lookup", "current": DEFAULT_STREAM}[self._swp_emb_lookup_stream]
        attributes = {"_memcpy_stream": "memcpy", "_data_dist_stream": "data_dist", "_emb_lookup_stream": lookup}
        return self._swp_checked(stream_pool_for(self._device, streams), attributes)

    def start_embedding_lookup(self, batch: In | None, context: EmbeddingTrainPipelineContext) -> None:
        """Upstream's ``start_embedding_lookup``: wait for the input dist of ``batch`` and start
        its lookup and output dist on the emb_lookup stream.

        The looked-up KJTs are recorded on the engine's compute stream (upstream: the current
        stream, which is the compute stream when upstream's progress() runs) where the device
        has streams, and on none on CPU. Where it has streams, each module's output request
        becomes a ``LookupOutput``: the forward waits for it on the lookup stream (upstream
        waits on the compute stream, see ``LookupOutput``).
        """
        if batch is None:
            return
        with record_function(f"## start_embedding_lookup {context.index} ##"):
            compute_stream = self._swp_compute_stream()
            with self._stream_context(self._emb_lookup_stream):
                for module in self._pipelined_modules:
                    _start_embedding_lookup(
                        module,
                        context,
                        source_stream=self._data_dist_stream,
                        target_stream=compute_stream,
                        stream_context=self._stream_context,
                    )
            if self._swp_engine.streams.has_streams and self._emb_lookup_stream is not None:
                requests = context.embedding_a2a_requests
                for name, request in requests.items():
                    if isinstance(request, Awaitable):  # not an MC module's (embeddings, kjts) pair
                        requests[name] = LookupOutput(
                            request, self._emb_lookup_stream, self._stream_context, self._device
                        )

    # ------------------------------------------------------------ task functions
    @task("EmbLookup")
    def _task_emb_lookup(self, b: int, batch: Any, context: Any) -> None:
        self.start_embedding_lookup(batch, context)

    def _task_forward(self, b: int, batch: Any, context: Any) -> tuple[Any, Any]:
        with record_function(f"## forward {context.index} ##"):
            losses, output = self._model_fwd(batch)
        return losses, output

    # upstream's Fused: backward without the 2D embedding sync, the optimizer stepped inline
    _task_backward = TrainingTasks._task_backward
    _task_optimizer_step = TrainingTasks._task_optimizer_step


class EvalPipelineFusedSparseDist(TrainPipelineFusedSparseDist[In, Out], upstream.EvalPipelineFusedSparseDist[In, Out]):  # type: ignore[type-arg]  # generic through upstream's base; TorchRec is Any to mypy
    """EvalPipelineFusedSparseDist on the engine: TrainPipelineFusedSparseDist's schedule without
    backward or optimizer, forward under ``torch.no_grad()``.

    Same constructor as upstream's (``enable_embedding_lookup_prefetch`` and Fused's arguments),
    plus the engine options. The default plan is ``catalog.eval_fused_sparse_dist_plan(...)``; with
    ``enable_embedding_lookup_prefetch`` the lookup of batch i+1 follows its InputDistWait, in
    the call that forwards batch i. As upstream: it does not call ``model.eval()``, zeroes
    gradients when the model is in training mode, returns the second element of what the model
    (or ``custom_model_fwd``) returns, and ignores ``enqueue_batch_after_forward``.
    """

    def _swp_default_plan(self) -> PipelinePlan:
        return self._swp_row_plan(
            enable_embedding_lookup_prefetch=self._enable_embedding_lookup_prefetch,
            emb_lookup_stream=self._swp_emb_lookup_stream,
            embedding_lookup_after_data_dist=self._embedding_lookup_after_data_dist,
            execute_all_batches=self._execute_all_batches,
            clear_data_dist_inputs=self._clear_data_dist_inputs,
        )

    def _task_forward(self, b: int, batch: Any, context: Any) -> tuple[Any, Any]:
        with record_function(f"## eval {context.index} ##"), torch.no_grad():
            losses, output = self._model_fwd(batch)
        return losses, output
