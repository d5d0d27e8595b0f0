"""TrainPipelineFusedSparseDist and EvalPipelineFusedSparseDist on the engine."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.autograd.profiler import record_function
from torchrec.distributed.train_pipeline import train_pipelines as upstream
from torchrec.distributed.train_pipeline.pipeline_context import EmbeddingTrainPipelineContext, In, Out
from torchrec.distributed.train_pipeline.utils import _start_embedding_lookup

from torchrec_swp.engine import DEFAULT_TIMEOUT_S, StreamPool, stream_pool_for
from torchrec_swp.integrations.torchrec import plans
from torchrec_swp.integrations.torchrec.pipelines._driven import PlanLike
from torchrec_swp.integrations.torchrec.pipelines.cpu_safe import InSyncEmbeddingForward
from torchrec_swp.integrations.torchrec.pipelines.sparse_dist import TrainPipelineSparseDist
from torchrec_swp.plan import DEFAULT_STREAM, PipelinePlan, ThreadMap

__all__ = ["EvalPipelineFusedSparseDist", "TrainPipelineFusedSparseDist"]

_EMB_LOOKUP_STREAMS = ("data_dist", "new", "current")
_UPSTREAM_FUSED_INIT = inspect.signature(upstream.TrainPipelineFusedSparseDist.__init__)


def _fused_options(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The arguments of upstream TrainPipelineFusedSparseDist's constructor for this call, by
    name, defaults filled in. Raises TypeError for a call upstream's constructor would reject."""
    bound = _UPSTREAM_FUSED_INIT.bind(None, *args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


class TrainPipelineFusedSparseDist(upstream.TrainPipelineFusedSparseDist[In, Out], TrainPipelineSparseDist[In, Out]):
    """TrainPipelineFusedSparseDist on the engine: EmbLookup(i) before ZeroGrad(i), overlapping the
    end of the previous optimizer step; H2D(i+2) and InputDist(i+1) as in TrainPipelineSparseDist.

    The default plan is ``plans.fused_sparse_dist_plan(...)`` with this pipeline's
    ``emb_lookup_stream``, ``embedding_lookup_after_data_dist``, ``enqueue_batch_after_forward``,
    ``execute_all_batches`` and ``clear_data_dist_inputs``.

    Like upstream, it assumes the tables are updated in backward (fused TBE, no feature
    processors): the lookup of batch i may overlap the dense optimizer step of batch i-1. The plan
    also orders EmbLookup(i) after Backward(i-1) on the device (an inter-iteration dependency),
    which upstream leaves to CPU submission order.

    Runs on CPU as shipped: its pipelined forward is ``cpu_safe.InSyncEmbeddingForward`` bound to
    the pipeline's device, and ``start_embedding_lookup`` records tensors on a stream only where
    the device has streams.
    """

    _pipelined_forward_type = InSyncEmbeddingForward

    _SWP_TASKS = (
        "EmbLookup",
        "ZeroGrad",
        "WaitBatch",
        "ClearDataDistInputs",
        "InputDistStart",
        "H2D",
        "Forward",
        "InputDistWait",
        "Backward",
        "OptimizerStep",
        "Dequeue",
    )

    def __init__(
        self,
        *args: Any,
        plan: PlanLike | None = None,
        thread_map: ThreadMap | None = None,
        engine_timeout_s: float = DEFAULT_TIMEOUT_S,
        **kwargs: Any,
    ) -> None:
        # The plan depends on options upstream does not keep (the emb_lookup_stream name), and our
        # TrainPipelineSparseDist's constructor, which runs inside upstream's, asks for it.
        self._swp_options = _fused_options(args, kwargs)
        if self._swp_options["emb_lookup_stream"] not in _EMB_LOOKUP_STREAMS:
            raise RuntimeError(f"Unknown emb_lookup_stream {self._swp_options['emb_lookup_stream']}")
        super().__init__(*args, **kwargs)
        self._pipelined_forward_type = InSyncEmbeddingForward.on(self._device)
        # Our TrainPipelineSparseDist's constructor built an engine before upstream's constructor
        # had created the emb_lookup stream; that engine never ran a task. Build the real one.
        self._swp_setup(self._swp_default_plan(), plan, thread_map, engine_timeout_s, self._swp_streams())

    def progress(self, dataloader_iter: Iterator[In]) -> Out:
        # upstream's hand-written progress() precedes ours in the MRO
        return TrainPipelineSparseDist.progress(self, dataloader_iter)

    def _swp_default_plan(self) -> PipelinePlan:
        o = self._swp_options
        return plans.fused_sparse_dist_plan(
            emb_lookup_stream=o["emb_lookup_stream"],
            embedding_lookup_after_data_dist=o["embedding_lookup_after_data_dist"],
            enqueue_batch_after_forward=o["enqueue_batch_after_forward"],
            execute_all_batches=o["execute_all_batches"],
            clear_data_dist_inputs=o["clear_data_dist_inputs"],
            name=type(self).__name__,
        )

    def _swp_streams(self) -> StreamPool:
        streams = {"memcpy": self._memcpy_stream, "data_dist": self._data_dist_stream}
        # absent while upstream's constructor is still running (see __init__)
        lookup = getattr(self, "_emb_lookup_stream", None)
        if self._swp_options["emb_lookup_stream"] == "new" and lookup is not None:
            streams["emb_lookup"] = lookup
        return stream_pool_for(self._device, streams)

    def start_embedding_lookup(self, batch: In | None, context: EmbeddingTrainPipelineContext) -> None:
        """Upstream's ``start_embedding_lookup``: wait for the input dist of ``batch`` and start
        its lookup and output dist on the emb_lookup stream.

        The looked-up KJTs are recorded on the engine's compute stream (upstream's current stream
        at ``progress()``) where the device has streams, and on none on CPU.
        """
        if batch is None:
            return
        with record_function(f"## start_embedding_lookup {context.index} ##"):
            compute_stream = self._swp_engine.streams.stream(DEFAULT_STREAM)
            with self._stream_context(self._emb_lookup_stream):  # type: ignore[arg-type]
                for module in self._pipelined_modules:
                    _start_embedding_lookup(
                        module,
                        context,
                        source_stream=self._data_dist_stream,
                        target_stream=compute_stream,
                        stream_context=self._stream_context,  # type: ignore[arg-type]
                    )

    # ------------------------------------------------------------ task functions
    def _swp_task_functions(self) -> Mapping[str, Callable[..., Any]]:
        return {**super()._swp_task_functions(), "EmbLookup": self._task_emb_lookup}

    def _task_emb_lookup(self, b: int, batch: Any, context: Any) -> None:
        self.start_embedding_lookup(batch, context)

    # Upstream's Fused progress() neither updates ``_state`` nor syncs 2D-sharded embeddings, and
    # steps the optimizer inline.
    def _task_forward(self, b: int, batch: Any, context: Any) -> tuple[Any, Any]:
        with record_function(f"## forward {context.index} ##"):
            losses, output = self._model_fwd(batch)
        return losses, output

    def _task_backward(self, b: int, losses: torch.Tensor, context: Any) -> None:
        if self._model.training:
            self._backward(losses)

    def _task_optimizer_step(self, b: int, context: Any) -> None:
        if self._model.training:
            with record_function("## optimizer ##"):
                self._optimizer.step()


class EvalPipelineFusedSparseDist(
    upstream.EvalPipelineFusedSparseDist[In, Out], TrainPipelineFusedSparseDist[In, Out]
):
    """EvalPipelineFusedSparseDist on the engine: TrainPipelineFusedSparseDist's schedule without
    backward or optimizer, forward under ``torch.no_grad()``.

    The default plan is ``plans.eval_fused_sparse_dist_plan(...)``. With
    ``enable_embedding_lookup_prefetch`` the lookup of batch i+1 follows its InputDistWait, in the
    call that forwards batch i. Like upstream, it does not call ``model.eval()``; it zeroes
    gradients when the model is in training mode and ignores ``enqueue_batch_after_forward``.
    """

    def __init__(self, *args: Any, enable_embedding_lookup_prefetch: bool = False, **kwargs: Any) -> None:
        # Upstream sets this after its parent's constructor, where our plan is already chosen.
        self._enable_embedding_lookup_prefetch = enable_embedding_lookup_prefetch
        super().__init__(*args, enable_embedding_lookup_prefetch=enable_embedding_lookup_prefetch, **kwargs)

    def progress(self, dataloader_iter: Iterator[In]) -> Out:
        # upstream's hand-written progress() precedes ours in the MRO
        return TrainPipelineSparseDist.progress(self, dataloader_iter)

    def _swp_default_plan(self) -> PipelinePlan:
        o = self._swp_options
        return plans.eval_fused_sparse_dist_plan(
            enable_embedding_lookup_prefetch=self._enable_embedding_lookup_prefetch,
            emb_lookup_stream=o["emb_lookup_stream"],
            embedding_lookup_after_data_dist=o["embedding_lookup_after_data_dist"],
            execute_all_batches=o["execute_all_batches"],
            clear_data_dist_inputs=o["clear_data_dist_inputs"],
        )

    def _task_forward(self, b: int, batch: Any, context: Any) -> tuple[Any, Any]:
        with record_function(f"## eval {context.index} ##"), torch.no_grad():
            losses, output = self._model_fwd(batch)
        return losses, output
